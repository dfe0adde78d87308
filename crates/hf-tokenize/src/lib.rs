//! # hf-tokenize — the token ids vLLM computes for an OpenAI request
//!
//! Loads a Hugging Face model directory (`tokenizer.json`, `tokenizer_config.json`,
//! `chat_template.jinja` when present; never the network) and turns a request body into the
//! prompt token ids vLLM 0.32 would feed its engine:
//!
//! * **chat** (`/v1/chat/completions`, and `/tokenize` with `messages`): the messages are
//!   normalised as vLLM's `parse_chat_messages` does ([`chat`]), the chat template is rendered
//!   as transformers' `apply_chat_template` renders it ([`template`]: Jinja with `trim_blocks`
//!   and `lstrip_blocks`, Python string methods, `tojson` as `json.dumps`, `raise_exception`,
//!   `strftime_now`, the special tokens and `chat_template_kwargs` as variables), and the text is
//!   tokenized **without** special tokens: transformers' `apply_chat_template(tokenize=True)`,
//!   which vLLM 0.32 calls, always passes `add_special_tokens=False` (the template writes BOS
//!   itself when the model wants one).
//! * **completions** (`/v1/completions` with a text prompt): the text tokenized **with** special
//!   tokens unless the body says `"add_special_tokens": false` (vLLM's default is true).
//!
//! [`HfTokenizer::safe_cuts`] says where a rendered prompt may be split so that tokenizing the
//! pieces and concatenating the ids equals tokenizing the whole (see [`cuts`]): the seam for
//! caching a repeated prefix's ids.

pub mod byte_level;
pub mod chat;
pub mod cuts;
pub mod merges;
pub mod template;

use std::path::{Path, PathBuf};

use serde::Deserialize;

pub use chat::ChatRequest;

/// Why a model directory could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path}: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error("chat template {name:?} does not compile: {message}")]
    Template { name: String, message: String },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
}

/// Why a request's token ids could not be computed.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// The body is not what vLLM accepts (vLLM answers it with a 400 too).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The request is valid but its ids cannot be computed here (multimodal parts, a request
    /// chat template, several prompts): route it without tokens.
    #[error("not tokenizable here: {0}")]
    Unsupported(&'static str),
    /// The model has no chat template.
    #[error("the model has no chat template")]
    NoChatTemplate,
    /// The chat template failed (including `raise_exception` from the template).
    #[error("chat template error: {0}")]
    Template(String),
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
}

/// Run one `tokenizers` call on client text, its panics turned into an error: the `onig`
/// crate panics when Oniguruma gives up on a match (its retry limit: a whitespace run of
/// millions of characters under Llama 3's pattern does it), and one request's text must not
/// take a worker thread down.
fn guarded<T>(f: impl FnOnce() -> tokenizers::Result<T>) -> Result<T, TokenizeError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(|e| TokenizeError::Tokenizer(e.to_string())),
        Err(_) => Err(TokenizeError::Tokenizer(
            "the tokenizer panicked on this text".into(),
        )),
    }
}

/// A token's byte span in the text it came from.
pub type Span = (usize, usize);

/// A loaded tokenizer and chat template set for one model.
pub struct HfTokenizer {
    tokenizer: tokenizers::Tokenizer,
    templates: template::Templates,
    /// `bos_token`, `eos_token`, … as the template sees them (transformers' `special_tokens_map`).
    special_tokens: Vec<(String, String)>,
    cutter: Option<cuts::Cutter>,
    /// The direct encoder, when the tokenizer has its shape ([`byte_level`]).
    direct: Option<byte_level::ByteLevelBpe>,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("vocab", &self.tokenizer.get_vocab_size(true))
            .field("templates", &self.templates.names())
            .finish()
    }
}

/// The fields of `tokenizer_config.json` that change tokenization or rendering; the rest
/// (class names, model_max_length, …) is ignored.
#[derive(Deserialize, Default)]
struct TokenizerConfig {
    #[serde(default)]
    chat_template: Option<serde_json::Value>,
    #[serde(default)]
    add_bos_token: Option<bool>,
    #[serde(default)]
    add_eos_token: Option<bool>,
    #[serde(flatten)]
    rest: serde_json::Map<String, serde_json::Value>,
}

/// Whether `tokenizer.json`'s `added_tokens` name every content and every id once.
fn added_tokens_are_distinct(json: &str) -> Option<bool> {
    #[derive(Deserialize)]
    struct Added {
        id: u32,
        content: String,
    }
    #[derive(Deserialize)]
    struct File {
        #[serde(default)]
        added_tokens: Vec<Added>,
    }
    let file: File = serde_json::from_str(json).ok()?;
    let mut ids = std::collections::HashSet::new();
    let mut contents = std::collections::HashSet::new();
    Some(
        file.added_tokens
            .iter()
            .all(|t| ids.insert(t.id) && contents.insert(t.content.as_str())),
    )
}

/// The special-token names transformers puts into `special_tokens_map` (and so into the
/// template's variables).
const SPECIAL_TOKEN_NAMES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

fn read(path: &Path) -> Result<String, LoadError> {
    std::fs::read_to_string(path).map_err(|source| LoadError::Io {
        path: path.to_owned(),
        source,
    })
}

/// A special token in `tokenizer_config.json`: a string, or an `AddedToken` object.
fn token_text(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(m) => m.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

impl HfTokenizer {
    /// Load `dir/tokenizer.json`, `dir/tokenizer_config.json` (optional) and
    /// `dir/chat_template.jinja` (optional; preferred over the config's `chat_template`, as
    /// transformers does).
    pub fn from_dir(dir: &Path) -> Result<Self, LoadError> {
        let tok_path = dir.join("tokenizer.json");
        // Read once: the tokenizer and the encoder's check of `added_tokens` parse the text.
        let tok_json = read(&tok_path)?;
        let mut tokenizer: tokenizers::Tokenizer =
            tok_json.parse().map_err(|e| LoadError::Tokenizer {
                path: tok_path.clone(),
                message: format!("{e}"),
            })?;
        let cfg_path = dir.join("tokenizer_config.json");
        let config: TokenizerConfig = if cfg_path.exists() {
            serde_json::from_str(&read(&cfg_path)?).map_err(|source| LoadError::Json {
                path: cfg_path.clone(),
                source,
            })?
        } else {
            TokenizerConfig::default()
        };
        let special_tokens: Vec<(String, String)> = SPECIAL_TOKEN_NAMES
            .iter()
            .filter_map(|name| {
                let v = config.rest.get(*name)?;
                Some(((*name).to_owned(), token_text(v)?))
            })
            .collect();
        // transformers (Llama-style fast tokenizers, and v5's TokenizersBackend) rebuild the
        // post-processor from `add_bos_token` / `add_eos_token` when the config sets them.
        if config.add_bos_token.is_some() || config.add_eos_token.is_some() {
            let lookup = |name: &str| -> Option<(String, u32)> {
                let text = special_tokens.iter().find(|(n, _)| n == name)?.1.clone();
                let id = tokenizer.token_to_id(&text)?;
                Some((text, id))
            };
            let bos = config
                .add_bos_token
                .unwrap_or(false)
                .then(|| lookup("bos_token"))
                .flatten();
            let eos = config
                .add_eos_token
                .unwrap_or(false)
                .then(|| lookup("eos_token"))
                .flatten();
            let processor = bos_eos_processor(bos, eos).map_err(|message| LoadError::Config {
                path: cfg_path.clone(),
                message,
            })?;
            tokenizer.with_post_processor(Some(processor));
        }
        let jinja_path = dir.join("chat_template.jinja");
        let sources = if jinja_path.exists() {
            vec![("default".to_owned(), read(&jinja_path)?)]
        } else {
            template::Templates::from_config(config.chat_template.as_ref()).map_err(|message| {
                LoadError::Config {
                    path: cfg_path.clone(),
                    message,
                }
            })?
        };
        let templates = template::Templates::new(sources)?;
        let cutter = cuts::Cutter::new(&tokenizer);
        // `tokenizers` keeps every entry of `added_tokens`, the encoder's view of them (the
        // id → token map) one per id: with a content or an id listed twice they could differ.
        let direct = byte_level::ByteLevelBpe::new(&tokenizer)
            .filter(|_| added_tokens_are_distinct(&tok_json).unwrap_or(false));
        Ok(HfTokenizer {
            tokenizer,
            templates,
            special_tokens,
            cutter,
            direct,
        })
    }

    /// Whether the model has a chat template.
    pub fn has_chat_template(&self) -> bool {
        !self.templates.is_empty()
    }

    /// Tokenize `text`, with the post-processor's special tokens (BOS) when asked.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        match &self.direct {
            Some(d) => d.encode(&self.tokenizer, text, add_special_tokens),
            None => self.encode_reference(text, add_special_tokens),
        }
    }

    /// Whether [`HfTokenizer::encode`] runs the direct encoder ([`byte_level`]) rather than
    /// `tokenizers`' pipeline.
    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// The ids `tokenizers`' own pipeline gives (what [`HfTokenizer::encode`] must equal).
    pub fn encode_reference(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        let enc = guarded(|| self.tokenizer.encode_fast(text, add_special_tokens))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Tokenize `text` without special tokens, with each token's byte span in `text`.
    pub fn encode_with_offsets(&self, text: &str) -> Result<(Vec<u32>, Vec<Span>), TokenizeError> {
        let enc = guarded(|| self.tokenizer.encode(text, false))?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    /// Render a chat request to the prompt text vLLM tokenizes.
    pub fn render_chat(&self, req: &ChatRequest) -> Result<String, TokenizeError> {
        template::render(self, req)
    }

    /// The prompt token ids of a `/v1/chat/completions` body.
    pub fn chat_ids(&self, body: &[u8]) -> Result<Vec<u32>, TokenizeError> {
        let req = ChatRequest::from_body(body)?;
        let text = self.render_chat(&req)?;
        self.encode(&text, false)
    }

    /// The prompt token ids of a `/v1/completions` body with a text prompt (a single string,
    /// or a list of one string). Token-id prompts are the caller's (they are used as given).
    pub fn completion_ids(&self, body: &[u8]) -> Result<Vec<u32>, TokenizeError> {
        let req: CompletionBody = serde_json::from_slice(body)
            .map_err(|e| TokenizeError::InvalidRequest(e.to_string()))?;
        let text = match req.prompt {
            CompletionPrompt::One(s) => s,
            CompletionPrompt::Many(mut v) if v.len() == 1 => v.swap_remove(0),
            CompletionPrompt::Many(_) => return Err(TokenizeError::Unsupported("several prompts")),
        };
        self.encode(&text, req.add_special_tokens.unwrap_or(true))
    }

    /// Byte offsets in `text` (ascending, each `< text.len()` and `> 0`) where tokenizing
    /// `text[..c]` and `text[c..]` separately and concatenating equals tokenizing `text`, with
    /// special tokens off; `None` when this tokenizer offers no such guarantee (see [`cuts`]).
    pub fn safe_cuts(&self, text: &str) -> Option<Vec<usize>> {
        self.cutter.as_ref().map(|c| c.cuts(text))
    }

    pub(crate) fn special_tokens(&self) -> &[(String, String)] {
        &self.special_tokens
    }

    pub(crate) fn templates(&self) -> &template::Templates {
        &self.templates
    }
}

fn bos_eos_processor(
    bos: Option<(String, u32)>,
    eos: Option<(String, u32)>,
) -> Result<tokenizers::processors::PostProcessorWrapper, String> {
    use tokenizers::processors::template::TemplateProcessing;
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut specials = Vec::new();
    if let Some((t, id)) = &bos {
        single.push(format!("{t}:0"));
        specials.push((t.clone(), *id));
    }
    single.push("$A:0".to_owned());
    if let Some((t, id)) = &eos {
        single.push(format!("{t}:0"));
        specials.push((t.clone(), *id));
    }
    pair.extend(single.iter().cloned());
    if let Some((t, _)) = &bos {
        pair.push(format!("{t}:1"));
    }
    pair.push("$B:1".to_owned());
    if let Some((t, _)) = &eos {
        pair.push(format!("{t}:1"));
    }
    let tp = TemplateProcessing::builder()
        .try_single(single.join(" "))
        .and_then(|b| b.try_pair(pair.join(" ")))
        .map_err(|e| e.to_string())?
        .special_tokens(specials)
        .build()
        .map_err(|e| e.to_string())?;
    Ok(tp.into())
}

#[derive(Deserialize)]
struct CompletionBody {
    prompt: CompletionPrompt,
    #[serde(default)]
    add_special_tokens: Option<bool>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum CompletionPrompt {
    One(String),
    Many(Vec<String>),
}

#[cfg(test)]
mod tests;
