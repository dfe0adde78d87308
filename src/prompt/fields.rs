//! Checks of the request fields the router reads, made while the body is parsed once: a
//! bounded `messages` array, a typed `prompt` shape, and the numeric ranges a backend would
//! refuse anyway, so such requests get a 400 naming the field before any backend sees them.
//!
//! The numeric ranges are the ones vLLM's own `SamplingParams` enforces, so nothing vLLM would
//! serve is refused here. JSON cannot spell NaN or infinity, and a number too large for an
//! `f64` (`1e999`) is already a parse error, so every number that reaches these checks is
//! finite.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::error::Error;

/// Most messages ever held in memory for one request, whatever `limits.max_messages` says: a
/// 32 MiB body of `{"role":"u"},` would otherwise become ~2.5 M message structs.
pub const MAX_MESSAGES_CEILING: usize = 100_000;

/// What the router refuses while parsing, from the config.
#[derive(Debug, Clone, Copy)]
pub struct ParseLimits {
    /// Most messages in a chat request (at most [`MAX_MESSAGES_CEILING`]).
    pub max_messages: usize,
}

impl Default for ParseLimits {
    fn default() -> Self {
        ParseLimits {
            max_messages: 10_000,
        }
    }
}

pub(crate) fn invalid_param(param: impl Into<String>, message: impl Into<String>) -> Error {
    Error::InvalidParam {
        param: param.into(),
        message: message.into(),
    }
}

/// The `messages` array: at most [`MAX_MESSAGES_CEILING`] elements are kept, the rest are
/// only counted (and skipped without allocating).
pub(crate) struct Bounded<T> {
    pub list: Vec<T>,
    pub total: usize,
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Bounded<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = Bounded<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut list = Vec::new();
                while list.len() < MAX_MESSAGES_CEILING {
                    match seq.next_element::<T>()? {
                        Some(item) => list.push(item),
                        None => {
                            let total = list.len();
                            return Ok(Bounded { list, total });
                        }
                    }
                }
                let mut total = list.len();
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    total = total.saturating_add(1);
                }
                Ok(Bounded { list, total })
            }
        }
        d.deserialize_seq(V(PhantomData))
    }
}

/// A completions `prompt`, or the reason it has none of the allowed shapes. The shape is
/// decided while parsing (no buffering of the value as serde's untagged enums do, no matching
/// of error texts afterwards).
#[derive(Debug)]
pub(crate) enum Prompt<'a> {
    Text(Cow<'a, str>),
    Texts(Vec<Cow<'a, str>>),
    Tokens(Vec<u32>),
    TokenBatches(Vec<Vec<u32>>),
    Invalid,
}

pub(crate) const PROMPT_SHAPES: &str = "`prompt` must be a string, an array of strings, an array of token ids or an array of token-id arrays";

/// Skip the rest of a sequence.
fn drain_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

/// Skip the rest of a map.
fn drain_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

/// Whether a top-level key is in the body at all, whatever its value (`null` included); the
/// value itself is skipped without being kept.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Present(pub bool);

impl<'de> Deserialize<'de> for Present {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        IgnoredAny::deserialize(d)?;
        Ok(Present(true))
    }
}

/// A token id (`u32`), or `None` for any other value (skipped).
struct TokenId(Option<u32>);

impl<'de> Deserialize<'de> for TokenId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TokenId;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a token id")
            }
            fn visit_u64<E>(self, v: u64) -> Result<TokenId, E> {
                Ok(TokenId(u32::try_from(v).ok()))
            }
            fn visit_i64<E>(self, _: i64) -> Result<TokenId, E> {
                Ok(TokenId(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<TokenId, E> {
                Ok(TokenId(None))
            }
            fn visit_bool<E>(self, _: bool) -> Result<TokenId, E> {
                Ok(TokenId(None))
            }
            fn visit_str<E>(self, _: &str) -> Result<TokenId, E> {
                Ok(TokenId(None))
            }
            fn visit_unit<E>(self) -> Result<TokenId, E> {
                Ok(TokenId(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<TokenId, A::Error> {
                drain_seq(seq)?;
                Ok(TokenId(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<TokenId, A::Error> {
                drain_map(map)?;
                Ok(TokenId(None))
            }
        }
        d.deserialize_any(V)
    }
}

/// One element of a prompt array.
enum Item<'a> {
    Text(Cow<'a, str>),
    Token(u32),
    Tokens(Vec<u32>),
    Invalid,
}

impl<'de: 'a, 'a> Deserialize<'de> for Item<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Item<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string, a token id or an array of token ids")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Item<'a>, E> {
                Ok(Item::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Item<'a>, E> {
                Ok(Item::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Item<'a>, E> {
                Ok(u32::try_from(v).map_or(Item::Invalid, Item::Token))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Item<'a>, E> {
                Ok(Item::Invalid)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Item<'a>, E> {
                Ok(Item::Invalid)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Item<'a>, E> {
                Ok(Item::Invalid)
            }
            fn visit_unit<E>(self) -> Result<Item<'a>, E> {
                Ok(Item::Invalid)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Item<'a>, A::Error> {
                let mut tokens = Vec::new();
                while let Some(TokenId(t)) = seq.next_element::<TokenId>()? {
                    match t {
                        Some(t) => tokens.push(t),
                        None => {
                            drain_seq(seq)?;
                            return Ok(Item::Invalid);
                        }
                    }
                }
                Ok(Item::Tokens(tokens))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Item<'a>, A::Error> {
                drain_map(map)?;
                Ok(Item::Invalid)
            }
        }
        d.deserialize_any(V(PhantomData))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Prompt<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Prompt<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(PROMPT_SHAPES)
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Prompt<'a>, E> {
                Ok(Prompt::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Prompt<'a>, E> {
                Ok(Prompt::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Prompt<'a>, E> {
                Ok(Prompt::Invalid)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Prompt<'a>, E> {
                Ok(Prompt::Invalid)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Prompt<'a>, E> {
                Ok(Prompt::Invalid)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Prompt<'a>, E> {
                Ok(Prompt::Invalid)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Prompt<'a>, A::Error> {
                drain_map(map)?;
                Ok(Prompt::Invalid)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt<'a>, A::Error> {
                // The first element decides the shape; every other one must have it too.
                let mut prompt = match seq.next_element::<Item<'a>>()? {
                    None => return Ok(Prompt::Texts(Vec::new())),
                    Some(Item::Text(t)) => Prompt::Texts(vec![t]),
                    Some(Item::Token(t)) => Prompt::Tokens(vec![t]),
                    Some(Item::Tokens(t)) => Prompt::TokenBatches(vec![t]),
                    Some(Item::Invalid) => {
                        drain_seq(seq)?;
                        return Ok(Prompt::Invalid);
                    }
                };
                while let Some(item) = seq.next_element::<Item<'a>>()? {
                    match (&mut prompt, item) {
                        (Prompt::Texts(list), Item::Text(t)) => list.push(t),
                        (Prompt::Tokens(list), Item::Token(t)) => list.push(t),
                        (Prompt::TokenBatches(list), Item::Tokens(t)) => list.push(t),
                        _ => {
                            drain_seq(seq)?;
                            return Ok(Prompt::Invalid);
                        }
                    }
                }
                Ok(prompt)
            }
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// The sampling numbers a request may carry (`null` and absent alike are `None`), checked
/// against the ranges vLLM enforces. Integers are read as numbers and must be whole, as
/// vLLM's request models accept `16.0` for 16.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Numbers {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<f64>,
    pub min_p: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub max_tokens: Option<f64>,
    pub max_completion_tokens: Option<f64>,
    pub n: Option<f64>,
}

fn whole(v: f64) -> bool {
    v.fract() == 0.0
}

/// A field's name, its value, the rule in words, and the rule.
type Rule<'a> = (&'a str, Option<f64>, &'a str, fn(f64) -> bool);

impl Numbers {
    pub fn check(&self) -> Result<(), Error> {
        let rules: [Rule<'_>; 10] = [
            ("temperature", self.temperature, "must be ≥ 0", |v| {
                v >= 0.0
            }),
            ("top_p", self.top_p, "must be in (0, 1]", |v| {
                v > 0.0 && v <= 1.0
            }),
            ("top_k", self.top_k, "must be a whole number ≥ -1", |v| {
                whole(v) && v >= -1.0
            }),
            ("min_p", self.min_p, "must be in [0, 1]", |v| {
                (0.0..=1.0).contains(&v)
            }),
            (
                "presence_penalty",
                self.presence_penalty,
                "must be in [-2, 2]",
                |v| (-2.0..=2.0).contains(&v),
            ),
            (
                "frequency_penalty",
                self.frequency_penalty,
                "must be in [-2, 2]",
                |v| (-2.0..=2.0).contains(&v),
            ),
            (
                "repetition_penalty",
                self.repetition_penalty,
                "must be > 0",
                |v| v > 0.0,
            ),
            (
                "max_tokens",
                self.max_tokens,
                "must be a whole number ≥ 0",
                |v| whole(v) && v >= 0.0,
            ),
            (
                "max_completion_tokens",
                self.max_completion_tokens,
                "must be a whole number ≥ 0",
                |v| whole(v) && v >= 0.0,
            ),
            ("n", self.n, "must be a whole number ≥ 1", |v| {
                whole(v) && v >= 1.0
            }),
        ];
        for (name, value, rule, ok) in rules {
            if let Some(v) = value {
                if !ok(v) {
                    return Err(invalid_param(name, format!("`{name}` {rule}, got {v}")));
                }
            }
        }
        Ok(())
    }
}

/// Which payload field a content part of a known type must carry, and whether that payload
/// is an object whose `url` must be present (`image_url: {url}`) rather than the value itself.
pub(crate) fn required_payload(kind: &str) -> Option<(&'static str, Option<&'static str>)> {
    match kind {
        "text" | "input_text" => Some(("text", None)),
        "image_url" => Some(("image_url", Some("url"))),
        "video_url" => Some(("video_url", Some("url"))),
        "audio_url" => Some(("audio_url", Some("url"))),
        "input_audio" => Some(("input_audio", Some("data"))),
        _ => None,
    }
}
