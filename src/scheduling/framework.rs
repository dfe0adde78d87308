//! The scheduling framework's extension points: [`Filter`], [`Scorer`], [`Picker`], and the
//! request-lifecycle hooks every [`Plugin`] may implement.
//!
//! Each trait has one required method and defaults for the rest. A plugin never sees the
//! proxy: it reads [`Candidate`]s (a backend plus the snapshot of its state taken for this
//! decision) and the request's [`RequestView`]. Scores are plain numbers the profile clamps
//! to [0, 1] and weighs in one place, so no plugin can drown out the others by accident.

use std::any::Any;
use std::sync::Arc;

use crate::endpoints::{Backend, Candidate};
use crate::prompt::RequestView;

/// What a scorer is about; reported in logs and used to reason about profiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Category {
    /// Prefers backends that already hold the request's state (prefix cache, session).
    Affinity,
    /// Spreads load (queue, KV usage, in-flight).
    Distribution,
}

/// How a request ended, for `on_complete` hooks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The response body ended normally.
    Success,
    /// The backend failed or answered with an error status.
    Failed,
    /// The client went away before the body ended.
    Cancelled,
}

/// Per-decision scratch space where plugins leave data for their own later hooks
/// (the prefix scorer keeps the request's block hashes here between scoring and recording).
#[derive(Default)]
pub struct CycleState {
    entries: Vec<(Arc<str>, Box<dyn Any + Send + Sync>)>,
}

impl CycleState {
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

/// Identity and lifecycle hooks shared by every plugin.
pub trait Plugin: Send + Sync {
    /// The factory name, e.g. `"queue-scorer"`.
    fn type_name(&self) -> &'static str;
    /// The instance name from config (defaults to the type name).
    fn name(&self) -> &str;
    /// Called once the profile has picked `backend` for `request`.
    fn after_pick(&self, _request: &RequestView, _state: &CycleState, _backend: &Backend) {}
    /// Called when the response to `request` has ended, one way or another.
    fn on_complete(&self, _request: &RequestView, _backend: &Backend, _outcome: Outcome) {}
}

/// Removes candidates that must not serve the request. A filter that would remove every
/// candidate for a soft reason (load) should keep them all instead; hard reasons (health,
/// model) may empty the list, which the scheduler reports as an error.
pub trait Filter: Plugin {
    fn filter(&self, request: &RequestView, candidates: &mut Vec<Candidate<'_>>);
}

/// Gives each candidate a score, ideally in [0, 1] (the profile clamps it anyway).
pub trait Scorer: Plugin {
    fn category(&self) -> Category;
    /// Names of the backend signals the scorer reads, for docs and debugging.
    fn consumes(&self) -> &'static [&'static str] {
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
pub trait Picker: Plugin {
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
    }
}
