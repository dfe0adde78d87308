//! Graceful draining of the front door's connections: on shutdown each open connection is told
//! to finish what it is serving and close, and the drain ends when the last one has.
//!
//! This is what hyper-util's `GracefulShutdown` does, at a lower cost per request. Its
//! per-connection future polls the shutdown signal (a `watch` receiver's `changed()`) every
//! time the connection is polled, about four times per proxied request: ~740 instructions a
//! request in its own functions under `bench/instr_per_request.sh`, and 1.2k fewer in all
//! once it went (9aef706). Here the signal is polled once, when the
//! connection is first polled, so that its task is woken when the drain starts; after that a
//! flag set before the signal is sent is read instead, one atomic load per poll. A task the
//! signal wakes reads the flag set, so an idle keep-alive connection is closed at once, as
//! before.

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use hyper_util::server::graceful::GracefulConnection;
use tokio::sync::watch;

/// The drain of one listener's connections.
pub struct Drain {
    /// Set before the signal is sent: a connection polled for any reason sees it.
    started: Arc<AtomicBool>,
    /// The signal. Every connection holds a receiver until it ends, so the receivers count
    /// the open connections and `closed()` waits for the last.
    signal: watch::Sender<()>,
}

impl Drain {
    pub fn new() -> Self {
        Drain {
            started: Arc::new(AtomicBool::new(false)),
            signal: watch::Sender::new(()),
        }
    }

    /// `conn`, shut down gracefully once the drain starts.
    pub fn watch<C: GracefulConnection>(
        &self,
        conn: C,
    ) -> impl Future<Output = Result<(), C::Error>> {
        let mut signal = self.signal.subscribe();
        let started = Arc::clone(&self.started);
        async move {
            let mut conn = pin!(conn);
            let mut changed = pin!(signal.changed());
            let mut registered = false;
            let mut shut = false;
            std::future::poll_fn(|cx| {
                if !shut {
                    // The first poll leaves this task's waker with the signal (a task keeps
                    // one waker, so once is enough); after that the flag stands in for it.
                    let signalled = !registered && changed.as_mut().poll(cx).is_ready();
                    registered = true;
                    if signalled || started.load(Ordering::Acquire) {
                        shut = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
                conn.as_mut().poll(cx)
            })
            .await
        }
    }

    /// Connections open now.
    pub fn count(&self) -> usize {
        self.signal.receiver_count()
    }

    /// Tell every connection to finish, then wait until all have closed.
    pub async fn shutdown(self) {
        self.started.store(true, Ordering::Release);
        // No receiver left is fine: nothing to drain.
        let _ = self.signal.send(());
        self.signal.closed().await;
    }
}
