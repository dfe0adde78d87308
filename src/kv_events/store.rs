//! One backend's block store: which token blocks (by our chain hash, see [`super::chain`]) its
//! KV cache holds, as its event stream reported them, plus the stream's status.
//!
//! Two sides with different needs:
//! * the **reader** (the prefix scorer, on the request path) asks "how many of this prompt's
//!   blocks do you hold, consecutively from the first?". The held blocks are this store's bit
//!   in the shared [`super::fleet`] index (an [`scc::HashIndex`] of per-block masks: reads take
//!   no lock at all, so a flood of events on one backend cannot delay a decision), which
//!   answers every candidate of a decision with one walk of the prompt's chain. Measured in
//!   `benches/hot_path.rs` (`kv_ingest`, `precise_decision`).
//! * the **writer** (that backend's subscriber task, off the request path) keeps the map from
//!   vLLM's hash (per medium) to ours, a reference count per hash of ours (a block can sit in
//!   the GPU and the CPU tier at once) and the insertion order for the capacity bound, under a
//!   mutex only it takes. Both maps hash with foldhash and a per-process random seed: their
//!   keys are hashes, but chosen by the backend (vLLM's) or derived from client tokens (ours),
//!   so passing them through unhashed would let a hostile backend or client aim every key at
//!   one bucket; a keyed hash costs about a nanosecond and closes that.
//!
//! Bounds: at most `capacity` vLLM blocks are kept, `capacity` = the backend's `num_gpu_blocks`
//! (`vllm:cache_config_info`) per tier seen (GPU, CPU, other) plus 1/8 slack, or
//! [`DEFAULT_CAPACITY`] while the geometry is unknown; beyond it the oldest stored blocks are
//! dropped (a stream that misses removals cannot grow the map). Blocks "in flight" (sent to the
//! backend, not yet reported) live in a second lock-free map with a deadline, at most
//! [`MAX_PENDING`] of them, purged by the subscriber's tick.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

use scc::{Guard, HashIndex};

use super::chain::block_hash;
use super::fleet::fleet;
use super::wire::{Event, Medium, Stored, MAX_EXTRA};
use crate::clock::now_ms;

/// Blocks kept while the backend's `num_gpu_blocks` is unknown.
pub const DEFAULT_CAPACITY: usize = 1 << 20;
/// In-flight blocks kept per backend.
pub const MAX_PENDING: usize = 1 << 16;

type Set<V> = HashIndex<u64, V, foldhash::fast::RandomState>;
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// What routing may make of a backend's stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// No event stream configured: approximate index only.
    Off,
    /// Events flow in order: the store is the truth.
    Live,
    /// Events were lost (a gap no replay could fill, or a late join): approximate until the
    /// cache has turned over once.
    Unsure,
    /// Requests were sent that should have produced events, and none came within the quiet
    /// time: approximate until events flow again.
    Silent,
    /// The stream is configured but its socket could not be opened (publisher unreachable,
    /// address in use) or failed: approximate until the subscriber reopens it.
    Broken,
}

impl Status {
    pub fn name(self) -> &'static str {
        match self {
            Status::Off => "off",
            Status::Live => "live",
            Status::Unsure => "unsure",
            Status::Silent => "silent",
            Status::Broken => "broken",
        }
    }

    /// Every status, in declaration order (`status as usize` indexes it).
    pub const ALL: [Status; 5] = [
        Status::Off,
        Status::Live,
        Status::Unsure,
        Status::Silent,
        Status::Broken,
    ];
}

const OFF: u8 = 0;
const LIVE: u8 = 1;
const UNSURE: u8 = 2;

/// How a sequence number relates to the last one seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqCheck {
    /// The next one (or the first message, from a fresh engine: seq 0).
    InOrder,
    /// Messages `from..seq` were lost (a first message with seq > 0: joined late).
    Gap { from: u64 },
    /// Went backwards: the engine restarted; the store has to be cleared.
    Restart,
    /// Already seen (replay overlap): skip.
    Duplicate,
}

/// Counters shown in the admin view.
#[derive(Debug, Default)]
struct Stats {
    messages: AtomicU64,
    stored: AtomicU64,
    removed: AtomicU64,
    gaps: AtomicU64,
    restarts: AtomicU64,
    orphans: AtomicU64,
    errors: AtomicU64,
}

#[derive(Debug)]
struct Ingest {
    /// (vLLM hash, medium) → (our hash, insertion generation).
    by_vllm: Map<(u64, Medium), (u64, u64)>,
    /// Our hash → how many (vLLM hash, medium) entries name it.
    refs: Map<u64, u32>,
    /// Insertion order for the capacity bound; stale entries are skipped by generation.
    order: VecDeque<((u64, Medium), u64)>,
    generation: u64,
    gpu_blocks: Option<usize>,
    tiers: [bool; 3],
    last_seq: Option<u64>,
    /// Blocks stored since the store became unsure.
    since_unsure: usize,
    scratch: Vec<u8>,
}

impl Default for Ingest {
    fn default() -> Self {
        Ingest {
            by_vllm: Map::default(),
            refs: Map::default(),
            order: VecDeque::new(),
            generation: 0,
            gpu_blocks: None,
            tiers: [true, false, false],
            last_seq: None,
            since_unsure: 0,
            scratch: Vec::new(),
        }
    }
}

impl Ingest {
    fn capacity(&self) -> usize {
        match self.gpu_blocks {
            Some(n) => {
                let tiers = self.tiers.iter().filter(|t| **t).count().max(1);
                let n = n.max(1).saturating_mul(tiers);
                n.saturating_add(n / 8)
            }
            None => DEFAULT_CAPACITY,
        }
    }
}

/// One backend's store. Created with the backend (status `off`); its subscriber task turns it on.
#[derive(Default)]
pub struct BlockStore {
    /// This store's slot in the [`super::fleet`] index, taken when it first holds a block.
    slot: OnceLock<u32>,
    pending: Set<u64>,
    pending_len: AtomicUsize,
    held_len: AtomicUsize,
    status: AtomicU8,
    block_size: AtomicU32,
    /// `now_ms() + 1` of the first request sent since the last message that should produce
    /// events (0: none outstanding).
    expect_since: AtomicU64,
    last_message_ms: AtomicU64,
    /// `now_ms() + 1` when the events last reported a block evicted (0: never).
    last_removed_ms: AtomicU64,
    quiet_ms: AtomicU64,
    connected: AtomicBool,
    stats: Stats,
    ingest: Mutex<Ingest>,
    /// Where the stream comes from, for the admin view.
    endpoint: Mutex<Option<String>>,
}

impl std::fmt::Debug for BlockStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockStore")
            .field("status", &self.status(now_ms()))
            .field("blocks", &self.blocks())
            .finish()
    }
}

impl BlockStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, Ingest> {
        self.ingest.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The stream is configured from now on; silence beyond `quiet_ms` after a request counts.
    /// It is `broken` until [`BlockStore::set_connected`] says its socket is open.
    pub fn turn_on(&self, quiet_ms: u64, endpoint: String) {
        self.quiet_ms.store(quiet_ms.max(1), Ordering::Relaxed);
        *self.endpoint.lock().unwrap_or_else(PoisonError::into_inner) = Some(endpoint);
        let _ = self
            .status
            .compare_exchange(OFF, LIVE, Ordering::AcqRel, Ordering::Relaxed);
    }

    /// The subscriber opened its socket (`true`) or lost it (`false`).
    pub fn set_connected(&self, open: bool) {
        self.connected.store(open, Ordering::Release);
    }

    /// The subscriber stopped: back to approximate, nothing held.
    pub fn turn_off(&self) {
        self.status.store(OFF, Ordering::Release);
        self.connected.store(false, Ordering::Relaxed);
        self.clear();
    }

    /// Status at `now` (ms, [`crate::clock::now_ms`]).
    pub fn status(&self, now: u64) -> Status {
        let base = match self.status.load(Ordering::Acquire) {
            OFF => return Status::Off,
            _ if !self.connected.load(Ordering::Acquire) => return Status::Broken,
            UNSURE => Status::Unsure,
            _ => Status::Live,
        };
        let since = self.expect_since.load(Ordering::Acquire);
        if since != 0
            && now.saturating_add(1).saturating_sub(since) > self.quiet_ms.load(Ordering::Relaxed)
        {
            return Status::Silent;
        }
        base
    }

    /// The block size the events report (0 until the first `BlockStored`).
    pub fn block_size(&self) -> usize {
        self.block_size.load(Ordering::Relaxed) as usize
    }

    /// Did the events report a block evicted within `window_ms` before `now`?
    pub fn evicted_within(&self, now: u64, window_ms: u64) -> bool {
        let last = self.last_removed_ms.load(Ordering::Relaxed);
        last != 0 && now.saturating_add(1).saturating_sub(last) <= window_ms
    }

    /// Blocks held (distinct hashes of ours).
    pub fn blocks(&self) -> usize {
        self.held_len.load(Ordering::Relaxed)
    }

    /// How many of `chain`'s blocks, consecutive from the first, the backend holds or was
    /// sent within the in-flight time. Never blocks. The held part comes from the fleet
    /// index's walk (shared with the decision's other candidates); in-flight blocks extend it.
    pub fn matched(&self, chain: &[u64], now: u64) -> usize {
        let slot = self.slot.get().copied();
        let held = slot.map_or(0, |s| fleet().matched(chain, s));
        if self.pending_len.load(Ordering::Relaxed) == 0 {
            return held;
        }
        let guard = Guard::new();
        let rest = chain.get(held..).unwrap_or_default();
        held + rest
            .iter()
            .take_while(|h| {
                slot.is_some_and(|s| fleet().holds(**h, s, &guard))
                    || self
                        .pending
                        .peek(*h, &guard)
                        .is_some_and(|deadline| *deadline > now)
            })
            .count()
    }

    fn slot(&self) -> u32 {
        *self.slot.get_or_init(|| fleet().take_slot())
    }

    /// `chain` was sent to the backend, which held its first `held` blocks: the rest count as
    /// held until `now + ttl_ms`, and an event is expected (for the silence check).
    pub fn note_sent(&self, chain: &[u64], held: usize, now: u64, ttl_ms: u64) {
        let rest = chain.get(held..).unwrap_or_default();
        if rest.is_empty() || self.status.load(Ordering::Relaxed) == OFF {
            return;
        }
        let _ = self.expect_since.compare_exchange(
            0,
            now.saturating_add(1),
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
        let deadline = now.saturating_add(ttl_ms);
        for h in rest {
            if self.pending_len.load(Ordering::Relaxed) >= MAX_PENDING {
                break;
            }
            match self.pending.entry_sync(*h) {
                scc::hash_index::Entry::Occupied(mut o) => o.update(deadline),
                scc::hash_index::Entry::Vacant(v) => {
                    v.insert_entry(deadline);
                    self.pending_len.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Drop expired in-flight blocks (the subscriber's tick).
    pub fn purge_pending(&self, now: u64) {
        if self.pending_len.load(Ordering::Relaxed) == 0 {
            return;
        }
        self.pending.retain_sync(|_, deadline| *deadline > now);
        self.pending_len
            .store(self.pending.len(), Ordering::Relaxed);
    }

    /// The backend's `num_gpu_blocks`, when known (bounds the store).
    pub fn set_gpu_blocks(&self, blocks: Option<u64>) {
        let mut ingest = self.lock();
        if let Some(n) = blocks {
            ingest.gpu_blocks = Some(usize::try_from(n).unwrap_or(usize::MAX));
            self.evict_over_capacity(&mut ingest);
        }
    }

    /// Where message `seq` stands relative to the last one applied.
    pub fn check_seq(&self, seq: u64) -> SeqCheck {
        let ingest = self.lock();
        match ingest.last_seq {
            None if seq == 0 => SeqCheck::InOrder,
            None => SeqCheck::Gap { from: 0 },
            Some(last) if seq == last.wrapping_add(1) => SeqCheck::InOrder,
            Some(last) if seq > last => SeqCheck::Gap {
                from: last.saturating_add(1),
            },
            Some(last) if seq == last => SeqCheck::Duplicate,
            Some(_) => SeqCheck::Restart,
        }
    }

    /// Events were lost and cannot be replayed: approximate until the cache turned over.
    pub fn mark_unsure(&self) {
        self.lock().since_unsure = 0;
        self.status.store(UNSURE, Ordering::Release);
    }

    /// The engine restarted (its sequence went backwards): it holds nothing we knew about.
    pub fn restarted(&self) {
        self.stats.restarts.fetch_add(1, Ordering::Relaxed);
        self.clear();
        self.lock().last_seq = None;
        let _ = self
            .status
            .compare_exchange(UNSURE, LIVE, Ordering::AcqRel, Ordering::Relaxed);
    }

    /// Forget every block (restart, `AllBlocksCleared`, turned off).
    pub fn clear(&self) {
        let mut ingest = self.lock();
        ingest.by_vllm.clear();
        if let Some(&slot) = self.slot.get() {
            let f = fleet();
            for ours in ingest.refs.keys() {
                f.unset(*ours, slot);
            }
            f.bump();
        }
        ingest.refs.clear();
        ingest.order.clear();
        self.pending.clear_sync();
        self.pending_len.store(0, Ordering::Relaxed);
        self.held_len.store(0, Ordering::Relaxed);
    }

    /// Count a gap in the sequence (replayed or not).
    pub fn note_gap(&self) {
        self.stats.gaps.fetch_add(1, Ordering::Relaxed);
    }

    /// Count a message that could not be decoded.
    pub fn note_error(&self) {
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Apply one message's events, recording `seq` as the last applied.
    pub fn apply(&self, seq: u64, events: &[Event], now: u64) {
        let mut ingest = self.lock();
        ingest.last_seq = Some(seq);
        for event in events {
            match event {
                Event::Stored(s) => self.stored(&mut ingest, s),
                Event::Removed {
                    block_hashes,
                    medium,
                } => {
                    for h in block_hashes {
                        self.remove(&mut ingest, (*h, *medium));
                    }
                    self.stats
                        .removed
                        .fetch_add(block_hashes.len() as u64, Ordering::Relaxed);
                    if !block_hashes.is_empty() {
                        self.last_removed_ms
                            .store(now.saturating_add(1), Ordering::Relaxed);
                    }
                }
                Event::AllCleared => {
                    drop(ingest);
                    self.clear();
                    ingest = self.lock();
                }
                Event::Unknown => {}
            }
        }
        self.evict_over_capacity(&mut ingest);
        if self.status.load(Ordering::Relaxed) == UNSURE
            && ingest.since_unsure
                >= ingest
                    .capacity()
                    .min(ingest.gpu_blocks.unwrap_or(usize::MAX))
        {
            // Every block the cache had when events were lost has been replaced since.
            self.status.store(LIVE, Ordering::Release);
        }
        self.held_len.store(ingest.refs.len(), Ordering::Relaxed);
        drop(ingest);
        fleet().bump();
        self.stats.messages.fetch_add(1, Ordering::Relaxed);
        self.last_message_ms.store(now, Ordering::Relaxed);
        self.expect_since.store(0, Ordering::Release);
    }

    fn stored(&self, ingest: &mut Ingest, s: &Stored) {
        let bs = s.block_size as usize;
        if bs == 0 {
            return;
        }
        self.block_size.store(s.block_size, Ordering::Relaxed);
        ingest.tiers[s.medium.index()] = true;
        let mut prev = match s.parent {
            None => None,
            Some(parent) => {
                let known = [Medium::Gpu, Medium::Cpu, Medium::Other]
                    .iter()
                    .find_map(|m| ingest.by_vllm.get(&(parent, *m)).map(|(ours, _)| *ours));
                match known {
                    Some(ours) => Some(ours),
                    None => {
                        // The parent's event was before our time: these blocks cannot be named.
                        self.stats
                            .orphans
                            .fetch_add(s.block_hashes.len() as u64, Ordering::Relaxed);
                        return;
                    }
                }
            }
        };
        let lora = s.lora_name.as_deref();
        let slot = self.slot();
        let mut stored = 0u64;
        let mut scratch = std::mem::take(&mut ingest.scratch);
        for (i, (vllm, tokens)) in s
            .block_hashes
            .iter()
            .zip(s.token_ids.chunks_exact(bs))
            .enumerate()
        {
            // The block's extra keys other than the adapter name (the decoder keeps at most
            // MAX_EXTRA), borrowed: no allocation per block.
            let mut keys = [""; MAX_EXTRA];
            let mut n = 0;
            for k in s.extra_keys.get(i).into_iter().flatten() {
                if Some(k.as_str()) != lora && n < MAX_EXTRA {
                    keys[n] = k.as_str();
                    n += 1;
                }
            }
            let ours = block_hash(prev, lora, &keys[..n], tokens, &mut scratch);
            prev = Some(ours);
            let key = (*vllm, s.medium);
            ingest.generation = ingest.generation.wrapping_add(1);
            let generation = ingest.generation;
            if let Some((old, _)) = ingest.by_vllm.insert(key, (ours, generation)) {
                self.unref(ingest, old);
            }
            let count = ingest.refs.entry(ours).or_insert(0);
            *count = count.saturating_add(1);
            if *count == 1 {
                fleet().set(ours, slot);
            }
            ingest.order.push_back((key, generation));
            stored += 1;
        }
        ingest.scratch = scratch;
        ingest.since_unsure = ingest.since_unsure.saturating_add(stored as usize);
        self.stats.stored.fetch_add(stored, Ordering::Relaxed);
    }

    fn unref(&self, ingest: &mut Ingest, ours: u64) {
        if let Some(count) = ingest.refs.get_mut(&ours) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                ingest.refs.remove(&ours);
                if let Some(&slot) = self.slot.get() {
                    fleet().unset(ours, slot);
                }
            }
        }
    }

    fn remove(&self, ingest: &mut Ingest, key: (u64, Medium)) {
        if let Some((ours, _)) = ingest.by_vllm.remove(&key) {
            self.unref(ingest, ours);
        }
    }

    fn evict_over_capacity(&self, ingest: &mut Ingest) {
        let cap = ingest.capacity();
        while ingest.by_vllm.len() > cap {
            let Some((key, generation)) = ingest.order.pop_front() else {
                break;
            };
            if ingest
                .by_vllm
                .get(&key)
                .is_some_and(|(_, g)| *g == generation)
            {
                self.remove(ingest, key);
            }
        }
        // Entries removed by events leave stale order entries: compact now and then.
        if ingest.order.len() > cap.saturating_mul(2).saturating_add(1024) {
            let Ingest { order, by_vllm, .. } = ingest;
            order.retain(|(key, g)| by_vllm.get(key).is_some_and(|(_, cur)| cur == g));
        }
    }

    /// The admin view's `kv_events` object.
    pub fn admin_json(&self, now: u64) -> serde_json::Value {
        let status = self.status(now);
        if status == Status::Off {
            return serde_json::json!({ "status": "off" });
        }
        let (capacity, last_seq) = {
            let ingest = self.lock();
            (ingest.capacity(), ingest.last_seq)
        };
        let last = self.last_message_ms.load(Ordering::Relaxed);
        let s = &self.stats;
        serde_json::json!({
            "status": status.name(),
            "endpoint": *self.endpoint.lock().unwrap_or_else(PoisonError::into_inner),
            "block_size": self.block_size(),
            "blocks": self.blocks(),
            "capacity": capacity,
            "in_flight_blocks": self.pending_len.load(Ordering::Relaxed),
            "last_seq": last_seq,
            "last_message_ms_ago": (s.messages.load(Ordering::Relaxed) > 0).then(|| now.saturating_sub(last)),
            "messages": s.messages.load(Ordering::Relaxed),
            "blocks_stored": s.stored.load(Ordering::Relaxed),
            "blocks_removed": s.removed.load(Ordering::Relaxed),
            "gaps": s.gaps.load(Ordering::Relaxed),
            "restarts": s.restarts.load(Ordering::Relaxed),
            "orphan_blocks": s.orphans.load(Ordering::Relaxed),
            "decode_errors": s.errors.load(Ordering::Relaxed),
        })
    }
}

impl Drop for BlockStore {
    /// Clear this store's bits from the fleet index and give its slot back.
    fn drop(&mut self) {
        self.clear();
        if let Some(&slot) = self.slot.get() {
            fleet().free_slot(slot);
        }
    }
}

#[cfg(test)]
mod tests;
