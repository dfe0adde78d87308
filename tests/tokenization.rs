//! In-process tokenization through the real binary: with `--tokenizer tests/fixtures/tiny-llama`
//! the scheduler sees the token ids vLLM would compute — here checked against a `vllm-sim`
//! started with the same tokenizer (its `/tokenize` and engine use `hf-tokenize` too) and
//! against the crate directly, through the explain header and `/admin/decisions` — while the
//! backend's KV-event stream is live; with no live stream the work is skipped and counted.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use serde_json::{json, Value};
use vllm_sim::SimConfig;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-llama");

fn tokens_hash(ids: &[u64]) -> String {
    let bytes: Vec<u8> = ids
        .iter()
        .flat_map(|&id| u32::try_from(id).unwrap().to_le_bytes())
        .collect();
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes))
}

/// `POST url` with `body` and the explain header, retried (bounded) until the router has a
/// healthy backend and answers 200.
async fn post_explained(url: &str, body: &Value) -> reqwest::Response {
    let client = common::client();
    for _ in 0..100 {
        let resp = client
            .post(url)
            .header("x-inferlb-explain", "1")
            .json(body)
            .send()
            .await
            .unwrap();
        if resp.status() == 200 {
            return resp;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no 200 from {url} within 10 s");
}

fn prompt_tokens(resp: &reqwest::Response) -> Option<usize> {
    let header = resp.headers()["x-inferlb-decision"].to_str().unwrap();
    header
        .split("; ")
        .find_map(|kv| kv.strip_prefix("prompt_tokens="))
        .map(|n| n.parse().unwrap())
}

/// Poll `/admin/backends` until the (only) backend's KV-event stream is live (at most 20 s).
async fn until_live(base: &str) {
    let client = common::client();
    for _ in 0..200 {
        if let Ok(resp) = client.get(format!("{base}/admin/backends")).send().await {
            if let Ok(v) = resp.json::<Value>().await {
                let live = v["backends"]
                    .as_array()
                    .is_some_and(|b| b.iter().any(|b| b["kv_events"]["status"] == "live"));
                if live {
                    return;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no live KV-event stream within 20 s");
}

/// A simulator serving `tiny-llama` that tokenizes with the fixture, as vLLM would.
fn tokenizing_sim() -> SimConfig {
    SimConfig {
        tokenizer: Some(FIXTURE.into()),
        ..common::sim::config("tiny-llama")
    }
}

/// The binary in front of `backend` with the fixture tokenizer, `config` as its config file and
/// `extra` flags; also returns the config's directory (removed by the caller).
fn tokenizing_router(
    tag: &str,
    config: &str,
    backend: &str,
    extra: &[&str],
) -> (common::binary::Running, std::path::PathBuf) {
    let mut args = vec![
        "--backend",
        backend,
        "--tokenizer",
        FIXTURE,
        "--poll-interval-ms",
        "100",
    ];
    args.extend_from_slice(extra);
    common::binary::spawn_with_config(&format!("tok-{tag}"), config, &args)
}

/// Without any live KV-event stream the ids would be read by nobody: the front door skips
/// tokenizing (the decision has no `prompt_tokens`) and counts it. Turn the check off (always
/// tokenize) and this fails on both assertions.
#[tokio::test]
async fn tokenizing_is_skipped_while_no_backend_stream_is_live() {
    let sim = common::sim::start(tokenizing_sim()).await;
    let backend = sim.url();
    let (router, dir) = tokenizing_router("skip", "[admin]\nexplain = true\n", &backend, &[]);
    let base = format!("http://{}", router.addr);
    let chat = json!({"model": "tiny-llama", "max_tokens": 1, "messages": [
        {"role": "system", "content": "you are a router of the load"},
        {"role": "user", "content": "what is the prefix cache"}]});
    for _ in 0..3 {
        let resp = post_explained(&format!("{base}/v1/chat/completions"), &chat).await;
        assert_eq!(prompt_tokens(&resp), None, "tokenized with no live stream");
    }
    let metrics = common::metrics_at(&router.addr).await;
    let skipped = metrics
        .lines()
        .find(|l| l.starts_with("inferlb_tokenize_skipped_total{reason=\"no_live_stream\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|n| n.parse::<f64>().ok());
    assert!(
        skipped.is_some_and(|n| n >= 3.0),
        "skips not counted: {skipped:?}"
    );
    router.signal("-TERM");
    router.exit().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn the_scheduler_sees_the_ids_vllm_computes_for_chat_and_text_prompts() {
    // The simulator publishes KV events (found by `--kv-events auto`): tokens are only
    // computed while some backend's stream is live.
    let sim = common::sim::start(SimConfig {
        kv_events_config: Some(common::sim::kv_events()),
        ..tokenizing_sim()
    })
    .await;
    let backend = sim.url();
    let (router, dir) = tokenizing_router(
        "test",
        "[admin]\nexplain = true\ndecisions = 8\n[tokenization]\nmax_body_bytes = 4096\n",
        &backend,
        &["--kv-events", "auto"],
    );
    let base = format!("http://{}", router.addr);
    let client = common::client();
    until_live(&base).await;
    // Start the decision ring (it records only once someone reads it).
    client
        .get(format!("{base}/admin/decisions"))
        .send()
        .await
        .unwrap();

    let chat = json!({"model": "tiny-llama", "max_tokens": 1, "messages": [
        {"role": "system", "content": "you are a router of the load"},
        {"role": "user", "content": "what is the prefix cache"},
        {"role": "assistant", "content": "a cache of token blocks"},
        {"role": "user", "content": [{"type": "text", "text": "and"}, {"type": "text", "text": "the model?"}]}]});
    let completion = json!({"model": "tiny-llama", "max_tokens": 1, "prompt": "hello world, the server of the model cache prefix tokens"});
    let tok = hf_tokenize::HfTokenizer::from_dir(std::path::Path::new(FIXTURE)).unwrap();
    for (path, body, want) in [
        (
            "/v1/chat/completions",
            &chat,
            tok.chat_ids(chat.to_string().as_bytes()).unwrap(),
        ),
        (
            "/v1/completions",
            &completion,
            tok.completion_ids(completion.to_string().as_bytes())
                .unwrap(),
        ),
    ] {
        // What the simulator (vLLM's stand-in, same tokenizer) computes for this body.
        let sim_ids = common::post_json(&format!("{backend}/tokenize"), body).await;
        let sim_ids: Vec<u64> = serde_json::from_value(sim_ids["tokens"].clone()).unwrap();
        let want: Vec<u64> = want.into_iter().map(u64::from).collect();
        assert_eq!(
            sim_ids, want,
            "{path}: the simulator tokenizes as the crate does"
        );
        assert!(want.len() > 8, "{path}: {want:?}");

        let resp = post_explained(&format!("{base}{path}"), body).await;
        assert_eq!(
            prompt_tokens(&resp),
            Some(want.len()),
            "{path}: explain header"
        );
        let decisions = common::get_json(&format!("{base}/admin/decisions?n=1")).await;
        let newest = &decisions["decisions"][0];
        assert_eq!(newest["prompt_tokens"], want.len(), "{path}: {newest}");
        assert_eq!(
            newest["prompt_tokens_hash"],
            tokens_hash(&want),
            "{path}: {newest}"
        );
    }

    // The same chat again: its earlier turns come from the prefix cache. /metrics shows the
    // time per operation and where the ids came from.
    let again = post_explained(&format!("{base}/v1/chat/completions"), &chat).await;
    assert_eq!(again.status(), 200);
    let metrics = common::metrics_at(&router.addr).await;
    let value = |series: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|n| n.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let chat_len = tok.chat_ids(chat.to_string().as_bytes()).unwrap().len() as f64;
    assert_eq!(
        value("inferlb_tokenize_duration_seconds_count{operation=\"chat\"}"),
        2.0
    );
    assert_eq!(
        value("inferlb_tokenize_duration_seconds_count{operation=\"completions\"}"),
        1.0
    );
    let cached = value("inferlb_tokenize_tokens_total{from=\"prefix_cache\"}");
    let tokenized = value("inferlb_tokenize_tokens_total{from=\"tokenizer\"}");
    assert!(cached > 0.0 && cached < chat_len, "{cached} of {chat_len}");
    assert!(tokenized >= chat_len, "{tokenized}");

    // A multimodal part cannot be tokenized here: routed without tokens, still served.
    let image = json!({"model": "tiny-llama", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.invalid/a.png"}}]}]});
    let resp = client
        .post(format!("{base}/v1/chat/completions"))
        .header("x-inferlb-explain", "1")
        .json(&image)
        .send()
        .await
        .unwrap();
    if resp.headers().contains_key("x-inferlb-decision") {
        assert_eq!(prompt_tokens(&resp), None);
    }

    // A body over `tokenization.max_body_bytes` (4096 here) is routed without ids, counted.
    let long = json!({"model": "tiny-llama", "max_tokens": 1, "messages": [
        {"role": "user", "content": "the load ".repeat(500)}]});
    let resp = post_explained(&format!("{base}/v1/chat/completions"), &long).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        prompt_tokens(&resp),
        None,
        "tokenized a body over the bound"
    );
    let metrics = common::metrics_at(&router.addr).await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("inferlb_tokenize_skipped_total{reason=\"too_long\"} 1")),
        "too_long not counted"
    );
    router.signal("-TERM");
    router.exit().await;
    std::fs::remove_dir_all(&dir).unwrap();
}
