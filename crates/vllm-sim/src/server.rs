//! Server: the accept loop, which (unlike `axum::serve`) can let go of its listening socket.
//!
//! The `refuse_connections` fault needs a server that really stops listening — so that
//! connects are refused, as when a backend process dies — and drops its open keep-alive
//! connections, then later binds the same address again. So this loop owns the
//! `TcpListener` as an `Option`, watches the fault state, and runs each connection with
//! hyper's HTTP/1 server in a task that also watches a "kill" signal. Dropping a connection
//! drops its in-flight handlers and bodies, whose guards abort their requests in the engine.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tower_service::Service;

use crate::faults::Faults;

/// How often re-binding a just-closed port is tried before giving up on this attempt.
const REBIND_TRIES: u32 = 50;

/// Serves `app` on `listener` until `shutdown` completes, obeying the listener faults.
pub async fn accept_loop(
    listener: TcpListener,
    app: Router,
    faults: Faults,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let addr = listener.local_addr()?;
    let mut listener = Some(listener);
    let mut refuse = faults.refuse_watch();
    let (stop_tx, stop_rx) = watch::channel(false);
    faults.set_listening(true);
    tokio::pin!(shutdown);
    loop {
        let want_open = !*refuse.borrow_and_update();
        if want_open && listener.is_none() {
            listener = rebind(addr).await;
            faults.set_listening(listener.is_some());
        } else if !want_open && listener.is_some() {
            listener = None;
            faults.set_listening(false);
        }
        tokio::select! {
            () = &mut shutdown => break,
            changed = refuse.changed() => {
                if changed.is_err() {
                    break;
                }
            }
            accepted = accept(listener.as_ref()) => match accepted {
                Ok((stream, _)) => {
                    // Subscribe to kills before reading the refusal: `refuse_connections`
                    // sets the refusal first and kills second, so a connection accepted as the
                    // port closes either finds the refusal here and is dropped, or was
                    // subscribed before the kill and sees it. (Subscribed alone, one accepted
                    // just after the kill took it for already seen and stayed open.)
                    let kill = faults.kill_watch();
                    if !*refuse.borrow() {
                        spawn_connection(stream, app.clone(), kill, stop_rx.clone());
                    }
                }
                Err(e) => {
                    // EMFILE and friends: back off briefly instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
        }
    }
    faults.set_listening(false);
    let _ = stop_tx.send(true);
    Ok(())
}

async fn accept(listener: Option<&TcpListener>) -> io::Result<(TcpStream, SocketAddr)> {
    match listener {
        Some(l) => l.accept().await,
        None => std::future::pending().await,
    }
}

/// Binds `addr` again; a port just released can be briefly unavailable, so retry a little.
async fn rebind(addr: SocketAddr) -> Option<TcpListener> {
    for attempt in 0..REBIND_TRIES {
        match TcpListener::bind(addr).await {
            Ok(l) => return Some(l),
            Err(e) if attempt + 1 == REBIND_TRIES => {
                tracing::error!(%addr, error = %e, "could not re-bind");
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    None
}

fn spawn_connection(
    stream: TcpStream,
    app: Router,
    mut kill: watch::Receiver<u64>,
    mut stop: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    tokio::spawn(async move {
        let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
            let mut app = app.clone();
            async move { app.call(req.map(axum::body::Body::new)).await }
        });
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .serve_connection(TokioIo::new(stream), svc);
        tokio::select! {
            _ = conn => {}
            _ = kill.changed() => {}
            _ = stop.changed() => {}
        }
    });
}
