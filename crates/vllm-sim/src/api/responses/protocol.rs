//! Responses API shapes: the request body, vLLM's prompt construction, and the response
//! object and stream events as vLLM 0.32 writes them (field order included).
//!
//! Prompt construction is vLLM's `construct_input_messages` (`entrypoints/openai/responses/
//! utils.py`) for non-Harmony models: `instructions` as a system message first; then, with a
//! `previous_response_id`, the stored messages of that request minus its system messages and
//! the previous output texts as assistant messages; then the new input. The messages are then
//! rendered through the chat template exactly as a `/v1/chat/completions` request would be.
//!
//! Structs serialise in declaration order, which is vLLM's (pydantic's) order; ids are
//! `resp_`/`msg_` + 16 lowercase hex digits, as vLLM's `random_uuid()`.

use serde::{Deserialize, Serialize, Serializer};
use serde_json::Value;

use super::super::error::ApiError;
use crate::tokenizer::ChatMessage;

/// A `POST /v1/responses` body (the fields the simulator reads; others are ignored).
#[derive(Debug, Deserialize)]
pub struct ResponsesRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub input: Input,
    #[serde(default)]
    pub instructions: Option<String>,
    #[serde(default)]
    pub max_output_tokens: Option<u32>,
    #[serde(default)]
    pub stream: Option<bool>,
    /// Default true; forced false when the server has no store.
    #[serde(default)]
    pub store: Option<bool>,
    #[serde(default)]
    pub background: Option<bool>,
    #[serde(default)]
    pub previous_response_id: Option<String>,
    /// vLLM extra (Harmony history); only its clash with `previous_response_id` is checked.
    #[serde(default)]
    pub previous_input_messages: Option<Vec<Value>>,
    /// vLLM extra: the client chooses the response id (not checked, as vLLM).
    #[serde(default)]
    pub request_id: Option<String>,
    /// vLLM's prefix-cache isolation key.
    #[serde(default)]
    pub cache_salt: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Input {
    Text(String),
    Items(Vec<InputItem>),
}

#[derive(Debug, Deserialize)]
pub struct InputItem {
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub role: Option<String>,
    #[serde(default)]
    pub content: Option<ItemContent>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ItemContent {
    Text(String),
    Parts(Vec<InputPart>),
}

#[derive(Debug, Deserialize)]
pub struct InputPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

/// A new random id: `prefix` + 16 lowercase hex digits.
pub fn random_id(prefix: &str) -> String {
    format!("{prefix}{:016x}", fastrand::u64(..))
}

/// vLLM's `construct_input_messages`: the messages to render (see module doc).
pub fn construct_input_messages(
    instructions: Option<&str>,
    input: Input,
    prev_messages: Option<&[ChatMessage]>,
    prev_output: Option<&[OutputMessage]>,
) -> Result<Vec<ChatMessage>, ApiError> {
    let mut messages = Vec::new();
    if let Some(text) = instructions.filter(|t| !t.is_empty()) {
        messages.push(ChatMessage {
            role: "system".into(),
            content: text.into(),
        });
    }
    if let Some(prev) = prev_messages {
        messages.extend(prev.iter().filter(|m| m.role != "system").cloned());
    }
    for item in prev_output.unwrap_or_default() {
        for part in &item.content {
            messages.push(ChatMessage {
                role: "assistant".into(),
                content: part.text.clone(),
            });
        }
    }
    match input {
        Input::Text(text) => messages.push(ChatMessage {
            role: "user".into(),
            content: text,
        }),
        Input::Items(items) => {
            for item in items {
                messages.push(item_message(item)?);
            }
        }
    }
    Ok(messages)
}

/// One input item as a chat message: role items pass through; text parts are joined with
/// "\n" (the chat parser's "string" content format); an assistant's part list keeps its first
/// text (vLLM's validator turns it into a `ResponseOutputMessage`).
fn item_message(item: InputItem) -> Result<ChatMessage, ApiError> {
    let kind = item.kind.as_deref().unwrap_or("message");
    let (true, Some(role)) = (kind == "message", item.role) else {
        return Err(ApiError::bad_param(
            format!("Unsupported input item type: {kind}"),
            "input",
        ));
    };
    let content = match item.content {
        None => String::new(),
        Some(ItemContent::Text(t)) => t,
        Some(ItemContent::Parts(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for p in parts {
                match (p.kind.as_str(), p.text) {
                    ("input_text" | "output_text" | "text", Some(t)) => texts.push(t),
                    (kind, _) => {
                        return Err(ApiError::bad_param(
                            format!("vllm-sim does not simulate content parts of type {kind:?}"),
                            "input",
                        ))
                    }
                }
            }
            if role == "assistant" {
                texts.into_iter().next().unwrap_or_default()
            } else {
                texts.join("\n")
            }
        }
    };
    Ok(ChatMessage { role, content })
}

/// Serialises as JSON `null` (the fields vLLM always leaves null here).
#[derive(Debug, Clone, Copy, Default)]
pub struct Null;

impl Serialize for Null {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_none()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Queued,
    InProgress,
    Completed,
    Incomplete,
    Cancelled,
}

#[derive(Debug, Clone, Serialize)]
pub struct IncompleteDetails {
    pub reason: &'static str,
}

/// An `output_text` content part.
#[derive(Debug, Clone, Serialize)]
pub struct OutputText {
    pub annotations: [Null; 0],
    pub text: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// `[]` while streaming (`content_part.added`), null in finished items.
    pub logprobs: Option<[Null; 0]>,
}

impl OutputText {
    pub fn new(text: String, logprobs: Option<[Null; 0]>) -> Self {
        Self {
            annotations: [],
            text,
            kind: "output_text",
            logprobs,
        }
    }
}

/// A `message` output item.
#[derive(Debug, Clone, Serialize)]
pub struct OutputMessage {
    pub id: String,
    pub content: Vec<OutputText>,
    pub role: &'static str,
    pub status: &'static str,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub phase: Null,
}

impl OutputMessage {
    pub fn new(id: String, content: Vec<OutputText>, status: &'static str) -> Self {
        Self {
            id,
            content,
            role: "assistant",
            status,
            kind: "message",
            phase: Null,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct InputTokensDetails {
    pub cached_tokens: u32,
    pub cache_write_tokens: u32,
    pub input_tokens_per_turn: [u32; 0],
    pub cached_tokens_per_turn: [u32; 0],
}

#[derive(Debug, Clone, Serialize)]
pub struct OutputTokensDetails {
    pub reasoning_tokens: u32,
    pub tool_output_tokens: u32,
    pub output_tokens_per_turn: [u32; 0],
    pub tool_output_tokens_per_turn: [u32; 0],
}

#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    pub input_tokens: u32,
    pub input_tokens_details: InputTokensDetails,
    pub output_tokens: u32,
    pub output_tokens_details: OutputTokensDetails,
    pub total_tokens: u32,
}

impl Usage {
    pub fn new(input: u32, cached: u32, output: u32) -> Self {
        Self {
            input_tokens: input,
            input_tokens_details: InputTokensDetails {
                cached_tokens: cached,
                cache_write_tokens: 0,
                input_tokens_per_turn: [],
                cached_tokens_per_turn: [],
            },
            output_tokens: output,
            output_tokens_details: OutputTokensDetails {
                reasoning_tokens: 0,
                tool_output_tokens: 0,
                output_tokens_per_turn: [],
                tool_output_tokens_per_turn: [],
            },
            total_tokens: input + output,
        }
    }
}

/// vLLM's `ResponsesResponse`, field for field (without tools, reasoning and metrics).
#[derive(Debug, Clone, Serialize)]
pub struct ResponseObject {
    pub id: String,
    pub created_at: u64,
    pub incomplete_details: Option<IncompleteDetails>,
    pub instructions: Option<String>,
    pub metadata: Null,
    pub model: String,
    pub object: &'static str,
    pub output: Vec<OutputMessage>,
    pub parallel_tool_calls: bool,
    pub temperature: f64,
    pub tool_choice: &'static str,
    pub tools: [Null; 0],
    pub top_p: f64,
    pub background: bool,
    /// The effective limit (vLLM echoes its sampling params' `max_tokens`).
    pub max_output_tokens: u32,
    pub max_tool_calls: Null,
    pub previous_response_id: Option<String>,
    pub prompt: Null,
    pub reasoning: Null,
    pub service_tier: &'static str,
    pub status: Status,
    pub text: Null,
    pub top_logprobs: Null,
    pub truncation: &'static str,
    pub usage: Option<Usage>,
    pub user: Null,
    pub presence_penalty: f64,
    pub frequency_penalty: f64,
    pub kv_transfer_params: Null,
    pub ec_transfer_params: Null,
    pub input_messages: Null,
    pub output_messages: Null,
}

impl ResponseObject {
    /// The object before any output: `status` as given, `output: []`, `usage: null`.
    pub fn start(
        id: String,
        model: String,
        instructions: Option<String>,
        max_output_tokens: u32,
        background: bool,
        previous_response_id: Option<String>,
        status: Status,
    ) -> Self {
        Self {
            id,
            created_at: crate::metrics::unix_now() as u64,
            incomplete_details: None,
            instructions,
            metadata: Null,
            model,
            object: "response",
            output: Vec::new(),
            parallel_tool_calls: true,
            temperature: 1.0,
            tool_choice: "none",
            tools: [],
            top_p: 1.0,
            background,
            max_output_tokens,
            max_tool_calls: Null,
            previous_response_id,
            prompt: Null,
            reasoning: Null,
            service_tier: "auto",
            status,
            text: Null,
            top_logprobs: Null,
            truncation: "disabled",
            usage: None,
            user: Null,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            kv_transfer_params: Null,
            ec_transfer_params: Null,
            input_messages: Null,
            output_messages: Null,
        }
    }

    /// The finished object: one message item, usage, and `incomplete` when the length limit
    /// ended it (the only way the simulator's generation ends).
    pub fn finished(
        mut self,
        item: OutputMessage,
        usage: Usage,
        by_length: bool,
    ) -> ResponseObject {
        self.output = vec![item];
        self.usage = Some(usage);
        if by_length {
            self.status = Status::Incomplete;
            self.incomplete_details = Some(IncompleteDetails {
                reason: "max_output_tokens",
            });
        } else {
            self.status = Status::Completed;
        }
        self
    }
}

/// `response.created`, `response.in_progress`, `response.completed`.
#[derive(Serialize)]
pub struct ResponseEvent<'a> {
    pub response: &'a ResponseObject,
    pub sequence_number: u64,
    #[serde(rename = "type")]
    pub kind: &'static str,
}

/// `response.output_item.added` / `.done`.
#[derive(Serialize)]
pub struct ItemEvent<'a> {
    pub item: &'a OutputMessage,
    pub output_index: u32,
    pub sequence_number: u64,
    #[serde(rename = "type")]
    pub kind: &'static str,
}

/// `response.content_part.added` / `.done`.
#[derive(Serialize)]
pub struct PartEvent<'a> {
    pub content_index: u32,
    pub item_id: &'a str,
    pub output_index: u32,
    pub part: &'a OutputText,
    pub sequence_number: u64,
    #[serde(rename = "type")]
    pub kind: &'static str,
}

/// `response.output_text.delta`.
#[derive(Serialize)]
pub struct DeltaEvent<'a> {
    pub content_index: u32,
    pub delta: &'a str,
    pub item_id: &'a str,
    pub logprobs: [Null; 0],
    pub output_index: u32,
    pub sequence_number: u64,
    #[serde(rename = "type")]
    pub kind: &'static str,
}

/// `response.output_text.done`.
#[derive(Serialize)]
pub struct TextDoneEvent<'a> {
    pub content_index: u32,
    pub item_id: &'a str,
    pub logprobs: [Null; 0],
    pub output_index: u32,
    pub sequence_number: u64,
    pub text: &'a str,
    #[serde(rename = "type")]
    pub kind: &'static str,
}

/// One SSE frame as vLLM writes it: `event: <type>\ndata: <compact json>\n\n`.
pub fn frame(kind: &str, event: &impl Serialize) -> String {
    // Serialising these plain structs cannot fail.
    let data = serde_json::to_string(event).unwrap_or_default();
    format!("event: {kind}\ndata: {data}\n\n")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    fn items(v: Value) -> Input {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn instructions_come_first_and_parts_join_with_newlines() {
        let input = items(serde_json::json!([{"role": "user", "content": [
            {"type": "input_text", "text": "first"}, {"type": "input_text", "text": "part2"}]}]));
        let m = construct_input_messages(Some("SYS1"), input, None, None).unwrap();
        assert_eq!(m, [msg("system", "SYS1"), msg("user", "first\npart2")]);
    }

    #[test]
    fn history_drops_system_messages_and_adds_the_previous_output() {
        let prev = [msg("system", "SYS1"), msg("user", "first")];
        let out = [OutputMessage::new(
            "msg_1".into(),
            vec![OutputText::new("R1".into(), None)],
            "completed",
        )];
        let m = construct_input_messages(
            Some("SYS2"),
            Input::Text("second".into()),
            Some(&prev),
            Some(&out),
        )
        .unwrap();
        assert_eq!(
            m,
            [
                msg("system", "SYS2"),
                msg("user", "first"),
                msg("assistant", "R1"),
                msg("user", "second")
            ]
        );
    }

    #[test]
    fn assistant_part_lists_keep_their_first_text_and_other_items_are_refused() {
        let input = items(serde_json::json!([
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "a"}, {"type": "output_text", "text": "b"}]},
            {"role": "developer", "content": "d"}
        ]));
        let m = construct_input_messages(None, input, None, None).unwrap();
        assert_eq!(m, [msg("assistant", "a"), msg("developer", "d")]);
        let input = items(serde_json::json!([{"type": "function_call_output", "output": "x"}]));
        let e = construct_input_messages(None, input, None, None).unwrap_err();
        assert_eq!(
            e.to_string(),
            "Unsupported input item type: function_call_output"
        );
    }

    #[test]
    fn objects_serialise_in_vllms_field_order() {
        let o = ResponseObject::start(
            "resp_x".into(),
            "m".into(),
            None,
            5,
            false,
            None,
            Status::InProgress,
        );
        let s = serde_json::to_string(&o).unwrap();
        assert!(s.starts_with(r#"{"id":"resp_x","created_at":"#), "{s}");
        assert!(s.contains(r#""status":"in_progress","text":null"#), "{s}");
        assert!(s.contains(r#""usage":null"#), "{s}");
        let item = OutputMessage::new("msg_1".into(), Vec::new(), "in_progress");
        assert_eq!(
            serde_json::to_string(&item).unwrap(),
            r#"{"id":"msg_1","content":[],"role":"assistant","status":"in_progress","type":"message","phase":null}"#
        );
        let id = random_id("resp_");
        assert_eq!(id.len(), 21);
        assert!(id[5..]
            .chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
    }
}
