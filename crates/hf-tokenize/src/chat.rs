//! Chat requests: the body fields that change the prompt, and the conversation vLLM hands the
//! template (`parse_chat_messages` + `_postprocess_messages` in vLLM 0.32's
//! `renderers/chat_utils.py`).
//!
//! Maps are minijinja values built in the order vLLM builds its dicts (`role`, `content`,
//! then the optional keys), and request JSON keeps its key order, so `tojson` in a template
//! prints what Python prints.

use minijinja::value::{Value, ValueKind};
use serde::Deserialize;

use crate::TokenizeError;

/// How a template wants message content (vLLM's `ChatTemplateContentFormat`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// Text parts joined with `"\n"` into one string.
    String,
    /// A list of `{"type": "text", "text": …}` parts.
    OpenAi,
}

/// The parts of a chat body that decide the prompt text.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub messages: Vec<Value>,
    pub tools: Option<Vec<Value>>,
    pub documents: Option<Value>,
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
    /// `chat_template_kwargs`, in request order.
    pub kwargs: Vec<(String, Value)>,
}

#[derive(Deserialize)]
struct Body {
    messages: Vec<Value>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    documents: Option<Value>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    continue_final_message: Option<bool>,
    #[serde(default)]
    chat_template: Option<Value>,
    #[serde(default)]
    chat_template_kwargs: Option<Value>,
}

fn invalid(msg: impl Into<String>) -> TokenizeError {
    TokenizeError::InvalidRequest(msg.into())
}

fn attr(v: &Value, key: &str) -> Option<Value> {
    if v.kind() != ValueKind::Map {
        return None;
    }
    let x = v.get_attr(key).ok()?;
    (!x.is_undefined()).then_some(x)
}

/// A value that is present and not JSON `null`.
fn some(v: Option<Value>) -> Option<Value> {
    v.filter(|x| !x.is_none() && !x.is_undefined())
}

/// Build an ordered map value.
fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::from_iter(entries.into_iter().map(|(k, v)| (k.to_owned(), v)))
}

impl ChatRequest {
    /// Read a `/v1/chat/completions` (or `/tokenize` chat) body.
    pub fn from_body(body: &[u8]) -> Result<ChatRequest, TokenizeError> {
        let b: Body = serde_json::from_slice(body).map_err(|e| invalid(e.to_string()))?;
        if some(b.chat_template).is_some() {
            // vLLM refuses a request's own template unless started with
            // --trust-request-chat-template; either way it is not the model's.
            return Err(TokenizeError::Unsupported("a chat_template in the request"));
        }
        let add_generation_prompt = b.add_generation_prompt.unwrap_or(true);
        let continue_final_message = b.continue_final_message.unwrap_or(false);
        if add_generation_prompt && continue_final_message {
            return Err(invalid(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            ));
        }
        let mut kwargs = Vec::new();
        if let Some(kw) = some(b.chat_template_kwargs) {
            if kw.kind() != ValueKind::Map {
                return Err(invalid("chat_template_kwargs must be an object"));
            }
            for key in kw.try_iter().map_err(|e| invalid(e.to_string()))? {
                let name = key.as_str().unwrap_or_default().to_owned();
                if matches!(name.as_str(), "chat_template" | "tokenize" | "messages") {
                    return Err(invalid(format!(
                        "Found unexpected chat template kwargs from request: {name}"
                    )));
                }
                let v = kw.get_item(&key).map_err(|e| invalid(e.to_string()))?;
                match name.as_str() {
                    // The request's own fields win over the same names in the kwargs.
                    "add_generation_prompt" | "continue_final_message" => {}
                    _ => kwargs.push((name, v)),
                }
            }
        }
        // vLLM keeps `tools` for `tool_choice: "none"` unless started with
        // --exclude-tools-when-tool-choice-none (off by default).
        let tools = match b.tools {
            None => None,
            Some(list) => Some(list.iter().map(tool_dict).collect::<Result<_, _>>()?),
        };
        Ok(ChatRequest {
            messages: b.messages,
            tools,
            documents: some(b.documents),
            add_generation_prompt,
            continue_final_message,
            kwargs,
        })
    }

    /// The messages as the template sees them.
    pub fn conversation(
        &self,
        format: ContentFormat,
        template_has_developer: bool,
    ) -> Result<Vec<Value>, TokenizeError> {
        if self.messages.is_empty() {
            return Err(invalid(
                "Cannot apply chat template to an empty conversation. Provide at least one message.",
            ));
        }
        let mut out = Vec::with_capacity(self.messages.len());
        for m in &self.messages {
            out.push(message(m, format)?);
        }
        let has_developer = out
            .iter()
            .any(|m| attr(m, "role").is_some_and(|r| r.as_str() == Some("developer")));
        if has_developer && !template_has_developer {
            out = developer_to_system(out);
        }
        Ok(out)
    }
}

/// `ChatCompletionToolsParam.model_dump()`: `type`, `function` {`name`, `description`,
/// `parameters`, [`strict`], [`defer_loading`]}, [`defer_loading`]; unknown keys dropped.
fn tool_dict(t: &Value) -> Result<Value, TokenizeError> {
    let f = attr(t, "function").ok_or_else(|| invalid("tools[].function is required"))?;
    let name = some(attr(&f, "name"))
        .filter(|n| n.kind() == ValueKind::String)
        .ok_or_else(|| invalid("tools[].function.name is required"))?;
    let defer_outer = some(attr(t, "defer_loading"));
    let defer_inner = some(attr(&f, "defer_loading")).or_else(|| defer_outer.clone());
    let mut func = vec![
        ("name", name),
        (
            "description",
            some(attr(&f, "description")).unwrap_or(Value::from(())),
        ),
        (
            "parameters",
            some(attr(&f, "parameters")).unwrap_or(Value::from(())),
        ),
    ];
    if let Some(s) = some(attr(&f, "strict")) {
        func.push(("strict", s));
    }
    if let Some(d) = defer_inner {
        func.push(("defer_loading", d));
    }
    let mut tool = vec![("type", Value::from("function")), ("function", map(func))];
    if let Some(d) = defer_outer {
        tool.push(("defer_loading", d));
    }
    Ok(map(tool))
}

/// One content part's text, or `None` for a text-type part without text (skipped by vLLM).
fn part_text(part: &Value) -> Result<Option<Value>, TokenizeError> {
    if part.kind() == ValueKind::String {
        return Ok(Some(part.clone()));
    }
    let ty = attr(part, "type");
    let key = match ty.as_ref().and_then(|t| t.as_str()) {
        Some("text" | "input_text" | "output_text") => "text",
        Some("refusal") => "refusal",
        Some("thinking") => "thinking",
        _ => return Err(TokenizeError::Unsupported("non-text content parts")),
    };
    Ok(some(attr(part, key)))
}

const BILLING_HEADER: &str = "x-anthropic-billing-header";

fn message(m: &Value, format: ContentFormat) -> Result<Value, TokenizeError> {
    let role = some(attr(m, "role"))
        .filter(|r| r.kind() == ValueKind::String)
        .ok_or_else(|| invalid("messages[].role is required"))?;
    let role_s = role.as_str().unwrap_or_default().to_owned();
    let content = some(attr(m, "content"));
    let mut texts: Vec<Value> = Vec::new();
    match content {
        None => {}
        Some(c) if c.kind() == ValueKind::String => texts.push(c),
        Some(c) if c.kind() == ValueKind::Seq => {
            for part in c.try_iter().map_err(|e| invalid(e.to_string()))? {
                if let Some(t) = part_text(&part)? {
                    texts.push(t);
                }
            }
        }
        Some(_) => return Err(invalid("messages[].content must be a string or a list")),
    }
    if role_s == "system" {
        // vLLM drops Claude Code's per-request attribution line from system text.
        texts = texts
            .into_iter()
            .filter_map(|t| {
                let s = t.as_str().unwrap_or_default();
                if !s.starts_with(BILLING_HEADER) {
                    return Some(t);
                }
                let rest = s.split_once('\n').map(|(_, r)| r).unwrap_or("");
                (!rest.is_empty()).then(|| Value::from(rest))
            })
            .collect();
    }
    let joined = || {
        let parts: Vec<&str> = texts
            .iter()
            .map(|t| t.as_str().unwrap_or_default())
            .collect();
        Value::from(parts.join("\n"))
    };
    let content_value = match format {
        ContentFormat::String => joined(),
        ContentFormat::OpenAi if role_s == "tool" => joined(),
        ContentFormat::OpenAi => Value::from(
            texts
                .iter()
                .map(|t| map(vec![("type", Value::from("text")), ("text", t.clone())]))
                .collect::<Vec<_>>(),
        ),
    };
    let mut out = vec![("role", role), ("content", content_value)];
    match role_s.as_str() {
        "assistant" => {
            if let Some(calls) = some(attr(m, "tool_calls")) {
                let calls = tool_calls(&calls)?;
                if !calls.is_empty() {
                    out.push(("tool_calls", Value::from(calls)));
                }
            }
            if let Some(r) = some(attr(m, "reasoning")) {
                out.push(("reasoning", r.clone()));
                out.push(("reasoning_content", r));
            }
        }
        "tool" => {
            if let Some(id) = attr(m, "tool_call_id") {
                out.push(("tool_call_id", id));
            }
        }
        _ => {}
    }
    if let Some(n) = some(attr(m, "name")).filter(|n| n.kind() == ValueKind::String) {
        out.push(("name", n));
    }
    if let Some(t) = some(attr(m, "task")).filter(|n| n.kind() == ValueKind::String) {
        out.push(("task", t));
    }
    if role_s == "developer" {
        out.push(("tools", attr(m, "tools").unwrap_or(Value::from(()))));
    }
    Ok(map(out))
}

/// Assistant tool calls with `function.arguments` parsed into a mapping (`{}` when empty,
/// malformed or not an object), as `_postprocess_messages` does.
fn tool_calls(calls: &Value) -> Result<Vec<Value>, TokenizeError> {
    if calls.kind() != ValueKind::Seq {
        return Err(invalid("tool_calls must be a list"));
    }
    let mut out = Vec::new();
    for call in calls.try_iter().map_err(|e| invalid(e.to_string()))? {
        if call.kind() != ValueKind::Map {
            return Err(invalid("assistant tool_calls entries must be objects."));
        }
        let ty = some(attr(&call, "type"));
        let func = attr(&call, "function").filter(|f| f.kind() == ValueKind::Map);
        let (Some(func), true) = (
            func,
            ty.as_ref().is_none_or(|t| t.as_str() == Some("function")),
        ) else {
            return Err(invalid(
                "chat completions only support assistant tool_calls of type 'function'.",
            ));
        };
        let args = some(attr(&func, "arguments"));
        let parsed = match args {
            Some(a) if a.kind() == ValueKind::Map => a,
            Some(a) if a.kind() == ValueKind::String && !a.as_str().unwrap_or("").is_empty() => {
                match serde_json::from_str::<Value>(a.as_str().unwrap_or("")) {
                    Ok(v) if v.kind() == ValueKind::Map => v,
                    _ => Value::from_iter(Vec::<(String, Value)>::new()),
                }
            }
            _ => Value::from_iter(Vec::<(String, Value)>::new()),
        };
        out.push(replace_key(
            &call,
            "function",
            replace_key(&func, "arguments", parsed),
        ));
    }
    Ok(out)
}

/// A copy of map `m` with `key` set to `v` (in place when present, appended otherwise).
fn replace_key(m: &Value, key: &str, v: Value) -> Value {
    let mut entries: Vec<(String, Value)> = Vec::new();
    let mut seen = false;
    if let Ok(keys) = m.try_iter() {
        for k in keys {
            let name = k.as_str().unwrap_or_default().to_owned();
            if name == key {
                entries.push((name, v.clone()));
                seen = true;
            } else {
                let item = m.get_item(&k).unwrap_or(Value::from(()));
                entries.push((name, item));
            }
        }
    }
    if !seen {
        entries.push((key.to_owned(), v));
    }
    Value::from_iter(entries)
}

/// vLLM's `_convert_developer_to_system` + `_consolidate_system_messages`.
fn developer_to_system(conv: Vec<Value>) -> Vec<Value> {
    let converted: Vec<Value> = conv
        .into_iter()
        .map(|m| {
            if attr(&m, "role").is_some_and(|r| r.as_str() == Some("developer")) {
                let mut entries: Vec<(String, Value)> = Vec::new();
                if let Ok(keys) = m.try_iter() {
                    for k in keys {
                        let name = k.as_str().unwrap_or_default().to_owned();
                        match name.as_str() {
                            "tools" => {}
                            "role" => entries.push((name, Value::from("system"))),
                            _ => entries.push((name, m.get_item(&k).unwrap_or(Value::from(())))),
                        }
                    }
                }
                Value::from_iter(entries)
            } else {
                m
            }
        })
        .collect();
    let mut system_contents: Vec<String> = Vec::new();
    let mut rest = Vec::new();
    let mut needs = false;
    for (i, m) in converted.iter().enumerate() {
        if attr(m, "role").is_some_and(|r| r.as_str() == Some("system")) {
            if i > 0 || !system_contents.is_empty() {
                needs = true;
            }
            let c = attr(m, "content").unwrap_or(Value::from(""));
            let text = if c.kind() == ValueKind::Seq {
                let parts: Vec<String> = c
                    .try_iter()
                    .map(|it| {
                        it.filter_map(|p| {
                            if p.kind() == ValueKind::String {
                                return Some(p.as_str().unwrap_or_default().to_owned());
                            }
                            attr(&p, "text").map(|t| t.as_str().unwrap_or_default().to_owned())
                        })
                        .collect()
                    })
                    .unwrap_or_default();
                parts.join("\n")
            } else {
                c.as_str().unwrap_or_default().to_owned()
            };
            if !text.is_empty() {
                system_contents.push(text);
            }
        } else {
            rest.push(m.clone());
        }
    }
    if !needs {
        return converted;
    }
    let mut out = vec![map(vec![
        ("role", Value::from("system")),
        ("content", Value::from(system_contents.join("\n\n"))),
    ])];
    out.extend(rest);
    out
}

/// transformers' `continue_final_message`: the tag appended to the last message's content
/// (a string, or the last text block of a list).
pub fn tag_final_message(last: Value, tag: &str) -> Result<Value, TokenizeError> {
    let content = attr(&last, "content")
        .filter(|c| !c.is_none())
        .ok_or_else(|| invalid("continue_final_message is set but the final message has no \"content\" to continue!"))?;
    let new_content = if content.kind() == ValueKind::Seq {
        let mut blocks: Vec<Value> = content
            .try_iter()
            .map_err(|e| invalid(e.to_string()))?
            .collect();
        let idx = blocks
            .iter()
            .rposition(|b| attr(b, "text").is_some())
            .ok_or_else(|| invalid("continue_final_message is set but we could not find any text to continue in the final message!"))?;
        let text = attr(&blocks[idx], "text").unwrap_or(Value::from(""));
        let tagged = format!("{}{tag}", text.as_str().unwrap_or_default());
        blocks[idx] = replace_key(&blocks[idx], "text", Value::from(tagged));
        Value::from(blocks)
    } else {
        Value::from(format!("{}{tag}", content.as_str().unwrap_or_default()))
    };
    Ok(replace_key(&last, "content", new_content))
}
