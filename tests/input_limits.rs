//! Limits the front door enforces before any backend sees a request: per-client request rate,
//! request header size, open connections, and the OpenAI fields the router can check cheaply.
//! Raw sockets where the point is what happens on the wire.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::Ordering;

use common::*;

/// POST `body` as JSON to `path`; (status, headers, body as JSON).
async fn post_json(
    router: &TestRouter,
    path: &str,
    body: &serde_json::Value,
) -> (u16, reqwest::header::HeaderMap, serde_json::Value) {
    let resp = client()
        .post(router.url(path))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    (status, headers, resp.json().await.unwrap_or_default())
}

fn assert_openai_error(v: &serde_json::Value) {
    assert!(v["error"]["message"].is_string(), "{v}");
    assert!(v["error"]["type"].is_string(), "{v}");
}

#[tokio::test]
async fn rate_limit_per_client_ip_answers_429_with_retry_after() {
    let b = FakeBackend::start("a", &["m"]).await;
    let mut cfg = config(&[&b]);
    // No keys: the limit is per client address. One request per 100 s, bursts of 2: the third
    // request of this test cannot be admitted however slow the machine is.
    cfg.auth.requests_per_second = 0.01;
    cfg.auth.burst = 2.0;
    let router = start_router(cfg).await;
    let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
    for _ in 0..2 {
        let (status, _, v) = post_json(&router, "/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{v}");
    }
    let (status, headers, v) = post_json(&router, "/v1/chat/completions", &body).await;
    assert_eq!(status, 429, "{v}");
    assert_openai_error(&v);
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    let retry_after: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(
        (90..=100).contains(&retry_after),
        "the next request is admitted within one period (100 s): {retry_after}"
    );
    assert_eq!(
        b.state.completions.load(Ordering::Relaxed),
        2,
        "the limited request never reached the backend"
    );
    router.shutdown().await;
}
