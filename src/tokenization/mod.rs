//! Tokenization: the token ids vLLM will compute for a request, so the scheduler can match
//! them against the token blocks backends report as cached (see `kv_events`).
//!
//! Token-id prompts (`/v1/completions` with `"prompt": [ids]`) carry their tokens as given (vLLM
//! uses them as they are; filled by [`crate::prompt`]). Text prompts and chat messages get
//! tokens here, in the prompt stage of the request path (the front door calls [`Tokenizers::fill`]
//! right after parsing), when the request's model has a Hugging Face tokenizer configured
//! (`[tokenization]` in config.toml, `--tokenizer DIR`). The tokenizers are loaded once at
//! start-up; a model without one costs nothing.
//!
//! Cost: rendering + BPE is linear in the prompt (the body limit bounds it). The common case —
//! the same system prompt and earlier turns again with a new last message — reuses the ids of
//! the longest prefix seen before ([`prefix_cache`]), cut only where concatenating ids is exact.
//! A request whose ids cannot be computed (multimodal parts, a template error that vLLM would
//! answer with a 400) is routed without tokens, as before.
//!
//! It owns the `[tokenization]` section ([`TokenizationConfig`]).

pub mod prefix_cache;
pub mod responses;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use hf_tokenize::{ChatRequest, HfTokenizer, TokenizeError};
use serde::Deserialize;

use crate::prompt::{Operation, RequestView};
use prefix_cache::PrefixCache;

/// The token ids of one request's prompt, as the engine will see them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PromptTokens {
    /// Token ids in prompt order (for chat: the rendered chat template, tokenized).
    pub ids: Vec<u32>,
    /// The request's `cache_salt`, which vLLM mixes into the first block's hash.
    pub cache_salt: Option<String>,
}

/// Why the tokenizers named in the configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
#[error("tokenizer {dir}: {source}")]
pub struct LoadError {
    pub dir: PathBuf,
    #[source]
    pub source: hf_tokenize::LoadError,
}

/// One model's tokenizer with its prefix cache.
pub struct ModelTokenizer {
    tok: HfTokenizer,
    cache: PrefixCache,
}

/// Model name → tokenizer, with a default for every other model.
#[derive(Default)]
pub struct Tokenizers {
    default: Option<Arc<ModelTokenizer>>,
    by_model: BTreeMap<String, Arc<ModelTokenizer>>,
    meters: OnceLock<Meters>,
    /// `tokenization.max_body_bytes` (0 only in `Default`, where there is no tokenizer).
    max_body: usize,
}

/// The per-request tokenization series, resolved on the first request (the recorder is
/// installed by then) instead of by label set on every one.
struct Meters {
    chat: metrics::Histogram,
    completions: metrics::Histogram,
    from_cache: metrics::Counter,
    tokenized: metrics::Counter,
}

impl Meters {
    fn new() -> Meters {
        use crate::telemetry::{TOKENIZE_DURATION, TOKENIZE_TOKENS};
        Meters {
            chat: metrics::histogram!(TOKENIZE_DURATION, "operation" => "chat"),
            completions: metrics::histogram!(TOKENIZE_DURATION, "operation" => "completions"),
            from_cache: metrics::counter!(TOKENIZE_TOKENS, "from" => "prefix_cache"),
            tokenized: metrics::counter!(TOKENIZE_TOKENS, "from" => "tokenizer"),
        }
    }
}

impl std::fmt::Debug for Tokenizers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizers")
            .field("default", &self.default.is_some())
            .field("models", &self.by_model.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Tokenizers {
    /// Load every directory the configuration names (a directory named twice is loaded once).
    pub fn load(cfg: &TokenizationConfig) -> Result<Tokenizers, LoadError> {
        let mut loaded: BTreeMap<PathBuf, Arc<ModelTokenizer>> = BTreeMap::new();
        let mut get = |dir: &Path| -> Result<Arc<ModelTokenizer>, LoadError> {
            if let Some(t) = loaded.get(dir) {
                return Ok(Arc::clone(t));
            }
            let tok = HfTokenizer::from_dir(dir).map_err(|source| LoadError {
                dir: dir.to_owned(),
                source,
            })?;
            let t = Arc::new(ModelTokenizer {
                tok,
                cache: PrefixCache::new(cfg.prefix_cache_tokens),
            });
            loaded.insert(dir.to_owned(), Arc::clone(&t));
            Ok(t)
        };
        let default = cfg.dir.as_deref().map(&mut get).transpose()?;
        let mut by_model = BTreeMap::new();
        for (model, dir) in &cfg.models {
            by_model.insert(model.clone(), get(dir)?);
        }
        Ok(Tokenizers {
            default,
            by_model,
            meters: OnceLock::new(),
            max_body: cfg.max_body_bytes,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.default.is_none() && self.by_model.is_empty()
    }

    /// The tokenizer for `model` (its own, else the default).
    pub fn for_model(&self, model: Option<&str>) -> Option<&Arc<ModelTokenizer>> {
        model
            .and_then(|m| self.by_model.get(m))
            .or(self.default.as_ref())
    }

    /// [`Tokenizers::fill`], but only when `useful()` says the ids can be used: the front door
    /// passes "some backend's KV-event stream is live" (precise scoring is the only reader of
    /// the ids). Otherwise the request is counted in `inferlb_tokenize_skipped_total{reason =
    /// "no_live_stream"}` and routed without tokens. `useful` is called only for a request
    /// that would be tokenized (its model has a tokenizer), so a fleet without a tokenizer
    /// pays nothing.
    pub fn fill_if(&self, view: &mut RequestView, body: &[u8], useful: impl FnOnce() -> bool) {
        if self.is_empty()
            || view.operation == Operation::Other
            || self.for_model(view.model.as_deref()).is_none()
        {
            return;
        }
        if !useful() {
            skipped("no_live_stream");
            return;
        }
        self.fill(view, body);
    }

    /// Fill `view.tokens` for a chat or text-completions request whose model has a tokenizer,
    /// and the `cache_salt` of any request that has tokens.
    pub fn fill(&self, view: &mut RequestView, body: &[u8]) {
        if self.is_empty() {
            return;
        }
        let Some(t) = self.for_model(view.model.as_deref()) else {
            return;
        };
        if body.len() > self.max_body {
            skipped("too_long");
            return;
        }
        let started = Instant::now();
        let ids = match (view.operation, &view.tokens) {
            (Operation::ChatCompletions, _) => t.chat_ids(body),
            (Operation::Completions, None) => t.tok.completion_ids(body).map(|ids| (ids, 0)),
            // Token-id prompts: already known.
            (Operation::Completions, Some(_)) => Err(TokenizeError::Unsupported("token ids")),
            (Operation::Responses, _) => {
                responses::as_chat(body).and_then(|chat| t.chat_ids(&chat))
            }
            (Operation::Other, _) => return,
        };
        let salt = cache_salt(body);
        match ids {
            Ok((ids, reused)) => {
                let m = self.meters.get_or_init(Meters::new);
                let took = started.elapsed().as_secs_f64();
                match view.operation {
                    Operation::ChatCompletions | Operation::Responses => m.chat.record(took),
                    _ => m.completions.record(took),
                }
                m.from_cache.increment(reused as u64);
                m.tokenized
                    .increment(ids.len().saturating_sub(reused) as u64);
                view.tokens = Some(Arc::new(PromptTokens {
                    ids,
                    cache_salt: salt,
                }))
            }
            Err(TokenizeError::Unsupported("token ids")) => {
                if let (Some(tokens), Some(salt)) = (&view.tokens, salt) {
                    let mut with_salt = PromptTokens::clone(tokens);
                    with_salt.cache_salt = Some(salt);
                    view.tokens = Some(Arc::new(with_salt));
                }
            }
            Err(e) => {
                let reason = match e {
                    TokenizeError::Unsupported(_) => "unsupported",
                    TokenizeError::InvalidRequest(_) => "invalid",
                    TokenizeError::NoChatTemplate => "no_chat_template",
                    TokenizeError::Template(_) => "template",
                    TokenizeError::Tokenizer(_) => "tokenizer",
                };
                skipped(reason);
                tracing::debug!(error = %e, "request routed without token ids");
            }
        }
    }
}

impl ModelTokenizer {
    /// A chat body's ids, reusing the cached ids of its longest known prefix, and how many
    /// of them (a prefix) came from that cache.
    pub fn chat_ids(&self, body: &[u8]) -> Result<(Vec<u32>, usize), TokenizeError> {
        let req = ChatRequest::from_body(body)?;
        let text = self.tok.render_chat(&req)?;
        match self.tok.safe_cuts(&text) {
            Some(cuts) if !cuts.is_empty() => self.cache.encode(&self.tok, &text, &cuts),
            _ => Ok((self.tok.encode(&text, false)?, 0)),
        }
    }

    pub fn tokenizer(&self) -> &HfTokenizer {
        &self.tok
    }
}

/// Count a request routed without token ids, by why.
fn skipped(reason: &'static str) {
    metrics::counter!(crate::telemetry::TOKENIZE_SKIPPED_TOTAL, "reason" => reason).increment(1);
}

#[derive(Deserialize)]
struct Salt<'a> {
    #[serde(borrow, default)]
    cache_salt: Option<std::borrow::Cow<'a, str>>,
}

/// The body's `cache_salt` (a string; anything else is ignored here and judged by vLLM).
fn cache_salt(body: &[u8]) -> Option<String> {
    serde_json::from_slice::<Salt<'_>>(body)
        .ok()?
        .cache_salt
        .map(|s| s.into_owned())
}

/// `[tokenization]`: which models get in-process tokenization (chat template + tokenizer).
///
/// Per model name, not per backend: a model name stands for one tokenizer (backends that
/// serve the same name with different tokenizers would not share a prefix cache anyway).
/// Loaded once at start-up; a reload does not reload tokenizers.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TokenizationConfig {
    /// Model directory (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`)
    /// for every model without its own entry in `models` (`--tokenizer DIR`).
    pub dir: Option<std::path::PathBuf>,
    /// Served model name → model directory.
    pub models: BTreeMap<String, std::path::PathBuf>,
    /// Token ids kept by each tokenizer's prefix cache (0 = no cache).
    pub prefix_cache_tokens: u64,
    /// Requests whose body is larger are routed without token ids (counted as `too_long`):
    /// it bounds the work and memory one request's tokenization can take (one pre-token of
    /// millions of characters costs `tokenizers` hundreds of bytes per token).
    pub max_body_bytes: usize,
}

impl Default for TokenizationConfig {
    fn default() -> Self {
        TokenizationConfig {
            dir: None,
            models: BTreeMap::new(),
            prefix_cache_tokens: 4_000_000,
            max_body_bytes: 2 * 1024 * 1024,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-llama");

    #[test]
    fn unknown_fields_are_rejected_by_name() {
        let err = toml::from_str::<TokenizationConfig>("dirr = \"x\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("dirr"), "{err}");
    }

    #[test]
    fn only_models_with_a_tokenizer_get_tokens() {
        let cfg = TokenizationConfig {
            models: [("tiny".to_owned(), PathBuf::from(FIXTURE))].into(),
            ..TokenizationConfig::default()
        };
        let toks = Tokenizers::load(&cfg).unwrap();
        let chat = |model: &str| {
            format!(
                r#"{{"model":"{model}","cache_salt":"s1","messages":[{{"role":"user","content":"hello world"}}]}}"#
            )
        };
        let mut view =
            RequestView::parse(Operation::ChatCompletions, chat("tiny").as_bytes()).unwrap();
        toks.fill(&mut view, chat("tiny").as_bytes());
        let t = view.tokens.unwrap();
        assert_eq!(t.ids, [4, 589, 478, 6, 5]);
        assert_eq!(t.cache_salt.as_deref(), Some("s1"));
        let mut other =
            RequestView::parse(Operation::ChatCompletions, chat("other").as_bytes()).unwrap();
        toks.fill(&mut other, chat("other").as_bytes());
        assert!(other.tokens.is_none());
        // Token-id prompts keep their ids and gain the salt.
        let body = br#"{"model":"tiny","prompt":[7,8,9],"cache_salt":"s2"}"#;
        let mut ids = RequestView::parse(Operation::Completions, body).unwrap();
        toks.fill(&mut ids, body);
        let t = ids.tokens.unwrap();
        assert_eq!(
            (t.ids.as_slice(), t.cache_salt.as_deref()),
            (&[7, 8, 9][..], Some("s2"))
        );
    }

    #[test]
    fn a_responses_body_has_the_ids_of_its_chat_rendering() {
        let cfg = TokenizationConfig {
            models: [("tiny".to_owned(), PathBuf::from(FIXTURE))].into(),
            ..TokenizationConfig::default()
        };
        let toks = Tokenizers::load(&cfg).unwrap();
        let ids = |op, body: &str| {
            let mut view = RequestView::parse(op, body.as_bytes()).unwrap();
            toks.fill(&mut view, body.as_bytes());
            view.tokens.map(|t| t.ids.clone())
        };
        let responses = ids(
            Operation::Responses,
            r#"{"model":"tiny","instructions":"be brief","input":"hello world"}"#,
        );
        let chat = ids(
            Operation::ChatCompletions,
            r#"{"model":"tiny","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hello world"}]}"#,
        );
        assert!(responses.is_some());
        assert_eq!(responses, chat);
        let follow_up = ids(
            Operation::Responses,
            r#"{"model":"tiny","input":"x","previous_response_id":"resp_1"}"#,
        );
        assert_eq!(
            follow_up, None,
            "the server's history is not ours to render"
        );
    }

    #[test]
    fn a_missing_directory_fails_the_start() {
        let cfg = TokenizationConfig {
            dir: Some("/nonexistent/model".into()),
            ..TokenizationConfig::default()
        };
        assert!(Tokenizers::load(&cfg).is_err());
    }
}
