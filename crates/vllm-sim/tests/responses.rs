//! The Responses API as vLLM 0.32 serves it: whole and streamed bodies, the store and its
//! unhappy paths (404s, cancels, store off), `previous_response_id` chains seen through the
//! prefix cache, background runs and resumed streams, client-chosen ids.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{client, fast, get_response, post, post_json, real_time, start};
use futures_util::StreamExt;
use serde_json::{json, Value};
use vllm_sim::tokenizer::{render_chat, tokenize, ChatMessage};
use vllm_sim::{SimConfig, SimHandle};

const WAIT: Duration = Duration::from_secs(10);

/// `cfg` with the store on (vLLM's `VLLM_ENABLE_RESPONSES_API_STORE=1`).
fn stored(cfg: SimConfig) -> SimConfig {
    SimConfig {
        responses_store: true,
        ..cfg
    }
}

fn url(sim: &SimHandle, path: &str) -> String {
    format!("{}/v1/responses{path}", sim.url())
}

async fn create(sim: &SimHandle, body: Value) -> reqwest::Response {
    post(&url(sim, ""), &body).await
}

async fn create_json(sim: &SimHandle, body: Value) -> Value {
    let r = create(sim, body).await;
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// Status and JSON body of `GET /v1/responses{path}`.
async fn retrieve(sim: &SimHandle, path: &str) -> (u16, Value) {
    let r = get_response(&url(sim, path)).await;
    (r.status().as_u16(), r.json().await.unwrap())
}

async fn cancel(sim: &SimHandle, id: &str) -> (u16, Value) {
    let r = client()
        .post(url(sim, &format!("/{id}/cancel")))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

fn not_found(id: &str) -> Value {
    json!({"error": {"message": format!("Response with id '{id}' not found."),
        "type": "invalid_request_error", "param": "response_id", "code": 404}})
}

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage {
        role: role.into(),
        content: content.into(),
    }
}

/// Prompt tokens of `messages` as a chat request of them is tokenised.
fn tokens_of(messages: &[ChatMessage]) -> u64 {
    tokenize(&render_chat(messages, true)).len() as u64
}

fn text_of(v: &Value) -> String {
    v["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap()
        .to_string()
}

/// SSE frames as (event, data) pairs; every frame must have both lines.
fn frames(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|f| !f.is_empty())
        .map(|f| {
            let (event, data) = f.split_once('\n').expect("two lines");
            let event = event.strip_prefix("event: ").expect("an event line");
            let data = data.strip_prefix("data: ").expect("a data line");
            assert!(!data.contains('\n'), "compact JSON on one line");
            (event.to_string(), serde_json::from_str(data).unwrap())
        })
        .collect()
}

/// Reads body frames until at least `n` SSE events have arrived; the events and the stream.
async fn first_frames(
    resp: reqwest::Response,
    n: usize,
) -> (
    Vec<(String, Value)>,
    impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>>,
) {
    let mut s = resp.bytes_stream();
    let mut buf = String::new();
    while buf.matches("\n\n").count() < n {
        let chunk = s.next().await.expect("more events").unwrap();
        buf.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    (frames(&buf), s)
}

fn seqs(f: &[(String, Value)]) -> Vec<u64> {
    f.iter()
        .map(|(_, d)| d["sequence_number"].as_u64().unwrap())
        .collect()
}

#[tokio::test]
async fn whole_response_has_vllm_shape() {
    let sim = start(fast()).await;
    let r = create(
        &sim,
        json!({"input": "hello", "instructions": "be brief", "max_output_tokens": 5}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let raw = r.text().await.unwrap();
    assert!(raw.starts_with(r#"{"id":"resp_"#), "id comes first: {raw}");
    let v: Value = serde_json::from_str(&raw).unwrap();
    let id = v["id"].as_str().unwrap();
    assert_eq!(id.len(), 21, "resp_ + 16 hex digits: {id}");
    assert!(id[5..]
        .chars()
        .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c)));
    assert_eq!(v["object"], "response");
    assert_eq!(v["model"], vllm_sim::config::DEFAULT_MODEL);
    assert!(v["created_at"].as_u64().unwrap() > 1_700_000_000);
    // The simulator always ends at the length limit: vLLM's `incomplete`.
    assert_eq!(v["status"], "incomplete");
    assert_eq!(
        v["incomplete_details"],
        json!({"reason": "max_output_tokens"})
    );
    assert_eq!(v["instructions"], "be brief");
    assert_eq!(v["max_output_tokens"], 5);
    assert_eq!(v["background"], false);
    assert_eq!(v["previous_response_id"], Value::Null);
    assert_eq!(v["tool_choice"], "none");
    let out = &v["output"];
    assert_eq!(out.as_array().unwrap().len(), 1);
    assert!(out[0]["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(out[0]["type"], "message");
    assert_eq!(out[0]["role"], "assistant");
    assert_eq!(out[0]["status"], "completed");
    assert_eq!(out[0]["content"][0]["type"], "output_text");
    assert_eq!(out[0]["content"][0]["annotations"], json!([]));
    assert_eq!(tokenize(&text_of(&v)).len(), 5);
    // Prompt: the instructions as a system message, then the input as a user message,
    // rendered as a chat request would be.
    let input = tokens_of(&[msg("system", "be brief"), msg("user", "hello")]);
    let u = &v["usage"];
    assert_eq!(u["input_tokens"], input);
    assert_eq!(u["output_tokens"], 5);
    assert_eq!(u["total_tokens"], input + 5);
    assert_eq!(u["input_tokens_details"]["cached_tokens"], 0);
    assert_eq!(sim.stats().prompt_tokens, input);
    // The chat default output length applies without max_output_tokens.
    let v = create_json(&sim, json!({"input": "hello"})).await;
    assert_eq!(v["max_output_tokens"], 256);
    assert_eq!(v["usage"]["output_tokens"], 256);
    // Unknown models are vLLM's usual 404.
    let r = create(&sim, json!({"model": "nope", "input": "x"})).await;
    assert_eq!(r.status(), 404);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "model");
}

#[tokio::test]
async fn stream_sends_vllms_events_in_order_without_done() {
    let sim = start(fast()).await;
    let r = create(
        &sim,
        json!({"input": "hello", "max_output_tokens": 3, "stream": true}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
    let text = r.text().await.unwrap();
    assert!(!text.contains("[DONE]"));
    assert!(text.ends_with("\n\n"));
    let f = frames(&text);
    let kinds: Vec<&str> = f.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    assert_eq!(seqs(&f), (0..11).collect::<Vec<u64>>());
    for (k, d) in &f {
        assert_eq!(d["type"], k.as_str(), "the data's type names its event");
    }
    let created = &f[0].1["response"];
    let id = created["id"].as_str().unwrap();
    assert!(id.starts_with("resp_"));
    assert_eq!(created["status"], "in_progress");
    assert_eq!(created["output"], json!([]));
    assert_eq!(created["usage"], Value::Null);
    let item_id = f[2].1["item"]["id"].as_str().unwrap();
    assert_eq!(f[2].1["item"]["status"], "in_progress");
    assert_eq!(f[3].1["part"]["logprobs"], json!([]));
    let deltas: String = f[4..7]
        .iter()
        .map(|(_, d)| {
            assert_eq!(d["item_id"], item_id);
            d["delta"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(f[7].1["text"], deltas.as_str());
    assert_eq!(f[8].1["part"]["text"], deltas.as_str());
    assert_eq!(f[8].1["part"]["logprobs"], Value::Null);
    assert_eq!(f[9].1["item"]["status"], "completed");
    // `response.completed` carries the final object even though its status is incomplete.
    let done = &f[10].1["response"];
    assert_eq!(done["id"], id);
    assert_eq!(done["status"], "incomplete");
    assert_eq!(text_of(done), deltas);
    assert_eq!(done["usage"]["output_tokens"], 3);
    // The store is off by default: nothing was kept.
    assert_eq!(
        retrieve(&sim, &format!("/{id}")).await,
        (404, not_found(id))
    );
}

#[tokio::test]
async fn stored_responses_are_retrieved_and_unknown_ids_are_vllms_404() {
    let sim = start(stored(fast())).await;
    let v = create_json(&sim, json!({"input": "hello", "max_output_tokens": 4})).await;
    let id = v["id"].as_str().unwrap();
    assert_eq!(retrieve(&sim, &format!("/{id}")).await, (200, v.clone()));
    assert_eq!(sim.stats().responses_stored, 1);
    assert_eq!(sim.stored_response(id), Some(v.clone()));
    // A completed stream is stored as well.
    let r = create(
        &sim,
        json!({"input": "x", "max_output_tokens": 2, "stream": true}),
    )
    .await;
    let f = frames(&r.text().await.unwrap());
    let streamed = f.last().unwrap().1["response"].clone();
    let sid = streamed["id"].as_str().unwrap();
    assert_eq!(retrieve(&sim, &format!("/{sid}")).await, (200, streamed));
    assert_eq!(sim.stats().responses_stored, 2);

    assert_eq!(
        retrieve(&sim, "/resp_nope").await,
        (404, not_found("resp_nope"))
    );
    assert_eq!(
        cancel(&sim, "resp_nope").await,
        (404, not_found("resp_nope"))
    );
    let r = create(
        &sim,
        json!({"input": "x", "previous_response_id": "resp_nope"}),
    )
    .await;
    assert_eq!(r.status(), 404);
    assert_eq!(r.json::<Value>().await.unwrap(), not_found("resp_nope"));
    // Routes vLLM does not serve: Starlette's bodies.
    let r = get_response(&url(&sim, &format!("/{id}/input_items"))).await;
    assert_eq!(r.status(), 404);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"detail": "Not Found"})
    );
    let r = client()
        .delete(url(&sim, &format!("/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"detail": "Method Not Allowed"})
    );
    assert_eq!(
        retrieve(&sim, &format!("/{id}")).await.0,
        200,
        "not deleted"
    );
}

#[tokio::test]
async fn previous_response_id_chains_build_the_prompt_as_vllm() {
    let sim = start(stored(fast())).await;
    let sys = "You answer questions about routing, briefly and without repeating yourself. ";
    // Turn 1: instructions first, two text parts joined with "\n".
    let r1 = create_json(
        &sim,
        json!({"instructions": sys, "max_output_tokens": 40, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "first"}, {"type": "input_text", "text": "part2"}]}]}),
    )
    .await;
    let turn1 = vec![msg("system", sys), msg("user", "first\npart2")];
    let p1 = tokens_of(&turn1);
    assert_eq!(r1["usage"]["input_tokens"], p1);
    // Turn 2, same instructions: the stored messages minus the system one, the previous
    // output as an assistant message, the new input. It starts with turn 1's prompt and its
    // generated tokens: every full block of them (39 of the 40 outputs' KV) is a hit.
    let r2 = create_json(
        &sim,
        json!({"instructions": sys, "input": "second", "max_output_tokens": 40,
               "previous_response_id": r1["id"]}),
    )
    .await;
    let mut turn2 = turn1.clone();
    turn2.push(msg("assistant", &text_of(&r1)));
    turn2.push(msg("user", "second"));
    let p2 = tokens_of(&turn2);
    assert_eq!(r2["usage"]["input_tokens"], p2);
    assert!(p2 > p1 + 40);
    assert_eq!(r2["previous_response_id"], r1["id"]);
    let hit = r2["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(hit, (p1 + 39) / 16 * 16, "turn 2 reuses turn 1's blocks");
    // Turn 3, no instructions: the system message is not carried over, so the prompt no
    // longer starts like turn 2's and nothing is cached.
    let before = sim.stats().prefix_hits;
    let r3 = create_json(
        &sim,
        json!({"input": [{"role": "user", "content": "third"}], "max_output_tokens": 4,
               "previous_response_id": r2["id"]}),
    )
    .await;
    let mut turn3: Vec<ChatMessage> = turn2[1..].to_vec();
    turn3.push(msg("assistant", &text_of(&r2)));
    turn3.push(msg("user", "third"));
    assert_eq!(r3["usage"]["input_tokens"], tokens_of(&turn3));
    assert_eq!(r3["usage"]["input_tokens_details"]["cached_tokens"], 0);
    assert_eq!(sim.stats().prefix_hits, before);
    assert_eq!(r3["instructions"], Value::Null);
}

#[tokio::test]
async fn background_responses_are_queued_and_cancelled() {
    let sim = start(stored(real_time())).await;
    let q = create_json(
        &sim,
        json!({"input": "long", "max_output_tokens": 5000, "background": true}),
    )
    .await;
    let id = q["id"].as_str().unwrap();
    assert_eq!(q["status"], "queued");
    assert_eq!(q["background"], true);
    assert_eq!(q["output"], json!([]));
    assert_eq!(q["usage"], Value::Null);
    let (s, ok) = sim.wait_for_stats(WAIT, |s| s.running == 1).await;
    assert!(ok, "the background request runs: {s:?}");
    // vLLM never marks this path in_progress: GET shows the queued object until the end.
    assert_eq!(retrieve(&sim, &format!("/{id}")).await, (200, q.clone()));
    let (status, c) = cancel(&sim, id).await;
    assert_eq!(status, 200);
    assert_eq!(c["status"], "cancelled");
    assert_eq!(c["output"], json!([]));
    assert_eq!(c["usage"], Value::Null);
    let (s, ok) = sim
        .wait_for_stats(WAIT, |s| s.aborted == 1 && s.used_blocks == 0)
        .await;
    assert!(ok, "cancel aborts the engine request: {s:?}");
    assert_eq!(retrieve(&sim, &format!("/{id}")).await, (200, c));
    let refused = json!({"error": {"message": "Cannot cancel a synchronous response.",
        "type": "invalid_request_error", "param": "response_id", "code": 400}});
    assert_eq!(cancel(&sim, id).await, (400, refused.clone()));
    // A finished (synchronous) response cannot be cancelled either.
    let v = create_json(&sim, json!({"input": "x", "max_output_tokens": 1})).await;
    let done = v["id"].as_str().unwrap();
    assert_eq!(cancel(&sim, done).await, (400, refused));
    assert_eq!(sim.stats().finished, 1);
}

#[tokio::test]
async fn background_stream_survives_its_client_and_resumes_after_n() {
    let sim = start(stored(SimConfig {
        time_scale: 5.0,
        ..SimConfig::default()
    }))
    .await;
    let n = 300u64;
    let r = create(
        &sim,
        json!({"input": "go", "max_output_tokens": n, "background": true, "stream": true}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let (first, s) = first_frames(r, 6).await;
    let id = first[0].1["response"]["id"].as_str().unwrap().to_string();
    assert_eq!(first[0].1["response"]["status"], "in_progress");
    assert_eq!(first[0].1["response"]["background"], true);
    // The client goes away; the generation goes on.
    drop(s);
    let (status, queued) = retrieve(&sim, &format!("/{id}")).await;
    assert_eq!((status, queued["status"].clone()), (200, json!("queued")));
    // Resume after event 5: 6 .. the last, live until response.completed.
    let r = get_response(&url(&sim, &format!("/{id}?stream=true&starting_after=5"))).await;
    assert_eq!(r.status(), 200);
    let rest = frames(&r.text().await.unwrap());
    let last = n + 7; // 4 opening events, n deltas, 3 closing ones, then completed
    assert_eq!(seqs(&rest), (6..=last).collect::<Vec<u64>>());
    assert_eq!(rest.last().unwrap().0, "response.completed");
    let done = rest.last().unwrap().1["response"].clone();
    assert_eq!(done["usage"]["output_tokens"], n);
    let s = sim.stats();
    assert_eq!((s.aborted, s.finished), (0, 1), "not aborted: {s:?}");
    // The final object is stored, and the buffer is kept for a full replay.
    assert_eq!(retrieve(&sim, &format!("/{id}")).await, (200, done));
    let r = get_response(&url(&sim, &format!("/{id}?stream=true"))).await;
    let all = frames(&r.text().await.unwrap());
    assert_eq!(seqs(&all), (0..=last).collect::<Vec<u64>>());
    assert_eq!(all[6..], rest[..]);
}

#[tokio::test]
async fn stream_query_without_an_event_buffer_breaks_after_the_headers() {
    let sim = start(stored(fast())).await;
    let v = create_json(&sim, json!({"input": "x", "max_output_tokens": 2})).await;
    let id = v["id"].as_str().unwrap();
    let r = get_response(&url(&sim, &format!("/{id}?stream=true"))).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
    let mut s = r.bytes_stream();
    let mut body = Vec::new();
    let mut broke = false;
    while let Some(chunk) = s.next().await {
        match chunk {
            Ok(b) => body.extend_from_slice(&b),
            Err(_) => broke = true,
        }
    }
    assert!(
        broke && body.is_empty(),
        "empty body, then a dropped connection"
    );
    // An unknown id is still the 404 before any stream.
    let r = get_response(&url(&sim, "/resp_nope?stream=true")).await;
    assert_eq!(r.status(), 404);
}

#[tokio::test]
async fn streamed_response_is_stored_only_if_it_ran_to_its_end() {
    let sim = start(stored(real_time())).await;
    let r = create(
        &sim,
        json!({"input": "x", "max_output_tokens": 3000, "stream": true}),
    )
    .await;
    let (first, s) = first_frames(r, 5).await;
    let id = first[0].1["response"]["id"].as_str().unwrap().to_string();
    drop(s);
    let (st, ok) = sim.wait_for_stats(WAIT, |s| s.aborted == 1).await;
    assert!(ok, "a foreground stream is aborted with its client: {st:?}");
    assert_eq!(
        retrieve(&sim, &format!("/{id}")).await,
        (404, not_found(&id))
    );
    assert_eq!(sim.stats().responses_stored, 0);
}

#[tokio::test]
async fn without_the_store_nothing_is_kept_and_background_is_refused() {
    let sim = start(fast()).await;
    // `store` (default true) is silently dropped.
    let v = create_json(
        &sim,
        json!({"input": "x", "max_output_tokens": 1, "store": true}),
    )
    .await;
    let id = v["id"].as_str().unwrap();
    assert_eq!(
        retrieve(&sim, &format!("/{id}")).await,
        (404, not_found(id))
    );
    assert_eq!(cancel(&sim, id).await, (404, not_found(id)));
    let r = create(&sim, json!({"input": "y", "previous_response_id": id})).await;
    assert_eq!(r.status(), 404);
    assert_eq!(sim.stats().responses_stored, 0);
    for body in [
        json!({"input": "x", "background": true}),
        json!({"input": "x", "background": true, "store": true}),
    ] {
        let r = create(&sim, body).await;
        assert_eq!(r.status(), 400);
        assert_eq!(
            r.json::<Value>().await.unwrap(),
            json!({"error": {"message": "This vLLM engine does not support `store=True` and \
                therefore does not support the background mode. To enable these features, set \
                the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the \
                vLLM server.", "type": "invalid_request_error", "param": "background",
                "code": 400}})
        );
    }
    // background without store is refused by the body's own validation, store or not.
    for sim in [&sim, &start(stored(fast())).await] {
        let r = create(
            sim,
            json!({"input": "x", "background": true, "store": false}),
        )
        .await;
        assert_eq!(r.status(), 400);
        assert_eq!(
            r.json::<Value>().await.unwrap(),
            json!({"error": {"message":
                "background can only be used when `store` is true (parameter=background)",
                "type": "BadRequestError", "param": "background", "code": 400}})
        );
        let r = create(
            sim,
            json!({"input": "x", "previous_response_id": "resp_a",
                   "previous_input_messages": [{"role": "user", "content": "h"}]}),
        )
        .await;
        assert_eq!(r.status(), 400);
        assert_eq!(
            r.json::<Value>().await.unwrap(),
            json!({"error": {"message":
                "Only one of `previous_input_messages` and `previous_response_id` can be set.",
                "type": "invalid_request_error", "param": "previous_response_id", "code": 400}})
        );
    }
    // With the store on, `store: false` keeps nothing either.
    let on = start(stored(fast())).await;
    let v = create_json(
        &on,
        json!({"input": "x", "max_output_tokens": 1, "store": false}),
    )
    .await;
    let id = v["id"].as_str().unwrap();
    assert_eq!(retrieve(&on, &format!("/{id}")).await.0, 404);
}

#[tokio::test]
async fn client_chosen_request_id_names_the_response() {
    let sim = start(stored(fast())).await;
    let v = create_json(
        &sim,
        json!({"input": "x", "max_output_tokens": 2, "request_id": "resp_custom1"}),
    )
    .await;
    assert_eq!(v["id"], "resp_custom1");
    assert_eq!(retrieve(&sim, "/resp_custom1").await, (200, v));
    let r = create(
        &sim,
        json!({"input": "x", "max_output_tokens": 2, "request_id": "backend-a:1", "stream": true}),
    )
    .await;
    let f = frames(&r.text().await.unwrap());
    assert_eq!(f[0].1["response"]["id"], "backend-a:1");
    assert_eq!(retrieve(&sim, "/backend-a:1").await.1["id"], "backend-a:1");
    let q = create_json(
        &sim,
        json!({"input": "x", "max_output_tokens": 2, "request_id": "mine", "background": true}),
    )
    .await;
    assert_eq!(q["id"], "mine");
}

#[tokio::test]
async fn the_store_drops_its_oldest_response_beyond_its_limit() {
    let sim = start(SimConfig {
        responses_store_limit: 2,
        ..stored(fast())
    })
    .await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        let v = create_json(&sim, json!({"input": "x", "max_output_tokens": 1})).await;
        ids.push(v["id"].as_str().unwrap().to_string());
    }
    assert_eq!(retrieve(&sim, &format!("/{}", ids[0])).await.0, 404);
    assert_eq!(retrieve(&sim, &format!("/{}", ids[1])).await.0, 200);
    assert_eq!(retrieve(&sim, &format!("/{}", ids[2])).await.0, 200);
    assert_eq!(sim.stats().responses_stored, 2);
    let page: Value = common::get_json(&format!("{}/sim/stats", sim.url())).await;
    assert_eq!(page["responses_stored"], 2);
}

#[tokio::test]
async fn responses_count_in_vllms_metrics_like_chat() {
    let sim = start(fast()).await;
    create_json(
        &sim,
        json!({"input": "hello there", "max_output_tokens": 6}),
    )
    .await;
    // The same conversation as a chat request hits every full block of it.
    let chat = post_json(
        &format!("{}/v1/chat/completions", sim.url()),
        &json!({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1}),
    )
    .await;
    let p = chat["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(p, tokens_of(&[msg("user", "hello there")]));
    assert_eq!(
        sim.metric(
            "vllm:request_success_total",
            &[("finished_reason", "length")]
        ),
        Some(2.0)
    );
    assert_eq!(sim.metric("vllm:generation_tokens_total", &[]), Some(7.0));
    assert_eq!(sim.stats().prefix_hits, (p - 1) / 16 * 16);
}
