//! Failover, outlier ejection, limits and queueing, deadlines, disconnects, auth and
//! graceful shutdown, driven through the real HTTP surface against fake backends.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use futures_util::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test]
async fn a_5xx_before_any_byte_is_retried_elsewhere() {
    let bad = FakeBackend::start("bad", &["m"]).await;
    let good = FakeBackend::start("good", &["m"]).await;
    bad.state.completion_status.store(503, Ordering::Relaxed);
    // Make `bad` the scheduler's first choice every time.
    good.set_metrics(|m| m.kv = 0.9);
    let mut cfg = config(&[&bad, &good]);
    cfg.outlier_detection.consecutive_failures = 0;
    let router = start_router(cfg).await;
    for i in 0..5 {
        let (status, served, body) = chat(&router, "m", &format!("q{i}")).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(served.unwrap(), good.url());
    }
    assert_eq!(
        bad.state.completions.load(Ordering::Relaxed),
        5,
        "each request tried `bad` first"
    );
    router.shutdown().await;
}

#[tokio::test]
async fn last_attempt_returns_the_backends_own_error() {
    let only = FakeBackend::start("only", &["m"]).await;
    only.state.completion_status.store(503, Ordering::Relaxed);
    let router = start_router(config(&[&only])).await;
    let (status, served, body) = chat(&router, "m", "x").await;
    assert_eq!(status, 503);
    assert_eq!(served.unwrap(), only.url());
    assert_eq!(body["error"], "only");
    router.shutdown().await;
}

#[tokio::test]
async fn repeated_failures_eject_a_backend_passively() {
    let flaky = FakeBackend::start("flaky", &["m"]).await;
    let steady = FakeBackend::start("steady", &["m"]).await;
    flaky.state.completion_status.store(500, Ordering::Relaxed);
    steady.set_metrics(|m| m.kv = 0.9);
    let mut cfg = config(&[&flaky, &steady]);
    cfg.forward.max_attempts = 1;
    cfg.outlier_detection.consecutive_failures = 3;
    cfg.outlier_detection.base_ejection_ms = 60_000;
    let router = start_router(cfg).await;
    for _ in 0..3 {
        assert_eq!(chat(&router, "m", "x").await.0, 500);
    }
    // Its /metrics still look best, but it is ejected: traffic goes to `steady`.
    for _ in 0..5 {
        let (status, served, _) = chat(&router, "m", "y").await;
        assert_eq!(status, 200);
        assert_eq!(served.unwrap(), steady.url());
    }
    assert_eq!(flaky.state.completions.load(Ordering::Relaxed), 3);
    router.shutdown().await;
}

#[tokio::test]
async fn saturated_backends_queue_then_429_with_retry_after() {
    let b = FakeBackend::start("a", &["m"]).await;
    b.state.hold_streams.store(true, Ordering::Relaxed);
    let mut cfg = config(&[&b]);
    cfg.limits.max_inflight_per_backend = 1;
    cfg.limits.queue_timeout_ms = 300;
    let router = start_router(cfg).await;
    let c = client();
    let first = c
        .post(router.url("/v1/chat/completions"))
        .json(&stream_body())
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    // The only backend is full: the next request waits its whole queue timeout, then 429.
    let started = std::time::Instant::now();
    let second = c
        .post(router.url("/v1/chat/completions"))
        .json(&stream_body())
        .send()
        .await
        .unwrap();
    let waited = started.elapsed();
    assert_eq!(second.status(), 429);
    assert!(
        waited >= Duration::from_millis(300),
        "refused after {waited:?}, before queue_timeout_ms"
    );
    assert_eq!(second.headers()["retry-after"], "1");
    let v: serde_json::Value = second.json().await.unwrap();
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    assert_eq!(b.state.completions.load(Ordering::Relaxed), 1, "never sent");

    drop(first);
    router.shutdown().await;
}

#[tokio::test]
async fn a_queued_request_is_admitted_when_capacity_frees() {
    let b = FakeBackend::start("a", &["m"]).await;
    b.state.hold_streams.store(true, Ordering::Relaxed);
    let mut cfg = config(&[&b]);
    cfg.limits.max_inflight_per_backend = 1;
    cfg.limits.queue_timeout_ms = 20_000;
    let router = start_router(cfg).await;
    let first = open_stream(&router).await;
    let mut first = first.bytes_stream();
    let _ = first.next().await.unwrap().unwrap();
    let url = router.url("/v1/chat/completions");
    let waiting = tokio::spawn(async move {
        let body =
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "later"}]});
        client()
            .post(url)
            .json(&body)
            .send()
            .await
            .unwrap()
            .status()
    });
    // The router reports it waiting, and the backend has seen nothing of it.
    until_backends_json(&router, |v| v["queued"] == 1 && v["waiting_for_slot"] == 1).await;
    assert_eq!(b.state.completions.load(Ordering::Relaxed), 1);
    assert!(!waiting.is_finished());
    b.state.gate.notify_one();
    while first.next().await.is_some() {}
    assert_eq!(
        waiting.await.unwrap(),
        200,
        "admitted after capacity freed, well before its deadline"
    );
    assert_eq!(b.state.completions.load(Ordering::Relaxed), 2);
    let v = admin_view(&router).await;
    assert_eq!(
        (v["queued"].clone(), v["waiting_for_slot"].clone()),
        (0.into(), 0.into())
    );
    router.shutdown().await;
}

/// A client that leaves while its request waits in the queue leaves the queue: the request is
/// never sent, and the freed slot goes to nobody (the next request is served at once).
#[tokio::test]
async fn a_client_leaving_the_queue_is_never_sent() {
    let b = FakeBackend::start("a", &["m"]).await;
    b.state.hold_streams.store(true, Ordering::Relaxed);
    let mut cfg = config(&[&b]);
    cfg.limits.max_inflight_per_backend = 1;
    cfg.limits.queue_timeout_ms = 60_000;
    let router = start_router(cfg).await;
    let mut first = open_stream(&router).await.bytes_stream();
    let _ = first.next().await.unwrap().unwrap();
    let url = router.url("/v1/chat/completions");
    let leaving = tokio::spawn(async move {
        let body =
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "bye"}]});
        client().post(url).json(&body).send().await
    });
    until_backends_json(&router, |v| v["waiting_for_slot"] == 1).await;
    leaving.abort();
    let _ = leaving.await;
    until_backends_json(&router, |v| v["queued"] == 0 && v["waiting_for_slot"] == 0).await;
    b.state.gate.notify_one();
    while first.next().await.is_some() {}
    until_backends_json(&router, |v| v["backends"][0]["inflight"] == 0).await;
    assert_eq!(
        b.state.completions.load(Ordering::Relaxed),
        1,
        "the abandoned request never reached the backend"
    );
    b.state.hold_streams.store(false, Ordering::Relaxed);
    let (status, _, _) = chat(&router, "m", "next").await;
    assert_eq!(status, 200);
    router.shutdown().await;
}

#[tokio::test]
async fn client_disconnect_cancels_upstream_and_releases_inflight() {
    let b = FakeBackend::start("a", &["m"]).await;
    b.state.hold_streams.store(true, Ordering::Relaxed);
    let router = start_router(config(&[&b])).await;
    let resp = open_stream(&router).await;
    let mut stream = resp.bytes_stream();
    let _first = stream.next().await.unwrap().unwrap();
    drop(stream);
    let mut abandoned = b.state.stream_abandoned.subscribe();
    tokio::time::timeout(Duration::from_secs(10), abandoned.wait_for(|v| *v))
        .await
        .expect("the backend must see the request go away")
        .unwrap();
    until_backends(&router, &b, |v| v["backends"][0]["inflight"] == 0).await;
    router.shutdown().await;
}

#[tokio::test]
async fn a_stream_cut_by_the_backend_ends_with_an_error_event() {
    let b = FakeBackend::start("a", &["m"]).await;
    b.state.cut_streams.store(true, Ordering::Relaxed);
    let router = start_router(config(&[&b])).await;
    let resp = open_stream(&router).await;
    assert_eq!(resp.status(), 200);
    let text = tokio::time::timeout(Duration::from_secs(10), resp.text())
        .await
        .unwrap()
        .unwrap();
    assert!(text.starts_with("data: {\"first\":\"a\"}\n\n"), "{text}");
    let last = text.trim_end().lines().last().unwrap();
    let event: serde_json::Value =
        serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(event["error"]["code"], "stream_interrupted", "{text}");
    router.shutdown().await;
}

#[tokio::test]
async fn idle_stream_is_cut_with_an_error_event() {
    let b = FakeBackend::start("a", &["m"]).await;
    b.state.hold_streams.store(true, Ordering::Relaxed);
    let mut cfg = config(&[&b]);
    cfg.forward.stream_idle_timeout_ms = 200;
    let router = start_router(cfg).await;
    let resp = open_stream(&router).await;
    let text = tokio::time::timeout(Duration::from_secs(10), resp.text())
        .await
        .unwrap()
        .unwrap();
    assert!(text.contains("sent nothing for 200 ms"), "{text}");
    router.shutdown().await;
}

#[tokio::test]
async fn slow_clients_are_cut_off() {
    let b = FakeBackend::start("a", &["m"]).await;
    let mut cfg = config(&[&b]);
    cfg.server.body_read_timeout_ms = 200;
    cfg.server.header_read_timeout_ms = 200;
    let router = start_router(cfg).await;
    // Headers promise 100 bytes, only 10 arrive: 408.
    let mut s = tokio::net::TcpStream::connect(router.addr).await.unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\":").await.unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&buf);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    // Headers never finish: the connection is closed.
    let mut s = tokio::net::TcpStream::connect(router.addr).await.unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await;
    assert!(
        closed.is_ok(),
        "the router must close a connection whose headers never end"
    );
    router.shutdown().await;
}

#[tokio::test]
async fn an_idle_keep_alive_connection_is_closed_at_once_on_shutdown() {
    let b = FakeBackend::start("a", &["m"]).await;
    let mut cfg = config(&[&b]);
    // A drain deadline far beyond the test's own: the connection must close because it is
    // idle, not because the deadline cut it.
    cfg.server.shutdown_timeout_ms = 120_000;
    let router = start_router(cfg).await;
    let mut s = tokio::net::TcpStream::connect(router.addr).await.unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    // The whole answer ("ok", 2 bytes of body): the connection is then idle, kept alive.
    let mut head = Vec::new();
    while !(head.ends_with(b"\r\n\r\nok")) {
        let mut byte = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut byte))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            n,
            1,
            "closed before the answer: {}",
            String::from_utf8_lossy(&head)
        );
        head.push(byte[0]);
    }
    let RouterParts { stop, task } = router.into_parts();
    stop.send(()).unwrap();
    // The drain wakes the idle connection's task and closes it: the client reads its end.
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await;
    assert!(
        matches!(read, Ok(Ok(0))),
        "the idle connection must be closed by the drain: {read:?}"
    );
    let result = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the drain ends once its only connection is closed")
        .unwrap();
    assert!(result.is_ok());
}

#[tokio::test]
async fn api_keys_admin_token_and_rate_limits() {
    let b = FakeBackend::start("a", &["m"]).await;
    let mut cfg = config(&[&b]);
    cfg.auth.api_keys = vec!["k1".into(), "k2".into()];
    cfg.auth.admin_token = Some("admin".into());
    cfg.auth.requests_per_second = 0.5;
    cfg.auth.burst = 2.0;
    let router = start_router(cfg).await;
    let c = client();
    let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
    let post = |key: Option<&str>| {
        let mut r = c.post(router.url("/v1/chat/completions")).json(&body);
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    let no_key = post(None).await.unwrap();
    assert_eq!(no_key.status(), 401);
    assert_eq!(no_key.headers()["www-authenticate"], "Bearer");
    assert_eq!(post(Some("wrong")).await.unwrap().status(), 401);
    assert_eq!(post(Some("k1")).await.unwrap().status(), 200);
    assert_eq!(post(Some("k1")).await.unwrap().status(), 200);
    let limited = post(Some("k1")).await.unwrap();
    assert_eq!(limited.status(), 429, "burst of 2 spent");
    assert!(limited.headers().contains_key("retry-after"));
    assert_eq!(
        post(Some("k2")).await.unwrap().status(),
        200,
        "limits are per key"
    );
    // The client's key is never forwarded to the backend.
    assert!(b
        .state
        .last_headers
        .lock()
        .unwrap()
        .clone()
        .unwrap()
        .get("authorization")
        .is_none());
    // Probes stay open; metrics need the admin token.
    assert_eq!(
        c.get(router.url("/health")).send().await.unwrap().status(),
        200
    );
    assert_eq!(
        c.get(router.url("/metrics")).send().await.unwrap().status(),
        401
    );
    assert_eq!(
        c.get(router.url("/metrics"))
            .bearer_auth("k1")
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    assert_eq!(
        c.get(router.url("/metrics"))
            .bearer_auth("admin")
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        c.get(router.url("/v1/models"))
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    router.shutdown().await;
}

#[tokio::test]
async fn graceful_shutdown_finishes_streams_and_refuses_new_connections() {
    let b = FakeBackend::start("a", &["m"]).await;
    b.state.hold_streams.store(true, Ordering::Relaxed);
    let router = start_router(config(&[&b])).await;
    let addr = router.addr;
    let resp = open_stream(&router).await;
    let mut stream = resp.bytes_stream();
    let first = stream.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: {\"first\""));
    let RouterParts { stop, task } = router.into_parts();
    stop.send(()).unwrap();
    // The listener closes: new connections are refused while the stream is still open. The
    // close is only observable by connecting, so try every 10 ms for at most 10 s (a loaded
    // 2-core machine), not a fixed number of scheduler turns.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(addr).await.is_ok() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "new connections must be refused during the drain"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    b.state.gate.notify_one();
    let mut rest = Vec::new();
    while let Some(chunk) = stream.next().await {
        rest.extend_from_slice(&chunk.unwrap());
    }
    assert!(
        rest.ends_with(b"data: [DONE]\n\n"),
        "the in-flight stream completes"
    );
    let result = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .unwrap()
        .unwrap();
    assert!(result.is_ok());
}
