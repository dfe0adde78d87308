//! Admission control: the router-wide in-flight limit with its bounded FIFO queue, the retry
//! budget, and a body wrapper that holds a permit until the response ends.

use std::pin::Pin;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use http::Response;
use http_body::{Frame, SizeHint};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::error::Error;

/// Counts requests waiting for capacity, so the queue stays bounded.
#[derive(Debug)]
pub struct Queue {
    waiting: AtomicUsize,
    max: usize,
}

/// A place in the queue; leaving it (drop) frees the place.
pub struct QueueSlot<'a>(&'a Queue);

impl Drop for QueueSlot<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Queue {
    pub fn new(max: usize) -> Self {
        Queue {
            waiting: AtomicUsize::new(0),
            max,
        }
    }

    /// Join the queue, or 429 at once when it is full.
    pub fn join(&self) -> Result<QueueSlot<'_>, Error> {
        let before = self.waiting.fetch_add(1, Ordering::Relaxed);
        let slot = QueueSlot(self);
        if before >= self.max {
            return Err(Error::TooManyRequests {
                reason: format!("the router's queue is full ({} waiting)", self.max),
                retry_after_secs: 1,
            });
        }
        Ok(slot)
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

/// Retries allowed as a share of traffic: each request deposits `ratio` of a retry, each retry
/// withdraws one. Starts with (and refills to at least) `min` retries of reserve.
#[derive(Debug)]
pub struct RetryBudget {
    /// In thousandths of a retry.
    balance: AtomicI64,
    deposit: i64,
    cap: i64,
}

impl RetryBudget {
    pub fn new(ratio: f64, min: u32) -> Self {
        let reserve = i64::from(min) * 1000;
        RetryBudget {
            balance: AtomicI64::new(reserve),
            deposit: (ratio * 1000.0).round() as i64,
            cap: reserve.max(1000) + 100_000,
        }
    }

    pub fn deposit(&self) {
        let _ = self
            .balance
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                Some((b + self.deposit).min(self.cap))
            });
    }

    pub fn available(&self) -> bool {
        self.balance.load(Ordering::Relaxed) >= 1000
    }

    pub fn withdraw(&self) -> bool {
        self.balance
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                (b >= 1000).then_some(b - 1000)
            })
            .is_ok()
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn budget_limits_retries_to_ratio_after_reserve() {
        let b = RetryBudget::new(0.2, 2);
        assert!(b.withdraw() && b.withdraw());
        assert!(!b.withdraw(), "reserve spent");
        for _ in 0..4 {
            b.deposit();
        }
        assert!(!b.available(), "4 × 0.2 < 1");
        b.deposit();
        assert!(b.withdraw(), "5 requests earn one retry");
        assert!(!b.withdraw());
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
