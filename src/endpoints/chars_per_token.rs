//! Each backend's characters per token, measured: how many bytes of routing text (see
//! [`crate::prompt`]) this router's prompts carry per token the backend counted for them; and,
//! to get it right, this router's share of the backend's traffic.
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
//! Four cumulative counters give the figure:
//!
//! * `chars`: the routing-text bytes of the prompts the backend started answering
//!   ([`super::sent_work::SentWork::served_chars`]: counted at the first byte of a
//!   successful answer, by which time the engine has counted the prompt's tokens);
//! * `tokens`: the backend's own `prefix_cache_queries` counter (vLLM counts every scheduled
//!   prompt's tokens in it), scraped by the poller, which reads `chars` just before the scrape;
//! * `own`: the requests this router saw the backend answer with a success, counted when they
//!   end ([`super::sent_work::SentWork::served_requests`], read with `chars`);
//! * `finished`: the backend's own count of finished requests (`vllm:request_success`,
//!   every reason), scraped with `tokens`.
//!
//! ```text
//! share = (own − own₀) / (finished − finished₀)               once finished − finished₀ ≥ MIN_FINISHED
//! ratio = (chars − chars₀) / ((tokens − tokens₀) · share)     once tokens − tokens₀ ≥ MIN_TOKENS
//! ```
//!
//! from a baseline `(chars₀, tokens₀, own₀, finished₀)` taken at the first scrape that has the
//! token counter, and taken again when a counter goes backwards, when the backend's epoch
//! changes (a restart), or when the finished counter first appears. The share is clamped to
//! [`MIN_SHARE`]–1; while the engine has no finished counter it is 1, and while it has one the
//! figure waits for the share. The window slides: once [`WINDOW_TOKENS`] have been counted
//! past the baseline a midpoint is kept, and when as many more have been counted the midpoint
//! becomes the baseline, so the figure covers the last one to two windows and follows a change
//! of workload.
//!
//! The share is what makes the figure right for a backend that other clients use too: several
//! replicas of this router behind a round-robin front (issue 26), or users who call the backend
//! directly. Without it each of two replicas read half the workload's figure on real vLLM
//! (0.50–0.67 against 1.18), sized its record of every cache at half the truth, and saw
//! evictions that did not happen. The share assumes the others' prompts are like this router's
//! (the same tokens per request). The prefix scorer also scales its absolute traffic
//! thresholds by it, since each replica sees only its share of a hot prefix's traffic.
//!
//! The remaining errors lean the same way, towards fewer characters per token and so a smaller
//! index (which sees evictions early rather than late): prompts scheduled but not yet answered
//! at a scrape are in `tokens` only, and prompts recomputed after a preemption add tokens and
//! no characters.
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
/// Requests the engine finished past the baseline before the share is measured.
pub const MIN_FINISHED: f64 = 16.0;
/// Smallest share measured (a router sending 1 request in 64 reads its figure from few).
pub const MIN_SHARE: f64 = 1.0 / 64.0;

/// One reading of the counters: `chars` and `own` are this router's, read just before the
/// scrape that gave `tokens` and `finished` (`None` where the page lacks the counter).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reading {
    pub chars: u64,
    pub own: u64,
    pub tokens: Option<f64>,
    pub finished: Option<f64>,
}

/// One reading kept as a baseline, midpoint or last reading.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Point {
    chars: u64,
    tokens: f64,
    own: u64,
    finished: Option<f64>,
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
    /// This router's share of the backend's finished requests, once measured.
    share: Option<f64>,
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

    /// This router's share of the backend's finished requests (0–1), once measured.
    pub fn share(&self) -> Option<f64> {
        self.share
    }

    /// The measurement after a scrape (see [`Reading`]); `restarted` when the backend's cache
    /// may have been wiped (its epoch changed). The published figure and the share survive a
    /// restart: they are the workload's, the tokenizer's and the fleet's, not the cache's.
    #[must_use]
    pub fn observe(self, reading: Reading, restarted: bool) -> Self {
        let Some(tokens) = reading.tokens.filter(|t| t.is_finite() && *t >= 0.0) else {
            return self;
        };
        let chars = reading.chars;
        let now = Point {
            chars,
            tokens,
            own: reading.own,
            finished: reading.finished.filter(|f| f.is_finite() && *f >= 0.0),
        };
        let fresh = CharsPerToken {
            base: Some(now),
            mid: None,
            last: Some(now),
            published: self.published,
            counted: 0.0,
            share: self.share,
        };
        let Some(mut base) = self.base else {
            return fresh;
        };
        let below = |p: &Point| {
            tokens < p.tokens
                || chars < p.chars
                || now.own < p.own
                || matches!((p.finished, now.finished), (Some(a), Some(b)) if b < a)
        };
        let appeared = base.finished.is_none() && now.finished.is_some();
        if restarted || appeared || self.last.is_some_and(|l| below(&l)) || below(&base) {
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
        let mut share = self.share;
        if let (Some(f0), Some(f1)) = (base.finished, now.finished) {
            if f1 - f0 >= MIN_FINISHED {
                let own = now.own.saturating_sub(base.own) as f64;
                share = Some((own / (f1 - f0)).clamp(MIN_SHARE, 1.0));
            }
        }
        // With the engine's finished counter on the page, the figure waits for the share.
        let scale = if now.finished.is_some() {
            share
        } else {
            Some(1.0)
        };
        let mut published = self.published;
        if let (true, Some(scale)) = (counted >= MIN_TOKENS, scale) {
            let ratio =
                ((chars - base.chars) as f64 / (counted * scale)).clamp(MIN_RATIO, MAX_RATIO);
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
            share,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A reading of `chars` and `tokens` from an engine without a finished counter.
    fn r(chars: u64, tokens: f64) -> Reading {
        Reading {
            chars,
            own: 0,
            tokens: Some(tokens),
            finished: None,
        }
    }

    /// Readings of `(chars, tokens)` in order, none restarting.
    fn run(readings: &[(u64, f64)]) -> CharsPerToken {
        readings.iter().fold(CharsPerToken::default(), |m, (c, t)| {
            m.observe(r(*c, *t), false)
        })
    }

    #[test]
    fn nothing_is_published_before_min_tokens_past_the_first_reading() {
        // The counters' totals before the first reading (another router's traffic, the
        // backend's uptime) are not this measurement's.
        let m = run(&[(1_000_000, 10.0), (1_000_000 + 9_000, 8_010.0)]);
        assert_eq!(m.ratio(), None);
        let m = m.observe(r(1_000_000 + 9_600, 8_202.0), false);
        let r = m.ratio().unwrap();
        assert!((r - 9_600.0 / 8_192.0).abs() < 1e-9, "{r}");
    }

    #[test]
    fn a_page_without_the_counter_changes_nothing() {
        let m = run(&[(0, 0.0), (12_000, 10_000.0)]);
        let none = Reading {
            tokens: None,
            ..r(50_000, 0.0)
        };
        assert_eq!(m.observe(none, false), m);
        assert_eq!(m.observe(r(50_000, f64::NAN), false), m);
    }

    #[test]
    fn small_moves_keep_the_published_figure_and_large_ones_replace_it() {
        let m = run(&[(0, 0.0), (12_000, 10_000.0)]);
        assert_eq!(m.ratio(), Some(1.2));
        // 1.25 overall: 4 % more, under 1/16 octave.
        let m = m.observe(r(25_000, 20_000.0), false);
        assert_eq!(m.ratio(), Some(1.2));
        // 2.0 overall: well past it.
        let m = m.observe(r(80_000, 40_000.0), false);
        assert_eq!(m.ratio(), Some(2.0));
    }

    #[test]
    fn a_restart_or_a_counter_going_back_takes_a_new_baseline_and_keeps_the_figure() {
        let m = run(&[(0, 0.0), (12_000, 10_000.0)]);
        for m in [
            m.observe(r(13_000, 50.0), false),
            m.observe(r(13_000, 11_000.0), true),
        ] {
            assert_eq!(m.ratio(), Some(1.2));
            assert_eq!(m.tokens_counted(), 0.0);
            // The next figure is measured from the new baseline only: 3 chars per token.
            let t = m.base.unwrap().tokens;
            let m = m.observe(r(13_000 + 30_000, t + 10_000.0), false);
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
            m = m.observe(r(chars, tokens), false);
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

    /// Readings of `(chars, own, tokens, finished)`: a router sending a share of the traffic
    /// of an engine that counts finished requests.
    fn shared(readings: &[(u64, u64, f64, f64)]) -> CharsPerToken {
        readings
            .iter()
            .fold(CharsPerToken::default(), |m, (c, o, t, f)| {
                m.observe(
                    Reading {
                        chars: *c,
                        own: *o,
                        tokens: Some(*t),
                        finished: Some(*f),
                    },
                    false,
                )
            })
    }

    #[test]
    fn a_router_sending_half_the_requests_reads_the_whole_figure() {
        // 40 requests of 500 tokens finished, 20 of them this router's at 600 characters
        // each: 1.2 characters per token, not the 0.6 its characters against every token give.
        let m = shared(&[(0, 0, 0.0, 0.0), (12_000, 20, 20_000.0, 40.0)]);
        assert_eq!(m.share(), Some(0.5));
        let ratio = m.ratio().unwrap();
        assert!((ratio - 1.2).abs() < 1e-9, "{ratio}");
        // Alone on the backend: share 1.
        let m = shared(&[(0, 0, 0.0, 0.0), (24_000, 40, 20_000.0, 40.0)]);
        assert_eq!(m.share(), Some(1.0));
        assert_eq!(m.ratio(), Some(1.2));
    }

    #[test]
    fn the_figure_waits_for_enough_finished_requests() {
        // Tokens enough, but 10 finished requests say little of the share: nothing yet.
        let m = shared(&[(0, 0, 0.0, 0.0), (12_000, 5, 10_000.0, 10.0)]);
        assert_eq!((m.share(), m.ratio()), (None, None));
        let m = m.observe(
            Reading {
                chars: 24_000,
                own: 10,
                tokens: Some(20_000.0),
                finished: Some(20.0),
            },
            false,
        );
        assert_eq!(m.share(), Some(0.5));
        assert_eq!(m.ratio(), Some(2.4));
    }

    #[test]
    fn the_share_is_clamped_and_survives_a_restart() {
        // More answered here than the engine says it finished (a lagging page): at most 1.
        let m = shared(&[(0, 0, 0.0, 0.0), (12_000, 30, 10_000.0, 20.0)]);
        assert_eq!(m.share(), Some(1.0));
        // One request in a thousand: the floor.
        let m = shared(&[(0, 0, 0.0, 0.0), (12_000, 1, 10_000.0, 1_000.0)]);
        assert_eq!(m.share(), Some(MIN_SHARE));
        // The engine's counter going back is a restart: a new baseline, the share kept.
        let m = shared(&[
            (0, 0, 0.0, 0.0),
            (12_000, 20, 20_000.0, 40.0),
            (13_000, 21, 21_000.0, 3.0),
        ]);
        assert_eq!(m.share(), Some(0.5));
        assert_eq!(m.tokens_counted(), 0.0);
    }
}
