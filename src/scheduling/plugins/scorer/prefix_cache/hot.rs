//! How much traffic each prompt prefix has brought lately: what makes a prefix hot, for placement
//! by traffic and for hot-prefix replication (see the parent module's doc).
//!
//! A prefix is named by the routing text's chain hash at a block depth (the hash covers every
//! block before it). After each pick the request's prompt tokens are added at the depths 1, 2,
//! 4, … up to its length, so a prefix of any length has a recorded depth within a factor of
//! two of it; a decision reads the depth it needs (see the parent module's doc).
//!
//! The counts live in a fixed table: two rows of `SLOTS` decaying counters
//! ([`Recent`], one-minute half-life), each key counted in one slot of each row chosen by a
//! seeded mix of its hash, and read as the smaller of its two slots (a count-min sketch). So
//! memory is fixed whatever the clients send, recording and reading never wait, and a key is
//! over-counted only when it shares both of its slots with others. Over-counting grows with
//! the traffic recorded (about `depths × traffic ÷ 4,096` a slot); at that point a prefix can
//! look hot and be replicated once more than it needed.

use std::hash::{BuildHasher, Hasher};

use crate::endpoints::sent_work::Recent;

/// Slots per row: 2 × 4,096 × 8 bytes = 64 KiB per prefix scorer.
const SLOTS: usize = 4_096;

pub struct PrefixTraffic {
    rows: [Box<[Recent]>; 2],
    /// Seeds of the rows' slot choice, drawn at start-up: which keys share a slot cannot be
    /// known from outside the process.
    seeds: [foldhash::fast::FixedState; 2],
}

impl Default for PrefixTraffic {
    fn default() -> Self {
        let row = || {
            (0..SLOTS)
                .map(|_| Recent::default())
                .collect::<Box<[Recent]>>()
        };
        PrefixTraffic {
            rows: [row(), row()],
            seeds: [
                foldhash::fast::FixedState::with_seed(fastrand::u64(..)),
                foldhash::fast::FixedState::with_seed(fastrand::u64(..)),
            ],
        }
    }
}

impl PrefixTraffic {
    fn slot(&self, row: usize, key: u64) -> &Recent {
        let mut h = self.seeds[row].build_hasher();
        h.write_u64(key);
        &self.rows[row][(h.finish() as usize) % SLOTS]
    }

    /// Count `tokens` for every recorded depth of a prompt whose chain hashes are `hashes`.
    pub fn record(&self, hashes: &[u64], tokens: f64, now_ms: u64) {
        for depth in depths(hashes.len()) {
            if let Some(&key) = hashes.get(depth - 1) {
                for row in 0..2 {
                    self.slot(row, key).add(tokens, now_ms);
                }
            }
        }
    }

    /// Recent prompt tokens of requests that shared the first `blocks` blocks of `hashes`
    /// (read at the deepest recorded depth within `blocks`; 0 for no block).
    pub fn recent(&self, hashes: &[u64], blocks: usize, now_ms: u64) -> f64 {
        let depth = recorded_depth(blocks.min(hashes.len()));
        match depth.checked_sub(1).and_then(|i| hashes.get(i)) {
            Some(&key) => self
                .slot(0, key)
                .get(now_ms)
                .min(self.slot(1, key).get(now_ms)),
            None => 0.0,
        }
    }
}

/// The depths recorded for a prompt of `n` blocks: 1, 2, 4, … ≤ n.
fn depths(n: usize) -> impl Iterator<Item = usize> {
    std::iter::successors(Some(1usize), |d| d.checked_mul(2)).take_while(move |d| *d <= n)
}

/// The deepest recorded depth within `blocks`: the largest power of two ≤ it (0 for 0).
pub(super) fn recorded_depth(blocks: usize) -> usize {
    match blocks {
        0 => 0,
        b => 1 << (usize::BITS - 1 - b.leading_zeros()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depths_are_powers_of_two_within_the_prompt() {
        assert_eq!(depths(0).count(), 0);
        assert_eq!(depths(1).collect::<Vec<_>>(), vec![1]);
        assert_eq!(depths(11).collect::<Vec<_>>(), vec![1, 2, 4, 8]);
        assert_eq!(recorded_depth(0), 0);
        assert_eq!(recorded_depth(1), 1);
        assert_eq!(recorded_depth(7), 4);
        assert_eq!(recorded_depth(8), 8);
        assert_eq!(recorded_depth(usize::MAX), 1 << (usize::BITS - 1));
    }

    #[test]
    fn traffic_is_counted_per_prefix_and_decays() {
        let t = PrefixTraffic::default();
        let a: Vec<u64> = (1..=20).collect();
        let mut b = a.clone();
        b[4..].iter_mut().for_each(|h| *h += 1_000); // shares a's first 4 blocks
        t.record(&a, 300.0, 0);
        t.record(&a, 300.0, 0);
        t.record(&b, 100.0, 0);
        assert_eq!(t.recent(&a, 20, 0), 600.0); // depth 16: a's own
        assert_eq!(t.recent(&a, 4, 0), 700.0); // depth 4: shared with b
        assert_eq!(t.recent(&b, 9, 0), 100.0); // depth 8: b's own
        assert_eq!(t.recent(&a, 0, 0), 0.0);
        let later = crate::endpoints::sent_work::RECENT_HALF_LIFE_MS;
        assert!((t.recent(&a, 20, later) - 300.0).abs() < 1.0);
    }
}
