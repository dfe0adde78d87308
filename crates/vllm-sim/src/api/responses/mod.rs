//! OpenAI's Responses API as vLLM 0.32 serves it: `POST /v1/responses`,
//! `GET /v1/responses/{id}` (optionally replaying a background stream), and
//! `POST /v1/responses/{id}/cancel`.
//!
//! A request's messages ([`protocol::construct_input_messages`]) are rendered and tokenised
//! exactly as a chat request of those messages, so the engine, the prefix cache, KV events and
//! metrics see the same prompt. Output is the usual filler of `max_output_tokens` tokens
//! (default as chat's), so every response ends `incomplete` (`max_output_tokens`).
//!
//! Store (`--responses-store`, vLLM's `VLLM_ENABLE_RESPONSES_API_STORE=1`): off, `store` is
//! forced false and `background` is a 400. On, whole responses are stored when done, streamed
//! ones only if the stream ran to its end, and background ones at once as `queued` (their
//! task runs detached from the client, its stream into an [`store::EventLog`]). vLLM's
//! unhappy paths are kept: unknown ids are 404s in vLLM's shape, cancelling anything but a
//! queued or running background response is "Cannot cancel a synchronous response.", and
//! `GET ?stream=true` of a response without events is a 200 whose body breaks at once. Routes
//! vLLM lacks (`input_items`, `DELETE`, `compact`) get Starlette's 404 / 405 bodies.

pub mod protocol;
pub mod store;

use std::io;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use futures_util::stream;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc;

use super::error::{parse_json, ApiError};
use super::openai::{self, DEFAULT_CHAT_TOKENS_CAP};
use super::AppState;
use crate::engine::{RequestGuard, Submission};
use crate::scheduler::{FinishReason, TokenEvent};
use crate::tokenizer::{self, filler_piece, ChatMessage};
use protocol::{
    frame, random_id, DeltaEvent, ItemEvent, OutputMessage, OutputText, PartEvent, ResponseEvent,
    ResponseObject, ResponsesRequest, Status, TextDoneEvent, Usage,
};
use store::{Cancel, Entry, EventLog};

const NO_STORE_BACKGROUND: &str = "This vLLM engine does not support `store=True` and therefore \
    does not support the background mode. To enable these features, set the environment \
    variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.";

/// The Responses routes (merged into the main router).
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/responses", post(create).fallback(method_not_allowed))
        .route(
            "/v1/responses/{id}",
            get(retrieve).fallback(method_not_allowed),
        )
        .route(
            "/v1/responses/{id}/cancel",
            post(cancel).fallback(method_not_allowed),
        )
        .route("/v1/responses/{id}/input_items", any(not_found))
}

async fn method_not_allowed() -> ApiError {
    ApiError::NotServed(StatusCode::METHOD_NOT_ALLOWED)
}

async fn not_found() -> ApiError {
    ApiError::NotServed(StatusCode::NOT_FOUND)
}

/// `POST /v1/responses`. Checks in vLLM's order: the body (`background` needs `store`), the
/// model, background without a store, both histories, then the previous response.
pub async fn create(State(st): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let req: ResponsesRequest = parse_json(&body)?;
    let background = req.background.unwrap_or(false);
    let store_asked = req.store.unwrap_or(true);
    if background && !store_asked {
        return Err(ApiError::bad_param(
            "background can only be used when `store` is true (parameter=background)",
            "background",
        ));
    }
    let model = openai::resolve_model(&st, req.model.as_deref())?;
    if background && !st.config.responses_store {
        return Err(ApiError::invalid(NO_STORE_BACKGROUND, "background"));
    }
    let prev_id = req.previous_response_id.clone();
    let both = req
        .previous_input_messages
        .as_ref()
        .is_some_and(|m| !m.is_empty())
        && prev_id.as_ref().is_some_and(|id| !id.is_empty());
    if both {
        return Err(ApiError::invalid(
            "Only one of `previous_input_messages` and `previous_response_id` can be set.",
            "previous_response_id",
        ));
    }
    // vLLM silently drops `store` when it has none (most clients send the default true).
    let store = store_asked && st.config.responses_store;
    let prev = match &prev_id {
        Some(id) => Some(
            st.responses
                .history(id)
                .ok_or_else(|| ApiError::ResponseNotFound(id.clone()))?,
        ),
        None => None,
    };
    let messages = protocol::construct_input_messages(
        req.instructions.as_deref(),
        req.input,
        prev.as_ref().map(|(m, _)| m.as_slice()),
        prev.as_ref().map(|(_, r)| r.output.as_slice()),
    )?;
    let tokens = prompt_tokens(&st, &messages)?;
    let max_len = st.config.max_model_len;
    if tokens.len() >= max_len {
        return Err(ApiError::invalid(
            format!(
                "The engine prompt length {} exceeds the max_model_len {max_len}. Please reduce \
                 prompt.",
                tokens.len()
            ),
            "input",
        ));
    }
    let default = |room: usize| DEFAULT_CHAT_TOKENS_CAP.min(room as u32);
    let p = openai::finish(
        &st,
        model,
        tokens,
        req.max_output_tokens,
        default,
        None,
        None,
    )?;
    let id = req.request_id.unwrap_or_else(|| random_id("resp_"));
    let stream = req.stream.unwrap_or(false);
    let prompt_len = p.tokens.len() as u32;
    let sub = Submission {
        hash_seed: openai::hash_seed(&p.model, req.cache_salt.as_deref()),
        tokens: p.tokens,
        max_tokens: p.max_tokens,
        lora: p.model.lora,
        cache_salt: req.cache_salt,
        arrival: None,
        external: 0,
        hold: None,
    };
    let start = |status| {
        ResponseObject::start(
            id.clone(),
            p.model.name.clone(),
            req.instructions.clone(),
            p.max_tokens,
            background,
            prev_id.clone(),
            status,
        )
    };
    let in_progress = start(Status::InProgress);
    let messages = Arc::new(messages);
    let (guard, rx) = st.engine.submit(sub);
    let mut gen = Generation::new(guard, rx, in_progress, prompt_len, stream);
    gen.stall = st.faults.first_token_stall();
    if background {
        return Ok(run_background(&st, start(Status::Queued), messages, gen));
    }
    let keep = store.then(|| (st.clone(), messages));
    if stream {
        return Ok(sse(foreground_stream(gen, keep)));
    }
    let done = gen.run_to_end().await?;
    if let Some((st, messages)) = keep {
        st.responses.insert(Entry {
            response: done.clone(),
            messages,
            events: None,
            task: None,
        });
    }
    Ok(Json(done).into_response())
}

/// Tokens of the rendered messages: the chat template and tokenizer of `/v1/chat/completions`.
fn prompt_tokens(st: &AppState, messages: &[ChatMessage]) -> Result<Vec<u32>, ApiError> {
    match &st.hf {
        Some(hf) => {
            let msgs: Vec<_> = messages
                .iter()
                .map(|m| json!({"role": m.role, "content": m.content}))
                .collect();
            let body = json!({ "messages": msgs }).to_string();
            openai::hf_prompt_tokens(hf.chat_ids(body.as_bytes()))
        }
        None => Ok(tokenizer::tokenize(&tokenizer::render_chat(messages, true))),
    }
}

/// A background request: stored `queued` at once, generated by a task the client cannot
/// stop (only a cancel can); the POST answers the queued object, or streams the task's events.
fn run_background(
    st: &AppState,
    queued: ResponseObject,
    messages: Arc<Vec<ChatMessage>>,
    mut gen: Generation,
) -> Response {
    let events = gen.emit.then(|| Arc::new(EventLog::default()));
    let log = events.clone();
    let task_st = st.clone();
    let task_messages = messages.clone();
    let spawn = move || {
        tokio::spawn(async move {
            if let Some(log) = &log {
                log.append(gen.opening(), false);
            }
            loop {
                match gen.next().await {
                    Step::Frames(frames) => {
                        if let Some(log) = &log {
                            log.append(frames, false);
                        }
                    }
                    Step::Done(done, frames) => {
                        // Stored first: whoever has read `response.completed` then GETs
                        // the final object.
                        task_st.responses.finish(*done, task_messages);
                        if let Some(log) = &log {
                            log.append(frames, true);
                        }
                        return;
                    }
                    // The engine stopped (the simulator is shutting down).
                    Step::Lost => return,
                }
            }
        })
        .abort_handle()
    };
    let entry = Entry {
        response: queued.clone(),
        messages,
        events: events.clone(),
        task: None,
    };
    st.responses.insert_with_task(entry, Some(spawn));
    match events {
        Some(log) => sse(log.follow(0)),
        None => Json(queued).into_response(),
    }
}

/// A foreground stream: generated while the client reads (a disconnect drops the guard and
/// aborts the request); stored, when asked, only once it has run to its end.
fn foreground_stream(
    mut gen: Generation,
    keep: Option<(AppState, Arc<Vec<ChatMessage>>)>,
) -> impl futures_util::Stream<Item = Result<Bytes, io::Error>> + Send {
    let opening = Some(gen.opening());
    stream::unfold(
        (gen, opening, keep, false),
        |(mut gen, opening, keep, done)| async move {
            if let Some(frames) = opening {
                return Some((Ok(Bytes::from(frames.concat())), (gen, None, keep, false)));
            }
            if done {
                return None;
            }
            match gen.next().await {
                Step::Frames(frames) => {
                    Some((Ok(Bytes::from(frames.concat())), (gen, None, keep, false)))
                }
                Step::Done(response, frames) => {
                    if let Some((st, messages)) = &keep {
                        st.responses.insert(Entry {
                            response: *response,
                            messages: messages.clone(),
                            events: None,
                            task: None,
                        });
                    }
                    Some((Ok(Bytes::from(frames.concat())), (gen, None, keep, true)))
                }
                Step::Lost => Some((
                    Err(io::Error::other("engine stopped")),
                    (gen, None, keep, true),
                )),
            }
        },
    )
}

fn sse(
    body: impl futures_util::Stream<Item = Result<Bytes, io::Error>> + Send + 'static,
) -> Response {
    let mut resp = Response::new(Body::from_stream(body));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    resp
}

/// What one wait on the engine produced.
enum Step {
    /// Events of tokens that arrived (empty when not streaming).
    Frames(Vec<String>),
    /// The last token: the final object and the closing events.
    Done(Box<ResponseObject>, Vec<String>),
    /// The engine went away.
    Lost,
}

/// One response being generated: turns the engine's tokens into text and stream events.
struct Generation {
    guard: RequestGuard,
    rx: mpsc::UnboundedReceiver<TokenEvent>,
    /// The in-progress object of `response.created` / `.in_progress`.
    obj: ResponseObject,
    item_id: String,
    text: String,
    prompt_tokens: u32,
    generated: u32,
    seq: u64,
    /// Write stream events (a streamed response).
    emit: bool,
    /// The `first_token_stall_ms` fault, held back once before the first token.
    stall: std::time::Duration,
}

impl Generation {
    fn new(
        guard: RequestGuard,
        rx: mpsc::UnboundedReceiver<TokenEvent>,
        obj: ResponseObject,
        prompt_tokens: u32,
        emit: bool,
    ) -> Self {
        Self {
            guard,
            rx,
            obj,
            item_id: random_id("msg_"),
            text: String::new(),
            prompt_tokens,
            generated: 0,
            seq: 0,
            emit,
            stall: std::time::Duration::ZERO,
        }
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq - 1
    }

    fn response_event(&mut self, kind: &'static str, obj: &ResponseObject) -> String {
        let sequence_number = self.next_seq();
        frame(
            kind,
            &ResponseEvent {
                response: obj,
                sequence_number,
                kind,
            },
        )
    }

    /// `response.created` and `response.in_progress`.
    fn opening(&mut self) -> Vec<String> {
        let obj = self.obj.clone();
        vec![
            self.response_event("response.created", &obj),
            self.response_event("response.in_progress", &obj),
        ]
    }

    /// `response.output_item.added` and `response.content_part.added` (with the first token).
    fn item_opening(&mut self, out: &mut Vec<String>) {
        let item = OutputMessage::new(self.item_id.clone(), Vec::new(), "in_progress");
        self.item_event(out, "response.output_item.added", &item);
        self.part_event(out, "response.content_part.added", String::new(), Some([]));
    }

    /// `response.output_item.added` / `.done` for `item`.
    fn item_event(&mut self, out: &mut Vec<String>, kind: &'static str, item: &OutputMessage) {
        let sequence_number = self.next_seq();
        out.push(frame(
            kind,
            &ItemEvent {
                item,
                output_index: 0,
                sequence_number,
                kind,
            },
        ));
    }

    fn part_event(
        &mut self,
        out: &mut Vec<String>,
        kind: &'static str,
        text: String,
        logprobs: Option<[protocol::Null; 0]>,
    ) {
        let part = OutputText::new(text, logprobs);
        let sequence_number = self.next_seq();
        out.push(frame(
            kind,
            &PartEvent {
                content_index: 0,
                item_id: &self.item_id,
                output_index: 0,
                part: &part,
                sequence_number,
                kind,
            },
        ));
    }

    /// Waits for the engine; takes every token already there.
    async fn next(&mut self) -> Step {
        if !self.stall.is_zero() {
            tokio::time::sleep(std::mem::take(&mut self.stall)).await;
        }
        let Some(first) = self.rx.recv().await else {
            return Step::Lost;
        };
        let mut out = Vec::new();
        let mut ev = Some(first);
        while let Some(e) = ev {
            if self.emit && self.generated == 0 {
                self.item_opening(&mut out);
            }
            let piece = filler_piece(e.index);
            self.text.push_str(piece);
            self.generated += 1;
            if self.emit {
                let kind = "response.output_text.delta";
                let sequence_number = self.next_seq();
                out.push(frame(
                    kind,
                    &DeltaEvent {
                        content_index: 0,
                        delta: piece,
                        item_id: &self.item_id,
                        logprobs: [],
                        output_index: 0,
                        sequence_number,
                        kind,
                    },
                ));
            }
            if let Some(reason) = e.finish {
                self.guard.finished();
                let done = self.close(reason, e.cached_tokens, &mut out);
                return Step::Done(Box::new(done), out);
            }
            ev = self.rx.try_recv().ok();
        }
        Step::Frames(out)
    }

    /// The final object, and (streaming) the closing events.
    fn close(
        &mut self,
        reason: FinishReason,
        cached: u32,
        out: &mut Vec<String>,
    ) -> ResponseObject {
        let text = std::mem::take(&mut self.text);
        let item = OutputMessage::new(
            self.item_id.clone(),
            vec![OutputText::new(text.clone(), None)],
            "completed",
        );
        let usage = Usage::new(self.prompt_tokens, cached, self.generated);
        let by_length = matches!(reason, FinishReason::Length);
        let done = self.obj.clone().finished(item.clone(), usage, by_length);
        if self.emit {
            let kind = "response.output_text.done";
            let sequence_number = self.next_seq();
            out.push(frame(
                kind,
                &TextDoneEvent {
                    content_index: 0,
                    item_id: &self.item_id,
                    logprobs: [],
                    output_index: 0,
                    sequence_number,
                    text: &text,
                    kind,
                },
            ));
            self.part_event(out, "response.content_part.done", text, None);
            self.item_event(out, "response.output_item.done", &item);
            // Sent whatever the status, `incomplete` included: vLLM has no other final event.
            out.push(self.response_event("response.completed", &done));
        }
        done
    }

    /// Runs a whole (not streamed) response to its end.
    async fn run_to_end(mut self) -> Result<ResponseObject, ApiError> {
        loop {
            match self.next().await {
                Step::Frames(_) => {}
                Step::Done(done, _) => return Ok(*done),
                Step::Lost => return Err(ApiError::Internal("engine stopped".into())),
            }
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct RetrieveQuery {
    #[serde(default)]
    stream: Option<String>,
    #[serde(default)]
    starting_after: Option<String>,
}

/// FastAPI's bool query parsing.
fn query_bool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" | "t" | "y" => Some(true),
        "0" | "false" | "off" | "no" | "f" | "n" => Some(false),
        _ => None,
    }
}

/// `GET /v1/responses/{id}[?stream=true&starting_after=N]`.
pub async fn retrieve(
    State(st): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<RetrieveQuery>,
) -> Result<Response, ApiError> {
    let stream = match q.stream.as_deref() {
        None => false,
        Some(v) => query_bool(v).ok_or_else(|| {
            ApiError::Validation(format!("1 validation error: stream: not a boolean: {v:?}"))
        })?,
    };
    let after = match q.starting_after.as_deref() {
        None => None,
        Some(v) => Some(v.parse::<i64>().map_err(|_| {
            ApiError::Validation(format!(
                "1 validation error: starting_after: not an integer: {v:?}"
            ))
        })?),
    };
    let Some((obj, events)) = st.responses.response_and_events(&id) else {
        return Err(ApiError::ResponseNotFound(id));
    };
    if !stream {
        return Ok(Json(obj).into_response());
    }
    let from = after.map_or(0, |n| usize::try_from(n.saturating_add(1)).unwrap_or(0));
    Ok(match events {
        Some(log) => sse(log.follow(from)),
        // vLLM raises "Unknown response_id" inside its generator: the 200 and the SSE headers
        // are out, then the connection breaks without a byte of body.
        None => sse(broken_after_headers(id)),
    })
}

/// A body that fails once hyper has sent the headers: hyper writes them with the first body
/// frame, and flushes them when the body is not ready, so the error comes one wait later.
fn broken_after_headers(
    id: String,
) -> impl futures_util::Stream<Item = Result<Bytes, io::Error>> + Send {
    stream::once(async move {
        tokio::task::yield_now().await;
        Err(io::Error::other(format!("Unknown response_id: {id}")))
    })
}

/// `POST /v1/responses/{id}/cancel`.
pub async fn cancel(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    match st.responses.cancel(&id) {
        Cancel::NotFound => Err(ApiError::ResponseNotFound(id)),
        Cancel::NotCancellable => Err(ApiError::invalid(
            "Cannot cancel a synchronous response.",
            "response_id",
        )),
        Cancel::Cancelled(obj) => Ok(Json(*obj).into_response()),
    }
}
