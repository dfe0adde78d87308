//! The `inferlb` binary: parse flags, load the config, apply overrides, run until a signal.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use inferlb::config::{BackendConfig, Config, LogFormat};
use inferlb::{run_reloadable, telemetry, Listeners};

/// mimalloc instead of glibc's malloc (see Cargo.toml for why and what it costs).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// An LLM-aware load balancer for vLLM fleets: routes each OpenAI request to the backend that
/// holds its prompt prefix in KV cache, weighed against queue and KV-cache load.
#[derive(Debug, Clone, Parser)]
#[command(version, about)]
struct Cli {
    /// TOML config file (see the documented config.toml); every field has a default.
    #[arg(long, short, env = "INFERLB_CONFIG")]
    config: Option<PathBuf>,
    /// Address of the OpenAI-compatible listener (overrides `listen`).
    #[arg(long, env = "INFERLB_LISTEN")]
    listen: Option<SocketAddr>,
    /// Separate listener for /metrics and /admin/* (overrides `admin_listen`).
    #[arg(long)]
    admin_listen: Option<SocketAddr>,
    /// Backend base URL, repeatable; replaces the file's [[backends]] when given.
    #[arg(long = "backend", value_name = "URL")]
    backends: Vec<String>,
    /// Discover backends instead of listing them: `file:PATH`, `dns:NAME:PORT`,
    /// `k8s:NAMESPACE/LABEL_SELECTOR:PORT` or `k8s-pool:NAMESPACE/NAME` (overrides
    /// `[discovery]`).
    #[arg(long, value_name = "SOURCE")]
    discovery: Option<String>,
    /// Log output format.
    #[arg(long, value_enum)]
    log_format: Option<LogFormat>,
    /// Log filter, e.g. `info` or `inferlb=debug` (debug logs every scheduling decision).
    #[arg(long)]
    log_level: Option<String>,
    /// Metrics poll interval in milliseconds (overrides `poller.interval_ms`).
    #[arg(long)]
    poll_interval_ms: Option<u64>,
    /// Scheduling profile to use (overrides `profile`).
    #[arg(long)]
    profile: Option<String>,
    /// Largest accepted request body in bytes (overrides `max_body_bytes`).
    #[arg(long)]
    max_body_bytes: Option<usize>,
    /// Hugging Face model directory whose tokenizer and chat template give every model's
    /// token ids (overrides `tokenization.dir`).
    #[arg(long, value_name = "DIR")]
    tokenizer: Option<PathBuf>,
    /// KV-event streams of backends without their own `kv_events`: `off`, `auto` or `port+N`
    /// (overrides `kv_events.default`).
    #[arg(long, value_name = "MODE")]
    kv_events: Option<String>,
    /// Request worker threads: `auto` (one per core, each with its own runtime, listening
    /// socket and backend connections), a number, or `shared` (one work-stealing runtime)
    /// (overrides `server.workers`).
    #[arg(long, value_name = "auto|N|shared")]
    workers: Option<inferlb::workers::Workers>,
    /// Validate the configuration and exit.
    #[arg(long)]
    check: bool,
    /// Demo: start N simulated vLLM servers in this process and route to them (needs the
    /// `demo` feature: `cargo run --release --features demo -- --demo 4`).
    #[arg(long, value_name = "N")]
    demo: Option<usize>,
}

impl Cli {
    fn apply(self, mut config: Config) -> Result<Config, inferlb::config::ConfigError> {
        if let Some(spec) = &self.discovery {
            config.discovery.apply_shorthand(spec)?;
        }
        if let Some(v) = self.listen {
            config.listen = v;
        }
        if let Some(v) = self.admin_listen {
            config.admin_listen = Some(v);
        }
        if !self.backends.is_empty() {
            config.backends = self
                .backends
                .into_iter()
                .map(BackendConfig::from_url)
                .collect();
        }
        if let Some(v) = self.log_format {
            config.log_format = v;
        }
        if let Some(v) = self.log_level {
            config.log_level = v;
        }
        if let Some(v) = self.poll_interval_ms {
            config.poller.interval_ms = v;
        }
        if let Some(v) = self.profile {
            config.profile = Some(v);
        }
        if let Some(v) = self.max_body_bytes {
            config.max_body_bytes = v;
        }
        if let Some(v) = self.tokenizer {
            config.tokenization.dir = Some(v);
        }
        if let Some(v) = self.kv_events {
            config.kv_events.default = v;
        }
        if let Some(v) = self.workers {
            config.server.workers = v;
        }
        Ok(config)
    }
}

/// Configurations to reload: re-read (with the same command-line overrides) on SIGHUP and,
/// when `--config` names a file, whenever its modification time or size changes (checked
/// every second). A file that cannot be read or parsed is reported and not sent. The demo's
/// backends are not in any file, so the demo does not reload.
fn watch_for_reloads(cli: Cli, demo: bool) -> tokio::sync::mpsc::Receiver<Config> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    if demo {
        return rx;
    }
    // Installed now, not when the task first runs: a SIGHUP right after start-up must reload,
    // not kill the process (SIGHUP's default action).
    #[cfg(unix)]
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    tokio::spawn(async move {
        let stamp = |path: &std::path::Path| {
            std::fs::metadata(path)
                .ok()
                .map(|m| (m.modified().ok(), m.len()))
        };
        let mut seen = cli.config.as_deref().and_then(stamp);
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        loop {
            #[cfg(unix)]
            let hangup = async {
                match hup.as_mut() {
                    Some(h) => h.recv().await,
                    None => std::future::pending().await,
                }
            };
            #[cfg(not(unix))]
            let hangup = std::future::pending::<Option<()>>();
            let why = tokio::select! {
                _ = hangup => "SIGHUP",
                _ = tick.tick() => {
                    let now = cli.config.as_deref().and_then(stamp);
                    if now == seen {
                        continue;
                    }
                    seen = now;
                    "the config file changed"
                }
            };
            tracing::info!("reloading the configuration ({why})");
            let file = match &cli.config {
                Some(path) => Config::from_file(path),
                None => Ok(Config::default()),
            };
            match file.and_then(|c| cli.clone().apply(c)) {
                Ok(config) => {
                    if tx.send(config).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    metrics::counter!(telemetry::CONFIG_RELOADS, "result" => "error").increment(1);
                    tracing::error!(error = %e, "configuration reload refused; the previous configuration stays in effect");
                }
            }
        }
    });
    rx
}

/// Resolves on the first SIGINT or SIGTERM; a second one exits the process at once.
///
/// The handlers are installed when this is called, not when the future is first polled (the
/// accept loop polls it only once start-up is done: the first scrape of every backend, the
/// listener's announcement). Installed lazily, a SIGTERM that came in between met the default
/// action and killed the process — an exit by signal instead of a drain and exit 0. Must be
/// called within the runtime.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let streams = signal(SignalKind::terminate())
            .and_then(|term| Ok((term, signal(SignalKind::interrupt())?)));
        async move {
            let Ok((mut term, mut int)) = streams else {
                tracing::warn!("cannot listen for signals; stop the process with SIGKILL");
                return std::future::pending().await;
            };
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tracing::info!("shutdown signal received; draining (send it again to exit at once)");
            tokio::spawn(async move {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
                tracing::warn!("second signal: exiting without waiting for in-flight requests");
                telemetry::log_writer::flush(LOG_FLUSH_LIMIT);
                std::process::exit(130);
            });
        }
    }
    #[cfg(not(unix))]
    {
        async {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// How long the binary waits on exit for buffered log lines to be written.
const LOG_FLUSH_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The model the demo's simulators serve.
const DEMO_MODEL: &str = "demo-llama";

#[cfg(feature = "demo")]
type DemoFleet = Vec<vllm_sim::SimHandle>;
#[cfg(not(feature = "demo"))]
type DemoFleet = ();

/// Start `n` simulators on loopback and make them the only backends.
#[cfg(feature = "demo")]
async fn start_demo_fleet(n: usize, config: &mut Config) -> Result<DemoFleet, String> {
    if n == 0 || n > 64 {
        return Err("N must be between 1 and 64".into());
    }
    let sim = vllm_sim::SimConfig {
        served_model_name: vec![DEMO_MODEL.into()],
        ..Default::default()
    };
    let fleet = vllm_sim::spawn_fleet(n, sim)
        .await
        .map_err(|e| e.to_string())?;
    config.backends = fleet
        .iter()
        .map(|s| BackendConfig::from_url(s.url()))
        .collect();
    for s in &fleet {
        println!("simulated vLLM server ({DEMO_MODEL}) on {}", s.url());
    }
    Ok(fleet)
}

#[cfg(not(feature = "demo"))]
async fn start_demo_fleet(_n: usize, _config: &mut Config) -> Result<DemoFleet, String> {
    Err("this binary was built without the demo; run `cargo run --release --features demo -- --demo 4`".into())
}

/// The configuration from the file and the flags, or the exit code of a refusal.
fn load(cli: &Cli) -> Result<Config, ExitCode> {
    let config = match &cli.config {
        Some(path) => match Config::from_file(path) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("inferlb: {e}");
                return Err(ExitCode::from(2));
            }
        },
        None => Config::default(),
    };
    cli.clone().apply(config).map_err(|e| {
        eprintln!("inferlb: {e}");
        ExitCode::from(2)
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match load(&cli) {
        Ok(c) => c,
        Err(code) => return code,
    };
    // With per-core request workers (crate `workers`) the requests run on threads of their
    // own; what is left here (admin listener, reloads, discovery, metrics upkeep) needs no
    // more than one thread. The shared model runs everything on one work-stealing runtime.
    let runtime = match config.server.workers {
        inferlb::workers::Workers::Shared => tokio::runtime::Runtime::new(),
        _ => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
    };
    let code = match runtime {
        Ok(runtime) => {
            let code = runtime.block_on(run(cli, config));
            // Tasks still running (a stream cut at the drain deadline) end here, before the
            // log is flushed, so their last lines are written too.
            runtime.shutdown_timeout(std::time::Duration::from_secs(1));
            code
        }
        Err(e) => {
            eprintln!("inferlb: cannot start the async runtime: {e}");
            ExitCode::from(1)
        }
    };
    // The log is written by a background thread (telemetry::log_writer): let it finish.
    telemetry::log_writer::flush(LOG_FLUSH_LIMIT);
    code
}

async fn run(cli: Cli, mut config: Config) -> ExitCode {
    // First of all, so no signal meets its default action from here on.
    let shutdown = shutdown_signal();
    let check = cli.check;
    let demo = cli.demo;
    let overrides = cli;
    // Keep the simulators alive for as long as the router runs.
    let _fleet = match demo {
        None => None,
        Some(n) => match start_demo_fleet(n, &mut config).await {
            Ok(fleet) => Some(fleet),
            Err(e) => {
                eprintln!("inferlb: --demo: {e}");
                return ExitCode::from(2);
            }
        },
    };
    telemetry::init_logging(config.log_format, &config.log_level);
    if let Err(e) = config
        .validate()
        .and_then(|_| inferlb::scheduling::profile::build_active(config.scheduling()).map(|_| ()))
    {
        eprintln!("inferlb: {e}");
        return ExitCode::from(2);
    }
    if check {
        println!("configuration is valid");
        return ExitCode::SUCCESS;
    }
    let main = match inferlb::workers::bind(config.listen, config.server.workers) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("inferlb: cannot listen on {}: {e}", config.listen);
            return ExitCode::from(1);
        }
    };
    let admin = match config.admin_listen {
        Some(addr) => match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => Some(l),
            Err(e) => {
                eprintln!("inferlb: cannot listen on {addr}: {e}");
                return ExitCode::from(1);
            }
        },
        None => None,
    };
    if demo.is_some() {
        let addr = main.local_addr().map(|a| a.to_string()).unwrap_or_default();
        println!("\ninferlb demo ready on http://{addr} — try:\n");
        println!(
            "  curl -N http://{addr}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{DEMO_MODEL}\",\"stream\":true,\"max_tokens\":32,\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}]}}'\n"
        );
        println!("  curl -s http://{addr}/admin/backends     # what the router sees");
        println!("  curl -s http://{addr}/metrics            # inferlb's own metrics\n");
    }
    let reloads = watch_for_reloads(overrides, demo.is_some());
    match run_reloadable(config, Listeners { main, admin }, shutdown, reloads).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("inferlb: {e}");
            ExitCode::from(1)
        }
    }
}
