//! `queue-scorer`: prefers backends with fewer requests waiting in their engine's queue.
//!
//! score = (max − q) / (max − min) over the candidates' waiting counts q
//! (`vllm:num_requests_waiting`); 1 for everyone when all are equal; unknown or stale → 0.5.

use std::sync::Arc;

use crate::endpoints::Candidate;
use crate::prompt::RequestView;
use crate::scheduling::framework::{lower_is_better, CycleState, Plugin, Scorer, Signal};
use crate::scheduling::plugins::identity;

pub struct QueueScorer {
    name: Arc<str>,
}

impl QueueScorer {
    pub const TYPE: &'static str = "queue-scorer";

    pub fn new(name: &str) -> Self {
        QueueScorer { name: name.into() }
    }
}

impl Plugin for QueueScorer {
    identity!();
}

impl Scorer for QueueScorer {
    fn consumes(&self) -> &'static [Signal] {
        &[Signal::Waiting]
    }

    fn score(
        &self,
        _: &RequestView,
        _: &mut CycleState,
        candidates: &[Candidate<'_>],
        scores: &mut [f64],
    ) {
        lower_is_better(
            candidates
                .iter()
                .map(|c| c.metrics().and_then(|m| m.waiting)),
            scores,
        );
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::endpoints::test_support::{backends, load};
    use crate::prompt::Operation;

    fn run(metrics: Vec<Option<f64>>) -> Vec<f64> {
        let b = backends(metrics.len());
        let c: Vec<_> = metrics
            .iter()
            .enumerate()
            .map(|(i, q)| Candidate::with_metrics(&b[i], q.map(|q| load(Some(q), None)), 0))
            .collect();
        let mut s = vec![0.0; c.len()];
        let view = RequestView::parse(Operation::Completions, br#"{"prompt":"x"}"#).unwrap();
        QueueScorer::new("q").score(&view, &mut CycleState::default(), &c, &mut s);
        s
    }

    #[test]
    fn min_max_over_waiting() {
        assert_eq!(
            run(vec![Some(0.0), Some(2.0), Some(8.0)]),
            vec![1.0, 0.75, 0.0]
        );
        assert_eq!(run(vec![Some(4.0), Some(4.0)]), vec![1.0, 1.0]);
        assert_eq!(run(vec![None, None]), vec![0.5, 0.5]);
        assert_eq!(run(vec![None, Some(1.0), Some(3.0)]), vec![0.5, 1.0, 0.0]);
    }
}
