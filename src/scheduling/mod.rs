//! Scheduling: choose the backend for each request.
//!
//! * [`framework`] — the plugin traits (Filter, Scorer, Picker, lifecycle hooks).
//! * [`plugins`] — the built-in plugins, one module per purpose.
//! * [`registry`] — type name → factory.
//! * [`profile`] — filters → weighted scores → picker, built from config.
//! * [`priority`] — the priority class of a request (header, per-key default and ceiling).
//! * this module — [`Scheduler`] (one decision, which takes the chosen backend's in-flight
//!   slot), [`SchedulerLayer`] (the tower layer that wraps forwarding, waits for capacity and
//!   retries failures elsewhere) and [`InflightGuard`].

pub mod admission;
pub mod config;
pub mod framework;
pub mod layer;
pub mod plugins;
pub mod priority;
pub mod profile;
pub mod registry;

pub use layer::{RetryPolicy, SchedulerLayer, SchedulerService};

use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;

use crate::endpoints::capacity::Slot;
use crate::endpoints::passive::Admission;
use crate::endpoints::sent_work::Charge;
use crate::endpoints::{Backend, Pool};
use crate::error::Error;
use crate::prompt::RequestView;
use framework::{CycleState, Rejection};
use profile::Profile;

/// How many times one decision is re-run when another request took the picked backend's last
/// slot (or its probe) between the decision and the reservation.
const MAX_RACES: usize = 8;

/// Why [`Scheduler::schedule`] returned no backend.
pub enum Refused {
    /// Eligible backends exist but all are at the in-flight limit: wait for a slot on one of
    /// `eligible`.
    AtCapacity {
        eligible: Vec<Arc<Backend>>,
        limit: Option<u64>,
    },
    /// Nobody can serve the request (a hard filter emptied the list).
    Failed(Error),
}

/// Runs the active profile over the pool.
pub struct Scheduler {
    pool: Arc<Pool>,
    /// Swapped whole on a config reload; each decision reads it once.
    profile: ArcSwap<Profile>,
}

impl Scheduler {
    pub fn new(pool: Arc<Pool>, profile: Arc<Profile>) -> Self {
        Scheduler {
            pool,
            profile: ArcSwap::new(profile),
        }
    }

    /// The profile in effect now.
    pub fn profile(&self) -> Arc<Profile> {
        self.profile.load_full()
    }

    /// Put `profile` in effect for every decision from now on.
    pub fn set_profile(&self, profile: Arc<Profile>) {
        self.profile.store(profile);
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Pick a backend for `request`, skipping the backends in `exclude` (failed attempts), and
    /// take its in-flight slot. `state` is the request's own, kept across its decisions.
    /// Nothing is recorded about the pick until [`Scheduler::sent`].
    pub fn schedule(
        &self,
        request: &RequestView,
        state: &mut CycleState,
        exclude: &[usize],
    ) -> Result<InflightGuard, Refused> {
        let now = Instant::now();
        let members = self.pool.backends();
        let active = self.profile.load();
        let profile = active.for_request(request);
        let mut lost: Vec<usize> = Vec::new();
        for _ in 0..MAX_RACES {
            let mut candidates = self.pool.candidates(&members, now);
            // Nearly always neither list has anything (a first attempt that lost no race).
            if !exclude.is_empty() || !lost.is_empty() {
                candidates
                    .retain(|c| !exclude.contains(&c.backend.id) && !lost.contains(&c.backend.id));
            }
            match profile.run(request, state, &mut candidates) {
                Ok(decision) => {
                    let backend = candidates[decision.index].backend;
                    match Self::reserve(profile, backend) {
                        Some(slot) => return Ok(InflightGuard::new(slot, request)),
                        None => lost.push(backend.id),
                    }
                }
                Err(Rejection::Unavailable) if !lost.is_empty() => break,
                Err(Rejection::AtCapacity) => break,
                Err(Rejection::Unavailable | Rejection::ModelNotServed) => {
                    return Err(Refused::Failed(self.explain(request)))
                }
            }
        }
        let mut candidates = self.pool.candidates(&members, now);
        candidates.retain(|c| !exclude.contains(&c.backend.id));
        let eligible = profile.uncapped(request, &mut candidates);
        if eligible.is_empty() {
            return Err(Refused::Failed(self.explain(request)));
        }
        Err(Refused::AtCapacity {
            eligible,
            limit: profile.slot_limit(),
        })
    }

    /// Take a slot on `backend` under the profile's limit, and its probe when it is on
    /// probation after an ejection.
    fn reserve(profile: &Profile, backend: &Arc<Backend>) -> Option<Slot> {
        let mut slot = Slot::try_reserve(backend, profile.slot_limit())?;
        match backend.passive().claim(tokio::time::Instant::now()) {
            Admission::Open => Some(slot),
            Admission::Probe => {
                slot.set_probe();
                Some(slot)
            }
            Admission::Closed => None,
        }
    }

    /// Wrap a slot handed over while the request waited.
    pub fn guard(&self, slot: Slot, request: &RequestView) -> InflightGuard {
        InflightGuard::new(slot, request)
    }

    /// `request` is being sent to the backend of `guard`: run the plugins' `after_pick` hooks
    /// (the prefix index records it) and charge the backend with the prompt work the first
    /// plugin that estimates it names. Called once per attempt actually sent, never for a pick
    /// given up.
    pub fn sent(&self, request: &RequestView, state: &CycleState, guard: &mut InflightGuard) {
        let active = self.profile.load();
        let profile = active.for_request(request);
        let backend = Arc::clone(guard.backend());
        backend
            .work()
            .note_sent(request.estimated_prompt_tokens(), crate::clock::now_ms());
        for plugin in profile.plugins() {
            plugin.after_pick(request, state, &backend);
        }
        let work = profile
            .plugins()
            .find_map(|p| p.prompt_work(request, state, &backend));
        if let Some(work) = work {
            guard.charge = Some(Charge::new(&backend, work.uncached, work.prompt));
        }
        guard.served_chars = request.routing_text.as_ref().map_or(0, |t| t.len() as u64);
    }

    /// `backend` left the pool: every plugin forgets it.
    pub fn forget(&self, backend: &Backend) {
        for plugin in self.profile.load().every_plugin() {
            plugin.backend_removed(backend);
        }
    }

    /// No backend may serve the request: 404 when the model is listed by no backend while
    /// some backend lists models, else 503.
    fn explain(&self, request: &RequestView) -> Error {
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

/// Holds one in-flight slot of a backend from the pick until the response ends; on drop the
/// slot is freed (or handed to a waiting request).
pub struct InflightGuard {
    slot: Slot,
    /// The prompt work charged to the backend, when the profile estimates it.
    charge: Option<Charge>,
    /// The metric label for the request's model: a name the chosen backend serves.
    model_label: Arc<str>,
    /// The prompt's routing-text bytes, counted as served by the backend at the first byte of
    /// a successful answer (0 once counted, or when the answer is not a success).
    served_chars: u64,
    /// Whether the backend answered with a success (no [`Self::prompt_not_served`]).
    success: bool,
    /// A successful answer's first byte arrived: the request counts as served when it ends.
    answered: bool,
}

impl InflightGuard {
    fn new(slot: Slot, request: &RequestView) -> Self {
        let served = request
            .model
            .as_deref()
            .filter(|m| slot.backend().state().serves(m));
        InflightGuard {
            model_label: Arc::from(served.unwrap_or(crate::telemetry::OTHER_MODEL)),
            slot,
            charge: None,
            served_chars: 0,
            success: true,
            answered: false,
        }
    }

    pub fn backend(&self) -> &Arc<Backend> {
        self.slot.backend()
    }

    pub fn model_label(&self) -> String {
        self.model_label.to_string()
    }

    /// [`Self::model_label`] without a copy.
    pub fn model(&self) -> &str {
        &self.model_label
    }

    /// The first byte of the response arrived: its prompt is prefilled (and its tokens
    /// counted by the backend, whose characters per token this measures).
    pub fn first_token(&mut self) {
        if let Some(charge) = &mut self.charge {
            charge.first_token();
        }
        let chars = std::mem::take(&mut self.served_chars);
        if chars > 0 {
            self.backend().work().note_served_chars(chars);
        }
        self.answered = self.success;
    }

    /// The backend's answer is not a success: it may not have counted the prompt's tokens,
    /// so the prompt's characters are not counted either, nor the request as served.
    pub fn prompt_not_served(&mut self) {
        self.served_chars = 0;
        self.success = false;
    }

    /// The prompt tokens this backend is charged to prefill ([`Scheduler::sent`]'s estimate;
    /// `None` when the profile has no plugin that estimates prompt work).
    pub fn charged_uncached(&self) -> Option<u64> {
        self.charge.as_ref().map(Charge::uncached)
    }

    /// Another backend prefilled the prompt (the decode step of a disaggregated request pulls
    /// its KV cache): this backend is charged no prefill, only the context it will decode.
    pub fn prefilled_elsewhere(&mut self) {
        if let Some(charge) = self.charge.take() {
            let context = charge.context();
            drop(charge);
            self.charge = Some(Charge::new(self.slot.backend(), 0, context));
        }
    }

    /// This request is the probe of a backend on probation.
    pub fn is_probe(&self) -> bool {
        self.slot.is_probe()
    }
}

impl Drop for InflightGuard {
    /// A request answered with a success has ended: the engine counts it finished now too
    /// (a client that hangs up mid-answer is an abort there, still a finished request).
    fn drop(&mut self) {
        if self.answered {
            self.backend().work().note_served_request();
        }
    }
}
