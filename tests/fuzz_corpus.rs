//! Replays the committed fuzz corpora (fuzz/corpus/*) through the same checks as the fuzz
//! targets, so every input the fuzzers found interesting — and any crash input saved there —
//! stays a regression test in the ordinary test run, without a nightly toolchain.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use inferlb::endpoints::engine::{extract, EngineMetricNames};
use inferlb::endpoints::prometheus::samples;
use inferlb::prompt::{json_depth, Operation, RequestView};

fn corpus(name: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(name);
    let mut inputs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| std::fs::read(e.unwrap().path()).unwrap())
        .collect();
    inputs.sort();
    inputs
}

#[test]
fn prompt_corpus() {
    let inputs = corpus("prompt");
    assert!(inputs.len() >= 4);
    let mut parsed = 0;
    for data in &inputs {
        let _ = json_depth(data);
        for op in [
            Operation::ChatCompletions,
            Operation::Completions,
            Operation::Other,
        ] {
            if let Ok(view) = RequestView::parse(op, data) {
                assert_eq!(view.routing_text.is_some(), op != Operation::Other);
                parsed += 1;
            }
        }
    }
    assert!(parsed > 0, "the seeds include valid requests");
}

#[test]
fn metrics_page_corpus() {
    let inputs = corpus("metrics_page");
    assert!(inputs.len() >= 3);
    for data in &inputs {
        let Ok(page) = std::str::from_utf8(data) else {
            continue;
        };
        for sample in samples(page).flatten() {
            for (k, v) in sample.labels() {
                let _ = (k.len(), v.len());
            }
        }
        for engine in ["vllm", "sglang"] {
            let names = EngineMetricNames::builtin(engine).unwrap();
            if let Ok(m) = extract(page, &names) {
                if let Some(kv) = m.kv_usage {
                    assert!((0.0..=1.0).contains(&kv));
                }
            }
        }
    }
}
