//! The accept loop: hyper connections with header limits, a cap on open connections, and
//! graceful draining (`drain`).
//!
//! axum's `serve` hides the connection builder, and inferlb needs its knobs: a deadline for
//! reading request headers (a slow client must not hold a connection forever), a bound on
//! their size (431 above it, before anything is parsed further), a cap on open connections,
//! and a drain with a deadline (on shutdown: refuse new connections at once, let in-flight
//! requests and streams finish, and give up after `shutdown_timeout`).
//!
//! A connection beyond the cap is accepted and closed at once. Leaving it in the kernel's
//! backlog instead would make the client wait for a connect timeout, and the backlog would
//! still fill; closing tells it right away to go elsewhere or retry.
//!
//! It owns the `[server]` section ([`ServerConfig`]: its defaults and checks).

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use super::drain::Drain;
use super::Routes;
use crate::config_error::ConfigError;
use crate::telemetry as t;

/// Connection-level settings.
#[derive(Debug, Clone, Copy)]
pub struct ServeOptions {
    pub header_read_timeout: Duration,
    pub shutdown_timeout: Duration,
    /// Largest request head (request line and headers) in bytes; larger ones get 431. HTTP/1
    /// takes it as hyper's read-buffer limit, so it is at least 8192 (hyper's minimum).
    pub max_header_bytes: usize,
    /// Open connections at once on this listener (0 = no limit).
    pub max_connections: usize,
}

/// hyper's smallest allowed HTTP/1 buffer limit.
pub const MIN_HEADER_BYTES: usize = 8192;

/// Serve `routes` on `listener` until `shutdown`, then drain. Returns whether the drain
/// finished before its deadline.
pub async fn serve(
    listener: TcpListener,
    routes: Routes,
    options: ServeOptions,
    shutdown: impl Future<Output = ()>,
) -> bool {
    let slots = connection_slots(options.max_connections);
    serve_with(listener, routes, options, slots, shutdown, log_draining).await
}

/// Announce a drain of `open` connections (the listener is closed by then).
pub fn log_draining(open: usize) {
    if open > 0 {
        tracing::info!(connections = open, "draining");
    }
}

/// The cap on open connections, `max_connections` slots (0 = none). The per-core workers
/// (`crate::workers`) share one, so the cap holds for the listener as a whole.
pub fn connection_slots(max_connections: usize) -> Option<Arc<Semaphore>> {
    (max_connections > 0).then(|| Arc::new(Semaphore::new(max_connections)))
}

/// [`serve`], taking connection slots from `slots`; `closed` is told how many connections
/// are open when the listener has been closed on shutdown (before the drain).
pub async fn serve_with(
    listener: TcpListener,
    routes: Routes,
    options: ServeOptions,
    slots: Option<Arc<Semaphore>>,
    shutdown: impl Future<Output = ()>,
    closed: impl FnOnce(usize),
) -> bool {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(options.header_read_timeout)
        // A head still incomplete when the buffer holds this much is answered with 431 and the
        // connection closed. (hyper-util's builder does not expose hyper's `max_header_size`;
        // the buffer limit has the same effect for heads, and a body is read through the
        // buffer in pieces, so it bounds nothing else.)
        .max_buf_size(options.max_header_bytes.max(MIN_HEADER_BYTES));
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(options.max_header_bytes).unwrap_or(u32::MAX));
    let drain = Drain::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // Out of file descriptors and the like: back off briefly instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        // Held by the connection's task for as long as the connection is open.
        let slot = match &slots {
            None => None,
            Some(slots) => match Arc::clone(slots).try_acquire_owned() {
                Ok(slot) => Some(slot),
                Err(_) => {
                    metrics::counter!(t::CONNECTIONS_REFUSED).increment(1);
                    tracing::debug!(%peer, limit = options.max_connections, "connection limit reached; closing");
                    drop(stream);
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let routes = routes.clone();
        let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            let routes = routes.clone();
            async move { Ok::<_, Infallible>(routes.call(req, peer).await) }
        });
        // Owned (the builder's settings cloned into it), so the task need not borrow it.
        let conn = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let watched = drain.watch(conn);
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(e) = watched.await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    // Closing the listener makes new connections fail at once.
    drop(listener);
    closed(drain.count());
    tokio::select! {
        _ = drain.shutdown() => true,
        _ = tokio::time::sleep(options.shutdown_timeout) => {
            tracing::warn!("drain deadline passed; closing remaining connections");
            false
        }
    }
}

/// `[server]`: the front door's connection handling.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// A client must send its request headers within this time.
    pub header_read_timeout_ms: u64,
    /// A client must send its whole request body within this time (408 otherwise).
    pub body_read_timeout_ms: u64,
    /// On SIGTERM/SIGINT, in-flight requests get this long to finish.
    pub shutdown_timeout_ms: u64,
    /// Deepest JSON nesting accepted in a request body (400 above it).
    pub max_json_depth: usize,
    /// Largest request line plus headers, in bytes (431 above it); at least 8192.
    pub max_header_bytes: usize,
    /// Request worker threads: `"auto"` (one per core), a number, or `"shared"` (one
    /// work-stealing runtime); see [`crate::workers`]. Read at start-up only.
    pub workers: crate::workers::Workers,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 30_000,
            shutdown_timeout_ms: 30_000,
            max_json_depth: 64,
            max_header_bytes: 65_536,
            workers: crate::workers::Workers::Auto,
        }
    }
}

impl ServerConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, v) in [
            ("server.header_read_timeout_ms", self.header_read_timeout_ms),
            ("server.body_read_timeout_ms", self.body_read_timeout_ms),
        ] {
            if v == 0 {
                return Err(ConfigError::invalid(field, "must be greater than 0"));
            }
        }
        if self.max_header_bytes < MIN_HEADER_BYTES {
            return Err(ConfigError::invalid(
                "server.max_header_bytes",
                format!("must be at least {MIN_HEADER_BYTES}"),
            ));
        }
        if self.max_json_depth == 0 {
            return Err(ConfigError::invalid(
                "server.max_json_depth",
                "must be at least 1",
            ));
        }
        Ok(())
    }
}
