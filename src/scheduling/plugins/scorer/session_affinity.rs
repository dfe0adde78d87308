//! `session-affinity-scorer`: keeps each session on one backend while that backend can take it.
//!
//! Key: the request's session, which the front door takes from the `session_header` (default
//! `x-session-id`) or, with `session_from_user = true`, from the OpenAI `user` field. A request
//! without a session scores 0 everywhere (no opinion).
//!
//! A candidate is *overloaded* when (consistent hashing with bounded loads)
//! `inflight ≥ ⌈load_factor × (Σ inflight + 1) / candidates⌉` over the candidates' router
//! in-flight counts and `inflight ≥ min_inflight` (default 8: at a few requests the bound
//! would move sessions, and their cached prefixes, for a difference an engine's batch does not
//! feel — measured on loadgen's multi-turn workload), or when its last fresh scrape shows
//! `waiting > max_waiting`.
//!
//! The session's *home* is:
//! 1. the backend it was last sent to (a bounded table of `max_sessions` entries, each
//!    forgotten after `idle_timeout_ms` without a request), if that backend is a candidate
//!    (healthy, serving the model, not filtered) and not overloaded;
//! 2. otherwise the candidate with the highest rendezvous weight `xxh3(url, seed = session)`
//!    among those not overloaded (among all of them if every one is).
//!
//! score = 1 for the home, 0 for every other candidate.
//!
//! After a request is sent the table records the backend it went to, so a session that had to
//! move stays on its new backend. Rendezvous hashing places sessions that have no entry
//! (new ones, or those another replica started) the same way on every replica, and a backend
//! joining or leaving moves only the sessions it takes or held.

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::config_error::ConfigError;
use crate::endpoints::{Backend, Candidate};
use crate::prompt::RequestView;
use crate::scheduling::framework::{CycleState, Plugin, Scorer, Signal};
use crate::scheduling::plugins::{identity, parameters};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Params {
    load_factor: f64,
    min_inflight: u64,
    max_waiting: f64,
    max_sessions: u64,
    idle_timeout_ms: u64,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            load_factor: 1.25,
            min_inflight: 8,
            max_waiting: 16.0,
            max_sessions: 100_000,
            idle_timeout_ms: 1_800_000,
        }
    }
}

pub struct SessionAffinityScorer {
    name: Arc<str>,
    load_factor: f64,
    min_inflight: u64,
    max_waiting: f64,
    /// session hash → uid of the backend it was last sent to.
    homes: moka::sync::Cache<u64, usize>,
}

impl SessionAffinityScorer {
    pub const TYPE: &'static str = "session-affinity-scorer";

    pub fn from_parameters(name: &str, table: &toml::Table) -> Result<Self, ConfigError> {
        let p: Params = parameters(name, table)?;
        if !(1.0..=100.0).contains(&p.load_factor) || p.max_waiting.is_nan() || p.max_waiting < 0.0
        {
            return Err(ConfigError::invalid(
                format!("plugins.{name}.parameters"),
                "load_factor must be within 1..=100 and max_waiting at least 0",
            ));
        }
        if p.max_sessions == 0 || p.max_sessions > 10_000_000 || p.idle_timeout_ms == 0 {
            return Err(ConfigError::invalid(
                format!("plugins.{name}.parameters"),
                "max_sessions must be within 1..=10000000 and idle_timeout_ms greater than 0",
            ));
        }
        Ok(SessionAffinityScorer {
            name: name.into(),
            load_factor: p.load_factor,
            min_inflight: p.min_inflight,
            max_waiting: p.max_waiting,
            homes: moka::sync::Cache::builder()
                .max_capacity(p.max_sessions)
                .time_to_idle(Duration::from_millis(p.idle_timeout_ms))
                .build(),
        })
    }

    /// Which candidates are overloaded (see the module doc).
    fn overloaded(&self, candidates: &[Candidate<'_>]) -> Vec<bool> {
        let total: u64 = candidates
            .iter()
            .map(|c| c.inflight)
            .fold(0, u64::saturating_add);
        let n = candidates.len().max(1) as f64;
        let cap = (self.load_factor * (total as f64 + 1.0) / n).ceil();
        candidates
            .iter()
            .map(|c| {
                (c.inflight >= self.min_inflight && c.inflight as f64 >= cap)
                    || c.metrics()
                        .and_then(|m| m.waiting)
                        .is_some_and(|w| w > self.max_waiting)
            })
            .collect()
    }

    /// Index of the session's home among `candidates`.
    fn home(&self, session: u64, candidates: &[Candidate<'_>]) -> Option<usize> {
        let over = self.overloaded(candidates);
        if let Some(uid) = self.homes.get(&session) {
            if let Some(i) = candidates.iter().position(|c| c.backend.uid == uid) {
                if !over[i] {
                    return Some(i);
                }
            }
        }
        let all_over = over.iter().all(|o| *o);
        candidates
            .iter()
            .enumerate()
            .filter(|(i, _)| all_over || !over[*i])
            .max_by_key(|(_, c)| xxh3_64_with_seed(c.backend.name.as_bytes(), session))
            .map(|(i, _)| i)
    }
}

impl Plugin for SessionAffinityScorer {
    identity!();

    fn after_pick(&self, request: &RequestView, _: &CycleState, backend: &Backend) {
        if let Some(session) = request.session {
            self.homes.insert(session, backend.uid);
        }
    }
}

impl Scorer for SessionAffinityScorer {
    fn consumes(&self) -> &'static [Signal] {
        &[Signal::Waiting]
    }

    fn score(
        &self,
        request: &RequestView,
        _: &mut CycleState,
        candidates: &[Candidate<'_>],
        scores: &mut [f64],
    ) {
        scores.fill(0.0);
        let Some(session) = request.session else {
            return;
        };
        if let Some(i) = self.home(session, candidates) {
            if let Some(s) = scores.get_mut(i) {
                *s = 1.0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::endpoints::test_support::{backends, load};
    use crate::prompt::Operation;

    fn scorer() -> SessionAffinityScorer {
        SessionAffinityScorer::from_parameters("s", &toml::Table::new()).unwrap()
    }

    fn view(session: Option<u64>) -> RequestView {
        let mut v = RequestView::parse(Operation::Completions, br#"{"prompt":"x"}"#).unwrap();
        v.session = session;
        v
    }

    fn scores(s: &SessionAffinityScorer, v: &RequestView, c: &[Candidate<'_>]) -> Vec<f64> {
        let mut out = vec![0.5; c.len()];
        s.score(v, &mut CycleState::default(), c, &mut out);
        out
    }

    fn one_hot(i: usize, n: usize) -> Vec<f64> {
        (0..n).map(|j| if j == i { 1.0 } else { 0.0 }).collect()
    }

    /// The rendezvous winner among `allowed` backends, computed independently.
    fn hrw(b: &[Arc<Backend>], session: u64, allowed: &[usize]) -> usize {
        *allowed
            .iter()
            .max_by_key(|i| xxh3_64_with_seed(b[**i].name.as_bytes(), session))
            .unwrap()
    }

    #[test]
    fn no_session_no_opinion() {
        let b = backends(3);
        let c: Vec<_> = b
            .iter()
            .map(|b| Candidate::with_metrics(b, None, 0))
            .collect();
        assert_eq!(scores(&scorer(), &view(None), &c), vec![0.0; 3]);
    }

    #[test]
    fn a_new_session_goes_to_its_rendezvous_winner_then_stays_where_it_was_sent() {
        let b = backends(4);
        let s = scorer();
        let c: Vec<_> = b
            .iter()
            .map(|b| Candidate::with_metrics(b, None, 0))
            .collect();
        for session in 0..50u64 {
            let want = hrw(&b, session, &[0, 1, 2, 3]);
            assert_eq!(scores(&s, &view(Some(session)), &c), one_hot(want, 4));
        }
        // Session 7 was sent elsewhere (other scorers won): it now lives there.
        let winner = hrw(&b, 7, &[0, 1, 2, 3]);
        let other = (winner + 1) % 4;
        s.after_pick(&view(Some(7)), &CycleState::default(), &b[other]);
        s.homes.run_pending_tasks();
        assert_eq!(scores(&s, &view(Some(7)), &c), one_hot(other, 4));
    }

    #[test]
    fn an_overloaded_home_moves_the_session_and_it_stays_moved() {
        let b = backends(3);
        let s = scorer();
        let session = 42;
        let home = hrw(&b, session, &[0, 1, 2]);
        s.after_pick(&view(Some(session)), &CycleState::default(), &b[home]);
        // Home holds 7 of 7 in flight: above cap = ceil(1.25 × 8 / 3) = 4, but below
        // min_inflight = 8, so the session stays.
        let few: Vec<_> = (0..3)
            .map(|i| Candidate::with_metrics(&b[i], None, if i == home { 7 } else { 0 }))
            .collect();
        assert_eq!(scores(&s, &view(Some(session)), &few), one_hot(home, 3));
        // Home holds 12 of 12: cap = ceil(1.25 × 13 / 3) = 6 and 12 ≥ 8, so it is overloaded.
        let busy: Vec<_> = (0..3)
            .map(|i| Candidate::with_metrics(&b[i], None, if i == home { 12 } else { 0 }))
            .collect();
        let rest: Vec<usize> = (0..3).filter(|i| *i != home).collect();
        let second = hrw(&b, session, &rest);
        assert_eq!(scores(&s, &view(Some(session)), &busy), one_hot(second, 3));
        s.after_pick(&view(Some(session)), &CycleState::default(), &b[second]);
        // The old home is idle again; the session stays on the backend it moved to.
        let idle: Vec<_> = b
            .iter()
            .map(|b| Candidate::with_metrics(b, None, 0))
            .collect();
        assert_eq!(scores(&s, &view(Some(session)), &idle), one_hot(second, 3));
        // A queue above max_waiting also counts as overloaded.
        let queued: Vec<_> = (0..3)
            .map(|i| {
                let w = if i == second { 17.0 } else { 0.0 };
                Candidate::with_metrics(&b[i], Some(load(Some(w), None)), 0)
            })
            .collect();
        let others: Vec<usize> = (0..3).filter(|i| *i != second).collect();
        assert_eq!(
            scores(&s, &view(Some(session)), &queued),
            one_hot(hrw(&b, session, &others), 3)
        );
        // Everyone overloaded: the rendezvous winner over all (a session must land somewhere).
        let all: Vec<_> = b
            .iter()
            .map(|b| Candidate::with_metrics(b, Some(load(Some(99.0), None)), 0))
            .collect();
        assert_eq!(
            scores(&s, &view(Some(900)), &all),
            one_hot(hrw(&b, 900, &[0, 1, 2]), 3)
        );
    }

    #[test]
    fn a_backend_leaving_moves_only_its_own_sessions() {
        let b = backends(5);
        let s = scorer();
        let all: Vec<_> = b
            .iter()
            .map(|b| Candidate::with_metrics(b, None, 0))
            .collect();
        let without: Vec<_> = b[..4]
            .iter()
            .map(|b| Candidate::with_metrics(b, None, 0))
            .collect();
        let home = |c: &[Candidate<'_>], session| {
            let out = scores(&s, &view(Some(session)), c);
            c[out.iter().position(|x| *x == 1.0).unwrap()].backend.id
        };
        let (mut moved, mut on_leaver) = (0, 0);
        for session in 0..2_000u64 {
            let before = home(&all, session);
            let after = home(&without, session);
            if before == 4 {
                on_leaver += 1;
            } else if before != after {
                moved += 1;
            }
        }
        assert_eq!(moved, 0, "sessions of the backends that stay do not move");
        assert!(
            (300..500).contains(&on_leaver),
            "about a fifth lived on it: {on_leaver}"
        );
    }

    #[test]
    fn rejects_bad_parameters() {
        for bad in [
            "load_factor = 0.5",
            "max_sessions = 0",
            "idle_timeout_ms = 0",
            "sessions = 3",
        ] {
            let t: toml::Table = toml::from_str(bad).unwrap();
            assert!(
                SessionAffinityScorer::from_parameters("s", &t).is_err(),
                "{bad}"
            );
        }
    }
}
