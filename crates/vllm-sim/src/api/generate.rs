//! Generation endpoints: `/v1/completions` and `/v1/chat/completions`, whole or streamed (SSE).
//!
//! A request is validated ([`super::openai`]), submitted to the engine, and answered from the
//! engine's per-request token channel. Output text is the tokenizer's filler, one piece per
//! token, so `completion_tokens == max_tokens` and every content chunk carries one token.
//!
//! Bodies and chunks carry the same fields as vLLM 0.32's, nulls included (checked against a
//! real server, see FIDELITY.md). Streams: `data: {json}\n\n` chunks; chat opens with a chunk
//! whose delta is `{"role":"assistant","content":""}` (sent with the first token, as vLLM does);
//! the last content chunk carries `finish_reason` (and `stop_reason: null`); with
//! `stream_options.include_usage` a chunk with `"choices":[]` and `usage` follows; the last
//! chunk carries `system_fingerprint`; then `data: [DONE]\n\n`.
//!
//! P/D legs (`kv_transfer_params`, see [`super::pd`]): a decode leg pulls and waits its
//! transfer before it is submitted; a prefill leg's whole answer carries the params a decode
//! leg needs (`null` in every other whole answer; stream chunks never have the field).
//!
//! The [`RequestGuard`] lives in the handler future (whole responses) or in the body stream
//! (SSE): when the client disconnects hyper drops it, and the engine aborts the request.

use std::io;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::error::{parse_json, ApiError};
use super::openai::{self, Prepared};
use super::{pd, AppState};
use crate::config::KvLoadFailurePolicy;
use crate::engine::{Hold, RequestGuard, Submission};
use crate::faults::{Admission, PrefillFail};
use crate::kv_cache::BlockId;
use crate::metrics::FINISHED_ERROR;
use crate::scheduler::TokenEvent;
use crate::tokenizer::{filler_piece, filler_text};

/// What vLLM puts in `system_fingerprint` (its version and a build hash).
const FINGERPRINT: &str = "vllm-0.32.0-sim";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// Where the engine announces a prefill leg's held blocks and the tokens they hold.
type HeldReply = oneshot::Receiver<(Vec<BlockId>, usize)>;

/// Everything needed to write one response.
struct Ctx {
    kind: Kind,
    id: String,
    created: u64,
    /// JSON-encoded model name (with quotes), written as-is into chunks.
    model_json: String,
    model: String,
    prompt_tokens: u32,
    details: bool,
    include_usage: bool,
    stall: Duration,
    cut: Option<u64>,
    /// A prefill leg: its key and where the engine announces the held blocks.
    prefill: Option<(String, HeldReply)>,
}

pub async fn completions(State(st): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    admit(&st)?;
    let req = parse_json(&body)?;
    let p = openai::prepare_completion(&st, req, &body)?;
    run(&st, p, Kind::Completion).await
}

pub async fn chat(State(st): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    admit(&st)?;
    let req = parse_json(&body)?;
    let p = openai::prepare_chat(&st, req, &body)?;
    run(&st, p, Kind::Chat).await
}

fn admit(st: &AppState) -> Result<(), ApiError> {
    match st.faults.admit_request() {
        Admission::Serve => Ok(()),
        Admission::Refuse => Err(ApiError::Unavailable(
            "server is refusing connections".into(),
        )),
    }
}

async fn run(st: &AppState, p: Prepared, kind: Kind) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let intent = pd::intent(st, p.kv_transfer_params.as_ref())?;
    if st.faults.should_fail() {
        return Err(ApiError::Internal(
            "Simulated internal error (fail_rate fault).".into(),
        ));
    }
    let prefix = match kind {
        Kind::Completion => "cmpl",
        Kind::Chat => "chatcmpl",
    };
    let mut ctx = Ctx {
        kind,
        id: format!("{prefix}-{:016x}", fastrand::u64(..)),
        created: crate::metrics::unix_now() as u64,
        model_json: serde_json::Value::from(p.model.name.as_str()).to_string(),
        model: p.model.name.clone(),
        prompt_tokens: p.tokens.len() as u32,
        details: st.config.enable_prompt_tokens_details,
        include_usage: p.include_usage,
        stall: st.faults.first_token_stall(),
        cut: st.faults.cut_stream_after(),
        prefill: None,
    };
    let mut external = 0;
    if let Some(remote) = intent.pull {
        match pd::pull(st, remote).await {
            Ok(tokens) => {
                let wait = st.config.kv_transfer_time(tokens);
                if !wait.is_zero() {
                    tokio::time::sleep(wait).await;
                }
                external = tokens;
            }
            Err(e) => match st.config.kv_load_failure_policy {
                KvLoadFailurePolicy::Fail => {
                    tracing::warn!(error = %e, "KV load failed: the request fails");
                    st.engine.shared.metrics().finished[FINISHED_ERROR] += 1;
                    let message = format!("KV transfer failed: {e}");
                    if p.stream {
                        return Ok(sse_error(&message));
                    }
                    return Err(ApiError::Internal(message));
                }
                KvLoadFailurePolicy::Recompute => {
                    tracing::warn!(error = %e, "KV load failed: the prompt is computed locally");
                }
            },
        }
    }
    let hold = intent.hold.then(|| {
        let key = format!("{}-{:08x}", ctx.id, fastrand::u32(..));
        let (reply, rx) = oneshot::channel();
        ctx.prefill = Some((key.clone(), rx));
        Hold { key, reply }
    });
    let hash_seed = openai::hash_seed(&p.model, p.cache_salt.as_deref());
    let sub = Submission {
        tokens: p.tokens,
        max_tokens: p.max_tokens,
        hash_seed,
        lora: p.model.lora,
        cache_salt: p.cache_salt,
        arrival: Some(arrival),
        external,
        hold,
    };
    let (guard, rx) = st.engine.submit(sub);
    if p.stream {
        Ok(sse(ctx, guard, rx))
    } else {
        whole(st, ctx, guard, rx).await
    }
}

/// A stream whose KV load failed (policy `fail`): one error event, then `[DONE]`, as vLLM's
/// streaming generators end on an error.
fn sse_error(message: &str) -> Response {
    let event = json!({"error": {
        "message": message, "type": "InternalServerError", "param": null, "code": 500,
    }});
    let body = format!("data: {event}\n\ndata: [DONE]\n\n");
    let mut resp = Response::new(Body::from(body));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    resp
}

/// The prefill leg's `kv_transfer_params`, once its blocks are held (null if they are not),
/// or the `kv_prefill_fail` fault's failure.
async fn prefill_answer(st: &AppState, ctx: &mut Ctx) -> Result<Value, Response> {
    let Some((key, rx)) = ctx.prefill.take() else {
        return Ok(Value::Null);
    };
    let held = rx.await.ok();
    match st.faults.kv_prefill_fail() {
        PrefillFail::None => Ok(held.map_or(Value::Null, |(blocks, tokens)| {
            pd::prefill_params(st, &key, &blocks, tokens)
        })),
        PrefillFail::Error => {
            st.engine.drop_held(key);
            Err(
                ApiError::Internal("Simulated prefill failure (kv_prefill_fail fault).".into())
                    .into_response(),
            )
        }
        PrefillFail::Drop => {
            st.engine.drop_held(key);
            let parts: Vec<Result<Bytes, io::Error>> = vec![Err(io::Error::other(
                "kv_prefill_fail fault: connection dropped",
            ))];
            Err(Response::new(Body::from_stream(stream::iter(parts))))
        }
    }
}

/// `usage`; whole bodies also carry the (null unless enabled) details fields.
fn usage_json(ctx: &Ctx, completion: u32, cached: u32, whole: bool) -> serde_json::Value {
    let mut u = json!({
        "prompt_tokens": ctx.prompt_tokens,
        "total_tokens": ctx.prompt_tokens + completion,
        "completion_tokens": completion,
    });
    if ctx.details {
        u["prompt_tokens_details"] = json!({ "cached_tokens": cached });
    } else if whole {
        u["prompt_tokens_details"] = serde_json::Value::Null;
    }
    if whole {
        u["completion_tokens_details"] = serde_json::Value::Null;
    }
    u
}

/// A non-streaming answer, once the last token is out.
async fn whole(
    st: &AppState,
    mut ctx: Ctx,
    mut guard: RequestGuard,
    mut rx: mpsc::UnboundedReceiver<TokenEvent>,
) -> Result<Response, ApiError> {
    let mut n = 0u32;
    let (finish, cached) = loop {
        let Some(ev) = rx.recv().await else {
            return Err(ApiError::Internal("engine stopped".into()));
        };
        if n == 0 && !ctx.stall.is_zero() {
            tokio::time::sleep(ctx.stall).await;
        }
        n += 1;
        if ctx.cut.is_some_and(|c| u64::from(n) >= c) {
            // Guard drops here: the engine aborts the request.
            return Ok(truncated_body());
        }
        if let Some(f) = ev.finish {
            break (f, ev.cached_tokens);
        }
    };
    guard.finished();
    let kv_params = match prefill_answer(st, &mut ctx).await {
        Ok(v) => v,
        Err(resp) => return Ok(resp),
    };
    let text = filler_text(n);
    let usage = usage_json(&ctx, n, cached, true);
    let body = match ctx.kind {
        Kind::Completion => json!({
            "id": ctx.id, "object": "text_completion", "created": ctx.created, "model": ctx.model,
            "choices": [{
                "index": 0, "text": text, "logprobs": null, "finish_reason": finish.as_str(),
                "stop_reason": null, "token_ids": null, "prompt_logprobs": null,
                "prompt_token_ids": null, "routed_experts": null,
            }],
            "service_tier": null, "system_fingerprint": FINGERPRINT,
            "usage": usage,
            "kv_transfer_params": kv_params, "ec_transfer_params": null, "metrics": null,
        }),
        Kind::Chat => json!({
            "id": ctx.id, "object": "chat.completion", "created": ctx.created, "model": ctx.model,
            "choices": [{
                "index": 0,
                "message": {
                    "role": "assistant", "content": text, "refusal": null, "annotations": null,
                    "audio": null, "function_call": null, "reasoning": null,
                },
                "logprobs": null, "finish_reason": finish.as_str(), "stop_reason": null,
                "token_ids": null, "routed_experts": null,
            }],
            "service_tier": null, "system_fingerprint": FINGERPRINT,
            "usage": usage,
            "prompt_logprobs": null, "prompt_token_ids": null, "prompt_text": null,
            "kv_transfer_params": kv_params, "ec_transfer_params": null, "metrics": null,
        }),
    };
    Ok(axum::Json(body).into_response())
}

/// Half a JSON body, then a broken connection (the `cut_stream_after` fault).
fn truncated_body() -> Response {
    let parts: Vec<Result<Bytes, io::Error>> = vec![
        Ok(Bytes::from_static(
            b"{\"id\":\"cmpl-cut\",\"object\":\"text_comp",
        )),
        Err(io::Error::other("cut_stream_after fault")),
    ];
    let mut resp = Response::new(Body::from_stream(stream::iter(parts)));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    resp
}

enum Phase {
    Tokens,
    Cut,
    End,
}

struct SseState {
    ctx: Ctx,
    guard: RequestGuard,
    rx: mpsc::UnboundedReceiver<TokenEvent>,
    sent: u64,
    phase: Phase,
    /// `data: {...,"choices":[{"index":0,` — the shared head of every chunk.
    head: String,
}

fn sse(ctx: Ctx, guard: RequestGuard, rx: mpsc::UnboundedReceiver<TokenEvent>) -> Response {
    let object = match ctx.kind {
        Kind::Completion => "text_completion",
        Kind::Chat => "chat.completion.chunk",
    };
    let head = format!(
        "data: {{\"id\":\"{}\",\"object\":\"{object}\",\"created\":{},\"model\":{},\"choices\":[",
        ctx.id, ctx.created, ctx.model_json
    );
    let state = SseState {
        ctx,
        guard,
        rx,
        sent: 0,
        phase: Phase::Tokens,
        head,
    };
    let body = stream::unfold(state, |mut st| async move {
        match st.phase {
            Phase::End => None,
            Phase::Cut => {
                st.phase = Phase::End;
                Some((Err(io::Error::other("cut_stream_after fault")), st))
            }
            Phase::Tokens => {
                let Some(first) = st.rx.recv().await else {
                    // Engine gone: end the body abruptly rather than pretend it finished.
                    st.phase = Phase::End;
                    return Some((Err(io::Error::other("engine stopped")), st));
                };
                if st.sent == 0 && !st.ctx.stall.is_zero() {
                    tokio::time::sleep(st.ctx.stall).await;
                }
                let mut out = String::with_capacity(256);
                let mut ev = Some(first);
                // Write every token already available in one body frame (cheap for slow readers).
                while let Some(e) = ev {
                    if st.ctx.cut.is_some_and(|c| st.sent >= c) {
                        st.phase = Phase::Cut;
                        break;
                    }
                    write_token(&mut st, &mut out, e);
                    if e.finish.is_some() {
                        st.guard.finished();
                        st.phase = Phase::End;
                        break;
                    }
                    ev = st.rx.try_recv().ok();
                }
                if out.is_empty() {
                    // Cut before anything was written in this frame.
                    st.phase = Phase::End;
                    return Some((Err(io::Error::other("cut_stream_after fault")), st));
                }
                Some((Ok(Bytes::from(out)), st))
            }
        }
    });
    let mut resp = Response::new(Body::from_stream(body));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    resp
}

fn write_token(st: &mut SseState, out: &mut String, ev: TokenEvent) {
    let kind = st.ctx.kind;
    if kind == Kind::Chat && st.sent == 0 {
        out.push_str(&st.head);
        out.push_str(
            "{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\
             \"finish_reason\":null}],\"prompt_token_ids\":null,\"prompt_text\":null}\n\n",
        );
    }
    let text = filler_piece(ev.index);
    let finish = match ev.finish {
        Some(f) => format!("\"{}\",\"stop_reason\":null", f.as_str()),
        None => "null".into(),
    };
    out.push_str(&st.head);
    match kind {
        Kind::Completion => {
            out.push_str("{\"index\":0,\"text\":\"");
            out.push_str(text);
            out.push_str("\",\"logprobs\":null,\"finish_reason\":");
            out.push_str(&finish);
            if ev.finish.is_none() {
                out.push_str(",\"stop_reason\":null");
            }
            out.push_str(",\"prompt_token_ids\":null,\"token_ids\":null}]");
        }
        Kind::Chat => {
            out.push_str("{\"index\":0,\"delta\":{\"content\":\"");
            out.push_str(text);
            out.push_str("\"},\"logprobs\":null,\"finish_reason\":");
            out.push_str(&finish);
            out.push_str(",\"token_ids\":null}]");
        }
    }
    st.sent += 1;
    let last = ev.finish.is_some();
    // The last chunk before [DONE] carries the fingerprint.
    if last && !st.ctx.include_usage {
        out.push_str(",\"system_fingerprint\":\"");
        out.push_str(FINGERPRINT);
        out.push('"');
    }
    out.push_str("}\n\n");
    if last {
        if st.ctx.include_usage {
            let usage = usage_json(&st.ctx, st.sent as u32, ev.cached_tokens, false);
            out.push_str(&st.head);
            out.push_str("],\"usage\":");
            out.push_str(&usage.to_string());
            out.push_str(",\"system_fingerprint\":\"");
            out.push_str(FINGERPRINT);
            out.push_str("\"}\n\n");
        }
        out.push_str("data: [DONE]\n\n");
    }
}
