//! The malformed-input suite: every case has the one status it must get, every JSON error has
//! OpenAI's shape, and each case is wrong in exactly the way its name says (the rest of the
//! request is valid), so a check that stops working shows up as the case being served. The
//! router must answer a health check after each case: never a hang, never a crash.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What a case must get back.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// The router's own OpenAI-shaped error with this status and, when given, this `code`.
    Error(u16, Option<&'static str>),
    /// Forwarded and served (the case is valid; its name says why it is in this suite).
    Served,
    /// Refused by the HTTP layer before any route ran: this status and no body, or the
    /// connection closed without an answer (status 0).
    Http(u16),
}

use Expect::*;

/// Send raw bytes on a fresh connection; returns the status line's code, the headers
/// (lower-cased) and the body. Code 0: the connection closed without a status line.
async fn raw(addr: std::net::SocketAddr, request: &[u8]) -> (u16, String, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(request).await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
        .await
        .expect("the router must answer or close")
        .unwrap();
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    (code, head.to_ascii_lowercase(), body.to_owned())
}

fn request(method: &str, path: &str, headers: &str, body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{headers}content-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

fn post(path: &str, content_type: &str, body: &[u8]) -> Vec<u8> {
    request(
        "POST",
        path,
        &format!("content-type: {content_type}\r\n"),
        body,
    )
}

fn chat(body: &[u8]) -> Vec<u8> {
    post("/v1/chat/completions", "application/json", body)
}

fn completions(body: &[u8]) -> Vec<u8> {
    post("/v1/completions", "application/json", body)
}

const VALID_CHAT: &[u8] = br#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#;

/// A valid chat body whose nesting reaches `depth` levels: the object itself is level 1, an
/// extra field (ignored by the router's parser, passed on to the backend) holds the rest.
fn chat_nested(depth: usize) -> Vec<u8> {
    let n = depth - 1;
    format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"extra":{}{}}}"#,
        "[".repeat(n),
        "]".repeat(n)
    )
    .into_bytes()
}

fn chat_cases() -> Vec<(&'static str, Expect, Vec<u8>)> {
    let bad = Error(400, None);
    vec![
        ("empty", bad, b"".to_vec()),
        ("whitespace", bad, b"   \n ".to_vec()),
        ("truncated object", bad, br#"{"model":"m","messages":["#.to_vec()),
        ("truncated string", bad, br#"{"model":"m"#.to_vec()),
        (
            "trailing garbage",
            bad,
            br#"{"model":"m","messages":[{"role":"user","content":"x"}]} xyz"#.to_vec(),
        ),
        ("array body", bad, b"[1,2,3]".to_vec()),
        ("string body", bad, b"\"hello\"".to_vec()),
        ("number body", bad, b"42".to_vec()),
        ("null body", bad, b"null".to_vec()),
        (
            "invalid utf-8",
            bad,
            b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}".to_vec(),
        ),
        (
            "lone surrogate",
            bad,
            br#"{"model":"m","messages":[{"role":"user","content":"\ud800"}]}"#.to_vec(),
        ),
        (
            "bad escape",
            bad,
            br#"{"model":"m","messages":[{"role":"user","content":"\q"}]}"#.to_vec(),
        ),
        ("messages missing", Error(400, None), br#"{"model":"m"}"#.to_vec()),
        ("messages null", bad, br#"{"model":"m","messages":null}"#.to_vec()),
        ("messages string", bad, br#"{"model":"m","messages":"hi"}"#.to_vec()),
        ("messages number", bad, br#"{"model":"m","messages":1}"#.to_vec()),
        (
            "messages object",
            bad,
            br#"{"model":"m","messages":{"role":"user","content":"x"}}"#.to_vec(),
        ),
        ("messages empty", bad, br#"{"model":"m","messages":[]}"#.to_vec()),
        ("message not object", bad, br#"{"model":"m","messages":["hi"]}"#.to_vec()),
        ("role missing", bad, br#"{"model":"m","messages":[{"content":"x"}]}"#.to_vec()),
        (
            "role number",
            bad,
            br#"{"model":"m","messages":[{"role":1,"content":"x"}]}"#.to_vec(),
        ),
        (
            "content number",
            bad,
            br#"{"model":"m","messages":[{"role":"user","content":5}]}"#.to_vec(),
        ),
        (
            "content object",
            bad,
            br#"{"model":"m","messages":[{"role":"user","content":{"a":1}}]}"#.to_vec(),
        ),
        (
            "content bool",
            bad,
            br#"{"model":"m","messages":[{"role":"user","content":true}]}"#.to_vec(),
        ),
        (
            "part without type",
            bad,
            br#"{"model":"m","messages":[{"role":"user","content":[{"text":"x"}]}]}"#.to_vec(),
        ),
        (
            "part not object",
            bad,
            br#"{"model":"m","messages":[{"role":"user","content":[1]}]}"#.to_vec(),
        ),
        (
            "part type number",
            bad,
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":3}]}]}"#.to_vec(),
        ),
        (
            "name number",
            bad,
            br#"{"model":"m","messages":[{"role":"user","content":"x","name":5}]}"#.to_vec(),
        ),
        (
            "model number",
            bad,
            br#"{"model":7,"messages":[{"role":"user","content":"x"}]}"#.to_vec(),
        ),
        (
            "model object",
            bad,
            br#"{"model":{},"messages":[{"role":"user","content":"x"}]}"#.to_vec(),
        ),
        (
            "huge number model",
            bad,
            br#"{"model":1e999999,"messages":[{"role":"user","content":"x"}]}"#.to_vec(),
        ),
        (
            "stream string",
            bad,
            br#"{"model":"m","stream":"yes","messages":[{"role":"user","content":"x"}]}"#.to_vec(),
        ),
        (
            "stream number",
            bad,
            br#"{"model":"m","stream":1,"messages":[{"role":"user","content":"x"}]}"#.to_vec(),
        ),
        (
            "user number",
            bad,
            br#"{"model":"m","user":1,"messages":[{"role":"user","content":"x"}]}"#.to_vec(),
        ),
        (
            "duplicate key",
            bad,
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"messages":[{"role":"user","content":"y"}]}"#.to_vec(),
        ),
        (
            "unknown model",
            Error(404, Some("model_not_found")),
            br#"{"model":"no-such-model","messages":[{"role":"user","content":"x"}]}"#.to_vec(),
        ),
        // `max_json_depth` is 64: 63 and 64 levels are served, 65 is the router's own refusal
        // (serde_json alone would accept up to 128), 10 000 must not exhaust the stack.
        ("nesting at 63 levels", Served, chat_nested(63)),
        ("nesting at 64 levels", Served, chat_nested(64)),
        ("nesting at 65 levels", Error(400, None), chat_nested(65)),
        ("nesting at 10000 levels", Error(400, None), chat_nested(10_000)),
        ("control: valid body", Served, VALID_CHAT.to_vec()),
    ]
}

fn completion_cases() -> Vec<(&'static str, Expect, Vec<u8>)> {
    let bad = Error(400, None);
    vec![
        ("prompt missing", bad, br#"{"model":"m"}"#.to_vec()),
        (
            "prompt number",
            bad,
            br#"{"model":"m","prompt":5}"#.to_vec(),
        ),
        (
            "prompt object",
            bad,
            br#"{"model":"m","prompt":{"a":1}}"#.to_vec(),
        ),
        (
            "prompt null",
            bad,
            br#"{"model":"m","prompt":null}"#.to_vec(),
        ),
        (
            "prompt negative token",
            bad,
            br#"{"model":"m","prompt":[-1]}"#.to_vec(),
        ),
        (
            "prompt float token",
            bad,
            br#"{"model":"m","prompt":[1.5]}"#.to_vec(),
        ),
        (
            "prompt huge token",
            bad,
            br#"{"model":"m","prompt":[99999999999999999999]}"#.to_vec(),
        ),
        (
            "prompt mixed array",
            bad,
            br#"{"model":"m","prompt":["a",1]}"#.to_vec(),
        ),
        (
            "prompt nested too deep",
            bad,
            br#"{"model":"m","prompt":[[[1]]]}"#.to_vec(),
        ),
        (
            "prompt bool",
            bad,
            br#"{"model":"m","prompt":true}"#.to_vec(),
        ),
        (
            "control: token ids",
            Served,
            br#"{"model":"m","prompt":[1,2,3]}"#.to_vec(),
        ),
        (
            "control: token batches",
            Served,
            br#"{"model":"m","prompt":[[1],[2]]}"#.to_vec(),
        ),
    ]
}

/// Cases that are not about the body: size, framing, content type, routes and methods.
fn other_cases() -> Vec<(&'static str, Expect, Vec<u8>)> {
    let too_large = Error(413, Some("request_too_large"));
    // Valid JSON, 100 KiB against the 64 KiB limit.
    let big = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "a".repeat(100 * 1024)
    );
    vec![
        ("giant body", too_large, chat(big.as_bytes())),
        (
            "giant declared length",
            too_large,
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: 99999999999\r\n\r\n".to_vec(),
        ),
        (
            "chunked body over the limit",
            too_large,
            {
                let mut r = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
                r.extend_from_slice(format!("{:x}\r\n", big.len()).as_bytes());
                r.extend_from_slice(big.as_bytes());
                r.extend_from_slice(b"\r\n0\r\n\r\n");
                r
            },
        ),
        (
            "chunked garbage",
            Error(400, None),
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n5\r\n{\"mes\r\n0\r\n\r\n".to_vec(),
        ),
        (
            "plain text body",
            Error(400, None),
            post("/v1/chat/completions", "text/plain", b"hello there"),
        ),
        (
            "form body",
            Error(400, None),
            post(
                "/v1/completions",
                "application/x-www-form-urlencoded",
                b"prompt=hi&model=m",
            ),
        ),
        (
            "embeddings garbage",
            Error(400, None),
            post("/v1/embeddings", "application/json", b"{oops"),
        ),
        (
            "unknown route",
            Error(404, Some("not_found")),
            post("/v2/chat/completions", "application/json", VALID_CHAT),
        ),
        ("root", Error(404, Some("not_found")), post("/", "application/json", VALID_CHAT)),
        (
            "wrong method",
            Error(405, Some("method_not_allowed")),
            request("DELETE", "/v1/chat/completions", "", b""),
        ),
        (
            "GET on completions",
            Error(405, Some("method_not_allowed")),
            request("GET", "/v1/completions", "", b""),
        ),
    ]
}

/// Check one answer against its expectation; returns a description of the mismatch.
fn check(name: &str, expect: Expect, code: u16, head: &str, body: &str) -> Result<(), String> {
    match expect {
        Error(status, want_code) => {
            if code != status {
                return Err(format!("{name}: status {code}, want {status}; body {body}"));
            }
            if !head.contains("content-type: application/json") {
                return Err(format!("{name}: not a JSON answer: {head}"));
            }
            let v: serde_json::Value = serde_json::from_str(body.trim())
                .map_err(|e| format!("{name}: not JSON ({e}): {body:?}"))?;
            let e = &v["error"];
            let shaped = e["message"].as_str().is_some_and(|m| !m.is_empty())
                && e["type"].is_string()
                && (e["param"].is_null() || e["param"].is_string())
                && e.as_object().is_some_and(|o| o.contains_key("param"))
                && e.as_object().is_some_and(|o| o.contains_key("code"))
                && (e["code"].is_null() || e["code"].is_string());
            if !shaped {
                return Err(format!("{name}: not OpenAI's error shape: {v}"));
            }
            if let Some(want) = want_code {
                if e["code"] != want {
                    return Err(format!("{name}: code {}, want {want}", e["code"]));
                }
            }
            Ok(())
        }
        Served => {
            if code != 200 || !body.contains("served_by") {
                return Err(format!("{name}: not served: {code} {body}"));
            }
            Ok(())
        }
        Http(status) => {
            if code != status || !body.is_empty() {
                return Err(format!(
                    "{name}: got {code} {body:?}, want {status} without a body"
                ));
            }
            Ok(())
        }
    }
}

async fn health(addr: std::net::SocketAddr) -> u16 {
    raw(
        addr,
        b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    )
    .await
    .0
}

#[tokio::test]
async fn each_malformed_input_gets_its_status_with_an_openai_error() {
    let b = FakeBackend::start("a", &["m"]).await;
    let mut cfg = config(&[&b]);
    cfg.max_body_bytes = 64 * 1024;
    let router = start_router(cfg).await;
    until_backends_json(&router, |v| healthy(v, &b.url())).await;
    let addr = router.addr;
    let mut cases: Vec<(String, Expect, Vec<u8>)> = Vec::new();
    for (name, expect, body) in chat_cases() {
        cases.push((format!("chat: {name}"), expect, chat(&body)));
    }
    for (name, expect, body) in completion_cases() {
        cases.push((format!("completions: {name}"), expect, completions(&body)));
    }
    for (name, expect, request) in other_cases() {
        cases.push((name.to_owned(), expect, request));
    }
    // Header abuse that hyper refuses before routing.
    let abuse: [(&str, &[u8]); 4] = [
        (
            "two content-lengths",
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ncontent-length: 7\r\n\r\nhello",
        ),
        (
            "header line without a colon",
            b"GET /health HTTP/1.1\r\nhost: x\r\nbad header line\r\n\r\n",
        ),
        ("not HTTP", b"NOT-HTTP\r\n\r\n"),
        (
            "control bytes in a header value",
            b"GET /health HTTP/1.1\r\nhost: x\r\nx: \x01\x02\r\n\r\n",
        ),
    ];
    for (name, request) in abuse {
        cases.push((name.to_owned(), Http(400), request.to_vec()));
    }
    assert!(cases.len() >= 60, "only {} cases", cases.len());
    let served_cases = cases.iter().filter(|c| matches!(c.1, Served)).count() as u64;
    let mut failures = Vec::new();
    for (name, expect, request) in &cases {
        let (code, head, body) = raw(addr, request).await;
        if let Err(e) = check(name, *expect, code, &head, &body) {
            failures.push(e);
        }
        assert_eq!(health(addr).await, 200, "the router died after {name}");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Only the cases meant to be served reached the backend.
    assert_eq!(b.state.completions.load(Ordering::SeqCst), served_cases);
    assert_eq!(b.state.stray.load(Ordering::SeqCst), 0);
    router.shutdown().await;
}

/// A 5000-byte `x-request-id` on an otherwise valid request: served, and the backend gets the
/// router's own id instead of the client's (ids over 128 bytes are replaced).
#[tokio::test]
async fn an_oversized_request_id_is_replaced_not_forwarded() {
    let b = FakeBackend::start("a", &["m"]).await;
    let router = start_router(config(&[&b])).await;
    until_backends_json(&router, |v| healthy(v, &b.url())).await;
    let id = "r".repeat(5000);
    for (client_id, forwarded_as_is) in [("short-id-1", true), (id.as_str(), false)] {
        let (code, head, body) = raw(
            router.addr,
            &request(
                "POST",
                "/v1/chat/completions",
                &format!("content-type: application/json\r\nx-request-id: {client_id}\r\n"),
                VALID_CHAT,
            ),
        )
        .await;
        check("oversized request id", Served, code, &head, &body).unwrap();
        let headers = b.state.last_headers.lock().unwrap().clone().unwrap();
        let sent = headers["x-request-id"].to_str().unwrap().to_owned();
        if forwarded_as_is {
            assert_eq!(sent, client_id, "a valid id is passed on");
        } else {
            assert!(
                sent.len() <= 128 && sent != client_id,
                "the backend got a {}-byte id",
                sent.len()
            );
        }
    }
    router.shutdown().await;
}

/// With auth on, each malformed `Authorization` header is a 401 with OpenAI's error and
/// `WWW-Authenticate: Bearer`, on a valid body; the right key on the same body is served.
#[tokio::test]
async fn a_malformed_authorization_header_gets_401_with_auth_on() {
    let b = FakeBackend::start("a", &["m"]).await;
    let mut cfg = config(&[&b]);
    cfg.auth.api_keys = vec!["k1".into()];
    let router = start_router(cfg).await;
    until_backends_json(&router, |v| healthy(v, &b.url())).await;
    for (name, header, expect) in [
        (
            "basic without credentials",
            "authorization: Basic\r\n",
            Error(401, Some("invalid_api_key")),
        ),
        (
            "basic with the key",
            "authorization: Basic k1\r\n",
            Error(401, Some("invalid_api_key")),
        ),
        (
            "bearer without a token",
            "authorization: Bearer\r\n",
            Error(401, Some("invalid_api_key")),
        ),
        (
            "bearer and a space",
            "authorization: Bearer \r\n",
            Error(401, Some("invalid_api_key")),
        ),
        (
            "key without a scheme",
            "authorization: k1\r\n",
            Error(401, Some("invalid_api_key")),
        ),
        (
            "key with a suffix",
            "authorization: Bearer k1x\r\n",
            Error(401, Some("invalid_api_key")),
        ),
        (
            "key prefix",
            "authorization: Bearer k\r\n",
            Error(401, Some("invalid_api_key")),
        ),
        ("no header", "", Error(401, Some("invalid_api_key"))),
        ("control: the key", "authorization: Bearer k1\r\n", Served),
    ] {
        let (code, head, body) = raw(
            router.addr,
            &request(
                "POST",
                "/v1/chat/completions",
                &format!("content-type: application/json\r\n{header}"),
                VALID_CHAT,
            ),
        )
        .await;
        check(name, expect, code, &head, &body).unwrap();
        if matches!(expect, Error(..)) {
            assert!(head.contains("www-authenticate: bearer"), "{name}: {head}");
        }
    }
    assert_eq!(b.state.completions.load(Ordering::SeqCst), 1);
    router.shutdown().await;
}
