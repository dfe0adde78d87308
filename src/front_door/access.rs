//! The access log: one structured line per proxied request, at INFO under the target
//! `inferlb::access` (so `log_level = "info,inferlb::access=off"` silences it, and
//! `--log-format json` makes each line one JSON object).
//!
//! The line is written when the response body ends (or the client goes away), so it carries
//! the time to the first body byte and the whole duration: request id, model (a label-safe
//! name: `other` unless some backend lists it), backend, status, scheduling decisions made
//! (`attempts`), prompt length, the prefix blocks matched on the chosen backend and, for
//! prefill/decode disaggregation, the path taken (`pd`) and the prefill backend.
//!
//! The filter decides whether the line is wanted ([`enabled`], a `tracing` check); the line
//! itself is laid out by hand (`telemetry::line`, in the subscriber's text or JSON layout) and
//! queued for the log writer thread, which is what one line per request costs least.

use std::cell::RefCell;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use axum::http::HeaderValue;
use axum::response::Response;
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};

use crate::telemetry::{line, log_writer};

pub const TARGET: &str = "inferlb::access";

/// Is the access log wanted by the current filter? Checked once per request.
pub fn enabled() -> bool {
    tracing::enabled!(target: TARGET, tracing::Level::INFO)
}

/// What the front door knows about a request when its response headers are ready.
#[derive(Debug, Default)]
pub struct Entry {
    /// The request's id as sent upstream (`""` when it is not printable ASCII).
    pub request_id: Option<HeaderValue>,
    pub model: String,
    /// The backend header of the response (`none` when no backend answered).
    pub backend: Option<HeaderValue>,
    pub status: u16,
    pub attempts: u32,
    pub prompt_bytes: usize,
    pub prefix_matched: Option<(u32, u32)>,
    /// The prefill/decode path, when `[pd]` applied.
    pub pd: Option<crate::scheduling::profile::decisions::PdStep>,
}

thread_local! {
    /// Each worker thread's line buffer, reused from request to request.
    static LINE: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

fn header_str<'a>(v: Option<&'a HeaderValue>, default: &'a str) -> &'a str {
    v.and_then(|v| v.to_str().ok()).unwrap_or(default)
}

impl Entry {
    fn write(&self, received_at: Instant, first_byte: Option<Instant>, completed: bool) {
        let now = Instant::now();
        LINE.with_borrow_mut(|buf| {
            buf.clear();
            self.format(buf, received_at, first_byte, now, completed);
            log_writer::append(buf);
            // A line is a few hundred bytes; do not keep an outlier's buffer.
            if buf.capacity() > 16 << 10 {
                *buf = Vec::new();
            }
        });
    }

    fn format(
        &self,
        buf: &mut Vec<u8>,
        received_at: Instant,
        first_byte: Option<Instant>,
        now: Instant,
        completed: bool,
    ) {
        let mut l = line::Line::start(buf, line::style(), "INFO", TARGET, "request");
        l.str("request_id", header_str(self.request_id.as_ref(), ""))
            .str("model", &self.model)
            .str("backend", header_str(self.backend.as_ref(), "none"))
            .u64("status", u64::from(self.status))
            .u64("attempts", u64::from(self.attempts));
        if let Some(t) = first_byte {
            l.millis("ttfb_ms", t.saturating_duration_since(received_at));
        }
        l.millis("duration_ms", now.saturating_duration_since(received_at))
            .u64("prompt_bytes", self.prompt_bytes as u64);
        if let Some((matched, blocks)) = self.prefix_matched {
            l.u64("prefix_blocks_matched", u64::from(matched))
                .u64("prefix_blocks", u64::from(blocks));
        }
        if let Some(pd) = &self.pd {
            l.str("pd", pd.path).str("pd_reason", pd.reason);
            if let Some(prefill) = &pd.prefill_backend {
                l.str("prefill_backend", prefill);
            }
        }
        l.bool("completed", completed);
        l.finish();
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
