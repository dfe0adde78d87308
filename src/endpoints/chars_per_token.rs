//! Each backend's characters per token, measured: how many bytes of routing text (see
//! [`crate::prompt`]) this router's prompts carry per token the backend counted for them.
//!
//! The approximate prefix index counts prompts in characters and caches hold tokens, so the
//! index sizes each backend's record of its cache as `cache tokens × characters per token`.
//! Assumed at 4 (English prose), that is 3.4 × too large for the project's own shared-prefix
//! workloads, whose words tokenize at 1.17 characters per token under vLLM's own tokenizer:
//! the router then never sees a cache evict (`bench/results/sim-26-cpt-*`). The figure is
//! always measured and published (`/admin/backends`, `inferlb_backend_chars_per_token`); the
//! prefix scorer sizes a backend's record by it while the backend's KV-event stream is live
//! (`measure_chars_per_token = "auto"`, the default), or always with `true` (see
//! [`crate::scheduling::plugins::scorer::prefix_cache`] for why not always by default).
//!
//! Two cumulative counters give the figure:
//!
//! * `chars`: the routing-text bytes of the prompts the backend started answering
//!   ([`super::sent_work::SentWork::served_chars`]: counted at the first byte of a
//!   successful answer, by which time the engine has counted the prompt's tokens);
//! * `tokens`: the backend's own `prefix_cache_queries` counter (vLLM counts every scheduled
//!   prompt's tokens in it), scraped by the poller, which reads `chars` just before the scrape.
//!
//! ```text
//! ratio = (chars − chars₀) / (tokens − tokens₀)      once tokens − tokens₀ ≥ MIN_TOKENS
//! ```
//!
//! from a baseline `(chars₀, tokens₀)` taken at the first scrape that has the counter, and
//! taken again when the counter goes backwards or the backend's epoch changes (a restart).
//! The window slides: once [`WINDOW_TOKENS`] have been counted past the baseline a midpoint is
//! kept, and when as many more have been counted the midpoint becomes the baseline, so the
//! figure covers the last one to two windows and follows a change of workload.
//!
//! Every error leans the same way, towards fewer characters per token and so a smaller index
//! (which sees evictions early rather than late): prompts scheduled but not yet answered at a
//! scrape are in `tokens` only; prompts from other clients of the same backend, and prompts
//! recomputed after a preemption, add tokens and no characters. A backend shared by `k`
//! routers reads `1/k` of its ratio in each.
//!
//! The published figure moves only when the measurement leaves it by more than 1/16 of an
//! octave (4.4 %), so the index is not resized at every scrape; it is clamped to
//! [`MIN_RATIO`]–[`MAX_RATIO`] (a multimodal prompt's image tokens have no routing text).

/// Tokens counted past the baseline before the figure is published.
pub const MIN_TOKENS: f64 = 8_192.0;
/// Tokens per window of the sliding measurement.
pub const WINDOW_TOKENS: f64 = 1_048_576.0;
/// Smallest figure published.
pub const MIN_RATIO: f64 = 0.25;
/// Largest figure published.
pub const MAX_RATIO: f64 = 64.0;
/// How far (in octaves) the measurement must move before the published figure follows.
const STEP_OCTAVES: f64 = 1.0 / 16.0;

/// One reading of the two counters.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Point {
    chars: u64,
    tokens: f64,
}

/// The measurement of one backend, carried from one published state to the next.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CharsPerToken {
    base: Option<Point>,
    mid: Option<Point>,
    /// The last reading (a counter below it went backwards).
    last: Option<Point>,
    published: Option<f64>,
    /// Tokens counted past the baseline at the last reading.
    counted: f64,
}

impl CharsPerToken {
    /// The measured characters per token, once [`MIN_TOKENS`] have been counted.
    pub fn ratio(&self) -> Option<f64> {
        self.published
    }

    /// Tokens counted in the current measurement (past its baseline).
    pub fn tokens_counted(&self) -> f64 {
        self.counted
    }

    /// The measurement after a scrape that read `tokens` (the backend's query counter, `None`
    /// when the page lacks it) with `chars` read just before it; `restarted` when the
    /// backend's cache may have been wiped (its epoch changed). The published figure survives
    /// a restart: it is the workload's and the tokenizer's, not the cache's.
    #[must_use]
    pub fn observe(self, chars: u64, tokens: Option<f64>, restarted: bool) -> Self {
        let Some(tokens) = tokens.filter(|t| t.is_finite() && *t >= 0.0) else {
            return self;
        };
        let now = Point { chars, tokens };
        let fresh = CharsPerToken {
            base: Some(now),
            mid: None,
            last: Some(now),
            published: self.published,
            counted: 0.0,
        };
        let Some(mut base) = self.base else {
            return fresh;
        };
        let back = self
            .last
            .is_some_and(|l| tokens < l.tokens || chars < l.chars);
        if restarted || back || tokens < base.tokens || chars < base.chars {
            return fresh;
        }
        let mut mid = self.mid;
        match mid {
            None if tokens - base.tokens >= WINDOW_TOKENS => mid = Some(now),
            Some(m) if tokens - m.tokens >= WINDOW_TOKENS => {
                base = m;
                mid = Some(now);
            }
            _ => {}
        }
        let counted = tokens - base.tokens;
        let mut published = self.published;
        if counted >= MIN_TOKENS {
            let ratio = ((chars - base.chars) as f64 / counted).clamp(MIN_RATIO, MAX_RATIO);
            let moved = published.is_none_or(|p| (ratio / p).log2().abs() >= STEP_OCTAVES);
            if moved {
                published = Some(ratio);
            }
        }
        CharsPerToken {
            base: Some(base),
            mid,
            last: Some(now),
            published,
            counted,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Readings of `(chars, tokens)` in order, none restarting.
    fn run(readings: &[(u64, f64)]) -> CharsPerToken {
        readings.iter().fold(CharsPerToken::default(), |m, (c, t)| {
            m.observe(*c, Some(*t), false)
        })
    }

    #[test]
    fn nothing_is_published_before_min_tokens_past_the_first_reading() {
        // The counters' totals before the first reading (another router's traffic, the
        // backend's uptime) are not this measurement's.
        let m = run(&[(1_000_000, 10.0), (1_000_000 + 9_000, 8_010.0)]);
        assert_eq!(m.ratio(), None);
        let m = m.observe(1_000_000 + 9_600, Some(8_202.0), false);
        let r = m.ratio().unwrap();
        assert!((r - 9_600.0 / 8_192.0).abs() < 1e-9, "{r}");
    }

    #[test]
    fn a_page_without_the_counter_changes_nothing() {
        let m = run(&[(0, 0.0), (12_000, 10_000.0)]);
        assert_eq!(m.observe(50_000, None, false), m);
        assert_eq!(m.observe(50_000, Some(f64::NAN), false), m);
    }

    #[test]
    fn small_moves_keep_the_published_figure_and_large_ones_replace_it() {
        let m = run(&[(0, 0.0), (12_000, 10_000.0)]);
        assert_eq!(m.ratio(), Some(1.2));
        // 1.25 overall: 4 % more, under 1/16 octave.
        let m = m.observe(25_000, Some(20_000.0), false);
        assert_eq!(m.ratio(), Some(1.2));
        // 2.0 overall: well past it.
        let m = m.observe(80_000, Some(40_000.0), false);
        assert_eq!(m.ratio(), Some(2.0));
    }

    #[test]
    fn a_restart_or_a_counter_going_back_takes_a_new_baseline_and_keeps_the_figure() {
        let m = run(&[(0, 0.0), (12_000, 10_000.0)]);
        for m in [
            m.observe(13_000, Some(50.0), false),
            m.observe(13_000, Some(11_000.0), true),
        ] {
            assert_eq!(m.ratio(), Some(1.2));
            assert_eq!(m.tokens_counted(), 0.0);
            // The next figure is measured from the new baseline only: 3 chars per token.
            let t = m.base.unwrap().tokens;
            let m = m.observe(13_000 + 30_000, Some(t + 10_000.0), false);
            assert_eq!(m.ratio(), Some(3.0));
        }
    }

    #[test]
    fn the_window_slides_to_the_recent_workload() {
        // A window of prose at 4 characters per token, then words at 1.2.
        let w = WINDOW_TOKENS;
        let mut m = run(&[(0, 0.0), ((4.0 * w) as u64, w)]);
        assert_eq!(m.ratio(), Some(4.0));
        let mut chars = (4.0 * w) as u64;
        let mut tokens = w;
        for _ in 0..8 {
            chars += (1.2 * w / 4.0) as u64;
            tokens += w / 4.0;
            m = m.observe(chars, Some(tokens), false);
        }
        // Two windows of words later, the prose is out of the measurement.
        let r = m.ratio().unwrap();
        assert!((r - 1.2).abs() < 0.01, "{r}");
        assert!(m.tokens_counted() <= 2.0 * w);
    }

    #[test]
    fn the_figure_is_clamped() {
        // Tokens with no routing text (another client, images): the floor.
        let m = run(&[(0, 0.0), (0, 100_000.0)]);
        assert_eq!(m.ratio(), Some(MIN_RATIO));
        let m = run(&[(0, 0.0), (u64::MAX, 10_000.0)]);
        assert_eq!(m.ratio(), Some(MAX_RATIO));
    }
}
