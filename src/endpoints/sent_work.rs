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
//!
//! Beside the work in force, each backend keeps its **recent** work: the prompt tokens of every
//! request sent to it, decayed exponentially with a half-life of [`RECENT_HALF_LIFE_MS`]. It is
//! the router's measure of how the fleet's traffic has been shared out lately, whether or not
//! anything is queued (`/admin/backends` shows it; the `prefix-cache-scorer` places new
//! prefixes and replicates hot ones by it), and how many new prefixes it was given lately
//! ([`SentWork::note_placed`]):
//!
//! ```text
//! recent(now) = Σ_requests prompt_tokens · 2^(−(now − sent_at) / half_life)
//! ```
//!
//! Each is a [`Recent`]: one atomic word (the decayed value as an `f32` and the time of its
//! last update in 16 ms ticks, updated by compare-and-swap), so recording and reading never
//! wait.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::Backend;

/// Per-backend totals of the charges in force.
#[derive(Debug, Default)]
pub struct SentWork {
    prefill: AtomicU64,
    decode: AtomicU64,
    /// Recent prompt tokens.
    recent: Recent,
    /// New prefixes placed here lately (the prefix-cache scorer's count).
    placed: Recent,
    /// Recent prompt tokens of requests whose prefix was hot when they were sent (the
    /// prefix-cache scorer's count).
    hot: Recent,
    /// Routing-text bytes of the prompts this backend has started answering, since the
    /// backend joined (see [`super::chars_per_token`]).
    served_chars: AtomicU64,
    /// Requests this backend answered with a success and that have ended, since the backend
    /// joined: beside the engine's own count of finished requests, this router's share of
    /// the backend's traffic (see [`super::chars_per_token`]).
    served_requests: AtomicU64,
}

/// A quantity that decays with a half-life of [`RECENT_HALF_LIFE_MS`]: one atomic word (the
/// decayed value as an `f32` above, the tick of its last update below), added to and read
/// without waiting. Used for each backend's recent work and for the prefix scorer's
/// per-prefix traffic ([`crate::scheduling::plugins::scorer::prefix_cache`]).
#[derive(Debug, Default)]
pub struct Recent(AtomicU64);

impl Recent {
    /// Add `amount` at `now_ms` (any monotonic millisecond clock, the same for every call).
    pub fn add(&self, amount: f64, now_ms: u64) {
        if !amount.is_finite() {
            return;
        }
        let now = tick(now_ms);
        // fetch_update never fails with a closure that always returns Some.
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |word| {
                let (value, then) = unpack(word);
                let sum = decay(value, then, now) + amount as f32;
                // Keep the later tick when another thread stored one after `now` was read.
                let later = if behind(now, then) { then } else { now };
                Some(pack(
                    if sum.is_finite() {
                        sum.max(0.0)
                    } else {
                        f32::MAX
                    },
                    later,
                ))
            });
    }

    /// The value decayed to `now_ms`.
    pub fn get(&self, now_ms: u64) -> f64 {
        let (value, then) = unpack(self.0.load(Ordering::Relaxed));
        f64::from(decay(value, then, tick(now_ms)))
    }
}

/// Half-life of [`SentWork::recent_tokens`]: traffic a minute old counts half.
pub const RECENT_HALF_LIFE_MS: u64 = 60_000;

/// Resolution of the recent-work clock; 2³² ticks of 16 ms are 2.2 years before the tick
/// wraps (ages are taken modulo that, so only a gap longer than it could mislead).
const TICK_MS: u64 = 16;

fn pack(value: f32, tick: u32) -> u64 {
    (u64::from(value.to_bits()) << 32) | u64::from(tick)
}

fn unpack(word: u64) -> (f32, u32) {
    (f32::from_bits((word >> 32) as u32), word as u32)
}

/// `value`, last updated at `then`, decayed to tick `now`.
fn decay(value: f32, then: u32, now: u32) -> f32 {
    if value <= 0.0 {
        return 0.0;
    }
    let age = if behind(now, then) {
        0
    } else {
        now.wrapping_sub(then)
    };
    let age_ms = f64::from(age) * TICK_MS as f64;
    (f64::from(value) * (-age_ms / RECENT_HALF_LIFE_MS as f64).exp2()) as f32
}

/// Was `now` read before another thread stored the later tick `then`? Such a `now` looks
/// almost 2³² ticks past `then`: any gap beyond half the tick range is taken for this race
/// (and counts as no age), not for a pause of over a year.
fn behind(now: u32, then: u32) -> bool {
    now.wrapping_sub(then) > u32::MAX / 2
}

fn tick(now_ms: u64) -> u32 {
    (now_ms / TICK_MS) as u32
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

    /// A request of `tokens` prompt tokens was sent at `now_ms` (any monotonic millisecond
    /// clock, the same for every call).
    pub fn note_sent(&self, tokens: u64, now_ms: u64) {
        self.recent.add(tokens as f64, now_ms);
    }

    /// A prompt whose prefix no backend held was sent here at `now_ms`.
    pub fn note_placed(&self, now_ms: u64) {
        self.placed.add(1.0, now_ms);
    }

    /// New prefixes placed here lately (one-minute half-life), decayed to `now_ms`.
    pub fn recent_placed(&self, now_ms: u64) -> f64 {
        self.placed.get(now_ms)
    }

    /// A request of `tokens` prompt tokens whose prefix was hot was sent here at `now_ms`.
    pub fn note_hot(&self, tokens: f64, now_ms: u64) {
        self.hot.add(tokens, now_ms);
    }

    /// Recent prompt tokens of hot prefixes sent here, decayed to `now_ms`.
    pub fn recent_hot(&self, now_ms: u64) -> f64 {
        self.hot.get(now_ms)
    }

    /// The backend started answering (a first byte with a success status) a prompt whose
    /// routing text is `chars` bytes long: by then it has counted the prompt's tokens.
    pub fn note_served_chars(&self, chars: u64) {
        add(&self.served_chars, chars);
    }

    /// Routing-text bytes of every prompt [`Self::note_served_chars`] counted (saturating).
    pub fn served_chars(&self) -> u64 {
        self.served_chars.load(Ordering::Relaxed)
    }

    /// A request this backend started answering with a success has ended (counted at the end,
    /// as the engine counts a finished request).
    pub fn note_served_request(&self) {
        add(&self.served_requests, 1);
    }

    /// Requests [`Self::note_served_request`] counted (saturating).
    pub fn served_requests(&self) -> u64 {
        self.served_requests.load(Ordering::Relaxed)
    }

    /// Recent prompt tokens sent (see the module doc), decayed to `now_ms`.
    pub fn recent_tokens(&self, now_ms: u64) -> f64 {
        self.recent.get(now_ms)
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

    /// The prompt tokens the backend is charged to prefill.
    pub fn uncached(&self) -> u64 {
        self.uncached
    }

    /// The prompt's length in tokens (what the request decodes against).
    pub fn context(&self) -> u64 {
        self.context
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
    fn recent_work_adds_and_halves_every_half_life() {
        let b = &backends(1)[0];
        let w = b.work();
        assert_eq!(w.recent_tokens(0), 0.0);
        w.note_sent(1_000, 1_000);
        w.note_sent(500, 1_000);
        assert_eq!(w.recent_tokens(1_000), 1_500.0);
        let later = 1_000 + RECENT_HALF_LIFE_MS;
        assert!((w.recent_tokens(later) - 750.0).abs() < 1.0);
        w.note_sent(250, later);
        assert!((w.recent_tokens(later) - 1_000.0).abs() < 1.0);
        assert!((w.recent_tokens(later + 2 * RECENT_HALF_LIFE_MS) - 250.0).abs() < 1.0);
        // An absurd token count saturates instead of turning into infinity.
        w.note_sent(u64::MAX, later);
        w.note_sent(u64::MAX, later);
        assert!(w.recent_tokens(later).is_finite());
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
