//! One OpenAI chat request, streamed or whole, timed: TTFT, inter-token gaps, end to end.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};
use vllm_sim::tokenizer::ChatMessage;

/// What one request measured. Times are wall-clock seconds.
#[derive(Debug, Clone, Default)]
pub struct Record {
    pub session: u64,
    pub turn: u32,
    /// Time to the first non-empty content token (streaming), or to the whole answer.
    pub ttft: Option<f64>,
    /// Gaps between consecutive content chunks.
    pub itl: Vec<f64>,
    pub e2e: f64,
    pub output_tokens: u64,
    pub status: Option<u16>,
    /// `None` on success, else a short kind: `connect`, `timeout`, `http_503`, `body`, …
    pub error: Option<String>,
    /// From the router's backend header, when it sent one.
    pub backend: Option<String>,
    /// The answer's text (needed to re-send the history in multi-turn).
    pub text: String,
    /// The server's `usage.prompt_tokens` and `usage.prompt_tokens_details.cached_tokens`, when
    /// it sent them (the cached count only with vLLM's `--enable-prompt-tokens-details`).
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// Wall seconds from the run's start to this request's send (set by the runner).
    pub sent_at: f64,
    /// The prefix group of the request's session (set by the runner).
    pub group: u64,
}

/// How requests are sent.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RequestOptions {
    pub model: String,
    pub stream: bool,
    /// Header naming the serving backend (inferlb's `x-inferlb-backend`).
    pub backend_header: String,
    /// Send each request's session id in this header (`loadgen-<session>`), for session
    /// affinity (inferlb's `x-session-id`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session_header: Option<String>,
    /// Mixed-adapter traffic: each session asks for one of these models (LoRA adapters),
    /// chosen uniformly by a hash of the session id, instead of `model`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub adapters: Vec<String>,
}

impl RequestOptions {
    /// The model session `session` asks for.
    pub fn model_for(&self, session: u64) -> &str {
        if self.adapters.is_empty() {
            return &self.model;
        }
        let i = fastrand::Rng::with_seed(session ^ 0x1_0aa5).usize(..self.adapters.len());
        &self.adapters[i]
    }
}

/// Builds the HTTP client all requests share: keep-alive, HTTP/1.1, no proxies (loopback
/// traffic must never detour through an `HTTP_PROXY` from the environment).
pub fn http_client(pool: usize, timeout: Duration) -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(pool)
        .connect_timeout(Duration::from_secs(5))
        .timeout(timeout)
        .tcp_nodelay(true)
        .build()
}

/// The request body: `ignore_eos` makes every answer exactly `max_tokens` long on vLLM.
pub fn body(opts: &RequestOptions, messages: &[ChatMessage], max_tokens: u32) -> Value {
    body_for(opts, 0, messages, max_tokens)
}

/// The request body of session `session` (its model, see [`RequestOptions::model_for`]).
pub fn body_for(
    opts: &RequestOptions,
    session: u64,
    messages: &[ChatMessage],
    max_tokens: u32,
) -> Value {
    let messages: Vec<Value> = messages
        .iter()
        .map(|m| json!({"role": m.role, "content": m.content}))
        .collect();
    let mut b = json!({
        "model": opts.model_for(session),
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": true,
        "stream": opts.stream,
    });
    if opts.stream {
        b["stream_options"] = json!({"include_usage": true});
    }
    b
}

/// Sends one chat completion to `base` and measures it. Never returns an error: failures
/// are recorded in [`Record::error`].
pub async fn send(
    client: &reqwest::Client,
    base: &str,
    opts: &RequestOptions,
    session: u64,
    messages: &[ChatMessage],
    max_tokens: u32,
) -> Record {
    let url = format!("{}/v1/chat/completions", base.trim_end_matches('/'));
    let payload = body_for(opts, session, messages, max_tokens);
    let start = Instant::now();
    let mut rec = Record::default();
    let mut req = client.post(&url).json(&payload);
    if let Some(header) = &opts.session_header {
        req = req.header(header.as_str(), format!("loadgen-{session}"));
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            rec.error = Some(error_kind(&e));
            rec.e2e = start.elapsed().as_secs_f64();
            return rec;
        }
    };
    let status = resp.status();
    rec.status = Some(status.as_u16());
    rec.backend = resp
        .headers()
        .get(opts.backend_header.as_str())
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    if !status.is_success() {
        // Read the error body so the connection can be reused.
        let _ = resp.bytes().await;
        rec.error = Some(format!("http_{}", status.as_u16()));
        rec.e2e = start.elapsed().as_secs_f64();
        return rec;
    }
    if opts.stream {
        read_stream(resp, start, &mut rec).await;
    } else {
        match resp.bytes().await {
            Ok(bytes) => {
                rec.ttft = Some(start.elapsed().as_secs_f64());
                match serde_json::from_slice::<Value>(&bytes) {
                    Ok(v) => {
                        let content = &v["choices"][0]["message"]["content"];
                        rec.text = content.as_str().unwrap_or_default().to_owned();
                        rec.output_tokens = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                        note_prompt_usage(&v, &mut rec);
                    }
                    Err(_) => rec.error = Some("parse".into()),
                }
            }
            Err(e) => rec.error = Some(body_error_kind(&e)),
        }
    }
    rec.e2e = start.elapsed().as_secs_f64();
    rec
}

async fn read_stream(resp: reqwest::Response, start: Instant, rec: &mut Record) {
    let mut stream = resp.bytes_stream();
    let mut parser = SseParser::default();
    let mut last_token: Option<Instant> = None;
    let mut chunks = 0u64;
    let mut usage: Option<u64> = None;
    let mut done = false;
    while let Some(item) = stream.next().await {
        let bytes = match item {
            Ok(b) => b,
            Err(e) => {
                rec.error = Some(body_error_kind(&e));
                return;
            }
        };
        let now = Instant::now();
        for event in parser.push(&bytes) {
            match event {
                SseEvent::Done => done = true,
                SseEvent::Data(v) => {
                    if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                        usage = Some(n);
                        note_prompt_usage(&v, rec);
                    }
                    let choice = &v["choices"][0];
                    let piece = choice["delta"]["content"]
                        .as_str()
                        .or_else(|| choice["text"].as_str())
                        .unwrap_or_default();
                    if piece.is_empty() {
                        continue;
                    }
                    chunks += 1;
                    rec.text.push_str(piece);
                    match last_token {
                        None => rec.ttft = Some((now - start).as_secs_f64()),
                        Some(prev) => rec.itl.push((now - prev).as_secs_f64()),
                    }
                    last_token = Some(now);
                }
                SseEvent::Invalid => {
                    rec.error = Some("parse".into());
                }
            }
        }
    }
    rec.output_tokens = usage.unwrap_or(chunks);
    if !done && rec.error.is_none() {
        rec.error = Some("incomplete".into());
    }
}

/// Records the prompt's token counts from an answer's `usage`, where present.
fn note_prompt_usage(v: &Value, rec: &mut Record) {
    let usage = &v["usage"];
    if let Some(n) = usage["prompt_tokens"].as_u64() {
        rec.prompt_tokens = Some(n);
    }
    if let Some(n) = usage["prompt_tokens_details"]["cached_tokens"].as_u64() {
        rec.cached_tokens = Some(n);
    }
}

fn error_kind(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "timeout".into()
    } else if e.is_connect() {
        "connect".into()
    } else {
        "request".into()
    }
}

fn body_error_kind(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "timeout".into()
    } else {
        "body".into()
    }
}

/// One server-sent event's payload.
#[derive(Debug, PartialEq)]
pub enum SseEvent {
    Data(Value),
    Done,
    Invalid,
}

/// Incremental SSE parser: events end at a blank line, whatever the network chunking.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut consumed = 0;
        while let Some(end) = find_event_end(&self.buf[consumed..]) {
            let (len, sep) = end;
            let event = &self.buf[consumed..consumed + len];
            consumed += len + sep;
            for line in event.split(|&b| b == b'\n') {
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                let Some(data) = line.strip_prefix(b"data:") else {
                    continue;
                };
                let data = data.strip_prefix(b" ").unwrap_or(data);
                if data == b"[DONE]" {
                    out.push(SseEvent::Done);
                } else {
                    match serde_json::from_slice(data) {
                        Ok(v) => out.push(SseEvent::Data(v)),
                        Err(_) => out.push(SseEvent::Invalid),
                    }
                }
            }
        }
        self.buf.drain(..consumed);
        out
    }
}

/// Position and separator length of the first event end (`\n\n` or `\r\n\r\n`).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn sse_parser_handles_any_split() {
        let text = "data: {\"choices\":[{\"delta\":{\"content\":\" the\"}}]}\n\n\
                    data: {\"choices\":[],\"usage\":{\"completion_tokens\":1}}\r\n\r\n\
                    : comment\n\ndata: [DONE]\n\n";
        for split in 1..text.len() {
            let mut p = SseParser::default();
            let mut events = p.push(&text.as_bytes()[..split]);
            events.extend(p.push(&text.as_bytes()[split..]));
            assert_eq!(events.len(), 3, "split at {split}");
            assert_eq!(events[2], SseEvent::Done);
        }
        let mut p = SseParser::default();
        assert_eq!(p.push(b"data: {oops\n\n"), vec![SseEvent::Invalid]);
    }

    #[test]
    fn body_asks_for_usage_only_when_streaming() {
        let mut opts = RequestOptions {
            model: "m".into(),
            stream: true,
            backend_header: "x".into(),
            ..Default::default()
        };
        let m = [ChatMessage {
            role: "user".into(),
            content: "hi".into(),
        }];
        let b = body(&opts, &m, 7);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["ignore_eos"], true);
        opts.stream = false;
        assert!(body(&opts, &m, 7).get("stream_options").is_none());
        assert_eq!(body_for(&opts, 5, &m, 7)["model"], "m");
    }

    #[test]
    fn mixed_adapters_pick_one_per_session_and_use_them_all() {
        let opts = RequestOptions {
            model: "base".into(),
            adapters: vec!["a".into(), "b".into(), "c".into()],
            ..Default::default()
        };
        let mut seen = std::collections::HashMap::new();
        for s in 0..300 {
            assert_eq!(opts.model_for(s), opts.model_for(s), "stable per session");
            *seen.entry(opts.model_for(s).to_owned()).or_insert(0) += 1;
        }
        assert_eq!(seen.len(), 3, "{seen:?}");
        assert!(seen.values().all(|n| (60..140).contains(n)), "{seen:?}");
    }
}
