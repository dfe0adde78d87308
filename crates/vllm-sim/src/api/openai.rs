//! OpenAI request bodies: parsing, model resolution, tokenising and vLLM's validation rules.
//!
//! A completion or chat body becomes a [`Prepared`] request: prompt tokens, output length and
//! streaming options. Rules (vLLM's where it has one):
//!
//! * `model` may be omitted (the primary served name is used); an unknown name is a 404; a
//!   LoRA adapter's name selects that adapter (its blocks never match the base model's).
//! * `prompt` (completions): a string, a one-element array of strings, an array of token ids,
//!   or a one-element array of token-id arrays. Text gets a BOS token in front.
//! * `messages` (chat): rendered through the fixed chat template, then tokenised.
//! * `n` must be 1. `max_tokens` (or chat's `max_completion_tokens`) must be ≥ 1; the default
//!   is 16 for completions and, for chat, the rest of the context capped at 256.
//! * A prompt of `--max-model-len` tokens or more is refused; a `max_tokens` beyond the rest of
//!   the context is lowered to fit (vLLM 0.32 does the same). Prompt + output must fit the KV
//!   cache at all.
//! * `kv_transfer_params` (both endpoints): an object or null, as vLLM's `dict | None`; what it
//!   asks for is read by [`super::pd`].

use serde::Deserialize;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::error::ApiError;
use super::AppState;
use crate::tokenizer::{self, ChatMessage};

/// Default output length of `/v1/completions` (OpenAI's legacy default, as vLLM).
pub const DEFAULT_COMPLETION_TOKENS: u32 = 16;
/// Cap of the chat default (vLLM would use the whole remaining context).
pub const DEFAULT_CHAT_TOKENS_CAP: u32 = 256;

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdBatches(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub prompt: Option<PromptInput>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub n: Option<u32>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Accepted; the simulator never samples an end-of-sequence token anyway.
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    /// vLLM's prefix-cache isolation key (mixed into the first block's hash).
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// P/D disaggregation (vLLM's NixlConnector protocol, see [`super::pd`]).
    #[serde(default)]
    pub kv_transfer_params: Option<KvTransferParams>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ImageUrl {
    Object { url: String },
    Plain(String),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    pub image_url: Option<ImageUrl>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<Message>,
    #[serde(default)]
    pub max_tokens: Option<u32>,
    #[serde(default)]
    pub max_completion_tokens: Option<u32>,
    #[serde(default)]
    pub n: Option<u32>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    /// vLLM's prefix-cache isolation key (mixed into the first block's hash).
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// P/D disaggregation (vLLM's NixlConnector protocol, see [`super::pd`]).
    #[serde(default)]
    pub kv_transfer_params: Option<KvTransferParams>,
}

/// `kv_transfer_params` as sent: any JSON object.
pub type KvTransferParams = serde_json::Map<String, serde_json::Value>;

/// Which model a request addressed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelChoice {
    /// The name to echo in responses.
    pub name: String,
    /// Index into the LoRA adapters, None for the base model.
    pub lora: Option<u16>,
}

impl ModelChoice {
    /// Seed of the block-hash chain: adapters get their own cache namespace.
    pub fn hash_seed(&self) -> u64 {
        match self.lora {
            None => 0,
            Some(_) => xxh3_64(self.name.as_bytes()),
        }
    }
}

/// A validated request, ready for the engine.
#[derive(Debug)]
pub struct Prepared {
    pub model: ModelChoice,
    pub tokens: Vec<u32>,
    pub max_tokens: u32,
    pub stream: bool,
    pub include_usage: bool,
    pub cache_salt: Option<String>,
    pub kv_transfer_params: Option<KvTransferParams>,
}

/// Seed of a request's block-hash chain: vLLM mixes `cache_salt` into the first block's hash,
/// so salted prompts share no blocks with unsalted ones or other salts.
pub fn hash_seed(model: &ModelChoice, cache_salt: Option<&str>) -> u64 {
    match cache_salt {
        Some(salt) => xxh3_64_with_seed(salt.as_bytes(), model.hash_seed()),
        None => model.hash_seed(),
    }
}

/// Resolves the `model` field against the served names and adapters.
pub fn resolve_model(st: &AppState, model: Option<&str>) -> Result<ModelChoice, ApiError> {
    let Some(name) = model else {
        return Ok(ModelChoice {
            name: st.names[0].clone(),
            lora: None,
        });
    };
    if st.names.iter().any(|n| n == name) {
        return Ok(ModelChoice {
            name: name.into(),
            lora: None,
        });
    }
    match st.config.lora_modules.iter().position(|l| l.name == name) {
        Some(i) => Ok(ModelChoice {
            name: name.into(),
            lora: Some(i as u16),
        }),
        None => {
            let mut valid: Vec<&str> = st.names.iter().map(String::as_str).collect();
            valid.extend(st.config.lora_modules.iter().map(|l| l.name.as_str()));
            Err(ApiError::ModelNotFound {
                name: name.into(),
                valid: valid.join(", "),
            })
        }
    }
}

/// Tokens of a completions `prompt`.
pub fn prompt_tokens(prompt: PromptInput) -> Result<Vec<u32>, ApiError> {
    let tokens = match prompt {
        PromptInput::Text(t) => tokenizer::tokenize_prompt(&t),
        PromptInput::Texts(mut v) if v.len() == 1 => tokenizer::tokenize_prompt(&v.remove(0)),
        PromptInput::Ids(ids) => ids,
        PromptInput::IdBatches(mut v) if v.len() == 1 => v.remove(0),
        PromptInput::Texts(v) if v.is_empty() => {
            return Err(ApiError::bad("You must pass at least one prompt"))
        }
        _ => {
            return Err(ApiError::bad_param(
                "vllm-sim serves one prompt per request: batched prompts are not supported",
                "prompt",
            ))
        }
    };
    if tokens.is_empty() {
        return Err(ApiError::bad("You must pass at least one prompt"));
    }
    if let Some(bad) = tokens.iter().find(|&&t| t >= tokenizer::VOCAB_SIZE) {
        return Err(ApiError::bad_param(
            format!(
                "Token id {bad} is out of vocabulary (size {})",
                tokenizer::VOCAB_SIZE
            ),
            "prompt",
        ));
    }
    Ok(tokens)
}

/// `--tokenizer`: the real tokenizer's ids, or the 400 vLLM would answer.
pub fn hf_prompt_tokens(
    ids: Result<Vec<u32>, hf_tokenize::TokenizeError>,
) -> Result<Vec<u32>, ApiError> {
    let tokens = ids.map_err(|e| ApiError::bad(e.to_string()))?;
    if tokens.is_empty() {
        return Err(ApiError::bad("You must pass at least one prompt"));
    }
    Ok(tokens)
}

/// Renders chat messages (content strings, text parts, image placeholders) to template text.
pub fn render_messages(
    messages: Vec<Message>,
    add_generation_prompt: bool,
) -> Result<String, ApiError> {
    let mut rendered = Vec::with_capacity(messages.len());
    for m in messages {
        let content = match m.content {
            None => String::new(),
            Some(Content::Text(t)) => t,
            Some(Content::Parts(parts)) => {
                let mut s = String::new();
                for p in parts {
                    match (p.kind.as_str(), p.text, p.image_url) {
                        ("text", Some(t), _) => s.push_str(&t),
                        ("image_url", _, Some(ImageUrl::Object { url } | ImageUrl::Plain(url))) => {
                            s.push_str(&tokenizer::image_placeholder(&url))
                        }
                        (kind, _, _) => {
                            return Err(ApiError::bad_param(
                                format!("Unsupported or malformed content part of type {kind:?}"),
                                "messages",
                            ))
                        }
                    }
                }
                s
            }
        };
        rendered.push(ChatMessage {
            role: m.role,
            content,
        });
    }
    Ok(tokenizer::render_chat(&rendered, add_generation_prompt))
}

fn check_n(n: Option<u32>) -> Result<(), ApiError> {
    match n {
        None | Some(1) => Ok(()),
        Some(n) => Err(ApiError::bad_param(
            format!("vllm-sim supports only n=1, got n={n}"),
            "n",
        )),
    }
}

/// Applies the length rules and picks the output length.
pub(crate) fn finish(
    st: &AppState,
    model: ModelChoice,
    tokens: Vec<u32>,
    requested: Option<u32>,
    default: impl FnOnce(usize) -> u32,
    stream: Option<bool>,
    opts: Option<StreamOptions>,
) -> Result<Prepared, ApiError> {
    let max_len = st.config.max_model_len;
    let prompt_len = tokens.len();
    if prompt_len >= max_len {
        return Err(ApiError::bad_param(
            format!(
                "This model's maximum context length is {max_len} tokens. However, your prompt \
                 contains {prompt_len} input tokens, which exceeds this limit even without any \
                 output tokens. Please reduce the length of the input prompt. \
                 (parameter=input_tokens, value={prompt_len})"
            ),
            "input_tokens",
        ));
    }
    let room = (max_len - prompt_len) as u32;
    let max_tokens = match requested {
        Some(0) => {
            return Err(ApiError::bad_param(
                "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
                "max_tokens",
            ))
        }
        Some(m) => m.min(room),
        None => default(room as usize).max(1),
    };
    let blocks = (prompt_len + max_tokens as usize).div_ceil(st.config.block_size);
    if blocks > st.config.num_gpu_blocks {
        return Err(ApiError::bad(format!(
            "The request needs {blocks} KV-cache blocks, more than the {} the cache holds.",
            st.config.num_gpu_blocks
        )));
    }
    let stream = stream.unwrap_or(false);
    let include_usage = stream && opts.and_then(|o| o.include_usage).unwrap_or(false);
    Ok(Prepared {
        model,
        tokens,
        max_tokens,
        stream,
        include_usage,
        cache_salt: None,
        kv_transfer_params: None,
    })
}

/// Validates a `/v1/completions` body.
pub fn prepare_completion(
    st: &AppState,
    req: CompletionRequest,
    body: &[u8],
) -> Result<Prepared, ApiError> {
    let model = resolve_model(st, req.model.as_deref())?;
    check_n(req.n)?;
    let Some(prompt) = req.prompt else {
        return Err(ApiError::bad_param(
            "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
            "prompt",
        ));
    };
    let tokens = match (&st.hf, &prompt) {
        (Some(hf), PromptInput::Text(_) | PromptInput::Texts(_)) => {
            hf_prompt_tokens(hf.completion_ids(body))?
        }
        _ => prompt_tokens(prompt)?,
    };
    let default = |room: usize| DEFAULT_COMPLETION_TOKENS.min(room as u32);
    let p = finish(
        st,
        model,
        tokens,
        req.max_tokens,
        default,
        req.stream,
        req.stream_options,
    )?;
    Ok(Prepared {
        cache_salt: req.cache_salt,
        kv_transfer_params: req.kv_transfer_params,
        ..p
    })
}

/// Validates a `/v1/chat/completions` body.
pub fn prepare_chat(st: &AppState, req: ChatRequest, body: &[u8]) -> Result<Prepared, ApiError> {
    let model = resolve_model(st, req.model.as_deref())?;
    check_n(req.n)?;
    let tokens = match &st.hf {
        Some(hf) => hf_prompt_tokens(hf.chat_ids(body))?,
        None => {
            let text = render_messages(req.messages, req.add_generation_prompt.unwrap_or(true))?;
            tokenizer::tokenize(&text)
        }
    };
    if tokens.is_empty() {
        return Err(ApiError::bad_param(
            "messages render to an empty prompt",
            "messages",
        ));
    }
    let requested = req.max_completion_tokens.or(req.max_tokens);
    let default = |room: usize| DEFAULT_CHAT_TOKENS_CAP.min(room as u32);
    let p = finish(
        st,
        model,
        tokens,
        requested,
        default,
        req.stream,
        req.stream_options,
    )?;
    Ok(Prepared {
        cache_salt: req.cache_salt,
        kv_transfer_params: req.kv_transfer_params,
        ..p
    })
}
