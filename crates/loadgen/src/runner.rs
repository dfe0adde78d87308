//! One load run: dispatch a workload under an arrival process, collect, scrape, summarise.
//!
//! A run always ends by itself: sending stops at the request bound, at the wall-clock
//! deadline or when the arrival process ends; requests still running `drain_timeout` after
//! that are aborted and counted as errors of kind `aborted`.

use std::collections::VecDeque;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinSet;

use crate::arrival::{Arrival, Schedule};
use crate::client::{self, Record, RequestOptions};
use crate::report::{Collector, Slo, Summary};
use crate::scrape::FleetScraper;
use crate::workload::{max_hit_with, Session, Tokens, Workload};
use vllm_sim::tokenizer::ChatMessage;

/// Everything a run needs besides the workload.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub label: String,
    /// Keep every request's messages (later turns with the server's answers) in
    /// [`RunOutput::messages`], for `--dump-requests`.
    pub keep_messages: bool,
    /// Base URL of the OpenAI server or router.
    pub target: String,
    pub request: RequestOptions,
    pub arrival: Arrival,
    pub max_requests: Option<u64>,
    /// Wall-clock limit for sending.
    pub duration: Duration,
    /// Wall-clock time allowed to in-flight requests after sending stops.
    pub drain_timeout: Duration,
    /// Wall-clock pause between a conversation's answer and its next turn.
    pub think_time: Duration,
    pub request_timeout: Duration,
    /// Backends whose `/metrics` are scraped before, during and after the run.
    pub backend_metrics: Vec<String>,
    pub sample_interval: Duration,
    pub progress: bool,
    pub seed: u64,
    /// Reported times are multiplied by this (the simulators' `time_scale`).
    pub time_scale: f64,
    /// The backends' KV block size, for the maximum-hit-rate bound.
    pub block_size: usize,
    /// The backends' tokenizer, for the bound.
    pub tokens: Tokens,
    /// Goodput objective, in wall seconds.
    pub slo: Option<Slo>,
    /// Write one JSON line per finished request here (`--trace`): when it was sent, its group,
    /// backend, TTFT, end-to-end time and prompt/cached tokens, times × `time_scale`.
    pub trace: Option<std::path::PathBuf>,
}

/// What a run produced.
#[derive(Debug, Clone)]
pub struct RunOutput {
    pub summary: Summary,
    /// `(session, turn)` of every request in send order.
    pub sent: Vec<(u64, u32)>,
    /// Every request sent, when `keep_messages`: in send order.
    pub messages: Vec<KeptRequest>,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    #[error("trace {}: {source}", path.display())]
    Trace {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// One request as sent, for `--dump-requests`.
#[derive(Debug, Clone)]
pub struct KeptRequest {
    pub session: u64,
    pub turn: u32,
    pub messages: Vec<ChatMessage>,
    /// The router's backend header on the answer, when it sent one.
    pub backend: Option<String>,
}

/// A conversation waiting for its next turn.
struct Turn {
    session: Arc<Session>,
    turn: u32,
    answers: Vec<String>,
}

struct Ctx {
    cfg: RunConfig,
    client: reqwest::Client,
    workload: Arc<Workload>,
    records: mpsc::UnboundedSender<Record>,
    sent: Mutex<Vec<(u64, u32)>>,
    messages: Mutex<Vec<KeptRequest>>,
    dispatched: AtomicU64,
    next_session: AtomicU64,
    started: Instant,
}

impl Ctx {
    /// Takes one request slot; false once the request bound is reached.
    fn claim(&self) -> bool {
        let n = self.dispatched.fetch_add(1, Ordering::Relaxed);
        if self.cfg.max_requests.is_some_and(|m| n >= m) {
            self.dispatched.fetch_sub(1, Ordering::Relaxed);
            return false;
        }
        true
    }

    fn new_session(&self) -> Option<Arc<Session>> {
        let id = self.next_session.fetch_add(1, Ordering::Relaxed);
        if self.workload.session_limit().is_some_and(|l| id >= l) {
            return None;
        }
        Some(Arc::new(self.workload.session(id)))
    }

    fn note_sent(&self, session: u64, turn: u32) {
        if let Ok(mut s) = self.sent.lock() {
            s.push((session, turn));
        }
    }

    async fn send(&self, t: &Turn) -> Record {
        let messages = t.session.messages(t.turn as usize, &t.answers);
        let kept_at = if self.cfg.keep_messages {
            self.messages.lock().ok().map(|mut kept| {
                kept.push(KeptRequest {
                    session: t.session.id,
                    turn: t.turn,
                    messages: messages.clone(),
                    backend: None,
                });
                kept.len() - 1
            })
        } else {
            None
        };
        let sent_at = self.started.elapsed().as_secs_f64();
        let mut rec = client::send(
            &self.client,
            &self.cfg.target,
            &self.cfg.request,
            t.session.id,
            &messages,
            t.session.output_tokens,
        )
        .await;
        rec.session = t.session.id;
        rec.turn = t.turn;
        rec.group = t.session.group;
        rec.sent_at = sent_at;
        // Locked only for a kept request the router named a backend for.
        if let (Some(i), Some(backend)) = (kept_at, &rec.backend) {
            if let Ok(mut kept) = self.messages.lock() {
                if let Some(kept) = kept.get_mut(i) {
                    kept.backend = Some(backend.clone());
                }
            }
        }
        rec
    }
}

/// One `--trace` line: times in the run's reported units (× `scale`).
fn trace_line(r: &Record, scale: f64) -> String {
    serde_json::json!({
        "sent_at": r.sent_at * scale,
        "session": r.session,
        "turn": r.turn,
        "group": r.group,
        "backend": r.backend,
        "ttft": r.ttft.map(|t| t * scale),
        "e2e": r.e2e * scale,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "error": r.error,
    })
    .to_string()
}

/// Runs `workload` against `cfg.target` and summarises.
pub async fn run(cfg: RunConfig, workload: Arc<Workload>) -> Result<RunOutput, RunError> {
    let pool = match cfg.arrival {
        Arrival::Closed { concurrency } => concurrency.max(1),
        _ => 256,
    };
    let client = client::http_client(pool, cfg.request_timeout)?;
    let trace_failed = |source| RunError::Trace {
        path: cfg.trace.clone().unwrap_or_default(),
        source,
    };
    // The trace file is opened before anything is sent, so a bad path fails the run at once.
    let trace = match &cfg.trace {
        Some(path) => Some(std::io::BufWriter::new(
            std::fs::File::create(path).map_err(trace_failed)?,
        )),
        None => None,
    };
    let scraper = if cfg.backend_metrics.is_empty() {
        None
    } else {
        Some(FleetScraper::start(cfg.backend_metrics.clone(), cfg.sample_interval).await)
    };
    // One clock for the run's wall time and the trace's send times.
    let start = Instant::now();
    let (tx, mut rx) = mpsc::unbounded_channel::<Record>();
    let ctx = Arc::new(Ctx {
        cfg: cfg.clone(),
        client,
        workload: Arc::clone(&workload),
        records: tx,
        sent: Mutex::new(Vec::new()),
        messages: Mutex::new(Vec::new()),
        dispatched: AtomicU64::new(0),
        next_session: AtomicU64::new(0),
        started: start,
    });

    let bar = progress_bar(&cfg);
    let collector_bar = bar.clone();
    let slo = cfg.slo;
    let scale = cfg.time_scale;
    let collector = tokio::spawn(async move {
        use std::io::Write as _;
        let mut c = Collector {
            slo,
            ..Collector::default()
        };
        let mut trace = trace;
        let mut trace_error = None;
        while let Some(r) = rx.recv().await {
            c.add(&r);
            if let Some(out) = &mut trace {
                if let Err(e) = writeln!(out, "{}", trace_line(&r, scale)) {
                    trace_error = Some(e);
                    trace = None;
                }
            }
            collector_bar.inc(1);
        }
        if let Some(Err(e)) = trace.map(|mut out| out.flush()) {
            trace_error = Some(e);
        }
        (c, trace_error)
    });

    let deadline = start + cfg.duration;
    // The drain clock starts when sending stops: after the open loop returns, or at the
    // deadline for closed-loop workers (which keep sending until then).
    let (mut tasks, sending_ends) = match cfg.arrival {
        Arrival::Closed { concurrency } => (closed_loop(&ctx, concurrency, deadline), deadline),
        _ => (open_loop(&ctx, start, deadline).await, Instant::now()),
    };
    let drain_until = tokio::time::Instant::from_std(sending_ends + cfg.drain_timeout);
    loop {
        match tokio::time::timeout_at(drain_until, tasks.join_next()).await {
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(_) => {
                tasks.abort_all();
                while tasks.join_next().await.is_some() {}
                break;
            }
        }
    }
    let wall = start.elapsed().as_secs_f64();
    let dispatched = ctx.dispatched.load(Ordering::Relaxed);
    let sent = ctx.sent.lock().map(|s| s.clone()).unwrap_or_default();
    let messages = ctx
        .messages
        .lock()
        .map(|mut m| std::mem::take(&mut *m))
        .unwrap_or_default();
    drop(ctx);
    let (mut collected, trace_error) = collector.await.unwrap_or_default();
    if let Some(e) = trace_error {
        return Err(trace_failed(e));
    }
    // Requests dispatched but never recorded were cut off by the drain timeout.
    collected.count_error("aborted", dispatched.saturating_sub(collected.sent));
    bar.finish_and_clear();
    let fleet = match scraper {
        Some(s) => Some(s.finish().await),
        None => None,
    };
    let bound = fleet
        .as_ref()
        .map(|_| max_hit_with(&cfg.tokens, &workload, &sent, cfg.block_size));
    let summary = Summary::new(&cfg.label, &collected, wall, cfg.time_scale, fleet, bound);
    Ok(RunOutput {
        summary,
        sent,
        messages,
    })
}

fn progress_bar(cfg: &RunConfig) -> ProgressBar {
    if !cfg.progress || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = match cfg.max_requests {
        Some(n) => ProgressBar::new(n),
        None => ProgressBar::no_length(),
    };
    bar.set_draw_target(ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(
        "{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} requests ({per_sec})",
    );
    if let Ok(style) = style {
        bar.set_style(style);
    }
    bar.set_prefix(cfg.label.clone());
    bar
}

/// Closed loop: each worker runs whole sessions (a conversation's turns in order).
fn closed_loop(ctx: &Arc<Ctx>, concurrency: usize, deadline: Instant) -> JoinSet<()> {
    let mut tasks = JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let ctx = Arc::clone(ctx);
        tasks.spawn(async move {
            while let Some(session) = ctx.new_session() {
                let mut t = Turn {
                    session,
                    turn: 0,
                    answers: Vec::new(),
                };
                while (t.turn as usize) < t.session.turns() {
                    if Instant::now() >= deadline || !ctx.claim() {
                        return;
                    }
                    ctx.note_sent(t.session.id, t.turn);
                    let mut rec = ctx.send(&t).await;
                    let ok = rec.error.is_none();
                    let text = std::mem::take(&mut rec.text);
                    let _ = ctx.records.send(rec);
                    if !ok {
                        break;
                    }
                    t.answers.push(text);
                    t.turn += 1;
                    if (t.turn as usize) < t.session.turns() && !ctx.cfg.think_time.is_zero() {
                        tokio::time::sleep(ctx.cfg.think_time).await;
                    }
                }
            }
        });
    }
    tasks
}

/// Open loop: at each arrival, send the oldest conversation turn that is ready, else a new
/// session; when neither exists (all conversations started, some still answering), the
/// arrival waits for the next ready turn.
async fn open_loop(ctx: &Arc<Ctx>, start: Instant, deadline: Instant) -> JoinSet<()> {
    let mut tasks = JoinSet::new();
    let (cont_tx, mut cont_rx) = mpsc::unbounded_channel::<Turn>();
    // Sessions whose next turn is pending (running or thinking); each such task sends its
    // continuation *before* decrementing, so 0 here means nothing more can arrive.
    let pending = Arc::new(Pending::default());
    let mut ready: VecDeque<Turn> = VecDeque::new();
    let schedule = Schedule::new(ctx.cfg.arrival.clone(), ctx.cfg.seed);
    let deadline_tokio = tokio::time::Instant::from_std(deadline);
    for at in schedule {
        let when = start + at;
        if when >= deadline {
            break;
        }
        tokio::time::sleep_until(tokio::time::Instant::from_std(when)).await;
        while let Ok(t) = cont_rx.try_recv() {
            ready.push_back(t);
        }
        let turn = match ready.pop_front() {
            Some(t) => t,
            None => match ctx.new_session() {
                Some(session) => Turn {
                    session,
                    turn: 0,
                    answers: Vec::new(),
                },
                None => match wait_for_turn(&mut cont_rx, &pending, deadline_tokio).await {
                    Some(t) => t,
                    None => break,
                },
            },
        };
        if !ctx.claim() {
            break;
        }
        ctx.note_sent(turn.session.id, turn.turn);
        let more = (turn.turn as usize + 1) < turn.session.turns();
        let guard = more.then(|| PendingGuard::new(&pending));
        let ctx = Arc::clone(ctx);
        let cont_tx = cont_tx.clone();
        tasks.spawn(async move {
            let _guard = guard;
            let mut rec = ctx.send(&turn).await;
            let ok = rec.error.is_none();
            let text = std::mem::take(&mut rec.text);
            let _ = ctx.records.send(rec);
            if more && ok {
                if !ctx.cfg.think_time.is_zero() {
                    tokio::time::sleep(ctx.cfg.think_time).await;
                }
                let mut answers = turn.answers;
                answers.push(text);
                let _ = cont_tx.send(Turn {
                    session: turn.session,
                    turn: turn.turn + 1,
                    answers,
                });
            }
        });
    }
    tasks
}

/// Waits for the next conversation turn; `None` when none can come any more (no session
/// pending and nothing queued) or at the deadline.
async fn wait_for_turn(
    rx: &mut mpsc::UnboundedReceiver<Turn>,
    pending: &Pending,
    deadline: tokio::time::Instant,
) -> Option<Turn> {
    loop {
        if pending.count.load(Ordering::Acquire) == 0 {
            // Continuations are sent before the count drops: all of them are queued now.
            return rx.try_recv().ok();
        }
        tokio::select! {
            t = rx.recv() => return t,
            // A session ended without a continuation (failed turn): re-check the count.
            _ = pending.changed.notified() => {}
            _ = tokio::time::sleep_until(deadline) => return None,
        }
    }
}

/// Sessions whose next turn may still come, and a wake-up when that number drops.
#[derive(Default)]
struct Pending {
    count: AtomicI64,
    changed: Notify,
}

/// Counts a session as pending while its current turn's task lives.
struct PendingGuard(Arc<Pending>);

impl PendingGuard {
    fn new(p: &Arc<Pending>) -> Self {
        p.count.fetch_add(1, Ordering::AcqRel);
        PendingGuard(Arc::clone(p))
    }
}

impl Drop for PendingGuard {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Ordering::AcqRel);
        // notify_one keeps a permit when nobody waits yet, so the wake-up is never lost.
        self.0.changed.notify_one();
    }
}
