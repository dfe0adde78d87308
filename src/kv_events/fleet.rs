//! The fleet's block index: for every token block (our chain hash, see [`super::chain`]) that
//! some backend's store holds, *which* stores hold it, as one 64-bit mask per 64 store slots.
//!
//! Why one shared map instead of a set per store: a precise decision asks every candidate "how
//! many of this prompt's blocks do you hold, consecutively from the first?". With a set per
//! store that is one walk per candidate, O(blocks × candidates) probes (64 backends holding a
//! 2,048-block prompt: 64k probes, about a millisecond). With the masks, one walk over the
//! chain answers every store at once: a running mask starts as block 0's holders, each next
//! block's mask is ANDed in, and a store's count is the block at which its bit dropped out; the
//! walk ends when the running mask is empty. That is O(longest match) probes per 64 slots, and
//! the result of the walk is kept (per thread) for the other candidates of the same decision
//! ([`Fleet::matched`]), so the scorer keeps asking one store at a time.
//!
//! * **Readers never wait.** The map is an [`scc::HashIndex`] (lock-free reads, epoch-based
//!   reclamation); a mask is an `AtomicU64` updated in place.
//! * **Writers** (the subscriber tasks, off the request path) serialise per key on one of
//!   [`STRIPES`] mutexes, so setting a bit and removing an entry whose mask became 0 cannot
//!   race. A bit is set while the store holds the block under any vLLM hash or tier (the store
//!   counts references; see [`super::store`]).
//! * **Hashing.** Keys are chain hashes of token ids that clients and backends choose, so the
//!   map uses foldhash with a per-process random seed (a keyed hash: nobody outside can aim
//!   keys at one bucket) rather than passing the hash through.
//! * **Bounded** by the stores: a live entry exists only while some store holds the block, and
//!   each store is bounded by its capacity. An entry whose last holder lets go is kept empty
//!   rather than removed, because a block evicted is often stored again soon (the same prefix
//!   computed again) and scc removes lazily: a remove followed by an insert into the same
//!   bucket made the insert clean the bucket of removed entries, 12 % of ingest under constant
//!   eviction. Empty entries are swept (all stripes held, one `retain` pass) once they are more
//!   than [`SWEEP_MIN`] and outnumber the live ones, so at most about half the map is empty.
//!   A slot is taken by a store when it first holds a block and given back (its bits cleared)
//!   when the store is cleared for good or dropped.
//! * **Memo validity.** Every write batch bumps [`Fleet::version`] after it is done; a kept walk
//!   is reused only for the same chain (its length and last hash, which names the whole prefix)
//!   at the same version, so it is never staler than the decision that made it.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};

use scc::{Guard, HashIndex};

/// Writer lock stripes.
pub const STRIPES: usize = 64;

/// Empty entries kept before a sweep is considered (see the module doc).
pub const SWEEP_MIN: usize = 4_096;

type Key = (u64, u32);

/// See the module doc.
pub struct Fleet {
    masks: HashIndex<Key, AtomicU64, foldhash::fast::RandomState>,
    stripes: Vec<Mutex<()>>,
    /// Slot allocation: bit `s % 64` of word `s / 64` is set while slot `s` is taken.
    slots: Mutex<Vec<u64>>,
    /// Words of slots ever handed out (walks cover these).
    words: AtomicU64,
    version: AtomicU64,
    /// Entries whose mask is 0 (kept for a block stored again; see the module doc) and the
    /// others: counted here because scc's `len` is a pass over the whole map.
    empty: AtomicUsize,
    live: AtomicUsize,
    sweep_min: usize,
}

impl Default for Fleet {
    fn default() -> Self {
        Fleet {
            masks: HashIndex::with_hasher(foldhash::fast::RandomState::default()),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            slots: Mutex::new(Vec::new()),
            words: AtomicU64::new(0),
            version: AtomicU64::new(0),
            empty: AtomicUsize::new(0),
            live: AtomicUsize::new(0),
            sweep_min: SWEEP_MIN,
        }
    }
}

/// The process's fleet index (every store of every pool; slots are unique per process).
pub fn fleet() -> &'static Fleet {
    static FLEET: OnceLock<Fleet> = OnceLock::new();
    FLEET.get_or_init(Fleet::default)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn split(slot: u32) -> (u32, u64) {
    (slot / 64, 1u64 << (slot % 64))
}

/// One walk's answer, kept for the rest of the decision.
#[derive(Default)]
struct Memo {
    valid: bool,
    /// Which [`Fleet`] made it (tests have several).
    fleet: usize,
    version: u64,
    len: usize,
    last: u64,
    /// Per slot: blocks held consecutively from the first.
    counts: Vec<u32>,
}

thread_local! {
    static MEMO: RefCell<Memo> = RefCell::new(Memo::default());
}

impl Fleet {
    /// A free slot (the lowest).
    pub fn take_slot(&self) -> u32 {
        let mut slots = lock(&self.slots);
        let (w, bit) = match slots.iter().position(|w| *w != u64::MAX) {
            Some(w) => (w, slots[w].trailing_ones()),
            None => {
                slots.push(0);
                (slots.len() - 1, 0)
            }
        };
        slots[w] |= 1u64 << bit;
        self.words.fetch_max(slots.len() as u64, Ordering::Relaxed);
        (w as u32).saturating_mul(64).saturating_add(bit)
    }

    /// Give `slot` back; its bits must have been cleared.
    pub fn free_slot(&self, slot: u32) {
        let (w, bit) = split(slot);
        if let Some(word) = lock(&self.slots).get_mut(w as usize) {
            *word &= !bit;
        }
    }

    fn stripe(&self, hash: u64) -> MutexGuard<'_, ()> {
        lock(&self.stripes[(hash as usize) % STRIPES])
    }

    /// `slot` holds `hash`.
    pub fn set(&self, hash: u64, slot: u32) {
        let (w, bit) = split(slot);
        let _g = self.stripe(hash);
        let guard = Guard::new();
        match self.masks.peek(&(hash, w), &guard) {
            Some(mask) => {
                if mask.fetch_or(bit, Ordering::Release) == 0 {
                    // An empty entry comes back to life.
                    self.empty.fetch_sub(1, Ordering::Relaxed);
                    self.live.fetch_add(1, Ordering::Relaxed);
                }
            }
            None => {
                if self
                    .masks
                    .insert_sync((hash, w), AtomicU64::new(bit))
                    .is_ok()
                {
                    self.live.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// `slot` no longer holds `hash`.
    pub fn unset(&self, hash: u64, slot: u32) {
        let (w, bit) = split(slot);
        let _g = self.stripe(hash);
        let guard = Guard::new();
        let Some(mask) = self.masks.peek(&(hash, w), &guard) else {
            return;
        };
        let before = mask.fetch_and(!bit, Ordering::AcqRel);
        if before != bit {
            // Still held by another slot of this word, or `slot` did not hold it.
            return;
        }
        let empty = self.empty.fetch_add(1, Ordering::Relaxed) + 1;
        let live = self.live.fetch_sub(1, Ordering::Relaxed).saturating_sub(1);
        let sweep = empty > self.sweep_min && empty > live;
        drop(_g);
        if sweep {
            self.sweep();
        }
    }

    /// Remove the empty entries. Every stripe is held meanwhile, so no mask changes under the
    /// pass (a `set` between its test and the removal would otherwise be lost); readers go on.
    fn sweep(&self) {
        let _all: Vec<MutexGuard<'_, ()>> = self.stripes.iter().map(lock).collect();
        if self.empty.load(Ordering::Relaxed) <= self.sweep_min {
            return; // another writer swept first
        }
        self.masks
            .retain_sync(|_, mask| mask.load(Ordering::Acquire) != 0);
        self.empty.store(0, Ordering::Relaxed);
    }

    /// Whether `slot` holds `hash`. Never blocks.
    pub fn holds(&self, hash: u64, slot: u32, guard: &Guard) -> bool {
        let (w, bit) = split(slot);
        self.masks
            .peek(&(hash, w), guard)
            .is_some_and(|m| m.load(Ordering::Acquire) & bit != 0)
    }

    /// A write batch is complete: walks kept before it are stale.
    pub fn bump(&self) {
        self.version.fetch_add(1, Ordering::Release);
    }

    /// Live entries in the map (blocks × 64-slot words holding them).
    pub fn entries(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// How many of `chain`'s blocks `slot` holds, consecutively from the first. The first call
    /// for a chain walks it once for every slot; later calls for the same chain (the other
    /// candidates of the decision) read that walk while no write intervened. Never blocks.
    pub fn matched(&self, chain: &[u64], slot: u32) -> usize {
        let (Some(&last), Some(&first)) = (chain.last(), chain.first()) else {
            return 0;
        };
        let version = self.version.load(Ordering::Acquire);
        MEMO.with(|memo| {
            let Ok(mut memo) = memo.try_borrow_mut() else {
                return self.walk_one(chain, slot);
            };
            let me = std::ptr::from_ref(self) as usize;
            if !(memo.valid
                && memo.fleet == me
                && memo.version == version
                && memo.len == chain.len()
                && memo.last == last)
            {
                memo.valid = false;
                self.walk_all(chain, first, &mut memo.counts);
                memo.version = version;
                memo.fleet = me;
                memo.len = chain.len();
                memo.last = last;
                memo.valid = true;
            }
            memo.counts.get(slot as usize).map_or(0, |c| *c as usize)
        })
    }

    /// Every slot's consecutive match of `chain` into `counts` (indexed by slot).
    fn walk_all(&self, chain: &[u64], first: u64, counts: &mut Vec<u32>) {
        let words = self.words.load(Ordering::Relaxed) as usize;
        counts.clear();
        counts.resize(words.saturating_mul(64), 0);
        let guard = Guard::new();
        let mask_of = |h: u64, w: u32| {
            self.masks
                .peek(&(h, w), &guard)
                .map_or(0, |m| m.load(Ordering::Acquire))
        };
        let full = u32::try_from(chain.len()).unwrap_or(u32::MAX);
        for w in 0..words {
            let word = w as u32;
            let mut running = mask_of(first, word);
            let mut i = 1usize;
            while running != 0 && i < chain.len() {
                let next = running & mask_of(chain[i], word);
                let mut dropped = running & !next;
                while dropped != 0 {
                    let b = dropped.trailing_zeros();
                    counts[w * 64 + b as usize] = i as u32;
                    dropped &= dropped - 1;
                }
                running = next;
                i += 1;
            }
            while running != 0 {
                let b = running.trailing_zeros();
                counts[w * 64 + b as usize] = full;
                running &= running - 1;
            }
        }
    }

    fn walk_one(&self, chain: &[u64], slot: u32) -> usize {
        let guard = Guard::new();
        chain
            .iter()
            .take_while(|h| self.holds(**h, slot, &guard))
            .count()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn one_walk_answers_every_slot_consecutively_from_the_first() {
        let f = Fleet::default();
        let slots: Vec<u32> = (0..70).map(|_| f.take_slot()).collect();
        assert_eq!(slots, (0..70).collect::<Vec<_>>(), "lowest free first");
        let chain: Vec<u64> = (100..110).collect();
        // Slot s holds the first s % 11 blocks; slot 69 (second word) holds all but block 3.
        for &s in &slots[..69] {
            for h in &chain[..(s as usize % 11).min(10)] {
                f.set(*h, s);
            }
        }
        for (i, h) in chain.iter().enumerate() {
            if i != 3 {
                f.set(*h, 69);
            }
        }
        f.bump();
        for &s in &slots[..69] {
            assert_eq!(f.matched(&chain, s), (s as usize % 11).min(10), "slot {s}");
            assert_eq!(f.walk_one(&chain, s), (s as usize % 11).min(10));
        }
        assert_eq!(f.matched(&chain, 69), 3, "a hole ends the match");
        assert_eq!(f.matched(&chain[..2], 69), 2, "another chain: a new walk");
        assert_eq!(f.matched(&[], 5), 0);
        assert_eq!(f.matched(&chain, 500), 0, "a slot never handed out");
    }

    #[test]
    fn a_write_after_the_walk_is_seen_by_the_next_one() {
        let f = Fleet::default();
        let s = f.take_slot();
        let chain = [1u64, 2, 3];
        f.set(1, s);
        f.bump();
        assert_eq!(f.matched(&chain, s), 1);
        f.set(2, s);
        f.set(3, s);
        f.bump();
        assert_eq!(f.matched(&chain, s), 3);
        f.unset(2, s);
        f.bump();
        assert_eq!(f.matched(&chain, s), 1);
    }

    #[test]
    fn entries_go_when_the_last_holder_goes_and_slots_are_reused() {
        let f = Fleet::default();
        let (a, b) = (f.take_slot(), f.take_slot());
        f.set(7, a);
        f.set(7, b);
        assert_eq!(f.entries(), 1);
        f.unset(7, a);
        let guard = Guard::new();
        assert!(!f.holds(7, a, &guard) && f.holds(7, b, &guard));
        f.unset(7, b);
        assert_eq!(f.entries(), 0, "no live entry is left");
        assert!(!f.holds(7, b, &guard));
        f.unset(7, b);
        assert_eq!(f.entries(), 0, "unsetting again changes nothing");
        f.set(7, b);
        assert_eq!(f.entries(), 1, "the empty entry comes back");
        assert!(f.holds(7, b, &guard) && !f.holds(7, a, &guard));
        f.unset(7, b);
        f.free_slot(a);
        assert_eq!(f.take_slot(), a);
        assert_eq!(f.take_slot(), 2);
    }

    #[test]
    fn empty_entries_are_swept_once_they_outnumber_the_live_ones() {
        let f = Fleet {
            sweep_min: 16,
            ..Fleet::default()
        };
        let (a, b) = (f.take_slot(), f.take_slot());
        // 10 blocks held for good by b; 1,000 blocks stored and evicted by a, one at a time.
        for h in 0..10 {
            f.set(h, b);
        }
        let mut most = 0;
        for h in 100..1_100 {
            f.set(h, a);
            f.unset(h, a);
            most = most.max(f.masks.len());
        }
        assert_eq!(f.entries(), 10);
        assert!(
            most <= 2 * 17 + 10,
            "the map stayed bounded: at most {most} entries"
        );
        let guard = Guard::new();
        assert!(
            (0..10).all(|h| f.holds(h, b, &guard)),
            "live entries survive sweeps"
        );
        assert!((100..1_100).all(|h| !f.holds(h, a, &guard)));
        // A block that was swept is stored again like a new one.
        f.set(100, a);
        assert!(f.holds(100, a, &guard));
        assert_eq!(f.entries(), 11);
    }
}
