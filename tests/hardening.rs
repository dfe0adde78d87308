//! The defects a review of the router found (issue: "Harden what exists"), each driven through
//! the real HTTP surface: exact per-backend limits, 5xx answers counted for what they are,
//! fleet-safe ejection, bounded metric labels, recording only what was sent, named timeouts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use futures_util::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A raw HTTP/1.1 backend: counts the TCP connections it accepts and the completion requests
/// it reads, serves a small vLLM `/metrics` page and `/v1/models` (model `m`), and answers
/// completions with `status` (0 = never answer), keep-alive, `Content-Length` set.
struct RawBackend {
    url: String,
    connections: Arc<AtomicU64>,
    completions: Arc<AtomicU64>,
    status: Arc<AtomicU64>,
}

impl RawBackend {
    async fn start(status: u16, kv: f64) -> RawBackend {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let connections = Arc::new(AtomicU64::new(0));
        let completions = Arc::new(AtomicU64::new(0));
        let status = Arc::new(AtomicU64::new(u64::from(status)));
        let (c, n, s) = (connections.clone(), completions.clone(), status.clone());
        tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                c.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(serve_raw(sock, n.clone(), s.clone(), kv));
            }
        });
        RawBackend {
            url,
            connections,
            completions,
            status,
        }
    }
}

async fn serve_raw(
    mut sock: tokio::net::TcpStream,
    completions: Arc<AtomicU64>,
    status: Arc<AtomicU64>,
    kv: f64,
) {
    let mut buf = Vec::new();
    loop {
        // Read one request head (and its body, by Content-Length).
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            match sock.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map_or(0, |v| v.trim().parse().unwrap());
        while buf.len() < head_end + length {
            let mut chunk = [0u8; 4096];
            match sock.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let path = head.split_whitespace().nth(1).unwrap_or("/").to_owned();
        buf.drain(..head_end + length);
        let (code, body) = if path.starts_with("/metrics") {
            (
                200,
                format!(
                    "vllm:num_requests_waiting{{engine=\"0\"}} 0\nvllm:kv_cache_usage_perc{{engine=\"0\"}} {kv}\n"
                ),
            )
        } else if path == "/v1/models" {
            (
                200,
                r#"{"object":"list","data":[{"id":"m","object":"model"}]}"#.to_owned(),
            )
        } else {
            completions.fetch_add(1, Ordering::Relaxed);
            match status.load(Ordering::Relaxed) {
                0 => {
                    // Never answer; hold the connection until the router gives up.
                    let mut rest = [0u8; 64];
                    let _ = sock.read(&mut rest).await;
                    return;
                }
                200 => (200, r#"{"object":"chat.completion"}"#.to_owned()),
                code => (code as u16, r#"{"error":{"message":"refused"}}"#.to_owned()),
            }
        };
        let reply = format!(
            "HTTP/1.1 {code} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        if sock.write_all(reply.as_bytes()).await.is_err() {
            return;
        }
    }
}

/// The value of the series `name{…backend="url"…}` on a metrics page (0 when absent).
fn series(page: &str, name: &str, url: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(name) && l.contains(&format!("backend=\"{url}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn outlier_state<'a>(v: &'a serde_json::Value, url: &str) -> &'a serde_json::Value {
    let b = v["backends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["url"] == url)
        .unwrap();
    &b["outlier"]["state"]
}

/// A refused (503) first attempt is retried elsewhere; its answer is read to the end so its
/// keep-alive connection is reused, and it is not counted as a client disconnect. Before the
/// fix every retried answer was dropped: one new connection and one "client disconnect" per
/// request.
#[tokio::test]
async fn a_retried_5xx_keeps_its_connection_and_is_no_client_disconnect() {
    let bad = RawBackend::start(503, 0.0).await;
    let good = RawBackend::start(200, 0.9).await;
    let mut cfg = inferlb::config::Config::default();
    cfg.poller.interval_ms = 20;
    cfg.backends = [&bad.url, &good.url]
        .iter()
        .map(|u| inferlb::config::BackendConfig::from_url((*u).clone()))
        .collect();
    cfg.outlier_detection.consecutive_failures = 0;
    cfg.forward.retry_budget_min_per_sec = 1000;
    // One request worker: every worker keeps backend connections of its own, and each request
    // here comes on a new client connection, which any worker may accept.
    cfg.server.workers = inferlb::workers::Workers::Count(1);
    let router = start_router(cfg).await;
    until_backends_json(&router, |v| healthy(v, &bad.url) && healthy(v, &good.url)).await;
    let before = bad.connections.load(Ordering::Relaxed);
    for i in 0..10 {
        let (status, served, body) = chat(&router, "m", &format!("q{i}")).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(served.unwrap(), good.url);
    }
    assert_eq!(
        bad.completions.load(Ordering::Relaxed),
        10,
        "bad was tried first"
    );
    let opened = bad.connections.load(Ordering::Relaxed) - before;
    assert!(
        opened <= 2,
        "{opened} new connections to the refusing backend for 10 requests"
    );
    let page = metrics_text(&router).await;
    assert_eq!(
        series(&page, "inferlb_client_disconnects_total", &bad.url),
        0.0
    );
    router.shutdown().await;
}

/// A request that every backend refuses with 5xx (a poison request) ejects nobody, even with
/// the most eager ejection setting. Before the fix each retry counted against its backend and
/// one such request could eject the whole fleet.
#[tokio::test]
async fn a_poison_request_ejects_nobody() {
    let a = FakeBackend::start("a", &["m"]).await;
    let b = FakeBackend::start("b", &["m"]).await;
    let c = FakeBackend::start("c", &["m"]).await;
    for x in [&a, &b, &c] {
        x.state.completion_status.store(500, Ordering::Relaxed);
    }
    let mut cfg = config(&[&a, &b, &c]);
    cfg.forward.max_attempts = 3;
    cfg.forward.retry_budget_min_per_sec = 1000;
    cfg.outlier_detection.consecutive_failures = 1;
    cfg.outlier_detection.max_ejection_percent = 100;
    let router = start_router(cfg).await;
    until_backends(&router, &a, |v| {
        healthy(v, &a.url()) && healthy(v, &b.url()) && healthy(v, &c.url())
    })
    .await;
    for i in 0..4 {
        let (status, _, _) = chat(&router, "m", &format!("poison {i}")).await;
        assert_eq!(status, 500);
    }
    let total: u64 = [&a, &b, &c]
        .iter()
        .map(|x| x.state.completions.load(Ordering::Relaxed))
        .sum();
    assert_eq!(total, 12, "every request tried all three backends");
    let v = admin_view(&router).await;
    for x in [&a, &b, &c] {
        assert_eq!(outlier_state(&v, &x.url()), "serving", "{v}");
    }
    router.shutdown().await;
}

/// With eager ejection and two always-failing backends of four, the cap (25 %) lets exactly
/// one be ejected; and a backend that is the last healthy one of its model is never ejected.
#[tokio::test]
async fn ejection_is_capped_and_spares_the_last_backend_of_a_model() {
    let bad1 = FakeBackend::start("bad1", &["m"]).await;
    let bad2 = FakeBackend::start("bad2", &["m"]).await;
    let ok1 = FakeBackend::start("ok1", &["m"]).await;
    let lone = FakeBackend::start("lone", &["rare"]).await;
    for x in [&bad1, &bad2, &lone] {
        x.state.completion_status.store(500, Ordering::Relaxed);
    }
    // The failing backends look idle, so they are picked first.
    ok1.set_metrics(|m| m.kv = 0.9);
    let mut cfg = config(&[&bad1, &bad2, &ok1, &lone]);
    cfg.forward.max_attempts = 1;
    cfg.outlier_detection.consecutive_failures = 1;
    cfg.outlier_detection.base_ejection_ms = 600_000;
    cfg.outlier_detection.max_ejection_percent = 25;
    let router = start_router(cfg).await;
    until_backends(&router, &ok1, |v| {
        [&bad1, &bad2, &ok1, &lone]
            .iter()
            .all(|x| healthy(v, &x.url()))
    })
    .await;
    for i in 0..6 {
        chat(&router, "m", &format!("q{i}")).await;
        chat(&router, "rare", &format!("r{i}")).await;
    }
    let v = admin_view(&router).await;
    let out = [&bad1, &bad2]
        .iter()
        .filter(|x| outlier_state(&v, &x.url()) == "ejected")
        .count();
    assert_eq!(out, 1, "one of four may be out: {v}");
    assert_eq!(
        outlier_state(&v, &lone.url()),
        "serving",
        "the only backend of `rare` stays: {v}"
    );
    assert_eq!(
        lone.state.completions.load(Ordering::Relaxed),
        6,
        "and keeps being tried"
    );
    let page = metrics_text(&router).await;
    let ejected: f64 = [&bad1, &bad2]
        .iter()
        .map(|x| series(&page, "inferlb_backend_ejected", &x.url()))
        .sum();
    assert_eq!(ejected, 1.0, "the ejected gauge agrees");
    router.shutdown().await;
}

/// Client-chosen model names never become metric labels: 20 requests for made-up models
/// while no backend is healthy add no series named after them. Before the fix each one made a
/// new `inferlb_requests_total` series.
#[tokio::test]
async fn made_up_model_names_do_not_become_labels() {
    let down = FakeBackend::start("down", &["m"]).await;
    down.set_metrics(|m| m.status = 500);
    let router = start_router(config(&[&down])).await;
    for i in 0..20 {
        let (status, _, _) = chat(&router, &format!("made-up-{i}"), "x").await;
        assert!(status == 503 || status == 404, "{status}");
    }
    let page = metrics_text(&router).await;
    assert!(!page.contains("made-up-"), "client strings became labels");
    assert!(page
        .lines()
        .any(|l| l.starts_with("inferlb_requests_total") && l.contains("model=\"other\"")));
    router.shutdown().await;
}

/// A pick that is not sent (the retry budget is spent) is not recorded in the prefix index.
/// Before the fix, the failed request's retry pick was recorded on the second backend, so
/// the next request with the same prompt saw both backends as holders and the KV scorer sent
/// it to the second one; now only the backend it was really sent to holds it.
#[tokio::test]
async fn only_sent_attempts_are_recorded_in_the_prefix_index() {
    let a = FakeBackend::start("a", &["m"]).await;
    let b = FakeBackend::start("b", &["m"]).await;
    a.state.completion_status.store(503, Ordering::Relaxed);
    b.set_metrics(|m| m.kv = 0.9);
    let mut cfg = config(&[&a, &b]);
    cfg.forward.retry_budget_ratio = 0.0;
    cfg.forward.retry_budget_min_per_sec = 0;
    cfg.outlier_detection.consecutive_failures = 0;
    let router = start_router(cfg).await;
    until_backends(&router, &a, |v| {
        healthy(v, &a.url()) && healthy(v, &b.url())
    })
    .await;
    let prompt = "a long shared system prompt ".repeat(20);
    let (status, served, _) = chat(&router, "m", &prompt).await;
    assert_eq!((status, served.as_deref()), (503, Some(a.url().as_str())));
    assert_eq!(
        b.state.completions.load(Ordering::Relaxed),
        0,
        "no budget: not sent"
    );
    // Now a is fine and b is the less loaded one.
    a.state.completion_status.store(200, Ordering::Relaxed);
    a.set_metrics(|m| m.kv = 0.9);
    b.set_metrics(|m| m.kv = 0.0);
    a.scrapes(2).await;
    b.scrapes(2).await;
    let (status, served, _) = chat(&router, "m", &prompt).await;
    assert_eq!(status, 200);
    assert_eq!(
        served.unwrap(),
        a.url(),
        "the prompt's prefix is held by a only"
    );
    router.shutdown().await;
}

/// When the whole request's deadline fires before the response timeout, the 504 names the
/// request deadline, not the response timeout.
#[tokio::test]
async fn a_timeout_names_the_limit_that_fired() {
    let silent = RawBackend::start(0, 0.0).await;
    let mut cfg = inferlb::config::Config::default();
    cfg.poller.interval_ms = 20;
    cfg.backends = vec![inferlb::config::BackendConfig::from_url(silent.url.clone())];
    cfg.forward.request_timeout_ms = 300;
    cfg.forward.max_attempts = 1;
    let router = start_router(cfg).await;
    until_backends_json(&router, |v| healthy(v, &silent.url)).await;
    let (status, _, body) = chat(&router, "m", "x").await;
    assert_eq!(status, 504, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("300 ms") && message.contains("request_timeout_ms"),
        "{message}"
    );
    silent.status.store(200, Ordering::Relaxed);
    router.shutdown().await;
}

/// Poll `cond` every 10 ms for at most 30 s (a loaded 2-core machine), then fail with `what`.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The per-backend limit is exact and a freed slot admits exactly one waiting request, which
/// the router reports as waiting meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_per_backend_limit_is_exact_and_one_slot_admits_one_waiter() {
    let b = FakeBackend::start("a", &["m"]).await;
    b.state.hold_streams.store(true, Ordering::Relaxed);
    let mut cfg = config(&[&b]);
    cfg.limits.max_inflight_per_backend = 2;
    cfg.limits.queue_timeout_ms = 60_000;
    let router = Arc::new(start_router(cfg).await);
    until_backends(&router, &b, |v| healthy(v, &b.url())).await;
    let mut streams = Vec::new();
    for _ in 0..8 {
        let r = Arc::clone(&router);
        streams.push(tokio::spawn(async move {
            let mut s = open_stream(&r).await.bytes_stream();
            while s.next().await.is_some() {}
        }));
    }
    until_backends_json(&router, |v| v["waiting_for_slot"] == 6).await;
    let sent = || b.state.completions.load(Ordering::Relaxed);
    eventually("two requests reach the backend", || sent() == 2).await;
    let v = admin_view(&router).await;
    assert_eq!(
        (
            v["backends"][0]["inflight"].clone(),
            v["waiting_for_slot"].clone()
        ),
        (2.into(), 6.into())
    );
    assert_eq!(sent(), 2, "no third request got past the limit");
    // Release one held stream: exactly one waiter takes its slot.
    b.state.gate.notify_one();
    eventually("the freed slot is used", || sent() == 3).await;
    let v = admin_view(&router).await;
    assert_eq!(
        (
            v["backends"][0]["inflight"].clone(),
            v["waiting_for_slot"].clone()
        ),
        (2.into(), 5.into())
    );
    assert_eq!(sent(), 3, "one slot, one waiter");
    // Let everything finish.
    b.state.hold_streams.store(false, Ordering::Relaxed);
    eventually("all eight are served", || {
        b.state.gate.notify_waiters();
        sent() == 8 && streams.iter().all(|s| s.is_finished())
    })
    .await;
    until_backends_json(&router, |v| {
        v["backends"][0]["inflight"] == 0 && v["waiting_for_slot"] == 0
    })
    .await;
}

/// POST the raw `body` to `path` on the router; the status.
async fn post_raw(router: &common::TestRouter, path: &str, body: &'static str) -> u16 {
    client()
        .post(router.url(path))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// The value of the unlabelled series `name` on `page` (0 when absent).
fn unlabelled(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| l.split(' ').next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A client's own `kv_transfer_params` never reaches a backend: it names the host and port
/// a vLLM decode engine would connect to. Chat, completions and another JSON `/v1/*` route
/// each lose the key (and only it), and each removal is counted. (Seen failing with
/// `client_body` returning the body unchanged: the backend got the key, the counter stayed 0.)
/// This is the only test in this binary that strips, so the counter's value is exact.
#[tokio::test]
async fn a_client_kv_transfer_params_is_removed_on_every_route() {
    let (fakes, router) = fleet(&["a"], |_| {}).await;
    let a = &fakes[0];
    let cases = [
        (
            "/v1/chat/completions",
            r#"{"model":"m","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.9.9.9","remote_port":5600},"messages":[{"role":"user","content":"hi"}],"seed":7}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"seed":7}"#,
        ),
        (
            "/v1/completions",
            r#"{"model":"m","prompt":"hi","kv_transfer_param\u0073":{"do_remote_decode":true},"max_tokens":3}"#,
            r#"{"model":"m","prompt":"hi","max_tokens":3}"#,
        ),
        (
            "/v1/embeddings",
            r#"{"model":"m","input":"hi","kv_transfer_params":null}"#,
            r#"{"model":"m","input":"hi"}"#,
        ),
    ];
    for (n, (path, sent, expected)) in cases.into_iter().enumerate() {
        assert_eq!(post_raw(&router, path, sent).await, 200, "{path}");
        let got = a.nth_body(n + 1).await;
        assert_eq!(std::str::from_utf8(&got).unwrap(), expected, "{path}");
        let page = metrics_text(&router).await;
        assert_eq!(
            unlabelled(&page, "inferlb_kv_transfer_params_stripped_total"),
            (n + 1) as f64,
            "{path}"
        );
    }
    router.shutdown().await;
}

/// With `forward.allow_client_kv_transfer_params`, the body goes through as sent; and a body
/// without the key is always forwarded byte for byte (the zero-copy path: key order, spacing
/// and number spellings untouched).
#[tokio::test]
async fn trusted_callers_keep_their_kv_transfer_params_and_other_bodies_are_untouched() {
    let (fakes, router) = fleet(&["a"], |c| c.forward.allow_client_kv_transfer_params = true).await;
    let a = &fakes[0];
    let with = r#"{"model":"m",  "kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[[0,1]]},"messages":[{"role":"user","content":"hi"}]}"#;
    assert_eq!(post_raw(&router, "/v1/chat/completions", with).await, 200);
    assert_eq!(&a.nth_body(1).await[..], with.as_bytes());
    router.shutdown().await;

    let (fakes, router) = fleet(&["b"], |_| {}).await;
    let b = &fakes[0];
    let without = r#"{ "seed": 1.0e3, "model":"m","messages":[{"role":"user","content":"h\u0069"}] ,"kv":{"kv_transfer_params":1}}"#;
    assert_eq!(
        post_raw(&router, "/v1/chat/completions", without).await,
        200
    );
    b.nth_body(1).await;
    let last = b.state.last_body.lock().unwrap().clone().unwrap();
    assert_eq!(&last[..], without.as_bytes());
    router.shutdown().await;
}
