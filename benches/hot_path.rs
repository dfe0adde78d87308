//! Criterion benches of the per-request hot path: prompt hashing and prefix matching, a full
//! scheduling decision with every default plugin, and parsing a real vLLM `/metrics` page.
//!
//! `cargo bench --bench hot_path` (add `-- --quick` for a fast pass). The aims are in
//! issue #4: a decision for a 32k-character prompt at 64 backends ≤ 50 µs; for a 1k-character
//! prompt at 100 backends ≤ 10 µs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

/// The binary's allocator, so allocation-heavy paths (tokenization) cost what they cost there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod support;

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

/// The default profile's plugins declared in a file: `bench/policies/default-prefill-cost.toml`
/// (the prefill-cost scorer with its parameters left at their defaults).
const DECLARED_DEFAULT: &str = include_str!("../bench/policies/default-prefill-cost.toml");

/// A pool of `n` healthy backends serving `m`, with fresh metrics, and a scheduler using the
/// default profile whose prefix index already holds `groups` prompts spread over the pool.
fn fleet(n: usize, groups: usize, prompt_len: usize) -> (Arc<Scheduler>, Vec<RequestView>) {
    fleet_with("", n, groups, prompt_len)
}

/// [`fleet`] with the scheduling part of a config file (`""`: the default profile).
fn fleet_with(
    profile: &str,
    n: usize,
    groups: usize,
    prompt_len: usize,
) -> (Arc<Scheduler>, Vec<RequestView>) {
    let mut config = Config {
        backends: (0..n)
            .map(|i| BackendConfig::from_url(format!("http://127.0.0.1:{}", 20_000 + i)))
            .collect(),
        ..Config::from_toml(profile, "bench").unwrap()
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
    let scheduler = Arc::new(Scheduler::new(
        pool,
        build_active(config.scheduling()).unwrap(),
    ));
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
    // The same decisions with the default profile's plugins declared in the file.
    let mut g = c.benchmark_group("declared_decision");
    for (backends, len) in [(64, 1_000), (64, 32_000)] {
        let (scheduler, views) = fleet_with(DECLARED_DEFAULT, backends, 64, len);
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

/// One vLLM 0.32 `BlockStored` map with every field vLLM writes (as in the committed capture:
/// `lora_id`, `lora_name`, `extra_keys` as nils, `group_idx`, `kv_cache_spec_kind`).
fn vllm_stored(out: &mut Vec<u8>, hashes: &[u64], parent: Option<u64>, tokens: &[u32], bs: u32) {
    use rmp::encode as e;
    e::write_map_len(out, 11).unwrap();
    e::write_str(out, "type").unwrap();
    e::write_str(out, "BlockStored").unwrap();
    e::write_str(out, "block_hashes").unwrap();
    e::write_array_len(out, hashes.len() as u32).unwrap();
    for h in hashes {
        e::write_uint(out, *h).unwrap();
    }
    e::write_str(out, "parent_block_hash").unwrap();
    match parent {
        Some(p) => {
            e::write_uint(out, p).unwrap();
        }
        None => e::write_nil(out).unwrap(),
    }
    e::write_str(out, "token_ids").unwrap();
    e::write_array_len(out, tokens.len() as u32).unwrap();
    for t in tokens {
        e::write_uint(out, u64::from(*t)).unwrap();
    }
    e::write_str(out, "block_size").unwrap();
    e::write_uint(out, u64::from(bs)).unwrap();
    e::write_str(out, "lora_id").unwrap();
    e::write_nil(out).unwrap();
    e::write_str(out, "medium").unwrap();
    e::write_str(out, "GPU").unwrap();
    e::write_str(out, "lora_name").unwrap();
    e::write_nil(out).unwrap();
    e::write_str(out, "extra_keys").unwrap();
    e::write_array_len(out, hashes.len() as u32).unwrap();
    for _ in hashes {
        e::write_nil(out).unwrap();
    }
    e::write_str(out, "group_idx").unwrap();
    e::write_uint(out, 0).unwrap();
    e::write_str(out, "kv_cache_spec_kind").unwrap();
    e::write_str(out, "full_attention").unwrap();
}

fn vllm_removed(out: &mut Vec<u8>, hash: u64) {
    use rmp::encode as e;
    e::write_map_len(out, 4).unwrap();
    e::write_str(out, "type").unwrap();
    e::write_str(out, "BlockRemoved").unwrap();
    e::write_str(out, "block_hashes").unwrap();
    e::write_array_len(out, 1).unwrap();
    e::write_uint(out, hash).unwrap();
    e::write_str(out, "medium").unwrap();
    e::write_str(out, "GPU").unwrap();
    e::write_str(out, "group_idx").unwrap();
    e::write_uint(out, 0).unwrap();
}

/// `count` messages shaped like a busy vLLM's engine steps: each step prefills 2,048 tokens of
/// one new prompt (one `BlockStored` chain from the start), completes a block for 16 decoding
/// requests (16 one-block `BlockStored` whose parent is a block stored a step earlier), and,
/// the cache being full, evicts as many blocks as it stored, one `BlockRemoved` per block as
/// the capture shows. Returns the messages and the blocks stored per message.
fn vllm_steps(count: usize, bs: usize) -> (Vec<Vec<u8>>, u64) {
    let prefill_blocks = 2_048 / bs;
    let decode = 16usize;
    let per_step = prefill_blocks + decode;
    // Blocks stay cached for `keep` steps before vLLM evicts them.
    let keep = 64usize;
    let mut rng = fastrand::Rng::with_seed(7);
    let mut stored: Vec<Vec<u64>> = Vec::with_capacity(count);
    let mut next_hash = 1u64 << 40;
    let mut messages = Vec::with_capacity(count);
    for m in 0..count {
        let mut out = Vec::new();
        let events = per_step + 1 + decode;
        rmp::encode::write_array_len(&mut out, 3).unwrap();
        rmp::encode::write_f64(&mut out, 1.7e9 + m as f64 * 0.01).unwrap();
        rmp::encode::write_array_len(&mut out, events as u32).unwrap();
        // Evictions of the step `keep` earlier (cyclically, so replaying stays consistent).
        let old = (m + count - keep % count) % count;
        for i in 0..per_step {
            let h = (old * per_step + i) as u64 + (1 << 40);
            vllm_removed(&mut out, h);
        }
        let mut mine = Vec::with_capacity(per_step);
        let mut take = || {
            let h = next_hash;
            next_hash += 1;
            h
        };
        let hashes: Vec<u64> = (0..prefill_blocks).map(|_| take()).collect();
        let tokens: Vec<u32> = (0..prefill_blocks * bs)
            .map(|_| rng.u32(..128_000))
            .collect();
        vllm_stored(&mut out, &hashes, None, &tokens, bs as u32);
        mine.extend_from_slice(&hashes);
        for d in 0..decode {
            let parent = m
                .checked_sub(1)
                .and_then(|p| stored.get(p))
                .map(|prev: &Vec<u64>| prev[d % prev.len()]);
            let h = take();
            let tokens: Vec<u32> = (0..bs).map(|_| rng.u32(..128_000)).collect();
            vllm_stored(&mut out, &[h], parent, &tokens, bs as u32);
            mine.push(h);
        }
        rmp::encode::write_uint(&mut out, 0).unwrap(); // data_parallel_rank
        stored.push(mine);
        messages.push(out);
    }
    (messages, per_step as u64)
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
        store.set_connected(true);
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
    // Busy-engine steps in vLLM 0.32's exact encoding, 256 messages replayed in turn on a store
    // bounded by num_gpu_blocks = 20,000 (vLLM's own removals keep it below the bound).
    for bs in [16usize, 128] {
        let (messages, per_message) = vllm_steps(256, bs);
        let store = BlockStore::default();
        store.turn_on(10_000, "bench".into());
        store.set_connected(true);
        store.set_gpu_blocks(Some(20_000));
        for (i, m) in messages.iter().enumerate() {
            store.apply(i as u64, &decode_payload(i as u64, m).unwrap().events, 0);
        }
        let mut seq = 0u64;
        g.throughput(Throughput::Elements(per_message));
        g.bench_function(BenchmarkId::new("vllm_steps", bs), |b| {
            b.iter(|| {
                let m = &messages[(seq % 256) as usize];
                let batch = decode_payload(seq, m).unwrap();
                store.apply(seq, &batch.events, 0);
                seq += 1;
            })
        });
    }
    // The committed real capture (28 messages, block size 128), replayed in turn.
    {
        let raw = include_bytes!("../tests/fixtures/vllm-0.32-cpu-frames.msgpack");
        let frames: Vec<Vec<Vec<u8>>> = rmp_serde_free_decode(raw);
        let payloads: Vec<Vec<u8>> = frames.into_iter().map(|mut f| f.remove(2)).collect();
        let blocks: u64 = payloads
            .iter()
            .map(|p| {
                decode_payload(0, p)
                    .unwrap()
                    .events
                    .iter()
                    .map(|e| match e {
                        inferlb::kv_events::wire::Event::Stored(s) => s.block_hashes.len() as u64,
                        _ => 0,
                    })
                    .sum::<u64>()
            })
            .sum();
        let store = BlockStore::default();
        store.turn_on(10_000, "bench".into());
        store.set_connected(true);
        store.set_gpu_blocks(Some(64));
        let mut seq = 0u64;
        g.throughput(Throughput::Elements(blocks));
        g.bench_function(BenchmarkId::new("real_capture_pass", 128), |b| {
            b.iter(|| {
                for p in &payloads {
                    let batch = decode_payload(seq, p).unwrap();
                    store.apply(seq, &batch.events, 0);
                    seq += 1;
                }
            })
        });
    }
    g.finish();
}

/// The capture file: one msgpack array of `[topic, seq, payload]` byte strings.
fn rmp_serde_free_decode(mut raw: &[u8]) -> Vec<Vec<Vec<u8>>> {
    let n = rmp::decode::read_array_len(&mut raw).unwrap();
    (0..n)
        .map(|_| {
            let parts = rmp::decode::read_array_len(&mut raw).unwrap();
            (0..parts)
                .map(|_| {
                    let len = rmp::decode::read_bin_len(&mut raw).unwrap() as usize;
                    let (head, rest) = raw.split_at(len);
                    raw = rest;
                    head.to_vec()
                })
                .collect()
        })
        .collect()
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
        b.kv().set_connected(true);
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
    chat_decisions(&mut g);
    g.finish();
}

/// Prose-like text of exactly `chars` characters for the tokenizer benches.
fn chat_text(chars: usize, seed: u64) -> String {
    let mut s = support::prose(chars, seed);
    s.truncate(chars);
    s
}

/// The aim: a full precise decision for a 32k-character chat prompt at 64 backends,
/// as the front door makes it: parse the body, tokenize it (tests/fixtures/tiny-llama: render
/// the chat template, BPE; the prefix cache warm with the system prompt, or off), then the
/// default profile's decision, whose prefix scorer chain-hashes the ids and matches them
/// against 64 live stores (block size 16; backend i holds the first i/64 of the system
/// prompt's blocks) — and records the pick. Each iteration has a new user message.
fn chat_decisions(g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    use inferlb::config::TokenizationConfig;
    use inferlb::kv_events::wire::{Event, Medium, Stored};
    use inferlb::tokenization::Tokenizers;
    let load = |cache_tokens: u64| {
        Tokenizers::load(&TokenizationConfig {
            dir: Some(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-llama").into()),
            prefix_cache_tokens: cache_tokens,
            ..TokenizationConfig::default()
        })
        .unwrap()
    };
    // (name, system chars, user chars): 90 % / 10 %, and a short turn after a long system prompt.
    for (name, system_chars, user_chars) in [
        ("chat_32k_chars_90_10", 28_800usize, 3_200usize),
        ("chat_32k_chars_short_turn", 31_500, 500),
    ] {
        let system = chat_text(system_chars, 1);
        for (mode, cache) in [("warm", 4_000_000u64), ("cold", 0)] {
            let tokenizers = load(cache);
            let (scheduler, _) = fleet(64, 1, 1_000);
            // The system prompt's ids, as the backends' events report them.
            let probe = support::chat_body(&system, "x");
            let mut v = RequestView::parse(Operation::ChatCompletions, &probe).unwrap();
            tokenizers.fill(&mut v, &probe);
            let ids = v.tokens.as_ref().unwrap().ids.clone();
            let blocks = ids.len() / 16;
            for (i, b) in scheduler.pool().backends().iter().enumerate() {
                let held = blocks * i / 64;
                b.kv().turn_on(3_600_000, "bench".into());
                b.kv().set_connected(true);
                b.kv().apply(
                    0,
                    &[Event::Stored(Stored {
                        block_hashes: (0..held as u64).map(|h| (i as u64) << 32 | h).collect(),
                        parent: None,
                        token_ids: ids[..held * 16].to_vec(),
                        block_size: 16,
                        lora_name: None,
                        medium: Medium::Gpu,
                        extra_keys: Vec::new(),
                    })],
                    0,
                );
            }
            let mut n = 0u64;
            // Warm the prefix cache with the system prompt.
            let warmup = support::chat_body(&system, &chat_text(user_chars, 999));
            let mut v = RequestView::parse(Operation::ChatCompletions, &warmup).unwrap();
            tokenizers.fill(&mut v, &warmup);
            if mode == "warm" && name == "chat_32k_chars_90_10" {
                decision_split(g, name, &system, user_chars, &tokenizers, &scheduler);
            }
            g.bench_function(BenchmarkId::new(format!("{name}_{mode}"), 64), |b| {
                b.iter_batched(
                    || {
                        n += 1;
                        support::chat_body(&system, &chat_text(user_chars, n + 2))
                    },
                    |body| {
                        let mut view =
                            RequestView::parse(Operation::ChatCompletions, &body).unwrap();
                        tokenizers.fill(&mut view, &body);
                        debug_assert!(view.tokens.is_some());
                        black_box(decide(&scheduler, &view))
                    },
                    criterion::BatchSize::SmallInput,
                )
            });
        }
    }
}

/// The split of one precise decision with new text (#27): each stage timed alone on inputs
/// made outside the timing, every iteration with a new user message. `parse`: the body into
/// a view; `tokenize`: chat template and BPE of a parsed view (the tokenizer's prefix cache
/// warm with the system prompt); `chain_hash`: the token ids' block-hash chain (block size 16,
/// as the stores here); `decide`: the default profile's decision on a view with its ids, which
/// is the chain hash plus the index walk over 64 stores plus the rest of the scheduler (the
/// walk and the rest are `decide` less `chain_hash`).
fn decision_split(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    system: &str,
    user_chars: usize,
    tokenizers: &inferlb::tokenization::Tokenizers,
    scheduler: &Scheduler,
) {
    use criterion::BatchSize::SmallInput;
    let mut n = 1_000_000u64;
    let mut body = || {
        n += 1;
        support::chat_body(system, &chat_text(user_chars, n))
    };
    let filled = |body: Vec<u8>| {
        let mut view = RequestView::parse(Operation::ChatCompletions, &body).unwrap();
        tokenizers.fill(&mut view, &body);
        assert!(view.tokens.is_some());
        view
    };
    g.bench_function(BenchmarkId::new(format!("{name}_split_parse"), 64), |b| {
        b.iter_batched(
            &mut body,
            |body| black_box(RequestView::parse(Operation::ChatCompletions, &body).unwrap()),
            SmallInput,
        )
    });
    g.bench_function(
        BenchmarkId::new(format!("{name}_split_tokenize"), 64),
        |b| {
            b.iter_batched(
                || {
                    let body = body();
                    let view = RequestView::parse(Operation::ChatCompletions, &body).unwrap();
                    (body, view)
                },
                |(body, mut view)| {
                    tokenizers.fill(&mut view, &body);
                    black_box(view)
                },
                SmallInput,
            )
        },
    );
    g.bench_function(
        BenchmarkId::new(format!("{name}_split_chain_hash"), 64),
        |b| {
            b.iter_batched(
                || filled(body()),
                |view| {
                    let ids = &view.tokens.as_ref().unwrap().ids;
                    let mut out = Vec::with_capacity(ids.len() / 16);
                    inferlb::kv_events::chain::prompt_chain(
                        ids,
                        16,
                        None,
                        None,
                        usize::MAX,
                        &mut out,
                    );
                    black_box(out)
                },
                SmallInput,
            )
        },
    );
    g.bench_function(BenchmarkId::new(format!("{name}_split_decide"), 64), |b| {
        b.iter_batched(
            || filled(body()),
            |view| black_box(decide(scheduler, &view)),
            SmallInput,
        )
    });
    // Criterion gives means; the target is per decision (p50 and p99): time 2,000
    // whole decisions one by one, each stage apart, and print the quantiles.
    let mut stages: [Vec<f64>; 5] = Default::default();
    for _ in 0..2_000 {
        let body = body();
        let t0 = std::time::Instant::now();
        let mut view = RequestView::parse(Operation::ChatCompletions, &body).unwrap();
        let t1 = std::time::Instant::now();
        tokenizers.fill(&mut view, &body);
        let t2 = std::time::Instant::now();
        let ids = &view.tokens.as_ref().unwrap().ids;
        let mut out = Vec::with_capacity(ids.len() / 16);
        inferlb::kv_events::chain::prompt_chain(ids, 16, None, None, usize::MAX, &mut out);
        black_box(&out);
        let t3 = std::time::Instant::now();
        black_box(decide(scheduler, &view));
        let t4 = std::time::Instant::now();
        for (stage, (a, b)) in
            stages
                .iter_mut()
                .zip([(t0, t1), (t1, t2), (t2, t3), (t3, t4), (t0, t4)])
        {
            stage.push(b.duration_since(a).as_secs_f64() * 1e6);
        }
    }
    for (label, mut v) in [
        "parse",
        "tokenize",
        "chain_hash",
        "decide",
        "whole (parse + tokenize + decide, chain hash twice)",
    ]
    .into_iter()
    .zip(stages)
    {
        v.sort_by(f64::total_cmp);
        let q = |p: f64| v[((v.len() - 1) as f64 * p) as usize];
        eprintln!(
            "{name} warm, 64 backends, 2,000 single decisions: {label} p50 {:.1} us, p99 {:.1} us",
            q(0.5),
            q(0.99)
        );
    }
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
