//! The tower layer that puts scheduling in front of a forwarding service.
//!
//! For each request it: takes a router-wide in-flight permit (when `limits.max_inflight` is
//! set, queueing FIFO up to `queue_timeout`); asks the [`Scheduler`] for a backend, waiting
//! for capacity when every eligible backend is at its per-backend limit; dispatches; and, when
//! the attempt failed before any byte reached the client (connection refused or reset, or a
//! 5xx/429 answer), retries on another backend after a jittered backoff — as long as
//! `max_attempts` and the retry budget allow. Once a response is returned nothing is retried.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use http::{Response, StatusCode};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};

use super::admission::{acquire, hold, Queue, RetryBudget};
use super::{InflightGuard, Scheduler};
use crate::config::{ForwardConfig, LimitsConfig};
use crate::endpoints::Backend;
use crate::error::Error;
use crate::forward::{Dispatch, ProxyRequest};

/// When and how often to try another backend.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    pub max_attempts: u32,
    pub on_status: bool,
    pub backoff_base: Duration,
    pub backoff_max: Duration,
}

impl RetryPolicy {
    pub fn from_config(cfg: &ForwardConfig) -> Self {
        RetryPolicy {
            max_attempts: cfg.max_attempts.max(1),
            on_status: cfg.retry_on_status,
            backoff_base: Duration::from_millis(cfg.backoff_base_ms),
            backoff_max: Duration::from_millis(cfg.backoff_max_ms),
        }
    }

    /// min(max, base × 2^(n−1)) × a random factor in [0.5, 1.5), so retries do not align.
    fn backoff(&self, attempt: u32) -> Duration {
        let exp = self
            .backoff_base
            .saturating_mul(1 << (attempt.saturating_sub(1)).min(16));
        exp.min(self.backoff_max).mul_f64(0.5 + fastrand::f64())
    }

    fn retryable(&self, result: &Result<Response<Body>, Error>) -> bool {
        match result {
            Err(Error::Upstream { .. }) => true,
            Ok(r) => {
                self.on_status
                    && (r.status().is_server_error() || r.status() == StatusCode::TOO_MANY_REQUESTS)
            }
            Err(_) => false,
        }
    }
}

struct Shared {
    scheduler: Arc<Scheduler>,
    retry: RetryPolicy,
    budget: RetryBudget,
    admission: Option<Arc<Semaphore>>,
    queue: Queue,
    queue_timeout: Duration,
}

#[derive(Clone)]
pub struct SchedulerLayer {
    shared: Arc<Shared>,
}

impl SchedulerLayer {
    pub fn new(scheduler: Arc<Scheduler>, forward: &ForwardConfig, limits: &LimitsConfig) -> Self {
        SchedulerLayer {
            shared: Arc::new(Shared {
                scheduler,
                retry: RetryPolicy::from_config(forward),
                budget: RetryBudget::new(forward.retry_budget_ratio, forward.retry_budget_min),
                admission: (limits.max_inflight > 0)
                    .then(|| Arc::new(Semaphore::new(limits.max_inflight))),
                queue: Queue::new(limits.max_queued),
                queue_timeout: Duration::from_millis(limits.queue_timeout_ms),
            }),
        }
    }
}

impl<S> Layer<S> for SchedulerLayer {
    type Service = SchedulerService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        SchedulerService {
            inner,
            shared: Arc::clone(&self.shared),
        }
    }
}

/// See the module docs.
#[derive(Clone)]
pub struct SchedulerService<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl Shared {
    /// Schedule, waiting (bounded) while every eligible backend is at its in-flight limit.
    async fn schedule(
        &self,
        request: &ProxyRequest,
        exclude: &[usize],
        deadline: Instant,
    ) -> Result<Arc<Backend>, Error> {
        let freed = self.scheduler.pool().capacity_freed();
        let mut slot = None;
        loop {
            // Register for the wake-up before looking, so a release in between is not lost.
            let notified = freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let started = std::time::Instant::now();
            let picked = self.scheduler.schedule(&request.view, exclude);
            metrics::histogram!(crate::telemetry::SCHEDULING_DURATION)
                .record(started.elapsed().as_secs_f64());
            match picked {
                Err(Error::Saturated) => {
                    if slot.is_none() {
                        slot = Some(self.queue.join()?);
                    }
                    if tokio::time::timeout_at(deadline, notified).await.is_err() {
                        return Err(Error::TooManyRequests {
                            reason: "every eligible backend is at its concurrency limit".into(),
                            retry_after_secs: 1,
                        });
                    }
                }
                other => return other,
            }
        }
    }
}

impl<S> Service<ProxyRequest> for SchedulerService<S>
where
    S: Service<Dispatch, Response = Response<Body>, Error = Error> + Clone + Send + 'static,
    S::Future: Send,
{
    type Response = Response<Body>;
    type Error = Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: ProxyRequest) -> Self::Future {
        let inner = self.inner.clone();
        let s = Arc::clone(&self.shared);
        Box::pin(async move {
            let deadline = Instant::now() + s.queue_timeout;
            let permit = match &s.admission {
                Some(semaphore) => Some(acquire(semaphore, &s.queue, deadline).await?),
                None => None,
            };
            s.budget.deposit();
            let request = Arc::new(request);
            let mut excluded = Vec::new();
            let mut backend = s.schedule(&request, &excluded, deadline).await?;
            let mut attempt = 1;
            loop {
                let guard = InflightGuard::new(
                    Arc::clone(&backend),
                    Arc::clone(s.scheduler.profile()),
                    Arc::clone(&request.view),
                );
                let dispatch = Dispatch {
                    request: Arc::clone(&request),
                    backend: Arc::clone(&backend),
                    guard,
                };
                let result = inner.clone().oneshot(dispatch).await;
                let again = s.retry.retryable(&result)
                    && attempt < s.retry.max_attempts
                    && s.budget.available();
                let next = if again {
                    excluded.push(backend.id);
                    s.scheduler.schedule(&request.view, &excluded).ok()
                } else {
                    None
                };
                let Some(next) = next.filter(|_| s.budget.withdraw()) else {
                    return match (result, permit) {
                        (Ok(response), Some(permit)) => Ok(hold(response, permit)),
                        (result, _) => result,
                    };
                };
                let what = match &result {
                    Ok(r) => format!("status {}", r.status()),
                    Err(e) => e.to_string(),
                };
                tracing::warn!(backend = %backend.name, attempt, error = %what, next = %next.name, "retrying on another backend");
                drop(result);
                tokio::time::sleep(s.retry.backoff(attempt)).await;
                backend = next;
                attempt += 1;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_is_capped_and_jittered() {
        let p = RetryPolicy {
            max_attempts: 5,
            on_status: true,
            backoff_base: Duration::from_millis(100),
            backoff_max: Duration::from_millis(300),
        };
        for _ in 0..50 {
            let one = p.backoff(1);
            assert!(
                one >= Duration::from_millis(50) && one < Duration::from_millis(150),
                "{one:?}"
            );
            let three = p.backoff(3);
            assert!(
                three >= Duration::from_millis(150) && three < Duration::from_millis(450),
                "{three:?}"
            );
        }
    }

    #[test]
    fn what_is_retryable() {
        let p = RetryPolicy {
            max_attempts: 3,
            on_status: true,
            backoff_base: Duration::ZERO,
            backoff_max: Duration::ZERO,
        };
        let status = |code: u16| -> Result<Response<Body>, Error> {
            let mut r = Response::new(Body::empty());
            *r.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::OK);
            Ok(r)
        };
        assert!(p.retryable(&status(503)));
        assert!(p.retryable(&status(429)));
        assert!(!p.retryable(&status(400)));
        assert!(!p.retryable(&status(200)));
        assert!(p.retryable(&Err(Error::Upstream {
            backend: "b".into(),
            reason: "refused".into()
        })));
        assert!(!p.retryable(&Err(Error::UpstreamTimeout {
            backend: "b".into(),
            timeout_ms: 1
        })));
        let no_status = RetryPolicy {
            on_status: false,
            ..p
        };
        assert!(!no_status.retryable(&status(503)));
    }
}
