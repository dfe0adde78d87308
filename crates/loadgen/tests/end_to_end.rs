//! End to end: the compare smoke path with inferlb in-process, and runs against a simulator.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use loadgen::arrival::Arrival;
use loadgen::client::RequestOptions;
use loadgen::compare::{compare, CompareConfig};
use loadgen::router::{builtin, InProcessRouter, InProcessStart, Launcher, Policy};
use loadgen::runner::{run, RunConfig};
use loadgen::workload::{Workload, WorkloadSpec};

/// Starts inferlb in this process on 127.0.0.1:0 from the generated config text.
fn in_process() -> InProcessStart {
    Arc::new(|text: String| {
        Box::pin(async move {
            let config = inferlb::config::Config::from_toml(&text, "generated")
                .map_err(|e| e.to_string())?;
            let main = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .map_err(|e| e.to_string())?;
            let url = format!("http://{}", main.local_addr().map_err(|e| e.to_string())?);
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let task = tokio::spawn(inferlb::run(
                config,
                inferlb::Listeners { main, admin: None },
                async move {
                    let _ = rx.await;
                },
            ));
            Ok(InProcessRouter {
                url,
                stop: Box::pin(async move {
                    let _ = tx.send(());
                    let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
                }),
            })
        })
    })
}

/// A compare of `policies` on `workload` with the tests' fixed settings (2 backends, time
/// scale 20, closed loop, in-process routers writing into `dir`); tests change fields with
/// struct update syntax.
fn compare_config(
    name: &str,
    workload: WorkloadSpec,
    policies: Vec<Policy>,
    dir: &tempfile::TempDir,
) -> CompareConfig {
    CompareConfig {
        name: name.into(),
        workload,
        seed: 5,
        backends: 2,
        block_size: 16,
        num_gpu_blocks: None,
        sizing_tokens: 512,
        max_num_seqs: 256,
        time_scale: 20.0,
        arrival: Arrival::Closed { concurrency: 2 },
        max_requests: Some(16),
        duration: Duration::from_secs(600),
        think_time: Duration::ZERO,
        policies,
        launcher: Launcher::InProcess(in_process()),
        results_dir: dir.path().to_path_buf(),
        ready_timeout: Duration::from_secs(10),
        drain_timeout: Duration::from_secs(20),
        progress: false,
        session_header: None,
        adapters: Vec::new(),
        max_loras: 1,
        sim_tokenizer: None,
        sim_kv_events: false,
        slo: None,
        trace_dir: None,
        prefill_backends: Default::default(),
    }
}

/// Mixed-adapter traffic: simulators serving adapters, every request for one of them, loads
/// counted per policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_mixed_adapters_reports_lora_loads() {
    let dir = tempfile::tempdir().unwrap();
    let workload = WorkloadSpec::Unique {
        prompt_tokens: 32,
        output_tokens: 8,
        prompt_tokens_max: 0,
        output_tokens_max: 0,
    };
    let cfg = CompareConfig {
        arrival: Arrival::Closed { concurrency: 4 },
        max_requests: Some(24),
        session_header: Some("x-session-id".into()),
        adapters: vec!["a0".into(), "a1".into(), "a2".into()],
        ..compare_config("adapters", workload, vec![builtin("random").unwrap()], &dir)
    };
    let out = compare(cfg).await.unwrap();
    let row = &out.rows[0];
    let s = row.summary.as_ref().unwrap_or_else(|| panic!("{row:?}"));
    assert_eq!(s.ok, 24, "{:?}", s.errors);
    let loads = row.lora_loads.unwrap();
    assert!(
        (2..=24).contains(&loads),
        "every request needs an adapter: {loads}"
    );
    assert!(out.markdown().contains("LoRA adapter loads"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_smoke_runs_two_policies_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let workload = WorkloadSpec::SharedPrefix {
        groups: 2,
        prompts: 8,
        system_tokens: 96,
        question_tokens: 16,
        output_tokens: 8,
        zipf: 0.0,
    };
    let policies = vec![builtin("random").unwrap(), builtin("default").unwrap()];
    let cfg = CompareConfig {
        sizing_tokens: 2 * 96,
        trace_dir: Some(dir.path().to_path_buf()),
        ..compare_config("smoke", workload, policies, &dir)
    };
    let out = compare(cfg).await.unwrap();
    assert_eq!(out.rows.len(), 2);
    // Each policy's trace: one line per request, with the simulator's usage and the router's
    // backend, times in simulated seconds.
    for policy in ["random", "default"] {
        let path = dir.path().join(format!("smoke-{policy}.trace.jsonl"));
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 16, "{policy}: {text}");
        let mut cached = 0;
        for l in &lines {
            assert!(l["group"].as_u64().unwrap() < 2, "{l}");
            assert!(l["backend"].is_string(), "{l}");
            assert!(l["ttft"].as_f64().unwrap() > 0.0, "{l}");
            assert!(
                l["e2e"].as_f64().unwrap() >= l["ttft"].as_f64().unwrap(),
                "{l}"
            );
            assert!(l["sent_at"].as_f64().unwrap() >= 0.0, "{l}");
            let prompt = l["prompt_tokens"].as_u64().unwrap();
            let hit = l["cached_tokens"].as_u64().unwrap();
            assert!(prompt > 96 && hit <= prompt, "{l}");
            cached += hit;
        }
        assert!(cached > 0, "{policy}: the shared prefixes hit somewhere");
    }
    for row in &out.rows {
        let s = row.summary.as_ref().unwrap_or_else(|| panic!("{row:?}"));
        assert_eq!(s.ok, 16, "{}: {:?}", row.policy, s.errors);
        assert_eq!(s.error_count(), 0);
        assert!(s.ttft.p50 > 0.0 && s.output_tokens == 16 * 8);
        let fleet = s.fleet.as_ref().unwrap();
        assert_eq!(fleet.backends, 2);
        assert!(fleet.prefix_cache_queries > 0.0);
        // Each queried backend's own hit rate, and the fleet's lies between them (it is
        // their query-weighted mean).
        let rates: Vec<f64> = fleet.hit_rate_by_backend.values().copied().collect();
        assert!(!rates.is_empty(), "{fleet:?}");
        assert!(rates.iter().all(|r| (0.0..=1.0).contains(r)), "{fleet:?}");
        let (lo, hi) = rates
            .iter()
            .fold((1.0f64, 0.0f64), |(lo, hi), r| (lo.min(*r), hi.max(*r)));
        assert!(
            lo - 1e-9 <= fleet.hit_rate && fleet.hit_rate <= hi + 1e-9,
            "{fleet:?}"
        );
        // The router names the backend of every request.
        assert_eq!(s.backend_share_header.values().sum::<f64>().round(), 1.0);
    }
    let max = out.max_hit_rate.unwrap();
    assert!(max > 0.4, "max achievable hit rate {max}");
    let default = out.row("default").unwrap();
    let hit = default.fleet.as_ref().unwrap().hit_rate;
    let random = out.row("random").unwrap().fleet.as_ref().unwrap().hit_rate;
    assert!(hit <= max + 1e-9, "hit rate {hit} above the bound {max}");
    // The same requests under random routing: each backend's cache holds about one group's
    // prefix, so random placement keeps evicting. Random reaches the default's hits only if
    // every one of the 14 repeats lands where its group lives (~2 × 2^-14 when the default is
    // at the bound), so `hit > random` fails on broken affinity, not on bad luck.
    assert!(
        hit > random,
        "the default profile (hit rate {hit}) did no better than random ({random}); bound {max}"
    );
    let table = out.table();
    assert!(
        table.contains("random") && table.contains("default"),
        "{table}"
    );
    assert!(out.markdown().starts_with("| policy |"));
}

fn direct_run(url: &str, arrival: Arrival, workload: &Workload, metrics: Vec<String>) -> RunConfig {
    RunConfig {
        label: "direct".into(),
        keep_messages: true,
        target: url.into(),
        request: RequestOptions {
            model: vllm_sim::config::DEFAULT_MODEL.into(),
            stream: true,
            backend_header: "x-inferlb-backend".into(),
            ..Default::default()
        },
        arrival,
        max_requests: workload.natural_requests(),
        duration: Duration::from_secs(60),
        drain_timeout: Duration::from_secs(20),
        think_time: Duration::from_millis(1),
        request_timeout: Duration::from_secs(30),
        backend_metrics: metrics,
        sample_interval: Duration::from_millis(20),
        progress: false,
        seed: 3,
        time_scale: 1.0,
        block_size: 16,
        tokens: Default::default(),
        slo: None,
        trace: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_turn_resends_answers_and_hits_the_cache_in_both_loops() {
    let spec = WorkloadSpec::MultiTurn {
        conversations: 3,
        turns: 3,
        system_tokens: 64,
        user_tokens: 16,
        output_tokens: 12,
    };
    let workload = Arc::new(Workload::new(spec, 3));
    for arrival in [
        Arrival::Closed { concurrency: 2 },
        Arrival::Poisson { rate: 400.0 },
    ] {
        let sim = vllm_sim::spawn(vllm_sim::SimConfig {
            time_scale: 50.0,
            ..Default::default()
        })
        .await
        .unwrap();
        let cfg = direct_run(&sim.url(), arrival.clone(), &workload, vec![sim.url()]);
        let out = run(cfg, Arc::clone(&workload)).await.unwrap();
        let s = &out.summary;
        assert_eq!(s.ok, 9, "{arrival:?}: {:?}", s.errors);
        assert_eq!(s.output_tokens, 9 * 12);
        assert!(s.itl.count > 0);
        // Turns of one conversation went out in order.
        for conv in 0..3u64 {
            let turns: Vec<u32> = out
                .sent
                .iter()
                .filter(|(c, _)| *c == conv)
                .map(|(_, t)| *t)
                .collect();
            assert_eq!(turns, vec![0, 1, 2], "{arrival:?}");
            // The messages kept for --dump-requests are the ones sent: each later turn
            // carries the conversation so far, the server's answers included.
            let kept: Vec<&Vec<_>> = out
                .messages
                .iter()
                .filter(|k| k.session == conv)
                .map(|k| &k.messages)
                .collect();
            assert_eq!(kept.len(), 3, "{arrival:?}");
            for (t, m) in kept.iter().enumerate() {
                // system, then (user, assistant) per earlier turn, then this turn's user
                assert_eq!(m.len(), 2 + 2 * t, "{arrival:?} turn {t}");
                assert_eq!(&m[..m.len() - 1], &kept[2][..m.len() - 1]);
            }
            assert_eq!(kept[2][2].role, "assistant");
            assert!(!kept[2][2].content.is_empty());
        }
        // The simulator names no backend, so no request records one.
        assert!(out.messages.iter().all(|k| k.backend.is_none()));
        // One backend with a big cache reaches the infinite-cache bound exactly, which it
        // can only do if the history (answers included) was re-sent verbatim.
        let fleet = s.fleet.as_ref().unwrap();
        let bound = s.max_hit.unwrap();
        assert_eq!(fleet.prefix_cache_queries as u64, bound.prompt_tokens);
        assert_eq!(fleet.prefix_cache_hits as u64, bound.max_hit_tokens);
        assert!((s.hit_rate_vs_max.unwrap() - 1.0).abs() < 1e-9);
        // The run ends when the last turn does, not at the 60 s limit.
        assert!(s.duration_s < 20.0, "{arrival:?} ran {} s", s.duration_s);
        sim.shutdown().await;
    }
}

/// `--dump-requests` keeps, with each request, the answer's value of the backend header (here
/// a header the simulator does send, standing in for a router's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_requests_carry_the_answers_backend_header() {
    let spec = WorkloadSpec::MultiTurn {
        conversations: 2,
        turns: 2,
        system_tokens: 32,
        user_tokens: 8,
        output_tokens: 4,
    };
    let workload = Arc::new(Workload::new(spec, 5));
    let sim = vllm_sim::spawn(vllm_sim::SimConfig {
        time_scale: 50.0,
        ..Default::default()
    })
    .await
    .unwrap();
    let mut cfg = direct_run(
        &sim.url(),
        Arrival::Closed { concurrency: 2 },
        &workload,
        vec![],
    );
    cfg.request.backend_header = "content-type".into();
    let out = run(cfg, Arc::clone(&workload)).await.unwrap();
    assert_eq!(out.summary.ok, 4, "{:?}", out.summary.errors);
    assert_eq!(out.messages.len(), 4);
    for kept in &out.messages {
        let backend = kept.backend.as_deref().unwrap_or("none");
        assert!(backend.starts_with("text/event-stream"), "{backend}");
    }
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_turns_end_their_conversation_without_stalling_the_open_loop() {
    let spec = WorkloadSpec::MultiTurn {
        conversations: 6,
        turns: 4,
        system_tokens: 32,
        user_tokens: 8,
        output_tokens: 4,
    };
    let workload = Arc::new(Workload::new(spec, 4));
    let sim = vllm_sim::spawn(vllm_sim::SimConfig {
        time_scale: 50.0,
        fail_rate: 0.5,
        ..Default::default()
    })
    .await
    .unwrap();
    let cfg = direct_run(
        &sim.url(),
        Arrival::Poisson { rate: 300.0 },
        &workload,
        Vec::new(),
    );
    let out = run(cfg, workload).await.unwrap();
    let s = &out.summary;
    assert!(s.errors.get("http_500").copied().unwrap_or(0) > 0, "{s:?}");
    assert_eq!(s.ok + s.error_count(), s.requests);
    assert!(
        s.requests < 24,
        "failed conversations must stop: {}",
        s.requests
    );
    assert!(
        s.duration_s < 20.0,
        "stalled until the limit: {} s",
        s.duration_s
    );
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_sends_until_the_deadline_not_the_drain_timeout() {
    let sim = vllm_sim::spawn(vllm_sim::SimConfig {
        instant: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let workload = Arc::new(Workload::new(
        WorkloadSpec::Unique {
            prompt_tokens: 8,
            output_tokens: 2,
            prompt_tokens_max: 0,
            output_tokens_max: 0,
        },
        1,
    ));
    let mut cfg = direct_run(
        &sim.url(),
        Arrival::Closed { concurrency: 4 },
        &workload,
        Vec::new(),
    );
    cfg.max_requests = None;
    cfg.duration = Duration::from_millis(1500);
    // A long drain timeout: a run that waited for it would last at least 31.5 s, one that
    // ends when its last request does lasts ~1.5 s (an instant backend). 15 s is far from
    // both, so a loaded machine cannot flip the answer.
    cfg.drain_timeout = Duration::from_secs(30);
    let out = run(cfg, workload).await.unwrap();
    let s = &out.summary;
    assert_eq!(s.error_count(), 0, "{:?}", s.errors);
    assert!(
        s.duration_s >= 1.5 && s.duration_s < 15.0,
        "{}",
        s.duration_s
    );
    sim.shutdown().await;
}

/// A run of `requests` tiny unique prompts against a port nothing listens on.
fn unreachable_run(requests: u64) -> (RunConfig, Arc<Workload>) {
    let port = loadgen::router::free_port().unwrap();
    let workload = Arc::new(Workload::new(
        WorkloadSpec::Unique {
            prompt_tokens: 8,
            output_tokens: 2,
            prompt_tokens_max: 0,
            output_tokens_max: 0,
        },
        1,
    ));
    let mut cfg = direct_run(
        &format!("http://127.0.0.1:{port}"),
        Arrival::Closed { concurrency: 2 },
        &workload,
        Vec::new(),
    );
    cfg.max_requests = Some(requests);
    (cfg, workload)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_target_is_counted_not_fatal_and_the_run_ends() {
    let (cfg, workload) = unreachable_run(5);
    let out = run(cfg, workload).await.unwrap();
    assert_eq!(out.summary.ok, 0);
    assert_eq!(out.summary.errors.get("connect"), Some(&5));
}

/// A trace that cannot be written fails the run before anything is sent, and a failed request
/// still gets its trace line (with its error, no TTFT).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_path_that_cannot_be_written_fails_the_run_at_once() {
    let (mut cfg, workload) = unreachable_run(3);
    let dir = tempfile::tempdir().unwrap();
    cfg.trace = Some(dir.path().join("missing-dir").join("trace.jsonl"));
    let err = run(cfg.clone(), Arc::clone(&workload)).await.unwrap_err();
    assert!(err.to_string().contains("trace"), "{err}");
    cfg.trace = Some(dir.path().join("trace.jsonl"));
    let out = run(cfg, workload).await.unwrap();
    assert_eq!(out.summary.errors.get("connect"), Some(&3));
    let text = std::fs::read_to_string(dir.path().join("trace.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(lines
        .iter()
        .all(|l| l["error"] == "connect" && l["ttft"].is_null()));
}

/// Whole prompts sent again and a cache small enough to preempt: every hit rate measured —
/// vLLM's counter and the once-per-request one — stays at or under the bound, in a run that
/// really did preempt and repeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn measured_hit_rate_never_exceeds_the_bound_with_repeats_and_preemption() {
    let spec = WorkloadSpec::SharedPrefix {
        groups: 2,
        prompts: 3,
        system_tokens: 96,
        question_tokens: 32,
        output_tokens: 48,
        zipf: 0.0,
    };
    let workload = Arc::new(Workload::new(spec, 7));
    // Each request needs ~11 blocks of 16 tokens by its end; 8 at once need ~90 and there
    // are 40: running requests are preempted and come back.
    let sim = vllm_sim::spawn(vllm_sim::SimConfig {
        time_scale: 50.0,
        block_size: 16,
        num_gpu_blocks: 40,
        ..Default::default()
    })
    .await
    .unwrap();
    let mut cfg = direct_run(
        &sim.url(),
        Arrival::Closed { concurrency: 8 },
        &workload,
        vec![sim.url()],
    );
    // Four passes over the 6 prompts: every prompt is sent again three times.
    cfg.max_requests = Some(24);
    let out = run(cfg, Arc::clone(&workload)).await.unwrap();
    let s = &out.summary;
    assert_eq!(s.ok, 24, "{:?}", s.errors);
    let fleet = s.fleet.as_ref().unwrap();
    let bound = s.max_hit.unwrap();
    assert!(fleet.preemptions > 0.0, "the run must preempt: {fleet:?}");
    assert!(
        bound.max_hit_tokens > bound.prefix_only_hit_tokens,
        "whole-prompt repeats must count in the bound: {bound:?}"
    );
    let per_request = fleet.hit_rate_per_request.unwrap();
    eprintln!(
        "bound {:.3} (prefix only {:.3}); vLLM counter {:.3}, per request {per_request:.3}; \
         {} preemptions",
        bound.rate(),
        bound.prefix_only_rate(),
        fleet.hit_rate,
        fleet.preemptions
    );
    assert!(
        fleet.hit_rate <= bound.rate() + 1e-9,
        "vLLM's counter {} above the bound {}",
        fleet.hit_rate,
        bound.rate()
    );
    assert!(
        per_request <= bound.rate() + 1e-9,
        "once per request {per_request} above the bound {}",
        bound.rate()
    );
    assert!(s.hit_rate_vs_max.unwrap() <= 1.0 + 1e-9);
    // The two figures agree on what was sent: every prompt token counted once.
    assert_eq!(fleet.prompt_tokens as u64, bound.prompt_tokens);
    assert_eq!(fleet.prefix_cache_queries as u64, bound.prompt_tokens);
    sim.shutdown().await;
}

/// A policy on a prefill/decode fleet (`prefill_backends`) beside a colocated one: both run
/// the workload without errors, the P/D router sends long prompts in two steps (its prefill
/// simulator computes prompts, the decode ones pull them), and goodput is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_runs_a_disaggregated_layout_and_reports_goodput() {
    let dir = tempfile::tempdir().unwrap();
    let workload = WorkloadSpec::Unique {
        prompt_tokens: 200,
        output_tokens: 8,
        prompt_tokens_max: 400,
        output_tokens_max: 16,
    };
    let policies = vec![
        builtin("default").unwrap(),
        Policy::Inferlb {
            name: "1p2d".into(),
            fragment: "[pd]\nenabled = true\nthreshold_tokens = 64\n".into(),
            bin: None,
        },
    ];
    let cfg = CompareConfig {
        backends: 3,
        num_gpu_blocks: Some(4096),
        max_requests: Some(12),
        // Generous objectives: every request is good.
        slo: Some(loadgen::report::Slo {
            ttft: 60.0,
            tpot: 60.0,
        }),
        prefill_backends: [("1p2d".to_string(), 1)].into_iter().collect(),
        ..compare_config("pd", workload, policies, &dir)
    };
    let out = compare(cfg).await.unwrap();
    assert_eq!(out.rows.len(), 2);
    for row in &out.rows {
        let s = row.summary.as_ref().unwrap_or_else(|| panic!("{row:?}"));
        assert_eq!(s.error_count(), 0, "{}: {:?}", row.policy, s.errors);
        assert_eq!(s.ok, 12);
        // Generous objectives: every request is good.
        assert!(s.goodput_per_s.unwrap() > 0.0, "{}", row.policy);
        assert_eq!(s.tpot.count, 12);
    }
    let shares = |i: usize| {
        out.rows[i]
            .summary
            .as_ref()
            .unwrap()
            .backend_share_header
            .clone()
    };
    // The header names the backend that answered: the decode ones only, on the P/D fleet.
    assert_eq!(shares(0).len(), 3, "{:?}", shares(0));
    assert_eq!(shares(1).len(), 2, "{:?}", shares(1));
    let md = out.markdown();
    assert!(md.contains("1p2d: 1 prefill + 2 decode simulators"), "{md}");
    assert!(
        md.contains("goodput = requests per simulated second"),
        "{md}"
    );
}
