//! Replays the committed fuzz corpora (fuzz/corpus/*) and checks each input's outcome, so
//! every input the fuzzers found interesting — and any crash input saved there — stays a
//! regression test in the ordinary test run, without a nightly toolchain.
//!
//! Three layers of expectation:
//! 1. Per input, the outcome recorded in `fuzz/expected/<target>.tsv`: accepted or rejected
//!    for each operation, and what was extracted (a hash of the routing text; the metric
//!    values read from a page). A change in any outcome fails and names the input. After a
//!    deliberate change, re-record with `INFERLB_BLESS_FUZZ=1 cargo test --test fuzz_corpus`
//!    and review the diff of the `.tsv` files.
//! 2. Per input class, rules that hold whatever was recorded: bytes that are not JSON are
//!    rejected by every JSON operation; an accepted chat body has a non-empty `messages`
//!    array and its routing text holds every string content; an accepted completion with a
//!    string prompt routes on exactly that string; the real vLLM pages give the values
//!    written in them.
//! 3. Count floors per class, so a corpus mostly deleted (with its records) fails too.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use inferlb::endpoints::engine::{extract, EngineMetricNames, LoadMetrics};
use inferlb::endpoints::prometheus::samples;
use inferlb::prompt::{json_depth, Operation, RequestView};
use xxhash_rust::xxh3::xxh3_64;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// (file name, bytes) of every input of `target`, sorted by name.
fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = root().join("fuzz/corpus").join(target);
    let mut inputs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().into_string().unwrap(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    inputs.sort();
    inputs
}

fn expected_path(target: &str) -> PathBuf {
    root().join("fuzz/expected").join(format!("{target}.tsv"))
}

/// Compare each input's outcome with the record (or write the record when blessing).
fn check_against_record(target: &str, outcomes: &BTreeMap<String, String>) {
    let path = expected_path(target);
    if std::env::var_os("INFERLB_BLESS_FUZZ").is_some() {
        let mut text = format!(
            "# {target}: input file name, then its outcome; written by INFERLB_BLESS_FUZZ=1 cargo test --test fuzz_corpus\n"
        );
        for (name, outcome) in outcomes {
            let _ = writeln!(text, "{name}\t{outcome}");
        }
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, text).unwrap();
        return;
    }
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (record it with INFERLB_BLESS_FUZZ=1)",
            path.display()
        )
    });
    let recorded: BTreeMap<&str, &str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split_once('\t').unwrap())
        .collect();
    let missing: Vec<_> = recorded
        .keys()
        .filter(|k| !outcomes.contains_key(**k))
        .collect();
    assert!(
        missing.is_empty(),
        "{target}: {} of {} recorded inputs are gone from the corpus, e.g. {:?}",
        missing.len(),
        recorded.len(),
        &missing[..missing.len().min(5)]
    );
    let mut changed = Vec::new();
    for (name, outcome) in outcomes {
        match recorded.get(name.as_str()) {
            None => changed.push(format!("{name}: not recorded (got {outcome})")),
            Some(want) if *want != outcome => {
                changed.push(format!("{name}: recorded {want}, got {outcome}"))
            }
            Some(_) => {}
        }
    }
    assert!(
        changed.is_empty(),
        "{target}: {} inputs changed outcome:\n{}",
        changed.len(),
        changed[..changed.len().min(20)].join("\n")
    );
}

fn outcome(view: &Result<RequestView, inferlb::error::Error>) -> String {
    match view {
        Ok(v) => match &v.routing_text {
            Some(t) => format!("ok:{:016x}", xxh3_64(t.as_bytes())),
            None => "ok".into(),
        },
        Err(_) => "err".into(),
    }
}

#[test]
fn prompt_corpus() {
    let inputs = corpus("prompt");
    let mut outcomes = BTreeMap::new();
    let (mut not_json, mut chat_ok, mut completions_ok, mut string_prompts, mut deep) =
        (0, 0, 0, 0, 0);
    let mut lenient = 0;
    for (name, data) in &inputs {
        let depth = json_depth(data);
        deep += usize::from(depth > 64);
        let chat = RequestView::parse(Operation::ChatCompletions, data);
        let completions = RequestView::parse(Operation::Completions, data);
        let other = RequestView::parse(Operation::Other, data);
        // Two readings of "is it JSON": the syntax alone (any value skipped, as serde skips
        // unknown fields: numbers out of f64 range and invalid UTF-8 inside strings pass; the
        // router holds the whole body to UTF-8 but lets such numbers pass),
        // and a full value (both refused).
        let syntax = serde_json::from_slice::<serde::de::IgnoredAny>(data).is_ok();
        let value = serde_json::from_slice::<serde_json::Value>(data).ok();
        match &value {
            None if !syntax => {
                // Not JSON at all: no JSON operation may accept it (an empty body is the
                // one thing `/v1/*` passes through without a model).
                not_json += 1;
                assert!(chat.is_err(), "{name}: chat accepted non-JSON");
                assert!(
                    completions.is_err(),
                    "{name}: completions accepted non-JSON"
                );
                let blank = data.iter().all(u8::is_ascii_whitespace);
                assert_eq!(other.is_ok(), blank, "{name}: other on non-JSON");
            }
            None => {
                // Known leniency, recorded rather than hidden: JSON syntax whose skipped
                // fields hold an out-of-range number is passed on (the backend refuses it);
                // the fields the router reads are checked in full.
                lenient += usize::from(chat.is_ok() || completions.is_ok() || other.is_ok());
            }
            Some(v) => {
                if let Ok(view) = &chat {
                    chat_ok += 1;
                    let messages = v["messages"].as_array();
                    assert!(
                        messages.is_some_and(|m| !m.is_empty()),
                        "{name}: chat accepted without messages"
                    );
                    let text = view.routing_text.as_deref().unwrap();
                    for m in messages.unwrap() {
                        assert!(m["role"].is_string(), "{name}: accepted a role {m}");
                        if let Some(content) = m["content"].as_str() {
                            assert!(text.contains(content), "{name}: content not routed");
                        }
                    }
                    assert_eq!(view.model.as_deref(), v["model"].as_str(), "{name}");
                }
                if let Ok(view) = &completions {
                    completions_ok += 1;
                    assert!(
                        !v["prompt"].is_null(),
                        "{name}: completions accepted without a prompt"
                    );
                    if let Some(p) = v["prompt"].as_str() {
                        string_prompts += 1;
                        assert_eq!(view.routing_text.as_deref(), Some(p), "{name}");
                    }
                    assert_eq!(view.model.as_deref(), v["model"].as_str(), "{name}");
                }
                if !v.is_object() {
                    assert!(chat.is_err() && completions.is_err(), "{name}: non-object");
                }
            }
        }
        outcomes.insert(
            name.clone(),
            format!(
                "chat={}\tcompletions={}\tother={}\tdepth={depth}",
                outcome(&chat),
                outcome(&completions),
                outcome(&other)
            ),
        );
    }
    check_against_record("prompt", &outcomes);
    eprintln!(
        "prompt corpus: {} inputs, {not_json} not JSON (and {lenient} JSON apart from a skipped \
         field's number, passed on), {chat_ok} chat, {completions_ok} completions \
         ({string_prompts} string prompts), {deep} deeper than 64",
        inputs.len()
    );
    // Floors near the corpus as committed (2,145 inputs, of which 2,043 are not JSON, 15
    // chat and 11 completion bodies): most of it deleted fails here even if its records went
    // with it.
    let floors = [
        ("inputs", inputs.len(), 2000),
        ("not JSON", not_json, 1900),
        ("accepted as chat", chat_ok, 12),
        ("accepted as completions", completions_ok, 8),
        ("string prompts", string_prompts, 1),
        ("deeper than 64", deep, 4),
    ];
    for (class, n, floor) in floors {
        assert!(
            n >= floor,
            "prompt corpus: {n} {class}, expected at least {floor}"
        );
    }
}

fn metrics_outcome(m: &Result<LoadMetrics, impl std::fmt::Debug>) -> String {
    let Ok(m) = m else { return "err".into() };
    let f = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v}"));
    let u = |v: Option<u64>| v.map_or("-".into(), |v| v.to_string());
    format!(
        "w={};r={};kv={};bs={};nb={};h={};q={};fin={};lora={}/{}/{}",
        f(m.waiting),
        f(m.running),
        f(m.kv_usage),
        u(m.block_size),
        u(m.num_gpu_blocks),
        f(m.prefix_cache_hits),
        f(m.prefix_cache_queries),
        f(m.requests_finished),
        m.running_loras.join(","),
        m.waiting_loras.join(","),
        u(m.max_lora),
    )
}

#[test]
fn metrics_page_corpus() {
    let inputs = corpus("metrics_page");
    let engines: Vec<_> = ["vllm", "sglang"]
        .iter()
        .map(|e| (*e, EngineMetricNames::builtin(e).unwrap()))
        .collect();
    let mut outcomes = BTreeMap::new();
    let (mut not_utf8, mut accepted, mut with_values, mut rejected) = (0, 0, 0, 0);
    for (name, data) in &inputs {
        let Ok(page) = std::str::from_utf8(data) else {
            not_utf8 += 1;
            outcomes.insert(name.clone(), "not-utf8".into());
            continue;
        };
        for sample in samples(page).flatten() {
            for (k, v) in sample.labels() {
                let _ = (k.len(), v.len());
            }
        }
        let mut line = Vec::new();
        for (engine, names) in &engines {
            let m = extract(page, names);
            // (KV usage is clamped to 0..=1 by construction; the record holds the value.)
            if let Ok(m) = &m {
                accepted += 1;
                with_values += usize::from(m.waiting.is_some() || m.kv_usage.is_some());
            } else {
                rejected += 1;
            }
            line.push(format!("{engine}={}", metrics_outcome(&m)));
        }
        outcomes.insert(name.clone(), line.join("\t"));
    }
    check_against_record("metrics_page", &outcomes);
    eprintln!(
        "metrics_page corpus: {} inputs, {not_utf8} not UTF-8, {accepted} accepted and \
         {rejected} rejected (engine × page), {with_values} with a waiting or KV value",
        inputs.len()
    );
    // Floors near the corpus as committed (609 inputs; 799 accepted and 417 rejected
    // engine × page readings, 34 with a waiting or KV value).
    let floors = [
        ("inputs", inputs.len(), 580),
        ("accepted (engine × page)", accepted, 750),
        ("with a waiting or KV value", with_values, 30),
        ("rejected (engine × page)", rejected, 380),
        ("not UTF-8", not_utf8, 1),
    ];
    for (class, n, floor) in floors {
        assert!(
            n >= floor,
            "metrics_page corpus: {n} {class}, expected at least {floor}"
        );
    }
}

/// The real pages (a vLLM 0.32 CPU server, the fixture and the shared copy) give the values
/// written in them, read by eye: tiny-llama idle after a run, 4096 blocks of 128 tokens,
/// 2072 prefix-cache query tokens of which 768 hit.
#[test]
fn real_vllm_pages_give_their_values() {
    let mut pages = vec![root().join("tests/fixtures/vllm-0.32-cpu.txt")];
    let shared = Path::new("/work/shared/vllm-metrics/vllm-0.32-cpu.txt");
    if shared.exists() {
        pages.push(shared.to_path_buf());
    }
    let vllm = EngineMetricNames::builtin("vllm").unwrap();
    for path in pages {
        let page = std::fs::read_to_string(&path).unwrap();
        let m = extract(&page, &vllm).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(m.waiting, Some(0.0), "{}", path.display());
        assert_eq!(m.running, Some(0.0));
        assert_eq!(m.kv_usage, Some(0.0));
        assert_eq!(m.block_size, Some(128));
        assert_eq!(m.num_gpu_blocks, Some(4096));
        assert_eq!(m.prefix_cache_queries, Some(2072.0));
        assert_eq!(m.prefix_cache_hits, Some(768.0));
        // A busy moment of the same page: the values move with the text.
        let busy = page
            .replace(
                "vllm:num_requests_waiting{engine=\"0\",model_name=\"tiny-llama\"} 0.0",
                "vllm:num_requests_waiting{engine=\"0\",model_name=\"tiny-llama\"} 7.0",
            )
            .replace(
                "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"tiny-llama\"} 0.0",
                "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"tiny-llama\"} 0.25",
            );
        let m = extract(&busy, &vllm).unwrap();
        assert_eq!((m.waiting, m.kv_usage), (Some(7.0), Some(0.25)));
        // One broken line among the series read: the whole page is refused.
        let broken = busy.replace(
            "vllm:num_requests_running{engine=\"0\",model_name=\"tiny-llama\"} 0.0",
            "vllm:num_requests_running{engine=\"0\",model_name=\"tiny-llama\" 0.0",
        );
        assert!(extract(&broken, &vllm).is_err(), "{}", path.display());
    }
}
