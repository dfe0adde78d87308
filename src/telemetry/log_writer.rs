//! Log output off the request path: formatted lines are appended to a shared buffer and a
//! dedicated thread writes whatever has gathered to stdout in one `write`.
//!
//! The access log is on at the default level, one line per request. Written straight to
//! stdout, each line is a `write(2)` (stdout is line-buffered) made by the worker thread that
//! served the request, in the middle of its work: at tens of thousands of requests a second
//! that was several percent of the router's CPU in `perf` and a blocking system call on the
//! request path. Here a worker only copies its line into memory under a short lock; the
//! writer thread wakes when the buffer goes from empty to non-empty, takes all of it and
//! writes it at once, so under load many lines share one system call, and when idle a line
//! still goes out at once (no timer, no added delay).
//!
//! Nothing is dropped: when stdout cannot keep up and [`MAX_PENDING`] bytes are waiting, a
//! logging thread waits for the writer (the same back-pressure a blocking `write` gave).
//! [`flush`] waits (bounded) until everything logged so far is written; the binary calls it
//! before exiting.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, Once, PoisonError};
use std::time::{Duration, Instant};

/// Bytes waiting to be written beyond which a logging thread waits for the writer.
pub const MAX_PENDING: usize = 8 << 20;

struct State {
    pending: Vec<u8>,
    /// The writer holds a batch it has not finished writing.
    writing: bool,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when `pending` becomes non-empty.
    work: Condvar,
    /// Signalled after each batch is written (room again; [`flush`] re-checks).
    written: Condvar,
}

/// Built at compile time, so the writer thread can never see it uninitialised.
static SHARED: Shared = Shared {
    state: Mutex::new(State {
        pending: Vec::new(),
        writing: false,
    }),
    work: Condvar::new(),
    written: Condvar::new(),
};
static STARTED: Once = Once::new();
/// The writer thread is running (if it could not be started, lines are written directly).
static RUNNING: AtomicBool = AtomicBool::new(false);

fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    shared.state.lock().unwrap_or_else(PoisonError::into_inner)
}

fn shared() -> &'static Shared {
    // Started with the first line; it lives as long as the process.
    STARTED.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("inferlb-log".into())
            .spawn(|| write_loop(&SHARED, std::io::stdout()));
        match spawned {
            Ok(_) => RUNNING.store(true, Ordering::Release),
            Err(e) => eprintln!("inferlb: cannot start the log writer thread: {e}"),
        }
    });
    &SHARED
}

fn write_loop(shared: &Shared, mut out: impl Write) {
    let mut batch = Vec::new();
    loop {
        {
            let mut state = lock(shared);
            state.writing = false;
            shared.written.notify_all();
            while state.pending.is_empty() {
                state = shared
                    .work
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            std::mem::swap(&mut state.pending, &mut batch);
            state.writing = true;
        }
        // A failed write (stdout closed) loses the batch, as a failed direct write did.
        let _ = out.write_all(&batch).and_then(|()| out.flush());
        batch.clear();
        // Do not keep a huge buffer after a burst.
        if batch.capacity() > MAX_PENDING {
            batch = Vec::new();
        }
    }
}

/// A `MakeWriter` for `tracing_subscriber::fmt`: every event's formatted line goes to the
/// shared buffer.
#[derive(Debug, Clone, Copy, Default)]
pub struct BufferedStdout;

impl Write for BufferedStdout {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let shared = shared();
        if !RUNNING.load(Ordering::Acquire) {
            return std::io::stdout().write(buf);
        }
        let mut state = lock(shared);
        while state.pending.len() >= MAX_PENDING {
            state = shared
                .written
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        let was_empty = state.pending.is_empty();
        state.pending.extend_from_slice(buf);
        drop(state);
        if was_empty {
            shared.work.notify_one();
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for BufferedStdout {
    type Writer = BufferedStdout;

    fn make_writer(&'a self) -> Self::Writer {
        *self
    }
}

/// Wait until everything logged so far has been written, or `limit` has passed. Returns
/// whether it all was.
pub fn flush(limit: Duration) -> bool {
    if !STARTED.is_completed() {
        return true;
    }
    let shared = &SHARED;
    let end = Instant::now() + limit;
    let mut state = lock(shared);
    while !state.pending.is_empty() || state.writing {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        state = shared
            .written
            .wait_timeout(state, left)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
    true
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn lines_are_written_in_order_and_flush_waits_for_them() {
        // The writer goes to the process's stdout; what is checked here is that every line is
        // taken, in order, and that flush sees the buffer drained.
        let mut w = BufferedStdout;
        for i in 0..1000 {
            writeln!(w, "log_writer test line {i}").unwrap();
        }
        assert!(flush(Duration::from_secs(10)));
        let state = lock(shared());
        assert!(state.pending.is_empty());
        assert!(!state.writing);
    }
}
