//! A direct encoder for GPT-2-style byte-level BPE tokenizers: the same ids as `tokenizers`'
//! `encode`, without its offset-tracking machinery.
//!
//! Why. A precise routing decision tokenizes the new part of every prompt, and in `tokenizers`
//! most of that time is not BPE: a 32k-character chat decision spent 25 % in the pre-tokenizer's
//! regex (Oniguruma, ~100 ns a character) and 20 % in `NormalizedString::transform` keeping the
//! byte-level characters aligned with the input (bench/results/kv-perf-2026-12-01.md, Session 5).
//! Routing needs the ids only, so this module does the same four stages directly:
//!
//! 1. **Added tokens**: the text is split on the added tokens whose `normalized` flag is false
//!    (one leftmost-longest Aho-Corasick scan), then each remaining piece on the `normalized`
//!    ones — the two scans `tokenizers` makes (no normalizer here, so the normalized text is the
//!    text). A match is its token's id.
//! 2. **Pre-tokenizer** (`ByteLevel` with `use_regex`): each piece is cut where GPT-2's pattern
//!    `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+` cuts it,
//!    by a hand-written scanner over character classes ([`split_gpt2`]). Leftmost-first
//!    alternation gives these rules at each position: a contraction; else an optional U+0020
//!    and a run of letters, of numbers, or of "other" characters; else a whitespace run, less
//!    its last character when a non-space follows it and the run is longer than one (the
//!    lookahead's backtrack).
//! 3. **Byte-level map**: every byte of a pre-token becomes GPT-2's printable stand-in
//!    character.
//! 4. **BPE**: the tokenizer's own BPE model (`Model::tokenize`, its merges and word cache),
//!    so merging cannot differ.
//!
//! With `add_special_tokens`, the post-processor's ids around a single sequence are found once
//! at load (the processor run on a one-token encoding) and added around the ids.
//!
//! Character classes are exact by construction: `\p{L}`, `\p{N}` and `\s` are read from the
//! regex engine `tokenizers` itself runs (its `SysRegex`), over every Unicode scalar value, once
//! per process ([`Classes`], ~20 ms); ASCII is then a table lookup, the rest a binary search
//! over ~1,500 ranges.
//!
//! Any other shape — a normalizer, another pre-tokenizer or split pattern, `add_prefix_space`,
//! added tokens with `lstrip`/`rstrip`/`single_word`, `encode_special_tokens`, truncation or
//! padding, a non-BPE model — gets no encoder (`None`) and is encoded by `tokenizers` as before.
//! The differential tests in `tests.rs` compare both on random text from a hostile alphabet.

use std::sync::OnceLock;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use tokenizers::models::ModelWrapper;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{Encoding, Model, Tokenizer};

use crate::TokenizeError;

/// The character classes GPT-2's pattern distinguishes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Letter,
    Number,
    Space,
    Other,
}

/// `\p{L}`, `\p{N}`, `\s` as the regex engine of `tokenizers` sees them.
struct Classes {
    ascii: [Class; 128],
    /// Non-ASCII ranges of letters, numbers and spaces: (first, last, class), ascending,
    /// disjoint; every other character is `Other`.
    ranges: Vec<(u32, u32, Class)>,
}

impl Classes {
    fn get() -> &'static Classes {
        static CLASSES: OnceLock<Classes> = OnceLock::new();
        CLASSES.get_or_init(Classes::read_engine)
    }

    /// Run `\p{L}+`, `\p{N}+` and `\s+` over a string of every scalar value, in order.
    fn read_engine() -> Classes {
        let all: String = (0..=char::MAX as u32).filter_map(char::from_u32).collect();
        let mut found: Vec<(u32, u32, Class)> = Vec::new();
        for (pattern, class) in [
            (r"\p{L}+", Class::Letter),
            (r"\p{N}+", Class::Number),
            (r"\s+", Class::Space),
        ] {
            // The patterns are constants; a failure to compile one would be a bug in the engine
            // build, and leaves that class empty (the differential tests would catch it).
            let Ok(re) = tokenizers::utils::SysRegex::new(pattern) else {
                continue;
            };
            for (s, e) in re.find_iter(&all) {
                let first = all[s..].chars().next();
                let last = all[..e].chars().next_back();
                if let (Some(f), Some(l)) = (first, last) {
                    found.push((f as u32, l as u32, class));
                }
            }
        }
        let mut ascii = [Class::Other; 128];
        for &(f, l, class) in &found {
            for c in f..=l.min(127) {
                ascii[c as usize] = class;
            }
        }
        let mut ranges: Vec<(u32, u32, Class)> = found
            .into_iter()
            .filter(|&(_, l, _)| l >= 128)
            .map(|(f, l, c)| (f.max(128), l, c))
            .collect();
        ranges.sort_unstable_by_key(|r| r.0);
        Classes { ascii, ranges }
    }

    #[inline]
    fn of(&self, c: char) -> Class {
        let u = c as u32;
        if u < 128 {
            return self.ascii[u as usize];
        }
        let i = self.ranges.partition_point(|r| r.0 <= u);
        match i.checked_sub(1).and_then(|i| self.ranges.get(i)) {
            Some(&(_, last, class)) if u <= last => class,
            _ => Class::Other,
        }
    }
}

/// The first character of `s` and its length in bytes (`s` not empty).
#[inline]
fn first_char(s: &str) -> Option<(char, usize)> {
    let c = s.chars().next()?;
    Some((c, c.len_utf8()))
}

/// Call `emit` with each pre-token of `text` under GPT-2's pattern, in order; the pre-tokens
/// tile `text`.
fn split_gpt2<'t>(text: &'t str, classes: &Classes, mut emit: impl FnMut(&'t str)) {
    let mut i = 0;
    while let Some(rest) = text.get(i..).filter(|r| !r.is_empty()) {
        let bytes = rest.as_bytes();
        // 's 't 're 've 'm 'll 'd
        if bytes[0] == b'\'' {
            let n = match bytes.get(1..3) {
                Some(b"re" | b"ve" | b"ll") => 3,
                _ => match bytes.get(1) {
                    Some(b's' | b't' | b'm' | b'd') => 2,
                    _ => 0,
                },
            };
            if n > 0 {
                emit(&rest[..n]);
                i += n;
                continue;
            }
        }
        let Some((c, w)) = first_char(rest) else {
            break;
        };
        let mut class = classes.of(c);
        // An optional U+0020 before a run of letters, numbers or others.
        let mut run_start = 0;
        if c == ' ' {
            if let Some((c2, _)) = first_char(&rest[w..]) {
                let k = classes.of(c2);
                if k != Class::Space {
                    class = k;
                    run_start = w;
                }
            }
        }
        let mut end = run_start;
        let mut last_start = run_start;
        let mut count = 0usize;
        for (off, ch) in rest[run_start..].char_indices() {
            if classes.of(ch) != class {
                break;
            }
            last_start = run_start + off;
            end = last_start + ch.len_utf8();
            count += 1;
        }
        let take = if class == Class::Space && end < rest.len() && count > 1 {
            // `\s+(?!\S)`: a non-space follows, so the run gives back its last character.
            last_start
        } else {
            end
        };
        emit(&rest[..take]);
        i += take;
    }
}

/// GPT-2's byte → printable character map (the byte-level alphabet).
fn byte_chars() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            u32::from(b)
        } else {
            let c = next;
            next += 1;
            c
        };
        map[usize::from(b)] = char::from_u32(code).unwrap_or('\0');
    }
    map
}

/// One scan of the added tokens: the matcher and each pattern's id.
struct AddedScan {
    matcher: AhoCorasick,
    ids: Vec<u32>,
}

impl AddedScan {
    fn new(tokens: Vec<(&str, u32)>) -> Option<Option<AddedScan>> {
        if tokens.is_empty() {
            return Some(None);
        }
        let matcher = AhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build(tokens.iter().map(|t| t.0))
            .ok()?;
        Some(Some(AddedScan {
            matcher,
            ids: tokens.iter().map(|t| t.1).collect(),
        }))
    }
}

/// The direct encoder of one tokenizer (see the module doc).
pub struct ByteLevelBpe {
    raw: Option<AddedScan>,
    normalized: Option<AddedScan>,
    /// The post-processor's ids before and after a single sequence.
    special_before: Vec<u32>,
    special_after: Vec<u32>,
    bytes: [char; 256],
    classes: &'static Classes,
}

impl ByteLevelBpe {
    /// The encoder for `tok`, or `None` when `tok` is not of the shape this module reproduces.
    pub fn new(tok: &Tokenizer) -> Option<ByteLevelBpe> {
        if tok.get_normalizer().is_some()
            || tok.get_truncation().is_some()
            || tok.get_padding().is_some()
            || tok.get_encode_special_tokens()
        {
            return None;
        }
        match tok.get_pre_tokenizer() {
            Some(PreTokenizerWrapper::ByteLevel(b)) if b.use_regex && !b.add_prefix_space => {}
            _ => return None,
        }
        let ModelWrapper::BPE(_) = tok.get_model() else {
            return None;
        };
        let added = tok.get_added_tokens_decoder();
        if added
            .values()
            .any(|t| t.lstrip || t.rstrip || t.single_word)
        {
            return None;
        }
        let mut raw: Vec<(&str, u32)> = Vec::new();
        let mut normalized: Vec<(&str, u32)> = Vec::new();
        let mut ids: Vec<&u32> = added.keys().collect();
        ids.sort_unstable();
        for id in ids {
            let t = &added[id];
            if t.content.is_empty() {
                continue;
            }
            if t.normalized {
                normalized.push((&t.content, *id));
            } else {
                raw.push((&t.content, *id));
            }
        }
        let (special_before, special_after) = special_frame(tok)?;
        Some(ByteLevelBpe {
            raw: AddedScan::new(raw)?,
            normalized: AddedScan::new(normalized)?,
            special_before,
            special_after,
            bytes: byte_chars(),
            classes: Classes::get(),
        })
    }

    /// `tok`'s ids of `text` (`tok` the tokenizer this encoder was made from).
    pub fn encode(
        &self,
        tok: &Tokenizer,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        let ModelWrapper::BPE(bpe) = tok.get_model() else {
            return Err(TokenizeError::Tokenizer("not a BPE model".into()));
        };
        let mut ids = Vec::with_capacity(text.len() / 3 + 8);
        if add_special_tokens {
            ids.extend_from_slice(&self.special_before);
        }
        let mut mapped = String::new();
        let mut failed: Option<String> = None;
        let mut piece = |p: &str, ids: &mut Vec<u32>| {
            split_gpt2(p, self.classes, |word| {
                if failed.is_some() {
                    return;
                }
                mapped.clear();
                mapped.extend(word.bytes().map(|b| self.bytes[usize::from(b)]));
                match bpe.tokenize(&mapped) {
                    Ok(tokens) => ids.extend(tokens.iter().map(|t| t.id)),
                    Err(e) => failed = Some(e.to_string()),
                }
            })
        };
        split_added(text, self.raw.as_ref(), &mut ids, |gap, ids| {
            split_added(gap, self.normalized.as_ref(), ids, &mut piece)
        });
        if let Some(e) = failed {
            return Err(TokenizeError::Tokenizer(e));
        }
        if add_special_tokens {
            ids.extend_from_slice(&self.special_after);
        }
        Ok(ids)
    }
}

/// Push the id of every `scan` match in `text` and call `gap` with the text between them.
fn split_added<'t>(
    text: &'t str,
    scan: Option<&AddedScan>,
    ids: &mut Vec<u32>,
    mut gap: impl FnMut(&'t str, &mut Vec<u32>),
) {
    let Some(scan) = scan else {
        if !text.is_empty() {
            gap(text, ids);
        }
        return;
    };
    let mut at = 0;
    for m in scan.matcher.find_iter(text) {
        if let Some(g) = text.get(at..m.start()).filter(|g| !g.is_empty()) {
            gap(g, ids);
        }
        if let Some(&id) = scan.ids.get(m.pattern().as_usize()) {
            ids.push(id);
        }
        at = m.end();
    }
    if let Some(g) = text.get(at..).filter(|g| !g.is_empty()) {
        gap(g, ids);
    }
}

/// The ids the post-processor puts before and after a single sequence: it is run on a
/// one-token encoding whose id is a sentinel. `None` when the sentinel does not come out
/// exactly once (a processor that repeats or drops the sequence).
fn special_frame(tok: &Tokenizer) -> Option<(Vec<u32>, Vec<u32>)> {
    const SENTINEL: u32 = u32::MAX;
    let one = Encoding::new(
        vec![SENTINEL],
        vec![0],
        vec![String::new()],
        vec![Some(0)],
        vec![(0, 0)],
        vec![0],
        vec![1],
        Vec::new(),
        Default::default(),
    );
    let framed = tok.post_process(one, None, true).ok()?;
    let ids = framed.get_ids();
    let at = ids.iter().position(|&i| i == SENTINEL)?;
    if ids.iter().filter(|&&i| i == SENTINEL).count() != 1 {
        return None;
    }
    Some((ids[..at].to_vec(), ids[at + 1..].to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(text: &str) -> Vec<&str> {
        let mut out = Vec::new();
        split_gpt2(text, Classes::get(), |w| out.push(w));
        out
    }

    #[test]
    fn the_pattern_s_rules_one_by_one() {
        assert_eq!(split("don't"), ["don", "'t"]);
        assert_eq!(split("we're 'x"), ["we", "'re", " '", "x"]);
        assert_eq!(split("a  b"), ["a", " ", " b"]);
        assert_eq!(split("a \n b"), ["a", " \n", " b"]);
        assert_eq!(split("a\n\nb"), ["a", "\n", "\n", "b"]);
        assert_eq!(split("x   "), ["x", "   "]);
        assert_eq!(split("12ab !?"), ["12", "ab", " !?"]);
        assert_eq!(split("!'s"), ["!'", "s"]);
        assert_eq!(split(" é中 ٣"), [" é中", " ٣"]);
    }

    #[test]
    fn the_byte_alphabet_is_a_bijection_onto_printables() {
        let m = byte_chars();
        let mut seen: Vec<char> = m.to_vec();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 256);
        assert_eq!((m[b'a' as usize], m[b' ' as usize], m[0]), ('a', 'Ġ', 'Ā'));
    }
}
