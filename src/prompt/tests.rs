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
fn chat_string_content_with_and_without_escapes() {
    // A plain string is taken between its quotes; one with escapes is decoded.
    let v = chat(
        r#"{"messages":[{"role":"user","content":"plain text"},
            {"role":"user","content":"a\nb \"q\" \u00e9"},{"role":"user","content":""}]}"#,
    )
    .unwrap();
    assert_eq!(
        v.routing_text.as_deref(),
        Some("user\nplain text\n\nuser\na\nb \"q\" \u{e9}\n\nuser\n\n\n")
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
            matches!(
                chat(body),
                Err(Error::InvalidRequest(_) | Error::InvalidParam { .. })
            ),
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
            matches!(
                completion(body),
                Err(Error::InvalidRequest(_) | Error::InvalidParam { .. })
            ),
            "{body:?}"
        );
    }
}

/// The `param` of an `InvalidParam` error, or a description of what came instead.
fn param_of(result: Result<RequestView, Error>) -> String {
    match result {
        Err(Error::InvalidParam { param, .. }) => param,
        other => format!("not an InvalidParam: {other:?}"),
    }
}

#[test]
fn bad_prompt_shapes_are_typed_errors_on_prompt() {
    for body in [
        r#"{"prompt":5}"#,
        r#"{"prompt":true}"#,
        r#"{"prompt":null}"#,
        r#"{"prompt":[-1]}"#,
        r#"{"prompt":[1.5]}"#,
        r#"{"prompt":[99999999999]}"#,
        r#"{"prompt":{"a":[1,2]}}"#,
        r#"{"prompt":["a",1]}"#,
        r#"{"prompt":[1,"a"]}"#,
        r#"{"prompt":[[1],2]}"#,
        r#"{"prompt":[[1,-2],[3]]}"#,
        r#"{"prompt":[[1,[2]]]}"#,
        r#"{"prompt":[null]}"#,
    ] {
        let got = param_of(completion(body));
        // `null` is an absent prompt.
        let want = if body.contains("null}") {
            "not an InvalidParam: Err(MissingField(\"prompt\"))"
        } else {
            "prompt"
        };
        assert_eq!(got, want, "{body}");
    }
    // A shape error stops the parse, the rest of the body is still read as JSON.
    assert!(matches!(
        completion(r#"{"prompt":["a",1],"model":"m""#),
        Err(Error::InvalidRequest(_))
    ));
}

#[test]
fn content_parts_of_known_types_need_their_payload() {
    let cases = [
        (r#"{"type":"text"}"#, "messages[0].content[1].text"),
        (
            r#"{"type":"text","text":null}"#,
            "messages[0].content[1].text",
        ),
        (r#"{"type":"input_text"}"#, "messages[0].content[1].text"),
        (
            r#"{"type":"image_url"}"#,
            "messages[0].content[1].image_url",
        ),
        (
            r#"{"type":"image_url","image_url":{}}"#,
            "messages[0].content[1].image_url",
        ),
        (
            r#"{"type":"image_url","image_url":{"url":7}}"#,
            "messages[0].content[1].image_url",
        ),
        (
            r#"{"type":"image_url","image_url":"https://x/a.png"}"#,
            "messages[0].content[1].image_url",
        ),
        (
            r#"{"type":"input_audio","input_audio":{"format":"wav"}}"#,
            "messages[0].content[1].input_audio",
        ),
        (
            r#"{"type":"video_url","video_url":{"detail":"low"}}"#,
            "messages[0].content[1].video_url",
        ),
        (
            r#"{"type":"audio_url"}"#,
            "messages[0].content[1].audio_url",
        ),
    ];
    for (part, param) in cases {
        let body = format!(
            r#"{{"messages":[{{"role":"user","content":[{{"type":"text","text":"ok"}},{part}]}}]}}"#
        );
        assert_eq!(param_of(chat(&body)), param, "{part}");
    }
    // Complete parts, and parts of types the router does not know, pass.
    for part in [
        r#"{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA","detail":"low"}}"#,
        r#"{"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}}"#,
        r#"{"type":"video_url","video_url":{"url":"https://x/v.mp4"}}"#,
        r#"{"type":"image_embeds","image_embeds":"AAAA"}"#,
    ] {
        let body = format!(r#"{{"messages":[{{"role":"user","content":[{part}]}}]}}"#);
        assert!(chat(&body).is_ok(), "{part}");
    }
}

#[test]
fn sampling_numbers_out_of_range_name_the_field() {
    let m = r#""messages":[{"role":"user","content":"x"}]"#;
    for (field, bad, good) in [
        ("temperature", "-0.1", "1.5"),
        ("top_p", "0", "1"),
        ("top_p", "1.01", "0.5"),
        ("top_k", "-2", "-1"),
        ("top_k", "2.5", "40"),
        ("min_p", "1.5", "0.1"),
        ("presence_penalty", "2.5", "-2"),
        ("frequency_penalty", "-3", "2"),
        ("repetition_penalty", "0", "1.1"),
        ("max_tokens", "-1", "16"),
        ("max_tokens", "1.5", "16.0"),
        ("max_completion_tokens", "-5", "0"),
        ("n", "0", "2"),
    ] {
        let body = format!(r#"{{{m},"{field}":{bad}}}"#);
        assert_eq!(param_of(chat(&body)), field, "{body}");
        let body = format!(r#"{{{m},"{field}":{good}}}"#);
        assert!(chat(&body).is_ok(), "{body}");
        let body = format!(r#"{{{m},"{field}":null}}"#);
        assert!(chat(&body).is_ok(), "{body}");
        if field != "max_completion_tokens" {
            let body = format!(r#"{{"prompt":"p","{field}":{bad}}}"#);
            assert_eq!(param_of(completion(&body)), field, "{body}");
        }
    }
    // Too large for a number at all, or of the wrong type: a JSON error, still a 400.
    for bad in ["1e999", "\"hot\"", "[1]"] {
        let body = format!(r#"{{{m},"temperature":{bad}}}"#);
        assert!(
            matches!(chat(&body), Err(Error::InvalidRequest(_))),
            "{body}"
        );
    }
}

#[test]
fn message_count_is_limited() {
    let body = |n: usize| {
        let one = r#"{"role":"user","content":"x"}"#;
        format!(r#"{{"messages":[{}]}}"#, vec![one; n].join(","))
    };
    let limits = ParseLimits { max_messages: 3 };
    let parse =
        |b: &str| RequestView::parse_with(Operation::ChatCompletions, b.as_bytes(), &limits);
    assert!(parse(&body(3)).is_ok());
    assert_eq!(param_of(parse(&body(4))), "messages");
    // Past the hard ceiling nothing more is held; the count is still exact in the message.
    let limits = ParseLimits {
        max_messages: MAX_MESSAGES_CEILING,
    };
    let huge = body(MAX_MESSAGES_CEILING + 2);
    match RequestView::parse_with(Operation::ChatCompletions, huge.as_bytes(), &limits) {
        Err(Error::InvalidParam { message, .. }) => {
            assert!(
                message.contains(&(MAX_MESSAGES_CEILING + 2).to_string()),
                "{message}"
            )
        }
        other => panic!("{other:?}"),
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
    // In a field the router skips too: the whole body is held to UTF-8.
    let skipped = b"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"x\":\"\xff\"}";
    for op in [Operation::ChatCompletions, Operation::Other] {
        let err = RequestView::parse(op, skipped).unwrap_err();
        assert!(err.to_string().contains("UTF-8"), "{op:?}: {err}");
    }
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
fn deeper_than_counts_brackets_first_then_scans() {
    // Few brackets in all: not deeper, without a scan.
    assert!(!deeper_than(br#"{"a":[{"b":[1]}]}"#, 4));
    assert!(deeper_than(br#"{"a":[{"b":[1]}]}"#, 3));
    // Many brackets, but inside strings: the scan says not deeper.
    assert!(!deeper_than(br#"{"a":"[[[[{{{{[[[[{{{{"}"#, 2));
    assert!(deeper_than(&b"[".repeat(65), 64));
    assert!(!deeper_than(&b"[".repeat(64), 64));
}

#[test]
fn json_depth_counts_outside_strings() {
    assert_eq!(json_depth(b"{}"), 1);
    assert_eq!(json_depth(br#"{"a":[{"b":[1]}]}"#), 4);
    assert_eq!(json_depth(br#"{"a":"[[[[{{{{"}"#), 1);
    assert_eq!(json_depth(br#"{"a":"\"[[["}"#), 1);
    assert_eq!(json_depth(b"plain"), 0);
    assert_eq!(json_depth(&b"[".repeat(1000)), 1000);
    // An escaped backslash ends right before the closing quote; brackets after it count.
    assert_eq!(json_depth(br#"{"a":"x\\","b":[[1]]}"#), 3);
    assert_eq!(json_depth(br#"{"a":"[[["#), 1, "unterminated string");
    assert_eq!(json_depth(b"{\"a\":\"\\"), 1, "ends on a backslash");
}

/// The skipping scan agrees with a byte-by-byte one on random mixes of the bytes that matter.
#[test]
fn json_depth_matches_a_byte_by_byte_scan() {
    fn reference(body: &[u8]) -> usize {
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
    let alphabet = b"[]{}\"\\ax";
    let mut rng = fastrand::Rng::with_seed(27);
    for _ in 0..20_000 {
        let len = rng.usize(0..40);
        let body: Vec<u8> = (0..len)
            .map(|_| alphabet[rng.usize(..alphabet.len())])
            .collect();
        assert_eq!(
            json_depth(&body),
            reference(&body),
            "{:?}",
            String::from_utf8_lossy(&body)
        );
    }
}

#[test]
fn notes_a_top_level_kv_transfer_params_whatever_its_value() {
    let cases = [
        (
            Operation::ChatCompletions,
            r#"{"messages":[{"role":"user","content":"x"}],"kv_transfer_params":null}"#,
            true,
        ),
        (
            Operation::ChatCompletions,
            r#"{"messages":[{"role":"user","content":"x","kv_transfer_params":{}}]}"#,
            false,
        ),
        (
            Operation::Completions,
            r#"{"prompt":"x","kv_transfer_param\u0073":{"remote_host":"h"}}"#,
            true,
        ),
        (Operation::Completions, r#"{"prompt":"x"}"#, false),
        (
            Operation::Other,
            r#"{"input":"x","kv_transfer_params":[]}"#,
            true,
        ),
        (
            Operation::Other,
            r#"{"input":{"kv_transfer_params":1}}"#,
            false,
        ),
        (Operation::Other, "", false),
    ];
    for (op, body, present) in cases {
        let view = RequestView::parse(op, body.as_bytes()).unwrap();
        assert_eq!(view.kv_transfer_params, present, "{body}");
    }
}
