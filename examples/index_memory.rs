//! Measures the prefix index's memory per entry: resident memory before and after recording
//! 1,000,000 (block, backend) entries, divided by the entries. Run with
//! `cargo run --release --example index_memory` (Linux: reads /proc/self/statm).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use inferlb::scheduling::plugins::scorer::prefix_cache::index::{block_hashes, PrefixIndex};

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("Linux /proc/self/statm");
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

fn main() {
    const ENTRIES: usize = 1_000_000;
    const BACKENDS: usize = 16;
    const BLOCKS_PER_PROMPT: usize = 100;
    // Distinct prompts, each recorded on one backend: every entry is a new block on one backend.
    let prompts = ENTRIES / BLOCKS_PER_PROMPT;
    let mut all = Vec::with_capacity(prompts);
    let mut hashes = Vec::new();
    for p in 0..prompts {
        let text = format!("{p:08}").repeat(8 * BLOCKS_PER_PROMPT);
        block_hashes(Some("m"), &text, 64, BLOCKS_PER_PROMPT, &mut hashes);
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
