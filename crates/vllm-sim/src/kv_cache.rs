//! KV cache: the GPU block pool with automatic prefix caching, modelled on vLLM's v1 manager.
//!
//! The cache holds `num_gpu_blocks` blocks of `block_size` tokens. Each block has a reference
//! count (how many running sequences use it) and, once it is *full*, a hash that names its
//! contents: `hash(block i) = xxh3(tokens of block i, seed = hash(block i-1))`, so a hash stands
//! for the whole prefix up to and including that block. Partial blocks are never hashed, so
//! they are never shared or reused.
//!
//! Blocks whose reference count is zero sit in a *free queue* in eviction order (least recently
//! freed first). A free block keeps its hash and contents until it is handed out again, so a
//! later request can still reuse it: that is the prefix cache. Allocation pops from the front of
//! the queue and evicts the popped block's hash. When a sequence ends, its blocks go to the back
//! of the queue in reverse order, so the tail of a prompt is evicted before its head (the head
//! is the part most likely to be shared).
//!
//! `kv_cache_usage_perc` counts blocks with a non-zero reference count only: a pool full of
//! cached-but-free blocks reports low usage, exactly as vLLM does.
//!
//! With KV-cache events enabled ([`BlockPool::enable_events`]) the pool also records what it
//! did, in order, for the engine to publish after each step: an eviction is a `BlockRemoved`,
//! a reset an `AllBlocksCleared`; the scheduler adds the `BlockStored` of each sequence's newly
//! cached blocks ([`BlockPool::record`]), since only it knows their tokens.

use std::collections::HashMap;

use crate::kv_events::KvEvent;

/// Index of a block in the pool.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Block {
    ref_cnt: u32,
    hash: Option<u64>,
    prev: u32,
    next: u32,
}

/// The block pool of one engine.
#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    /// Front of the free queue: the next block to hand out (and evict).
    head: u32,
    tail: u32,
    num_free: usize,
    cached: HashMap<u64, BlockId>,
    evictions: u64,
    /// Events since the last `take_events` (None: events disabled, nothing recorded).
    events: Option<Vec<KvEvent>>,
}

impl BlockPool {
    /// A pool of `num_blocks` empty blocks, all free.
    pub fn new(num_blocks: usize) -> Self {
        let n = num_blocks as u32;
        let blocks = (0..n)
            .map(|i| Block {
                ref_cnt: 0,
                hash: None,
                prev: if i == 0 { NIL } else { i - 1 },
                next: if i + 1 == n { NIL } else { i + 1 },
            })
            .collect();
        Self {
            blocks,
            head: if n == 0 { NIL } else { 0 },
            tail: if n == 0 { NIL } else { n - 1 },
            num_free: num_blocks,
            cached: HashMap::with_capacity(num_blocks),
            evictions: 0,
            events: None,
        }
    }

    /// Start recording KV-cache events.
    pub fn enable_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    pub fn events_enabled(&self) -> bool {
        self.events.is_some()
    }

    /// Appends an event (when events are enabled).
    pub fn record(&mut self, event: KvEvent) {
        if let Some(ev) = &mut self.events {
            ev.push(event);
        }
    }

    /// The events recorded since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// vLLM's `reset_prefix_cache`: forgets every cached block, only when no block is held
    /// (returns false and changes nothing otherwise); records `AllBlocksCleared`.
    pub fn reset(&mut self) -> bool {
        if self.num_used() > 0 {
            return false;
        }
        self.wipe();
        self.record(KvEvent::AllBlocksCleared);
        true
    }

    /// Forgets every cached block's contents, held or not, and drops unpublished events (an
    /// engine restart: nothing of the old cache survives, not even its news).
    pub fn wipe(&mut self) {
        for b in &mut self.blocks {
            b.hash = None;
        }
        self.cached.clear();
        if let Some(ev) = &mut self.events {
            ev.clear();
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks with reference count zero (empty or cached): what allocation can use.
    pub fn num_free(&self) -> usize {
        self.num_free
    }

    /// Blocks held by at least one sequence.
    pub fn num_used(&self) -> usize {
        self.blocks.len() - self.num_free
    }

    /// Full blocks whose contents are known by hash (in use or free).
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// Cached blocks evicted so far to make room.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Fraction of blocks held by sequences, 0–1 (`vllm:kv_cache_usage_perc`).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        self.num_used() as f64 / self.blocks.len() as f64
    }

    /// How many leading `hashes` are cached: the longest reusable prefix, in blocks.
    pub fn match_prefix(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// Whether `hashes` (all cached) can be taken and `new_blocks` allocated on top. Taking a
    /// cached block that is free removes it from the free queue, so it counts against space.
    pub fn can_allocate(&self, hashes: &[u64], new_blocks: usize) -> bool {
        let revived = hashes
            .iter()
            .filter_map(|h| self.cached.get(h))
            .filter(|&&id| self.blocks[id as usize].ref_cnt == 0)
            .count();
        revived + new_blocks <= self.num_free
    }

    /// Takes a reference on the cached blocks named by `hashes` (call `match_prefix` first; a
    /// hash that is not cached stops the walk) and appends them to `out`.
    pub fn acquire_cached(&mut self, hashes: &[u64], out: &mut Vec<BlockId>) {
        for h in hashes {
            let Some(&id) = self.cached.get(h) else {
                return;
            };
            if self.blocks[id as usize].ref_cnt == 0 {
                self.unlink(id);
            }
            self.blocks[id as usize].ref_cnt += 1;
            out.push(id);
        }
    }

    /// Allocates `n` fresh blocks (evicting cached contents from the front of the free queue)
    /// and appends them to `out`; returns false and changes nothing if fewer than `n` are free.
    pub fn allocate(&mut self, n: usize, out: &mut Vec<BlockId>) -> bool {
        if n > self.num_free {
            return false;
        }
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            let block = &mut self.blocks[id as usize];
            if let Some(h) = block.hash.take() {
                self.cached.remove(&h);
                self.evictions += 1;
                if let Some(ev) = &mut self.events {
                    ev.push(KvEvent::BlockRemoved { block_hash: h });
                }
            }
            block.ref_cnt = 1;
            out.push(id);
        }
        true
    }

    /// Records that block `id` is now full with contents named `hash`. If another block
    /// already holds the same contents (two requests computed the same prefix at once), this
    /// one stays anonymous and is simply discarded when freed, as in vLLM.
    pub fn commit_full(&mut self, id: BlockId, hash: u64) {
        if self.blocks[id as usize].hash.is_some() {
            return;
        }
        if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(hash) {
            e.insert(id);
            self.blocks[id as usize].hash = Some(hash);
        }
    }

    /// Drops one reference on each block, last block first, so that when they become free the
    /// tail of a sequence is evicted before its head.
    pub fn free(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            let block = &mut self.blocks[id as usize];
            debug_assert!(block.ref_cnt > 0, "double free of block {id}");
            block.ref_cnt = block.ref_cnt.saturating_sub(1);
            if block.ref_cnt == 0 {
                self.push_back(id);
            }
        }
    }

    fn unlink(&mut self, id: BlockId) {
        let (prev, next) = {
            let b = &self.blocks[id as usize];
            (b.prev, b.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[id as usize];
        b.prev = NIL;
        b.next = NIL;
        self.num_free -= 1;
    }

    fn push_back(&mut self, id: BlockId) {
        let old_tail = self.tail;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = old_tail;
            b.next = NIL;
        }
        if old_tail == NIL {
            self.head = id;
        } else {
            self.blocks[old_tail as usize].next = id;
        }
        self.tail = id;
        self.num_free += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Allocates blocks for a "sequence" and commits `hashes` to its first blocks.
    fn fill(pool: &mut BlockPool, n: usize, hashes: &[u64]) -> Vec<BlockId> {
        let mut ids = Vec::new();
        assert!(pool.allocate(n, &mut ids));
        for (id, h) in ids.iter().zip(hashes) {
            pool.commit_full(*id, *h);
        }
        ids
    }

    #[test]
    fn events_record_evictions_and_resets() {
        let mut pool = BlockPool::new(2);
        let a = fill(&mut pool, 2, &[1, 2]);
        assert!(pool.take_events().is_empty(), "disabled: nothing recorded");
        pool.free(&a);
        pool.enable_events();
        assert!(pool.reset(), "nothing held: the reset succeeds");
        let b = fill(&mut pool, 2, &[3, 4]);
        assert!(!pool.reset(), "blocks are held: the reset fails");
        pool.free(&b);
        let mut out = Vec::new();
        assert!(pool.allocate(1, &mut out));
        // b freed tail first: block with hash 4 is evicted first.
        assert_eq!(
            pool.take_events(),
            [
                KvEvent::AllBlocksCleared,
                KvEvent::BlockRemoved { block_hash: 4 }
            ]
        );
        pool.free(&out);
        assert!(pool.reset());
        assert_eq!(pool.num_cached(), 0);
        assert_eq!(pool.take_events(), [KvEvent::AllBlocksCleared]);
        let c = fill(&mut pool, 1, &[5]);
        pool.record(KvEvent::AllBlocksCleared);
        pool.wipe();
        assert!(
            pool.take_events().is_empty(),
            "a wipe drops unpublished events"
        );
        assert_eq!(pool.match_prefix(&[5]), 0);
        pool.free(&c);
        assert_eq!(pool.num_free(), 2);
    }

    #[test]
    fn miss_then_hit_after_free() {
        let mut pool = BlockPool::new(8);
        assert_eq!(pool.match_prefix(&[1, 2, 3]), 0);
        let ids = fill(&mut pool, 3, &[1, 2, 3]);
        assert_eq!(pool.num_used(), 3);
        pool.free(&ids);
        assert_eq!(pool.num_used(), 0);
        assert_eq!(
            pool.usage(),
            0.0,
            "cached-but-free blocks do not count as usage"
        );
        assert_eq!(pool.match_prefix(&[1, 2, 3, 4]), 3);
        assert_eq!(
            pool.match_prefix(&[9, 2, 3]),
            0,
            "a prefix must match from the start"
        );
        let mut again = Vec::new();
        pool.acquire_cached(&[1, 2, 3], &mut again);
        assert_eq!(again, ids);
        assert_eq!(pool.num_used(), 3);
    }

    #[test]
    fn uncommitted_partial_block_is_not_cached() {
        let mut pool = BlockPool::new(4);
        // Two full blocks committed, the third (partial) never is.
        let ids = fill(&mut pool, 3, &[10, 20]);
        pool.free(&ids);
        assert_eq!(pool.num_cached(), 2);
        assert_eq!(pool.match_prefix(&[10, 20, 30]), 2);
    }

    #[test]
    fn reference_counting_shares_blocks() {
        let mut pool = BlockPool::new(4);
        let a = fill(&mut pool, 2, &[1, 2]);
        let mut b = Vec::new();
        assert!(pool.can_allocate(&[1, 2], 2));
        pool.acquire_cached(&[1, 2], &mut b);
        assert_eq!(a, b);
        assert_eq!(pool.num_used(), 2, "shared blocks are held once");
        pool.free(&a);
        assert_eq!(pool.num_used(), 2, "still referenced by b");
        pool.free(&b);
        assert_eq!(pool.num_used(), 0);
        assert_eq!(pool.num_free(), 4);
    }

    #[test]
    fn eviction_is_lru_and_tail_first() {
        let mut pool = BlockPool::new(4);
        let a = fill(&mut pool, 2, &[1, 2]); // sequence A: blocks 1,2
        let b = fill(&mut pool, 2, &[3, 4]); // sequence B: blocks 3,4
        pool.free(&a); // A freed first: queue = [2, 1]
        pool.free(&b); // then B: queue = [2, 1, 4, 3]
        let mut out = Vec::new();
        assert!(pool.allocate(1, &mut out));
        assert_eq!(pool.match_prefix(&[1]), 1, "A's head survives its tail");
        assert_eq!(
            pool.match_prefix(&[1, 2]),
            1,
            "A's tail (hash 2) was evicted first"
        );
        assert!(pool.allocate(1, &mut out));
        assert_eq!(pool.match_prefix(&[1]), 0, "then A's head");
        assert_eq!(pool.match_prefix(&[3, 4]), 2, "B, freed later, is intact");
        assert_eq!(pool.evictions(), 2);
        // Touching a cached block makes it most recently used: revive B's head, free it again.
        let mut c = Vec::new();
        pool.acquire_cached(&[3], &mut c);
        pool.free(&c); // queue = [4, 3]
        assert!(pool.allocate(1, &mut out));
        assert_eq!(pool.match_prefix(&[3]), 1);
        assert_eq!(
            pool.match_prefix(&[3, 4]),
            1,
            "4 was older than the revived 3"
        );
    }

    #[test]
    fn allocation_fails_cleanly_when_full() {
        let mut pool = BlockPool::new(3);
        let held = fill(&mut pool, 2, &[1, 2]);
        let mut out = Vec::new();
        assert!(!pool.allocate(2, &mut out));
        assert!(out.is_empty());
        assert!(pool.allocate(1, &mut out));
        assert_eq!(pool.num_free(), 0);
        assert!(!pool.can_allocate(&[], 1));
        pool.free(&held);
        // Cached free blocks are evictable space, but reviving them uses that space too.
        assert!(pool.can_allocate(&[1, 2], 0));
        assert!(!pool.can_allocate(&[1, 2], 1));
        assert!(pool.can_allocate(&[], 2));
    }

    #[test]
    fn preemption_frees_blocks_but_keeps_them_cached() {
        let mut pool = BlockPool::new(4);
        let victim = fill(&mut pool, 3, &[7, 8]);
        assert_eq!(pool.num_free(), 1);
        pool.free(&victim); // what preemption does
        assert_eq!(pool.num_free(), 4);
        assert_eq!(
            pool.match_prefix(&[7, 8]),
            2,
            "recompute can hit its own blocks"
        );
    }

    #[test]
    fn duplicate_contents_stay_anonymous() {
        let mut pool = BlockPool::new(4);
        let a = fill(&mut pool, 1, &[5]);
        let b = fill(&mut pool, 1, &[5]);
        assert_eq!(pool.num_cached(), 1);
        pool.free(&b);
        pool.free(&a);
        let mut out = Vec::new();
        pool.acquire_cached(&[5], &mut out);
        assert_eq!(out, a);
    }
}
