//! The in-process instruments of `bench/cost_curves.py` (issue #27's cost curves), one binary
//! with two modes, both printing JSON on stdout:
//!
//! * `measure --n N`: at N healthy backends with fresh metrics, the time of one whole scheduling
//!   decision through the default profile, approximate (1,000-character chat prompts, 64 groups
//!   already in the prefix index, as `hot_path`'s `decision`) and precise (every backend's
//!   KV-event store live and holding blocks; 8 token-id prompts of 4,096 tokens in 16-token
//!   blocks, taken in turn so that no decision reuses the previous one's fleet walk), and of one
//!   membership change (`Pool::reconcile` of the whole set with one backend replaced, as
//!   `hot_path`'s `membership_change`). Each decision and change is timed on its own: p50, p99
//!   and mean in ns.
//! * `publish --port-base P --count N …`: N simulated vLLM KV-event publishers, one ZeroMQ PUB
//!   socket each on `127.0.0.1:P+i`, that publish vLLM 0.32 messages (the library's own encoder)
//!   at a fixed rate of blocks per second each once a line `go` arrives on stdin, until `stop`
//!   or end of input; then the counts sent.
//! * `metrics-query`: the query string the poller sends with `/metrics/`.
//!
//! Not a criterion bench: five fleet sizes × three measurements would take criterion minutes,
//! and the curves need one number per size, not a confidence interval.
//! `cargo build --release --bench cost_curves`, then run the binary (see the script).
#![allow(clippy::unwrap_used, clippy::expect_used)]

/// The binary's allocator, so allocation-heavy paths cost what they cost there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::collections::HashMap;
use std::hint::black_box;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use inferlb::config::{BackendConfig, Config, DiscoverySource};
use inferlb::discovery::DesiredBackend;
use inferlb::endpoints::engine::{EngineMetricNames, LoadMetrics};
use inferlb::endpoints::{ModelEntry, Pool};
use inferlb::kv_events::wire::{encode, Event, Medium, Stored};
use inferlb::prompt::{Operation, RequestView};
use inferlb::scheduling::framework::CycleState;
use inferlb::scheduling::profile::build_active;
use inferlb::scheduling::Scheduler;
use zeromq::{Socket, SocketSend};

/// Precise prompts: count, tokens each, block size.
const PROMPTS: usize = 8;
const PROMPT_TOKENS: usize = 4_096;
const BS: usize = 16;

fn main() {
    let mut args = std::env::args().skip(1).filter(|a| a != "--bench");
    let mode = args.next().unwrap_or_default();
    let mut flags = HashMap::new();
    while let Some(k) = args.next() {
        let v = args.next().unwrap_or_else(|| panic!("{k} needs a value"));
        flags.insert(k.trim_start_matches("--").to_owned(), v);
    }
    let num = |k: &str, default: u64| -> u64 {
        flags
            .get(k)
            .map(|v| {
                v.parse()
                    .unwrap_or_else(|_| panic!("--{k} {v}: not a number"))
            })
            .unwrap_or(default)
    };
    match mode.as_str() {
        "measure" => measure(
            num("n", 100) as usize,
            num("decisions", 5_000) as usize,
            num("changes", 200) as usize,
        ),
        // The query string inferlb's poller sends with `/metrics/` (so a static backend can be
        // given the page a simulator answers to it).
        "metrics-query" => println!(
            "{}",
            EngineMetricNames::builtin("vllm").unwrap().filter_query()
        ),
        "publish" => publish(&PublishArgs {
            port_base: num("port-base", 0) as u16,
            count: num("count", 1) as usize,
            blocks_per_s: num("blocks-per-s", 100),
            blocks_per_msg: num("blocks-per-msg", 10).max(1),
            block_size: num("block-size", 128) as usize,
            keep_blocks: num("keep-blocks", 1_000),
            max_seconds: num("max-seconds", 600),
        }),
        _ => {
            eprintln!("usage: cost_curves measure --n N [--decisions D] [--changes C]");
            eprintln!("       cost_curves metrics-query");
            eprintln!("       cost_curves publish --port-base P --count N [--blocks-per-s R] [--blocks-per-msg B] [--block-size BS] [--keep-blocks K] [--max-seconds S]");
            std::process::exit(2);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// measure

/// p50, p99 and mean of `samples` (ns), as a JSON object.
fn summary(mut samples: Vec<u64>) -> serde_json::Value {
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    let mean = samples.iter().sum::<u64>() as f64 / samples.len() as f64;
    serde_json::json!({"count": samples.len(), "p50_ns": at(0.5), "p99_ns": at(0.99), "mean_ns": mean.round()})
}

fn measure(n: usize, decisions: usize, changes: usize) {
    let started = Instant::now();
    let approximate = {
        let (scheduler, views) = fleet(n, 64, 1_000);
        time_decisions(&scheduler, &views, decisions)
    };
    let (precise, held) = {
        let (scheduler, _) = fleet(n, 1, 1_000);
        let (views, held) = precise_stores(&scheduler);
        (time_decisions(&scheduler, &views, decisions), held)
    };
    let membership = membership(n, changes);
    let out = serde_json::json!({
        "n": n,
        "approximate": approximate,
        "precise": precise,
        "precise_blocks_per_store": held as f64 / n as f64,
        "membership": membership,
        "seconds": started.elapsed().as_secs_f64(),
    });
    println!("{out}");
}

/// `decisions` timed decisions over `views` in turn, after a tenth as many untimed.
fn time_decisions(
    scheduler: &Scheduler,
    views: &[RequestView],
    decisions: usize,
) -> serde_json::Value {
    for i in 0..decisions / 10 {
        black_box(decide(scheduler, &views[i % views.len()]));
    }
    let mut samples = Vec::with_capacity(decisions);
    for i in 0..decisions {
        let v = &views[i % views.len()];
        let t = Instant::now();
        black_box(decide(scheduler, v));
        samples.push(t.elapsed().as_nanos() as u64);
    }
    summary(samples)
}

/// Deterministic prose-like text of `len` bytes (as `hot_path`'s).
fn text(len: usize, seed: u64) -> String {
    let words = [
        "alpha", "beta", "gamma", "delta", "kv", "cache", "prefix", "token", "route", "vllm",
    ];
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut s = String::with_capacity(len + 8);
    while s.len() < len {
        s.push_str(words[rng.usize(..words.len())]);
        s.push(' ');
    }
    s.truncate(len);
    s
}

fn chat_view(prompt: &str) -> RequestView {
    let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": prompt}]});
    RequestView::parse(Operation::ChatCompletions, body.to_string().as_bytes()).unwrap()
}

/// `hot_path`'s fleet: `n` healthy backends serving `m` with fresh metrics and the default
/// profile, its prefix index already holding `groups` prompts of `prompt_len` characters.
fn fleet(n: usize, groups: usize, prompt_len: usize) -> (Arc<Scheduler>, Vec<RequestView>) {
    let mut config = Config {
        backends: (0..n)
            .map(|i| BackendConfig::from_url(format!("http://127.0.0.1:{}", 20_000 + i)))
            .collect(),
        ..Config::from_toml("", "bench").unwrap()
    };
    config.poller.stale_after_ms = 3_600_000;
    let pool = Arc::new(Pool::from_config(&config).unwrap());
    for (i, b) in pool.backends().iter().enumerate() {
        let mut state = (*b.state()).clone();
        state.healthy = true;
        state.models = vec![ModelEntry {
            id: "m".into(),
            object: serde_json::json!({"id": "m"}),
        }]
        .into();
        state.metrics = Some((
            LoadMetrics {
                waiting: Some((i % 5) as f64),
                running: Some((i % 7) as f64),
                kv_usage: Some((i % 10) as f64 / 10.0),
                block_size: Some(BS as u64),
                num_gpu_blocks: Some(20_000),
                ..Default::default()
            },
            Instant::now(),
        ));
        b.publish(state);
    }
    let scheduler = Arc::new(Scheduler::new(
        pool,
        build_active(config.scheduling()).unwrap(),
    ));
    let views: Vec<_> = (0..groups)
        .map(|g| chat_view(&text(prompt_len, g as u64)))
        .collect();
    for v in &views {
        decide(&scheduler, v);
    }
    (scheduler, views)
}

/// Turn every backend's KV-event store on and fill it: backend `i` holds the first
/// `(i + 7p) mod 64` 64ths of prompt `p`'s blocks (so at any size some backends hold each
/// prompt far and most hold it partly), under vLLM hashes of its own. Returns the prompts as
/// token-id requests and the blocks stored over all stores.
fn precise_stores(scheduler: &Scheduler) -> (Vec<RequestView>, usize) {
    let blocks = PROMPT_TOKENS / BS;
    let prompts: Vec<Vec<u32>> = (0..PROMPTS as u32)
        .map(|p| {
            (0..PROMPT_TOKENS as u32)
                .map(|t| (t ^ (p << 20)).wrapping_mul(2_654_435_761) % 128_000)
                .collect()
        })
        .collect();
    let mut total = 0;
    for (i, b) in scheduler.pool().backends().iter().enumerate() {
        b.kv().turn_on(3_600_000, "bench".into());
        b.kv().set_connected(true);
        let events: Vec<Event> = prompts
            .iter()
            .enumerate()
            .map(|(p, ids)| {
                let held = blocks * ((i + 7 * p) % 64) / 64;
                total += held;
                Event::Stored(Stored {
                    block_hashes: (0..held as u64)
                        .map(|h| ((i as u64) << 32) | ((p as u64) << 16) | h)
                        .collect(),
                    parent: None,
                    token_ids: ids[..held * BS].to_vec(),
                    block_size: BS as u32,
                    lora_name: None,
                    medium: Medium::Gpu,
                    extra_keys: Vec::new(),
                })
            })
            .collect();
        b.kv().apply(0, &events, 0);
    }
    let views = prompts
        .iter()
        .map(|ids| {
            let body = serde_json::json!({"model": "m", "prompt": ids}).to_string();
            let view = RequestView::parse(Operation::Completions, body.as_bytes()).unwrap();
            assert!(view.tokens.is_some());
            view
        })
        .collect();
    (views, total)
}

/// One whole decision as a request makes it: pick (taking the backend's slot), record what
/// was sent, free the slot.
fn decide(scheduler: &Scheduler, view: &RequestView) -> usize {
    let mut state = CycleState::default();
    let Ok(mut guard) = scheduler.schedule(view, &mut state, &[]) else {
        panic!("no backend")
    };
    scheduler.sent(view, &state, &mut guard);
    guard.backend().id
}

/// `changes` timed membership changes at `n` backends: the whole desired set, with backend 0
/// replaced by a new one every other time, handed to `Pool::reconcile` (cloning the set
/// included, as discovery hands over a new one).
fn membership(n: usize, changes: usize) -> serde_json::Value {
    let mut config = Config::default();
    config.discovery.source = DiscoverySource::File;
    let pool = Pool::from_config(&config).unwrap();
    let set = |extra: u16| -> Vec<DesiredBackend> {
        (0..n)
            .map(|i| {
                let port = if i == 0 {
                    40_000 + extra
                } else {
                    20_000 + i as u16
                };
                DesiredBackend::new(BackendConfig::from_url(format!("http://10.0.0.1:{port}")))
            })
            .collect()
    };
    let (a, b) = (set(0), set(1));
    pool.reconcile("file", a.clone());
    let mut samples = Vec::with_capacity(changes);
    for i in 0..changes + changes / 10 {
        let next = if i % 2 == 0 { b.clone() } else { a.clone() };
        let t = Instant::now();
        black_box(pool.reconcile("file", next));
        if i >= changes / 10 {
            samples.push(t.elapsed().as_nanos() as u64);
        }
    }
    summary(samples)
}

// ---------------------------------------------------------------------------------------------
// publish

struct PublishArgs {
    port_base: u16,
    count: usize,
    blocks_per_s: u64,
    blocks_per_msg: u64,
    block_size: usize,
    keep_blocks: u64,
    max_seconds: u64,
}

/// What the publishers sent, over all sockets.
#[derive(Default)]
struct Sent {
    messages: AtomicU64,
    blocks: AtomicU64,
    bytes: AtomicU64,
    late_ticks: AtomicU64,
}

fn publish(a: &PublishArgs) {
    // One thread: the publishers' cost stays under one core, whatever N.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(publish_async(a));
}

async fn publish_async(a: &PublishArgs) {
    use tokio::io::AsyncBufReadExt;
    let mut sockets = Vec::with_capacity(a.count);
    for i in 0..a.count {
        let mut s = zeromq::PubSocket::new();
        let port = usize::from(a.port_base) + i;
        s.bind(&format!("tcp://127.0.0.1:{port}"))
            .await
            .unwrap_or_else(|e| panic!("bind 127.0.0.1:{port}: {e}"));
        sockets.push(s);
    }
    println!("{}", serde_json::json!({"bound": a.count}));
    std::io::stdout().flush().unwrap();
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    loop {
        match lines.next_line().await {
            Ok(Some(l)) if l.trim() == "go" => break,
            Ok(Some(_)) => continue,
            _ => return,
        }
    }
    let sent = Arc::new(Sent::default());
    let msgs_per_s = a.blocks_per_s as f64 / a.blocks_per_msg as f64;
    let period = Duration::from_secs_f64(1.0 / msgs_per_s);
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(a.count);
    for (i, socket) in sockets.into_iter().enumerate() {
        // Spread the sockets' ticks over one period, as independent engines' steps are.
        let first = start + period.mul_f64(i as f64 / a.count as f64);
        let stream = Stream {
            socket,
            index: i as u64,
            blocks_per_msg: a.blocks_per_msg,
            block_size: a.block_size,
            keep_msgs: a.keep_blocks.div_ceil(a.blocks_per_msg),
        };
        tasks.push(tokio::spawn(stream.run(first, period, Arc::clone(&sent))));
    }
    let stop = async {
        loop {
            match lines.next_line().await {
                Ok(Some(l)) if l.trim() == "stop" => return,
                Ok(Some(_)) => continue,
                _ => return,
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(a.max_seconds), stop).await;
    let elapsed = start.elapsed().as_secs_f64();
    for t in &tasks {
        t.abort();
    }
    for t in tasks {
        let _ = t.await;
    }
    let out = serde_json::json!({
        "messages": sent.messages.load(Ordering::Relaxed),
        "blocks": sent.blocks.load(Ordering::Relaxed),
        "payload_bytes": sent.bytes.load(Ordering::Relaxed),
        "late_ticks": sent.late_ticks.load(Ordering::Relaxed),
        "seconds": elapsed,
        "target_blocks": (a.blocks_per_s * a.count as u64) as f64 * elapsed,
    });
    println!("{out}");
    std::io::stdout().flush().unwrap();
}

/// One simulated engine's stream.
struct Stream {
    socket: zeromq::PubSocket,
    index: u64,
    blocks_per_msg: u64,
    block_size: usize,
    /// Messages after which a message's blocks are removed again (the cache stays this full).
    keep_msgs: u64,
}

impl Stream {
    /// Every `period`: one message with a `BlockStored` chain of `blocks_per_msg` new blocks
    /// from a prompt's start (a new prefill; token ids of this stream's own, so every store
    /// and fleet-index entry is distinct) and, once the cache is full, a `BlockRemoved` of the
    /// blocks stored `keep_msgs` messages earlier. vLLM hashes: stream index above bit 40,
    /// block counter below.
    async fn run(mut self, first: tokio::time::Instant, period: Duration, sent: Arc<Sent>) {
        let mut tick = tokio::time::interval_at(first, period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut rng = fastrand::Rng::with_seed(self.index);
        let b = self.blocks_per_msg;
        for seq in 0u64.. {
            let at = tick.tick().await;
            if at.elapsed() > period {
                sent.late_ticks.fetch_add(1, Ordering::Relaxed);
            }
            let base = (self.index << 40) | (seq * b);
            let mut events = Vec::with_capacity(2);
            if seq >= self.keep_msgs {
                let old = (self.index << 40) | ((seq - self.keep_msgs) * b);
                events.push(Event::Removed {
                    block_hashes: (old..old + b).collect(),
                    medium: Medium::Gpu,
                });
            }
            events.push(Event::Stored(Stored {
                block_hashes: (base..base + b).collect(),
                parent: None,
                token_ids: (0..b as usize * self.block_size)
                    .map(|_| rng.u32(..128_000))
                    .collect(),
                block_size: self.block_size as u32,
                lora_name: None,
                medium: Medium::Gpu,
                extra_keys: Vec::new(),
            }));
            let ts = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            let payload = encode::payload(ts, &events);
            let len = payload.len() as u64;
            let mut msg = zeromq::ZmqMessage::from(bytes::Bytes::from_static(b"kv@cost-curves"));
            msg.push_back(bytes::Bytes::copy_from_slice(&seq.to_be_bytes()));
            msg.push_back(bytes::Bytes::from(payload));
            if self.socket.send(msg).await.is_err() {
                return;
            }
            sent.messages.fetch_add(1, Ordering::Relaxed);
            sent.blocks.fetch_add(b, Ordering::Relaxed);
            sent.bytes.fetch_add(len, Ordering::Relaxed);
        }
    }
}
