//! The work this router has sent to one backend and that is not finished yet, in prompt
//! tokens: the prefill still ahead of requests waiting for their first token, and the context
//! of requests past it (decoding). Both are the router's own knowledge, fresh at every
//! decision (the engine's metrics arrive a poll later and do not say how long the queued
//! prompts are); the `prefill-cost-scorer` reads them.
//!
//! A [`Charge`] is taken when a request is sent (its estimated uncached prompt tokens and its
//! whole prompt), moves from prefill to decode when the first byte of the response arrives,
//! and is released when the response ends, fails or is abandoned (dropped). Counters saturate
//! instead of wrapping, and a charge releases exactly what it added.
//!
//! The first byte is the first token only for streamed responses: a non-streaming answer
//! arrives whole at the end, so its prompt counts as prefill for the request's whole life (an
//! overestimate of that backend's queue, by the decode time of such requests).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::Backend;

/// Per-backend totals of the charges in force.
#[derive(Debug, Default)]
pub struct SentWork {
    prefill: AtomicU64,
    decode: AtomicU64,
}

impl SentWork {
    /// Prompt tokens sent that still need prefilling (requests before their first token).
    pub fn prefill_tokens(&self) -> u64 {
        self.prefill.load(Ordering::Relaxed)
    }

    /// Prompt tokens of requests past their first token and still running.
    pub fn decode_tokens(&self) -> u64 {
        self.decode.load(Ordering::Relaxed)
    }
}

fn add(counter: &AtomicU64, n: u64) {
    // fetch_update never fails with a closure that always returns Some.
    let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_add(n))
    });
}

fn sub(counter: &AtomicU64, n: u64) {
    let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_sub(n))
    });
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Prefill,
    Decode,
}

/// One request's share of a backend's [`SentWork`]; released on drop.
#[derive(Debug)]
pub struct Charge {
    backend: Arc<Backend>,
    /// Tokens this request adds to the prefill total.
    uncached: u64,
    /// Tokens it adds to the decode total once past its first token.
    context: u64,
    stage: Stage,
}

impl Charge {
    /// Charge `backend` with a request whose prompt has `context` tokens, `uncached` of which
    /// it must prefill (clamped to `context`).
    pub fn new(backend: &Arc<Backend>, uncached: u64, context: u64) -> Self {
        let uncached = uncached.min(context);
        add(&backend.work().prefill, uncached);
        Charge {
            backend: Arc::clone(backend),
            uncached,
            context,
            stage: Stage::Prefill,
        }
    }

    /// The first byte of the response arrived: the prefill is done and the request decodes.
    /// Idempotent.
    pub fn first_token(&mut self) {
        if self.stage == Stage::Prefill {
            let work = self.backend.work();
            sub(&work.prefill, self.uncached);
            add(&work.decode, self.context);
            self.stage = Stage::Decode;
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        let work = self.backend.work();
        match self.stage {
            Stage::Prefill => sub(&work.prefill, self.uncached),
            Stage::Decode => sub(&work.decode, self.context),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::endpoints::test_support::backends;

    #[test]
    fn a_charge_moves_from_prefill_to_decode_and_releases_what_it_added() {
        let b = &backends(1)[0];
        let mut first = Charge::new(b, 300, 1_000);
        let second = Charge::new(b, 5_000, 2_000); // uncached clamped to the prompt
        assert_eq!(b.work().prefill_tokens(), 2_300);
        assert_eq!(b.work().decode_tokens(), 0);
        first.first_token();
        first.first_token();
        assert_eq!(b.work().prefill_tokens(), 2_000);
        assert_eq!(b.work().decode_tokens(), 1_000);
        drop(second);
        assert_eq!(b.work().prefill_tokens(), 0);
        drop(first);
        assert_eq!(b.work().decode_tokens(), 0);
    }

    #[test]
    fn counters_saturate() {
        let b = &backends(1)[0];
        let big = Charge::new(b, u64::MAX, u64::MAX);
        let more = Charge::new(b, 10, 10);
        assert_eq!(b.work().prefill_tokens(), u64::MAX);
        drop(more);
        drop(big);
        assert_eq!(b.work().prefill_tokens(), 0);
    }
}
