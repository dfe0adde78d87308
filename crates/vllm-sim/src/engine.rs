//! Engine: the one task per server that runs the scheduler's step loop in simulated time.
//!
//! HTTP handlers submit requests over a channel and get a per-request channel of tokens back.
//! The loop, per step: take new requests and aborts from the channel, let the scheduler plan
//! the step, compute its duration with the cost model, sleep until the step's end (divided by
//! `--time-scale`; that sleep *is* the simulation), then apply the step: tokens go out, finished
//! requests free their blocks, metrics are updated. When there is nothing to do the task waits
//! on its channel and burns no CPU.
//!
//! Step deadlines are chained (`next start = previous end`) rather than measured from the
//! actual wake-up, so timer granularity and scheduling jitter do not accumulate: at high
//! `--time-scale` many steps shorter than a timer tick still average out to the right rate.
//! Timestamps in metrics are those ideal step ends, converted to simulated seconds.
//!
//! A client that disconnects drops its [`RequestGuard`], which sends an abort; the engine then
//! frees the request's blocks at once and counts `finished_reason="abort"`.
//!
//! KV-cache events (`--kv-events-config`): after each step the block pool's events go to the
//! publisher as one batch numbered from 0 (vLLM batches per engine step too). Two control
//! messages act on the cache between steps: `reset_prefix_cache` (vLLM's endpoint of that name)
//! and `restart` (the restart fault: running requests are preempted, the cache is wiped, the
//! sequence starts again at 0 with `AllBlocksCleared`, the publisher re-opens its sockets).
//!
//! P/D disaggregation: a prefill leg ([`Submission::hold`]) keeps its blocks when it finishes,
//! under a key (its `remote_request_id`), until a pull ([`EngineHandle::pull`]) takes them —
//! the first pull frees them, so a second one is refused — or until the lease
//! (`--kv-lease-ms`, wall clock) ends. A decode leg ([`Submission::external`]) enters with the
//! pulled tokens counted as computed: no prefill compute is charged for them.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use crate::cost::CostModel;
use crate::kv_cache::BlockId;
use crate::kv_events::publisher::{PubMsg, PubStats};
use crate::kv_holds::Holds;
pub use crate::kv_holds::{Hold, PullRefused};
use crate::metrics::{unix_now, Metrics, FINISHED_ABORT, FINISHED_LENGTH};
use crate::scheduler::{Finished, Limits, Scheduler, Seq, TokenEvent};

/// Beyond this lag behind the chained schedule, the engine stops trying to catch up.
const MAX_LAG: Duration = Duration::from_millis(50);

/// A request as the HTTP layer hands it to the engine.
#[derive(Debug)]
pub struct Submission {
    pub tokens: Vec<u32>,
    pub max_tokens: u32,
    /// Seeds the block-hash chain: LoRA adapters and cache salts never share cache with the
    /// base model or each other.
    pub hash_seed: u64,
    pub lora: Option<u16>,
    /// `cache_salt` of the request (reported in the first block's KV-event `extra_keys`).
    pub cache_salt: Option<String>,
    /// When the request reached the server (default: now); a decode leg's pull happens before
    /// it is submitted, and its time counts in TTFT as in vLLM.
    pub arrival: Option<Instant>,
    /// P/D decode leg: prompt tokens whose KV was pulled (see [`crate::scheduler::Seq`]).
    pub external: usize,
    /// P/D prefill leg: hold the blocks when finished (see module doc).
    pub hold: Option<Hold>,
}

enum Msg {
    Add(Box<Seq>, Option<Hold>),
    Abort(u64),
    /// `POST /reset_prefix_cache`: answers whether the cache was reset.
    ResetPrefixCache {
        reset_running: bool,
        reply: oneshot::Sender<bool>,
    },
    /// The restart fault.
    Restart,
    /// A decode server takes held blocks (answers how many tokens they hold).
    Pull {
        key: String,
        blocks: Option<Vec<BlockId>>,
        reply: oneshot::Sender<Result<usize, PullRefused>>,
    },
    /// A lease ended.
    Expire(String),
    /// The prefill-dies fault: held blocks are dropped at once.
    DropHeld(String),
}

/// Engine state that tests and the HTTP layer can read.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Stats {
    pub running: usize,
    pub waiting: usize,
    /// Fraction of blocks held by requests (`vllm:kv_cache_usage_perc`).
    pub kv_usage: f64,
    pub used_blocks: usize,
    /// Blocks whose contents are in the prefix cache (held or free).
    pub cached_blocks: usize,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub preemptions: u64,
    /// Requests that finished by reaching max_tokens.
    pub finished: u64,
    /// Requests aborted because their client went away.
    pub aborted: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub steps: u64,
    /// LoRA adapter loads into a slot (an adapter admitted while not resident); not a vLLM
    /// series, only here and in `/sim/stats`.
    pub lora_loads: u64,
    /// P/D: prefills whose blocks are held for a pull now.
    pub kv_held: usize,
    /// P/D: pulls served (blocks handed over and freed).
    pub kv_pulls: u64,
    /// P/D: holds whose lease ended without a pull.
    pub kv_expired: u64,
    /// P/D: prompt tokens taken from pulls instead of computed.
    pub external_tokens: u64,
    /// Responses API: objects in the store now (`--responses-store`); kept by the HTTP layer,
    /// not the engine. Not a vLLM series.
    pub responses_stored: usize,
}

/// Shared between the engine task and everything that reads its state.
#[derive(Debug)]
pub struct Shared {
    metrics: Mutex<Metrics>,
    stats: Mutex<Stats>,
    /// [`Stats::responses_stored`], set by the Responses store.
    responses_stored: AtomicUsize,
    changed: watch::Sender<u64>,
    pub time_scale: f64,
}

impl Shared {
    pub fn metrics(&self) -> MutexGuard<'_, Metrics> {
        self.metrics.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn stats(&self) -> Stats {
        let mut s = *self.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.responses_stored = self.responses_stored.load(Ordering::Relaxed);
        s
    }

    /// The Responses store now holds `n` objects; wakes whoever waits on the stats.
    pub fn set_responses_stored(&self, n: usize) {
        self.responses_stored.store(n, Ordering::Relaxed);
        self.changed.send_modify(|v| *v += 1);
    }

    /// Notified after every engine step and every admission/abort.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Waits until `pred(stats)` holds or `timeout` passes; returns the last stats and
    /// whether the predicate held.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        pred: impl Fn(&Stats) -> bool,
    ) -> (Stats, bool) {
        let mut rx = self.subscribe();
        let deadline = Instant::now() + timeout;
        loop {
            let s = self.stats();
            if pred(&s) {
                return (s, true);
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => return (self.stats(), pred(&self.stats())),
            }
        }
    }
}

/// What the HTTP layer holds to talk to the engine.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Msg>,
    next_id: Arc<AtomicU64>,
    pub shared: Arc<Shared>,
}

impl std::fmt::Debug for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Msg::Add(s, _) => write!(f, "Add({})", s.id),
            Msg::Abort(id) => write!(f, "Abort({id})"),
            Msg::ResetPrefixCache { reset_running, .. } => {
                write!(f, "ResetPrefixCache({reset_running})")
            }
            Msg::Restart => write!(f, "Restart"),
            Msg::Pull { key, .. } => write!(f, "Pull({key})"),
            Msg::Expire(key) => write!(f, "Expire({key})"),
            Msg::DropHeld(key) => write!(f, "DropHeld({key})"),
        }
    }
}

/// Aborts its request in the engine when dropped, unless the request finished.
#[derive(Debug)]
pub struct RequestGuard {
    id: u64,
    tx: mpsc::UnboundedSender<Msg>,
    finished: bool,
}

impl RequestGuard {
    /// The request ran to completion: dropping the guard no longer aborts.
    pub fn finished(&mut self) {
        self.finished = true;
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if !self.finished {
            // The engine may be gone already (shutdown); nothing left to free then.
            let _ = self.tx.send(Msg::Abort(self.id));
        }
    }
}

impl EngineHandle {
    /// vLLM's `reset_prefix_cache`: drops every cached block when none is held (with
    /// `reset_running`, running requests are preempted first so that none is). False if the
    /// cache was not reset or the engine is gone.
    pub async fn reset_prefix_cache(&self, reset_running: bool) -> bool {
        let (reply, rx) = oneshot::channel();
        if self
            .tx
            .send(Msg::ResetPrefixCache {
                reset_running,
                reply,
            })
            .is_err()
        {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    /// The restart fault (see module doc); applied between steps.
    pub fn restart(&self) {
        let _ = self.tx.send(Msg::Restart);
    }

    /// Takes the blocks held under `key` (checking them against `blocks` when given) and frees
    /// them; answers how many tokens they hold. A second pull of the same key is refused.
    pub async fn pull(
        &self,
        key: String,
        blocks: Option<Vec<BlockId>>,
    ) -> Result<usize, PullRefused> {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Msg::Pull { key, blocks, reply }).is_err() {
            return Err(PullRefused::Stopped);
        }
        rx.await.unwrap_or(Err(PullRefused::Stopped))
    }

    /// Frees the blocks held under `key` now, if any (the prefill-dies fault).
    pub fn drop_held(&self, key: String) {
        let _ = self.tx.send(Msg::DropHeld(key));
    }

    /// Queues a request; tokens arrive on the returned receiver.
    pub fn submit(&self, sub: Submission) -> (RequestGuard, mpsc::UnboundedReceiver<TokenEvent>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        let mut seq = Seq::new(
            id,
            sub.tokens,
            sub.max_tokens,
            sub.hash_seed,
            sub.lora,
            tx,
            sub.arrival.unwrap_or_else(Instant::now),
        );
        seq.cache_salt = sub.cache_salt;
        seq.external = sub.external;
        seq.hold = sub.hold.is_some();
        // If the engine is gone the receiver closes at once and the handler reports an error.
        let _ = self.tx.send(Msg::Add(Box::new(seq), sub.hold));
        (
            RequestGuard {
                id,
                tx: self.tx.clone(),
                finished: false,
            },
            rx,
        )
    }
}

/// Engine parameters.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub limits: Limits,
    pub num_blocks: usize,
    pub cost: CostModel,
    pub time_scale: f64,
    pub max_model_len: usize,
    /// Adapter names by index, for `vllm:lora_requests_info`.
    pub lora_names: Vec<String>,
    /// Where KV-cache events go (None: not published, not even recorded).
    pub kv: Option<KvSink>,
    /// How long a prefill's held blocks wait for a pull (wall clock).
    pub kv_lease: Duration,
}

/// The engine's end of the KV-event publisher.
#[derive(Debug, Clone)]
pub struct KvSink {
    pub tx: mpsc::Sender<PubMsg>,
    pub stats: Arc<PubStats>,
    /// `--kv-events-restart-after N`: restart once, after the N-th batch.
    pub restart_after: Option<u64>,
}

/// Creates an engine; run the returned future on a task.
pub fn start(cfg: EngineConfig) -> (EngineHandle, impl std::future::Future<Output = ()> + Send) {
    let (tx, rx) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared {
        metrics: Mutex::new(Metrics::new(cfg.max_model_len)),
        stats: Mutex::new(Stats::default()),
        responses_stored: AtomicUsize::new(0),
        changed: watch::channel(0).0,
        time_scale: cfg.time_scale,
    });
    let handle = EngineHandle {
        tx,
        next_id: Arc::new(AtomicU64::new(0)),
        shared: shared.clone(),
    };
    let mut sched = Scheduler::new(cfg.limits, cfg.num_blocks);
    if cfg.kv.is_some() {
        sched.pool.enable_events();
    }
    let engine = Engine {
        sched,
        cfg,
        shared,
        me: handle.tx.downgrade(),
        holds: Holds::default(),
        steps: 0,
        lora_loads: 0,
        stats: Stats::default(),
        kv_seq: 0,
        kv_batches: 0,
    };
    (handle, engine.run(rx))
}

struct Engine {
    sched: Scheduler,
    cfg: EngineConfig,
    shared: Arc<Shared>,
    steps: u64,
    lora_loads: u64,
    stats: Stats,
    /// Seq of the next KV-event batch.
    kv_seq: u64,
    /// KV-event batches handed to the publisher since start (for `restart_after`).
    kv_batches: u64,
    /// For lease timers (weak: the engine still ends when every handle is gone).
    me: mpsc::WeakUnboundedSender<Msg>,
    /// P/D prefill legs and their held blocks.
    holds: Holds,
}

impl Engine {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Msg>) {
        let mut next_start: Option<Instant> = None;
        loop {
            if self.sched.is_idle() {
                next_start = None;
                match rx.recv().await {
                    Some(m) => self.handle(m),
                    None => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(m) => self.handle(m),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) if self.sched.is_idle() => return,
                    Err(mpsc::error::TryRecvError::Disconnected) => break,
                }
            }
            let now = Instant::now();
            let start = match next_start {
                Some(t) if now.saturating_duration_since(t) < MAX_LAG => t,
                _ => now,
            };
            let plan = self.sched.schedule(start);
            if plan.work.sequences == 0 {
                // Nothing can run (only possible with an empty batch and aborts pending).
                self.flush_kv();
                self.publish();
                next_start = None;
                if self.sched.is_idle() {
                    continue;
                }
                match rx.recv().await {
                    Some(m) => self.handle(m),
                    None => return,
                }
                continue;
            }
            let wall = self
                .cfg
                .cost
                .step_time(plan.work)
                .div_f64(self.cfg.time_scale);
            let end = start + wall;
            if end > Instant::now() {
                tokio::time::sleep_until(end).await;
            } else {
                // Behind schedule or --instant: let handlers run before the next step.
                tokio::task::yield_now().await;
            }
            next_start = Some(end);
            self.steps += 1;
            let scale = self.cfg.time_scale;
            let mut m = self.shared.metrics();
            m.iteration_tokens.observe(plan.tokens as f64);
            m.preemptions += u64::from(plan.preempted);
            self.lora_loads += u64::from(plan.lora_loads);
            m.prefix_queries += plan.prefix_queries;
            m.prefix_hits += plan.prefix_hits;
            m.external_queries += plan.external_queries;
            m.external_hits += plan.external_hits;
            let mut first_tokens = Vec::new();
            let left = self.sched.apply(end, |seq| {
                m.generation_tokens += 1;
                if seq.generated == 1 {
                    first_tokens.push((
                        seq.prompt_len,
                        seq.cached_at_admission,
                        seq.external_at_admission,
                    ));
                    if let Some(t0) = seq.times.first_token {
                        m.ttft.observe(secs(t0, seq.times.arrival, scale));
                    }
                } else if let Some(prev) = seq.times.last_token {
                    m.itl.observe(secs(end, prev, scale));
                }
            });
            drop(m);
            let left = self.hold_finished(left);
            self.record(first_tokens, left);
            self.flush_kv();
            self.publish();
        }
    }

    /// Hands this step's KV-cache events to the publisher as one batch.
    fn flush_kv(&mut self) {
        let Some(kv) = &self.cfg.kv else {
            return;
        };
        let events = self.sched.pool.take_events();
        if events.is_empty() {
            return;
        }
        let seq = self.kv_seq;
        self.kv_seq += 1;
        let batch = PubMsg::Batch {
            seq,
            ts: unix_now(),
            events,
        };
        if kv.tx.try_send(batch).is_err() {
            kv.stats.count_lost();
        }
        self.kv_batches += 1;
        if kv.restart_after == Some(self.kv_batches) {
            self.restart();
        }
    }

    /// The restart fault: what a subscriber sees when the engine process starts afresh.
    fn restart(&mut self) {
        let preempted = self.sched.preempt_all();
        self.shared.metrics().preemptions += u64::from(preempted);
        // The held prefills die with the process.
        self.holds.clear(&mut self.sched.pool);
        self.sched.pool.wipe();
        self.kv_seq = 0;
        if let Some(kv) = &self.cfg.kv {
            if kv.tx.try_send(PubMsg::Restart).is_err() {
                kv.stats.count_lost();
            }
        }
        self.sched
            .pool
            .record(crate::kv_events::KvEvent::AllBlocksCleared);
        self.flush_kv();
        self.publish();
    }

    fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Add(seq, hold) => {
                if let Some(h) = hold {
                    self.holds.start(seq.id, h);
                }
                self.sched.waiting.push_back(*seq)
            }
            Msg::Abort(id) => {
                // An aborted prefill frees its blocks at once (vLLM returns no params).
                self.holds.forget(id);
                if self.sched.abort(id).is_some() {
                    self.shared.metrics().finished[FINISHED_ABORT] += 1;
                    self.publish();
                }
            }
            Msg::ResetPrefixCache {
                reset_running,
                reply,
            } => {
                if reset_running {
                    let preempted = self.sched.preempt_all();
                    self.shared.metrics().preemptions += u64::from(preempted);
                }
                let ok = self.sched.pool.reset();
                self.flush_kv();
                self.publish();
                let _ = reply.send(ok);
            }
            Msg::Restart => self.restart(),
            Msg::Pull { key, blocks, reply } => {
                let answer = self
                    .holds
                    .pull(&key, blocks.as_deref(), &mut self.sched.pool);
                self.publish();
                let _ = reply.send(answer);
            }
            Msg::Expire(key) => {
                if self.holds.expire(&key, &mut self.sched.pool) {
                    tracing::warn!(%key, "KV lease ended without a pull; blocks freed");
                    self.publish();
                }
            }
            Msg::DropHeld(key) => {
                if self.holds.release(&key, &mut self.sched.pool) {
                    self.publish();
                }
            }
        }
    }

    /// Finished prefill legs keep their blocks (see [`Holds::finish`]); each starts its lease.
    fn hold_finished(&mut self, left: Vec<Finished>) -> Vec<Finished> {
        for key in self.holds.finish(&left, &mut self.sched.pool) {
            let me = self.me.clone();
            let lease = self.cfg.kv_lease;
            tokio::spawn(async move {
                tokio::time::sleep(lease).await;
                if let Some(tx) = me.upgrade() {
                    let _ = tx.send(Msg::Expire(key));
                }
            });
        }
        left
    }

    /// Per-step bookkeeping after `apply`: token counters and finished-request histograms.
    fn record(&mut self, first_tokens: Vec<(usize, usize, usize)>, left: Vec<Finished>) {
        let scale = self.cfg.time_scale;
        let mut m = self.shared.metrics();
        for (prompt_len, cached, external) in first_tokens {
            m.prompt_tokens_cached += (cached - external) as u64;
            m.prompt_tokens_external += external as u64;
            m.prompt_tokens_computed += (prompt_len - cached) as u64;
        }
        for f in left {
            let s = &f.seq;
            match f.reason {
                None => m.finished[FINISHED_ABORT] += 1,
                Some(_) => {
                    m.finished[FINISHED_LENGTH] += 1;
                    let t = s.times;
                    let (Some(sched), Some(first), Some(last)) =
                        (t.scheduled, t.first_token, t.last_token)
                    else {
                        continue;
                    };
                    let gen = f64::from(s.generated);
                    m.e2e.observe(secs(last, t.arrival, scale));
                    m.queue_time.observe(secs(sched, t.arrival, scale));
                    m.inference_time.observe(secs(last, sched, scale));
                    m.prefill_time.observe(secs(first, sched, scale));
                    let decode = secs(last, first, scale);
                    m.decode_time.observe(decode);
                    m.tpot.observe(if s.generated > 1 {
                        decode / (gen - 1.0)
                    } else {
                        0.0
                    });
                    m.request_prompt_tokens.observe(s.prompt_len as f64);
                    m.request_generation_tokens.observe(gen);
                    m.request_max_num_generation_tokens
                        .observe(f64::from(s.max_tokens));
                    m.request_params_max_tokens.observe(f64::from(s.max_tokens));
                    m.request_params_n.observe(1.0);
                    m.request_preemptions.observe(f64::from(s.preemptions));
                    m.prefill_kv_computed_tokens
                        .observe((s.prompt_len.saturating_sub(s.cached_at_admission)) as f64);
                }
            }
        }
    }

    /// Copies gauges into the metrics and stats, and wakes whoever waits on them.
    fn publish(&mut self) {
        let pool = &self.sched.pool;
        let mut m = self.shared.metrics();
        m.running = self.sched.running.len();
        m.waiting = self.sched.waiting.len();
        m.kv_usage = pool.usage();
        if !self.cfg.lora_names.is_empty() {
            let names = |it: &mut dyn Iterator<Item = Option<u16>>| {
                let mut v: Vec<String> = it
                    .flatten()
                    .filter_map(|i| self.cfg.lora_names.get(usize::from(i)).cloned())
                    .collect();
                v.sort();
                v.dedup();
                v
            };
            let running = names(&mut self.sched.running.iter().map(|s| s.lora));
            let waiting = names(&mut self.sched.waiting.iter().map(|s| s.lora));
            if running != m.running_loras || waiting != m.waiting_loras {
                m.running_loras = running;
                m.waiting_loras = waiting;
                m.lora_info_time = unix_now();
            }
        }
        self.stats = Stats {
            running: m.running,
            waiting: m.waiting,
            kv_usage: m.kv_usage,
            used_blocks: pool.num_used(),
            cached_blocks: pool.num_cached(),
            prefix_queries: m.prefix_queries,
            prefix_hits: m.prefix_hits,
            preemptions: m.preemptions,
            finished: m.finished[FINISHED_LENGTH],
            aborted: m.finished[FINISHED_ABORT],
            prompt_tokens: m.prompt_tokens_cached
                + m.prompt_tokens_computed
                + m.prompt_tokens_external,
            generation_tokens: m.generation_tokens,
            steps: self.steps,
            lora_loads: self.lora_loads,
            kv_held: self.holds.len(),
            kv_pulls: self.holds.pulls,
            kv_expired: self.holds.expired,
            external_tokens: m.prompt_tokens_external,
            responses_stored: 0,
        };
        drop(m);
        *self.shared.stats.lock().unwrap_or_else(|e| e.into_inner()) = self.stats;
        self.shared.changed.send_modify(|v| *v += 1);
    }
}

/// `later - earlier` in simulated seconds.
fn secs(later: Instant, earlier: Instant, scale: f64) -> f64 {
    later.saturating_duration_since(earlier).as_secs_f64() * scale
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
