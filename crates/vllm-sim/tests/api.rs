//! OpenAI API shapes and errors, end to end over HTTP: bodies, SSE chunks, models, tokenizer
//! endpoints, other routers' probes, and vLLM-style 400/404 errors.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{
    completion, fast, fast_with_len, get_json, get_response, post, post_json, sse_events, start,
    start_with_client,
};
use serde_json::{json, Value};
use vllm_sim::{LoraModule, SimConfig};

#[tokio::test]
async fn completion_body_has_vllm_shape_and_exact_usage() {
    let sim = start(fast()).await;
    let r = completion(
        &sim,
        &json!({"prompt": "Hello there, simulator", "max_tokens": 7}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["object"], "text_completion");
    assert!(v["created"].as_u64().unwrap() > 1_700_000_000);
    assert_eq!(v["model"], vllm_sim::config::DEFAULT_MODEL);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert_eq!(
        vllm_sim::tokenizer::tokenize(text).len(),
        7,
        "text is exactly 7 tokens"
    );
    // BOS + "Hell","o"," the","re,"," sim","ulat","or" = 8 tokens.
    assert_eq!(v["usage"]["prompt_tokens"], 8);
    assert_eq!(v["usage"]["completion_tokens"], 7);
    assert_eq!(v["usage"]["total_tokens"], 15);
    // The default output length of completions is 16.
    let v: Value = post_json(
        &format!("{}/v1/completions", sim.url()),
        &json!({"prompt": [5, 6, 7]}),
    )
    .await;
    assert_eq!(v["usage"]["completion_tokens"], 16);
    assert_eq!(v["usage"]["prompt_tokens"], 3);
}

#[tokio::test]
async fn chat_body_has_vllm_shape() {
    let sim = start(fast()).await;
    let body = json!({
        "model": vllm_sim::config::DEFAULT_MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}
            ]}
        ],
        "max_completion_tokens": 5,
        "ignore_eos": true
    });
    let r = post(&format!("{}/v1/chat/completions", sim.url()), &body).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert!(
        v["usage"]["prompt_tokens"].as_u64().unwrap() > 20,
        "image placeholder counted"
    );
    // Without max tokens, chat defaults to the rest of the context capped at 256.
    let v: Value = post_json(
        &format!("{}/v1/chat/completions", sim.url()),
        &json!({"messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(v["usage"]["completion_tokens"], 256);
}

#[tokio::test]
async fn chat_stream_has_role_content_finish_usage_done() {
    let sim = start(fast()).await;
    let r = post(
        &format!("{}/v1/chat/completions", sim.url()),
        &json!({
            "messages": [{"role": "user", "content": "Stream please"}],
            "max_tokens": 4, "stream": true, "stream_options": {"include_usage": true}
        }),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
    let events = sse_events(r).await;
    assert_eq!(
        events.len(),
        1 + 4 + 1 + 1,
        "role, 4 content chunks, usage, [DONE]: {events:?}"
    );
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..6]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let id = chunks[0]["id"].clone();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], id, "one id per stream");
    }
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    let mut text = String::new();
    for (i, c) in chunks[1..5].iter().enumerate() {
        let piece = c["choices"][0]["delta"]["content"].as_str().unwrap();
        assert_eq!(
            vllm_sim::tokenizer::tokenize(piece).len(),
            1,
            "one token per chunk"
        );
        text.push_str(piece);
        let finish = &c["choices"][0]["finish_reason"];
        if i == 3 {
            assert_eq!(finish, "length");
        } else {
            assert!(finish.is_null());
        }
    }
    assert_eq!(text, vllm_sim::tokenizer::filler_text(4));
    assert_eq!(chunks[5]["choices"], json!([]));
    assert_eq!(chunks[5]["usage"]["completion_tokens"], 4);
    assert_eq!(
        chunks[5]["usage"]["total_tokens"].as_u64().unwrap(),
        chunks[5]["usage"]["prompt_tokens"].as_u64().unwrap() + 4
    );
}

#[tokio::test]
async fn completion_stream_without_usage() {
    let sim = start(fast()).await;
    let r = completion(
        &sim,
        &json!({"prompt": "abc", "max_tokens": 3, "stream": true}),
    )
    .await;
    let events = sse_events(r).await;
    assert_eq!(events.len(), 4, "3 chunks then [DONE]: {events:?}");
    let last: Value = serde_json::from_str(&events[2]).unwrap();
    assert_eq!(last["object"], "text_completion");
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert!(last.get("usage").is_none());
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert!(first["choices"][0]["finish_reason"].is_null());
}

#[tokio::test]
async fn bad_requests_get_vllm_errors() {
    let (sim, c) = start_with_client(fast_with_len(100)).await;
    let url = format!("{}/v1/completions", sim.url());
    let chat = format!("{}/v1/chat/completions", sim.url());
    // (what, request, status, error type): schema failures are "Bad Request", vLLM's own
    // checks "BadRequestError", as a real vLLM 0.32 answers.
    let schema = "Bad Request";
    let check = "BadRequestError";
    let cases: Vec<(&str, reqwest::RequestBuilder, u16, &str)> = vec![
        ("bad json", c.post(&url).body("{not json"), 400, schema),
        (
            "wrong type",
            c.post(&url)
                .json(&json!({"prompt": "x", "max_tokens": "ten"})),
            400,
            schema,
        ),
        (
            "messages not a list",
            c.post(&chat).json(&json!({"messages": "hi"})),
            400,
            schema,
        ),
        (
            "missing prompt",
            c.post(&url).json(&json!({"max_tokens": 3})),
            400,
            check,
        ),
        (
            "n > 1",
            c.post(&url).json(&json!({"prompt": "x", "n": 2})),
            400,
            check,
        ),
        (
            "zero max_tokens",
            c.post(&url).json(&json!({"prompt": "x", "max_tokens": 0})),
            400,
            check,
        ),
        (
            "batch",
            c.post(&url).json(&json!({"prompt": ["a", "b"]})),
            400,
            check,
        ),
        (
            "empty ids",
            c.post(&url).json(&json!({"prompt": []})),
            400,
            check,
        ),
        (
            "too long",
            c.post(&url).json(&json!({"prompt": vec![3; 100]})),
            400,
            check,
        ),
        (
            "bad part",
            c.post(&chat)
                .json(&json!({"messages": [{"role": "user", "content": [{"type": "audio"}]}]})),
            400,
            check,
        ),
        (
            "unknown model",
            c.post(&url).json(&json!({"model": "nope", "prompt": "x"})),
            404,
            "NotFoundError",
        ),
    ];
    for (what, req, status, kind) in cases {
        let r = req
            .header("content-type", "application/json")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), status, "{what}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["type"], kind, "{what}: {v}");
        assert_eq!(v["error"]["code"], status, "{what}");
        assert!(
            !v["error"]["message"].as_str().unwrap().is_empty(),
            "{what}"
        );
    }
    let v: Value = post_json(&url, &json!({"model": "nope", "prompt": "x"})).await;
    assert_eq!(v["error"]["param"], "model");
    // Asking for more output than the context has left is lowered to fit, as vLLM 0.32 does.
    let v: Value = post_json(&url, &json!({"prompt": vec![3; 90], "max_tokens": 20})).await;
    assert_eq!(v["usage"]["completion_tokens"], 10);
    // The server is still fine.
    let r = post(&url, &json!({"prompt": "x", "max_tokens": 1})).await;
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn models_list_base_names_and_lora_adapters() {
    let cfg = SimConfig {
        served_model_name: vec!["base".into(), "alias".into()],
        lora_modules: vec![LoraModule {
            name: "sql".into(),
            path: "/loras/sql".into(),
            base_model_name: None,
        }],
        ..fast()
    };
    let sim = start(cfg).await;
    let v: Value = get_json(&format!("{}/v1/models", sim.url())).await;
    assert_eq!(v["object"], "list");
    let data = v["data"].as_array().unwrap();
    let ids: Vec<&str> = data.iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["base", "alias", "sql"]);
    assert!(data
        .iter()
        .all(|m| m["object"] == "model" && m["owned_by"] == "vllm"));
    assert_eq!(data[0]["max_model_len"], 32768);
    assert_eq!(data[2]["parent"], "base");
    assert_eq!(data[2]["root"], "/loras/sql");
    for model in ["alias", "sql"] {
        let v: Value = post_json(
            &format!("{}/v1/completions", sim.url()),
            &json!({"model": model, "prompt": "x", "max_tokens": 1}),
        )
        .await;
        assert_eq!(v["model"], model, "the requested name is echoed");
    }
}

#[tokio::test]
async fn tokenizer_render_and_probe_endpoints() {
    let sim = start(fast_with_len(4096)).await;
    let u = sim.url();
    let v: Value = post_json(&format!("{u}/tokenize"), &json!({"prompt": "hello world"})).await;
    assert_eq!(v["count"], 5, "BOS, hell, o, ' wor', ld: {v}");
    assert_eq!(v["max_model_len"], 4096);
    assert_eq!(v["tokens"].as_array().unwrap().len(), 5);
    let msgs = json!({"messages": [{"role": "user", "content": "hi"}]});
    let t: Value = post_json(&format!("{u}/tokenize"), &msgs).await;
    let r: Value = post_json(&format!("{u}/v1/chat/completions/render"), &msgs).await;
    assert_eq!(r["token_ids"], t["tokens"], "render and tokenize agree");
    assert_eq!(r["prompt"], "<|user|>\nhi\n<|assistant|>\n");
    let r: Value = post_json(
        &format!("{u}/v1/completions/render"),
        &json!({"prompt": "hi"}),
    )
    .await;
    assert_eq!(r["token_ids"].as_array().unwrap().len(), 2);
    let d: Value = post_json(
        &format!("{u}/detokenize"),
        &json!({"tokens": [vllm_sim::tokenizer::filler_id(0)]}),
    )
    .await;
    assert_eq!(d["prompt"], " the");
    for path in ["/get_model_info", "/model_info"] {
        let v: Value = get_json(&format!("{u}{path}")).await;
        assert_eq!(v["is_generation"], true);
        assert_eq!(v["model_path"], vllm_sim::config::DEFAULT_MODEL);
    }
    for path in ["/get_server_info", "/server_info"] {
        let v: Value = get_json(&format!("{u}{path}")).await;
        assert_eq!(v["max_total_num_tokens"], 2048 * 16);
        assert_eq!(v["port"], sim.addr().port());
    }
    let v: Value = get_json(&format!("{u}/get_load")).await;
    assert_eq!(v["load"], 0);
    let v: Value = get_json(&format!("{u}/version")).await;
    assert_eq!(v["version"], "0.32.0-sim");
    for path in ["/health", "/ping"] {
        let r = get_response(&format!("{u}{path}")).await;
        assert_eq!(r.status(), 200);
        assert!(r.bytes().await.unwrap().is_empty());
    }
}
