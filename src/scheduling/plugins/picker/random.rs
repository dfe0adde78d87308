//! `random-picker`: uniform choice among the candidates, ignoring scores (a baseline).

use std::sync::Arc;

use crate::endpoints::Candidate;
use crate::scheduling::framework::{Picker, Plugin};
use crate::scheduling::plugins::identity;

pub struct RandomPicker {
    name: Arc<str>,
}

impl RandomPicker {
    pub const TYPE: &'static str = "random-picker";

    pub fn new(name: &str) -> Self {
        RandomPicker { name: name.into() }
    }
}

impl Plugin for RandomPicker {
    identity!();
}

impl Picker for RandomPicker {
    fn pick(&self, candidates: &[Candidate<'_>], _totals: &[f64]) -> Option<usize> {
        (!candidates.is_empty()).then(|| fastrand::usize(..candidates.len()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::endpoints::test_support::backends;

    #[test]
    fn uniform_regardless_of_scores() {
        let b = backends(2);
        let c: Vec<_> = b
            .iter()
            .map(|b| Candidate::with_metrics(b, None, 0))
            .collect();
        let p = RandomPicker::new("r");
        let mut seen = [0usize; 2];
        for _ in 0..200 {
            seen[p.pick(&c, &[1.0, 0.0]).unwrap()] += 1;
        }
        assert!(seen[1] > 40, "{seen:?}");
        assert_eq!(p.pick(&[], &[]), None);
    }
}
