//! The Responses API across a fleet: `vllm-sim` servers with their response store on (each
//! keeps its responses in its own memory, as vLLM does) behind the router. A call naming a
//! response — `previous_response_id`, retrieve, cancel, the resumption of a background stream
//! — must reach the server that made it, through this router, another replica that never saw
//! the id, or a restarted one.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{client, start_router, until_all_healthy, TestRouter};
use inferlb::config::Config;
use serde_json::{json, Value};
use vllm_sim::{SimConfig, SimHandle};

const BACKEND: &str = "x-inferlb-backend";

fn sim_config() -> SimConfig {
    SimConfig {
        responses_store: true,
        ..common::sim::config("m")
    }
}

async fn sims(n: usize, cfg: impl Fn() -> SimConfig) -> Vec<SimHandle> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(common::sim::start(cfg()).await);
    }
    out
}

fn router_config(sims: &[&SimHandle]) -> Config {
    common::config_for(sims.iter().map(|s| s.url()))
}

async fn router_over(sims: &[&SimHandle]) -> TestRouter {
    let router = start_router(router_config(sims)).await;
    until_all_healthy(&router).await;
    router
}

/// `POST /v1/responses` through `router`: (status, backend, body).
async fn create(router: &TestRouter, body: &Value) -> (u16, String, Value) {
    let r = client()
        .post(router.url("/v1/responses"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let backend = backend(&r);
    (status, backend, r.json().await.unwrap_or(Value::Null))
}

async fn call(router: &TestRouter, method: reqwest::Method, path: &str) -> (u16, String, Value) {
    let r = client()
        .request(method, router.url(path))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let backend = backend(&r);
    (status, backend, r.json().await.unwrap_or(Value::Null))
}

/// The backend that answered (empty when the router answered itself).
fn backend(r: &reqwest::Response) -> String {
    r.headers()
        .get(BACKEND)
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

/// `/metrics` is one registry for the whole test binary: the tests that read its counters
/// hold this and compare before and after.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `GET /v1/responses/{id}` through `router`.
async fn retrieve(router: &TestRouter, id: &str) -> (u16, String, Value) {
    call(router, reqwest::Method::GET, &format!("/v1/responses/{id}")).await
}

/// A streamed `POST /v1/responses` read to its end: (backend, the events' JSON).
async fn stream(router: &TestRouter, body: &Value) -> (String, Vec<Value>) {
    let r = client()
        .post(router.url("/v1/responses"))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let backend = backend(&r);
    (backend, events(&r.text().await.unwrap()))
}

/// The `data:` lines of an SSE body.
fn events(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn stored(sim: &SimHandle) -> usize {
    sim.stats().responses_stored
}

async fn affinity(router: &TestRouter, outcome: &str) -> f64 {
    common::labelled_sample(
        router,
        "inferlb_responses_affinity_total",
        "outcome",
        outcome,
    )
    .await
}

/// Seen failing with the front door not pinning (every call routed by load alone): the
/// follow-up turns reached servers that never saw the previous response (404).
#[tokio::test]
async fn conversations_by_previous_response_id_stay_with_their_server() {
    let _serial = SERIAL.lock().await;
    let sims = sims(3, sim_config).await;
    let router = router_over(&sims.iter().collect::<Vec<_>>()).await;
    let known = affinity(&router, "known").await;
    for conversation in 0..4 {
        let (status, first, body) = create(
            &router,
            &json!({"model": "m", "instructions": "be brief", "input": format!("hello {conversation}"), "max_output_tokens": 3}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let mut previous = body["id"].as_str().unwrap().to_owned();
        for turn in 2..=3 {
            let (status, backend, body) = create(
                &router,
                &json!({"model": "m", "input": format!("turn {turn}"), "previous_response_id": previous, "max_output_tokens": 3}),
            )
            .await;
            assert_eq!(
                status, 200,
                "conversation {conversation} turn {turn}: {body}"
            );
            assert_eq!(backend, first, "conversation {conversation} turn {turn}");
            assert_eq!(body["previous_response_id"], json!(previous));
            previous = body["id"].as_str().unwrap().to_owned();
        }
        let (status, backend, body) = retrieve(&router, &previous).await;
        assert_eq!((status, backend.as_str()), (200, first.as_str()), "{body}");
        assert_eq!(body["id"], json!(previous));
    }
    assert_eq!(sims.iter().map(stored).sum::<usize>(), 12);
    assert_eq!(affinity(&router, "known").await - known, 12.0);
}

/// A streamed create is learnt from its first event: its follow-up, sent as soon as the
/// stream ends, goes to the same server. Seen failing with the SSE scan disabled (the
/// follow-up was looked up instead: outcome `found`, not `known`), and with the stream's end
/// judged by `[DONE]` (the router appended an error event after `response.completed`).
#[tokio::test]
async fn a_streamed_response_is_learnt_from_its_first_event() {
    let _serial = SERIAL.lock().await;
    let sims = sims(2, sim_config).await;
    let router = router_over(&sims.iter().collect::<Vec<_>>()).await;
    let (backend, events) = stream(
        &router,
        &json!({"model": "m", "input": "stream me", "stream": true, "max_output_tokens": 4}),
    )
    .await;
    let created = &events[0];
    assert_eq!(created["type"], "response.created");
    // vLLM's stream has no `[DONE]`: it ends with this, and the router adds nothing after it.
    assert_eq!(
        events.last().unwrap()["type"],
        "response.completed",
        "{events:?}"
    );
    let id = created["response"]["id"].as_str().unwrap().to_owned();
    let known = affinity(&router, "known").await;
    let (status, follow, body) = create(
        &router,
        &json!({"model": "m", "input": "and then", "previous_response_id": id}),
    )
    .await;
    assert_eq!((status, follow.as_str()), (200, backend.as_str()), "{body}");
    assert_eq!(affinity(&router, "known").await, known + 1.0);
}

/// Another replica (round robin in front of two routers) and a restarted router have never
/// seen the id: they find its holder by asking the fleet, and remember it. Seen failing with
/// the lookup answering `Absent` at once (404 from the replica).
#[tokio::test]
async fn replicas_and_a_restarted_router_find_the_holder() {
    let _serial = SERIAL.lock().await;
    let sims = sims(3, sim_config).await;
    let refs: Vec<_> = sims.iter().collect();
    let a = router_over(&refs).await;
    let b = router_over(&refs).await;
    let (status, holder, body) = create(
        &a,
        &json!({"model": "m", "input": "made through a", "max_output_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200);
    let mut id = body["id"].as_str().unwrap().to_owned();
    let found = affinity(&a, "found").await;
    // Round robin: the turns alternate between the replicas, so each names an id the other
    // replica made.
    for (turn, router) in [&b, &a, &b, &a].into_iter().enumerate() {
        let (status, backend, body) = create(
            router,
            &json!({"model": "m", "input": format!("turn {turn}"), "previous_response_id": id, "max_output_tokens": 2}),
        )
        .await;
        assert_eq!((status, backend.as_str()), (200, holder.as_str()), "{body}");
        id = body["id"].as_str().unwrap().to_owned();
    }
    assert_eq!(
        affinity(&a, "found").await - found,
        4.0,
        "one lookup per turn"
    );
    // b remembers what it looked up.
    let known = affinity(&b, "known").await;
    let (status, backend, _) = retrieve(&b, &id).await;
    assert_eq!((status, backend.as_str()), (200, holder.as_str()));
    let (status, _, _) = retrieve(&b, &id).await;
    assert_eq!(status, 200);
    assert_eq!(
        affinity(&b, "known").await - known,
        1.0,
        "the second retrieval was known"
    );
    // A restart forgets the table; the lookup finds the holder again.
    a.shutdown().await;
    let a = router_over(&refs).await;
    let found = affinity(&a, "found").await;
    let (status, backend, body) = retrieve(&a, &id).await;
    assert_eq!((status, backend.as_str()), (200, holder.as_str()), "{body}");
    assert_eq!(affinity(&a, "found").await - found, 1.0);
}

/// Cancel and retrieve by id reach the holder: a background response (its server stalls
/// before the first token, so it is still running) is cancelled there. Seen failing with
/// pinning off (the cancel went to a server that answered 404).
#[tokio::test]
async fn a_background_response_is_cancelled_on_its_server() {
    let _serial = SERIAL.lock().await;
    let sims = sims(3, || SimConfig {
        first_token_stall_ms: 600_000,
        ..sim_config()
    })
    .await;
    let router = router_over(&sims.iter().collect::<Vec<_>>()).await;
    let mut ids = Vec::new();
    for i in 0..3 {
        let (status, holder, body) = create(
            &router,
            &json!({"model": "m", "input": format!("long job {i}"), "background": true}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["status"], "queued");
        ids.push((body["id"].as_str().unwrap().to_owned(), holder));
    }
    for (id, holder) in &ids {
        let (status, backend, body) = retrieve(&router, id).await;
        assert_eq!((status, backend.as_str()), (200, holder.as_str()), "{body}");
        let (status, backend, body) = call(
            &router,
            reqwest::Method::POST,
            &format!("/v1/responses/{id}/cancel"),
        )
        .await;
        assert_eq!((status, backend.as_str()), (200, holder.as_str()), "{body}");
        assert_eq!(body["status"], "cancelled");
    }
}

/// A background stream, left after a few events, is resumed through the router with
/// `?stream=true&starting_after=N` from its holder: the events after N, to the end. Seen
/// failing with pinning off (another server answered the resumption with an empty body).
#[tokio::test]
async fn a_background_stream_is_resumed_from_its_holder() {
    let _serial = SERIAL.lock().await;
    let sims = sims(3, sim_config).await;
    let router = router_over(&sims.iter().collect::<Vec<_>>()).await;
    for i in 0..3 {
        let (holder, first) = stream(
            &router,
            &json!({"model": "m", "input": format!("resume me {i}"), "background": true, "stream": true, "max_output_tokens": 6}),
        )
        .await;
        let id = first[0]["response"]["id"].as_str().unwrap().to_owned();
        let last = first.last().unwrap()["sequence_number"].as_u64().unwrap();
        let r = client()
            .get(router.url(&format!("/v1/responses/{id}?stream=true&starting_after=3")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(backend(&r), holder);
        let resumed: Vec<u64> = events(&r.text().await.unwrap())
            .iter()
            .map(|e| e["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(resumed, (4..=last).collect::<Vec<_>>());
    }
}

/// Unknown ids get vLLM's own 404 after every server was asked; ids that are not ids are
/// refused before anything is forwarded; a holder that left the fleet is not found.
#[tokio::test]
async fn unknown_bad_and_departed_ids() {
    let _serial = SERIAL.lock().await;
    let sims = sims(2, sim_config).await;
    let router = router_over(&sims.iter().collect::<Vec<_>>()).await;
    let (status, _, body) = retrieve(&router, "resp_nope").await;
    assert_eq!(status, 404);
    assert_eq!(
        body,
        json!({"error": {"message": "Response with id 'resp_nope' not found.", "type": "invalid_request_error", "param": "response_id", "code": 404}})
    );
    let (status, _, _) = create(
        &router,
        &json!({"model": "m", "input": "x", "previous_response_id": "resp_nope2"}),
    )
    .await;
    assert_eq!(status, 404);
    let (status, _, body) = create(
        &router,
        &json!({"model": "m", "input": "x", "previous_response_id": 42}),
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "previous_response_id");
    // vLLM's own routes under /v1/responses/ name no response: the backend answers them.
    let (status, backend, body) =
        call(&router, reqwest::Method::POST, "/v1/responses/compact").await;
    assert_eq!(status, 405, "{body}");
    assert!(!backend.is_empty(), "a backend answered");
    let long = "a".repeat(200);
    let (status, _, _) = retrieve(&router, &long).await;
    assert_eq!(status, 400);
    // Path characters, sent as raw bytes (a client library would normalise them).
    for path in [
        "/v1/responses/a%2f..%2fmetrics",
        "/v1/responses/a%2Fb/cancel",
        "/v1/responses/..%2f",
    ] {
        assert_eq!(raw_status(&router, "GET", path).await, 400, "{path}");
    }
    // Nothing above reached a server except the lookups of the two unknown ids.
    for sim in &sims {
        assert_eq!(sim.stats().prompt_tokens, 0);
    }
    // The holder leaves: a router over the other server alone does not find the id.
    let (status, holder, body) = create(&router, &json!({"model": "m", "input": "here"})).await;
    assert_eq!(status, 200);
    let id = body["id"].as_str().unwrap().to_owned();
    let rest: Vec<_> = sims.iter().filter(|s| s.url() != holder).collect();
    let without = router_over(&rest).await;
    let (status, _, body) = retrieve(&without, &id).await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["param"], "response_id");
}

/// The holder is down: its calls get 503 (it may come back), not another server's 404.
#[tokio::test]
async fn calls_to_a_holder_that_is_down_are_unavailable() {
    let _serial = SERIAL.lock().await;
    let sims = sims(2, sim_config).await;
    let router = router_over(&sims.iter().collect::<Vec<_>>()).await;
    let (id, _) = made_then_down(&router, &sims).await;
    common::until_any_unhealthy(&router).await;
    let (status, _, body) = retrieve(&router, &id).await;
    assert_eq!(status, 503, "{body}");
}

/// A router that never saw the id, with the holder down, cannot say nobody has it: 503, not
/// 404. Seen failing (404) with the lookup deciding from the members that answer alone.
#[tokio::test]
async fn a_lookup_with_the_holder_down_is_unresolved() {
    let _serial = SERIAL.lock().await;
    let sims = sims(2, sim_config).await;
    let refs: Vec<_> = sims.iter().collect();
    let a = router_over(&refs).await;
    let (id, holder) = made_then_down(&a, &sims).await;
    let b = start_router(router_config(&refs)).await;
    common::until_backends_json(&b, |v| {
        v["backends"].as_array().is_some_and(|l| {
            l.iter()
                .any(|x| x["url"] == holder.as_str() && x["healthy"] == false)
                && l.iter()
                    .any(|x| x["url"] != holder.as_str() && x["healthy"] == true)
        })
    })
    .await;
    let (status, _, body) = retrieve(&b, &id).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["param"], "response_id");
}

/// Prefill backends make no responses: a lookup neither asks nor waits for them, so an
/// unknown id in a P/D fleet whose prefill server is down is still vLLM's 404, not a 503 for
/// want of its answer. Seen failing (503) with prefill backends counted in the lookup.
#[tokio::test]
async fn a_pd_fleet_answers_unknown_ids_with_not_found() {
    let _serial = SERIAL.lock().await;
    let whole = common::sim::start(sim_config()).await;
    let prefill = common::sim::start(SimConfig {
        kv_role: vllm_sim::config::KvRole::Prefill,
        ..sim_config()
    })
    .await;
    let mut cfg = router_config(&[&whole, &prefill]);
    cfg.backends[1].role = Some("prefill".into());
    cfg.pd.enabled = true;
    let router = start_router(cfg).await;
    until_all_healthy(&router).await;
    let (status, holder, body) = create(&router, &json!({"model": "m", "input": "short"})).await;
    assert_eq!(
        (status, holder.as_str()),
        (200, whole.url().as_str()),
        "{body}"
    );
    prefill.faults().refuse_connections();
    common::until_any_unhealthy(&router).await;
    let (status, _, body) = retrieve(&router, "resp_unknown").await;
    assert_eq!(status, 404, "{body}");
}

/// A follow-up naming another model goes to the holder anyway, which answers for that model
/// as one vLLM would (its 404), rather than the router answering 503 for ever because another
/// backend serves it. Seen failing (503) with the model filter applied to pinned requests.
#[tokio::test]
async fn a_follow_up_for_another_model_is_the_holders_to_answer() {
    let _serial = SERIAL.lock().await;
    let m = common::sim::start(sim_config()).await;
    let x = common::sim::start(SimConfig {
        model: "x".into(),
        ..sim_config()
    })
    .await;
    let router = router_over(&[&m, &x]).await;
    let (status, holder, body) = create(&router, &json!({"model": "m", "input": "hi"})).await;
    assert_eq!((status, holder.as_str()), (200, m.url().as_str()), "{body}");
    let (status, backend, body) = create(
        &router,
        &json!({"model": "x", "input": "and", "previous_response_id": body["id"]}),
    )
    .await;
    assert_eq!(
        (status, backend.as_str()),
        (404, m.url().as_str()),
        "{body}"
    );
}

/// A response made through `router`, whose server then refuses connections: (id, holder).
async fn made_then_down(router: &TestRouter, sims: &[SimHandle]) -> (String, String) {
    let (status, holder, body) = create(router, &json!({"model": "m", "input": "keep"})).await;
    assert_eq!(status, 200);
    let id = body["id"].as_str().unwrap().to_owned();
    sims.iter()
        .find(|s| s.url() == holder)
        .unwrap()
        .faults()
        .refuse_connections();
    (id, holder)
}

/// Send `method path` as raw bytes and read the status code.
async fn raw_status(router: &TestRouter, method: &str, path: &str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(router.addr).await.unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut status = [0u8; 12];
    s.read_exact(&mut status).await.unwrap();
    std::str::from_utf8(&status[9..12])
        .unwrap()
        .parse()
        .unwrap()
}
