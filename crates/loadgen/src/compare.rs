//! `loadgen compare`: one seeded workload against a fresh simulated fleet per routing policy,
//! summarised as one table.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use std::collections::BTreeMap;

use serde::Serialize;
use vllm_sim::config::KvRole;
use vllm_sim::SimConfig;

use crate::arrival::Arrival;
use crate::client::RequestOptions;
use crate::report::{secs, Slo, Summary};
use crate::router::{self, Launcher, Policy};
use crate::runner::{self, RunConfig};
use crate::workload::{Tokens, Workload, WorkloadSpec};

/// Fraction of the fleet's KV cache the workload's prefixes should need (llm-d's 73%).
pub const CACHE_FRACTION: f64 = 0.73;

/// Everything one comparison needs. Rates, durations and think time are in *simulated*
/// time; the simulators run `time_scale` times faster than real time.
#[derive(Clone)]
pub struct CompareConfig {
    pub name: String,
    pub workload: WorkloadSpec,
    pub seed: u64,
    pub backends: usize,
    pub block_size: usize,
    /// KV blocks per backend; `None`: sized from `sizing_tokens` (see [`blocks_for`]).
    pub num_gpu_blocks: Option<usize>,
    /// Tokens the sizing formula must fit in `CACHE_FRACTION` of the fleet.
    pub sizing_tokens: usize,
    pub max_num_seqs: usize,
    pub time_scale: f64,
    pub arrival: Arrival,
    pub max_requests: Option<u64>,
    /// Simulated-time limit for sending.
    pub duration: Duration,
    pub think_time: Duration,
    pub policies: Vec<Policy>,
    pub launcher: Launcher,
    pub results_dir: PathBuf,
    pub ready_timeout: Duration,
    /// Wall-clock time allowed to in-flight requests after sending stops.
    pub drain_timeout: Duration,
    pub progress: bool,
    /// `--sim-tokenizer`: the simulators tokenize with this Hugging Face model directory (and
    /// the bound and the cache sizing count its tokens).
    pub sim_tokenizer: Option<PathBuf>,
    /// `--sim-kv-events`: every simulator publishes KV-cache events on a free port (see its
    /// `/kv_event_sources`).
    pub sim_kv_events: bool,
    /// Sent as each request's session id header (session affinity).
    pub session_header: Option<String>,
    /// Mixed-adapter traffic: the simulators serve these LoRA adapters (`--lora-modules`) with
    /// `max_loras` slots, and each session asks for one of them.
    pub adapters: Vec<String>,
    pub max_loras: usize,
    /// Goodput objective in simulated seconds.
    pub slo: Option<Slo>,
    /// Write each policy's per-request trace (`runner::RunConfig::trace`) to
    /// `<dir>/<name>-<policy>.trace.jsonl`.
    pub trace_dir: Option<PathBuf>,
    /// Policy name → how many of its simulators run in the `prefill` role (the rest `decode`);
    /// policies not named get a fleet of `both`.
    pub prefill_backends: BTreeMap<String, usize>,
}

/// KV blocks per backend so that `tokens` fill `fraction` of `backends` caches:
/// `ceil(tokens / fraction / backends / block_size)`.
pub fn blocks_for(tokens: usize, fraction: f64, backends: usize, block_size: usize) -> usize {
    let per_backend = tokens as f64 / fraction / backends.max(1) as f64;
    (per_backend / block_size.max(1) as f64).ceil().max(1.0) as usize
}

/// One policy's result (or why it has none).
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub policy: String,
    pub summary: Option<Summary>,
    pub failure: Option<String>,
    /// Mixed-adapter runs: LoRA adapter loads over the fleet (`/sim/stats` `lora_loads`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lora_loads: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompareOutput {
    pub name: String,
    pub workload: WorkloadSpec,
    pub seed: u64,
    pub backends: usize,
    pub num_gpu_blocks: usize,
    pub block_size: usize,
    pub time_scale: f64,
    pub arrival: Arrival,
    /// The bound: one unlimited cache keeping every prompt and answer (repeats hit entirely).
    pub max_hit_rate: Option<f64>,
    /// Shared prefixes alone, each missing once (not a bound when whole prompts repeat).
    pub prefix_only_hit_rate: Option<f64>,
    pub slo: Option<Slo>,
    pub prefill_backends: BTreeMap<String, usize>,
    pub rows: Vec<Row>,
}

/// Runs every policy in turn: cold fleet, router, workload, stop.
pub async fn compare(cfg: CompareConfig) -> std::io::Result<CompareOutput> {
    std::fs::create_dir_all(&cfg.results_dir)?;
    let blocks = cfg.num_gpu_blocks.unwrap_or_else(|| {
        blocks_for(
            cfg.sizing_tokens,
            CACHE_FRACTION,
            cfg.backends,
            cfg.block_size,
        )
    });
    let kv_events_config = if cfg.sim_kv_events {
        let json = r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:0","replay_endpoint":"tcp://*:0","topic":"kv"}"#;
        Some(vllm_sim::kv_events::KvEventsConfig::parse(json).map_err(std::io::Error::other)?)
    } else {
        None
    };
    let sim = SimConfig {
        block_size: cfg.block_size,
        num_gpu_blocks: blocks,
        max_num_seqs: cfg.max_num_seqs,
        time_scale: cfg.time_scale,
        tokenizer: cfg.sim_tokenizer.clone(),
        kv_events_config,
        lora_modules: cfg
            .adapters
            .iter()
            .map(|name| vllm_sim::LoraModule {
                name: name.clone(),
                path: format!("/adapters/{name}"),
                base_model_name: None,
            })
            .collect(),
        max_loras: cfg.max_loras.max(1),
        // The trace records each answer's cached tokens, which vLLM reports only when asked.
        enable_prompt_tokens_details: cfg.trace_dir.is_some(),
        ..SimConfig::default()
    };
    let tokens = match &cfg.sim_tokenizer {
        Some(dir) => Tokens::Hf(Arc::new(
            hf_tokenize::HfTokenizer::from_dir(dir).map_err(std::io::Error::other)?,
        )),
        None => Tokens::StandIn,
    };
    let model = sim.model_names().first().cloned().unwrap_or_default();
    let workload = Arc::new(Workload::new(cfg.workload.clone(), cfg.seed));
    let ts = cfg.time_scale;
    let mut rows = Vec::new();
    let mut max_hit_rate = None;
    let mut prefix_only_hit_rate = None;
    for policy in &cfg.policies {
        eprintln!("[compare {}] policy {} …", cfg.name, policy.name());
        let prefill = cfg.prefill_backends.get(policy.name()).copied();
        let roles = roles(cfg.backends, prefill);
        let mut fleet = Vec::with_capacity(cfg.backends);
        for role in &roles {
            fleet.push(
                vllm_sim::spawn(SimConfig {
                    kv_role: *role,
                    ..sim.clone()
                })
                .await?,
            );
        }
        let workers: Vec<String> = fleet.iter().map(|s| s.url()).collect();
        let role_names: Vec<&str> = roles.iter().map(|r| role_name(*r)).collect();
        let row = match router::start(
            policy,
            &cfg.launcher,
            &workers,
            &role_names,
            &cfg.results_dir,
            cfg.ready_timeout,
        )
        .await
        {
            Err(e) => Row {
                policy: policy.name().into(),
                summary: None,
                failure: Some(e.to_string()),
                lora_loads: None,
            },
            Ok(r) => {
                let run = RunConfig {
                    label: format!("{}/{}", cfg.name, policy.name()),
                    keep_messages: false,
                    target: r.url.clone(),
                    request: RequestOptions {
                        model: model.clone(),
                        stream: true,
                        backend_header: "x-inferlb-backend".into(),
                        session_header: cfg.session_header.clone(),
                        adapters: cfg.adapters.clone(),
                    },
                    arrival: cfg.arrival.scaled(ts),
                    max_requests: cfg.max_requests,
                    duration: cfg.duration.div_f64(ts),
                    drain_timeout: cfg.drain_timeout,
                    think_time: cfg.think_time.div_f64(ts),
                    request_timeout: cfg.drain_timeout + cfg.duration.div_f64(ts),
                    backend_metrics: workers.clone(),
                    sample_interval: Duration::from_millis(100),
                    progress: cfg.progress,
                    seed: cfg.seed,
                    time_scale: ts,
                    block_size: cfg.block_size,
                    tokens: tokens.clone(),
                    slo: cfg.slo.map(|s| s.scaled_down(ts)),
                    trace: cfg
                        .trace_dir
                        .as_ref()
                        .map(|d| d.join(format!("{}-{}.trace.jsonl", cfg.name, policy.name()))),
                };
                let out = runner::run(run, Arc::clone(&workload)).await;
                r.save_metrics(&cfg.results_dir).await;
                r.stop().await;
                match out {
                    Ok(out) => {
                        if let Some(b) = &out.summary.max_hit {
                            max_hit_rate = Some(b.rate());
                            prefix_only_hit_rate = Some(b.prefix_only_rate());
                        }
                        Row {
                            policy: policy.name().into(),
                            summary: Some(out.summary),
                            failure: None,
                            lora_loads: None,
                        }
                    }
                    Err(e) => Row {
                        policy: policy.name().into(),
                        summary: None,
                        failure: Some(e.to_string()),
                        lora_loads: None,
                    },
                }
            }
        };
        let mut row = row;
        if !cfg.adapters.is_empty() {
            row.lora_loads = Some(fleet.iter().map(|s| s.stats().lora_loads).sum());
        }
        for s in fleet {
            s.shutdown().await;
        }
        if let Some(f) = &row.failure {
            eprintln!("[compare {}] policy {} failed: {f}", cfg.name, row.policy);
        }
        rows.push(row);
    }
    Ok(CompareOutput {
        name: cfg.name.clone(),
        workload: cfg.workload.clone(),
        seed: cfg.seed,
        backends: cfg.backends,
        num_gpu_blocks: blocks,
        block_size: cfg.block_size,
        time_scale: ts,
        arrival: cfg.arrival.clone(),
        max_hit_rate,
        prefix_only_hit_rate,
        slo: cfg.slo,
        prefill_backends: cfg.prefill_backends.clone(),
        rows,
    })
}

/// Each simulator's role: `prefill` for the first `prefill` of `n` and `decode` for the rest
/// when the policy runs disaggregated, else `both`.
fn roles(n: usize, prefill: Option<usize>) -> Vec<KvRole> {
    (0..n)
        .map(|i| match prefill {
            None => KvRole::Both,
            Some(p) if i < p => KvRole::Prefill,
            Some(_) => KvRole::Decode,
        })
        .collect()
}

fn role_name(role: KvRole) -> &'static str {
    match role {
        KvRole::Prefill => "prefill",
        KvRole::Decode => "decode",
        KvRole::Both => "both",
    }
}

const HEADERS: [&str; 16] = [
    "policy",
    "out tok/s",
    "TTFT p50",
    "TTFT p90",
    "TTFT p99",
    "TTFT mean",
    "TPOT p90",
    "goodput",
    "E2E p90",
    "hit rate",
    "hit/req",
    "hit/max",
    "preempt",
    "mean wait",
    "share max/min",
    "errors",
];

fn cells(row: &Row) -> Vec<String> {
    let Some(s) = &row.summary else {
        let mut v = vec![row.policy.clone()];
        v.extend((1..HEADERS.len() - 1).map(|_| "-".to_string()));
        v.push("failed (see notes)".into());
        return v;
    };
    let fleet = s.fleet.as_ref();
    vec![
        row.policy.clone(),
        format!("{:.0}", s.output_tokens_per_s),
        secs(s.ttft.p50),
        secs(s.ttft.p90),
        secs(s.ttft.p99),
        secs(s.ttft.mean),
        secs(s.tpot.p90),
        s.goodput_per_s.map_or("-".into(), |g| format!("{g:.3}/s")),
        secs(s.e2e.p90),
        fleet.map_or("-".into(), |f| format!("{:.3}", f.hit_rate)),
        fleet
            .and_then(|f| f.hit_rate_per_request)
            .map_or("-".into(), |r| format!("{r:.3}")),
        s.hit_rate_vs_max.map_or("-".into(), |r| format!("{r:.2}")),
        fleet.map_or("-".into(), |f| format!("{:.0}", f.preemptions)),
        fleet.map_or("-".into(), |f| format!("{:.2}", f.mean_waiting)),
        s.share_range().map_or("-".into(), |(a, b)| {
            format!("{:.0}%/{:.0}%", a * 100.0, b * 100.0)
        }),
        s.errors_text(),
    ]
}

impl CompareOutput {
    /// The aligned plain-text table.
    pub fn table(&self) -> String {
        let rows: Vec<Vec<String>> = self.rows.iter().map(cells).collect();
        let mut widths: Vec<usize> = HEADERS.iter().map(|h| h.chars().count()).collect();
        for r in &rows {
            for (w, c) in widths.iter_mut().zip(r) {
                *w = (*w).max(c.chars().count());
            }
        }
        let mut s = String::new();
        let line = |s: &mut String, r: Vec<String>| {
            let parts: Vec<String> = r
                .iter()
                .zip(&widths)
                .enumerate()
                .map(|(i, (c, w))| {
                    let pad = w.saturating_sub(c.chars().count());
                    if i == 0 {
                        format!("{c}{}", " ".repeat(pad))
                    } else {
                        format!("{}{c}", " ".repeat(pad))
                    }
                })
                .collect();
            let _ = writeln!(s, "{}", parts.join("  "));
        };
        line(&mut s, HEADERS.iter().map(|h| h.to_string()).collect());
        for r in rows {
            line(&mut s, r);
        }
        s.push_str(&self.notes());
        s
    }

    /// The same table in Markdown.
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "| {} |", HEADERS.join(" | "));
        let _ = writeln!(s, "|{}", " --- |".repeat(HEADERS.len()));
        for r in &self.rows {
            let _ = writeln!(s, "| {} |", cells(r).join(" | "));
        }
        s.push('\n');
        s.push_str(&self.notes());
        s
    }

    fn notes(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{} backends × {} KV blocks of {} tokens; times in simulated seconds (time scale {}); \
             hit rate = vLLM's prefix-cache counter; hit/req = cached ÷ prompt tokens, each \
             request counted once (preemption cannot raise it); max achievable hit rate {} \
             (one unlimited cache keeping every prompt and answer; hit/max = hit/req ÷ it), \
             {} from shared prefixes alone.",
            self.backends,
            self.num_gpu_blocks,
            self.block_size,
            self.time_scale,
            self.max_hit_rate.map_or("-".into(), |r| format!("{r:.3}")),
            self.prefix_only_hit_rate
                .map_or("-".into(), |r| format!("{r:.3}"))
        );
        if let Some(slo) = self.slo {
            let _ = writeln!(
                s,
                "TPOT = (E2E − TTFT) ÷ (output tokens − 1) per request; goodput = requests per \
                 simulated second with TTFT ≤ {} and TPOT ≤ {}.",
                secs(slo.ttft),
                secs(slo.tpot)
            );
        }
        for (policy, n) in &self.prefill_backends {
            let _ = writeln!(
                s,
                "{policy}: {n} prefill + {} decode simulators (others: {} × both).",
                self.backends.saturating_sub(*n),
                self.backends
            );
        }
        for r in &self.rows {
            if let Some(f) = &r.failure {
                let _ = writeln!(s, "- {}: {f}", r.policy);
            }
        }
        let loads: Vec<String> = self
            .rows
            .iter()
            .filter_map(|r| r.lora_loads.map(|n| format!("{} {n}", r.policy)))
            .collect();
        if !loads.is_empty() {
            let _ = writeln!(
                s,
                "LoRA adapter loads over the fleet (an adapter admitted while not in one of its \
                 backend's slots): {}.",
                loads.join(", ")
            );
        }
        s
    }

    /// A row by policy name.
    pub fn row(&self, policy: &str) -> Option<&Summary> {
        self.rows
            .iter()
            .find(|r| r.policy == policy)
            .and_then(|r| r.summary.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizing_formula() {
        // 32 groups × 1500 tokens at 73% over 4 backends of 16-token blocks.
        assert_eq!(blocks_for(48_000, 0.73, 4, 16), 1028);
        assert_eq!(blocks_for(0, 0.73, 4, 16), 1);
    }
}
