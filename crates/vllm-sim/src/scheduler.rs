//! Scheduler: continuous batching over the block pool, one step at a time (no clock here).
//!
//! Each step, like vLLM v1's scheduler with chunked prefill:
//!
//! 1. **Running sequences first**, in admission order. Each asks for its remaining prompt
//!    (chunked to the step's token budget, `--max-num-batched-tokens`) or, when decoding, one
//!    token. If the blocks for those tokens cannot be allocated, the most recently admitted
//!    running sequence is **preempted** (recompute mode: its blocks are freed — full ones stay
//!    cached — it goes back to the *front* of the waiting queue, `vllm:num_preemptions` rises)
//!    until the allocation fits or the sequence preempted itself.
//! 2. **Then the waiting queue**, FIFO, unless something was preempted this step: while there
//!    is budget and fewer than `--max-num-seqs` run, the head of the queue looks up its longest
//!    cached prefix (full blocks, at most all but the last token: one token must be computed to
//!    produce logits), and is admitted only if the blocks for that prefix and its first chunk
//!    fit. If not, admission stops (head-of-line blocking, as vLLM's FCFS policy). A request
//!    for a LoRA adapter that would make more than `--max-loras` distinct adapters run is
//!    skipped (it keeps its place; later requests may pass it), as vLLM does.
//!
//! After the step's simulated time has passed, [`Scheduler::apply`] advances every scheduled
//! sequence: computed tokens grow, newly full blocks are hashed and registered in the prefix
//! cache (with KV-cache events on, one `BlockStored` per sequence reports them), and a sequence whose tokens are all computed samples its next token (deterministic
//! filler). A sequence that reaches its `max_tokens` finishes and its blocks are freed.
//!
//! Prefix-cache accounting matches vLLM's counters: at a request's first admission,
//! `queries += tokens of the sequence` and `hits += cached tokens reused`. A re-admission after
//! preemption looks the cache up again (and mostly hits its own blocks) but is not counted:
//! vLLM 0.32 records it in `PrefixCacheStats.preempted_*`, which no Prometheus series exports
//! (`vllm/v1/core/kv_cache_manager.py` `record_prefix_cache_stats`, `preempted=
//! request.num_preemptions > 0`; `vllm/v1/metrics/stats.py` `PrefixCacheStats.record`;
//! `vllm/v1/metrics/loggers.py` increments `vllm:prefix_cache_{queries,hits}` from `queries`
//! and `hits` only). The tokens cached at the first admission are the request's
//! `cached_tokens`, as vLLM sets `num_cached_tokens` once.

use std::collections::VecDeque;

use tokio::sync::mpsc;
use tokio::time::Instant;
use xxhash_rust::xxh3::Xxh3;

use crate::cost::StepWork;
use crate::kv_cache::{BlockId, BlockPool};
use crate::kv_events::KvEvent;
use crate::tokenizer::filler_id;

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// Reached `max_tokens` (the simulator never samples an end-of-sequence token).
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
        }
    }
}

/// One generated token, sent to the request's HTTP handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenEvent {
    /// 0-based index of the token in the output.
    pub index: u32,
    /// Set on the last token.
    pub finish: Option<FinishReason>,
    /// Prompt tokens served from the prefix cache at (the latest) admission.
    pub cached_tokens: u32,
}

/// Per-request timestamps (wall clock; converted to simulated seconds for metrics).
#[derive(Debug, Clone, Copy)]
pub struct SeqTimes {
    pub arrival: Instant,
    pub scheduled: Option<Instant>,
    pub first_token: Option<Instant>,
    pub last_token: Option<Instant>,
}

/// A request inside the engine.
#[derive(Debug)]
pub struct Seq {
    pub id: u64,
    /// Prompt tokens followed by the tokens generated so far.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub max_tokens: u32,
    pub generated: u32,
    /// Tokens whose KV is in the cache.
    pub num_computed: usize,
    /// Tokens to compute in the current step (0 = not scheduled).
    pub scheduled: usize,
    pub blocks: Vec<BlockId>,
    /// Chain hashes of the full blocks of `tokens`, computed once each.
    hashes: Vec<u64>,
    hash_seed: u64,
    pub lora: Option<u16>,
    /// The request's `cache_salt` (already mixed into `hash_seed`), for the KV events.
    pub cache_salt: Option<String>,
    pub events: mpsc::UnboundedSender<TokenEvent>,
    pub times: SeqTimes,
    pub preemptions: u32,
    pub cached_at_admission: usize,
    /// P/D decode leg: prompt tokens whose KV was pulled from a prefill server, taken at the
    /// first admission for what the local prefix cache does not cover (then 0: one transfer
    /// per request, as vLLM clears `do_remote_prefill` after the first scheduling).
    pub external: usize,
    /// Of `cached_at_admission`, the tokens that came from the pull.
    pub external_at_admission: usize,
    /// P/D prefill leg: when the request finishes, its blocks stay held (the engine keeps
    /// them for a pull or until the lease ends) instead of being freed.
    pub hold: bool,
    /// The client went away (its channel is closed): drop at the end of the step.
    pub gone: bool,
}

impl Seq {
    pub fn new(
        id: u64,
        tokens: Vec<u32>,
        max_tokens: u32,
        hash_seed: u64,
        lora: Option<u16>,
        events: mpsc::UnboundedSender<TokenEvent>,
        arrival: Instant,
    ) -> Self {
        let prompt_len = tokens.len();
        Self {
            id,
            tokens,
            prompt_len,
            max_tokens,
            generated: 0,
            num_computed: 0,
            scheduled: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            hash_seed,
            lora,
            cache_salt: None,
            events,
            times: SeqTimes {
                arrival,
                scheduled: None,
                first_token: None,
                last_token: None,
            },
            preemptions: 0,
            cached_at_admission: 0,
            external: 0,
            external_at_admission: 0,
            hold: false,
            gone: false,
        }
    }

    /// Hashes every full block of `tokens` not hashed yet: `h_i = xxh3(block i, seed h_{i-1})`.
    fn ensure_hashes(&mut self, block_size: usize) {
        let full = self.tokens.len() / block_size;
        while self.hashes.len() < full {
            let b = self.hashes.len();
            let parent = self.hashes.last().copied().unwrap_or(self.hash_seed);
            let mut h = Xxh3::with_seed(parent);
            for t in &self.tokens[b * block_size..(b + 1) * block_size] {
                h.update(&t.to_le_bytes());
            }
            self.hashes.push(h.digest());
        }
    }
}

/// Limits of the scheduler.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub block_size: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// Distinct LoRA adapters that may run at once.
    pub max_loras: usize,
}

/// What happened in `schedule` that metrics care about.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleOutcome {
    pub work: StepWork,
    pub tokens: usize,
    pub preempted: u32,
    pub admitted: u32,
    /// Counted at first admission only (vLLM's `vllm:prefix_cache_*`).
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    /// Re-admissions after preemption (vLLM's `preempted_*`, not exported).
    pub preempted_prefix_queries: u64,
    pub preempted_prefix_hits: u64,
    /// Pulled (P/D) requests at first admission: vLLM's connector prefix-cache stats, queries
    /// = tokens beyond the local hit, hits = tokens taken from the pull.
    pub external_queries: u64,
    pub external_hits: u64,
    /// LoRA adapters loaded into a slot this step (not resident before).
    pub lora_loads: u32,
}

/// A sequence that left the engine at the end of a step.
#[derive(Debug)]
pub struct Finished {
    pub seq: Seq,
    /// None: the client disconnected (abort).
    pub reason: Option<FinishReason>,
}

/// Waiting queue, running batch and block pool of one engine.
#[derive(Debug)]
pub struct Scheduler {
    pub limits: Limits,
    pub pool: BlockPool,
    pub running: Vec<Seq>,
    pub waiting: VecDeque<Seq>,
    /// Adapters holding a LoRA slot, least recently admitted first (at most `max_loras`): an
    /// adapter admitted while not among them is a load, evicting the first when full.
    pub resident_loras: Vec<u16>,
}

impl Scheduler {
    pub fn new(limits: Limits, num_blocks: usize) -> Self {
        Self {
            limits,
            pool: BlockPool::new(num_blocks),
            running: Vec::new(),
            waiting: VecDeque::new(),
            resident_loras: Vec::new(),
        }
    }

    /// Adapter `l` is admitted: a load unless it holds a slot already (then it becomes the
    /// most recently used).
    fn touch_lora(&mut self, l: u16, out: &mut ScheduleOutcome) {
        if let Some(pos) = self.resident_loras.iter().position(|r| *r == l) {
            self.resident_loras.remove(pos);
        } else {
            out.lora_loads += 1;
            if self.resident_loras.len() >= self.limits.max_loras.max(1) {
                self.resident_loras.remove(0);
            }
        }
        self.resident_loras.push(l);
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.limits.block_size)
    }

    /// Plans one step (see module doc); `now` stamps first admissions.
    pub fn schedule(&mut self, now: Instant) -> ScheduleOutcome {
        let mut out = ScheduleOutcome::default();
        let mut budget = self.limits.max_num_batched_tokens;
        let mut i = 0;
        while i < self.running.len() {
            self.running[i].scheduled = 0;
            if budget == 0 {
                i += 1;
                continue;
            }
            let seq = &self.running[i];
            let n = (seq.tokens.len() - seq.num_computed).min(budget);
            let needed = self
                .blocks_for(seq.num_computed + n)
                .saturating_sub(seq.blocks.len());
            loop {
                if self.pool.allocate(needed, &mut self.running[i].blocks) {
                    self.running[i].scheduled = n;
                    budget -= n;
                    i += 1;
                    break;
                }
                // Preempt the most recently admitted sequence (possibly this one).
                let Some(victim) = self.running.pop() else {
                    break;
                };
                self.preempt(victim);
                out.preempted += 1;
                if i >= self.running.len() {
                    break;
                }
            }
        }
        if out.preempted == 0 {
            self.admit(now, &mut budget, &mut out);
        }
        for seq in self.running.iter().filter(|s| s.scheduled > 0) {
            let decode = seq.scheduled == 1 && seq.generated > 0;
            if !decode {
                out.work.prefill_tokens += seq.scheduled as u32;
            }
            out.work.sequences += 1;
            out.work.context_tokens += seq.num_computed as u64;
            out.tokens += seq.scheduled;
        }
        out
    }

    /// Preempts every running sequence, newest first, so they run again in their order (vLLM's
    /// `reset_prefix_cache(reset_running_requests=True)`); returns how many.
    pub fn preempt_all(&mut self) -> u32 {
        let mut n = 0;
        while let Some(seq) = self.running.pop() {
            self.preempt(seq);
            n += 1;
        }
        n
    }

    fn preempt(&mut self, mut seq: Seq) {
        self.pool.free(&seq.blocks);
        seq.blocks.clear();
        seq.num_computed = 0;
        seq.scheduled = 0;
        seq.preemptions += 1;
        self.waiting.push_front(seq);
    }

    fn admit(&mut self, now: Instant, budget: &mut usize, out: &mut ScheduleOutcome) {
        let bs = self.limits.block_size;
        let mut loras: Vec<u16> = self.running.iter().filter_map(|s| s.lora).collect();
        loras.sort_unstable();
        loras.dedup();
        let mut skipped = VecDeque::new();
        while *budget > 0 && self.running.len() < self.limits.max_num_seqs {
            let Some(seq) = self.waiting.front_mut() else {
                break;
            };
            if let Some(l) = seq.lora {
                if !loras.contains(&l) && loras.len() >= self.limits.max_loras {
                    skipped.extend(self.waiting.pop_front());
                    continue;
                }
            }
            seq.ensure_hashes(bs);
            let max_hit = (seq.tokens.len() - 1) / bs;
            let hit = self
                .pool
                .match_prefix(&seq.hashes[..max_hit.min(seq.hashes.len())]);
            let cached = hit * bs;
            // Pulled KV covers what the local cache does not, up to all but the last token
            // (which is computed for its logits, as for a local hit).
            let external = if seq.preemptions == 0 {
                seq.external
                    .min(seq.tokens.len() - 1)
                    .saturating_sub(cached)
            } else {
                0
            };
            let n = (seq.tokens.len() - cached - external).min(*budget);
            let new_blocks = (cached + external + n).div_ceil(bs) - hit;
            if !self.pool.can_allocate(&seq.hashes[..hit], new_blocks) {
                break;
            }
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            self.pool
                .acquire_cached(&seq.hashes[..hit], &mut seq.blocks);
            let ok = self.pool.allocate(new_blocks, &mut seq.blocks);
            debug_assert!(ok, "can_allocate said yes");
            seq.num_computed = cached + external;
            seq.scheduled = n;
            if external > 0 {
                self.commit_pulled(&mut seq, hit);
            }
            seq.times.scheduled.get_or_insert(now);
            *budget -= n;
            out.admitted += 1;
            if seq.preemptions == 0 {
                seq.cached_at_admission = cached + external;
                seq.external_at_admission = external;
                out.prefix_queries += seq.tokens.len() as u64;
                out.prefix_hits += cached as u64;
                if seq.external > 0 {
                    out.external_queries += (seq.tokens.len() - cached) as u64;
                    out.external_hits += external as u64;
                }
                seq.external = 0;
            } else {
                out.preempted_prefix_queries += seq.tokens.len() as u64;
                out.preempted_prefix_hits += cached as u64;
            }
            if let Some(l) = seq.lora {
                if !loras.contains(&l) {
                    loras.push(l);
                }
                self.touch_lora(l, out);
            }
            self.running.push(seq);
        }
        // Skipped requests keep their places at the head of the queue.
        while let Some(seq) = skipped.pop_back() {
            self.waiting.push_front(seq);
        }
    }

    /// The full blocks a pull filled (from block `from` on) enter the prefix cache at once, as
    /// vLLM caches loaded blocks; with KV-cache events on, one `BlockStored` reports them.
    fn commit_pulled(&mut self, seq: &mut Seq, from: usize) {
        let bs = self.limits.block_size;
        let to = seq.num_computed / bs;
        if to <= from {
            return;
        }
        for b in from..to {
            self.pool.commit_full(seq.blocks[b], seq.hashes[b]);
        }
        if self.pool.events_enabled() {
            self.pool.record(KvEvent::BlockStored {
                block_hashes: seq.hashes[from..to].to_vec(),
                parent_block_hash: from.checked_sub(1).map(|p| seq.hashes[p]),
                token_ids: seq.tokens[from * bs..to * bs].to_vec(),
                lora: seq.lora,
                cache_salt: seq.cache_salt.clone().filter(|_| from == 0),
            });
        }
    }

    /// Advances the scheduled sequences after the step (see module doc) and returns those that
    /// left: finished ones and ones whose client is gone. `now` is the step's end.
    pub fn apply(&mut self, now: Instant, mut on_token: impl FnMut(&Seq)) -> Vec<Finished> {
        let bs = self.limits.block_size;
        let mut done = Vec::new();
        for seq in self.running.iter_mut() {
            if seq.scheduled == 0 {
                continue;
            }
            let before = seq.num_computed / bs;
            seq.num_computed += seq.scheduled;
            seq.scheduled = 0;
            let after = seq.num_computed / bs;
            if after > before {
                seq.ensure_hashes(bs);
                for b in before..after {
                    self.pool.commit_full(seq.blocks[b], seq.hashes[b]);
                }
                if self.pool.events_enabled() {
                    // One event per sequence and step, like vLLM's `cache_full_blocks`; a block
                    // whose contents another block already caches is reported too (its hash
                    // names the same contents).
                    self.pool.record(KvEvent::BlockStored {
                        block_hashes: seq.hashes[before..after].to_vec(),
                        parent_block_hash: before.checked_sub(1).map(|p| seq.hashes[p]),
                        token_ids: seq.tokens[before * bs..after * bs].to_vec(),
                        lora: seq.lora,
                        cache_salt: seq.cache_salt.clone().filter(|_| before == 0),
                    });
                }
            }
            if seq.num_computed < seq.tokens.len() {
                continue; // mid-prefill chunk: nothing sampled yet
            }
            let index = seq.generated;
            seq.tokens.push(filler_id(index));
            seq.generated += 1;
            seq.times.first_token.get_or_insert(now);
            on_token(seq);
            seq.times.last_token = Some(now);
            let finish = (seq.generated >= seq.max_tokens).then_some(FinishReason::Length);
            let event = TokenEvent {
                index,
                finish,
                cached_tokens: seq.cached_at_admission as u32,
            };
            if seq.events.send(event).is_err() {
                seq.gone = true;
            } else if finish.is_some() {
                done.push(seq.id);
            }
        }
        let mut left = Vec::new();
        let mut k = 0;
        while k < self.running.len() {
            let s = &self.running[k];
            if s.gone || done.contains(&s.id) {
                let seq = self.running.remove(k);
                if seq.gone || !seq.hold {
                    // A held prefill's blocks go to the engine with it (see `Seq::hold`).
                    self.pool.free(&seq.blocks);
                }
                let reason = if seq.gone {
                    None
                } else {
                    Some(FinishReason::Length)
                };
                left.push(Finished { seq, reason });
            } else {
                k += 1;
            }
        }
        left
    }

    /// Removes request `id` wherever it is, freeing its blocks; None if it already left.
    pub fn abort(&mut self, id: u64) -> Option<Seq> {
        if let Some(k) = self.running.iter().position(|s| s.id == id) {
            let seq = self.running.remove(k);
            self.pool.free(&seq.blocks);
            return Some(seq);
        }
        let k = self.waiting.iter().position(|s| s.id == id)?;
        self.waiting.remove(k)
    }
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
