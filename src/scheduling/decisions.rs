//! The last scheduling decisions, kept for `/admin/decisions`, the status page (`/admin`) and
//! the `x-inferlb-explain` response header: every candidate's per-scorer scores, the total and
//! the winner.
//!
//! Recording must cost the request path almost nothing, so the ring is *watched on demand*:
//! reading it (`/admin/decisions`, which the status page polls) arms it for [`ARMED_FOR`], and
//! while it is not armed a decision costs one atomic load and a clock read. A request that asked
//! for an explanation is captured whatever the ring's state (`admin.decisions_always` records
//! every decision). The ring is bounded (`admin.decisions`, default 64) and keeps no prompt
//! text: only its length in bytes and an XXH3-64 hash.
//!
//! Per-request facts the front door reports (the explain header, the access log: decisions
//! made, prefix blocks matched) travel in a tokio task-local set around the request, so the
//! scheduling and forwarding layers need no new parameters.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;

use crate::endpoints::Candidate;
use crate::prompt::RequestView;

/// How long one read of the ring keeps it recording.
pub const ARMED_FOR: Duration = Duration::from_secs(600);
/// At most this many candidates are kept per decision (the winner always among them); the rest
/// are counted in `candidates_omitted`.
pub const MAX_CANDIDATES: usize = 32;

/// One decision as the status page and `/admin/decisions` show it.
#[derive(Debug, Clone, Serialize)]
pub struct DecisionRecord {
    /// Increases by one per recorded decision.
    pub seq: u64,
    pub unix_ms: u64,
    pub profile: String,
    /// The requested model (at most 128 bytes of it).
    pub model: Option<String>,
    /// Length of the routing text in bytes (no text is kept).
    pub prompt_bytes: usize,
    /// XXH3-64 of the routing text, hex: equal prompts have equal hashes.
    pub prompt_hash: Option<String>,
    /// Number of prompt token ids the scheduler saw (`None`: routed without tokens).
    pub prompt_tokens: Option<usize>,
    /// XXH3-64 of the token ids (little-endian u32), hex: equal ids have equal hashes.
    pub prompt_tokens_hash: Option<String>,
    /// Scorer instance names and weights, in the order of each candidate's `scores`.
    pub scorers: Vec<ScorerWeight>,
    /// Candidates left after the filters, best total first.
    pub candidates: Vec<CandidateScores>,
    /// Candidates beyond [`MAX_CANDIDATES`], not listed.
    pub candidates_omitted: usize,
    /// The winner's backend URL.
    pub winner: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ScorerWeight {
    pub name: String,
    pub weight: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct CandidateScores {
    pub backend: String,
    pub id: usize,
    /// Σ weight × clamp(score, 0, 1).
    pub total: f64,
    /// Each scorer's raw score, in the order of [`DecisionRecord::scorers`].
    pub scores: Vec<f64>,
    pub picked: bool,
}

/// The bounded ring of recent decisions.
pub struct DecisionLog {
    capacity: usize,
    always: bool,
    /// The [`crate::clock::now_ms`] until which decisions are recorded.
    armed_until_ms: AtomicU64,
    next_seq: AtomicU64,
    ring: Mutex<VecDeque<Arc<DecisionRecord>>>,
}

impl DecisionLog {
    /// A ring of `capacity` decisions (0: never records into the ring; explanations still
    /// work); `always` records without anyone watching.
    pub fn new(capacity: usize, always: bool) -> Self {
        DecisionLog {
            capacity,
            always,
            armed_until_ms: AtomicU64::new(0),
            next_seq: AtomicU64::new(0),
            ring: Mutex::new(VecDeque::with_capacity(capacity.min(4096))),
        }
    }

    /// Should the decision being made now go into the ring? The cheap check on the hot path.
    pub fn recording(&self) -> bool {
        self.capacity > 0
            && (self.always || self.armed_until_ms.load(Ordering::Relaxed) > crate::clock::now_ms())
    }

    /// The newest `n` decisions, newest first; arms the ring for [`ARMED_FOR`].
    pub fn recent(&self, n: usize) -> Vec<Arc<DecisionRecord>> {
        let until = crate::clock::now_ms().saturating_add(ARMED_FOR.as_millis() as u64);
        self.armed_until_ms.fetch_max(until, Ordering::Relaxed);
        let ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        ring.iter().rev().take(n).cloned().collect()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether the ring records right now and until when (seconds from now; `None` = always).
    pub fn armed_for(&self) -> Option<u64> {
        (!self.always).then(|| {
            self.armed_until_ms
                .load(Ordering::Relaxed)
                .saturating_sub(crate::clock::now_ms())
                / 1000
        })
    }

    /// Build the record of a decision (only called when [`Self::recording`] or the request
    /// asked for an explanation) and keep it where it is wanted.
    #[allow(clippy::too_many_arguments)]
    pub fn record(
        &self,
        into_ring: bool,
        profile: &str,
        request: &RequestView,
        candidates: &[Candidate<'_>],
        scorers: &[(&str, f64)],
        trace: &[Vec<f64>],
        totals: &[f64],
        winner: usize,
    ) {
        let explain = want_explanation();
        if !into_ring && !explain {
            return;
        }
        let mut order: Vec<usize> = (0..candidates.len()).collect();
        // Best total first; among equal totals the winner first.
        order.sort_by(|a, b| {
            totals[*b]
                .total_cmp(&totals[*a])
                .then((*b == winner).cmp(&(*a == winner)))
        });
        order.truncate(MAX_CANDIDATES);
        if !order.contains(&winner) {
            order.pop();
            order.push(winner);
        }
        let listed = order
            .iter()
            .map(|&i| CandidateScores {
                backend: candidates[i].backend.name.clone(),
                id: candidates[i].backend.id,
                total: totals[i],
                scores: trace
                    .iter()
                    .map(|s| s.get(i).copied().unwrap_or(0.0))
                    .collect(),
                picked: i == winner,
            })
            .collect();
        let text = request.routing_text.as_deref();
        let record = Arc::new(DecisionRecord {
            seq: self.next_seq.fetch_add(1, Ordering::Relaxed),
            unix_ms: crate::clock::unix_ms(),
            profile: profile.to_owned(),
            model: request
                .model
                .as_deref()
                .map(|m| truncate(m, 128).to_owned()),
            prompt_bytes: text.map_or(0, str::len),
            prompt_hash: text.map(|t| format!("{:016x}", xxhash_rust::xxh3::xxh3_64(t.as_bytes()))),
            prompt_tokens: request.tokens.as_ref().map(|t| t.ids.len()),
            prompt_tokens_hash: request.tokens.as_ref().map(|t| {
                let bytes: Vec<u8> = t.ids.iter().flat_map(|id| id.to_le_bytes()).collect();
                format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes))
            }),
            scorers: scorers
                .iter()
                .map(|(name, weight)| ScorerWeight {
                    name: (*name).to_owned(),
                    weight: *weight,
                })
                .collect(),
            candidates: listed,
            candidates_omitted: candidates.len().saturating_sub(MAX_CANDIDATES),
            winner: candidates[winner].backend.name.clone(),
        });
        if explain {
            let _ = REQUEST.try_with(|r| {
                *r.last.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::clone(&record));
            });
        }
        if into_ring {
            let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
            if ring.len() >= self.capacity {
                ring.pop_front();
            }
            ring.push_back(record);
        }
    }
}

fn truncate(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// What one request's decisions left for the front door.
#[derive(Debug, Default)]
pub struct RequestTrace {
    explain: bool,
    picks: AtomicU32,
    /// Prompt blocks found on, and hashed for, the backend the last sent attempt went to.
    prefix_matched: AtomicU32,
    prefix_blocks: AtomicU32,
    last: Mutex<Option<Arc<DecisionRecord>>>,
    /// The prefill/decode path of the last attempt sent, when `[pd]` applied to it.
    pd: Mutex<Option<PdStep>>,
}

/// How a request's last attempt went under prefill/decode disaggregation (`crate::pd`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PdStep {
    /// `disaggregated`, `local` or `fallback`.
    pub path: &'static str,
    /// Why (e.g. `below threshold_tokens`, `prefill step timed out (pd.prefill_timeout_ms)`).
    pub reason: &'static str,
    /// The backend the prefill step went to (also when it failed).
    pub prefill_backend: Option<String>,
}

impl RequestTrace {
    pub fn new(explain: bool) -> Arc<Self> {
        Arc::new(RequestTrace {
            explain,
            ..Default::default()
        })
    }

    /// Decisions that picked a backend for this request (1 + retries, usually).
    pub fn picks(&self) -> u32 {
        self.picks.load(Ordering::Relaxed)
    }

    /// `(matched, hashed)` prompt blocks of the last attempt sent, when the prefix scorer ran.
    pub fn prefix(&self) -> Option<(u32, u32)> {
        let blocks = self.prefix_blocks.load(Ordering::Relaxed);
        (blocks > 0).then(|| (self.prefix_matched.load(Ordering::Relaxed), blocks))
    }

    /// The prefill/decode path of the last attempt sent (`None`: `[pd]` did not apply).
    pub fn pd(&self) -> Option<PdStep> {
        self.pd.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The last decision made for the request, when it asked for an explanation.
    pub fn last_decision(&self) -> Option<Arc<DecisionRecord>> {
        self.last.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

tokio::task_local! {
    static REQUEST: Arc<RequestTrace>;
}

/// Run `f` (one request's way through scheduling and forwarding) with `trace` as its
/// per-request record.
pub fn scope<F: Future>(trace: Arc<RequestTrace>, f: F) -> impl Future<Output = F::Output> {
    REQUEST.scope(trace, f)
}

/// Does the request being scheduled want its decision explained?
pub fn want_explanation() -> bool {
    REQUEST.try_with(|r| r.explain).unwrap_or(false)
}

/// Run `f` (a decision made on the request's behalf that is not its own pick, e.g. the
/// prefill step's backend) with a trace of its own, so it changes neither the request's
/// decision count, its prefix match nor the decision its explain header shows. Its record
/// still goes into the ring when that is recording.
pub fn aside<R>(f: impl FnOnce() -> R) -> R {
    REQUEST.sync_scope(RequestTrace::new(want_explanation()), f)
}

/// The prefill/decode path of the attempt being sent.
pub fn note_pd(step: PdStep) {
    let _ = REQUEST.try_with(|r| {
        *r.pd.lock().unwrap_or_else(|e| e.into_inner()) = Some(step);
    });
}

/// A decision picked a backend for the current request.
pub fn note_pick() {
    let _ = REQUEST.try_with(|r| r.picks.fetch_add(1, Ordering::Relaxed));
}

/// The prefix scorer's match for the attempt being sent.
pub fn note_prefix(matched: usize, blocks: usize) {
    let _ = REQUEST.try_with(|r| {
        r.prefix_matched.store(
            u32::try_from(matched).unwrap_or(u32::MAX),
            Ordering::Relaxed,
        );
        r.prefix_blocks
            .store(u32::try_from(blocks).unwrap_or(u32::MAX), Ordering::Relaxed);
    });
}

/// The explain header's value: `seq=…; profile=…; decisions=N; winner=URL[; pd=PATH; pd_reason=WHY[; prefill=URL]][; prompt_tokens=N]; URL total=… name=score …, …`,
/// visible ASCII only, at most `max` bytes (cut at a candidate boundary, marked `…more`).
pub fn summary(record: &DecisionRecord, picks: u32, pd: Option<&PdStep>, max: usize) -> String {
    let mut out = format!(
        "seq={}; profile={}; decisions={}; winner={}",
        record.seq, record.profile, picks, record.winner
    );
    if let Some(pd) = pd {
        out.push_str(&format!("; pd={}; pd_reason={}", pd.path, pd.reason));
        if let Some(prefill) = &pd.prefill_backend {
            out.push_str(&format!("; prefill={prefill}"));
        }
    }
    if let Some(n) = record.prompt_tokens {
        out.push_str(&format!("; prompt_tokens={n}"));
    }
    for c in &record.candidates {
        let mut part = format!("; {} total={:.3}", c.backend, c.total);
        for (s, score) in record.scorers.iter().zip(&c.scores) {
            part.push_str(&format!(" {}={:.3}", s.name, score));
        }
        if out.len() + part.len() + 8 > max {
            out.push_str("; more");
            break;
        }
        out.push_str(&part);
    }
    out.retain(|ch| ch.is_ascii_graphic() || ch == ' ');
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn record(seq: u64, n: usize) -> DecisionRecord {
        DecisionRecord {
            seq,
            unix_ms: 0,
            profile: "default".into(),
            model: None,
            prompt_bytes: 3,
            prompt_tokens: None,
            prompt_tokens_hash: None,
            prompt_hash: None,
            scorers: vec![ScorerWeight {
                name: "queue-scorer".into(),
                weight: 1.0,
            }],
            candidates: (0..n)
                .map(|i| CandidateScores {
                    backend: format!("http://10.0.0.{i}:8000"),
                    id: i,
                    total: 1.0,
                    scores: vec![0.5],
                    picked: i == 0,
                })
                .collect(),
            candidates_omitted: 0,
            winner: "http://10.0.0.0:8000".into(),
        }
    }

    #[test]
    fn disarmed_until_read_then_armed() {
        let log = DecisionLog::new(4, false);
        assert!(!log.recording());
        assert!(log.recent(10).is_empty());
        assert!(log.recording());
        assert!(!DecisionLog::new(0, true).recording());
        assert!(DecisionLog::new(1, true).recording());
    }

    #[test]
    fn summary_is_bounded_ascii() {
        let s = summary(&record(7, 200), 2, None, 512);
        assert!(s.len() <= 512, "{}", s.len());
        assert!(s.starts_with("seq=7; profile=default; decisions=2; winner=http://10.0.0.0:8000"));
        assert!(s.ends_with("; more"));
        assert!(s.contains("http://10.0.0.1:8000 total=1.000 queue-scorer=0.500"));
        assert!(http::HeaderValue::from_str(&s).is_ok());
    }

    #[test]
    fn truncate_respects_char_boundaries() {
        assert_eq!(truncate("héllo", 2), "h");
        assert_eq!(truncate("abc", 10), "abc");
    }
}
