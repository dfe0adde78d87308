//! Criterion benches of the per-request hot path: prompt hashing and prefix matching, a full
//! scheduling decision with every default plugin, and parsing a real vLLM `/metrics` page.
//!
//! `cargo bench --bench hot_path` (add `-- --quick` for a fast pass). The aims are in
//! issue #4: a decision for a 32k-character prompt at 64 backends ≤ 50 µs; for a 1k-character
//! prompt at 100 backends ≤ 10 µs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use inferlb::config::{BackendConfig, Config};
use inferlb::endpoints::engine::{extract, EngineMetricNames, LoadMetrics};
use inferlb::endpoints::{ModelEntry, Pool};
use inferlb::prompt::{Operation, RequestView};
use inferlb::scheduling::framework::CycleState;
use inferlb::scheduling::plugins::scorer::prefix_cache::index::{block_hashes, PrefixIndex};
use inferlb::scheduling::profile::build_active;
use inferlb::scheduling::Scheduler;

/// Deterministic prose-like text of `len` bytes; `seed` changes it from the first word.
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

fn view(prompt: &str) -> RequestView {
    let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": prompt}]});
    RequestView::parse(Operation::ChatCompletions, body.to_string().as_bytes()).unwrap()
}

fn hashing(c: &mut Criterion) {
    let mut g = c.benchmark_group("prefix");
    for len in [1_000, 8_000, 32_000] {
        let t = text(len, 1);
        g.throughput(Throughput::Bytes(len as u64));
        g.bench_with_input(BenchmarkId::new("hash", len), &t, |b, t| {
            let mut out = Vec::new();
            b.iter(|| block_hashes(Some("m"), black_box(t), 64, 4096, &mut out));
        });
        // Match against an index where 8 of 64 backends hold the whole prompt.
        let index = PrefixIndex::new();
        let mut hashes = Vec::new();
        block_hashes(Some("m"), &t, 64, 4096, &mut hashes);
        for backend in 0..8 {
            index.record(backend * 8, 0, 1_000_000, &hashes);
        }
        let candidates: Vec<(usize, u64)> = (0..64).map(|b| (b, 0)).collect();
        let mut out = vec![0; 64];
        g.bench_with_input(
            BenchmarkId::new("match_64_backends", len),
            &hashes,
            |b, h| {
                b.iter(|| index.match_lengths(black_box(h), &candidates, &mut out));
            },
        );
    }
    g.finish();
}

/// A pool of `n` healthy backends serving `m`, with fresh metrics, and a scheduler using the
/// default profile whose prefix index already holds `groups` prompts spread over the pool.
fn fleet(n: usize, groups: usize, prompt_len: usize) -> (Arc<Scheduler>, Vec<RequestView>) {
    let mut config = Config {
        backends: (0..n)
            .map(|i| BackendConfig::from_url(format!("http://127.0.0.1:{}", 20_000 + i)))
            .collect(),
        ..Config::default()
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
                block_size: Some(16),
                num_gpu_blocks: Some(20_000),
                ..Default::default()
            },
            Instant::now(),
        ));
        b.publish(state);
    }
    let scheduler = Arc::new(Scheduler::new(pool, build_active(&config).unwrap()));
    let views: Vec<_> = (0..groups)
        .map(|g| view(&text(prompt_len, g as u64)))
        .collect();
    for v in &views {
        decide(&scheduler, v);
    }
    (scheduler, views)
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

fn decision(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision");
    for (backends, len) in [
        (4, 1_000),
        (64, 1_000),
        (100, 1_000),
        (512, 1_000),
        (4, 32_000),
        (64, 32_000),
        (512, 32_000),
    ] {
        let (scheduler, views) = fleet(backends, 64, len);
        let mut i = 0;
        g.bench_function(BenchmarkId::new(format!("{len}_chars"), backends), |b| {
            b.iter(|| {
                i = (i + 1) % views.len();
                black_box(decide(&scheduler, &views[i]));
            })
        });
    }
    g.finish();
}

fn metrics_page(c: &mut Criterion) {
    let page = include_str!("../tests/fixtures/vllm-0.32-cpu.txt");
    let names = EngineMetricNames::builtin("vllm").unwrap();
    let mut g = c.benchmark_group("metrics");
    g.throughput(Throughput::Bytes(page.len() as u64));
    g.bench_function("parse_real_vllm_page", |b| {
        b.iter(|| extract(black_box(page), &names).unwrap())
    });
    g.finish();
}

/// One membership change (a pod replaced by a new one) at 100 and 1,000 backends: the whole
/// desired set is handed to `Pool::reconcile`, which diffs it and swaps in a new snapshot.
fn membership(c: &mut Criterion) {
    use inferlb::config::DiscoverySource;
    use inferlb::discovery::DesiredBackend;
    let mut g = c.benchmark_group("membership_change");
    for n in [100usize, 1_000] {
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
        let mut flip = false;
        g.bench_function(BenchmarkId::from_parameter(n), |bench| {
            bench.iter(|| {
                flip = !flip;
                let next = if flip { b.clone() } else { a.clone() };
                black_box(pool.reconcile("file", next))
            })
        });
    }
    g.finish();
}

/// `n` BlockStored events of `blocks` blocks of `bs` tokens each, encoded as vLLM 0.32 does.
fn stored_batch(n: usize, blocks: usize, bs: usize, seed: u64) -> Vec<u8> {
    use inferlb::kv_events::wire::{encode, Event, Medium, Stored};
    let events: Vec<Event> = (0..n)
        .map(|e| {
            let base = seed * 1_000_000 + (e * blocks) as u64;
            Event::Stored(Stored {
                block_hashes: (0..blocks as u64).map(|i| base + i).collect(),
                parent: None,
                token_ids: (0..(blocks * bs) as u32)
                    .map(|t| (t.wrapping_mul(2_654_435_761) ^ base as u32) % 128_000)
                    .collect(),
                block_size: bs as u32,
                lora_name: None,
                medium: Medium::Gpu,
                extra_keys: Vec::new(),
            })
        })
        .collect();
    encode::payload(0.0, &events)
}

/// Decoding and applying KV-event messages on one backend's store (the subscriber's work).
fn kv_ingest(c: &mut Criterion) {
    use inferlb::kv_events::store::BlockStore;
    use inferlb::kv_events::wire::decode_payload;
    let mut g = c.benchmark_group("kv_ingest");
    for bs in [16usize, 128] {
        // 32 events of 16 blocks per message; 64 different messages, applied in turn to a
        // store bounded at 100k blocks (so eviction runs too).
        let messages: Vec<Vec<u8>> = (0..64).map(|m| stored_batch(32, 16, bs, m)).collect();
        let store = BlockStore::default();
        store.turn_on(10_000, "bench".into());
        store.set_gpu_blocks(Some(100_000));
        let mut seq = 0u64;
        g.throughput(Throughput::Elements(32 * 16));
        g.bench_function(BenchmarkId::new("decode_apply_blocks", bs), |b| {
            b.iter(|| {
                let m = &messages[(seq % 64) as usize];
                let batch = decode_payload(seq, m).unwrap();
                store.apply(seq, &batch.events, 0);
                seq += 1;
            })
        });
    }
    g.finish();
}

/// A full decision with precise data: 64 backends with live streams, each holding a different
/// share of a 32k-token prompt's blocks (block size 16), the request given as token ids.
fn precise_decision(c: &mut Criterion) {
    use inferlb::kv_events::wire::{Event, Medium, Stored};
    let (scheduler, _) = fleet(64, 1, 1_000);
    let ids: Vec<u32> = (0..32_768u32)
        .map(|t| t.wrapping_mul(2_654_435_761) % 128_000)
        .collect();
    for (i, b) in scheduler.pool().backends().iter().enumerate() {
        let blocks = (i * 32).min(2_048);
        b.kv().turn_on(3_600_000, "bench".into());
        b.kv().apply(
            0,
            &[Event::Stored(Stored {
                block_hashes: (0..blocks as u64).map(|h| (i as u64) << 32 | h).collect(),
                parent: None,
                token_ids: ids[..blocks * 16].to_vec(),
                block_size: 16,
                lora_name: None,
                medium: Medium::Gpu,
                extra_keys: Vec::new(),
            })],
            0,
        );
    }
    let body = serde_json::json!({"model": "m", "prompt": ids}).to_string();
    let view = RequestView::parse(Operation::Completions, body.as_bytes()).unwrap();
    assert!(view.tokens.is_some());
    let mut g = c.benchmark_group("precise_decision");
    g.bench_function(BenchmarkId::new("32k_tokens", 64), |b| {
        b.iter(|| black_box(decide(&scheduler, &view)))
    });
    g.finish();
}

criterion_group!(
    benches,
    hashing,
    decision,
    metrics_page,
    membership,
    kv_ingest,
    precise_decision
);
criterion_main!(benches);
