//! Measures the prefix index's memory: first per entry (resident memory before and after
//! recording 1,000,000 (block, backend) entries, divided by the entries), then per scheduling
//! profile (resident memory grown by 10,000 decisions of distinct 100-block prompts over 16
//! backends, and the entries held by the profile's prefix matchers), for the default profile
//! and for the same plugins declared in a file. Run with
//! `cargo run --release --all-features --example index_memory` (Linux: reads
//! /proc/self/statm).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Instant;

use inferlb::config::{BackendConfig, Config};
use inferlb::endpoints::engine::LoadMetrics;
use inferlb::endpoints::{ModelEntry, Pool};
use inferlb::prompt::{Operation, RequestView};
use inferlb::scheduling::framework::CycleState;
use inferlb::scheduling::plugins::scorer::prefill_cost::PrefillCostScorer;
use inferlb::scheduling::plugins::scorer::prefix_cache::index::{block_hashes, PrefixIndex};
use inferlb::scheduling::plugins::scorer::prefix_cache::PrefixCacheScorer;
use inferlb::scheduling::profile::build_active;
use inferlb::scheduling::Scheduler;

const BACKENDS: usize = 16;
const BLOCKS_PER_PROMPT: usize = 100;

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("Linux /proc/self/statm");
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// Distinct prompt text number `p`: `BLOCKS_PER_PROMPT` blocks of 64 characters.
fn prompt(p: usize) -> String {
    format!("{p:08}").repeat(8 * BLOCKS_PER_PROMPT)
}

fn per_entry() {
    const ENTRIES: usize = 1_000_000;
    // Distinct prompts, each recorded on one backend: every entry is a new block on one backend.
    let prompts = ENTRIES / BLOCKS_PER_PROMPT;
    let mut all = Vec::with_capacity(prompts);
    let mut hashes = Vec::new();
    for p in 0..prompts {
        block_hashes(Some("m"), &prompt(p), 64, BLOCKS_PER_PROMPT, &mut hashes);
        all.push(hashes.clone());
    }
    let index = PrefixIndex::new();
    let before = resident_bytes();
    for (p, h) in all.iter().enumerate() {
        index.record(p % BACKENDS, 0, ENTRIES as u64, h);
    }
    let after = resident_bytes();
    let entries = index.blocks();
    // A handful of 32-bit key collisions may merge entries; the rest must all be there.
    assert!(entries as usize >= ENTRIES - ENTRIES / 1000, "{entries}");
    println!(
        "prefix index: {entries} entries over {BACKENDS} backends, {:.1} MiB resident, {:.1} bytes/entry",
        (after - before) as f64 / (1 << 20) as f64,
        (after - before) as f64 / entries as f64
    );
}

/// The default profile's plugins declared in a file: `bench/policies/default-prefill-cost.toml`.
const DECLARED_DEFAULT: &str = include_str!("../bench/policies/default-prefill-cost.toml");

/// A scheduler over `BACKENDS` healthy backends with room for every prompt in their caches.
fn scheduler(profile: &str) -> Scheduler {
    let mut config = Config {
        backends: (0..BACKENDS)
            .map(|i| BackendConfig::from_url(format!("http://127.0.0.1:{}", 20_000 + i)))
            .collect(),
        ..Config::from_toml(profile, "probe").unwrap()
    };
    config.poller.stale_after_ms = 3_600_000;
    let pool = Arc::new(Pool::from_config(&config).unwrap());
    for b in pool.backends().iter() {
        let mut state = (*b.state()).clone();
        state.healthy = true;
        state.models = vec![ModelEntry {
            id: "m".into(),
            object: serde_json::json!({"id": "m"}),
        }]
        .into();
        state.metrics = Some((
            LoadMetrics {
                waiting: Some(0.0),
                running: Some(0.0),
                kv_usage: Some(0.0),
                block_size: Some(16),
                // 1.6M tokens: 100,000 blocks of 64 characters per backend, never full here.
                num_gpu_blocks: Some(100_000),
                ..Default::default()
            },
            Instant::now(),
        ));
        b.publish(state);
    }
    Scheduler::new(pool, build_active(config.scheduling()).unwrap())
}

/// The distinct prefix indexes the profile's matchers record into, and their entries.
fn indexes(scheduler: &Scheduler) -> (usize, u64) {
    let profile = scheduler.profile();
    let mut seen: Vec<*const PrefixIndex> = Vec::new();
    let mut entries = 0;
    for plugin in profile.plugins() {
        let any = plugin.as_any();
        let index = if let Some(p) = any.downcast_ref::<PrefixCacheScorer>() {
            Some((std::ptr::from_ref(p.index()), p.index().blocks()))
        } else if let Some(c) = any.downcast_ref::<PrefillCostScorer>() {
            c.with_prefix(|m| (std::ptr::from_ref(m.index()), m.index().blocks()))
        } else {
            None
        };
        if let Some((ptr, blocks)) = index {
            if !seen.contains(&ptr) {
                seen.push(ptr);
                entries += blocks;
            }
        }
    }
    (seen.len(), entries)
}

fn per_profile(name: &str, profile: &str) {
    const DECISIONS: usize = 10_000;
    let scheduler = scheduler(profile);
    let views: Vec<RequestView> = (0..DECISIONS)
        .map(|p| {
            let body = serde_json::json!({"model": "m", "prompt": prompt(p)}).to_string();
            RequestView::parse(Operation::Completions, body.as_bytes()).unwrap()
        })
        .collect();
    let before = resident_bytes();
    for view in &views {
        let mut state = CycleState::default();
        let Ok(mut guard) = scheduler.schedule(view, &mut state, &[]) else {
            panic!("no backend")
        };
        scheduler.sent(view, &state, &mut guard);
    }
    let after = resident_bytes();
    let (n, entries) = indexes(&scheduler);
    println!(
        "{name} profile: {DECISIONS} decisions of {BLOCKS_PER_PROMPT}-block prompts over \
         {BACKENDS} backends: {n} prefix index(es) holding {entries} entries, {:.1} MiB resident",
        after.saturating_sub(before) as f64 / (1 << 20) as f64,
    );
}

fn main() {
    per_entry();
    per_profile("default", "");
    per_profile("declared default", DECLARED_DEFAULT);
}
