//! Chat templates: compiled once per model, rendered per request as transformers'
//! `apply_chat_template` renders them (Jinja2 sandbox with `trim_blocks`, `lstrip_blocks`,
//! loop controls; `tojson` as Python's `json.dumps`; `raise_exception`; `strftime_now`).

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind};

use crate::chat::{ChatRequest, ContentFormat};
use crate::{HfTokenizer, LoadError, TokenizeError};

/// Work bound for one render (minijinja "fuel": roughly one unit per instruction). A chat
/// template does a few dozen instructions per message; the body limit bounds the messages, so
/// this only stops a template that loops far beyond its input.
const FUEL_PER_RENDER: u64 = 50_000_000;

/// What vLLM appends to the final message for `continue_final_message` (transformers' tag).
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// A model's chat templates: one default, or named ones (`default`, `tool_use`, …).
pub struct Templates {
    env: Environment<'static>,
    entries: Vec<Entry>,
}

struct Entry {
    name: String,
    format: ContentFormat,
    /// The template names the `developer` role (else vLLM turns developer messages into system).
    developer: bool,
    /// The template mentions `content` (needed by `continue_final_message`).
    mentions_content: bool,
}

impl Templates {
    /// No template (completions only).
    pub fn empty() -> Templates {
        Templates {
            env: environment(),
            entries: Vec::new(),
        }
    }

    /// `(name, source)` pairs; the first one named `default` (or the only one) is the default.
    pub fn new(sources: Vec<(String, String)>) -> Result<Templates, LoadError> {
        let mut t = Templates::empty();
        for (name, source) in sources {
            let format = detect_content_format(&source);
            let developer = source.contains("\"developer\"") || source.contains("'developer'");
            let mentions_content = source.contains("content");
            t.env
                .add_template_owned(name.clone(), source)
                .map_err(|e| LoadError::Template {
                    name: name.clone(),
                    message: e.to_string(),
                })?;
            t.entries.push(Entry {
                name,
                format,
                developer,
                mentions_content,
            });
        }
        Ok(t)
    }

    /// The template(s) in `tokenizer_config.json`'s `chat_template`: a string, or a list of
    /// `{"name", "template"}`.
    pub fn from_config(v: Option<&serde_json::Value>) -> Result<Vec<(String, String)>, String> {
        match v {
            None | Some(serde_json::Value::Null) => Ok(Vec::new()),
            Some(serde_json::Value::String(s)) => Ok(vec![("default".to_owned(), s.clone())]),
            Some(serde_json::Value::Array(items)) => items
                .iter()
                .map(|item| {
                    let name = item.get("name").and_then(|v| v.as_str());
                    let source = item.get("template").and_then(|v| v.as_str());
                    match (name, source) {
                        (Some(n), Some(s)) => Ok((n.to_owned(), s.to_owned())),
                        _ => {
                            Err("chat_template list entries need \"name\" and \"template\"".into())
                        }
                    }
                })
                .collect(),
            Some(_) => Err("chat_template must be a string or a list of named templates".into()),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn names(&self) -> Vec<&str> {
        self.entries.iter().map(|e| e.name.as_str()).collect()
    }

    /// transformers' `get_chat_template`: a single template; or `tool_use` when tools are
    /// given and it exists, else `default`.
    fn pick(&self, has_tools: bool) -> Result<&Entry, TokenizeError> {
        match self.entries.as_slice() {
            [] => Err(TokenizeError::NoChatTemplate),
            [only] => Ok(only),
            many => {
                let by_name = |n: &str| many.iter().find(|e| e.name == n);
                has_tools
                    .then(|| by_name("tool_use"))
                    .flatten()
                    .or_else(|| by_name("default"))
                    .ok_or(TokenizeError::Template(
                        "several chat templates and none named \"default\"".into(),
                    ))
            }
        }
    }

    /// The content format vLLM detects for the template a request would use.
    pub fn content_format(&self, has_tools: bool) -> Result<ContentFormat, TokenizeError> {
        Ok(self.pick(has_tools)?.format)
    }
}

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_fuel(Some(FUEL_PER_RENDER));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn strftime_now(format: String) -> Result<String, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(strftime(&format, secs))
}

/// Python's `datetime.now().strftime(fmt)` for a UTC clock (the servers run in UTC), with the
/// directives chat templates use (dates for "Today is …" system prompts).
pub fn strftime(fmt: &str, unix_secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_secs / 86_400;
    let rem = unix_secs % 86_400;
    let (hour, minute, second) = (rem / 3600, (rem % 3600) / 60, rem % 60);
    // Civil-from-days (Howard Hinnant's algorithm), for days since 1970-01-01.
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    let weekday = ((days + 3) % 7) as usize; // 1970-01-01 was a Thursday (index 3).
    let is_leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let m_idx = (month as usize).saturating_sub(1).min(11);
    let yday = cum[m_idx] + day + u64::from(is_leap && month > 2);
    let month_name = MONTHS[m_idx];
    let day_name = DAYS[weekday];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('-') => match chars.next() {
                Some('d') => out.push_str(&day.to_string()),
                Some('m') => out.push_str(&month.to_string()),
                Some(o) => {
                    out.push_str("%-");
                    out.push(o);
                }
                None => out.push_str("%-"),
            },
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('B') => out.push_str(month_name),
            Some('b') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(day_name),
            Some('a') => out.push_str(&day_name[..3]),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, with those keyword arguments honoured.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_owned()),
            None => {
                let n = i64::try_from(v.clone()).map_err(|_| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be a number",
                    )
                })?;
                Some(" ".repeat(usize::try_from(n.clamp(0, 64)).unwrap_or(0)))
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(v) if !v.is_none() => {
            let a = v.get_item(&Value::from(0))?;
            let b = v.get_item(&Value::from(1))?;
            (
                a.as_str().unwrap_or(", ").to_owned(),
                b.as_str().unwrap_or(": ").to_owned(),
            )
        }
        // Python: separators default to (', ', ': '), or (',', ': ') when indent is given.
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let opts = JsonOpts {
        indent,
        item_sep,
        key_sep,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(value, &opts, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct JsonOpts {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

/// Nesting bound for `tojson` (Python's own recursion limit is ~1000; request bodies are
/// depth-checked before they get here).
const MAX_JSON_DEPTH: usize = 256;

fn write_json(v: &Value, o: &JsonOpts, depth: usize, out: &mut String) -> Result<(), Error> {
    if depth > MAX_JSON_DEPTH {
        return Err(Error::new(ErrorKind::InvalidOperation, "tojson: too deep"));
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(ind) = &o.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&python_number(v)),
        ValueKind::String => write_json_str(v.as_str().unwrap_or(""), o.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, depth + 1);
                write_json(item, o, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if o.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, depth + 1);
                let key_text = match key.as_str() {
                    Some(s) => s.to_owned(),
                    None => key.to_string(),
                };
                write_json_str(&key_text, o.ensure_ascii, out);
                out.push_str(&o.key_sep);
                write_json(&v.get_item(key)?, o, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => write_json_str(&v.to_string(), o.ensure_ascii, out),
    }
    Ok(())
}

/// A number as Python prints it in JSON: integers as is, floats with `repr` (`1.0`, `0.5`,
/// `1e-05`, `1e+16`).
fn python_number(v: &Value) -> String {
    if let Ok(i) = i64::try_from(v.clone()) {
        if !v.to_string().contains('.') && !v.to_string().contains('e') {
            return i.to_string();
        }
    }
    let Ok(f) = f64::try_from(v.clone()) else {
        return v.to_string();
    };
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    // Rust's `{:?}` is the shortest round-trip like Python's repr; only the exponent
    // form differs (Python switches at 1e16 and below 1e-4, with a sign and two digits).
    let abs = f.abs();
    if abs != 0.0 && !(1e-4..1e16).contains(&abs) {
        let s = format!("{f:e}"); // e.g. "1e-5", "1.5e16"
        if let Some((mant, exp)) = s.split_once('e') {
            let (sign, digits) = match exp.strip_prefix('-') {
                Some(d) => ('-', d),
                None => ('+', exp),
            };
            return format!("{mant}e{sign}{digits:0>2}");
        }
        return s;
    }
    let s = format!("{f:?}");
    if s.contains('.') || s.contains('e') {
        s
    } else {
        format!("{s}.0")
    }
}

fn write_json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// vLLM's content-format detection (`_detect_content_format`), on the template's source: a
/// template that loops over a message's `content` (`{% for x in message['content'] %}`,
/// `message.content`, or a bare `content`) gets the OpenAI list-of-parts form; any other gets
/// the text parts joined with `"\n"`. vLLM walks the Jinja AST; this reads the `for` tags,
/// which is the same for the templates that matter (macro-parameter indirection is not
/// followed).
pub fn detect_content_format(source: &str) -> ContentFormat {
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let after = &rest[start + 2..];
        let end = after.find("%}").unwrap_or(after.len());
        let tag = after[..end].trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        if let Some(body) = tag.strip_prefix("for ") {
            if let Some((_, iter)) = body.split_once(" in ") {
                let iter = iter.split(" if ").next().unwrap_or("").trim();
                let iter = iter.split(" recursive").next().unwrap_or("").trim();
                let iter = iter.split('|').next().unwrap_or("").trim();
                if iter == "content"
                    || iter.ends_with("['content']")
                    || iter.ends_with("[\"content\"]")
                    || iter.ends_with(".content")
                {
                    return ContentFormat::OpenAi;
                }
            }
        }
        rest = &after[end..];
    }
    ContentFormat::String
}

/// Render `req` with the model's template, as vLLM 0.32 → transformers do.
pub fn render(tok: &HfTokenizer, req: &ChatRequest) -> Result<String, TokenizeError> {
    let templates = tok.templates();
    let entry = templates.pick(req.tools.is_some())?;
    let messages = req.conversation(entry.format, entry.developer)?;
    let mut messages: Vec<Value> = messages;
    if req.continue_final_message {
        if !entry.mentions_content {
            return Err(TokenizeError::Template(
                "continue_final_message is set but \"content\" is not an accepted field in the chat_template".into(),
            ));
        }
        let last = messages.pop().ok_or(TokenizeError::InvalidRequest(
            "messages must not be empty".into(),
        ))?;
        messages.push(crate::chat::tag_final_message(last, CONTINUE_TAG)?);
    }
    let tmpl = templates
        .env
        .get_template(&entry.name)
        .map_err(|e| TokenizeError::Template(e.to_string()))?;
    // Variables: special tokens, then the request's chat_template_kwargs (they override the
    // special tokens, as in transformers), then the named arguments.
    let mut ctx: Vec<(String, Value)> = tok
        .special_tokens()
        .iter()
        .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
        .collect();
    for (k, v) in &req.kwargs {
        ctx.retain(|(name, _)| name != k);
        ctx.push((k.clone(), v.clone()));
    }
    ctx.retain(|(name, _)| {
        !matches!(
            name.as_str(),
            "messages" | "tools" | "documents" | "add_generation_prompt"
        )
    });
    ctx.push(("messages".into(), Value::from(messages)));
    ctx.push((
        "tools".into(),
        req.tools
            .clone()
            .map(Value::from)
            .unwrap_or(Value::from(())),
    ));
    ctx.push((
        "documents".into(),
        req.documents.clone().unwrap_or(Value::from(())),
    ));
    ctx.push((
        "add_generation_prompt".into(),
        Value::from(req.add_generation_prompt),
    ));
    let rendered = tmpl
        .render(Value::from_iter(ctx))
        .map_err(|e| TokenizeError::Template(describe(&e)))?;
    if !req.continue_final_message {
        return Ok(rendered);
    }
    let tag = CONTINUE_TAG.trim();
    let Some(loc) = rendered.rfind(tag) else {
        return Err(TokenizeError::Template(
            "continue_final_message is set but the final message does not appear in the chat after applying the chat template".into(),
        ));
    };
    if rendered[loc..].starts_with(CONTINUE_TAG) {
        Ok(rendered[..loc].to_owned())
    } else {
        Ok(rendered[..loc].trim_end().to_owned())
    }
}

fn describe(e: &Error) -> String {
    // `raise_exception("…")` reaches the client as the template's own words, as in vLLM.
    match e.detail() {
        Some(d) if e.kind() == ErrorKind::InvalidOperation => d.to_owned(),
        _ => e.to_string(),
    }
}
