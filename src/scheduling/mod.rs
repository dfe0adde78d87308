//! Scheduling: choose the backend for each request.
//!
//! * [`framework`] — the plugin traits (Filter, Scorer, Picker, lifecycle hooks).
//! * [`plugins`] — the built-in plugins, one module per purpose.
//! * [`registry`] — type name → factory.
//! * [`profile`] — filters → weighted scores → picker, built from config.
//! * this module — [`Scheduler`] (one decision), [`SchedulerLayer`] (the tower layer that
//!   wraps forwarding and retries connection failures elsewhere) and [`InflightGuard`].

pub mod admission;
pub mod framework;
pub mod layer;
pub mod plugins;
pub mod profile;
pub mod registry;

pub use layer::{RetryPolicy, SchedulerLayer, SchedulerService};

use std::sync::Arc;
use std::time::Instant;

use crate::endpoints::{Backend, Pool};
use crate::error::Error;
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
            return Err(self.why_none(request, exclude));
        };
        let backend = Arc::clone(candidates[decision.index].backend);
        for plugin in self.profile.plugins() {
            plugin.after_pick(request, &decision.state, &backend);
        }
        Ok(backend)
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Saturated when eligible backends exist but all are at their in-flight limit; else 404
    /// when no backend has ever listed the model, 503 when some do but none is eligible.
    fn why_none(&self, request: &RequestView, exclude: &[usize]) -> Error {
        let eligible = self.pool.backends().iter().any(|b| {
            let s = b.state();
            !exclude.contains(&b.id)
                && s.healthy
                && !b.passive().is_ejected()
                && request.model.as_deref().is_none_or(|m| s.serves(m))
        });
        if eligible {
            return Error::Saturated;
        }
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
