//! Request workers: one single-threaded tokio runtime per core, each with its own listening
//! socket and its own share of the backend connection pool (nginx's worker model).
//!
//! With one work-stealing runtime, a request's client connection, its scheduling and its
//! backend connection hop between threads: a socket's readiness wakes whichever thread
//! parked in the I/O driver, idle threads are woken to steal, and every hop is a futex wake
//! and a context switch — on a small machine about as much kernel time as the proxying itself.
//! Here each worker thread runs a current-thread runtime that accepts its own connections
//! (a socket of its own bound with `SO_REUSEPORT`, so the kernel spreads new connections over
//! the workers; or, when the listener was bound without it, a duplicate of the one socket,
//! which the first idle worker accepts from), serves them, and takes backend connections only
//! from its own idle stacks (`forward::pool` keys them by [`current`]): a request never leaves
//! the thread that accepted it.
//!
//! What is shared stays shared and never waits: pool snapshots, the scheduler, metrics, the
//! configuration (arc-swap and atomics). The admin listener, reloads, discovery and metrics
//! upkeep run on the caller's runtime; the poller and the KV-event subscribers keep threads of
//! their own (`background`).
//!
//! `SO_REUSEPORT` lets any process of the same user bind the same port and take a share of
//! its connections (that is how a new binary can start beside an old one for a restart
//! without refusing connections); a second inferlb started on a port by mistake therefore does
//! not fail with "address in use" while per-core workers are on. `workers = "shared"` binds
//! without it.

use std::cell::Cell;
use std::future::Future;
use std::net::SocketAddr;

use serde::{Deserialize, Deserializer};
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::{oneshot, watch};

use crate::front_door::serve::{self, ServeOptions};

/// Most worker threads accepted (a typo guard, far above any core count served).
pub const MAX_WORKERS: usize = 1024;

/// `[server] workers`: how request handling is spread over threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Workers {
    /// One worker per core the process may run on.
    #[default]
    Auto,
    /// This many workers.
    Count(usize),
    /// One work-stealing runtime for everything (no per-core workers, no `SO_REUSEPORT`).
    Shared,
}

impl Workers {
    /// How many per-core workers to start, or `None` for the shared runtime.
    pub fn threads(self) -> Option<usize> {
        match self {
            Workers::Auto => Some(
                std::thread::available_parallelism()
                    .map(usize::from)
                    .unwrap_or(1),
            ),
            Workers::Count(n) => Some(n),
            Workers::Shared => None,
        }
    }
}

impl std::str::FromStr for Workers {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Workers::Auto),
            "shared" => Ok(Workers::Shared),
            n => match n.parse::<usize>() {
                Ok(n) if (1..=MAX_WORKERS).contains(&n) => Ok(Workers::Count(n)),
                _ => Err(format!(
                    "expected \"auto\", \"shared\" or a number of workers within 1..={MAX_WORKERS}, got `{s}`"
                )),
            },
        }
    }
}

impl std::fmt::Display for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Workers::Auto => f.write_str("auto"),
            Workers::Count(n) => write!(f, "{n}"),
            Workers::Shared => f.write_str("shared"),
        }
    }
}

impl<'de> Deserialize<'de> for Workers {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u64),
            Text(String),
        }
        let text = match Raw::deserialize(d)? {
            Raw::Number(n) => n.to_string(),
            Raw::Text(s) => s,
        };
        text.parse().map_err(serde::de::Error::custom)
    }
}

thread_local! {
    static WORKER: Cell<Option<usize>> = const { Cell::new(None) };
}

/// The index of the request worker running on this thread, if it is one.
pub fn current() -> Option<usize> {
    WORKER.with(Cell::get)
}

/// Bind `addr` for `workers`: with `SO_REUSEPORT` when there will be per-core workers (each
/// then binds a socket of its own beside this one), plainly otherwise. Must be called within
/// a tokio runtime.
pub fn bind(addr: SocketAddr, workers: Workers) -> std::io::Result<TcpListener> {
    let reuse_port = workers.threads().is_some_and(|n| n > 1);
    listen_socket(addr, reuse_port)
}

fn listen_socket(addr: SocketAddr, reuse_port: bool) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    // As `TcpListener::bind` does: a restart need not wait for TIME_WAIT sockets.
    #[cfg(unix)]
    socket.set_reuseaddr(true)?;
    #[cfg(all(unix, not(target_os = "solaris"), not(target_os = "illumos")))]
    if reuse_port {
        socket.set_reuseport(true)?;
    }
    #[cfg(not(all(unix, not(target_os = "solaris"), not(target_os = "illumos"))))]
    let _ = reuse_port;
    socket.bind(addr)?;
    socket.listen(1024)
}

/// One listening socket per worker: `first` and, for the others, sockets bound to the same
/// address with `SO_REUSEPORT` (when `first` has it), or else duplicates of `first`.
fn sockets_for(first: TcpListener, n: usize) -> std::io::Result<Vec<std::net::TcpListener>> {
    let addr = first.local_addr()?;
    let mut sockets = Vec::with_capacity(n);
    // A socket bound beside `first` succeeds only when `first` has SO_REUSEPORT too.
    let mut own = n > 1;
    for _ in 1..n {
        match listen_socket(addr, true).and_then(TcpListener::into_std) {
            Ok(s) => sockets.push(s),
            Err(e) => {
                tracing::debug!(error = %e, "no SO_REUSEPORT socket beside the listener; the workers share it");
                own = false;
                sockets.clear();
                break;
            }
        }
    }
    let first = first.into_std()?;
    if !own {
        for _ in 1..n {
            sockets.push(first.try_clone()?);
        }
    }
    sockets.insert(0, first);
    for s in &sockets {
        s.set_nonblocking(true)?;
    }
    Ok(sockets)
}

/// How far ahead a worker always has a timer due ([`timer_floor`]): below the request
/// timeouts (header read 10 s by default), so registering one of them never wakes the driver.
const TIMER_FLOOR: std::time::Duration = std::time::Duration::from_secs(1);

/// Keep a timer pending on the worker's runtime at all times, due within [`TIMER_FLOOR`].
///
/// tokio wakes its I/O driver (an `eventfd` write, then an early return from the next
/// `epoll_wait`) whenever a timer is registered that is due before the earliest one known when
/// the thread last parked, and with no timer pending at that park any first registration
/// does: under load, each request head's read timeout after the worker had been idle for a
/// moment. That was 0.21 `write` calls per proxied request (perf stat, wrk -c64 non-streaming;
/// the bare hyper proxy, which sets no timeouts, made none). With this timer pending the
/// earliest known wake-up is never more than a second away, so the request timers, due
/// later, register without waking anyone; it costs one wake-up per worker per second.
async fn timer_floor() {
    loop {
        tokio::time::sleep(TIMER_FLOOR).await;
    }
}

/// Serve `routes` on `listener` with `n` per-core workers until `shutdown`, then let every
/// worker drain (each within `options.shutdown_timeout`). Returns whether all drained in
/// time. Dropping the returned future stops the workers too. `max_connections` holds for the
/// listener as a whole.
pub async fn serve(
    listener: TcpListener,
    n: usize,
    routes: crate::front_door::Routes,
    options: ServeOptions,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<bool> {
    let sockets = sockets_for(listener, n.max(1))?;
    let slots = serve::connection_slots(options.max_connections);
    // Dropped with this future: the workers see the sender gone and drain.
    let (stop_tx, stop_rx) = watch::channel(false);
    // Each worker's open connections once its socket is closed: `draining` is logged when
    // every socket is, so from then on new connections are refused.
    let (closed_tx, mut closed_rx) = tokio::sync::mpsc::unbounded_channel::<usize>();
    let mut done = Vec::with_capacity(sockets.len());
    for (i, socket) in sockets.into_iter().enumerate() {
        let (tx, rx) = oneshot::channel();
        done.push(rx);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (routes, slots, mut stop) = (routes.clone(), slots.clone(), stop_rx.clone());
        let closed_tx = closed_tx.clone();
        std::thread::Builder::new()
            .name(format!("inferlb-worker-{i}"))
            .spawn(move || {
                WORKER.with(|w| w.set(Some(i)));
                let drained = runtime.block_on(async move {
                    // Dropped with the runtime.
                    tokio::spawn(timer_floor());
                    let listener = match TcpListener::from_std(socket) {
                        Ok(l) => l,
                        Err(e) => {
                            tracing::error!(worker = i, error = %e, "worker cannot use its listener");
                            return false;
                        }
                    };
                    let stop = async move {
                        // A change or the sender gone: either way, stop.
                        let _ = stop.changed().await;
                    };
                    let closed = move |open| {
                        let _ = closed_tx.send(open);
                    };
                    serve::serve_with(listener, routes, options, slots, stop, closed).await
                });
                // Connections still open past the drain deadline are closed here, with the
                // runtime.
                drop(runtime);
                let _ = tx.send(drained);
            })?;
    }
    tracing::info!(workers = done.len(), "request workers started");
    drop(closed_tx);
    shutdown.await;
    let _ = stop_tx.send(true);
    let mut open = 0usize;
    // Ends when every worker has reported (or ended without: a worker that failed).
    while let Some(n) = closed_rx.recv().await {
        open = open.saturating_add(n);
    }
    serve::log_draining(open);
    let mut all = true;
    for (i, rx) in done.into_iter().enumerate() {
        match rx.await {
            Ok(drained) => all &= drained,
            Err(_) => {
                tracing::error!(
                    worker = i,
                    "request worker ended without reporting (panicked)"
                );
                all = false;
            }
        }
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn workers_parse_from_text_and_numbers() {
        assert_eq!("auto".parse::<Workers>().unwrap(), Workers::Auto);
        assert_eq!("shared".parse::<Workers>().unwrap(), Workers::Shared);
        assert_eq!("3".parse::<Workers>().unwrap(), Workers::Count(3));
        for bad in ["0", "1025", "-1", "many", ""] {
            assert!(bad.parse::<Workers>().is_err(), "{bad}");
        }
        #[derive(Deserialize)]
        struct S {
            w: Workers,
        }
        let s: S = toml::from_str("w = 4").unwrap();
        assert_eq!(s.w, Workers::Count(4));
        let s: S = toml::from_str("w = \"auto\"").unwrap();
        assert_eq!(s.w, Workers::Auto);
        let e = toml::from_str::<S>("w = 0").err().unwrap().to_string();
        assert!(e.contains("1..=1024"), "{e}");
        assert!(Workers::Auto.threads().unwrap() >= 1);
        assert_eq!(Workers::Shared.threads(), None);
    }

    #[tokio::test]
    async fn reuseport_sockets_share_one_port_and_plain_ones_are_duplicated() {
        let first = bind("127.0.0.1:0".parse().unwrap(), Workers::Count(3)).unwrap();
        let port = first.local_addr().unwrap().port();
        let sockets = sockets_for(first, 3).unwrap();
        assert_eq!(sockets.len(), 3);
        assert!(sockets
            .iter()
            .all(|s| s.local_addr().unwrap().port() == port));
        // Without SO_REUSEPORT, the same socket three times.
        let plain = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = plain.local_addr().unwrap().port();
        let sockets = sockets_for(plain, 3).unwrap();
        assert_eq!(sockets.len(), 3);
        assert!(sockets
            .iter()
            .all(|s| s.local_addr().unwrap().port() == port));
        // And a plain socket really refuses a SO_REUSEPORT neighbour (what the fallback keys on).
        let plain = TcpListener::bind("127.0.0.1:0").await.unwrap();
        assert!(listen_socket(plain.local_addr().unwrap(), true).is_err());
    }
}
