//! `lora-affinity-scorer`: sends a LoRA adapter's requests where the adapter is already loaded,
//! then where it can be loaded without evicting one in use.
//!
//! Inputs: `vllm:lora_requests_info` from the last fresh scrape — `running_lora_adapters` R,
//! `waiting_lora_adapters` W, `max_lora` m — and the requested model A. The request is for an
//! adapter when some candidate lists A in `/v1/models` with a `parent`, or reports A running or
//! waiting; otherwise (a base model, no model) every candidate scores 0.5 (no opinion). The
//! model filter has already kept only backends that serve A.
//!
//! For an adapter request, with `others = |(R ∪ W) \ {A}|` (the other adapters with requests
//! there):
//!
//! | case | score |
//! | --- | --- |
//! | A ∈ R (running: loaded, no swap) | 1 |
//! | A ∉ R and `others < m` (a free slot: loading A evicts nothing in use) | 0.75 |
//! | A ∉ R and `others ≥ m` (every slot busy with other adapters: A waits, then evicts one) | 0 |
//! | no LoRA info (stale metrics, no series, no `max_lora`) | 0.5 |

use std::sync::Arc;

use crate::endpoints::Candidate;
use crate::prompt::RequestView;
use crate::scheduling::framework::{CycleState, Plugin, Scorer, Signal};
use crate::scheduling::plugins::identity;

/// Score of a backend with a free adapter slot.
pub const FREE_SLOT: f64 = 0.75;

pub struct LoraAffinityScorer {
    name: Arc<str>,
}

impl LoraAffinityScorer {
    pub const TYPE: &'static str = "lora-affinity-scorer";

    pub fn new(name: &str) -> Self {
        LoraAffinityScorer { name: name.into() }
    }
}

/// Is `model` a LoRA adapter, as far as the candidates tell?
fn is_adapter(model: &str, candidates: &[Candidate<'_>]) -> bool {
    candidates.iter().any(|c| {
        let listed = c
            .state
            .models
            .iter()
            .any(|m| m.id == model && m.object.get("parent").is_some_and(|p| p.is_string()));
        listed
            || c.metrics().is_some_and(|m| {
                m.running_loras.iter().any(|l| l == model)
                    || m.waiting_loras.iter().any(|l| l == model)
            })
    })
}

fn score_one(adapter: &str, c: &Candidate<'_>) -> f64 {
    let Some(m) = c.metrics() else {
        return 0.5;
    };
    let Some(max) = m.max_lora else {
        return 0.5;
    };
    if m.running_loras.iter().any(|l| l == adapter) {
        return 1.0;
    }
    let mut others: Vec<&str> = m
        .running_loras
        .iter()
        .chain(&m.waiting_loras)
        .map(String::as_str)
        .filter(|l| *l != adapter && !l.is_empty())
        .collect();
    others.sort_unstable();
    others.dedup();
    if (others.len() as u64) < max {
        FREE_SLOT
    } else {
        0.0
    }
}

impl Plugin for LoraAffinityScorer {
    identity!();
}

impl Scorer for LoraAffinityScorer {
    fn consumes(&self) -> &'static [Signal] {
        &[Signal::Lora]
    }

    fn score(
        &self,
        request: &RequestView,
        _: &mut CycleState,
        candidates: &[Candidate<'_>],
        scores: &mut [f64],
    ) {
        let adapter = request
            .model
            .as_deref()
            .filter(|m| is_adapter(m, candidates));
        for (slot, c) in scores.iter_mut().zip(candidates) {
            *slot = adapter.map_or(0.5, |a| score_one(a, c));
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::endpoints::engine::LoadMetrics;
    use crate::endpoints::test_support::backends;
    use crate::endpoints::{BackendState, ModelEntry};
    use crate::prompt::Operation;

    fn view(model: &str) -> RequestView {
        let body = format!(r#"{{"model":"{model}","prompt":"x"}}"#);
        RequestView::parse(Operation::Completions, body.as_bytes()).unwrap()
    }

    fn lora(running: &[&str], waiting: &[&str], max: Option<u64>) -> LoadMetrics {
        LoadMetrics {
            running_loras: running.iter().map(|s| (*s).to_owned()).collect(),
            waiting_loras: waiting.iter().map(|s| (*s).to_owned()).collect(),
            max_lora: max,
            ..Default::default()
        }
    }

    /// Give a candidate a `/v1/models` list: the base `base` and the adapters.
    fn listing(c: &mut Candidate<'_>, adapters: &[&str]) {
        let mut models = vec![ModelEntry {
            id: "base".into(),
            object: serde_json::json!({"id": "base", "parent": null}),
        }];
        for a in adapters {
            models.push(ModelEntry {
                id: (*a).into(),
                object: serde_json::json!({"id": a, "parent": "base"}),
            });
        }
        let state = BackendState {
            models: models.into(),
            ..(*c.state).clone()
        };
        c.state = Arc::new(state);
    }

    fn run(model: &str, c: &[Candidate<'_>]) -> Vec<f64> {
        let mut s = vec![-1.0; c.len()];
        LoraAffinityScorer::new("l").score(&view(model), &mut CycleState::default(), c, &mut s);
        s
    }

    #[test]
    fn running_then_free_slot_then_full_of_others() {
        let b = backends(6);
        let mut c = vec![
            Candidate::with_metrics(&b[0], Some(lora(&["a"], &[], Some(2))), 0),
            Candidate::with_metrics(&b[1], Some(lora(&["x"], &[], Some(2))), 0),
            Candidate::with_metrics(&b[2], Some(lora(&["x", "y"], &[], Some(2))), 0),
            Candidate::with_metrics(&b[3], Some(lora(&["x"], &["y", "a"], Some(2))), 0),
            Candidate::with_metrics(&b[4], Some(lora(&[], &[], None)), 0),
            Candidate::with_metrics(&b[5], None, 0),
        ];
        for cand in &mut c {
            listing(cand, &["a", "x", "y"]);
        }
        assert_eq!(run("a", &c), vec![1.0, FREE_SLOT, 0.0, 0.0, 0.5, 0.5]);
        // A's own waiting requests do not count against it: x and a waiting, one slot free.
        let d = vec![Candidate::with_metrics(
            &b[0],
            Some(lora(&["x"], &["a"], Some(2))),
            0,
        )];
        assert_eq!(run("a", &d), vec![FREE_SLOT]);
    }

    #[test]
    fn base_model_and_unknown_models_get_no_opinion() {
        let b = backends(2);
        let mut c = vec![
            Candidate::with_metrics(&b[0], Some(lora(&["a"], &[], Some(1))), 0),
            Candidate::with_metrics(&b[1], Some(lora(&["x"], &[], Some(1))), 0),
        ];
        for cand in &mut c {
            listing(cand, &["a", "x"]);
        }
        assert_eq!(run("base", &c), vec![0.5, 0.5]);
        assert_eq!(run("nobody-lists-this", &c), vec![0.5, 0.5]);
    }

    #[test]
    fn an_adapter_known_only_from_metrics_counts() {
        // Fixed model lists (no `parent` known): the metrics still say `a` is an adapter.
        let b = backends(2);
        let c = vec![
            Candidate::with_metrics(&b[0], Some(lora(&["a"], &[], Some(1))), 0),
            Candidate::with_metrics(&b[1], Some(lora(&["x"], &[], Some(1))), 0),
        ];
        assert_eq!(run("a", &c), vec![1.0, 0.0]);
    }
}
