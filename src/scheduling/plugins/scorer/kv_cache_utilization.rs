//! `kv-cache-utilization-scorer`: prefers backends with free KV cache.
//!
//! score = 1 − kv_usage, where kv_usage ∈ [0, 1] is the fraction of KV blocks held by running
//! requests (`vllm:kv_cache_usage_perc`). Unknown or stale usage scores 0.5 (neutral).

use std::sync::Arc;

use crate::endpoints::Candidate;
use crate::prompt::RequestView;
use crate::scheduling::framework::{CycleState, Plugin, Scorer, Signal};
use crate::scheduling::plugins::identity;

pub struct KvCacheUtilizationScorer {
    name: Arc<str>,
}

impl KvCacheUtilizationScorer {
    pub const TYPE: &'static str = "kv-cache-utilization-scorer";

    pub fn new(name: &str) -> Self {
        KvCacheUtilizationScorer { name: name.into() }
    }
}

impl Plugin for KvCacheUtilizationScorer {
    identity!();
}

impl Scorer for KvCacheUtilizationScorer {
    fn consumes(&self) -> &'static [Signal] {
        &[Signal::KvUsage]
    }

    fn score(
        &self,
        _: &RequestView,
        _: &mut CycleState,
        candidates: &[Candidate<'_>],
        scores: &mut [f64],
    ) {
        for (slot, c) in scores.iter_mut().zip(candidates) {
            *slot = c
                .metrics()
                .and_then(|m| m.kv_usage)
                .map_or(0.5, |u| 1.0 - u.clamp(0.0, 1.0));
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::endpoints::test_support::{backends, load};
    use crate::prompt::Operation;

    #[test]
    fn one_minus_usage_and_neutral_unknown() {
        let b = backends(4);
        let c = vec![
            Candidate::with_metrics(&b[0], Some(load(None, Some(0.25))), 0),
            Candidate::with_metrics(&b[1], Some(load(None, Some(1.0))), 0),
            Candidate::with_metrics(&b[2], Some(load(None, None)), 0),
            Candidate::with_metrics(&b[3], None, 0),
        ];
        let mut s = vec![0.0; 4];
        let view = RequestView::parse(Operation::Completions, br#"{"prompt":"x"}"#).unwrap();
        KvCacheUtilizationScorer::new("kv").score(&view, &mut CycleState::default(), &c, &mut s);
        assert_eq!(s, vec![0.75, 0.0, 0.5, 0.5]);
    }
}
