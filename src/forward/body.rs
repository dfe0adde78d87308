//! The response body on its way back: streamed frame by frame, never buffered.
//!
//! [`GuardedBody`] wraps the backend's body and holds the request's in-flight guard, so the
//! backend's in-flight count is released exactly when the body ends, fails, or is dropped
//! because the client went away — and dropping it also drops the upstream connection's body,
//! which makes vLLM abort the generation and free its KV blocks. It also times the first byte
//! and the whole response.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

use crate::scheduling::framework::Outcome;
use crate::scheduling::InflightGuard;
use crate::telemetry as t;

pub struct GuardedBody {
    inner: Incoming,
    guard: Option<InflightGuard>,
    received_at: Instant,
    first_byte_seen: bool,
    error_status: bool,
}

impl GuardedBody {
    pub fn new(
        inner: Incoming,
        guard: InflightGuard,
        received_at: Instant,
        error_status: bool,
    ) -> Self {
        GuardedBody {
            inner,
            guard: Some(guard),
            received_at,
            first_byte_seen: false,
            error_status,
        }
    }

    fn finish(&mut self, outcome: Outcome) {
        if let Some(mut guard) = self.guard.take() {
            let elapsed = self.received_at.elapsed().as_secs_f64();
            metrics::histogram!(t::REQUEST_DURATION, "backend" => guard.backend().name.clone(), "model" => guard.model_label())
                .record(elapsed);
            guard.set_outcome(outcome);
        }
    }
}

impl Body for GuardedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if !this.first_byte_seen && frame.data_ref().is_some_and(|d| !d.is_empty()) {
                    this.first_byte_seen = true;
                    if let Some(guard) = &this.guard {
                        metrics::histogram!(t::TIME_TO_FIRST_BYTE, "backend" => guard.backend().name.clone(), "model" => guard.model_label())
                            .record(this.received_at.elapsed().as_secs_f64());
                    }
                }
                // A server may stop polling once the body says it has ended; settle now.
                if this.inner.is_end_stream() {
                    let outcome = if this.error_status {
                        Outcome::Failed
                    } else {
                        Outcome::Success
                    };
                    this.finish(outcome);
                }
            }
            Poll::Ready(Some(Err(e))) => {
                tracing::warn!(error = %e, "backend response body failed");
                this.finish(Outcome::Failed);
            }
            Poll::Ready(None) => {
                let outcome = if this.error_status {
                    Outcome::Failed
                } else {
                    Outcome::Success
                };
                this.finish(outcome);
            }
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

impl Drop for GuardedBody {
    fn drop(&mut self) {
        if let Some(guard) = &self.guard {
            metrics::counter!(t::CLIENT_DISCONNECTS, "backend" => guard.backend().name.clone())
                .increment(1);
            self.finish(Outcome::Cancelled);
        }
    }
}
