//! The Responses API's body (`POST /v1/responses`) as a prompt.
//!
//! vLLM turns `instructions` + `input` into chat messages and renders them with the model's
//! chat template, as for `/v1/chat/completions` (`construct_input_messages` in
//! `vllm/entrypoints/openai/responses/utils.py`, vLLM 0.32.0; non-Harmony models): the
//! instructions become a first `system` message; a string `input` is one `user` message; a
//! list `input` is its items in order, messages (`{role, content}`, `type: "message"` or no
//! type) passing through with their content parts' text (`input_text`, `output_text`). With
//! `previous_response_id` the stored conversation of that response comes before the new
//! input on the server, which the router cannot see: such a request goes to the response's
//! holder anyway (`crate::responses`).
//!
//! The routing text is rendered as chat's (`role\n` + content + `\n\n` per message, the
//! instructions as `system`), so a client that resends the history turn by turn shares a
//! routing-text prefix with its previous turn. Items that are not messages (`function_call`,
//! `function_call_output`, `reasoning`, …) contribute `<type:hash>` of their raw JSON.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;
use xxhash_rust::xxh3::xxh3_64;

use super::fields::{invalid_param, Bounded, Numbers, Present};
use super::MAX_MESSAGES_CEILING;
use super::{invalid, render_content_of, Operation, ParseLimits, RequestView, RoleScope};
use crate::error::Error;

/// The longest response id accepted (vLLM's own are 21 characters; a client may choose its
/// own with vLLM's `request_id`).
pub const MAX_ID_LEN: usize = 128;

/// Is `id` an acceptable response id: 1 to [`MAX_ID_LEN`] bytes of `A–Z a–z 0–9 _ -`
/// (nothing that could change the meaning of a path it is put into)?
pub fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The 400 for an unacceptable id in `param`.
pub fn invalid_id(param: &str) -> Error {
    invalid_param(
        param,
        format!("`{param}` must be 1 to {MAX_ID_LEN} characters of A-Z, a-z, 0-9, `_` and `-`"),
    )
}

#[derive(Deserialize)]
struct ResponsesBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    instructions: Option<Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(borrow, default)]
    previous_response_id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    user: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    max_output_tokens: Option<f64>,
    #[serde(default)]
    kv_transfer_params: Present,
}

/// One `input` item as far as the router reads it.
#[derive(Deserialize)]
struct Item<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
}

pub(super) fn parse(body: &str, limits: &ParseLimits) -> Result<RequestView, Error> {
    let req: ResponsesBody<'_> = serde_json::from_str(body).map_err(invalid)?;
    let input = req.input.ok_or(Error::MissingField("input"))?;
    Numbers {
        temperature: req.temperature,
        top_p: req.top_p,
        max_tokens: req.max_output_tokens,
        ..Numbers::default()
    }
    .check()
    .map_err(|e| match e {
        // The field has another name here.
        Error::InvalidParam { param, message } if param == "max_tokens" => Error::InvalidParam {
            param: "max_output_tokens".into(),
            message: message.replace("max_tokens", "max_output_tokens"),
        },
        e => e,
    })?;
    let previous_response = match req.previous_response_id.map(RawValue::get) {
        None | Some("null") => None,
        Some(raw) => {
            let id: String = serde_json::from_str(raw).map_err(|_| {
                invalid_param(
                    "previous_response_id",
                    "`previous_response_id` must be a string",
                )
            })?;
            if !valid_id(&id) {
                return Err(invalid_id("previous_response_id"));
            }
            Some(id)
        }
    };
    let mut text = String::with_capacity(body.len().min(1 << 20));
    if let Some(tools) = req.tools {
        text.push_str("tools\n");
        text.push_str(tools.get());
        text.push_str("\n\n");
    }
    if let Some(instructions) = req.instructions.as_deref().filter(|i| !i.is_empty()) {
        text.push_str("system\n");
        text.push_str(instructions);
        text.push_str("\n\n");
    }
    render_input(input, limits, &mut text)?;
    Ok(RequestView {
        operation: Operation::Responses,
        model: req.model.map(Cow::into_owned),
        stream: req.stream.unwrap_or(false),
        routing_text: Some(text),
        tokens: None,
        user: req.user.map(|u| xxh3_64(u.as_bytes())),
        session: None,
        priority: 0,
        tenant: 0,
        kv_transfer_params: req.kv_transfer_params.0,
        roles: RoleScope::Whole,
        previous_response,
        pinned: None,
    })
}

/// `input`: a string (one user message) or a list of items.
fn render_input(input: &RawValue, limits: &ParseLimits, text: &mut String) -> Result<(), Error> {
    let json = input.get();
    match json.as_bytes().first() {
        Some(b'"') => {
            let s: Cow<'_, str> = serde_json::from_str(json).map_err(invalid)?;
            text.push_str("user\n");
            text.push_str(&s);
            text.push_str("\n\n");
            Ok(())
        }
        Some(b'[') => {
            let invalid_input =
                |e: serde_json::Error| invalid_param("input", format!("invalid `input`: {e}"));
            // Raw items (kept for the stand-ins of those that are not messages), each read
            // as an item after the count is checked.
            let items: Bounded<&RawValue> = serde_json::from_str(json).map_err(invalid_input)?;
            let max = limits.max_messages.min(MAX_MESSAGES_CEILING);
            if items.total > max {
                return Err(invalid_param(
                    "input",
                    format!("`input` has {} items; the limit is {max}", items.total),
                ));
            }
            for (i, raw) in items.list.into_iter().enumerate() {
                let item: Item<'_> = serde_json::from_str(raw.get()).map_err(invalid_input)?;
                match (&item.role, item.kind.as_deref()) {
                    (Some(role), None | Some("message")) => {
                        text.push_str(role);
                        text.push('\n');
                        if let Some(content) = item.content {
                            render_content_of("input", content, i, text)?;
                        }
                    }
                    (_, kind) => {
                        let kind = kind.unwrap_or("item");
                        // The type is client text: keep the stand-in short.
                        let kind: String = kind.chars().take(32).collect();
                        text.push_str(&format!("<{kind}:{:016x}>", xxh3_64(raw.get().as_bytes())));
                    }
                }
                text.push_str("\n\n");
            }
            Ok(())
        }
        _ => Err(invalid_param(
            "input",
            "`input` must be a string or an array of items",
        )),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn view(body: &str) -> Result<RequestView, Error> {
        RequestView::parse(Operation::Responses, body.as_bytes())
    }

    #[test]
    fn instructions_and_input_are_the_prompt() {
        let v = view(r#"{"model":"m","instructions":"be brief","input":"hello","stream":true}"#)
            .unwrap();
        assert_eq!(v.operation, Operation::Responses);
        assert_eq!(v.model.as_deref(), Some("m"));
        assert!(v.stream);
        assert_eq!(
            v.routing_text.as_deref(),
            Some("system\nbe brief\n\nuser\nhello\n\n")
        );
        let items = view(
            r#"{"input":[{"role":"user","content":[{"type":"input_text","text":"a"},{"type":"input_text","text":"b"}]},
                {"type":"message","role":"assistant","content":[{"type":"output_text","text":"c"}]},
                {"type":"function_call_output","call_id":"x","output":"42"}]}"#,
        )
        .unwrap();
        let text = items.routing_text.unwrap();
        assert!(
            text.starts_with("user\nab\n\nassistant\nc\n\n<function_call_output:"),
            "{text}"
        );
    }

    #[test]
    fn a_later_turn_extends_the_earlier_ones_text() {
        let one = view(r#"{"instructions":"s","input":[{"role":"user","content":"q1"}]}"#).unwrap();
        let two = view(
            r#"{"instructions":"s","input":[{"role":"user","content":"q1"},{"role":"assistant","content":"a1"},{"role":"user","content":"q2"}]}"#,
        )
        .unwrap();
        assert!(two
            .routing_text
            .unwrap()
            .starts_with(&one.routing_text.unwrap()));
    }

    #[test]
    fn previous_response_id_is_checked() {
        let v = view(r#"{"input":"x","previous_response_id":"resp_0123456789abcdef"}"#).unwrap();
        assert_eq!(
            v.previous_response.as_deref(),
            Some("resp_0123456789abcdef")
        );
        assert_eq!(
            view(r#"{"input":"x","previous_response_id":null}"#)
                .unwrap()
                .previous_response,
            None
        );
        for bad in [
            r#"{"input":"x","previous_response_id":42}"#,
            r#"{"input":"x","previous_response_id":["a"]}"#,
            r#"{"input":"x","previous_response_id":""}"#,
            r#"{"input":"x","previous_response_id":"../metrics"}"#,
            r#"{"input":"x","previous_response_id":"a%2fb"}"#,
        ] {
            match view(bad) {
                Err(Error::InvalidParam { param, .. }) => assert_eq!(param, "previous_response_id"),
                other => panic!("{bad}: {:?}", other.map(|v| v.previous_response)),
            }
        }
        let long = format!(
            r#"{{"input":"x","previous_response_id":"{}"}}"#,
            "a".repeat(MAX_ID_LEN + 1)
        );
        assert!(view(&long).is_err());
    }

    #[test]
    fn bad_bodies_are_400s_naming_the_field() {
        assert!(matches!(
            view(r#"{"model":"m"}"#),
            Err(Error::MissingField("input"))
        ));
        assert!(
            matches!(view(r#"{"input":7}"#), Err(Error::InvalidParam { param, .. }) if param == "input")
        );
        assert!(matches!(
            view(r#"{"input":"x","max_output_tokens":-1}"#),
            Err(Error::InvalidParam { param, .. }) if param == "max_output_tokens"
        ));
        assert!(matches!(
            view(r#"{"input":[{"role":"user","content":7}]}"#),
            Err(Error::InvalidParam { param, .. }) if param == "input[0].content"
        ));
    }
}
