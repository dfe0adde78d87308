//! Safe cut points: where a prompt text may be split so that the ids of the pieces,
//! concatenated, equal the ids of the whole (special tokens off).
//!
//! Why a cut right after an added token is safe. `tokenizers` encodes a text in two stages:
//! (1) it finds the added tokens whose `normalized` flag is false in the *raw* text with one
//! leftmost-longest Aho-Corasick scan and splits the text there; (2) every piece between those
//! matches is normalized, pre-tokenized and run through the model on its own (BPE merges never
//! cross a piece boundary; added tokens with `normalized = true` are only looked for inside a
//! piece). So if the scan over the whole text has a match ending at byte `c`, the pieces of
//! `text[..c]` are exactly the whole text's pieces left of `c` (a leftmost-longest scan of a
//! prefix finds the same matches up to a match that ends inside it), and the scan of `text[c..]`
//! starts where the whole text's scan resumed after that match. The ids are the pieces' ids in
//! order, hence `ids(text) == ids(text[..c]) ++ ids(text[c..])`.
//!
//! The argument needs the scan to be context-free, so the cutter is off (`None`) for a tokenizer
//! where it is not:
//! * an added token with `lstrip`, `rstrip` or `single_word` (its match depends on, or eats,
//!   characters beside it);
//! * a Metaspace pre-tokenizer with `prepend_scheme: "first"` (it treats the first piece of the
//!   *whole* text differently);
//! * truncation or padding configured in `tokenizer.json`.
//!
//! The cutter reproduces stage (1): the same patterns, the same match kind.

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};

/// Finds the raw-text added-token matches of one tokenizer.
pub struct Cutter {
    scan: AhoCorasick,
}

impl Cutter {
    /// `None` when the tokenizer has no raw-text added tokens or breaks the argument above.
    pub fn new(tok: &tokenizers::Tokenizer) -> Option<Cutter> {
        let added = tok.get_added_tokens_decoder();
        let raw: Vec<&tokenizers::AddedToken> = added.values().filter(|t| !t.normalized).collect();
        if raw.is_empty()
            || added
                .values()
                .any(|t| t.lstrip || t.rstrip || t.single_word)
        {
            return None;
        }
        if tok.get_truncation().is_some() || tok.get_padding().is_some() {
            return None;
        }
        let pre = serde_json::to_string(&tok.get_pre_tokenizer()).ok()?;
        let norm = serde_json::to_string(&tok.get_normalizer()).ok()?;
        if pre.contains("\"prepend_scheme\":\"first\"")
            || norm.contains("\"prepend_scheme\":\"first\"")
        {
            return None;
        }
        let scan = AhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build(raw.iter().map(|t| t.content.as_str()))
            .ok()?;
        Some(Cutter { scan })
    }

    /// The end offsets of every added-token match in `text`, ascending, excluding `0` and
    /// `text.len()` (cuts that split nothing).
    pub fn cuts(&self, text: &str) -> Vec<usize> {
        self.scan
            .find_iter(text)
            .map(|m| m.end())
            .filter(|&e| e > 0 && e < text.len())
            .collect()
    }
}
