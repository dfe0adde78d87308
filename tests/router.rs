//! End-to-end tests of the router over real sockets: scheduling outcomes, health,
//! streaming, model aggregation, error shapes and metrics.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use futures_util::StreamExt;

#[tokio::test]
async fn distinct_prompts_go_to_lowest_kv_usage() {
    let backends = [
        FakeBackend::start("a", &["m"]).await,
        FakeBackend::start("b", &["m"]).await,
        FakeBackend::start("c", &["m"]).await,
    ];
    backends[0].set_metrics(|m| m.kv = 0.9);
    backends[1].set_metrics(|m| m.kv = 0.1);
    backends[2].set_metrics(|m| m.kv = 0.5);
    let router = start_router(config(&backends.iter().collect::<Vec<_>>())).await;
    for i in 0..12 {
        let (status, backend, body) = chat(&router, "m", &format!("question {i}")).await;
        assert_eq!(status, 200);
        assert_eq!(backend.as_deref(), Some(backends[1].url().as_str()));
        assert_eq!(body["served_by"], "b");
    }
    router.shutdown().await;
}

#[tokio::test]
async fn shared_prefix_sticks_until_load_moves_it() {
    let backends = [
        FakeBackend::start("a", &["m"]).await,
        FakeBackend::start("b", &["m"]).await,
        FakeBackend::start("c", &["m"]).await,
    ];
    // Hot-prefix replication off: one prefix taking all the traffic would otherwise get a
    // second holder (tests/placement.rs tests that).
    let mut cfg = config(&backends.iter().collect::<Vec<_>>());
    cfg.plugins.push(inferlb::config::PluginSpec {
        kind: "prefix-cache-scorer".into(),
        name: None,
        parameters: toml::from_str("replicate_share = 0.0").unwrap(),
    });
    let router = start_router(cfg).await;
    let system = "You are a meticulous assistant. ".repeat(60);
    let mut served = Vec::new();
    for i in 0..10 {
        let (status, backend, _) =
            chat(&router, "m", &format!("{system} question number {i}")).await;
        assert_eq!(status, 200);
        served.push(backend.unwrap());
    }
    assert!(served.iter().all(|b| *b == served[0]), "{served:?}");
    // A different prefix is free to go elsewhere, but the shared one keeps its home...
    let home = backends.iter().position(|b| b.url() == served[0]).unwrap();
    // ...until its home is overloaded: queue and KV full, the others idle.
    backends[home].set_metrics(|m| {
        m.waiting = 40.0;
        m.kv = 0.99;
    });
    backends[home].scrapes(2).await;
    let (_, moved, _) = chat(&router, "m", &format!("{system} question number 99")).await;
    assert_ne!(
        moved.unwrap(),
        served[0],
        "an overloaded home must not keep the traffic"
    );
    router.shutdown().await;
}

#[tokio::test]
async fn failing_metrics_eject_then_readmit() {
    let backends = [
        FakeBackend::start("a", &["m"]).await,
        FakeBackend::start("b", &["m"]).await,
    ];
    backends[0].set_metrics(|m| m.kv = 0.0);
    backends[1].set_metrics(|m| m.kv = 0.5);
    let router = start_router(config(&backends.iter().collect::<Vec<_>>())).await;
    let (_, first, _) = chat(&router, "m", "hello").await;
    assert_eq!(first.unwrap(), backends[0].url(), "a has the free cache");

    backends[0].set_metrics(|m| m.status = 500);
    let a = backends[0].url();
    until_backends(&router, &backends[0], |v| !healthy(v, &a)).await;
    for i in 0..5 {
        let (status, b, _) = chat(&router, "m", &format!("while a is out {i}")).await;
        assert_eq!(status, 200);
        assert_eq!(b.unwrap(), backends[1].url());
    }

    backends[0].set_metrics(|m| m.status = 200);
    until_backends(&router, &backends[0], |v| healthy(v, &a)).await;
    let (_, back, _) = chat(&router, "m", "after recovery").await;
    assert_eq!(back.unwrap(), backends[0].url());
    router.shutdown().await;
}

#[tokio::test]
async fn streaming_first_chunk_arrives_while_backend_holds_the_rest() {
    let backend = FakeBackend::start("a", &["m"]).await;
    backend.state.hold_streams.store(true, Ordering::Relaxed);
    let router = start_router(config(&[&backend])).await;
    let resp = common::open_stream(&router).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut stream = resp.bytes_stream();
    let first = tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .expect("first chunk must not wait for the rest")
        .unwrap()
        .unwrap();
    assert_eq!(&first[..], b"data: {\"first\":\"a\"}\n\n");
    // The backend is still holding: nothing more has been sent.
    backend.state.gate.notify_one();
    let mut rest = Vec::new();
    while let Some(chunk) = stream.next().await {
        rest.extend_from_slice(&chunk.unwrap());
    }
    assert_eq!(rest, b"data: {\"second\":true}\n\ndata: [DONE]\n\n");
    router.shutdown().await;
}

#[tokio::test]
async fn models_are_aggregated_from_healthy_backends() {
    let a = FakeBackend::start("a", &["llama", "lora-1"]).await;
    let b = FakeBackend::start("b", &["llama", "qwen"]).await;
    let c = FakeBackend::start("c", &["hidden"]).await;
    c.set_metrics(|m| m.status = 503);
    let router = start_router(config(&[&a, &b, &c])).await;
    let v: serde_json::Value = client()
        .get(router.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["object"], "list");
    let mut ids: Vec<_> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect();
    ids.sort();
    assert_eq!(ids, vec!["llama", "lora-1", "qwen"]);
    // Requests for a model go only to backends serving it.
    for i in 0..6 {
        let (_, served, _) = chat(&router, "qwen", &format!("q{i}")).await;
        assert_eq!(served.unwrap(), b.url());
    }
    router.shutdown().await;
}

fn assert_openai_error(v: &serde_json::Value) {
    let e = &v["error"];
    assert!(e["message"].is_string(), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
}

#[tokio::test]
async fn every_error_status_has_openai_shape() {
    let up = FakeBackend::start("up", &["m"]).await;
    let mut down = FakeBackend::start("down", &["gone"]).await;
    let mut cfg = config(&[&up, &down]);
    cfg.max_body_bytes = 4096;
    // Slow polling: the router still believes `down` is healthy when it is stopped below.
    cfg.poller.interval_ms = 60_000;
    cfg.poller.stale_after_ms = 120_000;
    let router = start_router(cfg).await;
    let c = client();
    let post = |path: &str, body: Vec<u8>| {
        c.post(router.url(path))
            .header("content-type", "application/json")
            .body(body)
    };

    let cases: Vec<(reqwest::RequestBuilder, u16, Option<&str>)> = vec![
        (
            post("/v1/chat/completions", b"{not json".to_vec()),
            400,
            None,
        ),
        (
            post("/v1/chat/completions", br#"{"model":"m"}"#.to_vec()),
            400,
            None,
        ),
        (
            post("/v1/completions", br#"{"model":"m","prompt":{}}"#.to_vec()),
            400,
            None,
        ),
        (
            post("/v1/chat/completions", vec![b' '; 5000]),
            413,
            Some("request_too_large"),
        ),
        (
            post(
                "/v1/chat/completions",
                br#"{"model":"nope","messages":[{"role":"user","content":"x"}]}"#.to_vec(),
            ),
            404,
            Some("model_not_found"),
        ),
        (c.get(router.url("/v2/whatever")), 404, Some("not_found")),
        (
            c.get(router.url("/v1/chat/completions")),
            405,
            Some("method_not_allowed"),
        ),
    ];
    for (req, status, code) in cases {
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status().as_u16(), status);
        let v: serde_json::Value = resp.json().await.unwrap();
        assert_openai_error(&v);
        if let Some(code) = code {
            assert_eq!(v["error"]["code"], code);
        }
    }

    // 502: the only backend for `gone` refuses connections now.
    down.stop().await;
    let (status, _, v) = chat(&router, "gone", "x").await;
    assert_eq!(status, 502);
    assert_openai_error(&v);
    router.shutdown().await;

    // 503: the model is served, but only by an unhealthy backend.
    let sick = FakeBackend::start("sick", &["m"]).await;
    sick.set_metrics(|m| m.status = 500);
    let mut cfg = config(&[&up, &sick]);
    cfg.backends[1].models = Some(vec!["only-on-sick".into()]);
    let router = start_router(cfg).await;
    let (status, _, v) = chat(&router, "only-on-sick", "x").await;
    assert_eq!(status, 503);
    assert_eq!(v["error"]["code"], "no_healthy_backend");
    let ready = client().get(router.url("/ready")).send().await.unwrap();
    assert_eq!(ready.status(), 200, "one backend is healthy");
    router.shutdown().await;
}

#[tokio::test]
async fn ready_follows_the_fleet() {
    let b = FakeBackend::start("a", &["m"]).await;
    b.set_metrics(|m| m.status = 500);
    let router = start_router(config(&[&b])).await;
    assert_eq!(
        client()
            .get(router.url("/ready"))
            .send()
            .await
            .unwrap()
            .status(),
        503
    );
    assert_eq!(
        client()
            .get(router.url("/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    b.set_metrics(|m| m.status = 200);
    let url = b.url();
    until_backends(&router, &b, |v| healthy(v, &url)).await;
    assert_eq!(
        client()
            .get(router.url("/ready"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    router.shutdown().await;
}

#[tokio::test]
async fn original_bytes_and_headers_are_forwarded() {
    let b = FakeBackend::start("a", &["m"]).await;
    let router = start_router(config(&[&b])).await;
    // Odd spacing and key order must survive: the body is forwarded, never re-serialised.
    let raw = b"{ \"messages\" : [{\"content\":\"x\",\"role\":\"user\"}],\n \"model\":\"m\" , \"extra\": 1e3 }".to_vec();
    let resp = client()
        .post(router.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-request-id", "req-42")
        .header("authorization", "Bearer client-secret")
        .header("connection", "x-hop")
        .header("x-hop", "1")
        .body(raw.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-request-id"], "req-42");
    assert_eq!(b.state.last_body.lock().unwrap().as_deref(), Some(&raw[..]));
    let h = b.state.last_headers.lock().unwrap().clone().unwrap();
    assert_eq!(h["x-request-id"], "req-42");
    assert!(
        h.get("authorization").is_none(),
        "client credentials are not forwarded by default"
    );
    assert!(
        h.get("x-hop").is_none(),
        "headers named by Connection are hop-by-hop"
    );
    assert_eq!(h["host"], b.addr.to_string());
    router.shutdown().await;
}

#[tokio::test]
async fn backend_api_key_replaces_client_authorization() {
    let b = FakeBackend::start("a", &["m"]).await;
    let mut cfg = config(&[&b]);
    cfg.backends[0].api_key = Some("backend-key".into());
    let router = start_router(cfg).await;
    let (status, _, _) = chat(&router, "m", "x").await;
    assert_eq!(status, 200);
    let h = b.state.last_headers.lock().unwrap().clone().unwrap();
    assert_eq!(h["authorization"], "Bearer backend-key");
    router.shutdown().await;
}

#[tokio::test]
async fn other_v1_posts_are_forwarded_by_model() {
    let a = FakeBackend::start("a", &["chat"]).await;
    let b = FakeBackend::start("b", &["e5"]).await;
    let router = start_router(config(&[&a, &b])).await;
    let resp = client()
        .post(router.url("/v1/embeddings"))
        .json(&serde_json::json!({"model": "e5", "input": "hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-inferlb-backend"], b.url().as_str());
    router.shutdown().await;
}

#[tokio::test]
async fn metrics_expose_inferlb_series_after_traffic() {
    let b = FakeBackend::start("a", &["m"]).await;
    let router = start_router(config(&[&b])).await;
    let long = "shared prefix text ".repeat(20);
    for i in 0..3 {
        assert_eq!(chat(&router, "m", &format!("{long}{i}")).await.0, 200);
    }
    let _ = chat(&router, "nope", "x").await;
    let page = metrics_text(&router).await;
    let mut found: HashMap<&str, bool> = HashMap::new();
    for name in [
        "inferlb_requests_total",
        "inferlb_request_duration_seconds_bucket",
        "inferlb_time_to_first_byte_seconds_bucket",
        "inferlb_scheduling_duration_seconds_bucket",
        "inferlb_backend_healthy",
        "inferlb_backend_inflight",
        "inferlb_backend_kv_cache_usage_ratio",
        "inferlb_backend_waiting_requests",
        "inferlb_prefix_index_blocks",
        "inferlb_prefix_match_ratio_bucket",
    ] {
        found.insert(name, page.lines().any(|l| l.starts_with(name)));
    }
    assert!(
        found.values().all(|v| *v),
        "missing series: {found:?}\n{page}"
    );
    assert!(
        page.contains(&format!(
            "inferlb_requests_total{{backend=\"{}\",model=\"m\",code=\"200\"}}",
            b.url()
        )),
        "{page}"
    );
    assert!(page.contains("code=\"404\""), "{page}");
    router.shutdown().await;
}

/// Prefill/decode roles: with `[pd]` off (the default), an ordinary request
/// never goes to a `prefill` backend (20 of 20 go to the `decode` one), `/admin/backends`
/// shows each role, and a model only prefill backends serve is unavailable (503). (Seen
/// failing with the role filter left out of the always-applied filters: the second request
/// went to the prefill backend.)
#[tokio::test]
async fn ordinary_requests_never_go_to_a_prefill_backend() {
    let p = FakeBackend::start("p", &["m", "only-p"]).await;
    let d = FakeBackend::start("d", &["m"]).await;
    let mut cfg = config(&[&p, &d]);
    cfg.backends[0].role = Some("prefill".into());
    cfg.backends[1].role = Some("decode".into());
    let router = start_router(cfg).await;
    until_all_healthy(&router).await;
    let v = admin_view(&router).await;
    let role_of = |url: &str| {
        v["backends"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["url"] == url)
            .map(|b| b["role"].clone())
            .unwrap()
    };
    assert_eq!(role_of(&p.url()), "prefill", "{v}");
    assert_eq!(role_of(&d.url()), "decode", "{v}");
    for i in 0..20 {
        let (status, backend, _) = chat(&router, "m", &format!("hello {i}")).await;
        assert_eq!(status, 200);
        assert_eq!(backend.as_deref(), Some(d.url().as_str()), "request {i}");
    }
    assert_eq!(p.state.completions.load(Ordering::Relaxed), 0);
    let (status, _, body) = chat(&router, "only-p", "hello").await;
    assert_eq!(status, 503, "{body}");
    router.shutdown().await;
}

/// The two hot routes are served before the router's tree (`front_door::Routes`): they must
/// keep the client gate, the query string, the router's generated request id, and leave
/// every other method on those paths to the router (its 405).
#[tokio::test]
async fn hot_routes_keep_the_gate_the_query_and_the_405() {
    let b = FakeBackend::start("a", &["m"]).await;
    let mut cfg = config(&[&b]);
    cfg.auth.api_keys = vec!["k1".into()];
    let router = start_router(cfg).await;
    until_all_healthy(&router).await;
    let c = client();
    let chat = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
    let completion = serde_json::json!({"model": "m", "prompt": "x"});
    for (path, body) in [
        ("/v1/chat/completions", &chat),
        ("/v1/completions", &completion),
    ] {
        let no_key = c.post(router.url(path)).json(body).send().await.unwrap();
        assert_eq!(no_key.status(), 401, "{path} without a key");
        assert_eq!(no_key.headers()["www-authenticate"], "Bearer");
        assert_openai_error(&no_key.json().await.unwrap());

        let url = format!("{}?trace=1", router.url(path));
        let ok = c
            .post(url)
            .bearer_auth("k1")
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(ok.status(), 200, "{path} with the key");
        let id = ok.headers()["x-request-id"].to_str().unwrap().to_owned();
        assert!(
            id.len() == 32
                && id
                    .bytes()
                    .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()),
            "generated request id {id:?}"
        );
        let seen = b.state.last_headers.lock().unwrap().clone().unwrap();
        assert_eq!(seen["x-request-id"], id.as_str());
        assert_eq!(seen["host"], b.addr.to_string());
        let uri = b.state.last_uri.lock().unwrap().clone();
        assert_eq!(uri.as_deref(), Some(format!("{path}?trace=1").as_str()));

        for method in [reqwest::Method::GET, reqwest::Method::PUT] {
            let r = c
                .request(method.clone(), router.url(path))
                .bearer_auth("k1")
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 405, "{method} {path}");
            assert_openai_error(&r.json().await.unwrap());
        }
    }
    router.shutdown().await;
}
