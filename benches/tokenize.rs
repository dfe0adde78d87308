//! Tokenizing chat prompts (tests/fixtures/tiny-llama: byte-level BPE, 2,048 ids): render the
//! template + BPE, for prompts of 1k, 8k and 32k characters; cold (no prefix cache) and warm (the
//! same system prompt with a new user message each time, the prefix cache holding the system
//! part).  `cargo bench --bench tokenize`

use std::sync::atomic::{AtomicU64, Ordering};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use inferlb::config::TokenizationConfig;
use inferlb::tokenization::Tokenizers;

const WORDS: &[&str] = &[
    "the",
    "model",
    "cache",
    "prefix",
    "token",
    "request",
    "server",
    "router",
    "load",
    "balance",
    "hello",
    "world",
    "system",
    "user",
    "assistant",
    "question",
    "answer",
    "number",
    "water",
];

fn text(chars: usize, seed: u64) -> String {
    let mut s = String::with_capacity(chars + 16);
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    while s.len() < chars {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
        s.push(if x % 11 == 0 { '\n' } else { ' ' });
    }
    s
}

fn body(system: &str, user: &str) -> Vec<u8> {
    serde_json::json!({"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]})
    .to_string()
    .into_bytes()
}

fn load(cache_tokens: u64) -> Tokenizers {
    let cfg = TokenizationConfig {
        dir: Some(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-llama").into()),
        prefix_cache_tokens: cache_tokens,
        ..TokenizationConfig::default()
    };
    match Tokenizers::load(&cfg) {
        Ok(t) => t,
        Err(e) => panic!("{e}"),
    }
}

fn bench(c: &mut Criterion) {
    let cold = load(0);
    let warm = load(4_000_000);
    let (Some(cold), Some(warm)) = (cold.for_model(None), warm.for_model(None)) else {
        panic!("no default tokenizer");
    };
    let mut g = c.benchmark_group("tokenize_chat");
    for chars in [1_000usize, 8_000, 32_000] {
        // 90 % system prompt, 10 % user message: the shape of a repeated-system-prompt workload.
        let system = text(chars * 9 / 10, 1);
        let counter = AtomicU64::new(0);
        g.bench_with_input(BenchmarkId::new("cold", chars), &chars, |b, &chars| {
            b.iter_batched(
                || {
                    body(
                        &system,
                        &text(chars / 10, counter.fetch_add(1, Ordering::Relaxed) + 2),
                    )
                },
                |req| cold.chat_ids(&req),
                criterion::BatchSize::SmallInput,
            )
        });
        g.bench_with_input(BenchmarkId::new("warm", chars), &chars, |b, &chars| {
            b.iter_batched(
                || {
                    body(
                        &system,
                        &text(chars / 10, counter.fetch_add(1, Ordering::Relaxed) + 2),
                    )
                },
                |req| warm.chat_ids(&req),
                criterion::BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
