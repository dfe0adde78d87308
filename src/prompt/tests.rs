//! Table-driven tests of prompt extraction for every body shape the OpenAI API allows.
#![allow(clippy::unwrap_used)]

use super::*;

fn chat(body: &str) -> Result<RequestView, Error> {
    RequestView::parse(Operation::ChatCompletions, body.as_bytes())
}

fn completion(body: &str) -> Result<RequestView, Error> {
    RequestView::parse(Operation::Completions, body.as_bytes())
}

#[test]
fn chat_string_content_in_order() {
    let v = chat(
        r#"{"model":"m","stream":true,"user":"u1","messages":[
            {"role":"system","content":"Be brief."},
            {"role":"user","name":"bob","content":"Hi"}]}"#,
    )
    .unwrap();
    assert_eq!(v.model.as_deref(), Some("m"));
    assert!(v.stream);
    assert_eq!(
        v.routing_text.as_deref(),
        Some("system\nBe brief.\n\nuser:bob\nHi\n\n")
    );
}

#[test]
fn chat_prefix_is_shared_between_turns() {
    let one =
        chat(r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"Q1"}]}"#)
            .unwrap();
    let two = chat(
        r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"Q1"},
            {"role":"assistant","content":"A1"},{"role":"user","content":"Q2"}]}"#,
    )
    .unwrap();
    let a = one.routing_text.unwrap();
    assert!(two.routing_text.unwrap().starts_with(&a));
}

#[test]
fn chat_parts_text_and_media() {
    let v = chat(
        r#"{"messages":[{"role":"user","content":[
            {"type":"text","text":"look: "},
            {"type":"image_url","image_url":{"url":"https://x/cat.png"}},
            {"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}}]}]}"#,
    )
    .unwrap();
    let text = v.routing_text.unwrap();
    assert!(text.starts_with("user\nlook: <image_url:"), "{text}");
    assert!(text.contains("<input_audio:"), "{text}");
    // The same image URL renders the same; a different one differs.
    let same = chat(r#"{"messages":[{"role":"user","content":[{"type":"text","text":"look: "},{"type":"image_url","image_url":{"url":"https://x/cat.png"}}]}]}"#).unwrap();
    let other = chat(r#"{"messages":[{"role":"user","content":[{"type":"text","text":"look: "},{"type":"image_url","image_url":{"url":"https://x/dog.png"}}]}]}"#).unwrap();
    let same = same.routing_text.unwrap();
    let other = other.routing_text.unwrap();
    assert!(text.starts_with(same.trim_end()));
    assert_ne!(same, other);
}

#[test]
fn chat_tools_and_tool_calls_are_part_of_prompt() {
    let v = chat(
        r#"{"tools":[{"type":"function","function":{"name":"f"}}],"messages":[
            {"role":"assistant","content":null,"tool_calls":[{"id":"1"}]},
            {"role":"tool","content":"42"}]}"#,
    )
    .unwrap();
    let text = v.routing_text.unwrap();
    assert!(text.starts_with("tools\n[{\"type\":\"function\""), "{text}");
    assert!(text.contains("tool_calls [{\"id\":\"1\"}]"), "{text}");
    assert!(text.contains("tool\n42"), "{text}");
}

#[test]
fn chat_without_model_or_stream_defaults() {
    let v = chat(r#"{"messages":[{"role":"user","content":"x"}]}"#).unwrap();
    assert_eq!(v.model, None);
    assert!(!v.stream);
    assert_eq!(v.operation, Operation::ChatCompletions);
}

#[test]
fn chat_escaped_strings_are_unescaped() {
    let v = chat(r#"{"messages":[{"role":"user","content":"a\nb\u00e9"}]}"#).unwrap();
    assert_eq!(v.routing_text.as_deref(), Some("user\na\nbé\n\n"));
}

#[test]
fn completions_every_prompt_shape() {
    let cases = [
        (r#"{"prompt":"hello"}"#, "hello"),
        (r#"{"prompt":["a","b"]}"#, "a\u{1e}b"),
        (r#"{"prompt":[1,2,3]}"#, "1 2 3"),
        (r#"{"prompt":[[1,2],[3]]}"#, "1 2\u{1e}3"),
        (r#"{"prompt":[]}"#, ""),
    ];
    for (body, want) in cases {
        let v = completion(body).unwrap();
        assert_eq!(v.routing_text.as_deref(), Some(want), "{body}");
        assert_eq!(v.operation, Operation::Completions);
    }
}

#[test]
fn malformed_bodies_are_invalid_requests() {
    let chat_cases = [
        "",
        "{",
        "[]",
        "null",
        r#"{"messages":"hi"}"#,
        r#"{"messages":[]}"#,
        r#"{"messages":[{"content":"no role"}]}"#,
        r#"{"messages":[{"role":"user","content":5}]}"#,
        r#"{"messages":[{"role":"user","content":[{"text":"no type"}]}]}"#,
        r#"{"messages":[{"role":"user","content":"x"}],"stream":"yes"}"#,
        r#"{"messages":[{"role":"user","content":"x"}],"model":7}"#,
    ];
    for body in chat_cases {
        assert!(
            matches!(chat(body), Err(Error::InvalidRequest(_))),
            "{body:?}"
        );
    }
    let completion_cases = [
        r#"{"prompt":5}"#,
        r#"{"prompt":[-1]}"#,
        r#"{"prompt":[1.5]}"#,
        r#"{"prompt":[99999999999]}"#,
        r#"{"prompt":{"a":1}}"#,
        r#"{"prompt":["a",1]}"#,
    ];
    for body in completion_cases {
        assert!(
            matches!(completion(body), Err(Error::InvalidRequest(_))),
            "{body:?}"
        );
    }
}

#[test]
fn missing_required_fields_are_named() {
    assert!(matches!(
        chat(r#"{"model":"m"}"#),
        Err(Error::MissingField("messages"))
    ));
    assert!(matches!(
        completion(r#"{"model":"m"}"#),
        Err(Error::MissingField("prompt"))
    ));
}

#[test]
fn deep_nesting_is_rejected_not_crashing() {
    let deep = format!(
        r#"{{"messages":{}1{}}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    assert!(chat(&deep).is_err());
}

#[test]
fn invalid_utf8_is_rejected() {
    let body = b"{\"prompt\":\"\xff\xfe\"}";
    assert!(RequestView::parse(Operation::Completions, body).is_err());
}

#[test]
fn other_operations_read_model_only() {
    let v = RequestView::parse(Operation::Other, br#"{"model":"e5","input":"hi"}"#).unwrap();
    assert_eq!(v.model.as_deref(), Some("e5"));
    assert_eq!(v.routing_text, None);
    let empty = RequestView::parse(Operation::Other, b"").unwrap();
    assert_eq!(empty.model, None);
    assert!(RequestView::parse(Operation::Other, b"{oops").is_err());
}

#[test]
fn json_depth_counts_outside_strings() {
    assert_eq!(json_depth(b"{}"), 1);
    assert_eq!(json_depth(br#"{"a":[{"b":[1]}]}"#), 4);
    assert_eq!(json_depth(br#"{"a":"[[[[{{{{"}"#), 1);
    assert_eq!(json_depth(br#"{"a":"\"[[["}"#), 1);
    assert_eq!(json_depth(b"plain"), 0);
    assert_eq!(json_depth(&b"[".repeat(1000)), 1000);
}
