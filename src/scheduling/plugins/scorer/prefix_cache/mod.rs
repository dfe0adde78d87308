//! `prefix-cache-scorer`: prefers the backend most likely to hold the request's prompt prefix
//! in its KV cache, judged by which prompts the router itself sent where.
//!
//! The routing text is cut into blocks of `block_size` characters (UTF-8 bytes) and the blocks
//! are chain-hashed with XXH3-64 (the first seeded with the model name), see [`index`]. For a
//! candidate holding the first `m` of the prompt's `n` full blocks:
//!
//! ```text
//! ratio  = m / n
//! length = min(1, m · block_size / long_match_chars)
//! score  = (1 − length_weight) · ratio + length_weight · length        (0 when n = 0)
//! ```
//!
//! The length term keeps a long 90 % match from losing to a short full match.
//!
//! A prompt nobody holds well also says where its prefix *should* go. With `best` the highest
//! score above and `room` each candidate's free share of its recorded LRU (min–max scaled over
//! the candidates, 1 for all when equal):
//!
//! ```text
//! score += room_weight · (1 − best) · room
//! ```
//!
//! so a new prefix goes to the backend the router has filled least, and prefixes spread evenly
//! over the fleet's caches instead of wherever load noise sent their first request; a prompt
//! whose prefix is held somewhere keeps (almost) the plain ratio.
//!
//! Filling evenly is not loading evenly when prefixes differ in popularity: a hot prefix's
//! holder gets as many new prefixes as anyone, and takes the hot traffic on top (on two real
//! vLLM servers with Zipf-skewed groups, 61–68 % of the prompt tokens). So the room is judged
//! partly by each candidate's recent traffic (`work`: prompt tokens sent to it, decayed with a
//! one-minute half-life, see [`crate::endpoints::sent_work`]), but only by the part of it that
//! hot prefixes brought (`hot`: the prompt tokens of requests whose prefix was hot when they
//! were sent, same half-life). A prefix is hot when its recent traffic (the first half of what
//! the chosen backend held of the prompt: the part its group shares, read in [`hot`]'s table)
//! is at least `room_hot_share` (0.5) × the candidates' mean work and `replicate_min_prompts`
//! prompts' worth. With `w` the weight (`precise_room_work_weight` when every candidate is scored
//! from live KV events, else `room_work_weight`; both 1 by default), `kv` the candidates' mean
//! KV-cache usage (0.5 when none is known) and `thrash` the share of recent prompt tokens
//! (one-minute half-life) asked for again after a cache had dropped them (a prompt that came
//! back after the backend holding the most of it had evicted the next block counts the blocks
//! past that match: a repeated prompt that lost only its own tail counts its tail, a prefix
//! dropped whole counts whole; below):
//!
//! ```text
//! t       = w · (1 − kv) · max(0, 1 − thrash / room_thrash_limit)
//! load    = work + room_placed_weight · placed · Σ work ÷ Σ placed     (weight 2)
//! excess  = max(0, min(hot, load − (1 + room_work_slack) · mean(load)))   (slack 0)
//! room    = (1 − t) · room_by_fill + t · room_by_excess   (each min–max scaled as above)
//! ```
//!
//! and while no candidate has an excess, fill alone places (blending in a tie would wash out
//! its ranking). An excess spread over many prefixes is noise or the traffic of prefixes placed
//! a moment ago, still to arrive; fill places those as well as traffic does. Ranking by any
//! excess (no hot gate) let that lag pile the groups of a uniform workload onto a few backends:
//! in the simulator at 73 % cache pressure TTFT p90 went from 0.19 s (fill only) to 3.4–6.2 s,
//! hits 0.86 → 0.75–0.78, whatever the thrash limit; a slack of 0.5 over the mean avoided that
//! but on two backends fires only past a 75 % share. With the hot gate, two real vLLM servers,
//! Zipf: see the README (Routing quality, fifth round) for the busiest server's share and the
//! hit rate against the bound (`bench/results/real-vllm-2026-12-06-*26-default*.md`).
//!
//! `thrash` is closed-loop: placing by traffic gives the idler backends more distinct prefixes,
//! harmless while their caches hold them, and the moment their caches start dropping prefixes
//! that are asked for again, placement goes back to filling evenly. It counts only from four
//! prompts' worth of returned tokens ([`THRASH_MIN_PROMPTS`]): on 56 requests one return is
//! 1.8 %, and a single one had closed the gate; on real vLLM three repeated prompts whose
//! question blocks alone had been evicted closed it while every group's prefix stayed cached,
//! hence the lost share rather than the whole prompt. Mean KV usage cannot say this: an
//! engine's usage counts only running requests' blocks (about 0 between requests on two real
//! vLLM servers whose caches were full of reusable prefixes), and the index's fill is full as
//! soon as the router has sent a cache's worth. Returns are told by each backend's ghost of recent evictions (see
//! [`index`]) and, for a candidate scored from live KV events, by its events: a prefix the
//! router sent there and that it no longer holds, if its events reported an eviction within
//! the last minute (a cache that evicted nothing cannot have dropped it: its blocks are late).
//!
//! `room_placed_weight` (2; `precise_room_placed_weight`, 0, when every candidate is scored
//! from live KV events, see below) counts each new prefix (held nowhere when placed) a backend
//! was given lately (`placed`, one-minute half-life) at that many average prefixes' traffic
//! before its traffic arrives. With the hot gate, 0 balanced the real-vLLM Zipf runs better (52 %
//! against 56–59 %) but on the simulator at 73 % pressure handed the idler backends more groups
//! than their caches kept (Zipf hit rate 0.892 against 0.909, TTFT p90 0.142 s against 0.106 s,
//! `bench/results/sim-26-default5-zipf-2026-12-06.md`). At 0.5 the same happened more mildly:
//! per-request traces of later runs of that shape (`bench/zipf_tail.py`,
//! `bench/results/sim-26-zipf-tail-median3-2026-12-07.md` and `sim-26-placed-zipf-*`) show the
//! quietest backend given 12–14 of the 40 groups, taking about half of all the prefix evictions
//! that make the TTFT p90, and on another seed the hot group's backend holding 4. At 2 a backend that was just given
//! prefixes stops looking idle sooner, the groups spread 8–12 per backend and the evictions
//! fall by a tenth to a quarter: TTFT p90 0.092 s against 0.104 s (seed 1) and 0.086 s against
//! 0.126 s (seed 2), medians of 3, with the busiest backend at 35 % against 32–33 %
//! (README, Performance, fourteenth round). Approximate candidates only: their records assume 4
//! characters per token.
//!
//! Caches with room for every prefix are not the gate: on the simulator at 73 % pressure
//! placement by traffic among the caches whose KV events left room for the prompt lost the
//! uniform workload as badly (5.0 s TTFT p90): they have room only while warming up, which is
//! when every group is placed (`bench/results/sim-26-free-*-2026-12-06.md`).
//!
//! **Hot-prefix replication** (opt-in, `replicate_share`) balances with the hot prefix itself
//! instead of with the cold ones: a prefix that alone brings its holder more than its share is
//! given a second holder, which costs one prefill of it, and its traffic is split by a load
//! bound (below).
//!
//! # Hot-prefix replication and bounded load
//!
//! Each pick adds the prompt's tokens to a per-prefix traffic count ([`hot`]: the routing
//! text's chain hash at depths 1, 2, 4, …, one-minute half-life, a fixed-size count-min
//! table). Prompts are counted in estimated tokens, as the backends' recent work is. With
//! `work_i` as above, `fair` the candidates' mean work, `P` this prompt's tokens and
//!
//! ```text
//! bound = (1 + replicate_overload) · fair
//! ```
//!
//! the *holders* are the candidates holding the most of the prompt and the prefix's *group*
//! adds every candidate holding at least half of that (a copy of the prefix with another
//! tail: the same system prompt followed by another question or another conversation). When
//! a holder is within the bound nothing changes. When every holder is over it:
//!
//! * **bounded load**: the group member within the bound with the least work takes the
//!   request (once `fair ≥ replicate_min_prompts · P`, so a near-idle fleet's noise moves
//!   nothing). It pays only the tail it lacks, and every holder keeps its prefix. Without this
//!   rule a replicated prefix kept most of its traffic on its first holder whenever its
//!   prompts repeat (each held whole only there; two real vLLM servers, Zipf: 61 % of the
//!   prompt tokens on one server after replication against 53 % with it, same seed);
//! * **replication**, when no group member is within the bound: the prefix's recent traffic
//!   `r` is read at a recorded depth past every block the candidates outside the group hold
//!   (the part a new copy adds: a system prompt held everywhere names no one prefix) and,
//!   where one is, within the first half of the longest match (the part a new copy shares
//!   with the prompts that follow); with none past them nothing is replicated. With `g` the
//!   group's size, when
//!
//!   ```text
//!   r ≥ replicate_min_prompts · P           the prefix has brought traffic lately
//!   r ≥ replicate_share · fair · g          more than a share of a backend's each
//!   ```
//!
//!   the candidate outside the group with the least work, if it is within the bound,
//!   becomes a replica.
//!
//! The candidate named (copy or replica) is scored as holding what the best holder holds:
//! this scorer ranks it with the holders' best, the holders over their bound a hundredth
//! below it when it is a copy, and the `prefill-cost-scorer` prices it the same; the prefill
//! it is charged and P/D's view of its cached tokens stay what it really holds
//! ([`Held::cached_tokens`]). `replicate_share = 0` (the default) turns both rules off;
//! `inferlb_prefix_replicas_total` counts the requests sent to a new replica,
//! `inferlb_prefix_overflows_total` those sent to a copy by the bound.
//!
//! After the pick, the chosen backend's LRU records the prompt's blocks. Each backend's LRU holds at most
//! `capacity` blocks: a number, or `"auto"` = `num_gpu_blocks × block_size` tokens (from
//! `vllm:cache_config_info`) × characters per token ÷ `block_size` characters, falling back to
//! `fallback_capacity` blocks while the geometry is unknown. When a backend's cache may have
//! been wiped (restart, re-admission: its state epoch changes) its records are purged.
//!
//! The characters per token are `chars_per_token` (4), or the backend's own figure measured
//! from its token counter ([`crate::endpoints::chars_per_token`], once it has counted 8,192
//! tokens of this router's prompts): with `measure_chars_per_token = "auto"` (the default) for
//! a backend whose KV-event stream is live and scored precisely, with `true` for every backend.
//! `true` also counts this scorer's token estimates (a prompt's tokens, the tokens an
//! approximate candidate holds, which the `prefill-cost-scorer` prices) at the candidates' mean
//! figure, so they count real tokens, on the scale of precise candidates' and of that scorer's
//! `smoothing`.
//!
//! Where the workload tokenizes at 1.17 characters per token the assumed 4 makes each record
//! 3.4 × its cache, and the router never sees an eviction. Measured, it does (routers on the
//! simulator read 1.17–1.19). Approximate candidates still keep the assumed figure by default:
//! on the simulator at 73 % pressure (Zipf, medians of 3) measuring took the approximate
//! default's TTFT p90 from 0.107 s to 0.120 s (0.128 s with placed weight 0) — the oversized
//! record keeps its thrash gate open and placement by traffic going — while precise went from
//! 0.121 s to 0.094 s (`bench/results/sim-26-measured2-zipf-median3-2026-12-07.md`; README,
//! Performance, ninth round).
//!
//! With every candidate scored precisely, the placed weight is `precise_room_placed_weight`
//! (0): together with the measured record, that balanced two real vLLM servers on Zipf to 52 %
//! of the prompt tokens on both seeds in short runs (56 / 59 % before) at 0.993 / 1.000 of the
//! hit bound, and to 56 / 54 % in long runs (57 / 56 % before) at the same hit rate, with the
//! simulator's precise Zipf TTFT p90 at 0.117 s against 0.121 s (README, ninth round).
//!
//! # Several routers in front of one fleet
//!
//! Each of `N` replicas of this router behind a round-robin front sees `1/N` of the fleet's
//! traffic, so a threshold counted in this router's own traffic is reached `N` times less often
//! than one router reaches it: the hot gate's and replication's `replicate_min_prompts · P`,
//! bounded load's `fair ≥ replicate_min_prompts · P` and the thrash count's
//! [`THRASH_MIN_PROMPTS`]. Each is multiplied by the candidates' mean **traffic share**
//! (this router's share of the requests each backend finished, from the backend's own
//! counter: [`crate::endpoints::chars_per_token`]; 1 until measured or where the engine has no
//! such counter), while the thresholds relative to this router's own mean work (`room_hot_share`,
//! `replicate_share`) need nothing. On two real vLLM servers behind two replicas (short Zipf
//! runs) the busiest server took 57 / 59 % of the prompt tokens against one router's 52 / 52 %:
//! half-rate gates, and a characters-per-token figure measured at half the truth (0.50–0.67
//! against 1.18), which the share also corrects (README, Performance, eleventh round).
//!
//! # Precise scoring (KV events)
//!
//! When a candidate's KV-event stream is `live` (see [`crate::kv_events`]) and the request has
//! token ids (`RequestView.tokens`), the candidate is scored by what its cache truly holds
//! instead: the prompt's tokens are chain-hashed at the block size its events report
//! ([`crate::kv_events::chain`]; the LoRA adapter name mixed in when the requested model is an
//! adapter on that backend, the `cache_salt` into the first block), and with `m` of the `n`
//! full blocks held consecutively from the first
//!
//! ```text
//! ratio  = m / n
//! length = min(1, m · block_size · chars_per_token / long_match_chars)
//! ```
//!
//! in the same formula as above, so precise and approximate candidates compare on one scale
//! in a mixed fleet (the approximate index keeps recording every pick, so a backend whose
//! stream falls silent or unsure is scored by it at once). Blocks just sent to a backend count
//! as held there for the scorer's `inflight_ms`, so a burst of requests with the same new prefix
//! is not sprayed across the fleet before the first event arrives.
//!
//! What the events cannot say is where a prefix that *nobody* holds any more should go. Placed
//! by the room term alone (the router's fill, which the truth no longer backs), every evicted
//! group moved to another backend, until each cache held a random mix of groups: in the
//! loadgen shared-prefix run at 73 % cache pressure precise routing fell to a 0.65 hit rate
//! against the approximate index's 0.86, which keeps sending a group where it sent it before.
//! So a live candidate also gets credit for the router's memory of sending it this prefix
//! (`recalled`, its approximate-index ratio), in proportion to what the truth leaves open,
//! before the room term:
//!
//! ```text
//! score += memory_weight · (1 − best) · recalled        (live candidates; best as above)
//! ```
//!
//! A backend truly holding the prefix still wins; among backends that hold nothing of it, the
//! one the router last sent it to does (same run: 0.87).
//!
//! One scorer rather than a second `precise-prefix-cache-scorer`: the choice between the two
//! sources is per candidate (mixed fleets), and two scorers in one profile would each need the
//! other's answer to stay on one scale; `precise = false` turns the precise source off.

mod hot;
pub mod index;
mod lru;

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::Deserialize;

use crate::clock::now_ms;
use crate::config_error::ConfigError;
use crate::endpoints::sent_work::Recent;
use crate::endpoints::{Backend, BackendState, Candidate};
use crate::kv_events::chain::prompt_chain;
use crate::kv_events::store::Status;
use crate::prompt::{RequestView, RoleScope};
use crate::scheduling::framework::{lower_is_better, CycleState, Plugin, Scorer, Signal};
use crate::scheduling::plugins::{identity, parameters};
use crate::telemetry as t;
use hot::PrefixTraffic;
use index::{block_hashes, PrefixIndex};

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
enum Capacity {
    Blocks(u64),
    Auto(AutoWord),
}

#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum AutoWord {
    Auto,
}

/// `measure_chars_per_token`: `true`, `false`, or `"auto"` (measured for a backend with a live
/// KV-event stream; see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(untagged)]
enum Measure {
    Always(bool),
    Auto(AutoWord),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Params {
    block_size: usize,
    capacity: Capacity,
    chars_per_token: f64,
    /// Size a backend's record by its measured characters per token
    /// ([`crate::endpoints::chars_per_token`]) once known instead of `chars_per_token`: `"auto"`
    /// while its KV-event stream is live, `true` always (and count the token estimates at the
    /// candidates' mean figure), `false` never (module doc).
    measure_chars_per_token: Measure,
    fallback_capacity: u64,
    length_weight: f64,
    long_match_chars: usize,
    max_blocks: usize,
    room_weight: f64,
    /// Score candidates with a live KV-event stream by the blocks they report.
    precise: bool,
    /// Most token blocks of a prompt matched precisely.
    precise_max_blocks: usize,
    /// How long blocks sent to a backend count as held before its events confirm them.
    inflight_ms: u64,
    /// Weight of the approximate index's memory for live candidates (see the module doc).
    memory_weight: f64,
    /// Share of the room term judged by recent traffic rather than fill (see the module doc)…
    room_work_weight: f64,
    /// …when every candidate is scored precisely (its live KV-event stream tells its
    /// evictions, so the thrash gate works).
    precise_room_work_weight: f64,
    /// Share of recent prompt tokens whose prefix came back after a cache dropped it at which
    /// placing by traffic stops (module doc).
    room_thrash_limit: f64,
    /// How much each new prefix a backend was given lately adds to its traffic, in average
    /// prefixes' traffic (module doc)…
    room_placed_weight: f64,
    /// …when every candidate is scored precisely.
    precise_room_placed_weight: f64,
    /// How far over the candidates' mean traffic a candidate may be before placing by
    /// traffic moves new prefixes off it (module doc).
    room_work_slack: f64,
    /// A prefix whose recent traffic is at least this share of the candidates' mean recent
    /// work is hot; only its traffic moves new prefixes off a backend (module doc).
    room_hot_share: f64,
    /// Hot-prefix replication: a prefix whose recent traffic per holder is at least this share
    /// of a backend's fair share may be given to one more backend (0: never; module doc).
    replicate_share: f64,
    /// …once it has brought at least this many prompts' worth of tokens lately…
    replicate_min_prompts: f64,
    /// …and while every holder's recent work exceeds its fair share by this fraction.
    replicate_overload: f64,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            block_size: 64,
            capacity: Capacity::Auto(AutoWord::Auto),
            chars_per_token: RequestView::CHARS_PER_TOKEN,
            measure_chars_per_token: Measure::Auto(AutoWord::Auto),
            // 500k tokens × 4 chars ÷ 64 chars: an 8B model's cache on one 80 GB GPU.
            fallback_capacity: 31_250,
            length_weight: 0.0,
            long_match_chars: 32_768,
            max_blocks: 4_096,
            room_weight: 1.0,
            precise: true,
            precise_max_blocks: 8_192,
            inflight_ms: 2_000,
            memory_weight: 1.0,
            room_work_weight: 1.0,
            precise_room_work_weight: 1.0,
            room_thrash_limit: 0.02,
            room_placed_weight: 2.0,
            precise_room_placed_weight: 0.0,
            room_work_slack: 0.0,
            room_hot_share: 0.5,
            replicate_share: 0.0,
            replicate_min_prompts: 4.0,
            replicate_overload: 0.1,
        }
    }
}

/// How much of a request's prompt one candidate holds (see [`PrefixCacheScorer::held`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Held {
    /// Full blocks held consecutively from the first…
    pub blocks: usize,
    /// …of this many full blocks in the prompt (0: nothing to match).
    pub of: usize,
    /// The tokens those blocks hold: `block_size` tokens each when precise; `block_size`
    /// characters ÷ the characters per token (the candidates' measured mean, else
    /// `chars_per_token`) each when approximate.
    pub tokens: f64,
    /// Judged by the backend's KV events rather than the approximate index.
    pub precise: bool,
    /// The approximate index's ratio for this backend (blocks the router recorded sending it,
    /// consecutive from the start, ÷ the prompt's blocks), whatever the source above.
    pub recalled: f64,
    /// This decision names this backend a holder of what the best holder holds (see
    /// [`Grant`]): `blocks` and `tokens` are the holders', `cached` what it holds now.
    pub granted: Option<Grant>,
    /// The tokens it holds now when `granted` (unused otherwise: read
    /// [`Held::cached_tokens`]).
    pub cached: f64,
}

impl Held {
    /// `blocks ÷ of`: the share of the prompt's full blocks held (0 when it has none).
    pub fn ratio(&self) -> f64 {
        if self.of == 0 {
            0.0
        } else {
            self.blocks as f64 / self.of as f64
        }
    }

    /// Prompt tokens this backend holds now: what its prefill is spared.
    pub fn cached_tokens(&self) -> f64 {
        if self.granted.is_some() {
            self.cached
        } else {
            self.tokens
        }
    }
}

/// Why a decision scores a backend as holding what the prompt's best holder holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grant {
    /// It becomes the hot prefix's new replica.
    Replica,
    /// It holds part of the prefix (at least half of what the holders hold) and takes the
    /// request because every holder is over its load bound.
    Overflow,
}

/// Data kept for one request, across all of its decisions.
struct Scratch {
    /// The prompt's block hashes, computed once per request.
    hashes: Vec<u64>,
    /// (backend id, matched blocks) for each candidate of the last scoring.
    matched: Vec<(usize, usize)>,
    /// What each candidate of the last scoring holds (same order as `matched`)…
    held: Vec<Held>,
    /// …in this decision of the request ([`CycleState::decision`]).
    decision: u64,
    /// Match passes made for the request: one per decision when the profile's scorers share
    /// this matcher's answer.
    passes: u32,
    /// Token-block chains by (block size, LoRA adapter), computed once per request.
    chains: Vec<Chain>,
    /// The share of the prompt lost to an eviction, when it came back after one (0 when it
    /// did not): the blocks past the longest match, when the next of them is one a candidate
    /// holding that match evicted lately ([`PrefixIndex::returned`]), or past what a live
    /// backend still holds of what it was sent ([`evicted_precisely`]).
    returned: f64,
    /// (backend id, chain index, blocks held) for each candidate scored precisely.
    precise: Vec<(usize, usize, usize)>,
    /// The candidates' mean recent work when last scored (what makes a prefix hot).
    fair: f64,
}

struct Chain {
    block_size: usize,
    lora: Option<String>,
    hashes: Vec<u64>,
}

/// The LoRA adapter the request names on this backend: its model entry has a `parent`.
fn lora_of<'a>(request: &'a RequestView, candidate: &Candidate<'_>) -> Option<&'a str> {
    let model = request.model.as_deref()?;
    candidate
        .state
        .models
        .iter()
        .find(|m| m.id == model)
        .filter(|m| m.object.get("parent").is_some_and(|p| p.is_string()))
        .map(|_| model)
}

pub struct PrefixCacheScorer {
    name: Arc<str>,
    params: Params,
    index: PrefixIndex,
    decisions: AtomicU64,
    /// Recent traffic per prefix, for hot-prefix replication.
    traffic: PrefixTraffic,
    /// Recent prompt tokens routed, and those of them that came back after a cache dropped
    /// them ([`PrefixIndex::returned`]: a returning prompt's tokens times the share of it
    /// lost): the fleet's thrash.
    routed: Recent,
    /// Recent prompts routed (the count of `routed`'s requests).
    routed_prompts: Recent,
    returned: Recent,
    /// The candidates' mean measured characters per token at the last match (`f64` bits; 0
    /// until one is measured): the scale of this scorer's token estimates.
    fleet_chars_per_token: AtomicU64,
    /// The candidates' mean measured traffic share at the last match (`f64` bits; 0 until one
    /// is measured): the scale of this scorer's absolute traffic thresholds.
    fleet_share: AtomicU64,
}

impl PrefixCacheScorer {
    pub const TYPE: &'static str = "prefix-cache-scorer";

    pub fn from_parameters(name: &str, table: &toml::Table) -> Result<Self, ConfigError> {
        let params: Params = parameters(name, table)?;
        let field = format!("plugins.{name}.parameters");
        if params.block_size == 0 || params.max_blocks == 0 || params.long_match_chars == 0 {
            return Err(ConfigError::invalid(
                field,
                "block_size, max_blocks and long_match_chars must be > 0",
            ));
        }
        if !(0.0..=1.0).contains(&params.length_weight)
            || !(0.0..=1.0).contains(&params.room_weight)
            || !(0.0..=1.0).contains(&params.memory_weight)
            || !(0.0..=1.0).contains(&params.room_work_weight)
            || !(0.0..=1.0).contains(&params.precise_room_work_weight)
        {
            return Err(ConfigError::invalid(
                field,
                "length_weight, room_weight, memory_weight, room_work_weight and \
                 precise_room_work_weight must be within 0..1",
            ));
        }
        if !(params.chars_per_token > 0.0 && params.chars_per_token.is_finite()) {
            return Err(ConfigError::invalid(field, "chars_per_token must be > 0"));
        }
        if params.precise_max_blocks == 0 || params.inflight_ms == 0 {
            return Err(ConfigError::invalid(
                field,
                "precise_max_blocks and inflight_ms must be > 0",
            ));
        }
        // NaN is neither ≥ 0 nor finite, so these refuse it.
        let non_negative = |x: f64| x.is_finite() && x >= 0.0;
        if !non_negative(params.room_placed_weight)
            || !non_negative(params.precise_room_placed_weight)
        {
            return Err(ConfigError::invalid(
                field,
                "room_placed_weight and precise_room_placed_weight must be ≥ 0",
            ));
        }
        if !non_negative(params.room_work_slack) || !non_negative(params.room_hot_share) {
            return Err(ConfigError::invalid(
                field,
                "room_work_slack and room_hot_share must be ≥ 0",
            ));
        }
        if !(params.room_thrash_limit > 0.0 && params.room_thrash_limit.is_finite()) {
            return Err(ConfigError::invalid(field, "room_thrash_limit must be > 0"));
        }
        if !(0.0..=1.0).contains(&params.replicate_share)
            || !non_negative(params.replicate_min_prompts)
            || !non_negative(params.replicate_overload)
        {
            return Err(ConfigError::invalid(
                field,
                "replicate_share must be within 0..1, replicate_min_prompts and \
                 replicate_overload ≥ 0",
            ));
        }
        if params.capacity == Capacity::Blocks(0) {
            return Err(ConfigError::invalid(
                field,
                "capacity must be > 0 or \"auto\"",
            ));
        }
        Ok(PrefixCacheScorer {
            name: name.into(),
            params,
            index: PrefixIndex::new(),
            decisions: AtomicU64::new(0),
            traffic: PrefixTraffic::default(),
            routed: Recent::default(),
            routed_prompts: Recent::default(),
            returned: Recent::default(),
            fleet_chars_per_token: AtomicU64::new(0),
            fleet_share: AtomicU64::new(0),
        })
    }

    /// Blocks the index may hold for `backend`. With `"auto"`, a scrape that lacks the cache
    /// geometry keeps the capacity already in use (one missing series must not resize, let
    /// alone wipe, the backend's records); the fallback applies only before any is known.
    fn capacity(&self, backend: &Backend, state: &BackendState) -> u64 {
        match self.params.capacity {
            Capacity::Blocks(n) => n,
            Capacity::Auto(_) => state
                .metrics
                .as_ref()
                .and_then(|(m, _)| m.kv_capacity_tokens())
                .map(|tokens| {
                    let per_token = state
                        .chars_per_token
                        .ratio()
                        .filter(|_| self.measures(backend))
                        .unwrap_or(self.params.chars_per_token);
                    ((tokens as f64 * per_token) / self.params.block_size as f64).ceil() as u64
                })
                .or_else(|| self.index.capacity(backend.id, state.epoch))
                .unwrap_or(self.params.fallback_capacity)
                .max(1),
        }
    }

    /// Characters per token of this scorer's token estimates (a prompt's tokens, the tokens a
    /// candidate holds): the candidates' mean measured figure at the last match, else
    /// `chars_per_token`.
    fn per_token(&self) -> f64 {
        let measured = f64::from_bits(self.fleet_chars_per_token.load(Ordering::Relaxed));
        let on = self.params.measure_chars_per_token == Measure::Always(true);
        if on && measured > 0.0 && measured.is_finite() {
            measured
        } else {
            self.params.chars_per_token
        }
    }

    /// Is `backend`'s record sized by its measured characters per token (once measured)?
    /// Always or never as set; with `"auto"`, while its KV-event stream is live and scored.
    fn measures(&self, backend: &Backend) -> bool {
        match self.params.measure_chars_per_token {
            Measure::Always(on) => on,
            Measure::Auto(_) => {
                self.params.precise && backend.kv().status(now_ms()) == Status::Live
            }
        }
    }

    /// This router's share of the fleet's traffic (0–1]: the candidates' mean measured share
    /// at the last match, else 1. Thresholds counted in this router's own recent traffic are
    /// multiplied by it (module doc, several routers).
    fn traffic_scale(&self) -> f64 {
        let share = f64::from_bits(self.fleet_share.load(Ordering::Relaxed));
        if share > 0.0 && share <= 1.0 {
            share
        } else {
            1.0
        }
    }

    /// Note the candidates' mean measured traffic share, if any has one.
    fn note_fleet_share(&self, candidates: &[Candidate<'_>]) {
        store_mean(
            &self.fleet_share,
            candidates
                .iter()
                .filter_map(|c| c.state.chars_per_token.share()),
        );
    }

    /// Note the candidates' mean measured characters per token, if any has one (only
    /// `measure_chars_per_token = true` counts estimates at it).
    fn note_fleet_per_token(&self, candidates: &[Candidate<'_>]) {
        if self.params.measure_chars_per_token != Measure::Always(true) {
            return;
        }
        store_mean(
            &self.fleet_chars_per_token,
            candidates
                .iter()
                .filter_map(|c| c.state.chars_per_token.ratio()),
        );
    }

    fn hashes(&self, request: &RequestView) -> Vec<u64> {
        let Some(text) = request.routing_text.as_deref() else {
            return Vec::new();
        };
        let mut hashes = Vec::with_capacity(text.len() / self.params.block_size + 1);
        block_hashes(
            request.model.as_deref(),
            text,
            self.params.block_size,
            self.params.max_blocks,
            &mut hashes,
        );
        hashes
    }

    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// The index into `chains` of the request's chain at `block_size` for `lora`.
    fn chain(
        &self,
        request: &RequestView,
        chains: &mut Vec<Chain>,
        block_size: usize,
        lora: Option<&str>,
    ) -> Option<usize> {
        let tokens = request.tokens.as_deref()?;
        if let Some(i) = chains
            .iter()
            .position(|c| c.block_size == block_size && c.lora.as_deref() == lora)
        {
            return Some(i);
        }
        let mut hashes = Vec::with_capacity(
            (tokens.ids.len() / block_size.max(1)).min(self.params.precise_max_blocks),
        );
        prompt_chain(
            &tokens.ids,
            block_size,
            lora,
            tokens.cache_salt.as_deref(),
            self.params.precise_max_blocks,
            &mut hashes,
        );
        chains.push(Chain {
            block_size,
            lora: lora.map(str::to_owned),
            hashes,
        });
        Some(chains.len() - 1)
    }

    /// How much of `request`'s prompt each candidate holds, consecutively from the start:
    /// by its reported blocks when its KV-event stream is live, else by the approximate index.
    /// Leaves the request's hashes, matches and this answer in `state` for
    /// [`Plugin::after_pick`], for the next decision of the same request, and for the other
    /// scorers of this decision: asked again within one decision (a profile's
    /// `prefill-cost-scorer` linked to this scorer asks after or before it scores) it answers
    /// from `state` without matching again.
    pub fn held<'s>(
        &self,
        request: &RequestView,
        state: &'s mut CycleState,
        candidates: &[Candidate<'_>],
    ) -> Cow<'s, [Held]> {
        if !self.answered(state, candidates) {
            self.match_prompt(request, state, candidates);
        }
        match state.get::<Scratch>(&self.name) {
            Some(scratch) if scratch.held.len() == candidates.len() => Cow::Borrowed(&scratch.held),
            _ => Cow::Owned(vec![Held::default(); candidates.len()]),
        }
    }

    /// Has this decision's answer for these candidates been left in `state` already?
    fn answered(&self, state: &CycleState, candidates: &[Candidate<'_>]) -> bool {
        let decision = state.decision();
        decision != 0
            && state.get::<Scratch>(&self.name).is_some_and(|s| {
                s.decision == decision
                    && s.matched.len() == candidates.len()
                    && s.matched
                        .iter()
                        .zip(candidates)
                        .all(|((id, _), c)| *id == c.backend.id)
            })
    }

    /// The match passes made for the request whose state this is (0: this matcher never
    /// matched it).
    pub fn match_passes(&self, state: &CycleState) -> u32 {
        state.get::<Scratch>(&self.name).map_or(0, |s| s.passes)
    }

    /// Match the prompt against every candidate and leave the answer in `state` (see
    /// [`PrefixCacheScorer::held`]); the candidates are counted in
    /// `inferlb_prefix_precise_candidates_total` here, once per decision.
    fn match_prompt(
        &self,
        request: &RequestView,
        state: &mut CycleState,
        candidates: &[Candidate<'_>],
    ) {
        if request.routing_text.is_none() && request.tokens.is_none() {
            return;
        }
        let (hashes, mut chains, passes) = match state.take::<Scratch>(&self.name) {
            Some(scratch) => (scratch.hashes, scratch.chains, scratch.passes),
            None => (self.hashes(request), Vec::new(), 0),
        };
        let mut precise = Vec::new();
        let exact = self.precise_matches(request, candidates, &mut chains, &mut precise);
        let ids: Vec<(usize, u64)> = candidates
            .iter()
            .map(|c| (c.backend.id, c.state.epoch))
            .collect();
        let mut matched = vec![0usize; candidates.len()];
        self.index.match_lengths(&hashes, &ids, &mut matched);
        let n = hashes.len();
        self.note_fleet_per_token(candidates);
        self.note_fleet_share(candidates);
        let chars_per_token = self.per_token();
        let mut out = vec![Held::default(); candidates.len()];
        for ((slot, m), exact) in out.iter_mut().zip(&matched).zip(&exact) {
            let recalled = if n > 0 { *m as f64 / n as f64 } else { 0.0 };
            *slot = match exact {
                Some((held, blocks, bs)) => Held {
                    blocks: *held,
                    of: *blocks,
                    tokens: held.saturating_mul(*bs) as f64,
                    precise: true,
                    recalled,
                    ..Held::default()
                },
                None if n > 0 => Held {
                    blocks: *m,
                    of: n,
                    tokens: m.saturating_mul(self.params.block_size) as f64 / chars_per_token,
                    precise: false,
                    recalled,
                    ..Held::default()
                },
                None => Held::default(),
            };
        }
        let now = now_ms();
        // Each candidate's recent work, read once for the decision: the bounded load and
        // replication judge by it, and its mean makes a prefix hot (`Scratch::fair`).
        let work: Vec<f64> = candidates
            .iter()
            .map(|c| c.backend.work().recent_tokens(now))
            .collect();
        let (fair, _) = fair_and_bound(&work, 0.0);
        let returned = self
            .returned_prefix(&hashes, &ids, &matched)
            .max(evicted_precisely(&out, candidates, now));
        self.replicate(request, &work, now, &hashes, &matched, &mut out);
        if !precise.is_empty() {
            t::handles::precise_candidates(true).increment(precise.len() as u64);
        }
        let approximate = candidates.len().saturating_sub(precise.len());
        if approximate > 0 && n > 0 {
            t::handles::precise_candidates(false).increment(approximate as u64);
        }
        let matched = ids.iter().map(|(id, _)| *id).zip(matched).collect();
        let decision = state.decision();
        state.put(
            &self.name,
            Scratch {
                hashes,
                matched,
                held: out,
                decision,
                passes: passes.saturating_add(1),
                chains,
                precise,
                returned,
                fair,
            },
        );
    }

    /// Did the prompt's prefix come back after a cache dropped it: is its next block after the
    /// longest match among the candidates one that a candidate holding that match evicted
    /// lately? (A block evicted by one backend while another holds more of the prompt cost
    /// nothing.) Answers the share of the prompt's blocks past that match (0: no return): a
    /// repeated prompt that lost only its own tail while its group's prefix stayed is a small
    /// return, a prefix dropped whole a full one.
    fn returned_prefix(&self, hashes: &[u64], ids: &[(usize, u64)], matched: &[usize]) -> f64 {
        let longest = matched.iter().copied().max().unwrap_or(0);
        if longest >= hashes.len() {
            return 0.0;
        }
        let mut out = vec![false; ids.len()];
        self.index.returned(hashes, ids, matched, &mut out);
        if out.iter().zip(matched).any(|(r, m)| *r && *m == longest) {
            (hashes.len() - longest) as f64 / hashes.len() as f64
        } else {
            0.0
        }
    }

    /// The fleet's recent thrash: the share of recent prompt tokens whose prefix came back
    /// after a cache dropped it; 0 before any traffic and while fewer than
    /// [`THRASH_MIN_PROMPTS`] prompts' worth came back (one or two returns are a rate only
    /// over a long run: on 56 requests a single one is 1.8 %, and closed the gate at 2 %; a
    /// fleet's worth, so this router's traffic share of it).
    pub fn thrash(&self, now: u64) -> f64 {
        let routed = self.routed.get(now);
        let prompts = self.routed_prompts.get(now);
        let returned = self.returned.get(now);
        if routed > 0.0
            && prompts > 0.0
            && returned >= THRASH_MIN_PROMPTS * self.traffic_scale() * routed / prompts
        {
            (returned / routed).clamp(0.0, 1.0)
        } else {
            0.0
        }
    }

    /// Hot-prefix replication and bounded load (see the module doc): when every candidate
    /// holding the most of the prompt carries more than its bound, name another its holder for
    /// this decision: one holding part of the prefix within the bound (`overflow`), else, if
    /// the prefix is hot, a new replica. `work` is each candidate's recent work at `now`,
    /// `matched` the approximate index's blocks of `hashes` per candidate (the prefix's name).
    fn replicate(
        &self,
        request: &RequestView,
        work: &[f64],
        now: u64,
        hashes: &[u64],
        matched: &[usize],
        held: &mut [Held],
    ) {
        let p = &self.params;
        let longest = matched.iter().copied().max().unwrap_or(0);
        if p.replicate_share <= 0.0
            || work.len() < 2
            || longest == 0
            || request.roles == RoleScope::PrefillStep
        {
            return;
        }
        let best = held.iter().map(Held::ratio).fold(0.0, f64::max);
        if best <= 0.0 {
            return;
        }
        let (fair, bound) = fair_and_bound(work, p.replicate_overload);
        if !(fair > 0.0 && fair.is_finite()) {
            return;
        }
        let prompt = request.estimated_prompt_tokens() as f64;
        // The absolute thresholds count the fleet's traffic: this router sees its share.
        let min_traffic = p.replicate_min_prompts * prompt * self.traffic_scale();
        // The prefix's holders hold the most of the prompt; its group adds every candidate
        // holding at least half of that (a copy of the prefix with another tail).
        let full = |h: &Held| h.ratio() >= best;
        let in_group = |h: &Held| h.ratio() > 0.0 && h.ratio() * 2.0 >= best;
        // A holder within the bound takes the request: nothing to do.
        if held.iter().zip(work).any(|(h, w)| full(h) && *w < bound) {
            return;
        }
        let Some(holder) = held.iter().position(full) else {
            return;
        };
        // Bounded load: every holder is over it, a copy within it serves the request and
        // pays only the tail it lacks (once the fleet has carried a few prompts each).
        let least = |keep: &dyn Fn(usize) -> bool| -> Option<usize> {
            let mut pick: Option<usize> = None;
            for i in (0..held.len()).filter(|i| keep(*i)) {
                if pick
                    .is_none_or(|t| work[i] < work[t] || (work[i] == work[t] && fastrand::bool()))
                {
                    pick = Some(i);
                }
            }
            pick
        };
        let copy = least(&|i| in_group(&held[i]) && !full(&held[i]) && work[i] < bound);
        if let Some(copy) = copy {
            if fair >= min_traffic {
                Self::grant(held, holder, copy, Grant::Overflow);
            }
            return;
        }
        // A new copy: where the prefix's group carries too much, the prefix is hot, and a
        // candidate outside the group is within the bound. The prefix whose traffic counts: a
        // recorded depth past what every candidate outside the group holds (the part a new
        // copy adds: a system prompt held everywhere says nothing), at most half the longest
        // match where it can be (a repeated prompt's own blocks would name only itself, not
        // its group).
        let elsewhere = matched
            .iter()
            .zip(held.iter())
            .filter(|(m, h)| !in_group(h) && **m < longest)
            .map(|(m, _)| *m)
            .max()
            .unwrap_or(0);
        let Some(depth) = traffic_depth(elsewhere, longest) else {
            return;
        };
        let traffic = self.traffic.recent(hashes, depth, now);
        let members = held.iter().filter(|h| in_group(h)).count();
        let Some(target) = least(&|i| !in_group(&held[i]) && work[i] < bound) else {
            return;
        };
        if traffic >= min_traffic && traffic >= p.replicate_share * fair * members as f64 {
            Self::grant(held, holder, target, Grant::Replica);
        }
    }

    /// Score `to` as holding what `holder` holds for this decision (it keeps what it holds now
    /// as the tokens it is spared).
    fn grant(held: &mut [Held], holder: usize, to: usize, why: Grant) {
        let holds = held[holder];
        let now_held = held[to];
        held[to] = Held {
            granted: Some(why),
            cached: now_held.tokens,
            recalled: now_held.recalled,
            ..holds
        };
    }

    /// Count the request's prompt tokens in its prefixes' recent traffic (`keys`: its chain
    /// hashes, `held` of them held by `backend`, which took it) and, when the prefix it reuses
    /// (the first half of what was held: the part its group shares) was hot, in the backend's
    /// hot work: the prefix brought at least `room_hot_share` × `fair` (the candidates' mean
    /// recent work) and `replicate_min_prompts` prompts' worth lately (× this router's traffic
    /// share). Returns the tokens.
    fn count_traffic(
        &self,
        request: &RequestView,
        backend: &Backend,
        keys: &[u64],
        held: usize,
        fair: f64,
        now: u64,
    ) -> f64 {
        let tokens = request.estimated_prompt_tokens() as f64;
        if held > 0 {
            let p = &self.params;
            let r = self.traffic.recent(keys, held.div_ceil(2), now);
            let least = p.replicate_min_prompts * tokens * self.traffic_scale();
            if r > 0.0 && r >= p.room_hot_share * fair && r >= least {
                backend.work().note_hot(tokens, now);
            }
        }
        self.traffic.record(keys, tokens, now);
        tokens
    }

    /// The prompt's length in tokens: its token ids when known, else its routing text's
    /// characters ÷ the characters per token (the candidates' measured mean at the last
    /// match, else `chars_per_token`).
    pub fn prompt_tokens(&self, request: &RequestView) -> f64 {
        request.prompt_tokens(self.per_token())
    }

    /// The share of the room term judged by recent traffic: `room_work_weight`
    /// (`precise_room_work_weight` when every candidate was scored precisely) while the
    /// candidates' caches are idle, shrinking to 0 as their mean KV-cache usage reaches 1
    /// (0.5 when no candidate reports it; a usage that is not a number makes it 0) and as the
    /// fleet's thrash nears `room_thrash_limit`.
    fn traffic_share(&self, candidates: &[Candidate<'_>], held: &[Held]) -> f64 {
        let weight = if all_precise(held) {
            self.params.precise_room_work_weight
        } else {
            self.params.room_work_weight
        };
        if weight <= 0.0 {
            return 0.0;
        }
        let (sum, n) = candidates
            .iter()
            .filter_map(|c| c.metrics().and_then(|m| m.kv_usage))
            .fold((0.0, 0usize), |(s, n), k| (s + k.clamp(0.0, 1.0), n + 1));
        let busy = if n == 0 { 0.5 } else { sum / n as f64 };
        let open = (1.0 - self.thrash(now_ms()) / self.params.room_thrash_limit).max(0.0);
        let t = weight * (1.0 - busy) * open;
        if t.is_finite() {
            t
        } else {
            0.0
        }
    }

    /// Score the candidates whose stream is live precisely: `Some((held, blocks, block_size))`.
    fn precise_matches(
        &self,
        request: &RequestView,
        candidates: &[Candidate<'_>],
        chains: &mut Vec<Chain>,
        precise: &mut Vec<(usize, usize, usize)>,
    ) -> Vec<Option<(usize, usize, usize)>> {
        let mut out = vec![None; candidates.len()];
        if !self.params.precise || request.tokens.is_none() {
            return out;
        }
        let now = now_ms();
        for (slot, c) in out.iter_mut().zip(candidates) {
            let kv = c.backend.kv();
            let block_size = kv.block_size();
            if block_size == 0 || kv.status(now) != Status::Live {
                continue;
            }
            let Some(i) = self.chain(request, chains, block_size, lora_of(request, c)) else {
                continue;
            };
            let held = kv.matched(&chains[i].hashes, now);
            *slot = Some((held, chains[i].hashes.len(), block_size));
            precise.push((c.backend.id, i, held));
        }
        out
    }
}

/// The recorded depth (a power of two) whose traffic names the prefix that `longest` blocks
/// hold and no other candidate's `elsewhere` blocks do: the largest within half of `longest`
/// if one is past `elsewhere`, else the largest within `longest`; `None` if none is past it.
fn traffic_depth(elsewhere: usize, longest: usize) -> Option<usize> {
    [longest.div_ceil(2), longest]
        .into_iter()
        .map(hot::recorded_depth)
        .find(|d| *d > elsewhere)
}

/// Does a live backend's own report say the prompt's prefix came back after its cache dropped
/// it: the router sent at least half of the prompt's blocks to a backend scored precisely
/// (`recalled`) whose events reported an eviction within the last minute, and no candidate
/// now holds within half of that? The ghost cannot say so when the router's record of a cache
/// is larger than the cache (its capacity is estimated in characters), and the events can. A
/// cache that evicted nothing lately cannot have dropped it: the blocks are late (a request
/// still queued past the in-flight time) or were never named alike (on two real vLLM servers
/// with no eviction at all, 1–2 such prompts in 56 closed the thrash gate). Answers the share
/// of the prompt lost (what was sent there less what is held anywhere), 0 for no return.
fn evicted_precisely(held: &[Held], candidates: &[Candidate<'_>], now: u64) -> f64 {
    let sent = held
        .iter()
        .zip(candidates)
        .filter(|(h, c)| {
            h.precise
                && c.backend
                    .kv()
                    .evicted_within(now, crate::endpoints::sent_work::RECENT_HALF_LIFE_MS)
        })
        .map(|(h, _)| h.recalled)
        .fold(0.0, f64::max);
    let holds = held.iter().map(Held::ratio).fold(0.0, f64::max);
    if sent >= 0.5 && sent - holds >= 0.5 {
        (sent - holds).min(1.0)
    } else {
        0.0
    }
}

/// The candidates' mean load (their fair share) and `(1 + slack)` times it, the bound past
/// which one carries too much (0 and 0 for no candidates).
fn fair_and_bound(load: &[f64], slack: f64) -> (f64, f64) {
    let fair = load.iter().sum::<f64>() / load.len().max(1) as f64;
    (fair, (1.0 + slack) * fair)
}

/// Prompts' worth of returns (at the mean prompt's length) below which the fleet is not
/// counted as thrashing.
const THRASH_MIN_PROMPTS: f64 = 4.0;

/// Store the mean of `values` in `slot` (`f64` bits); leave it as it was when there are none.
fn store_mean(slot: &AtomicU64, values: impl Iterator<Item = f64>) {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if n > 0 {
        slot.store((sum / n as f64).to_bits(), Ordering::Relaxed);
    }
}

/// How much less the holders over their load bound score than the copy taking their request.
const OVERFLOW_YIELD: f64 = 0.01;

/// Was every candidate of a decision scored from its live KV events (and is there one)? The
/// room term then takes its `precise_*` weights.
fn all_precise(held: &[Held]) -> bool {
    !held.is_empty() && held.iter().all(|h| h.precise)
}

/// Was the request's prefix held nowhere when it was last scored (a new prefix placed)? A
/// replica is only ever named beside a holder, so a decision with one is never new.
fn is_new_prefix(scratch: &Scratch) -> bool {
    scratch.held.iter().all(|h| h.blocks == 0)
}

impl Plugin for PrefixCacheScorer {
    identity!();

    fn backend_removed(&self, backend: &Backend) {
        self.index.purge(backend.id);
        self.refresh_metrics();
    }

    fn refresh_metrics(&self) {
        metrics::gauge!(t::PREFIX_INDEX_BLOCKS).set(self.index.blocks() as f64);
        metrics::gauge!(t::PREFIX_THRASH).set(self.thrash(now_ms()));
    }

    fn after_pick(&self, request: &RequestView, state: &CycleState, backend: &Backend) {
        // A request handed a slot while it waited may never have been scored.
        let computed;
        let (hashes, matched) = match state.get::<Scratch>(&self.name) {
            Some(scratch) => (
                &scratch.hashes,
                scratch
                    .matched
                    .iter()
                    .find(|(id, _)| *id == backend.id)
                    .map_or(0, |(_, m)| *m),
            ),
            None => {
                computed = self.hashes(request);
                (&computed, 0)
            }
        };
        // One clock read for everything recorded about this pick.
        let now = now_ms();
        let mut new_prefix = false;
        let mut returned = 0.0;
        let mut fair = 0.0;
        if let Some(scratch) = state.get::<Scratch>(&self.name) {
            new_prefix = is_new_prefix(scratch);
            returned = scratch.returned;
            fair = scratch.fair;
            let picked = scratch
                .matched
                .iter()
                .zip(&scratch.held)
                .find(|((id, _), _)| *id == backend.id)
                .map(|(_, h)| *h);
            match picked.and_then(|h| h.granted) {
                Some(Grant::Replica) => metrics::counter!(t::PREFIX_REPLICAS).increment(1),
                Some(Grant::Overflow) => metrics::counter!(t::PREFIX_OVERFLOWS).increment(1),
                None => {}
            }
            if let Some((_, chain, held)) =
                scratch.precise.iter().find(|(id, _, _)| *id == backend.id)
            {
                if let Some(chain) = scratch.chains.get(*chain) {
                    backend
                        .kv()
                        .note_sent(&chain.hashes, *held, now, self.params.inflight_ms);
                }
            }
        }
        if hashes.is_empty() {
            return;
        }
        // Once per request: a P/D prefill step is the same request's traffic again.
        if request.roles != RoleScope::PrefillStep {
            let tokens = self.count_traffic(request, backend, hashes, matched, fair, now);
            self.routed.add(tokens, now);
            self.routed_prompts.add(1.0, now);
            if returned > 0.0 {
                self.returned.add(tokens * returned, now);
                metrics::counter!(t::PREFIX_RETURNS).increment(1);
            }
        }
        if new_prefix {
            backend.work().note_placed(now);
        }
        t::handles::prefix_match_ratio().record(matched as f64 / hashes.len() as f64);
        crate::scheduling::profile::decisions::note_prefix(matched, hashes.len());
        let state = backend.state();
        self.index.record(
            backend.id,
            state.epoch,
            self.capacity(backend, &state),
            hashes,
        );
        if self.decisions.fetch_add(1, Ordering::Relaxed) % 64 == 0 {
            metrics::gauge!(t::PREFIX_INDEX_BLOCKS).set(self.index.blocks() as f64);
            metrics::gauge!(t::PREFIX_THRASH).set(self.thrash(now));
        }
    }
}

impl Scorer for PrefixCacheScorer {
    fn consumes(&self) -> &'static [Signal] {
        // The geometry sizes the index only when `capacity = "auto"`.
        match self.params.capacity {
            Capacity::Auto(_) => &[Signal::CacheConfig],
            Capacity::Blocks(_) => &[],
        }
    }

    fn score(
        &self,
        request: &RequestView,
        state: &mut CycleState,
        candidates: &[Candidate<'_>],
        scores: &mut [f64],
    ) {
        scores.iter_mut().for_each(|s| *s = 0.0);
        let held = self.held(request, state, candidates);
        let w = self.params.length_weight;
        let per_token = self.per_token();
        let mut any = false;
        for (slot, h) in scores.iter_mut().zip(held.iter()) {
            if h.of == 0 {
                continue;
            }
            any = true;
            let chars = if h.precise {
                h.tokens * per_token
            } else {
                h.blocks.saturating_mul(self.params.block_size) as f64
            };
            let ratio = h.ratio();
            let length = (chars / self.params.long_match_chars as f64).min(1.0);
            *slot = (1.0 - w) * ratio + w * length;
        }
        if any {
            let best = scores.iter().copied().fold(0.0, f64::max);
            if self.params.memory_weight > 0.0 && best < 1.0 {
                let open = self.params.memory_weight * (1.0 - best);
                for (slot, h) in scores.iter_mut().zip(held.iter()) {
                    if h.precise {
                        *slot = (*slot + open * h.recalled).min(1.0);
                    }
                }
            }
            let best = scores.iter().copied().fold(0.0, f64::max);
            if self.params.room_weight > 0.0 && best < 1.0 {
                let ids: Vec<(usize, u64)> = candidates
                    .iter()
                    .map(|c| (c.backend.id, c.state.epoch))
                    .collect();
                let mut fill = vec![0.0; candidates.len()];
                self.index.fill(&ids, &mut fill);
                let spread = self.params.room_weight * (1.0 - best);
                let mut room = vec![0.0; candidates.len()];
                lower_is_better(fill.iter().map(|f| Some(*f)), &mut room);
                let t = self.traffic_share(candidates, &held);
                if t > 0.0 {
                    let now = now_ms();
                    // Recent traffic says what the prefixes a backend has held for a while
                    // bring; the prefixes it was just given have brought next to nothing
                    // yet. Each of those counts as much as the average prefix brings.
                    let placed: Vec<f64> = candidates
                        .iter()
                        .map(|c| c.backend.work().recent_placed(now))
                        .collect();
                    let work: Vec<f64> = candidates
                        .iter()
                        .map(|c| c.backend.work().recent_tokens(now))
                        .collect();
                    let per_prefix = work.iter().sum::<f64>() / placed.iter().sum::<f64>().max(1.0);
                    let placed_weight = if all_precise(&held) {
                        self.params.precise_room_placed_weight
                    } else {
                        self.params.room_placed_weight
                    };
                    let load: Vec<f64> = work
                        .iter()
                        .zip(&placed)
                        .map(|(w, p)| w + placed_weight * p * per_prefix)
                        .collect();
                    let (_, bound) = fair_and_bound(&load, self.params.room_work_slack);
                    // Only hot prefixes' traffic moves a new prefix: a backend's excess over
                    // the bound, up to what its hot prefixes brought. Spread over many
                    // prefixes, an excess is noise or traffic still to come, which fill
                    // places as well.
                    let excess: Vec<f64> = load
                        .iter()
                        .zip(candidates)
                        .map(|(l, c)| (l - bound).min(c.backend.work().recent_hot(now)).max(0.0))
                        .collect();
                    // Nobody over: traffic says nothing fill does not, and blending in a tie
                    // would only wash out fill's ranking.
                    if excess.iter().any(|e| *e > 0.0) {
                        let mut by_work = vec![0.0; candidates.len()];
                        lower_is_better(excess.iter().map(|e| Some(*e)), &mut by_work);
                        for (room, w) in room.iter_mut().zip(&by_work) {
                            *room = (1.0 - t) * *room + t * w;
                        }
                    }
                }
                for (slot, room) in scores.iter_mut().zip(&room) {
                    *slot = (*slot + spread * room).min(1.0);
                }
            }
            // A hot prefix's new replica, or the copy taking an over-bound holder's request,
            // ranks with the holders' best, whatever room they had: it is the holder this
            // decision adds.
            if held.iter().any(|h| h.granted.is_some()) {
                let top = scores.iter().copied().fold(0.0, f64::max);
                let overflow = held.iter().any(|h| h.granted == Some(Grant::Overflow));
                for (slot, h) in scores.iter_mut().zip(held.iter()) {
                    if h.granted.is_some() {
                        *slot = top;
                    } else if overflow && *slot >= top {
                        // The holders over their bound yield a tie to the copy (a real
                        // difference in the other scorers still decides).
                        *slot = top - OVERFLOW_YIELD;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
