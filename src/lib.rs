//! # inferlb — an LLM-aware load balancer for vLLM fleets
//!
//! inferlb takes OpenAI-compatible requests and sends each one to the backend that should
//! answer it fastest: the one that already holds the prompt's prefix in its KV cache, unless
//! that backend is too busy.
//!
//! # Layout (in the order a request meets it)
//!
//! * [`front_door`] — axum routes: `/v1/*`, `/health`, `/ready`, `/metrics`, `/admin/backends`,
//!   the status page `/admin` and `/admin/decisions` (`front_door::status`), the access log
//!   (`front_door::access`). Reads the body once, bounded, and turns every failure into OpenAI's
//!   error JSON via [`error`].
//! * [`prompt`] — parses the body once into a [`prompt::RequestView`]: model, stream flag and a
//!   deterministic *routing text* rendered from the messages or prompt, checking the fields it
//!   reads on the way (`prompt::fields`); multipart audio forms yield their `model` field only
//!   (`prompt::multipart`).
//! * [`tokenization`] — for models with a Hugging Face tokenizer configured, the prompt's token
//!   ids as vLLM computes them (chat template + tokenizer, crate `hf-tokenize`), with a prefix
//!   cache of repeated system prompts and turns; fills `RequestView.tokens`.
//! * [`scheduling`] — the plugin framework and the tower layer in front of forwarding: filters
//!   drop unfit backends, weighted scorers rank the rest, a picker chooses; lifecycle hooks
//!   let the prefix scorer remember where each prompt went.
//! * [`pd`] — prefill/decode disaggregation: per attempt, the rule that sends a long prompt's
//!   prefill to a `prefill` backend first and hands its KV params to the decode backend.
//! * [`responses`] — the Responses API's calls that name a response (`previous_response_id`,
//!   `/v1/responses/{id}…`) go to the backend holding it: a bounded id table learnt from the
//!   answers, and a bounded lookup round when the id is unknown.
//! * [`forward`] — hyper client with pooled keep-alive connections, plain TCP or TLS
//!   (`forward::tls`: rustls, per-CA client settings); streams the response back frame by frame
//!   and releases the backend's in-flight count when the body ends.
//!
//! Beside the request path:
//!
//! * [`endpoints`] — the backend pool, the per-backend poller of `/metrics` and `/v1/models`,
//!   the Prometheus text parser, and the immutable per-backend snapshots scorers read.
//! * [`kv_events`] — per backend, a ZeroMQ subscriber to its KV-cache events and the store of
//!   the token blocks it truly holds, read by the prefix scorer (precise prefix routing).
//! * [`workers`] — the request threads: one single-threaded runtime per core, each accepting
//!   on a `SO_REUSEPORT` socket of its own and keeping its own backend connections.
//! * [`config`] — the TOML configuration: composes the section each module owns (its struct,
//!   defaults and `validate`, e.g. `forward::config`, `discovery::config`, `front_door::serve`),
//!   loads the file and the flags' overrides, and reports errors by the field's path as a
//!   [`config_error::ConfigError`] (a leaf module, so sections need not import `config`).
//! * [`clock`] — the millisecond clock (monotonic, and wall-clock for labels) every module
//!   stamps with.
//! * [`telemetry`] — inferlb's own metrics and logging.

pub mod background;
pub mod clock;
pub mod config;
pub mod config_error;
pub mod discovery;
pub mod endpoints;
pub mod error;
pub mod forward;
pub mod front_door;
pub mod kv_events;
pub mod pd;
pub mod prompt;
pub mod reload;
pub mod responses;
pub mod scheduling;
pub mod telemetry;
pub mod tokenization;
pub mod workers;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;

use config::Config;
use config_error::ConfigError;
use endpoints::poller::Poller;
use endpoints::Pool;
use forward::Forwarder;
use front_door::AppState;
use scheduling::{Scheduler, SchedulerLayer};

/// Why the router could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Tokenizer(#[from] tokenization::LoadError),
}

/// The sockets the router serves on. `admin` carries `/metrics` and `/admin/*` when set;
/// otherwise they are served on `main`. With per-core workers (`[server] workers`), each
/// worker serves `main` from a socket of its own when `main` was bound with `SO_REUSEPORT`
/// ([`workers::bind`] does so), or else from a duplicate of it.
pub struct Listeners {
    pub main: TcpListener,
    pub admin: Option<TcpListener>,
}

/// Run the router until `shutdown` completes, then stop accepting and let in-flight
/// requests finish.
pub async fn run(
    config: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let (_keep, reloads) = tokio::sync::mpsc::channel(1);
    run_reloadable(config, listeners, shutdown, reloads).await
}

/// [`run`], applying every configuration received on `reloads` (see [`reload`]).
pub async fn run_reloadable(
    config: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send + 'static,
    mut reloads: tokio::sync::mpsc::Receiver<Config>,
) -> Result<(), RunError> {
    config.validate()?;
    let config = Arc::new(config);
    // Installed before the pool, whose backends keep metric handles.
    // Member gauges are refreshed on every poll: never idle them out faster than 3 polls.
    let idle = config
        .metrics_idle_timeout_ms
        .max(config.poller.interval_ms.saturating_mul(3));
    let metrics = telemetry::prometheus(Duration::from_millis(idle));
    let pool = Arc::new(Pool::from_config(&config)?);
    let profile = scheduling::profile::build_active(config.scheduling())?;
    tracing::info!(profile = %profile.describe(), backends = pool.backends().len(), "scheduling profile");
    for warning in profile.missing_signals(&config.backend_engines()) {
        tracing::warn!("{warning}");
    }

    let (stop_tx, stop_rx) = watch::channel(false);
    let poller = Poller::new(Arc::clone(&pool), config.poller.clone());
    poller.first_pass().await;
    poller.spawn(stop_rx.clone());
    // KV-event subscribers follow membership on a thread of their own; `[kv_events]` is read
    // at start-up (a reload does not change it).
    kv_events::subscriber::Subscribers::new(Arc::clone(&pool), config.kv_events.clone())
        .spawn(stop_rx.clone());
    if let Some(handle) = metrics.clone() {
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(5)) => handle.run_upkeep(),
                    _ = stop.changed() => break,
                }
            }
        });
    }

    let backend_header = http::HeaderName::from_bytes(config.backend_header.as_bytes())
        .map_err(|_| ConfigError::invalid("backend_header", "not a valid header name"))?;
    let decisions = Arc::clone(profile.decisions());
    let scheduler = Arc::new(Scheduler::new(Arc::clone(&pool), profile));
    let forwarder = Forwarder::new(
        &config.forward,
        &config.outlier_detection,
        backend_header.clone(),
        Arc::clone(&pool),
        config.server.workers.threads().unwrap_or(0),
    );
    {
        let (scheduler, forwarder) = (Arc::clone(&scheduler), forwarder.clone());
        pool.on_removed(Arc::new(move |backend| {
            scheduler.forget(backend);
            forwarder.forget(backend);
        }));
    }
    if let Some(source) = discovery::from_config(&config.discovery)? {
        tokio::spawn(discovery::run(source, Arc::clone(&pool), stop_rx.clone()));
    }
    let layer = SchedulerLayer::new(
        Arc::clone(&scheduler),
        &config.forward,
        &config.limits,
        &config.outlier_detection,
        &config.priority,
        &config.pd,
    );
    let service = tower::ServiceBuilder::new()
        .layer(layer.clone())
        .service(forwarder.clone());
    let state = Arc::new(AppState {
        config: arc_swap::ArcSwap::from_pointee(config.front_door()),
        pool,
        service,
        metrics,
        backend_header,
        auth: Arc::new(arc_swap::ArcSwap::from_pointee(
            front_door::auth::Auth::with_priorities(&config.auth, &config.priority)?,
        )),
        decisions,
        tokenizers: Arc::new(tokenization::Tokenizers::load(&config.tokenization)?),
        responses: Arc::new(responses::Lookup::new(&config.responses)),
    });
    let live = reload::Live {
        config: arc_swap::ArcSwap::new(Arc::clone(&config)),
        state: Arc::clone(&state),
        scheduler,
        layer,
        forwarder,
    };
    {
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    next = reloads.recv() => match next {
                        Some(next) => live.apply(next),
                        None => break,
                    },
                    _ = stop.changed() => break,
                }
            }
        });
    }

    let main_addr = listeners.main.local_addr()?;
    tracing::info!(%main_addr, "inferlb listening");
    let options = front_door::serve::ServeOptions {
        header_read_timeout: Duration::from_millis(config.server.header_read_timeout_ms),
        shutdown_timeout: Duration::from_millis(config.server.shutdown_timeout_ms),
        max_header_bytes: config.server.max_header_bytes,
        max_connections: config.limits.max_connections,
    };
    let main_routes = front_door::Routes::openai(Arc::clone(&state), listeners.admin.is_none());
    let admin = listeners.admin.map(|listener| {
        let router = front_door::admin_router(Arc::clone(&state));
        let mut stop = stop_rx.clone();
        tokio::spawn(front_door::serve::serve(
            listener,
            router.into(),
            options,
            async move {
                let _ = stop.changed().await;
            },
        ))
    });
    let mut stop = stop_rx;
    let shutdown = async move {
        tokio::select! {
            _ = shutdown => {}
            _ = stop.changed() => {}
        }
    };
    let drained = match config.server.workers.threads() {
        Some(n) => workers::serve(listeners.main, n, main_routes, options, shutdown).await?,
        None => front_door::serve::serve(listeners.main, main_routes, options, shutdown).await,
    };
    let _ = stop_tx.send(true);
    if let Some(admin) = admin {
        let _ = admin.await;
    }
    tracing::info!(drained, "inferlb stopped");
    Ok(())
}
