//! The malformed-input suite: every case must get a 4xx with OpenAI's error shape — never a
//! 5xx, never a hang, never a crash (the router answers a health check after each case).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Send raw bytes on a fresh connection and return the status line's code and the body.
async fn raw(addr: std::net::SocketAddr, request: &[u8]) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
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

fn post(path: &str, content_type: &str, body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

fn json_cases() -> Vec<(&'static str, Vec<u8>)> {
    let deep = format!("{{\"messages\":{}{}}}", "[".repeat(200), "]".repeat(200));
    let mut cases: Vec<(&'static str, Vec<u8>)> = vec![
        ("empty", b"".to_vec()),
        ("whitespace", b"   \n ".to_vec()),
        (
            "truncated object",
            b"{\"model\":\"m\",\"messages\":[".to_vec(),
        ),
        ("truncated string", b"{\"model\":\"m".to_vec()),
        (
            "trailing garbage",
            b"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]} xyz".to_vec(),
        ),
        ("array body", b"[1,2,3]".to_vec()),
        ("string body", b"\"hello\"".to_vec()),
        ("number body", b"42".to_vec()),
        ("null body", b"null".to_vec()),
        (
            "invalid utf-8",
            b"{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}".to_vec(),
        ),
        (
            "lone surrogate",
            br#"{"messages":[{"role":"user","content":"\ud800"}]}"#.to_vec(),
        ),
        (
            "bad escape",
            br#"{"messages":[{"role":"user","content":"\q"}]}"#.to_vec(),
        ),
        ("messages missing", br#"{"model":"m"}"#.to_vec()),
        ("messages null", br#"{"messages":null}"#.to_vec()),
        ("messages string", br#"{"messages":"hi"}"#.to_vec()),
        ("messages number", br#"{"messages":1}"#.to_vec()),
        (
            "messages object",
            br#"{"messages":{"role":"user"}}"#.to_vec(),
        ),
        ("messages empty", br#"{"messages":[]}"#.to_vec()),
        ("message not object", br#"{"messages":["hi"]}"#.to_vec()),
        (
            "role missing",
            br#"{"messages":[{"content":"x"}]}"#.to_vec(),
        ),
        (
            "role number",
            br#"{"messages":[{"role":1,"content":"x"}]}"#.to_vec(),
        ),
        (
            "content number",
            br#"{"messages":[{"role":"user","content":5}]}"#.to_vec(),
        ),
        (
            "content object",
            br#"{"messages":[{"role":"user","content":{"a":1}}]}"#.to_vec(),
        ),
        (
            "content bool",
            br#"{"messages":[{"role":"user","content":true}]}"#.to_vec(),
        ),
        (
            "part without type",
            br#"{"messages":[{"role":"user","content":[{"text":"x"}]}]}"#.to_vec(),
        ),
        (
            "part not object",
            br#"{"messages":[{"role":"user","content":[1]}]}"#.to_vec(),
        ),
        (
            "part type number",
            br#"{"messages":[{"role":"user","content":[{"type":3}]}]}"#.to_vec(),
        ),
        (
            "name number",
            br#"{"messages":[{"role":"user","content":"x","name":5}]}"#.to_vec(),
        ),
        (
            "model number",
            br#"{"model":7,"messages":[{"role":"user","content":"x"}]}"#.to_vec(),
        ),
        (
            "model object",
            br#"{"model":{},"messages":[{"role":"user","content":"x"}]}"#.to_vec(),
        ),
        (
            "stream string",
            br#"{"stream":"yes","messages":[{"role":"user","content":"x"}]}"#.to_vec(),
        ),
        (
            "stream number",
            br#"{"stream":1,"messages":[{"role":"user","content":"x"}]}"#.to_vec(),
        ),
        (
            "user number",
            br#"{"user":1,"messages":[{"role":"user","content":"x"}]}"#.to_vec(),
        ),
        (
            "duplicate key",
            br#"{"messages":[],"messages":[]}"#.to_vec(),
        ),
        (
            "huge number model",
            br#"{"model":1e999999,"messages":[{"role":"user","content":"x"}]}"#.to_vec(),
        ),
        ("deep nesting", deep.into_bytes()),
        (
            "unknown model",
            br#"{"model":"no-such-model","messages":[{"role":"user","content":"x"}]}"#.to_vec(),
        ),
    ];
    cases.shrink_to_fit();
    cases
}

fn completion_cases() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("prompt missing", br#"{"model":"m"}"#.to_vec()),
        ("prompt number", br#"{"prompt":5}"#.to_vec()),
        ("prompt object", br#"{"prompt":{"a":1}}"#.to_vec()),
        ("prompt null", br#"{"prompt":null}"#.to_vec()),
        ("prompt negative token", br#"{"prompt":[-1]}"#.to_vec()),
        ("prompt float token", br#"{"prompt":[1.5]}"#.to_vec()),
        (
            "prompt huge token",
            br#"{"prompt":[99999999999999999999]}"#.to_vec(),
        ),
        ("prompt mixed array", br#"{"prompt":["a",1]}"#.to_vec()),
        ("prompt nested too deep", br#"{"prompt":[[[1]]]}"#.to_vec()),
        ("prompt bool", br#"{"prompt":true}"#.to_vec()),
    ]
}

#[tokio::test]
async fn malformed_inputs_get_4xx_with_openai_errors() {
    let b = FakeBackend::start("a", &["m"]).await;
    let mut cfg = config(&[&b]);
    cfg.max_body_bytes = 64 * 1024;
    let router = start_router(cfg).await;
    let addr = router.addr;
    let mut requests: Vec<(String, Vec<u8>)> = Vec::new();
    for (name, body) in json_cases() {
        requests.push((
            format!("chat: {name}"),
            post("/v1/chat/completions", "application/json", &body),
        ));
    }
    for (name, body) in completion_cases() {
        requests.push((
            format!("completions: {name}"),
            post("/v1/completions", "application/json", &body),
        ));
    }
    let big = vec![b'a'; 100 * 1024];
    requests.extend([
        ("giant body".to_owned(), post("/v1/chat/completions", "application/json", &big)),
        (
            "giant declared length".to_owned(),
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 99999999999\r\n\r\n".to_vec(),
        ),
        ("wrong content type, garbage".to_owned(), post("/v1/chat/completions", "text/plain", b"hello there")),
        ("form body".to_owned(), post("/v1/completions", "application/x-www-form-urlencoded", b"prompt=hi&model=m")),
        ("embeddings garbage".to_owned(), post("/v1/embeddings", "application/json", b"{oops")),
        ("path traversal".to_owned(), post("/v1/../admin/backends", "application/json", b"{}")),
        ("encoded traversal".to_owned(), post("/v1/%2e%2e/metrics", "application/json", b"{}")),
        ("encoded slash".to_owned(), post("/v1/chat%2Fcompletions", "application/json", b"{}")),
        ("unknown route".to_owned(), post("/v2/chat/completions", "application/json", b"{}")),
        ("root".to_owned(), post("/", "application/json", b"{}")),
        (
            "wrong method".to_owned(),
            b"DELETE /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".to_vec(),
        ),
        (
            "GET on completions".to_owned(),
            b"GET /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".to_vec(),
        ),
        (
            "oversized request id".to_owned(),
            {
                let id = "r".repeat(5000);
                let body = b"{\"prompt\":5}";
                format!(
                    "POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-request-id: {id}\r\ncontent-length: {}\r\n\r\n{}",
                    body.len(),
                    String::from_utf8_lossy(body)
                )
                .into_bytes()
            },
        ),
        (
            "bad authorization header".to_owned(),
            {
                let body = br#"{"prompt":[1.5]}"#;
                let mut r = format!(
                    "POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\nauthorization: Basic\r\ncontent-length: {}\r\n\r\n",
                    body.len()
                )
                .into_bytes();
                r.extend_from_slice(body);
                r
            },
        ),
        (
            "chunked garbage".to_owned(),
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n5\r\n{\"mes\r\n0\r\n\r\n".to_vec(),
        ),
    ]);
    assert!(requests.len() >= 50, "only {} cases", requests.len());
    for (name, request) in &requests {
        let (code, body) = raw(addr, request).await;
        assert!(
            (400..500).contains(&code),
            "{name}: status {code}, body {body}"
        );
        if !body.is_empty() {
            let v: serde_json::Value = serde_json::from_str(body.trim())
                .unwrap_or_else(|e| panic!("{name}: not JSON ({e}): {body}"));
            assert!(v["error"]["message"].is_string(), "{name}: {body}");
            assert!(v["error"]["type"].is_string(), "{name}: {body}");
        }
        // Still alive after each case.
        let (health, _) = raw(
            addr,
            b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        )
        .await;
        assert_eq!(health, 200, "after {name}");
    }
    // Header abuse that hyper refuses before routing: a 4xx status, no body requirement.
    let abuse: [&[u8]; 4] = [
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ncontent-length: 7\r\n\r\nhello",
        b"GET /health HTTP/1.1\r\nhost: x\r\nbad header line\r\n\r\n",
        b"NOT-HTTP\r\n\r\n",
        b"GET /health HTTP/1.1\r\nhost: x\r\nx: \x01\x02\r\n\r\n",
    ];
    for request in abuse {
        let (code, _) = raw(addr, request).await;
        assert!(
            code == 0 || (400..500).contains(&code),
            "{:?}: {code}",
            String::from_utf8_lossy(request)
        );
    }
    let (health, _) = raw(
        addr,
        b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(health, 200);
    router.shutdown().await;
}
