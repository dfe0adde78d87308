//! Prompt extraction: turn an OpenAI request body into the routing view the scheduler reads.
//!
//! The body is parsed exactly once, with borrowed strings where the JSON allows it, and the
//! original bytes are what gets forwarded — this module never re-serialises a request.
//!
//! The *routing text* is a deterministic rendering of everything that ends up in the
//! model's prompt, in prompt order, so that two requests sharing a conversation prefix share
//! a routing-text prefix:
//!
//! * chat: `tools` first (a chat template puts them in the system area), then every message as
//!   `role[:name]\n` + content + tool calls + `\n\n`. Text parts contribute their text; image,
//!   audio, video and file parts contribute `<kind:hash>` where the hash is XXH3-64 of the part's
//!   raw JSON (so identical URLs or identical inline data give identical text, and megabytes of
//!   base64 never enter the prefix index).
//! * completions: the prompt string; several prompts joined by U+001E; token ids as decimal
//!   numbers separated by spaces.
//!
//! While parsing, the fields the router reads or can check cheaply are validated
//! ([`fields`]): message count, content parts of a known type without their payload, the
//! prompt's shape, and sampling numbers out of the range a backend accepts — each a 400 naming
//! the field.

pub mod fields;
pub mod multipart;
pub mod responses;

use std::borrow::Cow;
use std::fmt::Write as _;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::value::RawValue;
use xxhash_rust::xxh3::xxh3_64;

use crate::error::Error;
use crate::tokenization::PromptTokens;
use fields::{invalid_param, Bounded, Numbers, Present, Prompt, PROMPT_SHAPES};
pub use fields::{ParseLimits, MAX_MESSAGES_CEILING};

/// Deepest nesting of arrays and objects in `body`, counting only brackets outside strings.
/// A linear scan that lets the front door refuse pathological bodies before parsing them.
/// Inside a string it jumps from one quote or backslash to the next (`memchr2`): prompts are
/// almost all string bytes.
pub fn json_depth(body: &[u8]) -> usize {
    let (mut depth, mut max, mut i) = (0usize, 0usize, 0usize);
    while let Some(&b) = body.get(i) {
        i += 1;
        match b {
            b'"' => loop {
                // The string's end: the next quote not escaped by a backslash.
                let Some(rest) = body.get(i..) else {
                    return max;
                };
                match memchr::memchr2(b'"', b'\\', rest) {
                    None => return max,
                    Some(at) => {
                        let found = rest[at];
                        // Past the quote, or past the backslash and the byte it escapes.
                        i = i
                            .saturating_add(at)
                            .saturating_add(if found == b'"' { 1 } else { 2 });
                        if found == b'"' {
                            break;
                        }
                    }
                }
            },
            b'[' | b'{' => {
                depth += 1;
                max = max.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

/// Is `body` nested deeper than `limit` ([`json_depth`])? A body with no more opening
/// brackets than `limit` in all cannot be, and counting them (a loop the compiler vectorises)
/// answers that for nearly every request without the scan.
pub fn deeper_than(body: &[u8], limit: usize) -> bool {
    // Counted in byte-wide sums of at most 255 bytes each, which vectorise; a `usize` sum
    // per byte did not.
    let opening: usize = body
        .chunks(255)
        .map(|chunk| {
            let n = chunk.iter().fold(0u8, |n, &b| {
                n.wrapping_add(u8::from(b == b'[' || b == b'{'))
            });
            usize::from(n)
        })
        .sum();
    opening > limit && json_depth(body) > limit
}

/// Which OpenAI operation the request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    ChatCompletions,
    Completions,
    /// `POST /v1/responses` (OpenAI's Responses API): `instructions` + `input` are the prompt.
    Responses,
    /// Any other `/v1/*` POST (embeddings, audio, …), and the Responses API's calls on one
    /// response (`/v1/responses/{id}…`): routed by model and load only.
    Other,
}

/// What the scheduler needs to know about one request.
#[derive(Debug, Clone)]
pub struct RequestView {
    pub operation: Operation,
    pub model: Option<String>,
    pub stream: bool,
    /// The rendered prompt, `None` where the operation has no prompt.
    pub routing_text: Option<String>,
    /// The prompt's token ids when they are known (see [`crate::tokenization`]).
    pub tokens: Option<Arc<PromptTokens>>,
    /// XXH3 of the OpenAI `user` field, when the body has one.
    pub user: Option<u64>,
    /// XXH3 of the client's session key (the session header, or `user` when configured); set
    /// by the front door, read by `session-affinity-scorer`.
    pub session: Option<u64>,
    /// Priority class (0 = highest, an index into `priority.classes`); set by the front door.
    pub priority: u8,
    /// Who sent the request (XXH3 of the API key, else of the client address); set by the
    /// front door, the unit of fairness in the capacity queue.
    pub tenant: u64,
    /// The body's top-level object has a `kv_transfer_params` key (noted while parsing; the
    /// forward stage removes it unless configured otherwise, see `crate::forward::kv_params`).
    pub kv_transfer_params: bool,
    /// Which backend roles may take it (`role-filter`); set by the scheduling layer and the
    /// P/D flow (`crate::pd`), never by the parser.
    pub roles: RoleScope,
    /// `previous_response_id` of a Responses API request (checked: a string of at most
    /// [`responses::MAX_ID_LEN`] bytes).
    pub previous_response: Option<String>,
    /// The backend (by name) that must take the request: the holder of the response it
    /// names (`pinned-filter`). Set by the front door, never by the parser.
    pub pinned: Option<Arc<str>>,
}

/// Which prefill/decode roles of backend may take a request (see `role-filter`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RoleScope {
    /// A whole request: `decode` and `both` backends.
    #[default]
    Whole,
    /// A whole request whose prompt is too short ever to be disaggregated: `prefill`
    /// backends may take it too (`pd.prefill_serves_short_prompts`).
    WholeShort,
    /// The prefill step of a disaggregated request: `prefill` backends only.
    PrefillStep,
}

impl RequestView {
    /// Characters per token assumed where the prompt's token ids are not known and no
    /// plugin parameter says otherwise.
    pub const CHARS_PER_TOKEN: f64 = 4.0;

    /// The prompt's length in tokens: its token ids when known, else its routing text's
    /// bytes ÷ `chars_per_token`; 0 without a prompt.
    pub fn prompt_tokens(&self, chars_per_token: f64) -> f64 {
        match (&self.tokens, &self.routing_text) {
            (Some(tokens), _) => tokens.ids.len() as f64,
            (None, Some(text)) => text.len() as f64 / chars_per_token,
            (None, None) => 0.0,
        }
    }

    /// [`Self::prompt_tokens`] at [`Self::CHARS_PER_TOKEN`], whole, and at least 1 (a request
    /// without a prompt still costs the backend something).
    pub fn estimated_prompt_tokens(&self) -> u64 {
        (self.prompt_tokens(Self::CHARS_PER_TOKEN) as u64).max(1)
    }

    /// Parse a request for `operation` from its raw body, with the default limits.
    pub fn parse(operation: Operation, body: &[u8]) -> Result<Self, Error> {
        Self::parse_with(operation, body, &ParseLimits::default())
    }

    /// Parse a request for `operation` from its raw body.
    pub fn parse_with(
        operation: Operation,
        body: &[u8],
        limits: &ParseLimits,
    ) -> Result<Self, Error> {
        let first = body.iter().find(|b| !b.is_ascii_whitespace());
        if operation != Operation::Other && first != Some(&b'{') {
            return Err(Error::InvalidRequest(
                "the request body must be a JSON object".into(),
            ));
        }
        // UTF-8 checked once for the whole body, so the JSON reader need not check each
        // string again (and a skipped field's bytes are held to it too, as vLLM holds them).
        let body = std::str::from_utf8(body).map_err(|e| {
            Error::InvalidRequest(format!(
                "the request body is not valid UTF-8 (from byte {})",
                e.valid_up_to()
            ))
        })?;
        match operation {
            Operation::ChatCompletions => parse_chat(body, limits),
            Operation::Completions => parse_completions(body),
            Operation::Responses => responses::parse(body, limits),
            Operation::Other => parse_other(body),
        }
    }

    /// A `multipart/form-data` request (audio): routed by its `model` form field when a
    /// bounded scan finds one, else by load alone.
    pub fn multipart(body: &[u8], boundary: &str) -> Self {
        RequestView {
            operation: Operation::Other,
            model: multipart::model_field(body, boundary),
            stream: false,
            routing_text: None,
            tokens: None,
            user: None,
            session: None,
            priority: 0,
            tenant: 0,
            kv_transfer_params: false,
            roles: RoleScope::Whole,
            previous_response: None,
            pinned: None,
        }
    }
}

fn invalid(err: serde_json::Error) -> Error {
    Error::InvalidRequest(format!("invalid JSON body: {err}"))
}

#[derive(Deserialize)]
struct ChatBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    messages: Option<Bounded<Message<'a>>>,
    #[serde(default)]
    stream: Option<bool>,
    /// A string, like vLLM checks; its hash may key the session.
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    top_k: Option<f64>,
    #[serde(default)]
    min_p: Option<f64>,
    #[serde(default)]
    presence_penalty: Option<f64>,
    #[serde(default)]
    frequency_penalty: Option<f64>,
    #[serde(default)]
    repetition_penalty: Option<f64>,
    #[serde(default)]
    max_tokens: Option<f64>,
    #[serde(default)]
    max_completion_tokens: Option<f64>,
    #[serde(default)]
    n: Option<f64>,
    #[serde(default)]
    kv_transfer_params: Present,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
}

/// Message content of `messages[index]`: a string, an array of parts, or null.
fn render_content(raw: &RawValue, index: usize, out: &mut String) -> Result<(), Error> {
    render_content_of("messages", raw, index, out)
}

/// Content of `{list}[index]` (`messages` of chat, `input` of the Responses API).
pub(crate) fn render_content_of(
    list: &str,
    raw: &RawValue,
    index: usize,
    out: &mut String,
) -> Result<(), Error> {
    let json = raw.get();
    let invalid = |e: &dyn std::fmt::Display| {
        invalid_param(
            format!("{list}[{index}].content"),
            format!("invalid `{list}[{index}].content`: {e}"),
        )
    };
    match json.as_bytes().first() {
        Some(b'"') => {
            // Without a backslash a JSON string's text is what stands between its quotes (the
            // raw value is valid JSON already): no second parse in the common case.
            let plain = json
                .strip_prefix('"')
                .and_then(|j| j.strip_suffix('"'))
                .filter(|text| !text.contains('\\'));
            match plain {
                Some(text) => out.push_str(text),
                None => {
                    let text: Cow<'_, str> = serde_json::from_str(json).map_err(|e| invalid(&e))?;
                    out.push_str(&text);
                }
            }
        }
        Some(b'[') => {
            let parts: Vec<&RawValue> = serde_json::from_str(json).map_err(|e| invalid(&e))?;
            for (j, part) in parts.into_iter().enumerate() {
                render_part(part, out).map_err(|e| match e {
                    PartError::Json(e) => invalid(&e),
                    PartError::Missing { field, message } => invalid_param(
                        format!("{list}[{index}].content[{j}].{field}"),
                        format!("`{list}[{index}].content[{j}]` {message}"),
                    ),
                })?;
            }
        }
        Some(b'n') if json == "null" => {}
        _ => {
            return Err(invalid(
                &"must be a string, an array of content parts, or null",
            ))
        }
    }
    Ok(())
}

/// A content part as far as the router reads it: its type, its text, and the payload fields
/// of the media types (kept raw: megabytes of base64 are neither copied nor decoded).
#[derive(Deserialize)]
struct Part<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    image_url: Option<&'a RawValue>,
    #[serde(borrow, default)]
    video_url: Option<&'a RawValue>,
    #[serde(borrow, default)]
    audio_url: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input_audio: Option<&'a RawValue>,
}

/// The inner field of a media payload (`image_url.url`, `input_audio.data`).
#[derive(Deserialize)]
struct Payload<'a> {
    #[serde(borrow, default)]
    url: Option<&'a RawValue>,
    #[serde(borrow, default)]
    data: Option<&'a RawValue>,
}

enum PartError {
    Json(serde_json::Error),
    Missing {
        field: &'static str,
        message: String,
    },
}

fn parse_chat(body: &str, limits: &ParseLimits) -> Result<RequestView, Error> {
    let chat: ChatBody<'_> = serde_json::from_str(body).map_err(invalid)?;
    let messages = chat.messages.ok_or(Error::MissingField("messages"))?;
    if messages.total == 0 {
        return Err(invalid_param("messages", "`messages` must not be empty"));
    }
    let max = limits.max_messages.min(MAX_MESSAGES_CEILING);
    if messages.total > max {
        return Err(invalid_param(
            "messages",
            format!(
                "`messages` has {} messages; the limit is {max}",
                messages.total
            ),
        ));
    }
    Numbers {
        temperature: chat.temperature,
        top_p: chat.top_p,
        top_k: chat.top_k,
        min_p: chat.min_p,
        presence_penalty: chat.presence_penalty,
        frequency_penalty: chat.frequency_penalty,
        repetition_penalty: chat.repetition_penalty,
        max_tokens: chat.max_tokens,
        max_completion_tokens: chat.max_completion_tokens,
        n: chat.n,
    }
    .check()?;
    let messages = messages.list;
    let mut text = String::with_capacity(body.len().min(1 << 20));
    if let Some(tools) = chat.tools {
        text.push_str("tools\n");
        text.push_str(tools.get());
        text.push_str("\n\n");
    }
    for (i, message) in messages.iter().enumerate() {
        text.push_str(&message.role);
        if let Some(name) = &message.name {
            text.push(':');
            text.push_str(name);
        }
        text.push('\n');
        if let Some(content) = message.content {
            render_content(content, i, &mut text)?;
        }
        if let Some(calls) = message.tool_calls {
            text.push_str("\ntool_calls ");
            text.push_str(calls.get());
        }
        text.push_str("\n\n");
    }
    Ok(RequestView {
        operation: Operation::ChatCompletions,
        model: chat.model.map(Cow::into_owned),
        stream: chat.stream.unwrap_or(false),
        routing_text: Some(text),
        tokens: None,
        user: chat.user.map(|u| xxh3_64(u.as_bytes())),
        session: None,
        priority: 0,
        tenant: 0,
        kv_transfer_params: chat.kv_transfer_params.0,
        roles: RoleScope::Whole,
        previous_response: None,
        pinned: None,
    })
}

/// Render one content part; a part of a known type must carry its payload.
fn render_part(raw: &RawValue, out: &mut String) -> Result<(), PartError> {
    let part: Part<'_> = serde_json::from_str(raw.get()).map_err(PartError::Json)?;
    let kind = part.kind.as_ref();
    if let Some((field, inner)) = fields::required_payload(kind) {
        let payload = match field {
            "image_url" => part.image_url,
            "video_url" => part.video_url,
            "audio_url" => part.audio_url,
            "input_audio" => part.input_audio,
            _ => None,
        };
        let missing = |what: String| PartError::Missing {
            field,
            message: format!("of type `{kind}` {what}"),
        };
        match (inner, payload) {
            (None, _) if part.text.is_none() => return Err(missing(format!("has no `{field}`"))),
            (None, _) => {}
            (Some(_), None) => return Err(missing(format!("has no `{field}`"))),
            (Some(inner), Some(payload)) => {
                let present: Payload<'_> = serde_json::from_str(payload.get()).map_err(|_| {
                    missing(format!("needs `{field}` to be an object with `{inner}`"))
                })?;
                let value = if inner == "url" {
                    present.url
                } else {
                    present.data
                };
                if !value.is_some_and(|v| v.get().starts_with('"')) {
                    return Err(missing(format!("needs a string `{field}.{inner}`")));
                }
            }
        }
    }
    match (kind, part.text) {
        ("text" | "input_text" | "output_text", Some(text)) => out.push_str(&text),
        (kind, _) => {
            // Media and unknown parts: a short, stable stand-in for their content.
            let _ = write!(out, "<{kind}:{:016x}>", xxh3_64(raw.get().as_bytes()));
        }
    }
    Ok(())
}

#[derive(Deserialize)]
struct CompletionBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    prompt: Option<Prompt<'a>>,
    #[serde(default)]
    stream: Option<bool>,
    /// A string; its hash may key the session.
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    top_k: Option<f64>,
    #[serde(default)]
    min_p: Option<f64>,
    #[serde(default)]
    presence_penalty: Option<f64>,
    #[serde(default)]
    frequency_penalty: Option<f64>,
    #[serde(default)]
    repetition_penalty: Option<f64>,
    #[serde(default)]
    max_tokens: Option<f64>,
    #[serde(default)]
    n: Option<f64>,
    #[serde(default)]
    kv_transfer_params: Present,
}

fn push_tokens(tokens: &[u32], out: &mut String) {
    for (i, t) in tokens.iter().enumerate() {
        if i > 0 {
            out.push(' ');
        }
        let _ = write!(out, "{t}");
    }
}

fn parse_completions(body: &str) -> Result<RequestView, Error> {
    let req: CompletionBody<'_> = serde_json::from_str(body).map_err(invalid)?;
    let prompt = req.prompt.ok_or(Error::MissingField("prompt"))?;
    Numbers {
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        min_p: req.min_p,
        presence_penalty: req.presence_penalty,
        frequency_penalty: req.frequency_penalty,
        repetition_penalty: req.repetition_penalty,
        max_tokens: req.max_tokens,
        max_completion_tokens: None,
        n: req.n,
    }
    .check()?;
    let mut tokens = None;
    let text = match prompt {
        Prompt::Invalid => return Err(invalid_param("prompt", PROMPT_SHAPES)),
        Prompt::Text(s) => s.into_owned(),
        Prompt::Texts(list) => list.join("\u{1e}"),
        Prompt::Tokens(ids) => {
            let mut out = String::with_capacity(ids.len() * 6);
            push_tokens(&ids, &mut out);
            tokens = Some(Arc::new(PromptTokens {
                ids,
                cache_salt: None,
            }));
            out
        }
        Prompt::TokenBatches(batches) => {
            let mut out = String::new();
            for (i, tokens) in batches.iter().enumerate() {
                if i > 0 {
                    out.push('\u{1e}');
                }
                push_tokens(tokens, &mut out);
            }
            out
        }
    };
    Ok(RequestView {
        operation: Operation::Completions,
        model: req.model.map(Cow::into_owned),
        stream: req.stream.unwrap_or(false),
        routing_text: Some(text),
        tokens,
        user: req.user.map(|u| xxh3_64(u.as_bytes())),
        session: None,
        priority: 0,
        tenant: 0,
        kv_transfer_params: req.kv_transfer_params.0,
        roles: RoleScope::Whole,
        previous_response: None,
        pinned: None,
    })
}

#[derive(Deserialize)]
struct OtherBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    /// A string; its hash may key the session.
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
    #[serde(default)]
    kv_transfer_params: Present,
}

fn parse_other(body: &str) -> Result<RequestView, Error> {
    let (model, user, kv_transfer_params) = if body.bytes().all(|b| b.is_ascii_whitespace()) {
        (None, None, false)
    } else {
        let req: OtherBody<'_> = serde_json::from_str(body).map_err(invalid)?;
        (
            req.model.map(Cow::into_owned),
            req.user.map(|u| xxh3_64(u.as_bytes())),
            req.kv_transfer_params.0,
        )
    };
    Ok(RequestView {
        operation: Operation::Other,
        model,
        stream: false,
        routing_text: None,
        tokens: None,
        user,
        session: None,
        priority: 0,
        tenant: 0,
        kv_transfer_params,
        roles: RoleScope::Whole,
        previous_response: None,
        pinned: None,
    })
}

#[cfg(test)]
mod tests;
