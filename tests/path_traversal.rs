//! Paths that could climb out of `/v1/` on a backend that normalises them are refused by the
//! router itself, and never reach a backend.
//!
//! The requests go out as raw bytes: an HTTP client library (reqwest's URL parser) would
//! normalise `..` and `%2e%2e` before sending, and the router would never see them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// POST `path` with a body that is valid for any `/v1/*` route, on a fresh connection;
/// returns the status and the body.
async fn post_raw(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let body =
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"prompt":"x","input":"x"}"#;
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
        .await
        .expect("the router must answer or close")
        .unwrap();
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (code, body)
}

#[tokio::test]
async fn dot_segments_and_encoded_separators_get_the_routers_400_and_reach_no_backend() {
    let b = FakeBackend::start("a", &["m"]).await;
    let router = start_router(config(&[&b])).await;
    until_backends_json(&router, |v| healthy(v, &b.url())).await;
    let addr = router.addr;

    // Controls: the counters this test relies on do count. A clean path is forwarded to the
    // backend's route, and a clean path the backend does not know reaches its catch-all.
    let (code, body) = post_raw(addr, "/v1/embeddings").await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(b.state.completions.load(Ordering::SeqCst), 1);
    let (code, _) = post_raw(addr, "/v1/no-such-thing").await;
    assert_eq!(code, 404, "the backend's own empty 404");
    assert_eq!(b.state.stray.load(Ordering::SeqCst), 1);
    b.state.completions.store(0, Ordering::SeqCst);
    b.state.stray.store(0, Ordering::SeqCst);

    for path in [
        "/v1/../metrics",
        "/v1/../admin/backends",
        "/v1/chat/completions/..",
        "/v1/chat/../completions",
        "/v1/./chat/completions",
        "/v1/a/./b",
        "/v1/%2e%2e/metrics",
        "/v1/%2E%2E/metrics",
        "/v1/.%2e/metrics",
        "/v1/%2e/embeddings",
        "/v1/x%2Fy",
        "/v1/..%2fmetrics",
        "/v1/x%5Cy",
        "/v1/..%5Cmetrics",
    ] {
        let (code, body) = post_raw(addr, path).await;
        assert_eq!(code, 400, "{path}: {body}");
        let v: serde_json::Value = serde_json::from_str(body.trim())
            .unwrap_or_else(|e| panic!("{path}: not the router's JSON error ({e}): {body:?}"));
        assert_eq!(v["error"]["type"], "invalid_request_error", "{path}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("the path must not contain"),
            "{path}: refused for another reason: {message}"
        );
    }
    assert_eq!(
        b.state.stray.load(Ordering::SeqCst),
        0,
        "a refused path reached the backend: {:?}",
        b.state.last_stray.lock().unwrap()
    );
    assert_eq!(b.state.completions.load(Ordering::SeqCst), 0);
    router.shutdown().await;
}
