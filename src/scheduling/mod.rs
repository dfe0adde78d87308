//! Scheduling: choose the backend for each request.
//!
//! * [`framework`] — the plugin traits (Filter, Scorer, Picker, lifecycle hooks).
//! * [`plugins`] — the built-in plugins, one module per purpose.
//! * [`registry`] — type name → factory.
//! * [`profile`] — filters → weighted scores → picker, built from config.
//! * this module — [`Scheduler`] (one decision), [`SchedulerLayer`] (the tower layer that
//!   wraps forwarding and retries connection failures elsewhere) and [`InflightGuard`].

pub mod framework;
pub mod plugins;
pub mod profile;
pub mod registry;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use http::Response;
use tower::{Layer, Service, ServiceExt};

use crate::endpoints::{Backend, Pool};
use crate::error::Error;
use crate::forward::{Dispatch, ProxyRequest};
use crate::prompt::RequestView;
use crate::telemetry as t;
use framework::Outcome;
use profile::Profile;

/// Runs the active profile over the pool.
pub struct Scheduler {
    pool: Arc<Pool>,
    profile: Arc<Profile>,
}

impl Scheduler {
    pub fn new(pool: Arc<Pool>, profile: Arc<Profile>) -> Self {
        Scheduler { pool, profile }
    }

    pub fn profile(&self) -> &Arc<Profile> {
        &self.profile
    }

    /// Pick a backend for `request`, skipping the backends in `exclude` (failed attempts).
    pub fn schedule(
        &self,
        request: &RequestView,
        exclude: &[usize],
    ) -> Result<Arc<Backend>, Error> {
        let mut candidates = self.pool.candidates(Instant::now());
        if !exclude.is_empty() {
            candidates.retain(|c| !exclude.contains(&c.backend.id));
        }
        let Some(decision) = self.profile.run(request, &mut candidates) else {
            return Err(self.why_none(request));
        };
        let backend = Arc::clone(candidates[decision.index].backend);
        for plugin in self.profile.plugins() {
            plugin.after_pick(request, &decision.state, &backend);
        }
        Ok(backend)
    }

    /// 404 when no backend has ever listed the model, 503 when some do but none is eligible.
    fn why_none(&self, request: &RequestView) -> Error {
        let Some(model) = request.model.as_deref() else {
            return Error::NoHealthyBackend("(any)".into());
        };
        let states: Vec<_> = self.pool.backends().iter().map(|b| b.state()).collect();
        let anyone_serves = states.iter().any(|s| s.serves(model));
        let any_known = states.iter().any(|s| !s.models.is_empty());
        if anyone_serves || !any_known {
            Error::NoHealthyBackend(model.to_owned())
        } else {
            Error::ModelNotFound(model.to_owned())
        }
    }
}

/// Holds one unit of a backend's in-flight count from dispatch until the response ends;
/// on drop it releases the count and runs the profile's `on_complete` hooks.
pub struct InflightGuard {
    backend: Arc<Backend>,
    profile: Arc<Profile>,
    view: Arc<RequestView>,
    outcome: Outcome,
}

impl InflightGuard {
    pub fn new(backend: Arc<Backend>, profile: Arc<Profile>, view: Arc<RequestView>) -> Self {
        let n = backend.inflight_add();
        metrics::gauge!(t::BACKEND_INFLIGHT, "backend" => backend.name.clone()).set(n as f64);
        InflightGuard {
            backend,
            profile,
            view,
            // Until told otherwise, a guard that is dropped was abandoned.
            outcome: Outcome::Cancelled,
        }
    }

    pub fn backend(&self) -> &Arc<Backend> {
        &self.backend
    }

    pub fn model_label(&self) -> String {
        self.view.model.clone().unwrap_or_else(|| "unknown".into())
    }

    pub fn set_outcome(&mut self, outcome: Outcome) {
        self.outcome = outcome;
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        let n = self.backend.inflight_sub();
        metrics::gauge!(t::BACKEND_INFLIGHT, "backend" => self.backend.name.clone()).set(n as f64);
        for plugin in self.profile.plugins() {
            plugin.on_complete(&self.view, &self.backend, self.outcome);
        }
    }
}

/// The tower layer that puts scheduling in front of a forwarding service.
#[derive(Clone)]
pub struct SchedulerLayer {
    scheduler: Arc<Scheduler>,
    max_attempts: u32,
}

impl SchedulerLayer {
    pub fn new(scheduler: Arc<Scheduler>, max_attempts: u32) -> Self {
        SchedulerLayer {
            scheduler,
            max_attempts: max_attempts.max(1),
        }
    }
}

impl<S> Layer<S> for SchedulerLayer {
    type Service = SchedulerService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        SchedulerService {
            inner,
            scheduler: Arc::clone(&self.scheduler),
            max_attempts: self.max_attempts,
        }
    }
}

/// Schedules a [`ProxyRequest`] and hands the [`Dispatch`] to the inner service. A
/// connection-level failure (nothing reached the client yet) is retried on another backend.
#[derive(Clone)]
pub struct SchedulerService<S> {
    inner: S,
    scheduler: Arc<Scheduler>,
    max_attempts: u32,
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
        let scheduler = Arc::clone(&self.scheduler);
        let max_attempts = self.max_attempts;
        Box::pin(async move {
            let request = Arc::new(request);
            let mut excluded = Vec::new();
            let mut last_error = None;
            for _ in 0..max_attempts {
                let started = Instant::now();
                let picked = scheduler.schedule(&request.view, &excluded);
                metrics::histogram!(t::SCHEDULING_DURATION).record(started.elapsed().as_secs_f64());
                let backend = match picked {
                    Ok(b) => b,
                    // Nobody left to try: report the upstream failure, not the empty pool.
                    Err(e) => return Err(last_error.unwrap_or(e)),
                };
                let guard = InflightGuard::new(
                    Arc::clone(&backend),
                    Arc::clone(scheduler.profile()),
                    Arc::clone(&request.view),
                );
                let dispatch = Dispatch {
                    request: Arc::clone(&request),
                    backend: Arc::clone(&backend),
                    guard,
                };
                match inner.clone().oneshot(dispatch).await {
                    Err(e @ Error::Upstream { .. }) => {
                        tracing::warn!(backend = %backend.name, error = %e, "attempt failed; trying another backend");
                        excluded.push(backend.id);
                        last_error = Some(e);
                    }
                    other => return other,
                }
            }
            Err(last_error.unwrap_or_else(|| Error::Internal("no attempt was made".into())))
        })
    }
}
