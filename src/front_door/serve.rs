//! The accept loop: hyper connections with a header-read timeout, and graceful draining.
//!
//! axum's `serve` hides the connection builder, and inferlb needs two of its knobs: a deadline
//! for reading request headers (a slow client must not hold a connection forever) and a drain
//! with a deadline (on shutdown: refuse new connections at once, let in-flight requests and
//! streams finish, and give up after `shutdown_timeout`).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tower::ServiceExt;

/// Connection-level settings.
#[derive(Debug, Clone, Copy)]
pub struct ServeOptions {
    pub header_read_timeout: Duration,
    pub shutdown_timeout: Duration,
}

/// Serve `router` on `listener` until `shutdown`, then drain. Returns whether the drain
/// finished before its deadline.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    options: ServeOptions,
    shutdown: impl Future<Output = ()>,
) -> bool {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(options.header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    let graceful = GracefulShutdown::new();
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
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
            req.extensions_mut().insert(ConnectInfo::<SocketAddr>(peer));
            let router = router.clone();
            async move { Ok::<_, Infallible>(router.oneshot(req).await.unwrap_or_else(|e| match e {})) }
        });
        let builder = builder.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            if let Err(e) = watcher.watch(conn).await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    // Closing the listener makes new connections fail at once.
    drop(listener);
    let open = graceful.count();
    if open > 0 {
        tracing::info!(connections = open, "draining");
    }
    tokio::select! {
        _ = graceful.shutdown() => true,
        _ = tokio::time::sleep(options.shutdown_timeout) => {
            tracing::warn!("drain deadline passed; closing remaining connections");
            false
        }
    }
}
