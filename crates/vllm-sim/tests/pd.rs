//! P/D disaggregation end to end: a prefill and a decode simulator on 127.0.0.1, driven the way
//! a router drives vLLM's NixlConnector (prefill leg with `do_remote_decode`, `stream: false`,
//! `max_tokens: 1`; decode leg with the prefill's `kv_transfer_params` verbatim).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use serde_json::{json, Value};
use vllm_sim::config::{KvLoadFailurePolicy, KvRole};
use vllm_sim::{SimConfig, SimHandle};

const WAIT: Duration = Duration::from_secs(10);
/// Prompt length of the tests: 13 blocks of 16, the last one partly full.
const PROMPT: usize = 200;

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

fn config(role: KvRole) -> SimConfig {
    SimConfig {
        time_scale: 20.0,
        kv_role: role,
        ..SimConfig::default()
    }
}

async fn pair(prefill: SimConfig, decode: SimConfig) -> (SimHandle, SimHandle) {
    (
        vllm_sim::spawn(prefill).await.unwrap(),
        vllm_sim::spawn(decode).await.unwrap(),
    )
}

fn prompt() -> Vec<u32> {
    (0..PROMPT as u32).map(|i| i * 11 % 30_000 + 2).collect()
}

/// What vLLM's toy proxy sends the prefill server.
fn prefill_params() -> Value {
    json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
           "remote_block_ids": null, "remote_host": null, "remote_port": null})
}

async fn post(url: &str, path: &str, body: &Value) -> reqwest::Response {
    client()
        .post(format!("{url}{path}"))
        .json(body)
        .send()
        .await
        .unwrap()
}

/// The prefill leg of a completion; its answer's `kv_transfer_params`.
async fn prefill(p: &SimHandle) -> Value {
    let body = json!({"prompt": prompt(), "max_tokens": 1, "stream": false,
                      "kv_transfer_params": prefill_params()});
    let r = post(&p.url(), "/v1/completions", &body).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 1);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    v["kv_transfer_params"].clone()
}

fn decode_body(params: &Value, stream: bool) -> Value {
    json!({"prompt": prompt(), "max_tokens": 8, "stream": stream, "kv_transfer_params": params})
}

/// `data:` payloads of an SSE body.
async fn events(r: reqwest::Response) -> Vec<String> {
    let text = r.text().await.unwrap();
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").unwrap().to_string())
        .collect()
}

/// A sample of the simulator's `/metrics` page: `name` with all of `labels`.
fn metric(sim: &SimHandle, name: &str, labels: &[(&str, &str)]) -> f64 {
    sim.metric(name, labels)
        .unwrap_or_else(|| panic!("no sample {name} {labels:?}"))
}

fn by_source(sim: &SimHandle, source: &str) -> f64 {
    metric(
        sim,
        "vllm:prompt_tokens_by_source_total",
        &[("source", source)],
    )
}

#[tokio::test]
async fn two_step_flow_streams_the_answer_without_prefill_compute_on_decode() {
    let (p, d) = pair(
        SimConfig {
            kv_engine_id: Some("engine-p".into()),
            ..config(KvRole::Prefill)
        },
        config(KvRole::Decode),
    )
    .await;
    let params = prefill(&p).await;
    // vLLM's pull connector's shape, block ids one list per KV-cache group.
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(params["remote_engine_id"], "engine-p");
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(params["remote_port"], p.addr().port());
    assert_eq!(params["remote_block_ids"].as_array().unwrap().len(), 1);
    assert_eq!(params["remote_block_ids"][0].as_array().unwrap().len(), 13);
    assert_eq!(params["remote_num_tokens"], PROMPT);
    assert!(params["remote_request_id"]
        .as_str()
        .unwrap()
        .starts_with("cmpl-"));
    for (k, v) in [("tp_size", 1), ("dcp_size", 1), ("pp_size", 1)] {
        assert_eq!(params[k], v, "{k}");
    }
    assert_eq!(params["transfer_mode"], "pull");
    assert!(params["remote_blocks_expiry_time"].is_null());
    let s = p.stats();
    assert_eq!((s.kv_held, s.used_blocks), (1, 13), "P holds the blocks");

    let r = post(&d.url(), "/v1/completions", &decode_body(&params, true)).await;
    assert_eq!(r.status(), 200);
    let ev = events(r).await;
    assert_eq!(ev.len(), 9, "8 tokens and [DONE]: {ev:?}");
    assert_eq!(ev[8], "[DONE]");
    for e in &ev[..8] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert!(
            v.get("kv_transfer_params").is_none(),
            "chunks never carry it"
        );
        assert!(v.get("error").is_none());
    }
    let s = p.stats();
    assert_eq!(
        (s.kv_held, s.used_blocks, s.kv_pulls),
        (0, 0, 1),
        "pulled, freed"
    );
    // D computed only the last prompt token; the rest came over the transfer.
    assert_eq!(by_source(&d, "local_compute"), 1.0);
    assert_eq!(by_source(&d, "external_kv_transfer"), (PROMPT - 1) as f64);
    assert_eq!(by_source(&d, "local_cache_hit"), 0.0);
    assert_eq!(metric(&d, "vllm:prompt_tokens_total", &[]), PROMPT as f64);
    assert_eq!(
        metric(&d, "vllm:prompt_tokens_cached_total", &[]),
        (PROMPT - 1) as f64
    );
    assert_eq!(metric(&d, "vllm:prefix_cache_hits_total", &[]), 0.0);
    assert_eq!(
        metric(&d, "vllm:external_prefix_cache_hits_total", &[]),
        (PROMPT - 1) as f64
    );
    assert_eq!(d.stats().external_tokens, (PROMPT - 1) as u64);
    // P computed the whole prompt once.
    assert_eq!(by_source(&p, "local_compute"), PROMPT as f64);
}

#[tokio::test]
async fn chat_legs_carry_the_params_and_plain_answers_carry_null() {
    let (p, d) = pair(config(KvRole::Both), config(KvRole::Both)).await;
    let messages = json!([{"role": "user", "content": "tell me about disaggregated serving"}]);
    let r = post(
        &p.url(),
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 1, "max_completion_tokens": 1,
                "stream": false, "kv_transfer_params": prefill_params()}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    let params = v["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true);
    let r = post(
        &d.url(),
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 4, "stream": false,
                "kv_transfer_params": params}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    let obj = v.as_object().unwrap();
    assert!(obj.contains_key("kv_transfer_params") && v["kv_transfer_params"].is_null());
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(p.stats().kv_pulls, 1);
    assert!(d.stats().external_tokens > 0);
}

#[tokio::test]
async fn a_second_pull_of_the_same_params_fails() {
    let (p, d) = pair(config(KvRole::Prefill), config(KvRole::Decode)).await;
    let params = prefill(&p).await;
    let r = post(&d.url(), "/v1/completions", &decode_body(&params, false)).await;
    assert_eq!(r.status(), 200);
    // Non-streaming: vLLM's 500 for a failed KV load under policy `fail`.
    let r = post(&d.url(), "/v1/completions", &decode_body(&params, false)).await;
    assert_eq!(r.status(), 500);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "InternalServerError");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("no KV blocks are held"), "{msg}");
    // Streaming: status 200 already, one error event, then [DONE].
    let r = post(&d.url(), "/v1/completions", &decode_body(&params, true)).await;
    assert_eq!(r.status(), 200);
    let ev = events(r).await;
    assert_eq!(ev.len(), 2, "{ev:?}");
    let e: Value = serde_json::from_str(&ev[0]).unwrap();
    assert_eq!(e["error"]["code"], 500);
    assert_eq!(ev[1], "[DONE]");
    assert_eq!(
        metric(
            &d,
            "vllm:request_success_total",
            &[("finished_reason", "error")]
        ),
        2.0
    );
    assert_eq!(d.stats().external_tokens, (PROMPT - 1) as u64, "only once");
}

#[tokio::test]
async fn blocks_nobody_pulls_are_freed_when_the_lease_ends() {
    let (p, d) = pair(
        SimConfig {
            kv_lease_ms: 50,
            ..config(KvRole::Prefill)
        },
        config(KvRole::Decode),
    )
    .await;
    let params = prefill(&p).await;
    let (s, ok) = p
        .wait_for_stats(WAIT, |s| s.kv_held == 0 && s.kv_expired == 1)
        .await;
    assert!(ok, "lease not ended: {s:?}");
    assert_eq!(s.used_blocks, 0);
    let r = post(&d.url(), "/v1/completions", &decode_body(&params, false)).await;
    assert_eq!(r.status(), 500, "the blocks are gone");
}

#[tokio::test]
async fn recompute_policy_prefills_locally_when_the_pull_fails() {
    let (p, d) = pair(
        config(KvRole::Prefill),
        SimConfig {
            kv_load_failure_policy: KvLoadFailurePolicy::Recompute,
            ..config(KvRole::Decode)
        },
    )
    .await;
    let params = prefill(&p).await;
    p.faults().set_kv_pull_refuse(true);
    let r = post(&d.url(), "/v1/completions", &decode_body(&params, true)).await;
    assert_eq!(r.status(), 200);
    let ev = events(r).await;
    assert_eq!(ev.len(), 9, "the full answer: {ev:?}");
    assert_eq!(by_source(&d, "local_compute"), PROMPT as f64);
    assert_eq!(by_source(&d, "external_kv_transfer"), 0.0);
    assert_eq!(
        p.stats().kv_held,
        1,
        "a refused pull leaves the blocks held (until the lease)"
    );
    // Once P answers again, the same params still work: nothing was taken.
    p.faults().set_kv_pull_refuse(false);
    let r = post(&d.url(), "/v1/completions", &decode_body(&params, false)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(p.stats().kv_held, 0);
}

#[tokio::test]
async fn decode_pull_faults_and_an_unreachable_prefill_fail_the_request() {
    let (p, d) = pair(config(KvRole::Prefill), config(KvRole::Decode)).await;
    let params = prefill(&p).await;
    // The decode side's transfer breaks: P is not even asked and keeps the blocks.
    d.faults().set_kv_pull_fail(true);
    let r = post(&d.url(), "/v1/completions", &decode_body(&params, false)).await;
    assert_eq!(r.status(), 500);
    assert_eq!(p.stats().kv_held, 1);
    d.faults().set_kv_pull_fail(false);
    // P refuses pulls (through the admin API): a 500 whose message names the refusal.
    let r = post(&p.url(), "/sim/faults", &json!({"kv_pull_refuse": true})).await;
    assert_eq!(r.status(), 200);
    let r = post(&d.url(), "/v1/completions", &decode_body(&params, false)).await;
    assert_eq!(r.status(), 500);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("refused"));
    // P gone: unreachable.
    p.shutdown().await;
    let r = post(&d.url(), "/v1/completions", &decode_body(&params, false)).await;
    assert_eq!(r.status(), 500);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unreachable"),
        "{v}"
    );
}

#[tokio::test]
async fn a_prefill_that_dies_holds_nothing() {
    let p = vllm_sim::spawn(config(KvRole::Prefill)).await.unwrap();
    let body = json!({"prompt": prompt(), "max_tokens": 1, "stream": false,
                      "kv_transfer_params": prefill_params()});
    let r = post(
        &p.url(),
        "/sim/faults",
        &json!({"kv_prefill_fail": "error"}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let r = post(&p.url(), "/v1/completions", &body).await;
    assert_eq!(r.status(), 500);
    let (s, ok) = p.wait_for_stats(WAIT, |s| s.kv_held == 0).await;
    assert!(ok && s.used_blocks == 0, "{s:?}");
    // The connection drops: no answer at all reaches the client.
    p.faults()
        .set_kv_prefill_fail(vllm_sim::faults::PrefillFail::Drop);
    let sent = client()
        .post(format!("{}/v1/completions", p.url()))
        .json(&body)
        .send()
        .await;
    let broken = match sent {
        Err(_) => true,
        Ok(r) => r.bytes().await.is_err(),
    };
    assert!(broken, "the client saw a whole answer");
    let (s, ok) = p.wait_for_stats(WAIT, |s| s.kv_held == 0).await;
    assert!(ok && s.used_blocks == 0, "{s:?}");
    assert_eq!(s.kv_expired, 0, "freed at once, not by the lease");
}

#[tokio::test]
async fn roles_loopback_and_incomplete_params() {
    let (p, d) = pair(config(KvRole::Prefill), config(KvRole::Decode)).await;
    let full = |host: &str| {
        json!({"do_remote_prefill": true, "remote_engine_id": "e", "remote_request_id": "r",
               "remote_block_ids": [[0]], "remote_host": host, "remote_port": 1})
    };
    // A leg the role does not take is a 400.
    let r = post(
        &d.url(),
        "/v1/completions",
        &json!({"prompt": prompt(), "max_tokens": 1, "kv_transfer_params": prefill_params()}),
    )
    .await;
    assert_eq!(r.status(), 400);
    let r = post(
        &p.url(),
        "/v1/completions",
        &decode_body(&full("127.0.0.1"), false),
    )
    .await;
    assert_eq!(r.status(), 400);
    // The simulator dials loopback only.
    let r = post(
        &d.url(),
        "/v1/completions",
        &decode_body(&full("192.0.2.7"), false),
    )
    .await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["param"], "kv_transfer_params");
    // Keys missing: vLLM's "invalid KVTransferParams" path computes the prompt locally.
    let r = post(
        &d.url(),
        "/v1/completions",
        &decode_body(&json!({"do_remote_prefill": true}), false),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(by_source(&d, "local_compute"), PROMPT as f64);
    // Not an object: a schema error, as vLLM's `dict | None`.
    let r = post(
        &d.url(),
        "/v1/completions",
        &json!({"prompt": prompt(), "kv_transfer_params": [1]}),
    )
    .await;
    assert_eq!(r.status(), 400);
}

#[tokio::test]
async fn the_transfer_time_counts_in_the_decode_ttft() {
    // 13 blocks × 16 tokens × 10⁵ B at 10⁷ B/s = 2.08 simulated seconds before the first token
    // (the prefill of one token costs milliseconds).
    let (p, d) = pair(
        config(KvRole::Prefill),
        SimConfig {
            kv_bytes_per_token: 100_000,
            kv_transfer_gbps: 0.01,
            ..config(KvRole::Decode)
        },
    )
    .await;
    let params = prefill(&p).await;
    let r = post(&d.url(), "/v1/completions", &decode_body(&params, false)).await;
    assert_eq!(r.status(), 200);
    let ttft = metric(&d, "vllm:time_to_first_token_seconds_sum", &[]);
    assert!(ttft >= 2.08, "TTFT {ttft} s misses the 2.08 s transfer");
}
