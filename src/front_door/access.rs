//! The access log: one structured line per proxied request, at INFO under the target
//! `inferlb::access` (so `log_level = "info,inferlb::access=off"` silences it, and
//! `--log-format json` makes each line one JSON object).
//!
//! The line is written when the response body ends (or the client goes away), so it carries
//! the time to the first body byte and the whole duration: request id, model (a label-safe
//! name: `other` unless some backend lists it), backend, status, scheduling decisions made
//! (`attempts`), prompt length and the prefix blocks matched on the chosen backend.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};

pub const TARGET: &str = "inferlb::access";

/// Is the access log wanted by the current filter? Checked once per request.
pub fn enabled() -> bool {
    tracing::enabled!(target: TARGET, tracing::Level::INFO)
}

/// What the front door knows about a request when its response headers are ready.
#[derive(Debug, Default)]
pub struct Entry {
    pub request_id: String,
    pub model: String,
    pub backend: String,
    pub status: u16,
    pub attempts: u32,
    pub prompt_bytes: usize,
    pub prefix_matched: Option<(u32, u32)>,
}

impl Entry {
    fn write(&self, received_at: Instant, first_byte: Option<Instant>, completed: bool) {
        let ms = |t: Instant| t.saturating_duration_since(received_at).as_secs_f64() * 1000.0;
        let (matched, blocks) = self.prefix_matched.unzip();
        tracing::info!(
            target: TARGET,
            request_id = %self.request_id,
            model = %self.model,
            backend = %self.backend,
            status = self.status,
            attempts = self.attempts,
            ttfb_ms = first_byte.map(ms),
            duration_ms = ms(Instant::now()),
            prompt_bytes = self.prompt_bytes,
            prefix_blocks_matched = matched,
            prefix_blocks = blocks,
            completed,
            "request"
        );
    }
}

/// Wrap `response` so its body writes `entry` when it ends or is dropped.
pub fn log_at_end(response: Response, entry: Entry, received_at: Instant) -> Response {
    let (parts, body) = response.into_parts();
    Response::from_parts(
        parts,
        Body::new(LoggedBody {
            inner: body,
            entry: Some(entry),
            received_at,
            first_byte: None,
        }),
    )
}

struct LoggedBody {
    inner: Body,
    /// Taken when the line is written, so it is written once.
    entry: Option<Entry>,
    received_at: Instant,
    first_byte: Option<Instant>,
}

impl LoggedBody {
    fn finish(&mut self, completed: bool) {
        if let Some(entry) = self.entry.take() {
            entry.write(self.received_at, self.first_byte, completed);
        }
    }
}

impl HttpBody for LoggedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if self.first_byte.is_none() && frame.data_ref().is_some_and(|d| !d.is_empty()) {
                    self.first_byte = Some(Instant::now());
                }
            }
            Poll::Ready(None) => self.finish(true),
            Poll::Ready(Some(Err(_))) => self.finish(false),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for LoggedBody {
    fn drop(&mut self) {
        // The client went away before the end (or the body was never polled to its end).
        let done = self.inner.is_end_stream();
        self.finish(done);
    }
}
