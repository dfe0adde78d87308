//! The tower layer that puts scheduling in front of a forwarding service.
//!
//! For each request it: takes a router-wide in-flight permit (when `limits.max_inflight` is
//! set, queueing FIFO up to its class's queue timeout); asks the [`Scheduler`] for a backend
//! and its in-flight slot, waiting for a slot when every eligible backend is at its
//! per-backend limit (in the capacity queue: priority classes, tenants in turn, lower classes
//! shed first — see [`crate::endpoints::capacity`]);
//! dispatches; and, when the attempt failed before any byte reached the client (connection
//! refused or reset, or a 5xx/429 answer), retries on another backend after a jittered
//! backoff — as long as `max_attempts` and the windowed retry budget allow. A refused answer
//! is read to its end during the backoff so its connection is reused. Once a response is
//! returned nothing is retried. 5xx answers count towards passive ejection when the request
//! is over, and only if a single backend gave them.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use arc_swap::ArcSwap;
use axum::body::Body;
use http::{Response, StatusCode};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};

use super::admission::{acquire, hold, Queue, RetryBudget};
use super::framework::CycleState;
use super::{InflightGuard, Refused, Scheduler};
use crate::endpoints::capacity::{Outcome, Rank, Registration};
use crate::endpoints::Backend;
use crate::endpoints::OutlierConfig;
use crate::error::Error;
use crate::forward::ForwardConfig;
use crate::forward::{discard, Dispatch, ProxyRequest};
use crate::pd::{flow, Path, PdConfig};
use crate::scheduling::admission::LimitsConfig;
use crate::scheduling::priority::PriorityConfig;

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

/// The layer's settings that a config reload replaces.
struct Settings {
    retry: RetryPolicy,
    outlier: OutlierConfig,
    /// How long a request of each priority class may wait, by class index.
    queue_timeouts: Vec<Duration>,
    /// The classes' names: the `class` label values (bounded by the config).
    class_labels: Vec<Arc<str>>,
    max_inflight: usize,
    /// (ratio, min per second, window) the budget was built with.
    budget_params: (f64, u32, u64),
    /// Prefill/decode disaggregation (`crate::pd`).
    pd: PdConfig,
}

impl Settings {
    fn queue_timeout(&self, class: u8) -> Duration {
        let last = self.queue_timeouts.last().copied().unwrap_or_default();
        self.queue_timeouts
            .get(usize::from(class))
            .copied()
            .unwrap_or(last)
    }

    fn class_label(&self, class: u8) -> String {
        self.class_labels
            .get(usize::from(class))
            .map_or_else(|| "other".to_owned(), |l| l.to_string())
    }

    fn new(
        forward: &ForwardConfig,
        limits: &LimitsConfig,
        outlier: &OutlierConfig,
        priority: &PriorityConfig,
        pd: &PdConfig,
    ) -> Self {
        Settings {
            pd: pd.clone(),
            retry: RetryPolicy::from_config(forward),
            outlier: outlier.clone(),
            queue_timeouts: priority
                .classes
                .iter()
                .map(|c| {
                    let ms = priority.queue_timeout_ms.get(c);
                    Duration::from_millis(ms.copied().unwrap_or(limits.queue_timeout_ms))
                })
                .collect(),
            class_labels: priority
                .classes
                .iter()
                .map(|c| Arc::from(c.as_str()))
                .collect(),
            max_inflight: limits.max_inflight,
            budget_params: (
                forward.retry_budget_ratio,
                forward.retry_budget_min_per_sec,
                forward.retry_budget_window_ms,
            ),
        }
    }
}

fn budget((ratio, min, window): (f64, u32, u64)) -> RetryBudget {
    RetryBudget::new(ratio, min, Duration::from_millis(window))
}

fn admission(max_inflight: usize) -> Option<Arc<Semaphore>> {
    (max_inflight > 0).then(|| Arc::new(Semaphore::new(max_inflight)))
}

struct Shared {
    scheduler: Arc<Scheduler>,
    settings: ArcSwap<Settings>,
    budget: ArcSwap<RetryBudget>,
    /// The router-wide limit. A reload that changes it installs a new semaphore: requests
    /// already admitted keep (and release) permits of the old one.
    admission: ArcSwap<Option<Arc<Semaphore>>>,
    queue: Queue,
}

#[derive(Clone)]
pub struct SchedulerLayer {
    shared: Arc<Shared>,
}

impl SchedulerLayer {
    pub fn new(
        scheduler: Arc<Scheduler>,
        forward: &ForwardConfig,
        limits: &LimitsConfig,
        outlier: &OutlierConfig,
        priority: &PriorityConfig,
        pd: &PdConfig,
    ) -> Self {
        let settings = Settings::new(forward, limits, outlier, priority, pd);
        SchedulerLayer {
            shared: Arc::new(Shared {
                scheduler,
                budget: ArcSwap::from_pointee(budget(settings.budget_params)),
                admission: ArcSwap::from_pointee(admission(limits.max_inflight)),
                queue: Queue::new(limits.max_queued),
                settings: ArcSwap::from_pointee(settings),
            }),
        }
    }

    /// Apply reloaded settings: retry policy and budget, outlier detection, queue bound and
    /// timeouts, priority classes, the router-wide in-flight limit. Requests in flight finish
    /// under the old ones.
    pub fn reload(
        &self,
        forward: &ForwardConfig,
        limits: &LimitsConfig,
        outlier: &OutlierConfig,
        priority: &PriorityConfig,
        pd: &PdConfig,
    ) {
        let s = &self.shared;
        let next = Settings::new(forward, limits, outlier, priority, pd);
        let old = s.settings.load();
        if old.budget_params != next.budget_params {
            s.budget.store(Arc::new(budget(next.budget_params)));
        }
        if old.max_inflight != next.max_inflight {
            s.admission.store(Arc::new(admission(next.max_inflight)));
        }
        s.queue.set_max(limits.max_queued);
        s.settings.store(Arc::new(next));
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

impl<S> SchedulerService<S> {
    /// The scheduler deciding for this stack (for side requests that pick one backend).
    pub fn scheduler(&self) -> &Scheduler {
        &self.shared.scheduler
    }

    /// The service the picked requests are sent through.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Requests waiting in the router's queue now.
    pub fn queued(&self) -> usize {
        self.shared.queue.waiting()
    }

    /// Set the gauges that only change with traffic, before `/metrics` is rendered.
    pub fn refresh_metrics(&self) {
        self.shared.queue.refresh_gauge();
        let settings = self.shared.settings.load();
        let waiters = self.shared.scheduler.pool().waiters();
        for (class, label) in settings.class_labels.iter().enumerate() {
            let n = u8::try_from(class).map_or(0, |c| waiters.len_of(c));
            metrics::gauge!(crate::telemetry::QUEUED_BY_CLASS, "class" => label.to_string())
                .set(n as f64);
        }
        for plugin in self.shared.scheduler.profile().every_plugin() {
            plugin.refresh_metrics();
        }
    }

    /// The scheduling profile in effect, e.g. `default: saturation-filter → prefix…×2 → …`.
    pub fn profile_description(&self) -> String {
        self.shared.scheduler.profile().describe()
    }
}

impl Shared {
    /// Schedule, waiting (bounded) for a slot while every eligible backend is at its in-flight
    /// limit. A freed slot is handed to exactly one waiter (highest class first, tenants in
    /// turn); when the queue is full the arrival may shed a less deserving waiter.
    async fn schedule(
        &self,
        request: &ProxyRequest,
        state: &mut CycleState,
        exclude: &[usize],
        deadline: Instant,
        settings: &Settings,
    ) -> Result<InflightGuard, Error> {
        let rank = Rank {
            class: request.view.priority,
            tenant: request.view.tenant,
        };
        let shed = |reason: &'static str, class: u8| {
            metrics::counter!(crate::telemetry::QUEUE_SHED, "class" => settings.class_label(class), "reason" => reason)
                .increment(1);
        };
        let waiters = self.scheduler.pool().waiters();
        let mut place = None;
        loop {
            let started = std::time::Instant::now();
            let picked = self.scheduler.schedule(&request.view, state, exclude);
            crate::telemetry::handles::scheduling_duration()
                .record(started.elapsed().as_secs_f64());
            let (eligible, limit) = match picked {
                Ok(guard) => return Ok(guard),
                Err(Refused::Failed(e)) => return Err(e),
                Err(Refused::AtCapacity { eligible, limit }) => (eligible, limit),
            };
            if place.is_none() {
                let joined = match self.queue.join() {
                    Ok(joined) => joined,
                    // Full: take the place of a waiter that deserves it less (it answers 429
                    // and leaves its place as it wakes), else refuse this one.
                    Err(full) => match waiters.shed_for(rank) {
                        Some(_) => self.queue.join_over(),
                        None => {
                            shed("full", rank.class);
                            return Err(full);
                        }
                    },
                };
                place = Some((joined, Instant::now()));
            }
            let waited = |place: &Option<(_, Instant)>| {
                if let Some((_, since)) = place {
                    metrics::histogram!(crate::telemetry::QUEUE_WAIT, "class" => settings.class_label(rank.class))
                        .record(since.elapsed().as_secs_f64());
                }
            };
            match waiters.register(&eligible, limit, rank) {
                // A slot freed up meanwhile: decide again (yield first, so a busy fleet
                // cannot keep this task from letting others run).
                Registration::Retry => tokio::task::yield_now().await,
                Registration::Waiting(mut wait) => {
                    match tokio::time::timeout_at(deadline, wait.slot()).await {
                        Ok(Outcome::Slot(slot)) => {
                            waited(&place);
                            return Ok(self.scheduler.guard(slot, &request.view));
                        }
                        Ok(Outcome::Shed) => {
                            waited(&place);
                            shed("displaced", rank.class);
                            return Err(Error::TooManyRequests {
                                reason: "the router's queue is full; requests of higher priority took this one's place".into(),
                                retry_after_secs: 1,
                            });
                        }
                        Ok(Outcome::Closed) => {
                            return Err(Error::Internal("the capacity queue went away".into()))
                        }
                        Err(_) => {
                            waited(&place);
                            shed("deadline", rank.class);
                            return Err(Error::TooManyRequests {
                                reason: "every eligible backend is at its concurrency limit".into(),
                                retry_after_secs: 1,
                            });
                        }
                    }
                }
            }
        }
    }

    /// The request is over: count its 5xx answers against the backends that gave them —
    /// unless two or more backends answered 5xx to it, which says more about the request
    /// (a poison request) than about them.
    fn settle_failures(&self, five_xx: &[Arc<Backend>]) {
        let mut distinct: Vec<usize> = five_xx.iter().map(|b| b.id).collect();
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() >= 2 {
            tracing::warn!(
                backends = distinct.len(),
                "several backends answered 5xx to one request; not counted against any"
            );
            return;
        }
        for backend in five_xx {
            let settings = self.settings.load();
            self.scheduler
                .pool()
                .report_failure(backend, &settings.outlier);
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
        self.start(request)
    }
}

impl SchedulerService<crate::forward::Forwarder> {
    /// Schedule and forward `request`: [`Service::call`] without a clone of the service or a
    /// readiness wait around it (the forwarder is always ready, and the future takes its own
    /// clones), which the front door pays on every request otherwise.
    pub fn send(
        &self,
        request: ProxyRequest,
    ) -> Pin<Box<dyn Future<Output = Result<Response<Body>, Error>> + Send>> {
        self.start(request)
    }
}

impl<S> SchedulerService<S>
where
    S: Service<Dispatch, Response = Response<Body>, Error = Error> + Clone + Send + 'static,
    S::Future: Send,
{
    fn start(
        &self,
        request: ProxyRequest,
    ) -> Pin<Box<dyn Future<Output = Result<Response<Body>, Error>> + Send>> {
        let inner = self.inner.clone();
        let s = Arc::clone(&self.shared);
        Box::pin(async move {
            let settings = s.settings.load_full();
            let budget = s.budget.load_full();
            let deadline = Instant::now() + settings.queue_timeout(request.view.priority);
            let semaphore = s.admission.load_full();
            let permit = match &*semaphore {
                Some(semaphore) => Some(acquire(semaphore, &s.queue, deadline).await?),
                None => None,
            };
            budget.deposit();
            let mut request = request;
            let roles = crate::pd::whole_request_roles(&settings.pd, &request.view);
            if roles != request.view.roles {
                Arc::make_mut(&mut request.view).roles = roles;
            }
            let request = Arc::new(request);
            // The request's own plugin state, kept across retries and waits (block hashes are
            // computed once).
            let mut state = CycleState::default();
            let mut excluded = Vec::new();
            let mut five_xx: Vec<Arc<Backend>> = Vec::new();
            let mut guard = s
                .schedule(&request, &mut state, &excluded, deadline, &settings)
                .await?;
            let mut attempt = 1;
            loop {
                let backend = Arc::clone(guard.backend());
                // Recorded only now that it is sent: a pick given up is never recorded.
                s.scheduler.sent(&request.view, &state, &mut guard);
                // P/D: run the prefill step first when the rule says so; each attempt plans
                // anew, so a failed decode is never retried with the same KV params.
                // Boxed, and only with P/D on: its future is large, and every future nested
                // by value is copied into the one awaiting it on every request.
                let plan = if settings.pd.enabled {
                    Box::pin(flow::plan(
                        &settings.pd,
                        &s.scheduler,
                        inner.clone(),
                        &request,
                        &mut guard,
                    ))
                    .await
                } else {
                    flow::Plan::unchanged(&request)
                };
                let dispatch = Dispatch {
                    request: plan.request,
                    backend: Arc::clone(&backend),
                    guard,
                };
                // Timed only for a decode step (no clock read on the ordinary path).
                let decode_started =
                    (plan.path == Some(Path::Disaggregated)).then(std::time::Instant::now);
                let result = inner.clone().oneshot(dispatch).await;
                if let Some(started) = decode_started {
                    crate::pd::record_step("decode", started.elapsed());
                }
                let server_error = matches!(&result, Ok(r) if r.status().is_server_error());
                let retry = &settings.retry;
                let next = if retry.retryable(&result) && attempt < retry.max_attempts {
                    excluded.push(backend.id);
                    // Only a pick that will be sent spends the budget; one not sent frees its
                    // slot on drop and is never recorded.
                    s.scheduler
                        .schedule(&request.view, &mut state, &excluded)
                        .ok()
                        .filter(|_| budget.withdraw())
                } else {
                    None
                };
                if server_error {
                    five_xx.push(Arc::clone(&backend));
                }
                let Some(next) = next else {
                    s.settle_failures(&five_xx);
                    return match (result, permit) {
                        (Ok(response), Some(permit)) => Ok(hold(response, permit)),
                        (result, _) => result,
                    };
                };
                let what = match &result {
                    Ok(r) => format!("status {}", r.status()),
                    Err(e) => e.to_string(),
                };
                tracing::warn!(backend = %backend.name, attempt, error = %what, next = %next.backend().name, "retrying on another backend");
                let pause = tokio::time::sleep(retry.backoff(attempt));
                match result {
                    // Read the refused answer to its end while backing off, so its keep-alive
                    // connection returns to the pool; it is not a client disconnect.
                    Ok(response) => {
                        tokio::join!(discard(response, Instant::now() + DISCARD_WITHIN), pause);
                    }
                    Err(_) => pause.await,
                }
                guard = next;
                attempt += 1;
            }
        })
    }
}

/// How long a refused answer's body may take to arrive before its connection is dropped.
const DISCARD_WITHIN: Duration = Duration::from_millis(250);

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
            timeout_ms: 1,
            limit: "forward.response_timeout_ms",
        })));
        let no_status = RetryPolicy {
            on_status: false,
            ..p
        };
        assert!(!no_status.retryable(&status(503)));
    }
}
