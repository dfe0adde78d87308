//! Tokenization: the token ids vLLM will compute for a request, so the scheduler can match
//! them against the token blocks backends report as cached (see `kv_events`).
//!
//! Today only token-id prompts (`/v1/completions` with `"prompt": [ids]`) carry tokens: vLLM
//! uses them as they are. Text prompts and chat messages get tokens once a model's Hugging
//! Face tokenizer and chat template are loaded.

/// The token ids of one request's prompt, as the engine will see them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PromptTokens {
    /// Token ids in prompt order (for chat: the rendered chat template, tokenized).
    pub ids: Vec<u32>,
    /// The request's `cache_salt`, which vLLM mixes into the first block's hash.
    pub cache_salt: Option<String>,
}
