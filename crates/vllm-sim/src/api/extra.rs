//! Everything but generation: models, health, metrics, tokenizer endpoints, the probes other
//! routers send to their workers, and the `/sim/*` admin endpoints.
//!
//! * vLLM: `/v1/models`, `/health`, `/ping`, `/version`, `/metrics`, `/tokenize`,
//!   `/detokenize`, `/v1/chat/completions/render`, `/v1/completions/render`,
//!   `/kv_event_sources`, `POST /reset_prefix_cache` (a dev-mode route in vLLM; always on here).
//! * SGLang (what `sglang-router` probes): `/get_model_info`, `/model_info`,
//!   `/get_server_info`, `/server_info`, `/get_load`.
//! * Simulator: `GET|POST /sim/faults` (see `faults.rs`), `GET /sim/stats`.

use axum::body::{Body, Bytes};
use axum::extract::{RawQuery, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::{parse_json, ApiError};
use super::openai::{self, Message, PromptInput};
use super::AppState;
use crate::faults::FaultPatch;
use crate::metrics;
use crate::tokenizer;

/// What `/version` reports.
pub const VERSION: &str = "0.32.0-sim";

fn permission(created: u64) -> Value {
    json!([{
        "id": format!("modelperm-{:032x}", fastrand::u128(..)),
        "object": "model_permission", "created": created, "allow_create_engine": false,
        "allow_sampling": true, "allow_logprobs": true, "allow_search_indices": false,
        "allow_view": true, "allow_fine_tuning": false, "organization": "*", "group": null,
        "is_blocking": false,
    }])
}

pub async fn models(State(st): State<AppState>) -> Json<Value> {
    let created = metrics::unix_now() as u64;
    let mut data: Vec<Value> = st
        .names
        .iter()
        .map(|n| {
            json!({
                "id": n, "object": "model", "created": created, "owned_by": "vllm",
                "root": st.config.model, "parent": null,
                "max_model_len": st.config.max_model_len, "permission": permission(created),
            })
        })
        .collect();
    for l in &st.config.lora_modules {
        let parent = l
            .base_model_name
            .clone()
            .unwrap_or_else(|| st.names[0].clone());
        data.push(json!({
            "id": l.name, "object": "model", "created": created, "owned_by": "vllm",
            "root": l.path, "parent": parent, "max_model_len": null,
            "permission": permission(created),
        }));
    }
    Json(json!({ "object": "list", "data": data }))
}

pub async fn empty_ok() -> StatusCode {
    StatusCode::OK
}

pub async fn version() -> Json<Value> {
    Json(json!({ "version": VERSION }))
}

/// `GET /metrics`: the whole page, as vLLM's own route serves it (it ignores `?name[]=`).
pub async fn metrics_page(State(st): State<AppState>) -> Response {
    metrics_response(st, None).await
}

/// `GET /metrics/`: vLLM mounts `prometheus_client`'s exposition app there, which honours
/// `?name[]=series` by sending only those series.
pub async fn metrics_page_filtered(
    State(st): State<AppState>,
    RawQuery(query): RawQuery,
) -> Response {
    let names = query
        .as_deref()
        .map(metrics::query_names)
        .unwrap_or_default();
    metrics_response(st, (!names.is_empty()).then_some(names)).await
}

async fn metrics_response(st: AppState, names: Option<Vec<String>>) -> Response {
    if st.faults.metrics_hang() {
        // The fault: never answer (the client's timeout is what is being tested).
        std::future::pending::<()>().await;
    }
    let delay = st.faults.metrics_delay();
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let text = if st.faults.metrics_garbage() {
        "<html>\u{0}garbage{{{ not prometheus\nvllm:num_requests_running{engine=\"0\" NaN?!\n"
            .to_string()
    } else {
        let page = {
            let m = st.engine.shared.metrics();
            metrics::render(&m, &st.page_info)
        };
        match names {
            Some(names) => metrics::restrict(&page, &names),
            None => page,
        }
    };
    let mut resp = Response::new(Body::from(text));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    resp
}

#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<PromptInput>,
    #[serde(default)]
    messages: Option<Vec<Message>>,
    #[serde(default)]
    add_special_tokens: Option<bool>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
}

/// Tokens (and the text they came from) of a `prompt` or `messages` body.
fn tokens_of(st: &AppState, req: TokenizeRequest) -> Result<(Option<String>, Vec<u32>), ApiError> {
    openai::resolve_model(st, req.model.as_deref())?;
    match (req.prompt, req.messages) {
        (_, Some(messages)) => {
            let text =
                openai::render_messages(messages, req.add_generation_prompt.unwrap_or(true))?;
            let tokens = tokenizer::tokenize(&text);
            Ok((Some(text), tokens))
        }
        (Some(PromptInput::Text(text)), None) => {
            let tokens = if req.add_special_tokens.unwrap_or(true) {
                tokenizer::tokenize_prompt(&text)
            } else {
                tokenizer::tokenize(&text)
            };
            Ok((Some(text), tokens))
        }
        (Some(p), None) => Ok((None, openai::prompt_tokens(p)?)),
        (None, None) => Err(ApiError::bad("either prompt or messages is required")),
    }
}

pub async fn tokenize(State(st): State<AppState>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let req: TokenizeRequest = parse_json(&body)?;
    let tokens = match (&st.hf, &req.messages, &req.prompt) {
        (Some(hf), Some(_), _) => hf
            .chat_ids(&body)
            .map_err(|e| ApiError::bad(e.to_string()))?,
        (Some(hf), None, Some(PromptInput::Text(_))) => hf
            .completion_ids(&body)
            .map_err(|e| ApiError::bad(e.to_string()))?,
        _ => tokens_of(&st, req)?.1,
    };
    Ok(Json(json!({
        "count": tokens.len(), "max_model_len": st.config.max_model_len,
        "tokens": tokens, "token_strs": null,
    })))
}

#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    tokens: Vec<u32>,
}

pub async fn detokenize(body: Bytes) -> Result<Json<Value>, ApiError> {
    let req: DetokenizeRequest = parse_json(&body)?;
    Ok(Json(
        json!({ "prompt": tokenizer::detokenize(&req.tokens) }),
    ))
}

/// `/v1/{chat/}completions/render`: the prompt as the engine would see it, not generated.
pub async fn render(State(st): State<AppState>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let raw: Value = parse_json(&body)?;
    let max_tokens = raw.get("max_tokens").cloned().unwrap_or(Value::Null);
    let model = raw.get("model").and_then(Value::as_str).map(str::to_string);
    let req: TokenizeRequest = serde_json::from_value(raw)
        .map_err(|e| ApiError::Validation(format!("1 validation error: {e}")))?;
    let choice = openai::resolve_model(&st, model.as_deref())?;
    let (text, tokens) = tokens_of(&st, req)?;
    Ok(Json(json!({
        "request_id": format!("render-{:032x}", fastrand::u128(..)),
        "model": choice.name,
        "prompt": text,
        "token_ids": tokens,
        "prompt_token_ids": tokens,
        "sampling_params": { "max_tokens": max_tokens },
        "stream": false,
    })))
}

pub async fn model_info(State(st): State<AppState>) -> Json<Value> {
    Json(json!({
        "model_path": st.names[0], "tokenizer_path": st.names[0], "is_generation": true,
        "preferred_sampling_params": null, "weight_version": "default",
        "has_image_understanding": false, "has_audio_understanding": false,
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
    }))
}

pub async fn server_info(State(st): State<AppState>) -> Json<Value> {
    let c = &st.config;
    let s = st.engine.shared.stats();
    Json(json!({
        "model_path": st.names[0], "tokenizer_path": st.names[0],
        "served_model_name": st.names[0], "host": st.addr.ip().to_string(),
        "port": st.addr.port(), "context_length": c.max_model_len,
        "max_total_num_tokens": c.num_gpu_blocks * c.block_size,
        "max_running_requests": c.max_num_seqs, "chunked_prefill_size": c.max_num_batched_tokens,
        "page_size": c.block_size, "tp_size": 1, "dp_size": 1, "disaggregation_mode": "null",
        "version": VERSION,
        "internal_states": [{ "num_running_reqs": s.running, "num_waiting_reqs": s.waiting }],
    }))
}

pub async fn get_load(State(st): State<AppState>) -> Json<Value> {
    let s = st.engine.shared.stats();
    Json(json!({
        "load": s.running + s.waiting, "num_reqs": s.running + s.waiting,
        "num_running_reqs": s.running, "num_waiting_reqs": s.waiting,
        "num_tokens": s.used_blocks * st.config.block_size, "dp_rank": 0,
    }))
}

/// `GET /kv_event_sources`: the publisher config per data-parallel rank (`{}` without one).
pub async fn kv_event_sources(State(st): State<AppState>) -> Json<Value> {
    Json(match &st.kv {
        Some(kv) => crate::kv_events::sources_json(&kv.resolved),
        None => json!({}),
    })
}

/// `POST /reset_prefix_cache[?reset_running_requests=true]`: `{"success": bool}`; fails while
/// requests hold blocks unless they are preempted first. Publishes `AllBlocksCleared`.
/// (`reset_external`, vLLM's connector cache, is accepted and has nothing to act on.)
pub async fn reset_prefix_cache(
    State(st): State<AppState>,
    RawQuery(query): RawQuery,
) -> Result<Json<Value>, ApiError> {
    let reset_running = query_bool(query.as_deref().unwrap_or(""), "reset_running_requests")?;
    let ok = st.engine.reset_prefix_cache(reset_running).await;
    Ok(Json(json!({ "success": ok })))
}

/// A boolean query parameter as FastAPI reads it (true/false/1/0/yes/no/on/off); absent is
/// false; other parameters are ignored.
fn query_bool(query: &str, name: &'static str) -> Result<bool, ApiError> {
    let Some(v) = query
        .split('&')
        .filter_map(|p| p.split_once('=').or(Some((p, ""))))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
    else {
        return Ok(false);
    };
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(ApiError::bad_param(
            format!("{name}: {v:?} is not a valid boolean"),
            name,
        )),
    }
}

pub async fn get_faults(State(st): State<AppState>) -> Json<Value> {
    Json(json!(st.faults.snapshot()))
}

pub async fn post_faults(State(st): State<AppState>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let patch: FaultPatch = parse_json(&body)?;
    if patch.fail_rate.is_some_and(|r| !(0.0..=1.0).contains(&r)) {
        return Err(ApiError::bad_param(
            "fail_rate must be within 0..=1",
            "fail_rate",
        ));
    }
    if patch
        .kv_events_drop_rate
        .is_some_and(|r| !(0.0..=1.0).contains(&r))
    {
        return Err(ApiError::bad_param(
            "kv_events_drop_rate must be within 0..=1",
            "kv_events_drop_rate",
        ));
    }
    st.faults.apply(&patch);
    if patch.kv_events_restart {
        st.engine.restart();
    }
    Ok(Json(json!(st.faults.snapshot())))
}

pub async fn stats(State(st): State<AppState>) -> impl IntoResponse {
    Json(json!(st.engine.shared.stats()))
}
