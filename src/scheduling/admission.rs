//! Admission control: the router-wide in-flight limit with its bounded FIFO queue, the retry
//! budget, and a body wrapper that holds a permit until the response ends.
//!
//! It owns the `[limits]` section ([`LimitsConfig`]: its defaults and checks).

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::Response;
use http_body::{Frame, SizeHint};
use serde::Deserialize;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tower::retry::budget::{Budget, TpsBudget};

use crate::config_error::ConfigError;
use crate::error::Error;
use crate::prompt::MAX_MESSAGES_CEILING;
use crate::telemetry as t;

/// Counts requests waiting for capacity, so the queue stays bounded.
pub struct Queue {
    waiting: AtomicUsize,
    max: AtomicUsize,
    gauge: metrics::Gauge,
}

/// A place in the queue; leaving it (drop) frees the place.
pub struct QueueSlot<'a>(&'a Queue);

impl Drop for QueueSlot<'_> {
    fn drop(&mut self) {
        let before = self.0.waiting.fetch_sub(1, Ordering::Relaxed);
        self.0.gauge.set(before.saturating_sub(1) as f64);
    }
}

impl Queue {
    pub fn new(max: usize) -> Self {
        Queue {
            waiting: AtomicUsize::new(0),
            max: AtomicUsize::new(max),
            gauge: metrics::gauge!(t::REQUESTS_QUEUED),
        }
    }

    /// Join the queue, or 429 at once when it is full.
    pub fn join(&self) -> Result<QueueSlot<'_>, Error> {
        let before = self.waiting.fetch_add(1, Ordering::Relaxed);
        self.gauge.set(before.saturating_add(1) as f64);
        let slot = QueueSlot(self);
        let max = self.max.load(Ordering::Relaxed);
        if before >= max {
            return Err(Error::TooManyRequests {
                reason: format!("the router's queue is full ({max} waiting)"),
                retry_after_secs: 1,
            });
        }
        Ok(slot)
    }

    /// Join even though the queue is full: the arrival shed a waiter, whose place frees as
    /// soon as it wakes (the bound is exceeded by at most the sheds in progress).
    pub fn join_over(&self) -> QueueSlot<'_> {
        let before = self.waiting.fetch_add(1, Ordering::Relaxed);
        self.gauge.set(before.saturating_add(1) as f64);
        QueueSlot(self)
    }

    pub fn refresh_gauge(&self) {
        self.gauge.set(self.waiting() as f64);
    }

    /// A new bound (config reload); requests already waiting stay.
    pub fn set_max(&self, max: usize) {
        self.max.store(max, Ordering::Relaxed);
    }

    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }
}

/// Take a router-wide in-flight permit, waiting in FIFO order (tokio's semaphore is fair) up
/// to `deadline`, then 429.
pub async fn acquire(
    semaphore: &Arc<Semaphore>,
    queue: &Queue,
    deadline: Instant,
) -> Result<OwnedSemaphorePermit, Error> {
    if let Ok(permit) = Arc::clone(semaphore).try_acquire_owned() {
        return Ok(permit);
    }
    let _slot = queue.join()?;
    match tokio::time::timeout_at(deadline, Arc::clone(semaphore).acquire_owned()).await {
        Ok(Ok(permit)) => Ok(permit),
        Ok(Err(_)) => Err(Error::Internal("admission semaphore closed".into())),
        Err(_) => Err(Error::TooManyRequests {
            reason: "the router is at its concurrency limit".into(),
            retry_after_secs: 1,
        }),
    }
}

/// Retries allowed as a share of recent traffic: tower's windowed token bucket (`TpsBudget`).
/// Each request deposits, each retry withdraws; deposits expire after the window, so a burst
/// of old successes cannot fund a retry storm later. `min_per_sec` retries per second are
/// always allowed on top.
pub struct RetryBudget(TpsBudget);

impl std::fmt::Debug for RetryBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl RetryBudget {
    /// `window` is clamped to 1..60 s and `ratio` to 0..1 (config validation refuses values
    /// outside them first).
    pub fn new(ratio: f64, min_per_sec: u32, window: Duration) -> Self {
        let window = window.clamp(Duration::from_secs(1), Duration::from_secs(60));
        let ratio = if ratio.is_finite() {
            ratio.clamp(0.0, 1.0)
        } else {
            0.0
        };
        RetryBudget(TpsBudget::new(
            window,
            min_per_sec.min(1_000_000),
            ratio as f32,
        ))
    }

    pub fn deposit(&self) {
        self.0.deposit();
    }

    pub fn withdraw(&self) -> bool {
        self.0.withdraw()
    }
}

/// A response body that keeps `held` alive until the body is done or dropped.
struct Holding<T> {
    inner: Body,
    _held: T,
}

impl<T: Send + Unpin + 'static> http_body::Body for Holding<T> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Keep `held` (a permit, a guard) until `response`'s body ends.
pub fn hold<T: Send + Sync + Unpin + 'static>(response: Response<Body>, held: T) -> Response<Body> {
    response.map(|inner| Body::new(Holding { inner, _held: held }))
}

/// `[limits]`: concurrency limits and the router-side queue.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Requests in flight through the router at once (0 = no limit).
    pub max_inflight: usize,
    /// Requests in flight to one backend at once (0 = no limit).
    pub max_inflight_per_backend: u64,
    /// Requests allowed to wait for capacity; more get 429 at once.
    pub max_queued: usize,
    /// How long a request may wait for capacity before 429.
    pub queue_timeout_ms: u64,
    /// Client connections open at once on each listener (0 = no limit); more are closed on
    /// arrival.
    pub max_connections: usize,
    /// Most messages in one chat request (400 above it); at most 100000.
    pub max_messages: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_inflight: 0,
            max_inflight_per_backend: 0,
            max_queued: 1024,
            queue_timeout_ms: 10_000,
            max_connections: 10_000,
            max_messages: 10_000,
        }
    }
}

impl LimitsConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=MAX_MESSAGES_CEILING).contains(&self.max_messages) {
            return Err(ConfigError::invalid(
                "limits.max_messages",
                format!("must be within 1..={MAX_MESSAGES_CEILING}"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn budget_allows_the_ratio_of_recent_requests_plus_the_minimum() {
        let b = RetryBudget::new(0.2, 0, Duration::from_secs(10));
        assert!(!b.withdraw(), "no traffic, no minimum: no retry");
        for _ in 0..4 {
            b.deposit();
        }
        assert!(!b.withdraw(), "4 × 0.2 < 1");
        b.deposit();
        assert!(b.withdraw(), "5 requests earn one retry");
        assert!(!b.withdraw());
        let m = RetryBudget::new(0.0, 1, Duration::from_secs(2));
        assert!(
            m.withdraw() && m.withdraw(),
            "1 per second over a 2 s window"
        );
        assert!(!m.withdraw());
    }

    #[test]
    fn queue_is_bounded() {
        let q = Queue::new(2);
        let a = q.join().unwrap();
        let _b = q.join().unwrap();
        assert!(matches!(q.join(), Err(Error::TooManyRequests { .. })));
        drop(a);
        assert_eq!(q.waiting(), 1);
        assert!(q.join().is_ok());
    }

    #[tokio::test]
    async fn acquire_waits_then_times_out() {
        let sem = Arc::new(Semaphore::new(1));
        let q = Queue::new(10);
        let first = acquire(&sem, &q, Instant::now()).await.unwrap();
        let err = acquire(
            &sem,
            &q,
            Instant::now() + std::time::Duration::from_millis(20),
        )
        .await;
        assert!(matches!(err, Err(Error::TooManyRequests { .. })));
        drop(first);
        assert!(acquire(&sem, &q, Instant::now()).await.is_ok());
        assert_eq!(q.waiting(), 0);
    }
}
