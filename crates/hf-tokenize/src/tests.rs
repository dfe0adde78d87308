//! Unit tests against the committed tiny-llama tokenizer (`tests/fixtures/tiny-llama`) and
//! golden ids from transformers (`tests/fixtures/tiny-llama-golden.json`, made by
//! `bench/tokenizer_golden.py`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use super::*;
use crate::chat::ContentFormat;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama")
}

fn tiny() -> HfTokenizer {
    HfTokenizer::from_dir(&fixture_dir()).unwrap()
}

/// A model directory in a temp dir: the fixture's tokenizer with another chat template.
fn with_template(tag: &str, template: &str) -> HfTokenizer {
    let dir = std::env::temp_dir().join(format!("hf-tokenize-test-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture_dir().join(f), dir.join(f)).unwrap();
    }
    std::fs::write(dir.join("chat_template.jinja"), template).unwrap();
    let t = HfTokenizer::from_dir(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
    t.unwrap()
}

fn render(tok: &HfTokenizer, body: serde_json::Value) -> Result<String, TokenizeError> {
    tok.render_chat(&ChatRequest::from_body(body.to_string().as_bytes())?)
}

#[test]
fn golden_ids_from_transformers() {
    let tok = tiny();
    let golden: Vec<serde_json::Value> = serde_json::from_str(
        &std::fs::read_to_string(fixture_dir().join("../tiny-llama-golden.json")).unwrap(),
    )
    .unwrap();
    assert!(golden.len() >= 10);
    for case in golden {
        let body = case["body"].to_string();
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let got = match case["kind"].as_str().unwrap() {
            "chat" => {
                let text = tok
                    .render_chat(&ChatRequest::from_body(body.as_bytes()).unwrap())
                    .unwrap();
                assert_eq!(text, case["text"].as_str().unwrap(), "{}", case["name"]);
                tok.chat_ids(body.as_bytes()).unwrap()
            }
            _ => tok.completion_ids(body.as_bytes()).unwrap(),
        };
        assert_eq!(got, want, "case {}", case["name"]);
    }
}

#[test]
fn list_of_parts_joined_with_newline_for_string_templates() {
    let tok = tiny();
    let parts = serde_json::json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "first"}, {"type": "text", "text": "second"}, "third"]}]});
    let joined =
        serde_json::json!({"messages": [{"role": "user", "content": "first\nsecond\nthird"}]});
    assert_eq!(render(&tok, parts).unwrap(), render(&tok, joined).unwrap());
}

#[test]
fn openai_format_templates_get_the_parts() {
    let tpl = "{% for m in messages %}[{{ m.role }}]{% for p in m['content'] %}({{ p.type }}:{{ p.text }}){% endfor %}{% endfor %}";
    let tok = with_template("openai", tpl);
    assert_eq!(
        tok.templates().content_format(false).unwrap(),
        ContentFormat::OpenAi
    );
    let out = render(
        &tok,
        serde_json::json!({"messages": [{"role": "user", "content": "plain"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]}]}),
    )
    .unwrap();
    assert_eq!(out, "[user](text:plain)[user](text:a)(text:b)");
}

#[test]
fn non_text_parts_are_unsupported() {
    let tok = tiny();
    let body = serde_json::json!({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:x"}}]}]});
    assert!(matches!(
        render(&tok, body),
        Err(TokenizeError::Unsupported(_))
    ));
}

#[test]
fn tools_reach_the_template_as_vllm_dumps_them() {
    let tpl = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}";
    let tok = with_template("tools", tpl);
    // Raw text: `serde_json::json!` would sort the keys; the request's order must survive.
    let body = r#"{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "get", "parameters": {"type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {"type": "integer"}}}}}]}"#;
    let req = ChatRequest::from_body(body.as_bytes()).unwrap();
    // json.dumps spacing, request key order (zeta before alpha), description: None as null.
    assert_eq!(
        tok.render_chat(&req).unwrap(),
        r#"[{"type": "function", "function": {"name": "get", "description": null, "parameters": {"type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {"type": "integer"}}}}}]x"#
    );
}

#[test]
fn tojson_indent_and_non_ascii() {
    let tok = with_template("tojson", "{{ messages[0] | tojson(indent=2) }}");
    let out = render(
        &tok,
        serde_json::json!({"messages": [{"role": "user", "content": "é\n"}]}),
    )
    .unwrap();
    assert_eq!(out, "{\n  \"role\": \"user\",\n  \"content\": \"é\\n\"\n}");
}

#[test]
fn assistant_tool_call_arguments_become_a_mapping() {
    let tpl = "{% for m in messages %}{% for c in m.tool_calls %}{{ c.function.arguments.city }}|{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}";
    let tok = with_template("calls", tpl);
    let body = serde_json::json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "w", "arguments": "{\"city\": \"Oslo\"}"}},
        {"id": "2", "type": "function", "function": {"name": "w", "arguments": "not json"}}]}]});
    assert_eq!(render(&tok, body).unwrap(), "Oslo|{\"city\": \"Oslo\"}|{}");
}

#[test]
fn generation_prompt_and_continue_final_message() {
    let tok = tiny();
    let msgs = serde_json::json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the answer"}]);
    assert_eq!(
        render(&tok, serde_json::json!({"messages": msgs, "add_generation_prompt": false, "continue_final_message": true})).unwrap(),
        "<|user|>hi<|end|><|assistant|>the answer"
    );
    assert!(matches!(
        render(
            &tok,
            serde_json::json!({"messages": msgs, "continue_final_message": true})
        ),
        Err(TokenizeError::InvalidRequest(_))
    ));
    assert!(render(&tok, serde_json::json!({"messages": msgs}))
        .unwrap()
        .ends_with("<|end|><|assistant|>"));
}

#[test]
fn special_tokens_kwargs_and_builtins_are_variables() {
    let tpl = "{{ bos_token }}{{ eos_token }}|{{ flavour }}|{{ messages[0].content.strip().upper() }}|{{ strftime_now('%Y') | length }}";
    let tok = with_template("vars", tpl);
    let out = render(
        &tok,
        serde_json::json!({"messages": [{"role": "user", "content": "  hey "}], "chat_template_kwargs": {"flavour": "mint"}}),
    )
    .unwrap();
    assert_eq!(out, "<s></s>|mint|HEY|4");
}

#[test]
fn raise_exception_is_a_template_error_with_its_message() {
    let tok = with_template("raise", "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok");
    match render(
        &tok,
        serde_json::json!({"messages": [{"role": "system", "content": "x"}]}),
    ) {
        Err(TokenizeError::Template(m)) => assert!(m.contains("first must be user"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn broken_template_fails_to_load() {
    let dir = std::env::temp_dir().join(format!("hf-tokenize-broken-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture_dir().join(f), dir.join(f)).unwrap();
    }
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{% for m in messages %}{{ m.content }",
    )
    .unwrap();
    let err = HfTokenizer::from_dir(&dir).unwrap_err();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(matches!(err, LoadError::Template { .. }), "{err}");
}

#[test]
fn missing_dir_is_an_io_error() {
    let err = HfTokenizer::from_dir(std::path::Path::new("/nonexistent/model")).unwrap_err();
    assert!(
        matches!(err, LoadError::Tokenizer { .. } | LoadError::Io { .. }),
        "{err}"
    );
}

#[test]
fn developer_role_becomes_system_when_the_template_lacks_it() {
    let tok = tiny();
    let out = render(
        &tok,
        serde_json::json!({"messages": [{"role": "user", "content": "u"}, {"role": "developer", "content": "d"}]}),
    )
    .unwrap();
    assert_eq!(out, "<|system|>d<|end|><|user|>u<|end|><|assistant|>");
}

#[test]
fn safe_cuts_concatenate_to_the_whole() {
    let tok = tiny();
    let texts = [
        "<|system|>You are a helpful model. the cache<|end|><|user|>hello world<|end|><|assistant|>",
        "<|user|>  spaces  <|end|>\n\n<|assistant|> leading space<|end|>x",
        "no specials at all, only text",
        "<|end|><|end|>a<s>b</s>c<|user|>",
        "héllo<|end|>wörld<|end|> 日本語",
    ];
    let mut checked = 0;
    for text in texts {
        let whole = tok.encode(text, false).unwrap();
        let cuts = tok.safe_cuts(text).unwrap();
        for &c in &cuts {
            let mut joined = tok.encode(&text[..c], false).unwrap();
            joined.extend(tok.encode(&text[c..], false).unwrap());
            assert_eq!(joined, whole, "cut at {c} of {text:?}");
            checked += 1;
        }
    }
    assert!(checked >= 10, "{checked}");
    // A cut inside plain text is not offered, and would not be safe: BPE merges cross it.
    let text = "the model cache prefix";
    assert!(tok.safe_cuts(text).unwrap().is_empty());
    let mut joined = tok.encode(&text[..6], false).unwrap();
    joined.extend(tok.encode(&text[6..], false).unwrap());
    assert_ne!(joined, tok.encode(text, false).unwrap());
}

#[test]
fn strftime_formats_a_known_instant() {
    // 2026-12-01 13:05:09 UTC, a Tuesday, day 335 of the year.
    let t = 1_796_130_309;
    assert_eq!(
        template::strftime("%Y-%m-%d %H:%M:%S %A %a %B %b %j %-d %%", t),
        "2026-12-01 13:05:09 Tuesday Tue December Dec 335 1 %"
    );
}

#[test]
fn content_format_detection() {
    use template::detect_content_format as d;
    assert_eq!(d("{{ m['content'] }}"), ContentFormat::String);
    assert_eq!(
        d("{%- for c in message['content'] -%}{{ c.text }}{% endfor %}"),
        ContentFormat::OpenAi
    );
    assert_eq!(
        d("{% for c in message.content | selectattr('type') %}{% endfor %}"),
        ContentFormat::OpenAi
    );
    assert_eq!(
        d("{% for m in messages %}{{ m.content }}{% endfor %}"),
        ContentFormat::String
    );
}
