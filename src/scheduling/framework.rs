//! The scheduling framework's extension points: [`Filter`], [`Scorer`], [`Picker`], and the
//! request-lifecycle hooks every [`Plugin`] may implement.
//!
//! Each trait has one required method and defaults for the rest. A plugin never sees the
//! proxy: it reads [`Candidate`]s (a backend plus the snapshot of its state taken for this
//! decision) and the request's [`RequestView`]. Scores are plain numbers the profile clamps
//! to [0, 1] and weighs in one place, so no plugin can drown out the others by accident.
//!
//! [`PluginInstance`] (a built plugin, by role) lives here too: the registry builds instances
//! and the profile links them, both importing this module, which imports neither.

use std::any::Any;
use std::sync::Arc;

use crate::endpoints::{Backend, Candidate};
use crate::prompt::RequestView;

/// A backend signal a scorer reads, checked against each engine's metric names when a
/// profile is built: a scorer reading a signal some backend's engine does not report is a
/// loud start-up warning (those backends score as "unknown").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// Requests waiting in the engine's queue.
    Waiting,
    /// Requests in the engine's running batch.
    Running,
    /// KV-cache usage.
    KvUsage,
    /// KV-cache geometry (block size, number of blocks).
    CacheConfig,
    /// LoRA adapters running and waiting.
    Lora,
}

impl Signal {
    pub fn name(self) -> &'static str {
        match self {
            Signal::Waiting => "waiting",
            Signal::Running => "running",
            Signal::KvUsage => "kv_usage",
            Signal::CacheConfig => "cache_config",
            Signal::Lora => "lora",
        }
    }

    /// Does an engine with these metric names report the signal?
    pub fn reported_by(self, engine: &crate::endpoints::engine::EngineMetricNames) -> bool {
        match self {
            Signal::Waiting => !engine.waiting.is_empty(),
            Signal::Running => !engine.running.is_empty(),
            Signal::KvUsage => !engine.kv_usage.is_empty(),
            Signal::CacheConfig => engine.cache_config.is_some(),
            Signal::Lora => engine.lora.is_some(),
        }
    }
}

/// Why a filter left no candidate: the filter that emptied the list says it, so the scheduler
/// never has to guess.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// Nobody may serve the request now (health, policy): fail at once.
    Unavailable,
    /// No candidate serves the requested model.
    ModelNotServed,
    /// Eligible backends exist but every one is at its in-flight limit: wait for a slot.
    AtCapacity,
}

/// Per-request scratch space where plugins leave data for their own later use, and for the
/// plugins linked to them (see [`Plugin::link_target`]). It lives as long as the request,
/// across every decision made for it (retries, waits for capacity), so work such as the
/// prefix scorer's block hashes is done once per request; what holds for one decision only
/// (a prefix match) is tagged with [`CycleState::decision`].
#[derive(Default)]
pub struct CycleState {
    entries: Vec<(Arc<str>, Box<dyn Any + Send + Sync>)>,
    /// The number of the decision under way: 0 until a profile runs one (plugins called
    /// outside a profile then never take an earlier result for this decision's).
    decision: u64,
}

impl CycleState {
    /// A profile starts a decision: results tagged with an earlier one are stale from now on.
    pub fn begin_decision(&mut self) {
        self.decision = self.decision.wrapping_add(1).max(1);
    }

    /// The decision under way (see [`CycleState::begin_decision`]); 0 outside a profile.
    pub fn decision(&self) -> u64 {
        self.decision
    }

    pub fn put<T: Any + Send + Sync>(&mut self, key: &Arc<str>, value: T) {
        if let Some(slot) = self
            .entries
            .iter_mut()
            .find(|(k, _)| Arc::ptr_eq(k, key) || **k == **key)
        {
            slot.1 = Box::new(value);
        } else {
            self.entries.push((Arc::clone(key), Box::new(value)));
        }
    }

    /// Remove and return the entry under `key` (to be put back, updated).
    pub fn take<T: Any>(&mut self, key: &str) -> Option<T> {
        let i = self
            .entries
            .iter()
            .position(|(k, v)| &**k == key && v.is::<T>())?;
        let (_, value) = self.entries.swap_remove(i);
        value.downcast::<T>().ok().map(|b| *b)
    }

    pub fn get<T: Any>(&self, key: &str) -> Option<&T> {
        self.entries
            .iter()
            .find(|(k, _)| &**k == key)
            .and_then(|(_, v)| v.downcast_ref())
    }
}

impl std::fmt::Debug for CycleState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.entries.iter().map(|(k, _)| k))
            .finish()
    }
}

/// A request's prompt as work for one backend, in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptWork {
    /// Tokens that backend must prefill (the prompt less what it already caches).
    pub uncached: u64,
    /// The whole prompt.
    pub prompt: u64,
}

/// Identity and lifecycle hooks shared by every plugin.
pub trait Plugin: Send + Sync {
    /// The factory name, e.g. `"queue-scorer"`.
    fn type_name(&self) -> &'static str;
    /// The instance name from config (defaults to the type name).
    fn name(&self) -> &str;
    /// Called when `request` is sent to `backend` (once per attempt actually made; a pick
    /// that is not sent, e.g. because the retry budget is spent, is not reported).
    fn after_pick(&self, _request: &RequestView, _state: &CycleState, _backend: &Backend) {}
    /// The prompt work `request` brings to `backend`, if this plugin estimates it (the
    /// `prefill-cost-scorer` does). Asked once per attempt sent, after `after_pick`; the first
    /// plugin of the profile that answers charges the backend's
    /// [`SentWork`](crate::endpoints::sent_work::SentWork) until the response ends.
    fn prompt_work(
        &self,
        _request: &RequestView,
        _state: &CycleState,
        _backend: &Backend,
    ) -> Option<PromptWork> {
        None
    }
    /// `backend` left the pool: drop whatever the plugin keeps about it.
    fn backend_removed(&self, _backend: &Backend) {}
    /// `/metrics` is being rendered: set the plugin's own gauges (they would otherwise idle
    /// out of the exporter while no request comes).
    fn refresh_metrics(&self) {}
    /// The plugin instance this one works through instead of keeping state of its own (see
    /// [`Link`]). The profile builder hands that instance over with [`Plugin::link`] once,
    /// when this instance is built for the profile in effect; a reload that rebuilds the
    /// other instance, or that would link this one to another (or to none), rebuilds this one
    /// too.
    fn link_target(&self) -> Option<Link<'_>> {
        None
    }
    /// Take the instance [`Plugin::link_target`] named; an error says why it does not fit.
    fn link(&self, _target: &PluginInstance) -> Result<(), String> {
        Ok(())
    }
    /// The name of the instance [`Plugin::link`] handed over, if any.
    fn linked(&self) -> Option<&str> {
        None
    }
    /// The concrete plugin, for a linked plugin to recognise its target's type.
    fn as_any(&self) -> &dyn Any;
}

/// A plugin seen as its [`Plugin`] part: a supertrait of [`Filter`], [`Scorer`] and
/// [`Picker`], implemented once for every plugin type by the blanket impl below, so a
/// `&dyn Scorer` yields its `&dyn Plugin` with every hook the plugin has — nothing forwards
/// hooks by hand, so none can be left out. (`dyn Scorer` → `dyn Plugin` is trait upcasting,
/// stable only since Rust 1.86; the workspace's declared rust-version is 1.85.)
pub trait AsPlugin {
    fn plugin(&self) -> &dyn Plugin;
}

impl<T: Plugin> AsPlugin for T {
    fn plugin(&self) -> &dyn Plugin {
        self
    }
}

/// A built plugin, by role.
#[derive(Clone)]
pub enum PluginInstance {
    Filter(Arc<dyn Filter>),
    Scorer(Arc<dyn Scorer>),
    Picker(Arc<dyn Picker>),
}

impl PluginInstance {
    /// The instance's [`Plugin`] part (see [`AsPlugin`]).
    pub fn as_plugin(&self) -> &dyn Plugin {
        match self {
            PluginInstance::Filter(p) => p.plugin(),
            PluginInstance::Scorer(p) => p.plugin(),
            PluginInstance::Picker(p) => p.plugin(),
        }
    }

    pub fn role(&self) -> Role {
        match self {
            PluginInstance::Filter(_) => Role::Filter,
            PluginInstance::Scorer(_) => Role::Scorer,
            PluginInstance::Picker(_) => Role::Picker,
        }
    }
}

/// Where a plugin sits in a profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Filter,
    Scorer,
    Picker,
}

/// Which instance a plugin works through (see [`Plugin::link_target`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link<'a> {
    /// The instance named in the plugin's parameter `param`; a profile using the plugin must
    /// include it (it runs the hooks that keep the shared state).
    Named { param: &'static str, name: &'a str },
    /// The first plugin of this type in the profile in effect, if it has one; without one the
    /// plugin works on its own.
    FirstOfType(&'static str),
}

impl Link<'_> {
    /// The instance this link resolves to in a profile whose plugins are `refs` (instance
    /// names in profile order), `type_of` giving an instance's type.
    pub fn resolve<'r>(
        &self,
        refs: impl IntoIterator<Item = &'r str>,
        type_of: impl Fn(&str) -> Option<&'static str>,
    ) -> Option<String> {
        match self {
            Link::Named { name, .. } => Some((*name).to_owned()),
            Link::FirstOfType(ty) => refs
                .into_iter()
                .find(|r| type_of(r) == Some(*ty))
                .map(str::to_owned),
        }
    }
}

/// Removes candidates that must not serve the request. A filter that would remove every
/// candidate for a soft reason (load) should keep them all instead; hard reasons (health,
/// model, a concurrency limit) may empty the list, and then [`Filter::when_empty`] says what
/// that means.
pub trait Filter: Plugin + AsPlugin {
    fn filter(&self, request: &RequestView, candidates: &mut Vec<Candidate<'_>>);
    /// What an empty list after this filter means. Filters with a [`Filter::capacity`] mean
    /// [`Rejection::AtCapacity`]; the default is [`Rejection::Unavailable`].
    fn when_empty(&self) -> Rejection {
        if self.capacity().is_some() {
            Rejection::AtCapacity
        } else {
            Rejection::Unavailable
        }
    }
    /// The per-backend in-flight limit this filter enforces, if any. The scheduler reserves
    /// the picked backend's slot atomically under the smallest such limit of the profile, so
    /// concurrent decisions cannot all pass a limit read moments earlier.
    fn capacity(&self) -> Option<u64> {
        None
    }
}

/// Gives each candidate a score, ideally in [0, 1] (the profile clamps it anyway).
pub trait Scorer: Plugin + AsPlugin {
    /// The backend signals the scorer reads (checked against each engine at start-up).
    fn consumes(&self) -> &'static [Signal] {
        &[]
    }
    /// Write one score per candidate into `scores` (same length and order as `candidates`).
    fn score(
        &self,
        request: &RequestView,
        state: &mut CycleState,
        candidates: &[Candidate<'_>],
        scores: &mut [f64],
    );
}

/// Chooses one candidate from the weighted totals.
pub trait Picker: Plugin + AsPlugin {
    /// Index into `candidates`; `None` only when `candidates` is empty.
    fn pick(&self, candidates: &[Candidate<'_>], totals: &[f64]) -> Option<usize>;
}

/// Indices of the entries within a hair of the maximum, so ties are detected despite rounding.
pub fn top_indices(totals: &[f64], out: &mut Vec<usize>) {
    out.clear();
    let max = totals.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let eps = 1e-9 * max.abs().max(1.0);
    out.extend(
        totals
            .iter()
            .enumerate()
            .filter(|(_, v)| **v >= max - eps)
            .map(|(i, _)| i),
    );
}

/// Min–max normalisation where lower raw values are better: `(max − v) / (max − min)`.
/// All equal → 1 for everyone. Unknown values (`None`) score 0.5, a neutral middle, and do not
/// take part in the min and max.
pub fn lower_is_better(values: impl Iterator<Item = Option<f64>> + Clone, scores: &mut [f64]) {
    let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.clone().flatten() {
        min = min.min(v);
        max = max.max(v);
    }
    for (slot, v) in scores.iter_mut().zip(values) {
        *slot = match v {
            None => 0.5,
            Some(_) if max - min <= f64::EPSILON => 1.0,
            Some(v) => (max - v) / (max - min),
        };
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn top_indices_finds_ties() {
        let mut out = Vec::new();
        top_indices(&[1.0, 3.0, 3.0 - 1e-12, 2.0], &mut out);
        assert_eq!(out, vec![1, 2]);
        top_indices(&[], &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn lower_is_better_table() {
        let cases: &[(&[Option<f64>], &[f64])] = &[
            (&[Some(0.0), Some(5.0), Some(10.0)], &[1.0, 0.5, 0.0]),
            (&[Some(3.0), Some(3.0)], &[1.0, 1.0]),
            (&[None, None], &[0.5, 0.5]),
            (&[None, Some(2.0), Some(4.0)], &[0.5, 1.0, 0.0]),
            (&[Some(7.0)], &[1.0]),
        ];
        for (input, want) in cases {
            let mut scores = vec![0.0; input.len()];
            lower_is_better(input.iter().copied(), &mut scores);
            assert_eq!(&scores, want, "{input:?}");
        }
    }

    #[test]
    fn cycle_state_roundtrip() {
        let key: Arc<str> = Arc::from("p");
        let mut state = CycleState::default();
        state.put(&key, 5u32);
        state.put(&key, 6u32);
        assert_eq!(state.get::<u32>("p"), Some(&6));
        assert_eq!(state.get::<u64>("p"), None);
        assert_eq!(state.get::<u32>("q"), None);
        assert_eq!(state.decision(), 0);
        state.begin_decision();
        state.begin_decision();
        assert_eq!(state.decision(), 2);
    }
}
