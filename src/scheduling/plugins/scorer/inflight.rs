//! `inflight-scorer`: prefers backends with fewer requests in flight *from this router*.
//!
//! score = (max − n) / (max − min) over the candidates' in-flight counts n; 1 for everyone
//! when all are equal. The counts are the router's own atomics, incremented at dispatch and
//! released when a response ends, fails or is abandoned — the only load signal that is fresh
//! between two metric polls, so a burst does not all land on the backend that looked idlest.

use std::sync::Arc;

use crate::endpoints::Candidate;
use crate::prompt::RequestView;
use crate::scheduling::framework::{lower_is_better, CycleState, Plugin, Scorer};
use crate::scheduling::plugins::identity;

pub struct InflightScorer {
    name: Arc<str>,
}

impl InflightScorer {
    pub const TYPE: &'static str = "inflight-scorer";

    pub fn new(name: &str) -> Self {
        InflightScorer { name: name.into() }
    }
}

impl Plugin for InflightScorer {
    identity!();
}

impl Scorer for InflightScorer {
    fn score(
        &self,
        _: &RequestView,
        _: &mut CycleState,
        candidates: &[Candidate<'_>],
        scores: &mut [f64],
    ) {
        lower_is_better(candidates.iter().map(|c| Some(c.inflight as f64)), scores);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::endpoints::test_support::backends;
    use crate::prompt::Operation;

    #[test]
    fn min_max_over_router_inflight() {
        let b = backends(3);
        let view = RequestView::parse(Operation::Completions, br#"{"prompt":"x"}"#).unwrap();
        let mut s = vec![0.0; 3];
        let c: Vec<_> = [4, 0, 2]
            .iter()
            .enumerate()
            .map(|(i, n)| Candidate::with_metrics(&b[i], None, *n))
            .collect();
        InflightScorer::new("i").score(&view, &mut CycleState::default(), &c, &mut s);
        assert_eq!(s, vec![0.0, 1.0, 0.5]);
        let c: Vec<_> = (0..3)
            .map(|i| Candidate::with_metrics(&b[i], None, 7))
            .collect();
        InflightScorer::new("i").score(&view, &mut CycleState::default(), &c, &mut s);
        assert_eq!(s, vec![1.0, 1.0, 1.0]);
    }
}
