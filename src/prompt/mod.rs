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

use std::borrow::Cow;
use std::fmt::Write as _;

use serde::Deserialize;
use serde_json::value::RawValue;
use xxhash_rust::xxh3::xxh3_64;

use crate::error::Error;

/// Deepest nesting of arrays and objects in `body`, counting only brackets outside strings.
/// A linear scan that lets the front door refuse pathological bodies before parsing them.
pub fn json_depth(body: &[u8]) -> usize {
    let (mut depth, mut max, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for &b in body {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
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

/// Which OpenAI operation the request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    ChatCompletions,
    Completions,
    /// Any other `/v1/*` POST (embeddings, audio, …): routed by model and load only.
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
}

impl RequestView {
    /// Parse a request for `operation` from its raw body.
    pub fn parse(operation: Operation, body: &[u8]) -> Result<Self, Error> {
        let first = body.iter().find(|b| !b.is_ascii_whitespace());
        if operation != Operation::Other && first != Some(&b'{') {
            return Err(Error::InvalidRequest(
                "the request body must be a JSON object".into(),
            ));
        }
        match operation {
            Operation::ChatCompletions => parse_chat(body),
            Operation::Completions => parse_completions(body),
            Operation::Other => parse_other(body),
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
    messages: Option<Vec<Message<'a>>>,
    #[serde(default)]
    stream: Option<bool>,
    /// Type-checked only (a string), like vLLM does; not used for routing.
    #[serde(borrow, default, rename = "user")]
    _user: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
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

/// Message content: a string, an array of parts, or null.
fn render_content(raw: &RawValue, out: &mut String) -> Result<(), String> {
    let json = raw.get();
    match json.as_bytes().first() {
        Some(b'"') => {
            let text: Cow<'_, str> = serde_json::from_str(json).map_err(|e| e.to_string())?;
            out.push_str(&text);
        }
        Some(b'[') => {
            let parts: Vec<&RawValue> = serde_json::from_str(json).map_err(|e| e.to_string())?;
            for part in parts {
                render_part(part, out).map_err(|e| e.to_string())?;
            }
        }
        Some(b'n') if json == "null" => {}
        _ => return Err("must be a string, an array of content parts, or null".into()),
    }
    Ok(())
}

#[derive(Deserialize)]
struct TextPart<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

fn parse_chat(body: &[u8]) -> Result<RequestView, Error> {
    let chat: ChatBody<'_> = serde_json::from_slice(body).map_err(invalid)?;
    let messages = chat.messages.ok_or(Error::MissingField("messages"))?;
    if messages.is_empty() {
        return Err(Error::InvalidRequest("`messages` must not be empty".into()));
    }
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
            render_content(content, &mut text).map_err(|e| {
                Error::InvalidRequest(format!("invalid `messages[{i}].content`: {e}"))
            })?;
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
    })
}

fn render_part(raw: &RawValue, out: &mut String) -> Result<(), serde_json::Error> {
    let part: TextPart<'_> = serde_json::from_str(raw.get())?;
    match (part.kind.as_ref(), part.text) {
        ("text" | "input_text", Some(text)) => out.push_str(&text),
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
    /// Type-checked only (a string); not used for routing.
    #[serde(borrow, default, rename = "user")]
    _user: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Texts(#[serde(borrow)] Vec<Cow<'a, str>>),
    Tokens(Vec<u32>),
    TokenBatches(Vec<Vec<u32>>),
}

fn push_tokens(tokens: &[u32], out: &mut String) {
    for (i, t) in tokens.iter().enumerate() {
        if i > 0 {
            out.push(' ');
        }
        let _ = write!(out, "{t}");
    }
}

fn parse_completions(body: &[u8]) -> Result<RequestView, Error> {
    let req: CompletionBody<'_> = serde_json::from_slice(body).map_err(|e| {
        if e.to_string().contains("untagged enum Prompt") {
            Error::InvalidRequest(
                "`prompt` must be a string, an array of strings, an array of token ids or an array of token-id arrays".into(),
            )
        } else {
            invalid(e)
        }
    })?;
    let prompt = req.prompt.ok_or(Error::MissingField("prompt"))?;
    let text = match prompt {
        Prompt::Text(s) => s.into_owned(),
        Prompt::Texts(list) => list.join("\u{1e}"),
        Prompt::Tokens(tokens) => {
            let mut out = String::with_capacity(tokens.len() * 6);
            push_tokens(&tokens, &mut out);
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
    })
}

#[derive(Deserialize)]
struct OtherBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    /// Type-checked only (a string); not used for routing.
    #[serde(borrow, default, rename = "user")]
    _user: Option<Cow<'a, str>>,
}

fn parse_other(body: &[u8]) -> Result<RequestView, Error> {
    let model = if body.iter().all(u8::is_ascii_whitespace) {
        None
    } else {
        let req: OtherBody<'_> = serde_json::from_slice(body).map_err(invalid)?;
        req.model.map(Cow::into_owned)
    };
    Ok(RequestView {
        operation: Operation::Other,
        model,
        stream: false,
        routing_text: None,
    })
}

#[cfg(test)]
mod tests;
