//! The `loadgen` binary: `run` (load one URL) and `compare` (routing policies on a sim fleet).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use loadgen::arrival::{parse_ramp, Arrival};
use loadgen::client::RequestOptions;
use loadgen::compare::{self, CompareConfig};
use loadgen::report::Slo;
use loadgen::router::{self, Launcher, Policy};
use loadgen::runner::{self, RunConfig};
use loadgen::workload::{Tokens, Workload, WorkloadSpec};
use loadgen::{is_loopback, machine};

/// Load generator and routing-quality benchmark for OpenAI-compatible LLM servers and routers.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Send a seeded workload to one base URL (router or backend) and report.
    Run(RunArgs),
    /// Compare routing policies on a fresh simulated fleet per policy.
    Compare(CompareArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Kind {
    SharedPrefix,
    MultiTurn,
    Unique,
}

#[derive(Debug, Clone, Args)]
struct WorkloadArgs {
    /// Workload shape.
    #[arg(long, value_enum, default_value = "shared-prefix")]
    workload: Kind,
    /// shared-prefix: number of groups (each with its own system prompt).
    #[arg(long, default_value_t = 32)]
    groups: u64,
    /// shared-prefix: prompts per group.
    #[arg(long, default_value_t = 5)]
    prompts: u64,
    /// System prompt tokens (shared-prefix: per group; multi-turn: per conversation).
    #[arg(long, default_value_t = 1500)]
    system_tokens: usize,
    /// Question / user message tokens (unique: prompts are system + question tokens long).
    #[arg(long, default_value_t = 150)]
    question_tokens: usize,
    /// Output tokens per request (`max_tokens` with `ignore_eos`).
    #[arg(long, default_value_t = 100)]
    output_tokens: u32,
    /// unique: prompt lengths drawn uniformly from system + question tokens to this (0: fixed).
    #[arg(long, default_value_t = 0)]
    prompt_tokens_max: usize,
    /// unique: output lengths drawn uniformly from --output-tokens to this (0: fixed).
    #[arg(long, default_value_t = 0)]
    output_tokens_max: u32,
    /// shared-prefix: Zipf exponent of group popularity; 0 = every prompt in turn.
    #[arg(long, default_value_t = 0.0)]
    zipf: f64,
    /// multi-turn: number of conversations.
    #[arg(long, default_value_t = 16)]
    conversations: u64,
    /// multi-turn: turns per conversation (12: the unavoidable cold first turns stay under
    /// 10% of requests, so TTFT p90 measures routing rather than cold starts).
    #[arg(long, default_value_t = 12)]
    turns: u32,
    /// multi-turn: pause between an answer and the next turn (ms, simulated time in compare).
    #[arg(long, default_value_t = 0)]
    think_time_ms: u64,
    /// Seed of every random choice (texts, order, arrivals).
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

impl WorkloadArgs {
    fn spec(&self) -> WorkloadSpec {
        match self.workload {
            Kind::SharedPrefix => WorkloadSpec::SharedPrefix {
                groups: self.groups,
                prompts: self.prompts,
                system_tokens: self.system_tokens,
                question_tokens: self.question_tokens,
                output_tokens: self.output_tokens,
                zipf: self.zipf,
            },
            Kind::MultiTurn => WorkloadSpec::MultiTurn {
                conversations: self.conversations,
                turns: self.turns,
                system_tokens: self.system_tokens,
                user_tokens: self.question_tokens,
                output_tokens: self.output_tokens,
            },
            Kind::Unique => WorkloadSpec::Unique {
                prompt_tokens: self.system_tokens + self.question_tokens,
                output_tokens: self.output_tokens,
                prompt_tokens_max: self.prompt_tokens_max,
                output_tokens_max: self.output_tokens_max,
            },
        }
    }

    fn name(&self) -> &'static str {
        match self.workload {
            Kind::SharedPrefix => "shared-prefix",
            Kind::MultiTurn => "multi-turn",
            Kind::Unique => "unique",
        }
    }
}

/// Goodput: requests meeting both objectives (times in reported, i.e. simulated, seconds).
#[derive(Debug, Clone, Args)]
struct SloArgs {
    /// Goodput's TTFT objective, ms (with --slo-tpot-ms).
    #[arg(long, requires = "slo_tpot_ms")]
    slo_ttft_ms: Option<f64>,
    /// Goodput's TPOT objective (time per output token after the first), ms.
    #[arg(long, requires = "slo_ttft_ms")]
    slo_tpot_ms: Option<f64>,
}

impl SloArgs {
    fn slo(&self) -> Option<Slo> {
        Some(Slo {
            ttft: self.slo_ttft_ms? / 1e3,
            tpot: self.slo_tpot_ms? / 1e3,
        })
    }
}

#[derive(Debug, Clone, Args)]
struct ArrivalArgs {
    /// Open loop: Poisson arrivals at this many requests/s.
    #[arg(long, conflicts_with_all = ["ramp", "concurrency"])]
    rate: Option<f64>,
    /// Open loop: stepped Poisson ramp FROM:TO:STEPS requests/s (e.g. 3:60:6).
    #[arg(long, conflicts_with = "concurrency")]
    ramp: Option<String>,
    /// Length of each ramp step, seconds.
    #[arg(long, default_value_t = 10.0)]
    step_secs: f64,
    /// Closed loop: this many concurrent clients.
    #[arg(long)]
    concurrency: Option<usize>,
    /// Stop after this many requests (default: one natural pass of the workload).
    #[arg(long)]
    requests: Option<u64>,
    /// Stop sending after this many seconds.
    #[arg(long, default_value_t = 600.0)]
    duration: f64,
    /// Wall-clock seconds in-flight requests may take after sending stops.
    #[arg(long, default_value_t = 120.0)]
    drain_secs: f64,
}

impl ArrivalArgs {
    fn arrival(&self, default: Arrival) -> Result<Arrival, String> {
        if let Some(rate) = self.rate {
            return Ok(Arrival::Poisson { rate });
        }
        if let Some(r) = &self.ramp {
            let (from, to, steps) = parse_ramp(r)?;
            return Ok(Arrival::Ramp {
                from,
                to,
                steps,
                step_secs: self.step_secs,
            });
        }
        if let Some(concurrency) = self.concurrency {
            return Ok(Arrival::Closed { concurrency });
        }
        Ok(default)
    }
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Base URL of the server or router (…/v1/chat/completions is appended).
    #[arg(long)]
    url: String,
    /// Model name; default: the first id of the target's /v1/models.
    #[arg(long)]
    model: Option<String>,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    arrival: ArrivalArgs,
    #[command(flatten)]
    slo: SloArgs,
    /// Send non-streaming requests (TTFT is then the whole answer's latency).
    #[arg(long)]
    no_stream: bool,
    /// A backend's base URL whose /metrics to scrape (repeatable).
    #[arg(long = "backend-metrics", value_name = "URL")]
    backend_metrics: Vec<String>,
    /// Backends' KV block size (for the maximum achievable hit rate).
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Report times × this factor (set to the simulators' --time-scale).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Write the summary as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write one JSON line per finished request here: send time, group, backend, TTFT,
    /// end-to-end time, prompt and cached tokens (times × --time-scale). vLLM reports cached
    /// tokens only when it runs with `--enable-prompt-tokens-details` (else `null`).
    #[arg(long, value_name = "PATH")]
    trace: Option<PathBuf>,
    /// Allow non-loopback targets.
    #[arg(long)]
    allow_remote: bool,
    /// Response header naming the backend that served a request.
    #[arg(long, default_value = "x-inferlb-backend")]
    backend_header: String,
    /// Write every request's messages here, one JSON object per line in send order
    /// (`{"session", "turn", "messages", "backend"}`; later turns of a conversation carry the
    /// server's answers as they came; `backend` is the answer's backend header, when the router
    /// sent one), e.g. to compute a hit-rate bound with the real model's tokenizer.
    #[arg(long, value_name = "PATH")]
    dump_requests: Option<PathBuf>,
    /// Send each request's session id in this header (e.g. inferlb's `x-session-id`).
    #[arg(long)]
    session_header: Option<String>,
    /// Mixed-adapter traffic: comma-separated LoRA adapter names; each session asks for one
    /// (uniform, stable per session) instead of --model.
    #[arg(long, value_delimiter = ',')]
    adapters: Vec<String>,
}

#[derive(Debug, Args)]
struct CompareArgs {
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    arrival: ArrivalArgs,
    #[command(flatten)]
    slo: SloArgs,
    /// NAME=N: policy NAME runs on a prefill/decode fleet, its first N simulators in the
    /// `prefill` role and the rest `decode` (each with its `role` in the router's config); other
    /// policies get `both` (repeatable).
    #[arg(long = "prefill-backends", value_name = "NAME=N")]
    prefill_backends: Vec<String>,
    /// Simulated backends.
    #[arg(long, default_value_t = 4)]
    backends: usize,
    /// KV blocks per backend (default: sized so the prefixes need 73% of the fleet's cache).
    #[arg(long)]
    num_gpu_blocks: Option<usize>,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Simulator speed-up; rates, durations and reported times are in simulated time. 4 keeps
    /// the peak of the default ramp (240 requests/s of wall time) within 2 cores.
    #[arg(long, default_value_t = 4.0)]
    time_scale: f64,
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Built-in policies, comma-separated (random, round-robin, load-only, prefix-only, default).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "random,round-robin,load-only,prefix-only,default"
    )]
    policies: Vec<String>,
    /// NAME=path.toml: an inferlb config fragment ([[plugins]], [[scheduling_profiles]], …).
    #[arg(long = "policy-file", value_name = "NAME=PATH")]
    policy_files: Vec<String>,
    /// NAME=path: run the inferlb policy NAME (built-in or `--policy-file`) from this binary
    /// instead of `--inferlb-bin`, e.g. a build of an older commit beside today's in one run.
    #[arg(long = "policy-bin", value_name = "NAME=BIN")]
    policy_bins: Vec<String>,
    /// NAME=command with {port}, {workers} and {metrics_port} placeholders: any router
    /// (repeatable); ready when its /health or /v1/models answers 200.
    #[arg(long = "router-cmd", value_name = "NAME=CMD")]
    router_cmds: Vec<String>,
    /// The inferlb binary.
    #[arg(long, default_value = "target/release/inferlb")]
    inferlb_bin: PathBuf,
    /// Where the Markdown and JSON results (and router logs) go.
    #[arg(long, default_value = "bench/results")]
    results_dir: PathBuf,
    /// Write each policy's per-request trace (as `run --trace`) to
    /// `DIR/<name>-<policy>.trace.jsonl`.
    #[arg(long, value_name = "DIR")]
    trace_dir: Option<PathBuf>,
    /// Tiny CI version: 2 backends, 2 groups × 3 prompts, tiny prompts, 2 policies.
    #[arg(long)]
    smoke: bool,
    /// Seconds a router may take to become ready.
    #[arg(long, default_value_t = 30)]
    ready_timeout_secs: u64,
    /// A line for the results header (repeatable), e.g. the versions of external routers.
    #[arg(long = "note", value_name = "TEXT")]
    notes: Vec<String>,
    /// Hugging Face model directory the simulators tokenize with (`vllm-sim --tokenizer`); the
    /// hit-rate bound and the cache sizing then count its tokens. A precise inferlb policy
    /// (`--policy-file`) points its `[tokenization] dir` at the same directory.
    #[arg(long, value_name = "DIR")]
    sim_tokenizer: Option<PathBuf>,
    /// Every simulator publishes KV-cache events (vLLM's `--kv-events-config`, a free port,
    /// found through `/kv_event_sources`), for precise policies (`[kv_events] default = "auto"`).
    #[arg(long)]
    sim_kv_events: bool,
    /// Send each request's session id in this header (e.g. inferlb's `x-session-id`).
    #[arg(long)]
    session_header: Option<String>,
    /// Mixed-adapter traffic: the simulators serve these LoRA adapters (comma-separated) and
    /// each session asks for one (uniform, stable per session); LoRA loads are reported.
    #[arg(long, value_delimiter = ',')]
    adapters: Vec<String>,
    /// LoRA slots per simulator (`--max-loras`) for --adapters.
    #[arg(long, default_value_t = 1)]
    max_loras: usize,
}

/// `NAME=N` pairs of `--prefill-backends`.
fn parse_prefill_backends(
    pairs: &[String],
) -> Result<std::collections::BTreeMap<String, usize>, String> {
    pairs
        .iter()
        .map(|p| {
            let (name, n) = p
                .split_once('=')
                .ok_or_else(|| format!("--prefill-backends {p}: expected NAME=N"))?;
            let n = n
                .parse::<usize>()
                .map_err(|e| format!("--prefill-backends {p}: {e}"))?;
            Ok((name.to_owned(), n))
        })
        .collect()
}

fn sizing_tokens(w: &WorkloadArgs, workload: &Workload) -> usize {
    match workload.prefix_tokens() {
        // Unique prompts reuse nothing: size the cache as the shared-prefix shape would.
        0 => w.groups as usize * w.system_tokens,
        n => n,
    }
}

/// [`sizing_tokens`] in `tok`'s tokens: scaled by how many tokens `tok` gives the workload's
/// system prompts against the simulator's stand-in tokenizer.
fn sizing_tokens_with(tok: &Tokens, w: &WorkloadArgs, workload: &Workload) -> usize {
    let base = sizing_tokens(w, workload);
    if matches!(tok, Tokens::StandIn) {
        return base;
    }
    let mut seen = std::collections::HashSet::new();
    let (mut theirs, mut ours) = (0usize, 0usize);
    for id in 0..workload.natural_requests().unwrap_or(1_000).min(10_000) {
        let session = workload.session(id);
        let Some(system) = session.system.clone() else {
            continue;
        };
        if seen.insert(system.clone()) {
            let m = [vllm_sim::tokenizer::ChatMessage {
                role: "system".into(),
                content: system,
            }];
            theirs += tok.chat(&m, false).len();
            ours += Tokens::StandIn.chat(&m, false).len();
        }
    }
    if ours == 0 {
        return base;
    }
    (base as f64 * theirs as f64 / ours as f64).ceil() as usize
}

fn policies(a: &CompareArgs) -> Result<Vec<Policy>, String> {
    let mut out = Vec::new();
    for name in a.policies.iter().filter(|n| !n.is_empty()) {
        out.push(router::builtin(name).ok_or_else(|| {
            format!(
                "unknown policy {name:?}; built-in: {}",
                router::BUILTIN_POLICIES.join(", ")
            )
        })?);
    }
    for spec in &a.policy_files {
        let (name, path) = spec
            .split_once('=')
            .ok_or_else(|| format!("--policy-file wants NAME=PATH, got {spec:?}"))?;
        let fragment = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
        out.push(Policy::Inferlb {
            name: name.into(),
            fragment,
            bin: None,
        });
    }
    for spec in &a.policy_bins {
        let (name, path) = spec
            .split_once('=')
            .ok_or_else(|| format!("--policy-bin wants NAME=BIN, got {spec:?}"))?;
        let path = PathBuf::from(path);
        if !path.is_file() {
            return Err(format!("--policy-bin {name}: {} not found", path.display()));
        }
        let own = out
            .iter_mut()
            .find_map(|p| match p {
                Policy::Inferlb { name: n, bin, .. } if n == name => Some(bin),
                _ => None,
            })
            .ok_or_else(|| format!("--policy-bin {name}: no inferlb policy of that name"))?;
        *own = Some(path);
    }
    for spec in &a.router_cmds {
        let (name, command) = spec
            .split_once('=')
            .ok_or_else(|| format!("--router-cmd wants NAME=COMMAND, got {spec:?}"))?;
        out.push(Policy::Command {
            name: name.into(),
            command: command.into(),
        });
    }
    Ok(out)
}

async fn model_of(url: &str) -> Option<String> {
    let client = reqwest::Client::builder().no_proxy().build().ok()?;
    let v: serde_json::Value = client
        .get(format!("{}/v1/models", url.trim_end_matches('/')))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()?;
    v["data"][0]["id"].as_str().map(str::to_owned)
}

async fn run_cmd(a: RunArgs) -> Result<(), String> {
    for u in std::iter::once(&a.url).chain(&a.backend_metrics) {
        if !a.allow_remote && !is_loopback(u) {
            return Err(format!(
                "{u} is not a loopback address; pass --allow-remote"
            ));
        }
    }
    let model = match &a.model {
        Some(m) => m.clone(),
        None => model_of(&a.url)
            .await
            .unwrap_or_else(|| vllm_sim::config::DEFAULT_MODEL.into()),
    };
    let workload = Arc::new(Workload::new(a.workload.spec(), a.workload.seed));
    let arrival = a.arrival.arrival(Arrival::Closed { concurrency: 8 })?;
    let max_requests = a.arrival.requests.or(workload.natural_requests());
    let cfg = RunConfig {
        label: a.workload.name().into(),
        keep_messages: a.dump_requests.is_some(),
        target: a.url.clone(),
        request: RequestOptions {
            model,
            stream: !a.no_stream,
            backend_header: a.backend_header.clone(),
            session_header: a.session_header.clone(),
            adapters: a.adapters.clone(),
        },
        duration: secs(a.arrival.duration),
        drain_timeout: secs(a.arrival.drain_secs),
        think_time: Duration::from_millis(a.workload.think_time_ms),
        request_timeout: secs(a.arrival.duration + a.arrival.drain_secs),
        arrival,
        max_requests,
        backend_metrics: a.backend_metrics.clone(),
        sample_interval: Duration::from_millis(100),
        progress: true,
        seed: a.workload.seed,
        time_scale: a.time_scale,
        block_size: a.block_size,
        tokens: Default::default(),
        slo: a.slo.slo().map(|s| s.scaled_down(a.time_scale)),
        trace: a.trace.clone(),
    };
    let provenance = machine::provenance(
        &std::env::current_exe().into_iter().collect::<Vec<_>>(),
        &[],
    );
    let out = runner::run(cfg, Arc::clone(&workload))
        .await
        .map_err(|e| e.to_string())?;
    print!("{}", out.summary.render());
    if let Some(path) = &a.dump_requests {
        dump_requests(path, &out.messages)?;
    }
    if let Some(path) = &a.json {
        let mut json = serde_json::to_value(&out.summary).map_err(|e| e.to_string())?;
        if let Some(o) = json.as_object_mut() {
            o.insert(
                "provenance".into(),
                serde_json::to_value(&provenance).map_err(|e| e.to_string())?,
            );
        }
        let text = serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

fn dump_requests(
    path: &std::path::Path,
    sent: &[loadgen::runner::KeptRequest],
) -> Result<(), String> {
    let mut text = String::new();
    for kept in sent {
        let messages: Vec<serde_json::Value> = kept
            .messages
            .iter()
            .map(|m| serde_json::json!({ "role": m.role, "content": m.content }))
            .collect();
        let mut line =
            serde_json::json!({ "session": kept.session, "turn": kept.turn, "messages": messages });
        if let (Some(backend), Some(o)) = (&kept.backend, line.as_object_mut()) {
            o.insert("backend".into(), backend.clone().into());
        }
        text.push_str(&line.to_string());
        text.push('\n');
    }
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.0))
}

async fn compare_cmd(mut a: CompareArgs) -> Result<(), String> {
    if a.smoke {
        a.backends = 2;
        a.workload.groups = 2;
        a.workload.prompts = 3;
        a.workload.conversations = 2;
        a.workload.turns = 3;
        a.workload.system_tokens = 96;
        a.workload.question_tokens = 16;
        a.workload.output_tokens = 8;
        a.time_scale = 20.0;
        if a.policies.len() > 2 {
            a.policies = vec!["random".into(), "default".into()];
        }
        if a.arrival.rate.is_none() && a.arrival.ramp.is_none() {
            a.arrival.concurrency.get_or_insert(2);
        }
    }
    let spec = a.workload.spec();
    let workload = Workload::new(spec.clone(), a.workload.seed);
    let default_arrival = match a.workload.workload {
        // Measured on the simulator: 3→60 takes random routing far past its capacity (as
        // llm-d's ramp does) while prefix-aware routing keeps up longer; unique prompts cannot
        // hit, so their ramp stops near the fleet's capacity where balancing decides.
        Kind::SharedPrefix => Arrival::Ramp {
            from: 3.0,
            to: 60.0,
            steps: 6,
            step_secs: a.arrival.step_secs,
        },
        Kind::Unique => Arrival::Ramp {
            from: 2.0,
            to: 20.0,
            steps: 6,
            step_secs: a.arrival.step_secs,
        },
        Kind::MultiTurn => Arrival::Poisson { rate: 8.0 },
    };
    let arrival = a.arrival.arrival(default_arrival)?;
    let policies = policies(&a)?;
    let sim_tokens = match &a.sim_tokenizer {
        Some(dir) => Tokens::Hf(Arc::new(
            hf_tokenize::HfTokenizer::from_dir(dir)
                .map_err(|e| format!("{}: {e}", dir.display()))?,
        )),
        None => Tokens::StandIn,
    };
    let cfg = CompareConfig {
        name: a.workload.name().into(),
        sizing_tokens: sizing_tokens_with(&sim_tokens, &a.workload, &workload),
        workload: spec,
        seed: a.workload.seed,
        backends: a.backends,
        block_size: a.block_size,
        num_gpu_blocks: a.num_gpu_blocks,
        max_num_seqs: a.max_num_seqs,
        time_scale: a.time_scale,
        // A ramp ends by itself; other arrivals stop after one natural pass by default.
        max_requests: a.arrival.requests.or(match arrival.natural_duration() {
            Some(_) => None,
            None => workload.natural_requests(),
        }),
        duration: secs(a.arrival.duration),
        think_time: Duration::from_millis(a.workload.think_time_ms),
        arrival,
        policies,
        launcher: Launcher::Binary(a.inferlb_bin.clone()),
        results_dir: a.results_dir.clone(),
        ready_timeout: Duration::from_secs(a.ready_timeout_secs),
        drain_timeout: secs(a.arrival.drain_secs),
        progress: true,
        sim_tokenizer: a.sim_tokenizer.clone(),
        sim_kv_events: a.sim_kv_events,
        session_header: a.session_header.clone(),
        adapters: a.adapters.clone(),
        max_loras: a.max_loras,
        slo: a.slo.slo(),
        trace_dir: a.trace_dir.clone(),
        prefill_backends: parse_prefill_backends(&a.prefill_backends)?,
    };
    if !a.inferlb_bin.exists()
        && cfg
            .policies
            .iter()
            .any(|p| matches!(p, Policy::Inferlb { bin: None, .. }))
    {
        return Err(format!(
            "{} not found: build it with `cargo build --release -p inferlb` or pass --inferlb-bin",
            a.inferlb_bin.display()
        ));
    }
    // Read before the run: the binaries measured and the sources they should come from.
    let mut binaries: Vec<PathBuf> = std::env::current_exe().into_iter().collect();
    if cfg
        .policies
        .iter()
        .any(|p| matches!(p, Policy::Inferlb { bin: None, .. }))
    {
        binaries.push(a.inferlb_bin.clone());
    }
    // A policy's own binary is another build (an older commit): named, not checked against
    // these sources, whose newer edits would call it stale.
    let mut notes = a.notes.clone();
    for p in &cfg.policies {
        if let Policy::Inferlb {
            name, bin: Some(b), ..
        } = p
        {
            notes.push(format!(
                "policy {name} runs `{}` (built {}), not checked against these sources",
                b.display(),
                machine::built_at(b).unwrap_or_else(|| "at an unknown time".into())
            ));
        }
    }
    let provenance = machine::provenance(&binaries, &notes);
    let out = compare::compare(cfg).await.map_err(|e| e.to_string())?;
    let table = out.table();
    println!("{table}");
    let (date, _) = machine::utc_now();
    let stem = format!(
        "compare-{}{}-{date}",
        out.name,
        if a.smoke { "-smoke" } else { "" }
    );
    let md = format!(
        "# loadgen compare: {}\n\n{}{}\n{}",
        out.name,
        machine::header(),
        provenance.markdown(),
        out.markdown()
    );
    let md_path = a.results_dir.join(format!("{stem}.md"));
    let json_path = a.results_dir.join(format!("{stem}.json"));
    let mut json = serde_json::to_value(&out).map_err(|e| e.to_string())?;
    if let Some(o) = json.as_object_mut() {
        o.insert(
            "provenance".into(),
            serde_json::to_value(&provenance).map_err(|e| e.to_string())?,
        );
    }
    let json = serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?;
    std::fs::write(&md_path, md).map_err(|e| format!("{}: {e}", md_path.display()))?;
    std::fs::write(&json_path, json).map_err(|e| format!("{}: {e}", json_path.display()))?;
    eprintln!("wrote {} and {}", md_path.display(), json_path.display());
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Run(a) => run_cmd(a).await,
        Cmd::Compare(a) => compare_cmd(a).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("loadgen: {e}");
            ExitCode::from(2)
        }
    }
}
