//! Limits the front door enforces before any backend sees a request: per-client request rate,
//! request header size, open connections, and the OpenAI fields the router can check cheaply.
//! Raw sockets where the point is what happens on the wire.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Everything the router sends on `stream` until it closes it, or what arrived within 10 s.
async fn read_until_close(stream: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return out,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
        }
    }
}

/// Send `request` as raw bytes on a fresh connection; the raw answer, read until the router
/// closes it.
async fn send_raw(router: &TestRouter, request: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(router.addr).await.unwrap();
    s.write_all(request).await.unwrap();
    read_until_close(&mut s).await
}

/// A chat request head with one `x-pad` header, `total` bytes long up to (not including) the
/// blank line that would end it.
fn padded_head(total: usize) -> Vec<u8> {
    let start = b"POST /v1/chat/completions HTTP/1.1\r\nhost: inferlb\r\nx-pad: ".to_vec();
    let mut head = start;
    head.resize(total, b'a');
    head
}

/// `GET path` on fresh connections until one is answered 200 (within 10 s); the answer.
async fn get_when_served(router: &TestRouter, path: &str) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut s = TcpStream::connect(router.addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nhost: inferlb\r\nconnection: close\r\n\r\n");
        let _ = s.write_all(request.as_bytes()).await;
        let answer = read_until_close(&mut s).await;
        if answer.starts_with(b"HTTP/1.1 200") {
            return String::from_utf8_lossy(&answer).into_owned();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no connection slot came free"
        );
        tokio::task::yield_now().await;
    }
}

/// One complete `GET /health` on a fresh connection; the raw answer.
async fn get_health(stream: &mut TcpStream) -> Vec<u8> {
    stream
        .write_all(b"GET /health HTTP/1.1\r\nhost: inferlb\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
        .await
        .expect("an answer")
        .unwrap();
    buf.truncate(n);
    buf
}

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
    // Another client address has a budget of its own: the router tells clients apart by each
    // connection's peer address (on Linux all of 127.0.0.0/8 is loopback).
    let other = reqwest::Client::builder()
        .local_address(std::net::IpAddr::from([127, 0, 0, 2]))
        .build()
        .unwrap();
    let resp = other
        .post(router.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.status(),
        200,
        "a second client address is limited apart"
    );
    router.shutdown().await;
}

#[tokio::test]
async fn oversized_request_head_gets_431_and_reaches_no_backend() {
    let b = FakeBackend::start("a", &["m"]).await;
    let mut cfg = config(&[&b]);
    cfg.server.max_header_bytes = 16_384;
    // Far beyond the test's own 10 s read deadline: a router without the limit would wait for
    // the rest of the head, not answer.
    cfg.server.header_read_timeout_ms = 60_000;
    let router = start_router(cfg).await;

    // A head that is still incomplete at the limit: exactly the limit's worth of bytes, so the
    // router has read everything sent when it answers (no reset discards the answer).
    let answer = send_raw(&router, &padded_head(16_384)).await;
    let text = String::from_utf8_lossy(&answer);
    assert!(
        text.starts_with("HTTP/1.1 431"),
        "expected 431, got {:?}",
        text.chars().take(200).collect::<String>()
    );

    // Under the limit, the same shape goes through.
    let body = br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#;
    let mut head = padded_head(12_000);
    head.extend_from_slice(
        format!(
            "\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    );
    head.extend_from_slice(body);
    let answer = send_raw(&router, &head).await;
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&answer[..answer.len().min(200)])
    );
    assert_eq!(
        b.state.completions.load(Ordering::Relaxed),
        1,
        "only the request under the limit reached the backend"
    );
    router.shutdown().await;
}

#[tokio::test]
async fn connections_beyond_the_cap_are_closed_at_once() {
    let b = FakeBackend::start("a", &["m"]).await;
    let mut cfg = config(&[&b]);
    cfg.limits.max_connections = 2;
    cfg.server.header_read_timeout_ms = 60_000;
    let router = start_router(cfg).await;

    // Two keep-alive connections, each proven accepted and served.
    let mut first = TcpStream::connect(router.addr).await.unwrap();
    let mut second = TcpStream::connect(router.addr).await.unwrap();
    assert!(get_health(&mut first).await.starts_with(b"HTTP/1.1 200"));
    assert!(get_health(&mut second).await.starts_with(b"HTTP/1.1 200"));

    // A third is closed without an answer, well before any timeout of the router's.
    let mut third = TcpStream::connect(router.addr).await.unwrap();
    let _ = third
        .write_all(b"GET /health HTTP/1.1\r\nhost: inferlb\r\n\r\n")
        .await;
    let started = tokio::time::Instant::now();
    let answer = read_until_close(&mut third).await;
    assert!(
        answer.is_empty(),
        "over the cap: {:?}",
        String::from_utf8_lossy(&answer)
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "closed promptly"
    );
    // Closing one frees its slot: a new connection is served again once the router has seen
    // the close (each try is a real connection; no sleeping). The refusal was counted.
    drop(first);
    let page = get_when_served(&router, "/metrics").await;
    assert!(
        page.lines()
            .any(|l| l.starts_with("inferlb_connections_refused_total ")),
        "{page}"
    );
    drop(second);
    router.shutdown().await;
}

#[tokio::test]
async fn invalid_openai_fields_get_400_naming_the_param_before_any_backend() {
    let b = FakeBackend::start("a", &["m"]).await;
    let mut cfg = config(&[&b]);
    cfg.limits.max_messages = 5;
    let router = start_router(cfg).await;
    let msg = serde_json::json!({"role": "user", "content": "x"});
    let chat = |extra: serde_json::Value| {
        let mut body = serde_json::json!({"model": "m", "messages": [msg.clone()]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    // The backend serves well-formed requests: the refusals below are the router's own.
    let (status, _, v) = post_json(
        &router,
        "/v1/chat/completions",
        &chat(serde_json::json!({})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let served = b.state.completions.load(Ordering::Relaxed);

    let parts = |part: serde_json::Value| serde_json::json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, part]}]});
    let cases = [
        (
            "/v1/chat/completions",
            chat(parts(serde_json::json!({"type": "text"}))),
            "messages[0].content[1].text",
        ),
        (
            "/v1/chat/completions",
            chat(parts(
                serde_json::json!({"type": "image_url", "image_url": {"detail": "low"}}),
            )),
            "messages[0].content[1].image_url",
        ),
        (
            "/v1/chat/completions",
            chat(parts(
                serde_json::json!({"type": "input_audio", "input_audio": {"format": "wav"}}),
            )),
            "messages[0].content[1].input_audio",
        ),
        (
            "/v1/chat/completions",
            chat(serde_json::json!({"temperature": -1})),
            "temperature",
        ),
        (
            "/v1/chat/completions",
            chat(serde_json::json!({"top_p": 1.5})),
            "top_p",
        ),
        (
            "/v1/chat/completions",
            chat(serde_json::json!({"n": 0})),
            "n",
        ),
        (
            "/v1/chat/completions",
            chat(serde_json::json!({"max_tokens": -3})),
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            chat(serde_json::json!({"max_tokens": 2.5})),
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            chat(serde_json::json!({"messages": vec![msg.clone(); 6]})),
            "messages",
        ),
        (
            "/v1/completions",
            serde_json::json!({"model": "m", "prompt": [1, "two"]}),
            "prompt",
        ),
        (
            "/v1/completions",
            serde_json::json!({"model": "m", "prompt": {"text": "x"}}),
            "prompt",
        ),
        (
            "/v1/completions",
            serde_json::json!({"model": "m", "prompt": "x", "frequency_penalty": 9}),
            "frequency_penalty",
        ),
    ];
    for (path, body, param) in cases {
        let (status, _, v) = post_json(&router, path, &body).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_openai_error(&v);
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    // Exactly at the message limit is fine.
    let (status, _, v) = post_json(
        &router,
        "/v1/chat/completions",
        &chat(serde_json::json!({"messages": vec![msg.clone(); 5]})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        b.state.completions.load(Ordering::Relaxed),
        served + 1,
        "no refused request reached the backend"
    );
    router.shutdown().await;
}

#[tokio::test]
async fn a_body_sent_in_several_chunks_reaches_the_backend_byte_for_byte() {
    let b = FakeBackend::start("a", &["m"]).await;
    let router = start_router(config(&[&b])).await;
    let body = br#"{"model":"m","messages":[{"role":"user","content":"one, two and three"}]}"#;
    // Three chunks, the last one empty-terminated: the front door reads them as three frames.
    let (one, rest) = body.split_at(10);
    let (two, three) = rest.split_at(25);
    let mut request = b"POST /v1/chat/completions HTTP/1.1\r\nhost: inferlb\r\nconnection: close\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    for chunk in [one, two, three] {
        request.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        request.extend_from_slice(chunk);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"0\r\n\r\n");
    let answer = send_raw(&router, &request).await;
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    assert_eq!(&b.nth_body(1).await[..], &body[..]);
    router.shutdown().await;
}
