//! Log output off the request path: formatted lines are appended to a shared buffer and a
//! dedicated thread writes whatever has gathered to stdout in one `write`.
//!
//! The access log is on at the default level, one line per request. Written straight to
//! stdout, each line is a `write(2)` (stdout is line-buffered) made by the worker thread that
//! served the request, in the middle of its work. Here a worker only copies its line into
//! memory under a short lock ([`append`]) and, as a rule, wakes nobody.
//!
//! The writer flushes on a short timer, like nginx's `access_log … buffer= flush=`: after each
//! write it gathers lines for [`FLUSH_INTERVAL`], then writes all of them at once; a logger
//! wakes it early only when [`FLUSH_BYTES`] are waiting. When a whole interval passes with
//! nothing logged the writer parks, and the next line wakes it and is written at once. So
//! **a line reaches stdout at most [`FLUSH_INTERVAL`] (10 ms) after it was logged**, plus the
//! time of the write before it; an idle router's lines go out immediately; a busy router makes
//! about 100 writes and writer wake-ups a second whatever its request rate. (The previous
//! design woke the writer whenever the buffer went from empty to non-empty, which at tens of
//! thousands of lines a second meant a futex wake per line and a writer thread on the CPU
//! for 7 % of the router's samples.)
//!
//! Nothing is dropped: when stdout cannot keep up and [`MAX_PENDING`] bytes are waiting, a
//! logging thread waits for the writer (the same back-pressure a blocking `write` gave).
//! [`flush`] writes what is waiting at once and waits (bounded) until everything logged so
//! far is written; the binary calls it before exiting.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, Once, PoisonError};
use std::time::{Duration, Instant};

/// Bytes waiting to be written beyond which a logging thread waits for the writer.
pub const MAX_PENDING: usize = 8 << 20;
/// How long the writer gathers lines after a write before the next one.
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(10);
/// Bytes waiting at which a logger wakes the writer before the interval is over.
pub const FLUSH_BYTES: usize = 64 << 10;

struct State {
    pending: Vec<u8>,
    /// The writer holds a batch it has not finished writing.
    writing: bool,
    /// The writer is parked until a line arrives (nothing came for a whole interval).
    idle: bool,
    /// [`flush`] asked for what is waiting to be written now.
    flush_now: bool,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled for the parked writer's first line, at [`FLUSH_BYTES`] and by [`flush`].
    work: Condvar,
    /// Signalled after each batch is written (room again; [`flush`] re-checks).
    written: Condvar,
}

impl Shared {
    const fn new() -> Self {
        Shared {
            state: Mutex::new(State {
                pending: Vec::new(),
                writing: false,
                idle: false,
                flush_now: false,
            }),
            work: Condvar::new(),
            written: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn append(&self, buf: &[u8]) {
        let mut state = self.lock();
        while state.pending.len() >= MAX_PENDING {
            state = self
                .written
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        let before = state.pending.len();
        state.pending.extend_from_slice(buf);
        let wake = (state.idle && before == 0)
            || (before < FLUSH_BYTES && state.pending.len() >= FLUSH_BYTES);
        drop(state);
        if wake {
            self.work.notify_one();
        }
    }

    /// Wait until everything appended so far is written, or `limit` has passed.
    fn flush(&self, limit: Duration) -> bool {
        let end = Instant::now() + limit;
        let mut state = self.lock();
        while !state.pending.is_empty() || state.writing {
            if !state.pending.is_empty() && !state.flush_now {
                state.flush_now = true;
                self.work.notify_one();
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            state = self
                .written
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }
}

/// Built at compile time, so the writer thread can never see it uninitialised.
static SHARED: Shared = Shared::new();
static STARTED: Once = Once::new();
/// The writer thread is running (if it could not be started, lines are written directly).
static RUNNING: AtomicBool = AtomicBool::new(false);

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
    let mut state = shared.lock();
    loop {
        // Gather for one interval (a flush request or a full buffer cuts it short) ...
        let end = Instant::now() + FLUSH_INTERVAL;
        while !state.flush_now && state.pending.len() < FLUSH_BYTES {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            state = shared
                .work
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        // ... and when nothing came in a whole interval, park until the next line.
        if state.pending.is_empty() {
            state.idle = true;
            while state.pending.is_empty() {
                state = shared
                    .work
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            state.idle = false;
        }
        state.flush_now = false;
        std::mem::swap(&mut state.pending, &mut batch);
        state.writing = true;
        drop(state);
        // A failed write (stdout closed) loses the batch, as a failed direct write did.
        let _ = out.write_all(&batch).and_then(|()| out.flush());
        batch.clear();
        // Do not keep a huge buffer after a burst.
        if batch.capacity() > MAX_PENDING {
            batch = Vec::new();
        }
        state = shared.lock();
        state.writing = false;
        shared.written.notify_all();
    }
}

/// Queue one or more whole lines for stdout.
pub fn append(buf: &[u8]) {
    let shared = shared();
    if !RUNNING.load(Ordering::Acquire) {
        let _ = std::io::stdout().write_all(buf);
        return;
    }
    shared.append(buf);
}

/// A `MakeWriter` for `tracing_subscriber::fmt`: every event's formatted line goes to the
/// shared buffer.
#[derive(Debug, Clone, Copy, Default)]
pub struct BufferedStdout;

impl Write for BufferedStdout {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        append(buf);
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

/// Write what is waiting now and wait until everything logged so far has been written, or
/// `limit` has passed. Returns whether it all was.
pub fn flush(limit: Duration) -> bool {
    if !STARTED.is_completed() {
        return true;
    }
    SHARED.flush(limit)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::Arc;

    /// Records each `write` call the writer thread makes.
    #[derive(Clone, Default)]
    struct Recorder(Arc<Mutex<Vec<Vec<u8>>>>);

    impl Write for Recorder {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().push(buf.to_vec());
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Recorder {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().concat()).unwrap()
        }
        fn writes(&self) -> usize {
            self.0.lock().unwrap().len()
        }
        /// Poll (bounded) until `n` lines have been written.
        fn wait_lines(&self, n: usize) {
            for _ in 0..5000 {
                if self.text().lines().count() >= n {
                    return;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            panic!("only {} of {n} lines written", self.text().lines().count());
        }
    }

    fn writer() -> (&'static Shared, Recorder) {
        let shared: &'static Shared = Box::leak(Box::new(Shared::new()));
        let out = Recorder::default();
        let to = out.clone();
        std::thread::spawn(move || write_loop(shared, to));
        (shared, out)
    }

    #[test]
    fn an_idle_writer_writes_a_line_without_waiting_for_more() {
        let (shared, out) = writer();
        shared.append(b"first\n");
        out.wait_lines(1);
        // Parked again after an interval with nothing logged: the next line wakes it.
        for _ in 0..5000 {
            if shared.lock().idle {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(shared.lock().idle);
        shared.append(b"second\n");
        out.wait_lines(2);
        assert_eq!(out.text(), "first\nsecond\n");
    }

    #[test]
    fn a_burst_is_written_in_a_few_batches_in_order_and_flush_waits_for_it() {
        let (shared, out) = writer();
        let mut want = String::new();
        for i in 0..2000 {
            let line = format!("log_writer test line {i}\n");
            shared.append(line.as_bytes());
            want.push_str(&line);
        }
        assert!(shared.flush(Duration::from_secs(10)));
        assert_eq!(out.text(), want);
        // 2000 lines (~50 KiB) logged back to back: the first line wakes the writer, the rest
        // wait for the interval or the flush; far fewer writes than lines.
        assert!(out.writes() <= 20, "{} writes for 2000 lines", out.writes());
        let state = shared.lock();
        assert!(state.pending.is_empty());
        assert!(!state.writing);
    }

    #[test]
    fn the_process_writer_takes_lines_and_flush_drains_it() {
        let mut w = BufferedStdout;
        for i in 0..100 {
            writeln!(w, "log_writer test line {i}").unwrap();
        }
        assert!(flush(Duration::from_secs(10)));
        let state = shared().lock();
        assert!(state.pending.is_empty());
        assert!(!state.writing);
    }
}
