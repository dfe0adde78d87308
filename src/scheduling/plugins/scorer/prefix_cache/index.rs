//! The prefix index: which backends were sent which prompt blocks, bounded per backend.
//!
//! Two structures work together:
//! * a sharded map `(block hash, word) → bitmask` answers "which backends hold this block" with
//!   one probe per block and 32-backend word, so matching a prompt costs O(blocks), not
//!   O(blocks × backends);
//! * one [`Lru`] per backend bounds what each backend is believed to hold; when it evicts a
//!   block, the recorder clears that backend's bit in the map in the same step.
//!
//! The per-backend LRU is a compact intrusive list rather than a general cache: recording a
//! 32k-character prompt touches 500 blocks, and a general concurrent cache (moka was measured
//! here) spent ~1 µs per touch; the compact list spends a few tens of nanoseconds and ~32 bytes.
//!
//! Block hashes are chained (each mixes the previous one, the first is seeded with the model),
//! so a hash names a whole prefix, and "block i matches" implies "blocks 0..i match" for a
//! backend that received that exact prefix; recording keeps each backend's set prefix-closed,
//! so matching bisects instead of walking every block.
//!
//! Each backend also keeps a small **ghost** of the blocks its LRU evicted lately (a
//! direct-mapped table of the LRU's size within [`GHOST_MIN`]..[`GHOST_MAX`] hashes, the
//! newest eviction replacing whatever shares its slot: an evicted block is remembered for
//! about as many evictions as the table has slots). [`PrefixIndex::returned`] asks it
//! whether a prompt's next block after what a backend holds is one that backend evicted: a
//! prefix that comes back after its cache dropped it, the sign of a cache that cannot hold
//! its working set (as the ghost lists of adaptive replacement caches measure it).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError, RwLock};

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::lru::{Lru, Touch};

const SHARDS: usize = 64;

/// Backends per bitmask word.
const WORD: usize = 32;
type Mask = u32;

/// Block hashes are already uniformly distributed: hashing them again would only cost time.
#[derive(Default)]
pub struct PassThroughHasher(u64);

impl Hasher for PassThroughHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 ^= n;
    }
    fn write_u32(&mut self, n: u32) {
        // Spread a 32-bit key over the whole word: the map takes its bucket from the low
        // bits and its tag from the high ones.
        self.0 ^= u64::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// Keyed by 32 bits of the block hash mixed with the 32-backend word number; the value is that
/// word's bitmask of backends holding the block. A shard is picked by 6 other bits, so 38 bits
/// of the hash tell blocks apart: at a million blocks, about one probe in 250,000 meets another
/// block's entry, and an entry costs 8 bytes instead of 16. Such a false "held" answer is never
/// a crash, but its effect depends on where it lands: matching bisects (see
/// [`PrefixIndex::match_lengths`]), so a false positive at a bisection probe makes the search
/// believe every block up to the probe is held — a match overstated by up to half the
/// prompt's blocks, for that one decision. With ~log₂(n) probes per decision that is about one
/// decision in 25,000 at a million blocks; the cost is one less-than-ideal placement, which
/// the next decision (with no collision) corrects.
type Shard = RwLock<HashMap<u32, Mask, BuildHasherDefault<PassThroughHasher>>>;

/// The map key of block `hash` for backend word `w` (word 0: the hash's low 32 bits).
fn key(hash: u64, w: u16) -> u32 {
    (hash ^ u64::from(w).wrapping_mul(0x9E37_79B9_7F4A_7C15)) as u32
}

/// Chain-hash `text` in blocks of `block` bytes, at most `max_blocks`, into `out`.
/// Only full blocks are hashed: a trailing partial block cannot be a shared prefix yet.
pub fn block_hashes(
    model: Option<&str>,
    text: &str,
    block: usize,
    max_blocks: usize,
    out: &mut Vec<u64>,
) {
    out.clear();
    let mut prev = xxh3_64(model.unwrap_or("").as_bytes());
    for chunk in text.as_bytes().chunks_exact(block).take(max_blocks) {
        prev = xxh3_64_with_seed(chunk, prev);
        out.push(prev);
    }
}

/// Most evicted hashes remembered per backend: 32 KiB of ghost beside an LRU that, at the
/// fallback capacity, takes about 750 KiB…
pub const GHOST_MAX: usize = 4_096;
/// …and least, so that a small cache's ghost outlives one long prompt's evictions.
pub const GHOST_MIN: usize = 1_024;

struct BackendLru {
    epoch: u64,
    /// Entries in `lru`, mirrored after each record so scoring reads it without the mutex.
    len: AtomicUsize,
    capacity: usize,
    lru: Mutex<Lru>,
    /// Hashes evicted lately, at `hash mod len` (a power of two); 0 is an empty slot. Written
    /// under the `lru` mutex, read without it.
    ghost: Box<[AtomicU64]>,
}

impl BackendLru {
    fn new(epoch: u64, capacity: usize) -> Self {
        let lru = Lru::new(capacity);
        let slots = lru
            .capacity()
            .clamp(GHOST_MIN, GHOST_MAX)
            .next_power_of_two();
        BackendLru {
            epoch,
            len: AtomicUsize::new(0),
            capacity: lru.capacity(),
            lru: Mutex::new(lru),
            ghost: (0..slots).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn slot(&self, hash: u64) -> &AtomicU64 {
        // The length is a power of two; the low bits are as uniform as any.
        &self.ghost[(hash as usize) & (self.ghost.len() - 1)]
    }

    fn evicted(&self, hash: u64) {
        self.slot(hash).store(hash, Ordering::Relaxed);
    }

    fn was_evicted(&self, hash: u64) -> bool {
        hash != 0 && self.slot(hash).load(Ordering::Relaxed) == hash
    }
}

/// Shared by all requests of one prefix scorer.
pub struct PrefixIndex {
    shards: Box<[Shard]>,
    lrus: RwLock<Vec<Option<BackendLru>>>,
}

fn shard_of(hash: u64) -> usize {
    // The low bits pick the bucket inside a shard's map; use high bits for the shard.
    (hash >> 58) as usize % SHARDS
}

fn word_bit(backend: usize) -> (u16, Mask) {
    ((backend / WORD) as u16, 1 << (backend % WORD))
}

impl Default for PrefixIndex {
    fn default() -> Self {
        PrefixIndex::new()
    }
}

impl PrefixIndex {
    pub fn new() -> Self {
        PrefixIndex {
            shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
            lrus: RwLock::new(Vec::new()),
        }
    }

    /// The epoch the index holds for `backend`, if it holds anything.
    pub fn epoch(&self, backend: usize) -> Option<u64> {
        let lrus = self.lrus.read().unwrap_or_else(PoisonError::into_inner);
        lrus.get(backend).and_then(|l| l.as_ref()).map(|l| l.epoch)
    }

    /// For each `(backend, epoch)` candidate, how full its LRU is (entries ÷ capacity, 0 for a
    /// backend the index holds nothing of at that epoch).
    pub fn fill(&self, candidates: &[(usize, u64)], out: &mut [f64]) {
        let lrus = self.lrus.read().unwrap_or_else(PoisonError::into_inner);
        for (slot, (backend, epoch)) in out.iter_mut().zip(candidates) {
            *slot = match lrus.get(*backend).and_then(|l| l.as_ref()) {
                Some(l) if l.epoch == *epoch => {
                    l.len.load(Ordering::Relaxed) as f64 / l.capacity.max(1) as f64
                }
                _ => 0.0,
            };
        }
    }

    /// For each `(backend, epoch)` candidate, how many leading blocks of `hashes` it holds.
    /// Candidates whose epoch differs from the index's get 0 (their cache was wiped).
    ///
    /// What one backend holds is prefix-closed: [`record`](Self::record) touches a prompt's
    /// blocks last to first, so every block is at least as recent as anything chained after it
    /// and the LRU never evicts a block before its descendants. Whether a backend holds block
    /// `i` is therefore monotone in `i`, and every candidate's depth is found by bisection —
    /// all candidates of one 32-backend word at once, splitting them by the bitmask at each
    /// probe — in O(log n) probes per distinct depth instead of one probe per block.
    pub fn match_lengths(&self, hashes: &[u64], candidates: &[(usize, u64)], out: &mut [usize]) {
        out.iter_mut().for_each(|m| *m = 0);
        if hashes.is_empty() || candidates.is_empty() {
            return;
        }
        // alive[w] = candidates (by bit) in word w whose records are current.
        let words = candidates.iter().map(|(b, _)| b / WORD).max().unwrap_or(0) + 1;
        let mut alive: Vec<Mask> = vec![0; words];
        {
            let lrus = self.lrus.read().unwrap_or_else(PoisonError::into_inner);
            for (backend, epoch) in candidates {
                let current = lrus.get(*backend).and_then(|l| l.as_ref()).map(|l| l.epoch);
                if current == Some(*epoch) {
                    let (w, bit) = word_bit(*backend);
                    alive[w as usize] |= bit;
                }
            }
        }
        let mut depths = vec![0usize; words * WORD];
        for (w, set) in alive.iter().enumerate() {
            if *set == 0 {
                continue;
            }
            let w = w as u16;
            let head = self.holders(hashes[0], w) & set;
            if head != 0 {
                self.bisect(hashes, w, 1, hashes.len(), head, &mut depths);
            }
        }
        for (slot, (backend, _)) in out.iter_mut().zip(candidates) {
            *slot = depths[*backend];
        }
    }

    /// The backends of word `w` holding block `hash`.
    fn holders(&self, hash: u64, w: u16) -> Mask {
        let shard = self.shards[shard_of(hash)]
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        shard.get(&key(hash, w)).copied().unwrap_or(0)
    }

    /// Every backend in `set` (word `w`) holds at least `lo` and at most `hi` leading blocks:
    /// write each one's exact count into `depths`.
    fn bisect(
        &self,
        hashes: &[u64],
        w: u16,
        lo: usize,
        hi: usize,
        set: Mask,
        depths: &mut [usize],
    ) {
        if lo == hi {
            let mut m = set;
            while m != 0 {
                depths[usize::from(w) * WORD + m.trailing_zeros() as usize] = lo;
                m &= m - 1;
            }
            return;
        }
        // Probe block mid−1: its holders have at least mid blocks, the others fewer.
        let mid = lo + (hi - lo).div_ceil(2);
        let deeper = self.holders(hashes[mid - 1], w) & set;
        if deeper != 0 {
            self.bisect(hashes, w, mid, hi, deeper, depths);
        }
        if set & !deeper != 0 {
            self.bisect(hashes, w, lo, mid - 1, set & !deeper, depths);
        }
    }

    /// For each `(backend, epoch)` candidate holding `matched` leading blocks of `hashes`: is
    /// the next block one its LRU evicted lately (the prompt's prefix came back to a cache that
    /// had dropped it)? False where the candidate holds the whole prompt or the index holds
    /// nothing of it at that epoch.
    pub fn returned(
        &self,
        hashes: &[u64],
        candidates: &[(usize, u64)],
        matched: &[usize],
        out: &mut [bool],
    ) {
        let lrus = self.lrus.read().unwrap_or_else(PoisonError::into_inner);
        for ((slot, (backend, epoch)), m) in out.iter_mut().zip(candidates).zip(matched) {
            *slot = match (lrus.get(*backend).and_then(|l| l.as_ref()), hashes.get(*m)) {
                (Some(l), Some(next)) if l.epoch == *epoch => l.was_evicted(*next),
                _ => false,
            };
        }
    }

    /// The capacity (blocks) of `backend`'s LRU at `epoch`, if the index holds one.
    pub fn capacity(&self, backend: usize, epoch: u64) -> Option<u64> {
        let lrus = self.lrus.read().unwrap_or_else(PoisonError::into_inner);
        lrus.get(backend)
            .and_then(|l| l.as_ref())
            .filter(|l| l.epoch == epoch)
            .map(|l| l.capacity as u64)
    }

    /// Remember that `backend` (at `epoch`) was sent `hashes`. `capacity` bounds its LRU in
    /// blocks; a new epoch starts the backend afresh, a new capacity keeps the most recent
    /// blocks that fit.
    ///
    /// Blocks are touched last to first, so a prompt's head ends up the most recent and its
    /// tail is evicted first — as an engine frees a finished request's blocks — and a prefix
    /// shared by many prompts outlives their individual endings.
    pub fn record(&self, backend: usize, epoch: u64, capacity: u64, hashes: &[u64]) {
        let capacity = usize::try_from(capacity).unwrap_or(usize::MAX);
        self.ensure(backend, epoch, capacity);
        let lrus = self.lrus.read().unwrap_or_else(PoisonError::into_inner);
        let Some(Some(entry)) = lrus.get(backend) else {
            return;
        };
        let mut lru = entry.lru.lock().unwrap_or_else(PoisonError::into_inner);
        let (w, bit) = word_bit(backend);
        for hash in hashes.iter().rev() {
            match lru.touch(*hash) {
                Touch::Refreshed => {}
                Touch::Inserted => self.set_bit(*hash, w, bit),
                Touch::Replaced(old) => {
                    self.clear_bit(old, w, bit);
                    self.set_bit(*hash, w, bit);
                    entry.evicted(old);
                }
            }
        }
        entry.len.store(lru.len(), Ordering::Relaxed);
    }

    fn set_bit(&self, hash: u64, w: u16, bit: Mask) {
        let mut shard = self.shards[shard_of(hash)]
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        *shard.entry(key(hash, w)).or_insert(0) |= bit;
    }

    fn clear_bit(&self, hash: u64, w: u16, bit: Mask) {
        let mut shard = self.shards[shard_of(hash)]
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(mask) = shard.get_mut(&key(hash, w)) {
            *mask &= !bit;
            if *mask == 0 {
                shard.remove(&key(hash, w));
            }
        }
    }

    /// Make sure `backend` has an LRU for `epoch` with `capacity`, purging an outdated one.
    fn ensure(&self, backend: usize, epoch: u64, capacity: usize) {
        let current = |lrus: &Vec<Option<BackendLru>>| {
            lrus.get(backend)
                .and_then(|l| l.as_ref())
                .is_some_and(|l| l.epoch == epoch && l.capacity == capacity.clamp(1, Lru::MAX))
        };
        if current(&self.lrus.read().unwrap_or_else(PoisonError::into_inner)) {
            return;
        }
        let mut lrus = self.lrus.write().unwrap_or_else(PoisonError::into_inner);
        if current(&lrus) {
            return;
        }
        if lrus.len() <= backend {
            lrus.resize_with(backend + 1, || None);
        }
        if let Some(old) = lrus[backend].as_mut().filter(|l| l.epoch == epoch) {
            // Same cache, new size: evict down to the new bound (or make room), keep the rest.
            let mut lru = old.lru.lock().unwrap_or_else(PoisonError::into_inner);
            let (resized, evicted) = lru.resized(capacity);
            let (w, bit) = word_bit(backend);
            for hash in evicted {
                self.clear_bit(hash, w, bit);
                old.evicted(hash);
            }
            *lru = resized;
            old.capacity = lru.capacity();
            old.len.store(lru.len(), Ordering::Relaxed);
            return;
        }
        if let Some(old) = lrus[backend].take() {
            self.clear_backend(backend, &old);
        }
        lrus[backend] = Some(BackendLru::new(epoch, capacity));
    }

    /// Forget everything about `backend` (it left the pool or its cache was wiped).
    pub fn purge(&self, backend: usize) {
        let mut lrus = self.lrus.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(old) = lrus.get_mut(backend).and_then(Option::take) {
            self.clear_backend(backend, &old);
        }
    }

    /// Clear `backend`'s bit for every block its (now removed) LRU held. Called with the LRU
    /// table's write lock held, so no recorder can set bits for the backend meanwhile.
    fn clear_backend(&self, backend: usize, old: &BackendLru) {
        let (w, bit) = word_bit(backend);
        let lru = old.lru.lock().unwrap_or_else(PoisonError::into_inner);
        for hash in lru.iter() {
            self.clear_bit(hash, w, bit);
        }
    }

    /// Blocks held over all backends (as counted by their LRUs).
    pub fn blocks(&self) -> u64 {
        let lrus = self.lrus.read().unwrap_or_else(PoisonError::into_inner);
        lrus.iter()
            .flatten()
            .map(|l| l.len.load(Ordering::Relaxed) as u64)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn hashes(text: &str) -> Vec<u64> {
        let mut out = Vec::new();
        block_hashes(Some("m"), text, 4, usize::MAX, &mut out);
        out
    }

    #[test]
    fn chained_hashes_share_prefixes_only() {
        let a = hashes("aaaabbbbcccc");
        let b = hashes("aaaabbbbdddd");
        let c = hashes("xxxxbbbbcccc");
        assert_eq!(a.len(), 3);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        assert_ne!(
            a[1], c[1],
            "same block after a different prefix must differ"
        );
        assert_eq!(hashes("aaaab").len(), 1, "partial block is not hashed");
        let mut other_model = Vec::new();
        block_hashes(Some("n"), "aaaa", 4, 10, &mut other_model);
        assert_ne!(other_model[0], a[0], "the model seeds the chain");
        block_hashes(None, "aaaabbbbcccc", 4, 2, &mut other_model);
        assert_eq!(other_model.len(), 2, "max_blocks bounds the work");
    }

    #[test]
    fn matches_leading_blocks_per_backend() {
        let idx = PrefixIndex::new();
        let a = hashes("aaaabbbbccccdddd");
        idx.record(0, 0, 100, &a[..2]);
        idx.record(1, 0, 100, &a);
        idx.record(70, 0, 100, &a[..3]);
        let cands = [(0, 0), (1, 0), (2, 0), (70, 0)];
        let mut out = [9; 4];
        idx.match_lengths(&a, &cands, &mut out);
        assert_eq!(out, [2, 4, 0, 3]);
        let other = hashes("zzzzbbbb");
        idx.match_lengths(&other, &cands, &mut out);
        assert_eq!(out, [0, 0, 0, 0]);
    }

    /// Under heavy eviction the bisection must agree with walking block by block.
    #[test]
    fn bisection_agrees_with_a_walk_under_eviction() {
        let mut rng = fastrand::Rng::with_seed(7);
        // Prompts of 1–12 blocks from a 3-letter alphabet share many heads.
        let prompts: Vec<Vec<u64>> = (0..300)
            .map(|_| {
                let len = rng.usize(1..=12);
                let text: String = (0..len)
                    .map(|_| ["aaaa", "bbbb", "cccc"][rng.usize(..3)])
                    .collect();
                hashes(&text)
            })
            .collect();
        let backends = [0usize, 1, 2, 3, 64, 65, 130];
        let idx = PrefixIndex::new();
        let cands: Vec<(usize, u64)> = backends.iter().map(|b| (*b, 0)).collect();
        let mut out = vec![0; cands.len()];
        for round in 0..2_000 {
            let p = &prompts[rng.usize(..prompts.len())];
            let b = backends[rng.usize(..backends.len())];
            idx.record(b, 0, 16, p);
            if round % 10 == 0 {
                for q in &prompts {
                    idx.match_lengths(q, &cands, &mut out);
                    for (i, (b, _)) in cands.iter().enumerate() {
                        let (w, bit) = word_bit(*b);
                        let walked = q
                            .iter()
                            .take_while(|h| idx.holders(**h, w) & bit != 0)
                            .count();
                        assert_eq!(out[i], walked, "backend {b}, round {round}");
                    }
                }
            }
        }
    }

    #[test]
    fn epoch_change_forgets_backend() {
        let idx = PrefixIndex::new();
        let a = hashes("aaaabbbb");
        idx.record(0, 0, 100, &a);
        let mut out = [0; 1];
        idx.match_lengths(&a, &[(0, 1)], &mut out);
        assert_eq!(
            out,
            [0],
            "a candidate at a new epoch does not match old records"
        );
        idx.record(0, 1, 100, &a[..1]);
        idx.match_lengths(&a, &[(0, 1)], &mut out);
        assert_eq!(out, [1]);
        assert_eq!(idx.epoch(0), Some(1));
    }

    #[test]
    fn purge_clears_one_backend_only() {
        let idx = PrefixIndex::new();
        let a = hashes("aaaabbbb");
        idx.record(0, 0, 100, &a);
        idx.record(1, 0, 100, &a);
        idx.purge(0);
        let mut out = [0; 2];
        idx.match_lengths(&a, &[(0, 0), (1, 0)], &mut out);
        assert_eq!(out, [0, 2]);
    }

    #[test]
    fn backends_sharing_a_bit_position_in_different_words_stay_apart() {
        let idx = PrefixIndex::new();
        let a = hashes("aaaabbbb");
        idx.record(3, 0, 100, &a);
        idx.record(67, 0, 100, &a);
        idx.record(131, 0, 100, &a[..1]);
        let mut out = [0; 3];
        idx.match_lengths(&a, &[(3, 0), (67, 0), (131, 0)], &mut out);
        assert_eq!(out, [2, 2, 1]);
        idx.purge(3);
        idx.match_lengths(&a, &[(3, 0), (67, 0), (131, 0)], &mut out);
        assert_eq!(out, [0, 2, 1]);
        // A new epoch for 67 wipes only 67.
        idx.record(67, 1, 100, &a[..1]);
        idx.match_lengths(&a, &[(3, 0), (67, 1), (131, 0)], &mut out);
        assert_eq!(out, [0, 1, 1]);
    }

    #[test]
    fn lru_bound_evicts_oldest_and_clears_bits() {
        let idx = PrefixIndex::new();
        let first = hashes("aaaabbbb");
        let second = hashes("ccccdddd");
        idx.record(0, 0, 2, &first);
        idx.record(0, 0, 2, &second);
        assert_eq!(idx.blocks(), 2);
        let mut out = [0; 1];
        idx.match_lengths(&second, &[(0, 0)], &mut out);
        assert_eq!(out, [2]);
        idx.match_lengths(&first, &[(0, 0)], &mut out);
        assert_eq!(out, [0], "evicted blocks no longer match");
    }

    /// The ghost names the block a prompt lacks when its backend evicted it, and only then:
    /// not for a backend that never held it, not at another epoch, not past the prompt's end.
    #[test]
    fn ghost_names_blocks_the_backend_evicted() {
        let idx = PrefixIndex::new();
        let first = hashes("aaaabbbb");
        let second = hashes("ccccdddd");
        idx.record(0, 0, 2, &first);
        idx.record(1, 0, 2, &first);
        idx.record(0, 0, 2, &second);
        let mut matched = [0; 2];
        idx.match_lengths(&first, &[(0, 0), (1, 0)], &mut matched);
        assert_eq!(matched, [0, 2]);
        let mut out = [false; 2];
        idx.returned(&first, &[(0, 0), (1, 0)], &matched, &mut out);
        assert_eq!(
            out,
            [true, false],
            "backend 0 evicted the head; 1 holds it all"
        );
        idx.returned(&first, &[(0, 1), (1, 0)], &[0, 0], &mut out);
        assert_eq!(
            out,
            [false, false],
            "another epoch, and a block 1 never lost"
        );
        idx.returned(&second, &[(0, 0), (1, 0)], &[0, 0], &mut out);
        assert_eq!(out, [false, false], "held or never sent: nothing evicted");
        // Touched again, the block is held: the prompt now matches past it.
        idx.record(0, 0, 2, &first);
        idx.match_lengths(&second, &[(0, 0)], &mut matched[..1]);
        idx.returned(&second, &[(0, 0)], &matched[..1], &mut out[..1]);
        assert!(out[0], "the second prompt's blocks went in their turn");
    }

    /// A new reported cache size shrinks the backend's records to the most recent blocks that
    /// fit (it used to wipe them all) and a larger one keeps everything.
    #[test]
    fn capacity_change_evicts_down_instead_of_wiping() {
        let idx = PrefixIndex::new();
        let old = hashes("aaaabbbb");
        let new = hashes("ccccdddd");
        idx.record(0, 0, 4, &old);
        idx.record(0, 0, 4, &new);
        assert_eq!(idx.blocks(), 4);
        idx.record(0, 0, 8, &new);
        assert_eq!(idx.blocks(), 4, "growing keeps every block");
        assert_eq!(idx.capacity(0, 0), Some(8));
        let mut out = [0; 1];
        idx.match_lengths(&old, &[(0, 0)], &mut out);
        assert_eq!(out, [2]);
        idx.record(0, 0, 2, &new);
        assert_eq!(idx.blocks(), 2, "shrinking evicts down to the bound");
        idx.match_lengths(&new, &[(0, 0)], &mut out);
        assert_eq!(out, [2], "the most recent prompt survives");
        idx.match_lengths(&old, &[(0, 0)], &mut out);
        assert_eq!(out, [0], "the evicted ones no longer match");
    }
}
