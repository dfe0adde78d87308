//! vllm-sim: a vLLM stand-in whose behaviour under load makes routing decisions matter.
//!
//! No GPU is needed: prompts that hit the prefix cache start faster, a server whose KV cache
//! is full queues requests, a busy batch decodes slower — all from a simulated engine that
//! speaks vLLM's OpenAI API and exposes vLLM's Prometheus metrics.
//!
//! # Layout
//!
//! In the order a request meets them:
//!
//! * [`server`] — the accept loop; it can close and re-bind its port for the connection faults.
//! * [`api`] — axum routes: OpenAI generation (whole and SSE), models, tokenizer, metrics, the
//!   probes SGLang's and vLLM's routers send to workers, `/sim/*` admin endpoints, and the P/D
//!   legs (`kv_transfer_params`) with their loopback side channel, and OpenAI's Responses API
//!   (`/v1/responses`: create, retrieve, cancel, background, `previous_response_id`) with
//!   vLLM's in-memory store (`--responses-store`).
//! * [`tokenizer`] — the deterministic ~4-bytes-per-token tokenizer and the chat template.
//! * [`engine`] — one task per server running the step loop in simulated time.
//! * [`scheduler`] — continuous batching, chunked prefill, FIFO admission, preemption.
//! * [`kv_cache`] — the block pool with reference counts, chain hashes and LRU prefix caching.
//! * [`kv_holds`] — P/D: a prefill's blocks held for a decode server's pull, or until a lease.
//! * [`kv_events`] — vLLM's `--kv-events-config`: the pool's stores, evictions and resets
//!   published over ZeroMQ in vLLM 0.32's msgpack encoding, with replay and stream faults.
//! * [`cost`] — the step-time model, calibrated to Llama-3.1-8B on one H100.
//! * [`metrics`] — counters and histograms rendered exactly as vLLM 0.32's `/metrics`.
//! * [`faults`] — runtime-switchable failures (500s, slow/hung/garbage metrics, stalls, cut
//!   streams, refused connections, dropped/stalled KV events, engine restarts, dying
//!   prefills, refused or broken KV pulls).
//! * [`config`] — every flag, shared by the library and the `vllm-sim` binary.
//!
//! # Use from tests
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! let sim = vllm_sim::spawn(vllm_sim::SimConfig { time_scale: 50.0, ..Default::default() }).await?;
//! let url = format!("{}/v1/completions", sim.url());
//! // ... send requests to `url`, read `sim.stats()` or `/metrics` ...
//! sim.faults().set_fail_rate(1.0); // every completion now fails with 500
//! sim.shutdown().await;
//! # Ok(()) }
//! ```

pub mod api;
pub mod config;
pub mod cost;
pub mod engine;
pub mod faults;
pub mod kv_cache;
pub mod kv_events;
pub mod kv_holds;
pub mod metrics;
pub mod scheduler;
pub mod server;
pub mod tokenizer;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

pub use config::{LoraModule, SimConfig};
pub use cost::CostModel;
pub use engine::Stats;
pub use faults::{FaultPatch, FaultSnapshot, Faults};
pub use kv_events::publisher::KvStats;
pub use kv_events::KvEventsConfig;

use api::{AppState, KvInfo};
use engine::{EngineConfig, KvSink, Shared};
use kv_events::encode::Encoder;
use kv_events::publisher::{self as kv_publisher, StallPlan};
use metrics::PageInfo;
use scheduler::Limits;

type Task = Pin<Box<dyn Future<Output = ()> + Send>>;

/// How long a stopping simulator waits for its event publisher to close its sockets.
const PUBLISHER_CLOSE: Duration = Duration::from_secs(2);

/// A simulator built (engine ready, KV-event sockets bound) but not yet serving; the binary
/// uses it to print the bound event endpoint before serving.
pub struct Sim {
    state: AppState,
    engine: Task,
    publisher: Option<Task>,
}

impl Sim {
    /// Validates `config`, binds the KV-event sockets (if configured) and builds the engine;
    /// `addr` is the address `listener` (given to [`Sim::run`]) is bound to.
    pub async fn build(config: SimConfig, addr: SocketAddr) -> io::Result<Self> {
        config
            .validate()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        let names = config.model_names();
        let kv_engine_id = config
            .kv_engine_id
            .clone()
            .unwrap_or_else(api::pd::random_engine_id);
        let hf = match &config.tokenizer {
            Some(dir) => Some(std::sync::Arc::new(
                hf_tokenize::HfTokenizer::from_dir(dir)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?,
            )),
            None => None,
        };
        let faults = Faults::new();
        faults.set_fail_rate(config.fail_rate);
        faults.set_metrics_delay(Duration::from_millis(config.metrics_delay_ms));
        faults.set_metrics_hang(config.metrics_hang);
        faults.set_metrics_garbage(config.metrics_garbage);
        faults.set_first_token_stall(Duration::from_millis(config.first_token_stall_ms));
        faults.set_cut_stream_after(config.cut_stream_after.map(u64::from));
        faults.set_refuse_after(config.refuse_after);
        // The caller's listener is bound already: connects succeed from now on.
        faults.set_listening(true);
        let lora_names: Vec<String> = config.lora_modules.iter().map(|l| l.name.clone()).collect();
        let publisher = match &config.kv_events_config {
            Some(kv) if kv.publishes() => {
                let encoder = Encoder {
                    block_size: config.block_size as u64,
                    loras: lora_names.clone(),
                };
                let stall = StallPlan {
                    after: config.kv_events_stall_after,
                    ms: config.kv_events_stall_ms,
                };
                faults.set_kv_drop_rate(config.kv_events_drop_rate);
                let host = addr.ip().to_string();
                Some(kv_publisher::start(kv, &host, encoder, faults.clone(), stall).await?)
            }
            _ => None,
        };
        let kv_sink = publisher.as_ref().map(|p| KvSink {
            tx: p.tx.clone(),
            stats: p.stats.clone(),
            restart_after: config.kv_events_restart_after,
        });
        let kv_info = publisher.as_ref().map(|p| KvInfo {
            resolved: p.resolved.clone(),
            dial: p.dial.clone(),
            stats: p.stats.clone(),
        });
        let time_scale = if config.instant {
            1.0
        } else {
            config.time_scale
        };
        let (engine_handle, engine) = engine::start(EngineConfig {
            limits: Limits {
                block_size: config.block_size,
                max_num_seqs: config.max_num_seqs,
                max_num_batched_tokens: config.max_num_batched_tokens,
                max_loras: config.max_loras,
            },
            num_blocks: config.num_gpu_blocks,
            cost: config.cost_model(),
            time_scale,
            max_model_len: config.max_model_len,
            lora_names,
            kv: kv_sink,
            kv_lease: Duration::from_millis(config.kv_lease_ms),
        });
        let page_info = PageInfo {
            model_name: names[0].clone(),
            block_size: config.block_size,
            num_gpu_blocks: config.num_gpu_blocks,
            max_model_len: config.max_model_len,
            max_loras: config.max_loras,
            lora_enabled: !config.lora_modules.is_empty(),
            gpu_cache_usage_metric: config.gpu_cache_usage_metric,
            created: metrics::unix_now(),
        };
        let responses = api::responses::store::Store::new(
            config.responses_store_limit,
            engine_handle.shared.clone(),
        );
        let state = AppState::new(api::Inner {
            config,
            names,
            engine: engine_handle,
            faults,
            page_info,
            addr,
            hf,
            kv: kv_info,
            kv_engine_id,
            responses,
        });
        Ok(Self {
            state,
            engine: Box::pin(engine),
            publisher: publisher.map(|p| p.task),
        })
    }

    /// The KV-event PUB endpoint as bound (a dialable address), when events are published.
    pub fn kv_events_endpoint(&self) -> Option<String> {
        self.state.kv.as_ref().map(|k| k.dial.0.clone())
    }

    /// Serves on `listener` (and `admin`, with the admin routes) until `shutdown` completes.
    pub async fn run(
        self,
        listener: TcpListener,
        admin: Option<TcpListener>,
        shutdown: impl Future<Output = ()>,
    ) -> io::Result<()> {
        let engine = AbortOnDrop(tokio::spawn(self.engine));
        let publisher = self.publisher.map(|p| AbortOnDrop(tokio::spawn(p)));
        let (admin_stop, admin_rx) = watch::channel(());
        let _admin = match admin {
            Some(admin) => {
                let mut rx = admin_rx.clone();
                let app = api::admin_router(self.state.clone());
                // The admin port has its own (never-set) faults: it must stay reachable.
                let task = server::accept_loop(admin, app, Faults::new(), async move {
                    let _ = rx.changed().await;
                });
                Some(AbortOnDrop(tokio::spawn(async move {
                    let _ = task.await;
                })))
            }
            None => None,
        };
        let app = api::router(self.state.clone());
        let result = server::accept_loop(listener, app, self.state.faults.clone(), shutdown).await;
        drop(admin_stop);
        drop(engine);
        if let Some(mut p) = publisher {
            // The engine's end of the queue is gone: the publisher closes its sockets and ends.
            let _ = tokio::time::timeout(PUBLISHER_CLOSE, &mut p.0).await;
        }
        result
    }
}

/// Aborts a task when dropped, so a stopped server leaves no engine behind.
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Serves one simulator on `listener` until `shutdown` completes. With `config.admin_port`
/// set, the admin routes are also served on that port of `config.host`.
pub async fn serve(
    listener: TcpListener,
    config: SimConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let admin = match config.admin_port {
        Some(port) => Some(TcpListener::bind((config.host.as_str(), port)).await?),
        None => None,
    };
    serve_with_admin(listener, admin, config, shutdown).await
}

/// Like [`serve`], with the admin listener (`/health`, `/sim/*`) bound by the caller, so it
/// can be bound to port 0 and its address printed. `config.admin_port` is ignored.
pub async fn serve_with_admin(
    listener: TcpListener,
    admin: Option<TcpListener>,
    config: SimConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let sim = Sim::build(config, listener.local_addr()?).await?;
    sim.run(listener, admin, shutdown).await
}

/// A simulator running in a background task; it stops when dropped or on [`shutdown`].
///
/// [`shutdown`]: SimHandle::shutdown
#[derive(Debug)]
pub struct SimHandle {
    addr: SocketAddr,
    admin_addr: Option<SocketAddr>,
    state: AppState,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<io::Result<()>>>,
}

/// Starts a simulator on 127.0.0.1:0 (`config.host` and `config.port` are ignored; with
/// `config.admin_port` set, the admin port is also bound on 127.0.0.1:0, see
/// [`SimHandle::admin_addr`]).
pub async fn spawn(config: SimConfig) -> io::Result<SimHandle> {
    let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
    let addr = listener.local_addr()?;
    let admin = match config.admin_port {
        Some(_) => Some(TcpListener::bind(("127.0.0.1", 0)).await?),
        None => None,
    };
    let admin_addr = admin.as_ref().map(TcpListener::local_addr).transpose()?;
    let sim = Sim::build(config, addr).await?;
    let state = sim.state.clone();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(sim.run(listener, admin, async move {
        let _ = stopped.await;
    }));
    Ok(SimHandle {
        addr,
        admin_addr,
        state,
        stop: Some(stop),
        task: Some(task),
    })
}

/// Starts `n` simulators (a "fleet") with the same configuration, each on its own port.
pub async fn spawn_fleet(n: usize, config: SimConfig) -> io::Result<Vec<SimHandle>> {
    let mut fleet = Vec::with_capacity(n);
    for _ in 0..n {
        fleet.push(spawn(config.clone()).await?);
    }
    Ok(fleet)
}

impl SimHandle {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Address of the admin port (only when `config.admin_port` was set); it keeps answering
    /// `/health` and `/sim/*` while the main port refuses connections.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    /// Runtime fault control.
    pub fn faults(&self) -> &Faults {
        &self.state.faults
    }

    /// The KV-event PUB endpoint as bound (`tcp://127.0.0.1:PORT` for `tcp://*:0`), when events
    /// are published.
    pub fn kv_events_endpoint(&self) -> Option<String> {
        self.state.kv.as_ref().map(|k| k.dial.0.clone())
    }

    /// The KV-event replay (ROUTER) endpoint as bound, when configured.
    pub fn kv_replay_endpoint(&self) -> Option<String> {
        self.state.kv.as_ref().and_then(|k| k.dial.1.clone())
    }

    /// Counters of the KV-event stream, when events are published.
    pub fn kv_stats(&self) -> Option<KvStats> {
        self.state.kv.as_ref().map(|k| k.stats.snapshot())
    }

    /// vLLM's `POST /reset_prefix_cache`: true if the prefix cache was dropped.
    pub async fn reset_prefix_cache(&self, reset_running: bool) -> bool {
        self.state.engine.reset_prefix_cache(reset_running).await
    }

    /// The restart fault: running requests preempted, cache wiped, KV-event sequence back to 0.
    pub fn restart_engine(&self) {
        self.state.engine.restart();
    }

    /// The engine's counters and gauges now.
    pub fn stats(&self) -> Stats {
        self.state.engine.shared.stats()
    }

    /// Waits (at most `timeout`) until `pred` holds on the engine's stats; returns the last
    /// stats seen and whether it held. Woken by the engine after each change, no polling.
    pub async fn wait_for_stats(
        &self,
        timeout: Duration,
        pred: impl Fn(&Stats) -> bool,
    ) -> (Stats, bool) {
        self.state.engine.shared.wait_for(timeout, pred).await
    }

    /// The `/metrics` page as it would be served now (without metrics faults).
    pub fn metrics_text(&self) -> String {
        let m = self.state.engine.shared.metrics();
        metrics::render(&m, &self.state.page_info)
    }

    /// The value of the first sample of `name` on [`Self::metrics_text`] that carries every
    /// one of `labels` (`None`: no such sample).
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.metrics_text().lines().find_map(|l| {
            let (n, rest) = l.split_once('{').unwrap_or((l.split(' ').next()?, ""));
            let wanted = n == name
                && labels
                    .iter()
                    .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
            wanted.then(|| l.rsplit(' ').next()?.parse().ok()).flatten()
        })
    }

    /// The Responses API object stored under `id` (`--responses-store`), as `GET
    /// /v1/responses/{id}` would answer it; `None` when this server does not hold it.
    pub fn stored_response(&self, id: &str) -> Option<serde_json::Value> {
        let obj = self.state.responses.response(id)?;
        serde_json::to_value(obj).ok()
    }

    /// Shared engine state, for advanced observers.
    pub fn shared(&self) -> &std::sync::Arc<Shared> {
        &self.state.engine.shared
    }

    /// Stops the server and waits until it has let go of its port.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for SimHandle {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}
