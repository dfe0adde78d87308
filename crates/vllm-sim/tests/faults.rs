//! Every fault, produced through the CLI-flag fields of `SimConfig`, the `Faults` handle, or
//! `POST /sim/faults` — and observed from the outside as a router would.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::{
    client, completion, fast, first_events, get_json, get_response, ids_body, parse_prometheus,
    post, real_time, set_faults, start, start_fast, start_with_client, stream_started,
};
use futures_util::StreamExt;
use serde_json::{json, Value};
use vllm_sim::SimConfig;

async fn complete(url: &str) -> reqwest::Response {
    post(&format!("{url}/v1/completions"), &ids_body(8, 0, 3, false)).await
}

/// Asserts that at least `ms` milliseconds have passed since `t0` (`what` prefixes the message).
fn waited_at_least(t0: Instant, ms: u64, what: &str) {
    let took = t0.elapsed();
    assert!(took >= Duration::from_millis(ms), "{what}{took:?}");
}

/// Asserts that less than `ms` milliseconds have passed since `t0`.
fn answered_within(t0: Instant, ms: u64) {
    let took = t0.elapsed();
    assert!(took < Duration::from_millis(ms), "{took:?}");
}

#[tokio::test]
async fn fail_rate_flag_and_runtime_switch() {
    let sim = start_fast(|c| c.fail_rate = 1.0).await;
    let r = complete(&sim.url()).await;
    assert_eq!(r.status(), 500);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], 500);
    assert_eq!(v["error"]["type"], "InternalServerError");
    // Switched off at run time through the admin endpoint.
    let r = set_faults(&sim.url(), json!({"fail_rate": 0.0})).await;
    assert_eq!(r.status(), 200);
    assert_eq!(complete(&sim.url()).await.status(), 200);
    // And a fraction: over 200 requests, 30% ± a wide margin fail.
    sim.faults().set_fail_rate(0.3);
    let mut failed = 0;
    for _ in 0..200 {
        if complete(&sim.url()).await.status() == 500 {
            failed += 1;
        }
    }
    assert!((30..=90).contains(&failed), "{failed} of 200 failed");
    let r = set_faults(&sim.url(), json!({"fail_rate": 3})).await;
    assert_eq!(r.status(), 400, "out-of-range rate is refused");
}

#[tokio::test]
async fn metrics_delay_flag() {
    let sim = start_fast(|c| c.metrics_delay_ms = 2000).await;
    let t0 = Instant::now();
    let r = get_response(&format!("{}/metrics", sim.url())).await;
    assert_eq!(r.status(), 200);
    waited_at_least(t0, 2000, "");
    sim.faults().set_metrics_delay(Duration::ZERO);
    let t0 = Instant::now();
    get_response(&format!("{}/metrics", sim.url())).await;
    // A delay left in place costs 2 s; a scrape without one takes milliseconds. 1 s is far
    // from both, so a loaded machine does not flip the answer.
    answered_within(t0, 1000);
}

#[tokio::test]
async fn metrics_hang_flag_times_out_and_other_routes_still_answer() {
    let sim = start_fast(|c| c.metrics_hang = true).await;
    // Only the hung scrape runs against a short client timeout: it must not answer within
    // it (a hang never does). Everything that must answer gets the usual 20 s client, so a
    // slow debug build cannot turn an answer into a timeout.
    let short = reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let err = short
        .get(format!("{}/metrics", sim.url()))
        .send()
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert_eq!(
        get_response(&format!("{}/health", sim.url()))
            .await
            .status(),
        200
    );
    let r = set_faults(&sim.url(), json!({"metrics_hang": false})).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        get_response(&format!("{}/metrics", sim.url()))
            .await
            .status(),
        200
    );
}

#[tokio::test]
async fn metrics_garbage_flag() {
    let sim = start_fast(|c| c.metrics_garbage = true).await;
    let r = get_response(&format!("{}/metrics", sim.url())).await;
    assert_eq!(r.status(), 200);
    assert!(parse_prometheus(&r.text().await.unwrap()).is_err());
    sim.faults().set_metrics_garbage(false);
    let r = get_response(&format!("{}/metrics", sim.url())).await;
    assert!(parse_prometheus(&r.text().await.unwrap()).is_ok());
}

#[tokio::test]
async fn first_token_stall_flag() {
    let sim = start_fast(|c| c.first_token_stall_ms = 1500).await;
    for stream in [true, false] {
        let t0 = Instant::now();
        let r = completion(&sim, &ids_body(8, 0, 2, stream)).await;
        if stream {
            let mut s = r.bytes_stream();
            assert!(!first_events(&mut s, 1).await.is_empty());
            waited_at_least(t0, 1500, "stream: ");
            while s.next().await.is_some() {}
        } else {
            assert_eq!(r.status(), 200);
            r.bytes().await.unwrap();
            waited_at_least(t0, 1500, "whole: ");
        }
    }
    sim.faults().set_first_token_stall(Duration::ZERO);
    let t0 = Instant::now();
    complete(&sim.url()).await;
    // A stall left in place costs 1.5 s; a 2-token answer at 20× takes milliseconds.
    answered_within(t0, 750);
}

#[tokio::test]
async fn cut_stream_after_flag_ends_the_body_abruptly() {
    let sim = start_fast(|c| c.cut_stream_after = Some(3)).await;
    let r = post(
        &format!("{}/v1/chat/completions", sim.url()),
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": true}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let mut s = r.bytes_stream();
    let mut text = String::new();
    let mut broke = false;
    while let Some(item) = s.next().await {
        match item {
            Ok(b) => text.push_str(std::str::from_utf8(&b).unwrap()),
            Err(_) => {
                broke = true;
                break;
            }
        }
    }
    assert!(
        broke,
        "the body must end with an error, not cleanly: {text}"
    );
    assert!(!text.contains("[DONE]"));
    let events = common::parse_sse(&text);
    assert_eq!(
        events.len(),
        1 + 3,
        "role chunk + 3 content chunks: {events:?}"
    );
    let (st, ok) = sim
        .wait_for_stats(Duration::from_secs(10), |s| s.aborted == 1)
        .await;
    assert!(ok, "the cut request is aborted in the engine: {st:?}");
    // Whole (non-streaming) bodies are cut too.
    let cut = client()
        .post(format!("{}/v1/completions", sim.url()))
        .json(&ids_body(8, 0, 10, false))
        .send()
        .await;
    match cut {
        Err(e) => assert!(!e.is_timeout(), "{e}"),
        Ok(r) => assert!(r.bytes().await.is_err(), "a whole body must be cut too"),
    }
    sim.faults().set_cut_stream_after(None);
    assert_eq!(complete(&sim.url()).await.status(), 200);
}

#[tokio::test]
async fn refuse_after_flag_closes_the_port_and_admin_brings_it_back() {
    let cfg = SimConfig {
        refuse_after: Some(2),
        admin_port: Some(0),
        ..fast()
    };
    let sim = start(cfg).await;
    let admin = format!("http://{}", sim.admin_addr().unwrap());
    assert_eq!(complete(&sim.url()).await.status(), 200);
    assert_eq!(complete(&sim.url()).await.status(), 200);
    sim.faults().wait_listening(false).await;
    let err = tokio::net::TcpStream::connect(sim.addr())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
    // The admin port stays up and re-opens the main one.
    let v: Value = get_json(&format!("{admin}/sim/faults")).await;
    assert_eq!(v["listening"], false);
    let r = set_faults(&admin, json!({"refuse_connections": false})).await;
    assert_eq!(r.status(), 200);
    sim.faults().wait_listening(true).await;
    assert_eq!(
        complete(&sim.url()).await.status(),
        200,
        "same port, serving again"
    );
}

#[tokio::test]
async fn refuse_connections_drops_live_connections_and_comes_back_by_itself() {
    let (sim, c) = start_with_client(real_time()).await;
    // A long stream in flight on a live connection.
    let mut s = stream_started(&sim, &ids_body(20, 0, 3000, true), 1).await;
    let r = c
        .post(format!("{}/sim/faults", sim.url()))
        .json(&json!({"refuse_connections": true, "refuse_for_ms": 500}))
        .send()
        .await;
    // The admin call's own connection may be dropped with the others.
    drop(r);
    sim.faults().wait_listening(false).await;
    let mut ended = false;
    for _ in 0..10_000 {
        match s.next().await {
            Some(Ok(_)) => continue,
            _ => {
                ended = true;
                break;
            }
        }
    }
    assert!(ended, "the in-flight stream is cut");
    let err = tokio::net::TcpStream::connect(sim.addr())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
    let (st, ok) = sim
        .wait_for_stats(Duration::from_secs(10), |s| {
            s.aborted == 1 && s.used_blocks == 0
        })
        .await;
    assert!(ok, "{st:?}");
    tokio::time::timeout(Duration::from_secs(10), sim.faults().wait_listening(true))
        .await
        .unwrap();
    assert_eq!(complete(&sim.url()).await.status(), 200);
}
