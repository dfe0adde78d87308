//! `max-score-picker`: the highest total wins; ties break uniformly at random among the tied
//! top (never by index order, which would send every tie to the first backend).

use std::sync::Arc;

use crate::endpoints::Candidate;
use crate::scheduling::framework::{top_indices, Picker, Plugin};
use crate::scheduling::plugins::identity;

pub struct MaxScorePicker {
    name: Arc<str>,
}

impl MaxScorePicker {
    pub const TYPE: &'static str = "max-score-picker";

    pub fn new(name: &str) -> Self {
        MaxScorePicker { name: name.into() }
    }
}

impl Plugin for MaxScorePicker {
    identity!();
}

impl Picker for MaxScorePicker {
    fn pick(&self, candidates: &[Candidate<'_>], totals: &[f64]) -> Option<usize> {
        if candidates.is_empty() {
            return None;
        }
        let mut top = Vec::with_capacity(4);
        top_indices(totals, &mut top);
        match top.len() {
            0 => Some(fastrand::usize(..candidates.len())),
            1 => Some(top[0]),
            n => Some(top[fastrand::usize(..n)]),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::endpoints::test_support::backends;

    #[test]
    fn highest_wins_and_ties_spread() {
        let b = backends(3);
        let c: Vec<_> = b
            .iter()
            .map(|b| Candidate::with_metrics(b, None, 0))
            .collect();
        let p = MaxScorePicker::new("p");
        assert_eq!(p.pick(&c, &[0.1, 0.9, 0.5]), Some(1));
        let mut seen = [0usize; 3];
        for _ in 0..300 {
            seen[p.pick(&c, &[1.0, 1.0, 0.0]).unwrap()] += 1;
        }
        assert_eq!(seen[2], 0);
        assert!(
            seen[0] > 50 && seen[1] > 50,
            "ties must not favour index order: {seen:?}"
        );
        assert_eq!(p.pick(&[], &[]), None);
    }
}
