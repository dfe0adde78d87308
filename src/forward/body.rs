//! The response body on its way back: streamed frame by frame, never buffered.
//!
//! [`GuardedBody`] wraps the backend's body and holds the request's in-flight guard, so the
//! backend's in-flight count is released exactly when the body ends, fails, or is dropped
//! because the client went away — and dropping it also drops the upstream body, which closes
//! the backend connection and makes vLLM abort the generation and free its KV blocks.
//!
//! It also enforces two deadlines: the longest silence between chunks and the end of the
//! whole request. When a Server-Sent-Events stream breaks (backend error, cut connection,
//! deadline, or an end without its end marker), the client gets a final `data: {"error":…}`
//! event and a clean end of stream instead of a hang or a torn connection. The end marker is
//! `data: [DONE]` for chat and completions; the Responses API has none (vLLM's stream ends
//! after `response.completed`, `api_router.py` in `vllm/entrypoints/openai/responses`, 0.32.0),
//! so there a terminal event must have passed ([`SseEnd`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::time::{Instant, Sleep};

use super::pool::Lease;
use crate::error::openai_error_body;
use crate::scheduling::InflightGuard;
use crate::telemetry as t;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type InnerPoll = Option<Result<Frame<Bytes>, BoxError>>;

/// Chunks already waiting in the connection's buffer are sent on as one frame of at most this
/// many bytes: one write to the client instead of one per chunk, and no added latency, since
/// only what has already arrived is joined.
const COALESCE_MAX: usize = 64 * 1024;

/// Set by the scheduling layer on an answer it will not return to the client (it retries
/// elsewhere): the body's end or drop is then neither a finished request nor a client
/// disconnect.
#[derive(Debug, Clone, Default)]
pub struct Discard(Arc<AtomicBool>);

impl Discard {
    pub fn set(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    fn is_set(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// How an SSE stream shows that it ended as the backend meant it to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SseEnd {
    /// `data: [DONE]` last (chat and completions).
    Done,
    /// A terminal Responses API event passed (`response.completed`, `response.failed`,
    /// `response.incomplete`, `error`): the stream ends after it, with no `[DONE]`.
    ResponseEvent,
}

/// Markers of a terminal Responses API event: its `event:` line (from a line start: a raw
/// newline cannot occur inside a JSON string, so model text cannot fake it), or its JSON
/// `type` (quotes inside a JSON string are escaped) for servers that send no event lines. A
/// terminal event is never a stream's first, so its line always follows a newline.
const TERMINAL_EVENTS: [&[u8]; 7] = [
    b"\nevent: response.completed",
    b"\nevent: response.failed",
    b"\nevent: response.incomplete",
    b"\nevent: error",
    b"\"type\":\"response.completed\"",
    b"\"type\":\"response.failed\"",
    b"\"type\":\"response.incomplete\"",
];

/// Bytes kept from the end of the stream: enough for the longest marker to span two chunks.
const TAIL: usize = 32;

/// Does `data`, or its start joined to `before` (the stream's previous bytes), hold a
/// terminal event marker?
fn terminal_in(before: &[u8], data: &[u8]) -> bool {
    let found = |hay: &[u8]| {
        TERMINAL_EVENTS
            .iter()
            .any(|m| memchr::memmem::find(hay, m).is_some())
    };
    if found(data) {
        return true;
    }
    let mut seam = [0u8; 2 * TAIL];
    let head = &data[..data.len().min(TAIL)];
    seam[..before.len()].copy_from_slice(before);
    seam[before.len()..before.len() + head.len()].copy_from_slice(head);
    found(&seam[..before.len() + head.len()])
}

/// Time limits of one response body.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimits {
    pub idle: Duration,
    /// End of the whole request, if bounded.
    pub deadline: Option<Instant>,
}

pub struct GuardedBody {
    inner: Incoming,
    /// The connection `inner` arrives on, polled here; back to its pool when the body ends.
    lease: Option<Lease>,
    /// A terminal result met while joining chunks, returned by the next poll.
    stash: Option<InnerPoll>,
    guard: Option<InflightGuard>,
    received_at: std::time::Instant,
    first_byte_seen: bool,
    error_status: bool,
    /// The response is an SSE stream: failures become a final error event.
    sse: bool,
    /// How that stream marks its proper end.
    end: SseEnd,
    /// A terminal event passed ([`SseEnd::ResponseEvent`]).
    terminal_seen: bool,
    /// The last bytes seen, to tell whether an SSE stream ended with its end marker.
    tail: [u8; TAIL],
    tail_len: usize,
    limits: BodyLimits,
    /// Fires every idle period; a frame since the last firing means the stream is alive.
    /// Re-arming lazily (not on every frame) keeps per-chunk cost to a flag write, at the price
    /// of cutting a silent stream after between one and two idle periods. Made the first time
    /// the backend has nothing to give: a body that arrived with its head (most non-streaming
    /// answers) never needs one, and skips its allocation and clock read.
    timer: Option<Pin<Box<Sleep>>>,
    active: bool,
    /// Set once the final error event has been sent; the next poll ends the stream.
    closed: bool,
    discarded: Discard,
    /// This response's latency histograms, looked up (a table read and two handle clones) by
    /// the first of its two records and kept for the second.
    latency: Option<t::handles::Latency>,
}

impl GuardedBody {
    pub fn new(
        inner: Incoming,
        lease: Option<Lease>,
        guard: InflightGuard,
        received_at: std::time::Instant,
        error_status: bool,
        sse: Option<SseEnd>,
        limits: BodyLimits,
    ) -> Self {
        let mut body = GuardedBody {
            inner,
            lease,
            stash: None,
            guard: Some(guard),
            received_at,
            first_byte_seen: false,
            error_status,
            sse: sse.is_some(),
            end: sse.unwrap_or(SseEnd::Done),
            terminal_seen: false,
            tail: [0; TAIL],
            tail_len: 0,
            limits,
            timer: None,
            active: false,
            closed: false,
            discarded: Discard::default(),
            latency: None,
        };
        // An empty body (204, `Content-Length: 0`) is complete already, and a server does not
        // poll a body that says so: settle it here, or it would count as abandoned.
        if body.inner.is_end_stream() && !body.sse {
            body.settle();
        }
        body
    }

    /// The marker that tells this body it is a refused attempt being discarded.
    pub fn discard_marker(&self) -> Discard {
        self.discarded.clone()
    }

    /// Drive the connection, then take the next frame of the backend's body.
    fn poll_inner(&mut self, cx: &mut Context<'_>) -> Poll<InnerPoll> {
        if let Some(stashed) = self.stash.take() {
            return Poll::Ready(stashed);
        }
        match &mut self.lease {
            Some(lease) => lease
                .conn
                .poll_body(cx, &mut self.inner)
                .map(|frame| frame.map(|r| r.map_err(BoxError::from))),
            None => Pin::new(&mut self.inner)
                .poll_frame(cx)
                .map(|frame| frame.map(|r| r.map_err(BoxError::from))),
        }
    }

    /// After a data frame, take every further data frame that is ready now and join them.
    fn join_ready(&mut self, cx: &mut Context<'_>, first: Bytes) -> Bytes {
        let mut joined: Option<BytesMut> = None;
        while joined.as_ref().map_or(first.len(), BytesMut::len) < COALESCE_MAX
            && !self.inner.is_end_stream()
        {
            match self.poll_inner(cx) {
                Poll::Pending => break,
                Poll::Ready(Some(Ok(frame))) if frame.is_data() => {
                    if let Ok(data) = frame.into_data() {
                        joined
                            .get_or_insert_with(|| BytesMut::from(&first[..]))
                            .extend_from_slice(&data);
                    }
                }
                Poll::Ready(other) => {
                    self.stash = Some(other);
                    break;
                }
            }
        }
        joined.map_or(first, BytesMut::freeze)
    }

    /// The body ended as the backend meant it to: record it and hand the connection back.
    fn settle(&mut self) {
        self.finish();
        self.release_connection();
    }

    /// The body was read to the end: its connection can carry another request.
    fn release_connection(&mut self) {
        if let Some(lease) = self.lease.take() {
            lease.release();
        }
    }

    /// The response is over: record its duration (unless it was a refused attempt) and free
    /// the backend's in-flight slot.
    fn finish(&mut self) {
        if let Some(guard) = self.guard.take() {
            if !self.discarded.is_set() {
                let elapsed = self.received_at.elapsed().as_secs_f64();
                self.latency
                    .get_or_insert_with(|| {
                        t::handles::latency(&guard.backend().name, guard.model())
                    })
                    .duration
                    .record(elapsed);
            }
        }
    }

    fn remember_tail(&mut self, data: &[u8]) {
        if self.end == SseEnd::ResponseEvent && !self.terminal_seen {
            self.terminal_seen = terminal_in(&self.tail[..self.tail_len], data);
        }
        const N: usize = TAIL;
        if data.len() >= N {
            self.tail.copy_from_slice(&data[data.len() - N..]);
            self.tail_len = N;
        } else {
            let keep = (N - data.len()).min(self.tail_len);
            self.tail
                .copy_within(self.tail_len - keep..self.tail_len, 0);
            self.tail[keep..keep + data.len()].copy_from_slice(data);
            self.tail_len = keep + data.len();
        }
    }

    /// Did the stream end with its end marker?
    fn saw_done(&self) -> bool {
        if self.end == SseEnd::ResponseEvent {
            return self.terminal_seen;
        }
        let tail = &self.tail[..self.tail_len];
        let trimmed = tail
            .iter()
            .rposition(|b| !b.is_ascii_whitespace())
            .map_or(&tail[..0], |i| &tail[..=i]);
        trimmed.ends_with(b"[DONE]")
    }

    /// End the response because of `reason`: an error event for SSE, an error otherwise.
    fn fail(&mut self, reason: String) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        tracing::warn!(error = %reason, "response stream broken");
        if let Some(guard) = &self.guard {
            metrics::counter!(t::STREAMS_INTERRUPTED, "backend" => guard.backend().name.clone())
                .increment(1);
        }
        self.finish();
        self.closed = true;
        if self.sse {
            let body =
                openai_error_body(reason, "upstream_error", None, Some("stream_interrupted"));
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(format!(
                "data: {body}\n\n"
            ))))))
        } else {
            Poll::Ready(Some(Err(reason.into())))
        }
    }
}

fn next_wake(limits: &BodyLimits) -> Instant {
    let idle = Instant::now() + limits.idle;
    limits.deadline.map_or(idle, |d| d.min(idle))
}

impl Body for GuardedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if this.closed {
            return Poll::Ready(None);
        }
        match this.poll_inner(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let frame = match frame.into_data() {
                    Ok(data) => Frame::data(this.join_ready(cx, data)),
                    Err(frame) => frame,
                };
                if let Some(data) = frame.data_ref() {
                    if !data.is_empty() {
                        if !this.first_byte_seen {
                            this.first_byte_seen = true;
                            if let Some(guard) = &mut this.guard {
                                guard.first_token();
                                this.latency
                                    .get_or_insert_with(|| {
                                        t::handles::latency(&guard.backend().name, guard.model())
                                    })
                                    .first_byte
                                    .record(this.received_at.elapsed().as_secs_f64());
                            }
                        }
                        if this.sse {
                            let data = data.clone();
                            this.remember_tail(&data);
                        }
                    }
                }
                this.active = true;
                // A server may stop polling once the body says it has ended; settle now.
                if this.inner.is_end_stream()
                    && !(this.sse && !this.saw_done() && !this.error_status)
                {
                    this.settle();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.fail(format!("the backend's response broke off: {e}"))
            }
            Poll::Ready(None) => {
                if this.sse && !this.error_status && this.guard.is_some() && !this.saw_done() {
                    return this.fail(match this.end {
                        SseEnd::Done => "the backend ended the stream before [DONE]".into(),
                        SseEnd::ResponseEvent => {
                            "the backend ended the stream before its final event".into()
                        }
                    });
                }
                this.settle();
                Poll::Ready(None)
            }
            Poll::Pending => match this
                .timer
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(next_wake(&this.limits))))
                .as_mut()
                .poll(cx)
            {
                Poll::Ready(()) => {
                    let past_deadline = this.limits.deadline.is_some_and(|d| Instant::now() >= d);
                    if this.active && !past_deadline {
                        // Frames arrived during the last period: the stream is alive. Re-arm
                        // (polling registers the new wake-up) and keep waiting.
                        this.active = false;
                        let next = next_wake(&this.limits);
                        if let Some(timer) = this.timer.as_mut() {
                            timer.as_mut().reset(next);
                            if timer.as_mut().poll(cx).is_pending() {
                                return Poll::Pending;
                            }
                        }
                    }
                    let reason = if past_deadline {
                        "the request took longer than its time limit".to_owned()
                    } else {
                        format!(
                            "the backend sent nothing for {} ms",
                            this.limits.idle.as_millis()
                        )
                    };
                    this.fail(reason)
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.closed || (self.inner.is_end_stream() && !self.sse)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for GuardedBody {
    fn drop(&mut self) {
        if let Some(guard) = &self.guard {
            if !self.discarded.is_set() {
                metrics::counter!(t::CLIENT_DISCONNECTS, "backend" => guard.backend().name.clone())
                    .increment(1);
            }
            self.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_responses_events_are_seen_within_and_across_chunks() {
        let completed = b"\n\nevent: response.completed\ndata: {\"response\":{},\"type\":\"response.completed\"}\n\n";
        assert!(terminal_in(b"", completed));
        // Its event line at the start of a chunk: the newline is the previous chunk's.
        assert!(terminal_in(b"}\n\n", b"event: response.completed\n"));
        // Model text that reads like an event line is inside a JSON string, never at a line start.
        assert!(!terminal_in(
            b"",
            b"event: response.output_text.delta\ndata: {\"delta\":\"event: error\"}\n\n"
        ));
        // Split inside the marker: the seam of the previous tail and this chunk.
        let (a, b) = completed.split_at(12);
        assert!(!terminal_in(b"", a));
        assert!(terminal_in(a, b));
        assert!(terminal_in(
            b"",
            b"data: {\"type\":\"response.failed\"}\n\n"
        ));
        for not_terminal in [
            &b"event: response.output_text.delta\ndata: {\"delta\":\"x\"}\n\n"[..],
            b"event: response.created\n",
            b"data: [DONE]\n\n",
        ] {
            assert!(!terminal_in(b"", not_terminal));
        }
    }
}
