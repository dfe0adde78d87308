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

/// A hostile alphabet for the differential tests: every class GPT-2's pattern tells apart,
/// the characters its rules turn on (U+0020 against other spaces, the apostrophe and the
/// contraction letters), non-ASCII letters, numbers, spaces and marks, and the fixture's added
/// tokens whole and broken.
const ALPHABET: &[&str] = &[
    "a", "b", "s", "t", "re", "ve", "ll", "m", "d", "Z", "0", "7", " ", " ", "  ", "\n", "\t",
    "\r\n", "\u{b}", "\u{c}", "\u{1c}", "\u{85}", "\u{a0}", "\u{2028}", "\u{3000}", "'", "'", "!",
    "?", ".", ",", "-", "_", "\"", "é", "ß", "中文", "٣", "Ⅻ", "½", "\u{301}", "🙂", "\u{200d}",
    "\u{fe0f}", "ǅ", "ſ", "\u{212a}", "S", "T", "RE", "Ve", "lL", "D", "\r", "123", "45678",
    "e\u{301}", "Å", "<|user|>", "<|end|>", "<s>", "</s>", "<|", "|>", "<", "\0", "\u{7f}",
];

/// Deterministic random strings over [`ALPHABET`] (xorshift; 1..=40 symbols each).
fn hostile_strings(n: usize, mut seed: u64) -> Vec<String> {
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    (0..n)
        .map(|_| {
            let len = 1 + (next() % 40) as usize;
            (0..len)
                .map(|_| ALPHABET[(next() % ALPHABET.len() as u64) as usize])
                .collect()
        })
        .collect()
}

/// The direct encoder's pre-tokens are the regex engine's matches of each pattern, on random
/// text from the hostile alphabet (the fixture's small vocabulary hides many split errors in
/// the ids, so the splits are compared themselves).
#[test]
fn pre_tokens_are_the_regex_engine_s_matches() {
    let texts = hostile_strings(10_000, 0x2545_F491_4F6C_DD1D);
    for (pattern, digits) in byte_level::PATTERNS {
        let re = tokenizers::utils::SysRegex::new(pattern).unwrap();
        for text in &texts {
            let want: Vec<&str> = re.find_iter(text).map(|(s, e)| &text[s..e]).collect();
            assert_eq!(
                byte_level::pre_tokens(text, digits),
                want,
                "pattern {pattern}, text {text:?}"
            );
        }
    }
}

/// GPT-2's pattern lives inside `tokenizers` (`ByteLevel` with `use_regex`), not in a
/// tokenizer.json: compare the scanner with that pre-tokenizer itself, so a change of the
/// crate's pattern would show.
#[test]
fn gpt2_pre_tokens_are_byte_level_s_own_splits() {
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
    let byte_level = tokenizers::pre_tokenizers::byte_level::ByteLevel::new(false, true, true);
    for text in hostile_strings(3_000, 0x5851_F42D_4C95_7F2D) {
        let mut pre = PreTokenizedString::from(text.as_str());
        byte_level.pre_tokenize(&mut pre).unwrap();
        let want: Vec<&str> = pre
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(_, (s, e), _)| &text[s..e])
            .collect();
        assert_eq!(byte_level::pre_tokens(&text, None), want, "{text:?}");
    }
}

/// `encode` (the direct encoder) and `tokenizers`' pipeline agree on every text, with and
/// without special tokens.
fn assert_same_ids(tok: &HfTokenizer, texts: &[String], tag: &str) {
    for text in texts {
        for special in [false, true] {
            assert_eq!(
                tok.encode(text, special).unwrap(),
                tok.encode_reference(text, special).unwrap(),
                "{tag}: {text:?}, add_special_tokens {special}"
            );
        }
    }
}

#[test]
fn the_direct_encoder_gives_the_ids_of_tokenizers_own_pipeline() {
    let tok = tiny();
    assert!(tok.is_direct(), "the fixture is a byte-level BPE tokenizer");
    let mut texts = hostile_strings(5_000, 0x9E37_79B9_7F4A_7C15);
    texts.push(String::new());
    texts.push(std::fs::read_to_string(fixture_dir().join("chat_template.jinja")).unwrap());
    texts.push(std::fs::read_to_string(fixture_dir().join("../tiny-llama-golden.json")).unwrap());
    assert_same_ids(&tok, &texts, "fixture");
}

/// The fixture's tokenizer.json with `edit` applied, in a temp model directory.
fn with_tokenizer_edit(tag: &str, edit: impl FnOnce(&mut serde_json::Value)) -> HfTokenizer {
    let dir = std::env::temp_dir().join(format!("hf-tokenize-edit-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture_dir().join("tokenizer.json")).unwrap(),
    )
    .unwrap();
    edit(&mut json);
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    std::fs::copy(
        fixture_dir().join("tokenizer_config.json"),
        dir.join("tokenizer_config.json"),
    )
    .unwrap();
    let t = HfTokenizer::from_dir(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
    t.unwrap()
}

const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The fixture's vocabulary under Llama 3's and Qwen2's pre-tokenizers (Qwen2's with its NFC
/// normalizer): the direct encoder's split must be theirs.
#[test]
fn llama3_and_qwen2_patterns_give_the_ids_of_tokenizers_own_pipeline() {
    let llama3 = LLAMA3;
    let qwen2 = llama3.replace(r"\p{N}{1,3}", r"\p{N}");
    for (tag, pattern, normalizer) in [
        ("llama3", llama3.to_owned(), serde_json::Value::Null),
        ("qwen2", qwen2, serde_json::json!({"type": "NFC"})),
    ] {
        let tok = with_tokenizer_edit(tag, |j| {
            j["normalizer"] = normalizer;
            // A normalized added token, matched after NFC ("Å" composed, "e\u{301}" → "é").
            j["added_tokens"]
                .as_array_mut()
                .unwrap()
                .push(serde_json::json!({"id": 2048,
                "content": "éa", "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": true, "special": false}));
            j["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
                 "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                 "use_regex": false}]});
        });
        assert!(tok.is_direct(), "{tag}");
        let mut texts = hostile_strings(5_000, 0xD1B5_4A32_D192_ED03);
        texts.push(std::fs::read_to_string(fixture_dir().join("chat_template.jinja")).unwrap());
        texts.extend(["e\u{301}a x éa".into(), "Åéa<|end|>e\u{301}".into()]);
        assert_same_ids(&tok, &texts, tag);
    }
}

#[test]
fn normalized_added_tokens_are_matched_inside_the_raw_pieces() {
    // Two added tokens matched on the normalized text (no normalizer: the same text), one of
    // them overlapping a raw one, so the order of the two scans shows.
    let tok = with_tokenizer_edit("normalized", |j| {
        let added = j["added_tokens"].as_array_mut().unwrap();
        for (id, content) in [(2048, "hello"), (2049, "end|>x")] {
            added.push(
                serde_json::json!({"id": id, "content": content, "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": true, "special": false}),
            );
        }
    });
    assert!(tok.is_direct());
    let mut texts = hostile_strings(2_000, 7);
    texts.extend(["hello<|end|>x hellohello".into(), "<|end|>xhello".into()]);
    for text in texts.iter().map(|t| t.replace('b', "hello")) {
        assert_eq!(
            tok.encode(&text, false).unwrap(),
            tok.encode_reference(&text, false).unwrap(),
            "{text:?}"
        );
    }
}

#[test]
fn other_shapes_keep_tokenizers_pipeline() {
    let lower = with_tokenizer_edit("lowercase", |j| {
        j["normalizer"] = serde_json::json!({"type": "Lowercase"});
    });
    let prefix = with_tokenizer_edit("prefix-space", |j| {
        j["pre_tokenizer"]["add_prefix_space"] = true.into();
    });
    let lstrip = with_tokenizer_edit("lstrip", |j| {
        j["added_tokens"][6]["lstrip"] = true.into();
    });
    // `Sequence[Split(pattern, Isolated, invert), <middle>..., ByteLevel(use_regex: false)]`.
    let split_seq = |tag: &str, pattern: &str, invert: bool, middle: Vec<serde_json::Value>| {
        let mut steps = vec![
            serde_json::json!({"type": "Split", "pattern": {"Regex": pattern},
            "behavior": "Isolated", "invert": invert}),
        ];
        steps.extend(middle);
        steps.push(
            serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
            "trim_offsets": true, "use_regex": false}),
        );
        with_tokenizer_edit(tag, |j| {
            j["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": steps});
        })
    };
    let other_split = split_seq("other-split", r"\p{L}+|\s+|.", false, Vec::new());
    let inverted = split_seq("inverted", LLAMA3, true, Vec::new());
    let digits = serde_json::json!({"type": "Digits", "individual_digits": true});
    let three = split_seq("three", LLAMA3, false, vec![digits]);
    let dropout = with_tokenizer_edit("dropout", |j| {
        j["model"]["dropout"] = 0.5.into();
    });
    let duplicate = with_tokenizer_edit("duplicate", |j| {
        let added = j["added_tokens"].as_array_mut().unwrap();
        added.push(
            serde_json::json!({"id": 2048, "content": "<|end|>", "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": true, "special": false}),
        );
    });
    assert!(!dropout.is_direct() && !duplicate.is_direct());
    for tok in [
        &lower,
        &prefix,
        &lstrip,
        &other_split,
        &inverted,
        &three,
        &duplicate,
    ] {
        assert!(!tok.is_direct());
        assert_eq!(
            tok.encode("Hello <|end|> World", false).unwrap(),
            tok.encode_reference("Hello <|end|> World", false).unwrap()
        );
    }
}
