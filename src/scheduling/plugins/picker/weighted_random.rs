//! `weighted-random-picker`: chooses candidate i with probability totalᵢ / Σ total
//! (uniform when every total is 0). Spreads load in proportion to fitness instead of always
//! taking the top, which helps when several routers share a fleet.

use std::sync::Arc;

use crate::endpoints::Candidate;
use crate::scheduling::framework::{Picker, Plugin};
use crate::scheduling::plugins::identity;

pub struct WeightedRandomPicker {
    name: Arc<str>,
}

impl WeightedRandomPicker {
    pub const TYPE: &'static str = "weighted-random-picker";

    pub fn new(name: &str) -> Self {
        WeightedRandomPicker { name: name.into() }
    }
}

impl Plugin for WeightedRandomPicker {
    identity!();
}

impl Picker for WeightedRandomPicker {
    fn pick(&self, candidates: &[Candidate<'_>], totals: &[f64]) -> Option<usize> {
        if candidates.is_empty() {
            return None;
        }
        let weight = |v: f64| if v.is_finite() && v > 0.0 { v } else { 0.0 };
        let sum: f64 = totals.iter().map(|v| weight(*v)).sum();
        if sum <= 0.0 {
            return Some(fastrand::usize(..candidates.len()));
        }
        let mut target = fastrand::f64() * sum;
        for (i, v) in totals.iter().enumerate() {
            target -= weight(*v);
            if target < 0.0 {
                return Some(i);
            }
        }
        totals.iter().rposition(|v| weight(*v) > 0.0)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::endpoints::test_support::backends;

    #[test]
    fn proportional_and_never_zero_weight() {
        let b = backends(3);
        let c: Vec<_> = b
            .iter()
            .map(|b| Candidate::with_metrics(b, None, 0))
            .collect();
        let p = WeightedRandomPicker::new("w");
        let mut seen = [0usize; 3];
        for _ in 0..2000 {
            seen[p.pick(&c, &[3.0, 1.0, 0.0]).unwrap()] += 1;
        }
        assert_eq!(seen[2], 0);
        assert!(seen[0] > 2 * seen[1], "{seen:?}");
        let mut zero = [0usize; 3];
        for _ in 0..300 {
            zero[p.pick(&c, &[0.0, 0.0, 0.0]).unwrap()] += 1;
        }
        assert!(
            zero.iter().all(|n| *n > 30),
            "all-zero totals pick uniformly: {zero:?}"
        );
    }
}
