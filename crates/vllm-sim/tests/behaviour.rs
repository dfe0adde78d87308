//! Engine behaviour seen from outside: prefix-cache hits and TTFT, queueing beyond
//! `--max-num-seqs` and KV capacity, aborts on client disconnect — checked through /metrics.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{
    client, completion, fast, first_events, ids_body, post, post_json, real_time, scrape, start,
    start_with_client, stream_started,
};
use futures_util::StreamExt;
use serde_json::json;
use tokio::io::AsyncWriteExt;
use vllm_sim::SimConfig;

const WAIT: Duration = Duration::from_secs(10);

/// Sends a streaming request and returns the time to its first content chunk on tokio's clock
/// (under a paused clock: the simulated time, free of the machine's scheduling delays).
async fn timed_stream(url: &str, body: serde_json::Value) -> Duration {
    let t0 = tokio::time::Instant::now();
    let r = post(&format!("{url}/v1/completions"), &body).await;
    let mut s = r.bytes_stream();
    let events = first_events(&mut s, 1).await;
    let ttft = t0.elapsed();
    assert!(!events.is_empty());
    while s.next().await.is_some() {}
    ttft
}

// Under tokio's paused clock the engine's steps take exactly their modelled time: time moves
// only when every task waits, so a loaded machine cannot stretch the simulated TTFT (it did,
// to 0.40 s at `time_scale` 10, with a second test suite running beside this one).
#[tokio::test(start_paused = true)]
async fn second_identical_long_prompt_hits_cache_and_starts_faster() {
    let (sim, c) = start_with_client(SimConfig {
        time_scale: 10.0,
        ..SimConfig::default()
    })
    .await;
    let url = sim.url();
    let body = ids_body(4000, 1, 4, true);

    let before = scrape(&c, &url).await;
    let cold = timed_stream(&url, body.clone()).await;
    let mid = scrape(&c, &url).await;
    let warm = timed_stream(&url, body).await;
    let after = scrape(&c, &url).await;

    let hits = |p: &common::Page| p.value("vllm:prefix_cache_hits_total");
    let queries = |p: &common::Page| p.value("vllm:prefix_cache_queries_total");
    let ttft_sum = |p: &common::Page| p.value("vllm:time_to_first_token_seconds_sum");
    assert_eq!(hits(&mid) - hits(&before), 0.0, "cold cache");
    assert_eq!(queries(&mid) - queries(&before), 4000.0);
    // All full 16-token blocks except that the last token must be computed: (4000-1)/16 = 249.
    assert_eq!(hits(&after) - hits(&mid), 249.0 * 16.0);
    assert_eq!(queries(&after) - queries(&mid), 4000.0);
    assert_eq!(after.value("vllm:prompt_tokens_cached_total"), 3984.0);

    // Simulated TTFT: ~6 ms + 4000 × 80 µs ≈ 0.33 s cold, ~6 ms warm.
    let cold_sim = ttft_sum(&mid) - ttft_sum(&before);
    let warm_sim = ttft_sum(&after) - ttft_sum(&mid);
    assert!(
        (0.3..0.4).contains(&cold_sim),
        "cold simulated TTFT {cold_sim}"
    );
    assert!(warm_sim < 0.05, "warm simulated TTFT {warm_sim}");
    assert!(
        warm < cold,
        "client-observed TTFT: warm {warm:?} vs cold {cold:?}"
    );
}

#[tokio::test]
async fn chat_turns_share_a_prefix() {
    let sim = start(fast()).await;
    let url = format!("{}/v1/chat/completions", sim.url());
    let system = "You are a helpful assistant. ".repeat(40);
    let turn1 = json!([{"role": "system", "content": system}, {"role": "user", "content": "First question?"}]);
    let r: serde_json::Value = post_json(&url, &json!({"messages": turn1, "max_tokens": 40})).await;
    let answer = r["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let p1 = r["usage"]["prompt_tokens"].as_u64().unwrap();
    let before = sim.stats().prefix_hits;
    let turn2 = json!([
        {"role": "system", "content": system}, {"role": "user", "content": "First question?"},
        {"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}
    ]);
    post(&url, &json!({"messages": turn2, "max_tokens": 1})).await;
    let hit = sim.stats().prefix_hits - before;
    // The whole first prompt and the KV-computed part of the answer (39 of 40 tokens) are
    // re-used, rounded down to full blocks.
    assert_eq!(hit, (p1 + 39) / 16 * 16, "hit {hit}, first prompt {p1}");
}

#[tokio::test]
async fn beyond_max_num_seqs_requests_wait_and_queue_time_shows() {
    let sim = start(SimConfig {
        max_num_seqs: 2,
        time_scale: 5.0,
        ..SimConfig::default()
    })
    .await;
    let url = sim.url();
    let mut tasks = Vec::new();
    for salt in 0..6 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            timed_stream(&url, ids_body(32, salt, 50, true)).await
        }));
    }
    let (s, ok) = sim.wait_for_stats(WAIT, |s| s.waiting >= 3).await;
    assert!(ok, "requests beyond max-num-seqs must wait: {s:?}");
    assert_eq!(s.running, 2);
    let page = scrape(&client(), &url).await;
    assert!(page.value("vllm:num_requests_waiting") >= 1.0);
    assert_eq!(page.value("vllm:num_requests_running"), 2.0);
    let mut ttfts = Vec::new();
    for t in tasks {
        ttfts.push(t.await.unwrap());
    }
    ttfts.sort();
    // Each batch of two takes ~50 steps × ~6 ms = 0.3 s simulated, 60 ms wall at 5×: the last
    // two waited for two batches.
    assert!(
        ttfts[5] > Duration::from_millis(100),
        "queued TTFT {:?}",
        ttfts
    );
    let page = scrape(&client(), &url).await;
    let queue = page.value("vllm:request_queue_time_seconds_sum");
    // Two requests waited ~0.3 s, two ~0.6 s (simulated).
    assert!(queue > 1.2, "queue time sum {queue}");
    assert_eq!(page.value("vllm:request_queue_time_seconds_count"), 6.0);
    assert_eq!(
        page.get(
            "vllm:request_success_total",
            &[("finished_reason", "length")]
        ),
        Some(6.0)
    );
}

#[tokio::test]
async fn kv_capacity_limits_admission_and_preempts() {
    // 12 blocks × 16 tokens; each request: 60-token prompt (4 blocks) growing to 7 blocks.
    let cfg = SimConfig {
        num_gpu_blocks: 12,
        ..fast()
    };
    let sim = start(cfg).await;
    let url = sim.url();
    let mut tasks = Vec::new();
    for salt in 0..4 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let r = post(
                &format!("{url}/v1/completions"),
                &ids_body(60, salt, 50, false),
            )
            .await;
            assert_eq!(r.status(), 200);
            r.json::<serde_json::Value>().await.unwrap()
        }));
    }
    let (s, ok) = sim
        .wait_for_stats(WAIT, |s| s.waiting >= 1 && s.running >= 1)
        .await;
    assert!(ok, "KV capacity must hold requests back: {s:?}");
    assert!(
        s.running <= 3,
        "at most three 4-block prompts fit in 12 blocks: {s:?}"
    );
    for t in tasks {
        assert_eq!(t.await.unwrap()["usage"]["completion_tokens"], 50);
    }
    let page = scrape(&client(), &url).await;
    assert!(
        page.value("vllm:num_preemptions_total") >= 1.0,
        "growing sequences must preempt"
    );
    assert_eq!(page.value("vllm:kv_cache_usage_perc"), 0.0);
    assert_eq!(sim.stats().used_blocks, 0);
}

#[tokio::test]
async fn streaming_client_disconnect_aborts_and_frees_blocks() {
    let (sim, c) = start_with_client(real_time()).await;
    let stream = stream_started(&sim, &ids_body(300, 3, 2000, true), 2).await;
    let s = sim.stats();
    assert_eq!(s.running, 1);
    assert!(
        s.used_blocks >= 19,
        "300 prompt tokens hold 19 blocks: {s:?}"
    );
    let page = scrape(&c, &sim.url()).await;
    assert!(page.value("vllm:kv_cache_usage_perc") > 0.0);
    drop(stream);
    let (s, ok) = sim
        .wait_for_stats(WAIT, |s| s.aborted == 1 && s.used_blocks == 0)
        .await;
    assert!(ok, "disconnect must abort and free: {s:?}");
    let page = scrape(&c, &sim.url()).await;
    assert_eq!(page.value("vllm:kv_cache_usage_perc"), 0.0);
    assert_eq!(
        page.get(
            "vllm:request_success_total",
            &[("finished_reason", "abort")]
        ),
        Some(1.0)
    );
    assert_eq!(page.value("vllm:num_requests_running"), 0.0);
}

#[tokio::test]
async fn non_streaming_client_disconnect_aborts() {
    let sim = start(real_time()).await;
    let body = ids_body(100, 4, 5000, false).to_string();
    let mut sock = tokio::net::TcpStream::connect(sim.addr()).await.unwrap();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(req.as_bytes()).await.unwrap();
    let (s, ok) = sim.wait_for_stats(WAIT, |s| s.running == 1).await;
    assert!(ok, "request admitted: {s:?}");
    drop(sock);
    let (s, ok) = sim
        .wait_for_stats(WAIT, |s| s.aborted == 1 && s.used_blocks == 0)
        .await;
    assert!(ok, "dropped connection must abort the request: {s:?}");
}

// On tokio's paused clock, like the TTFT test above: time moves only while every task waits,
// so the engine's steps take exactly their scaled time and a loaded machine cannot put the
// engine behind schedule (it did: simulated e2e beyond 15 s with a second suite beside it).
// The wall time below is read on the same clock.
#[tokio::test(start_paused = true)]
async fn time_scale_speeds_up_wall_clock_only() {
    // 1000 tokens of decode ≈ 1000 × 6 ms = 6 s simulated; at 100× that is ~60 ms of wall time.
    let sim = start(SimConfig {
        time_scale: 100.0,
        ..SimConfig::default()
    })
    .await;
    let t0 = tokio::time::Instant::now();
    let r = completion(&sim, &ids_body(10, 0, 1000, false)).await;
    assert_eq!(r.status(), 200);
    let wall = t0.elapsed();
    let page = scrape(&client(), &sim.url()).await;
    let e2e = page.value("vllm:e2e_request_latency_seconds_sum");
    assert!((5.5..15.0).contains(&e2e), "simulated e2e {e2e}");
    // Unscaled, the wall time would be the simulated 6 s; scaled it is ~60 ms. 3 s is 50× the
    // expected time (room for a loaded debug build) and half the unscaled one.
    assert!(wall < Duration::from_secs(3), "wall {wall:?}");
    // --instant: no simulated latency at all, seen in the simulated clock itself.
    let sim = start(SimConfig {
        instant: true,
        ..SimConfig::default()
    })
    .await;
    let r = completion(&sim, &ids_body(10, 0, 500, false)).await;
    assert_eq!(r.status(), 200);
    let page = scrape(&client(), &sim.url()).await;
    let e2e = page.value("vllm:e2e_request_latency_seconds_sum");
    let ttft = page.value("vllm:time_to_first_token_seconds_sum");
    // Without --instant, 500 tokens cost ~3 s (time scale 1); with it, what is left is the
    // handler's own wall time (milliseconds). 1.5 s is far above that even on a loaded debug
    // build, and half of what a cost model left switched on would take.
    assert!(
        e2e < 1.5 && ttft < 1.5,
        "instant: e2e {e2e} s, ttft {ttft} s"
    );
}
