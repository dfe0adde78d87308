//! A Responses API body (`POST /v1/responses`) as the chat request vLLM renders for it, so its
//! token ids are computed exactly as for chat.
//!
//! vLLM 0.32.0 (non-Harmony models) builds the messages with `construct_input_messages`
//! (`vllm/entrypoints/openai/responses/utils.py`) and renders them with the chat template as
//! `/v1/chat/completions` does (`OnlineRenderer.render_responses`,
//! `vllm/renderers/online_renderer.py`): `instructions` first as a `system` message; a string
//! `input` as one `user` message; list items with a `role` (`type` absent or `"message"`)
//! pass through with their content (text parts `input_text` / `output_text` read as text),
//! except that an `assistant` item whose content is a list becomes that list's first text.
//! Other items (tool calls and outputs, reasoning) and `previous_response_id` (whose history
//! the server holds) are not rendered here: such a request is routed without token ids.

use serde::Deserialize;
use serde_json::{json, Value};

use hf_tokenize::TokenizeError;

#[derive(Deserialize)]
struct Body {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    input: Value,
    #[serde(default)]
    previous_response_id: Option<Value>,
    #[serde(default)]
    tools: Option<Value>,
}

/// The chat body whose rendering is this Responses body's prompt.
pub fn as_chat(body: &[u8]) -> Result<Vec<u8>, TokenizeError> {
    let req: Body =
        serde_json::from_slice(body).map_err(|_| TokenizeError::Unsupported("responses body"))?;
    if req.previous_response_id.is_some_and(|v| !v.is_null()) {
        return Err(TokenizeError::Unsupported("previous_response_id"));
    }
    if req.tools.is_some_and(|t| !t.is_null()) {
        return Err(TokenizeError::Unsupported("responses tools"));
    }
    let mut messages = Vec::new();
    if let Some(instructions) = req.instructions.filter(|i| !i.is_empty()) {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    match req.input {
        Value::String(text) => messages.push(json!({"role": "user", "content": text})),
        Value::Array(items) => {
            for item in items {
                messages.push(message_of(item)?);
            }
        }
        _ => return Err(TokenizeError::Unsupported("responses input")),
    }
    let chat = json!({"model": req.model, "messages": messages});
    serde_json::to_vec(&chat).map_err(|_| TokenizeError::Unsupported("responses body"))
}

fn message_of(item: Value) -> Result<Value, TokenizeError> {
    let Value::Object(mut item) = item else {
        return Err(TokenizeError::Unsupported("responses input item"));
    };
    match item.get("type").and_then(Value::as_str) {
        None | Some("message") => {}
        Some(_) => return Err(TokenizeError::Unsupported("responses input item type")),
    }
    if !item.contains_key("role") {
        return Err(TokenizeError::Unsupported(
            "responses input item without role",
        ));
    }
    item.remove("type");
    // Other keys (`name`, …) reach the template as vLLM passes them.
    let assistant = item.get("role").and_then(Value::as_str) == Some("assistant");
    if let (true, Some(Value::Array(parts))) = (assistant, item.get("content")) {
        let first = parts
            .first()
            .and_then(|p| p.get("text").cloned())
            .unwrap_or(Value::String(String::new()));
        item.insert("content".into(), first);
    }
    Ok(Value::Object(item))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn chat(body: &str) -> Value {
        serde_json::from_slice(&as_chat(body.as_bytes()).unwrap()).unwrap()
    }

    #[test]
    fn instructions_and_input_become_vllms_messages() {
        assert_eq!(
            chat(r#"{"model":"m","instructions":"SYS","input":"hi"}"#),
            json!({"model":"m","messages":[{"role":"system","content":"SYS"},{"role":"user","content":"hi"}]})
        );
        assert_eq!(
            chat(
                r#"{"input":[{"role":"user","content":[{"type":"input_text","text":"a"}]},
                {"type":"message","role":"assistant","content":[{"type":"output_text","text":"b"}]}]}"#
            ),
            json!({"model":null,"messages":[
                {"role":"user","content":[{"type":"input_text","text":"a"}]},
                {"role":"assistant","content":"b"}]})
        );
        assert_eq!(
            chat(r#"{"input":[{"role":"user","name":"ann","content":"hi"}]}"#),
            json!({"model":null,"messages":[{"role":"user","name":"ann","content":"hi"}]})
        );
    }

    #[test]
    fn what_the_router_cannot_render_is_unsupported() {
        for body in [
            r#"{"input":"x","previous_response_id":"resp_1"}"#,
            r#"{"input":[{"type":"function_call_output","call_id":"c","output":"1"}]}"#,
            r#"{"input":7}"#,
            r#"{"input":"x","tools":[{"type":"function","name":"f"}]}"#,
        ] {
            assert!(as_chat(body.as_bytes()).is_err(), "{body}");
        }
    }
}
