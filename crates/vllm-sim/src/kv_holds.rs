//! P/D holds: a prefill leg's blocks kept after it finishes, until a pull takes them or their
//! lease ends (the bookkeeping of [`crate::engine`], which owns the block pool and the timers).
//!
//! A prefill leg registers a [`Hold`] when it is submitted. When it finishes, its blocks (still
//! referenced: the scheduler does not free a held sequence) move here under its key, the
//! `remote_request_id`, and are announced on the hold's channel. The first pull of the key frees
//! them and answers how many tokens they hold; a second pull, or one after the lease, finds
//! nothing (vLLM frees after the first read). A leg that leaves without finishing (abort, client
//! gone) just forgets its hold: the scheduler freed its blocks.

use std::collections::HashMap;

use tokio::sync::oneshot;

use crate::kv_cache::{BlockId, BlockPool};
use crate::scheduler::Finished;

/// Where a prefill leg's held blocks are announced.
#[derive(Debug)]
pub struct Hold {
    /// The `remote_request_id` a pull names.
    pub key: String,
    /// Gets the held block ids and the tokens they hold once the request finished (dropped if
    /// it did not).
    pub reply: oneshot::Sender<(Vec<BlockId>, usize)>,
}

/// Why a pull got no blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PullRefused {
    /// Never held, already pulled, or the lease ended.
    #[error("no KV blocks are held for this request (never held, already pulled, or expired)")]
    NotHeld,
    /// The request is held but under other block ids.
    #[error("the KV blocks held for this request are not the ones named")]
    WrongBlocks,
    /// The engine is gone.
    #[error("engine stopped")]
    Stopped,
}

/// A finished prefill's blocks, waiting for their pull.
#[derive(Debug)]
struct Held {
    blocks: Vec<BlockId>,
    tokens: usize,
}

/// Every hold of one engine.
#[derive(Debug, Default)]
pub struct Holds {
    /// Prefill legs still running, by sequence id.
    running: HashMap<u64, Hold>,
    /// Finished prefills' blocks, by key.
    held: HashMap<String, Held>,
    /// Pulls served.
    pub pulls: u64,
    /// Holds whose lease ended unpulled.
    pub expired: u64,
}

impl Holds {
    /// Prefills whose blocks are held now.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Sequence `id` is a prefill leg.
    pub fn start(&mut self, id: u64, hold: Hold) {
        self.running.insert(id, hold);
    }

    /// Sequence `id` left without finishing: nothing to hold.
    pub fn forget(&mut self, id: u64) {
        self.running.remove(&id);
    }

    /// Moves the blocks of prefill legs that finished this step here and announces them;
    /// returns their keys (each needs a lease timer). Other departures forget their hold.
    pub fn finish(&mut self, left: &[Finished], pool: &mut BlockPool) -> Vec<String> {
        let mut keys = Vec::new();
        for f in left {
            let Some(hold) = self.running.remove(&f.seq.id) else {
                continue;
            };
            if f.reason.is_none() || !f.seq.hold {
                continue;
            }
            let blocks = f.seq.blocks.clone();
            let tokens = f.seq.num_computed;
            // Held even if the client is gone by now: the request finished, and vLLM holds the
            // blocks all the same until the lease ends.
            let _ = hold.reply.send((blocks.clone(), tokens));
            if let Some(old) = self.held.insert(hold.key.clone(), Held { blocks, tokens }) {
                pool.free(&old.blocks);
            }
            keys.push(hold.key);
        }
        keys
    }

    /// A pull of `key` (checked against `blocks` when given): frees the blocks, answers how
    /// many tokens they held.
    pub fn pull(
        &mut self,
        key: &str,
        blocks: Option<&[BlockId]>,
        pool: &mut BlockPool,
    ) -> Result<usize, PullRefused> {
        let h = self.held.get(key).ok_or(PullRefused::NotHeld)?;
        if blocks.is_some_and(|b| b != h.blocks.as_slice()) {
            return Err(PullRefused::WrongBlocks);
        }
        let tokens = h.tokens;
        self.release(key, pool);
        self.pulls += 1;
        Ok(tokens)
    }

    /// The lease of `key` ended: frees its blocks if they are still held.
    pub fn expire(&mut self, key: &str, pool: &mut BlockPool) -> bool {
        let freed = self.release(key, pool);
        if freed {
            self.expired += 1;
        }
        freed
    }

    /// Frees the blocks held under `key`, if any.
    pub fn release(&mut self, key: &str, pool: &mut BlockPool) -> bool {
        match self.held.remove(key) {
            Some(h) => {
                pool.free(&h.blocks);
                true
            }
            None => false,
        }
    }

    /// Frees every held block (an engine restart).
    pub fn clear(&mut self, pool: &mut BlockPool) {
        for (_, h) in self.held.drain() {
            pool.free(&h.blocks);
        }
    }
}
