//! `round-robin-picker`: rotates through the candidates in order, ignoring scores — the
//! baseline a cache-blind balancer gives.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::endpoints::Candidate;
use crate::scheduling::framework::{Picker, Plugin};
use crate::scheduling::plugins::identity;

pub struct RoundRobinPicker {
    name: Arc<str>,
    next: AtomicUsize,
}

impl RoundRobinPicker {
    pub const TYPE: &'static str = "round-robin-picker";

    pub fn new(name: &str) -> Self {
        RoundRobinPicker {
            name: name.into(),
            next: AtomicUsize::new(0),
        }
    }
}

impl Plugin for RoundRobinPicker {
    identity!();
}

impl Picker for RoundRobinPicker {
    fn pick(&self, candidates: &[Candidate<'_>], _totals: &[f64]) -> Option<usize> {
        (!candidates.is_empty())
            .then(|| self.next.fetch_add(1, Ordering::Relaxed) % candidates.len())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::endpoints::test_support::backends;

    #[test]
    fn rotates() {
        let b = backends(3);
        let c: Vec<_> = b
            .iter()
            .map(|b| Candidate::with_metrics(b, None, 0))
            .collect();
        let p = RoundRobinPicker::new("rr");
        let picks: Vec<_> = (0..6)
            .map(|_| p.pick(&c, &[9.0, 0.0, 0.0]).unwrap())
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    }
}
