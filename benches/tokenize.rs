//! Tokenizing prompts (tests/fixtures/tiny-llama: byte-level BPE, 2,048 ids) as the front door
//! does ([`Tokenizers::fill`]), for prompts of 1k, 8k and 32k characters:
//! * chat: render the template + BPE; cold (no prefix cache) and warm (the same system prompt,
//!   90 % of the characters, with a new user message each time: the prefix cache holds the
//!   system part);
//! * completion (a text prompt, special tokens on): cold and warm — completions have no safe
//!   cut unless the text contains an added token, so "warm" shows the cache costs nothing there.
//!
//! * unseen words: text of random letter strings, no word ever repeated (BPE merging itself).
//!
//! `cargo bench --all-features --bench tokenize` (add `-- --quick` for a fast pass).

/// The binary's allocator (tokenization allocates a lot; glibc's malloc would overstate it).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod support;

use std::sync::atomic::{AtomicU64, Ordering};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use inferlb::config::TokenizationConfig;
use inferlb::prompt::{Operation, RequestView};
use inferlb::tokenization::Tokenizers;

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

/// The front door's work: parse the body, fill the token ids.
fn fill(t: &Tokenizers, op: Operation, body: &[u8]) -> usize {
    let mut view = match RequestView::parse(op, body) {
        Ok(v) => v,
        Err(e) => panic!("{e}"),
    };
    t.fill(&mut view, body);
    view.tokens.map_or(0, |t| t.ids.len())
}

fn completions(c: &mut Criterion) {
    let tokenizers = [("cold", load(0)), ("warm", load(4_000_000))];
    let mut g = c.benchmark_group("tokenize_completion");
    for chars in [1_000usize, 8_000, 32_000] {
        let counter = AtomicU64::new(0);
        for (mode, t) in &tokenizers {
            g.bench_with_input(BenchmarkId::new(*mode, chars), &chars, |b, &chars| {
                b.iter_batched(
                    || {
                        // 90 % the same text, the end new each time.
                        let head = support::prose(chars * 9 / 10, 1);
                        let tail =
                            support::prose(chars / 10, counter.fetch_add(1, Ordering::Relaxed) + 2);
                        serde_json::json!({"model": "m", "prompt": head + &tail})
                            .to_string()
                            .into_bytes()
                    },
                    |req| fill(t, Operation::Completions, &req),
                    criterion::BatchSize::SmallInput,
                )
            });
        }
    }
    g.finish();
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
        let system = support::prose(chars * 9 / 10, 1);
        let counter = AtomicU64::new(0);
        g.bench_with_input(BenchmarkId::new("cold", chars), &chars, |b, &chars| {
            b.iter_batched(
                || {
                    support::chat_body(
                        &system,
                        &support::prose(chars / 10, counter.fetch_add(1, Ordering::Relaxed) + 2),
                    )
                },
                |req| cold.chat_ids(&req),
                criterion::BatchSize::SmallInput,
            )
        });
        g.bench_with_input(BenchmarkId::new("warm", chars), &chars, |b, &chars| {
            b.iter_batched(
                || {
                    support::chat_body(
                        &system,
                        &support::prose(chars / 10, counter.fetch_add(1, Ordering::Relaxed) + 2),
                    )
                },
                |req| warm.chat_ids(&req),
                criterion::BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

/// Text whose words were never seen: every word a fresh random string of 2-9 letters, so no
/// word cache (ours or `tokenizers`') can help — the cost of BPE merging itself, the worst
/// case for text. The prefix cache is off.
fn unseen_words(c: &mut Criterion) {
    let t = load(0);
    let mut g = c.benchmark_group("tokenize_unseen_words");
    let seed = AtomicU64::new(0x2545_f491_4f6c_dd1d);
    for chars in [1_000usize, 8_000, 32_000] {
        g.bench_with_input(
            BenchmarkId::new("completion", chars),
            &chars,
            |b, &chars| {
                b.iter_batched(
                    || {
                        let mut x = seed.fetch_add(0x9e37_79b9, Ordering::Relaxed) | 1;
                        let mut text = String::with_capacity(chars + 16);
                        while text.len() < chars {
                            x ^= x << 13;
                            x ^= x >> 7;
                            x ^= x << 17;
                            for k in 0..2 + x % 8 {
                                text.push(char::from(b'a' + ((x >> (5 * k + 8)) % 26) as u8));
                            }
                            text.push(' ');
                        }
                        serde_json::json!({"model": "m", "prompt": text})
                            .to_string()
                            .into_bytes()
                    },
                    |req| fill(&t, Operation::Completions, &req),
                    criterion::BatchSize::SmallInput,
                )
            },
        );
    }
    g.finish();
}

criterion_group!(benches, bench, completions, unseen_words);
criterion_main!(benches);
