//! A direct encoder for byte-level BPE tokenizers of the GPT-2, Llama 3 and Qwen2 families:
//! the same ids as `tokenizers`' `encode`, without its offset-tracking machinery.
//!
//! Why. A precise routing decision tokenizes the new part of every prompt, and in `tokenizers`
//! most of that time is not BPE: a 32k-character chat decision spent 25 % in the pre-tokenizer's
//! regex (Oniguruma, ~100 ns a character) and 20 % in `NormalizedString::transform` keeping the
//! byte-level characters aligned with the input (bench/results/kv-perf-2026-12-01.md, Session 5).
//! Routing needs the ids only, so this module does the same four stages directly:
//!
//! 1. **Added tokens**: the text is split on the added tokens whose `normalized` flag is false
//!    (one leftmost-longest Aho-Corasick scan), then each remaining piece on the `normalized`
//!    ones — the two scans `tokenizers` makes. A match is its token's id. With no normalizer
//!    the normalized text is the text; with NFC (Qwen2's) a piece that is not already NFC
//!    (`is_nfc`) is normalized by the crate `tokenizers` normalizes with, before the second
//!    scan and the rest.
//! 2. **Pre-tokenizer**: each piece is cut where the split pattern cuts it, by a hand-written
//!    scanner over character classes. GPT-2's pattern (`ByteLevel` with `use_regex`,
//!    `split_gpt2`) is
//!    `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`;
//!    Llama 3's and Qwen2's (a `Split` before `ByteLevel` without regex, `split_llama3`)
//!    differ in case-insensitive contractions, one non-letter before a letter run, numbers in
//!    runs of at most 3 (1 for Qwen2) and newlines kept at the end of a run. Leftmost-first
//!    alternation turns each pattern into a rule per position (see the functions). Any other
//!    pattern string gets no direct encoder.
//! 3. **Byte-level map**: every byte of a pre-token becomes GPT-2's printable stand-in
//!    character.
//! 4. **BPE**: the tokenizer's merges, applied by id ([`crate::merges`], `tokenizers`' rule)
//!    for words of up to 64 bytes, else by the tokenizer's own BPE model (`Model::tokenize`);
//!    either way behind a bounded word cache of this module's.
//!
//! With `add_special_tokens`, the post-processor's ids around a single sequence are found once
//! at load (the processor run on a one-token encoding) and added around the ids.
//!
//! Character classes are exact by construction: `\p{L}`, `\p{N}` and `\s` are read from the
//! regex engine `tokenizers` itself runs (its `SysRegex`), over every Unicode scalar value, once
//! per process at load (`Classes`, ~70 ms); ASCII is then a table lookup, the rest a binary
//! search over the ranges. Case folding in Llama 3's contractions follows Oniguruma's, written
//! out by hand: `ſ` (U+017F) is an `s`, and no other character folds to one of the contraction
//! letters (checked over every scalar value by a review, 2026-12-02; the engine-comparison test
//! has `ſ` and the Kelvin sign in its alphabet).
//!
//! Any other shape — another normalizer, pre-tokenizer or split pattern, `add_prefix_space`,
//! added tokens with `lstrip`/`rstrip`/`single_word`, listed twice (`HfTokenizer::from_dir`
//! checks the file) or with an id the model gives another string, `encode_special_tokens`,
//! truncation or padding, BPE dropout, a non-BPE model — gets no encoder (`None`) and is
//! encoded by `tokenizers` as before.
//! Tests (`tests.rs`): the pre-tokens equal the regex engine's matches of each pattern, and the
//! ids equal `tokenizers`' on random text from a hostile alphabet, for all three families.

use std::sync::{OnceLock, RwLock};

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use tokenizers::models::ModelWrapper;
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::{Encoding, Model, Tokenizer};
use unicode_normalization_alignments::is_nfc;
use unicode_normalization_alignments::UnicodeNormalization;

use crate::merges::Merges;
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
    /// `None` if the engine would not compile a class pattern (then no direct encoder).
    fn get() -> Option<&'static Classes> {
        static CLASSES: OnceLock<Option<Classes>> = OnceLock::new();
        CLASSES.get_or_init(Classes::read_engine).as_ref()
    }

    /// Run `\p{L}+`, `\p{N}+` and `\s+` over a string of every scalar value, in order.
    fn read_engine() -> Option<Classes> {
        let all: String = (0..=char::MAX as u32).filter_map(char::from_u32).collect();
        let mut found: Vec<(u32, u32, Class)> = Vec::new();
        for (pattern, class) in [
            (r"\p{L}+", Class::Letter),
            (r"\p{N}+", Class::Number),
            (r"\s+", Class::Space),
        ] {
            let re = tokenizers::utils::SysRegex::new(pattern).ok()?;
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
        Some(Classes { ascii, ranges })
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

/// The Llama 3 / Qwen2 pattern's contraction after an apostrophe, case-insensitively as
/// Oniguruma folds it (`ſ`, U+017F, folds to `s`): its length in bytes, or 0.
fn contraction_ci(after: &str) -> usize {
    let fold = |c: char| {
        if c == '\u{17f}' {
            's'
        } else {
            c.to_ascii_lowercase()
        }
    };
    let mut chars = after.chars();
    let Some(a) = chars.next() else {
        return 0;
    };
    match (fold(a), chars.next().map(fold)) {
        // Only ASCII folds to these: two bytes.
        ('r', Some('e')) | ('v', Some('e')) | ('l', Some('l')) => 2,
        ('s' | 't' | 'm' | 'd', _) => a.len_utf8(),
        _ => 0,
    }
}

/// Call `emit` with each pre-token of `text` under the pattern Llama 3 (`max_digits` 3) and
/// Qwen2 (`max_digits` 1) split with:
/// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`.
/// At each position, first match wins: a contraction; a letter run, with one character
/// before it that is neither `\r`, `\n`, a letter nor a number; up to `max_digits` numbers;
/// an optional U+0020, a run of others and any `\r`/`\n` after it; else a whitespace run cut
/// after its last `\r`/`\n` if it has one, else as in GPT-2's pattern.
fn split_llama3<'t>(
    text: &'t str,
    classes: &Classes,
    max_digits: usize,
    mut emit: impl FnMut(&'t str),
) {
    let run = |s: &str, class: Class| -> usize {
        s.char_indices()
            .find(|&(_, ch)| classes.of(ch) != class)
            .map_or(s.len(), |(off, _)| off)
    };
    let mut i = 0;
    while let Some(rest) = text.get(i..).filter(|r| !r.is_empty()) {
        if rest.as_bytes()[0] == b'\'' {
            let n = contraction_ci(&rest[1..]);
            if n > 0 {
                emit(&rest[..1 + n]);
                i += 1 + n;
                continue;
            }
        }
        let Some((c, w)) = first_char(rest) else {
            break;
        };
        let class = classes.of(c);
        let next = first_char(&rest[w..]).map(|(c2, _)| classes.of(c2));
        let take = match class {
            Class::Letter => run(rest, Class::Letter),
            _ if class != Class::Number
                && c != '\r'
                && c != '\n'
                && next == Some(Class::Letter) =>
            {
                w + run(&rest[w..], Class::Letter)
            }
            Class::Number => rest
                .char_indices()
                .take(max_digits)
                .take_while(|&(_, ch)| classes.of(ch) == Class::Number)
                .last()
                .map_or(w, |(off, ch)| off + ch.len_utf8()),
            Class::Other => newline_tail(rest, run(rest, Class::Other)),
            _ if c == ' ' && next == Some(Class::Other) => {
                newline_tail(rest, w + run(&rest[w..], Class::Other))
            }
            _ => {
                // Whitespace (`class` is Space here).
                let end = run(rest, Class::Space);
                let ws = &rest[..end];
                if let Some(p) = ws.rfind(['\r', '\n']) {
                    p + 1
                } else if end < rest.len() && ws.chars().nth(1).is_some() {
                    ws.char_indices().last().map_or(end, |(off, _)| off)
                } else {
                    end
                }
            }
        };
        emit(&rest[..take]);
        i += take;
    }
}

/// `end` extended over the `\r` and `\n` bytes that follow it in `s`.
fn newline_tail(s: &str, end: usize) -> usize {
    end + s.as_bytes()[end..]
        .iter()
        .take_while(|&&b| b == b'\r' || b == b'\n')
        .count()
}

/// GPT-2's byte → printable character map (the byte-level alphabet).
pub(crate) fn byte_chars() -> [char; 256] {
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

/// Llama 3's split pattern (`Sequence[Split(this, Isolated), ByteLevel(use_regex: false)]`).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's: Llama 3's with one digit a pre-token.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Which pattern the pre-tokenizer splits with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pattern {
    Gpt2,
    Llama3 { max_digits: usize },
}

impl Pattern {
    /// The pattern of a `ByteLevel(use_regex)` pre-tokenizer, or of a `Split` of a known
    /// pattern followed by `ByteLevel(use_regex: false)`; `add_prefix_space` off.
    fn of(pre: &serde_json::Value) -> Option<Pattern> {
        let byte_level = |v: &serde_json::Value, regex: bool| {
            v["type"] == "ByteLevel"
                && v["add_prefix_space"] == false
                && v.get("use_regex").and_then(|u| u.as_bool()).unwrap_or(true) == regex
        };
        if byte_level(pre, true) {
            return Some(Pattern::Gpt2);
        }
        let seq = pre
            .get("pretokenizers")
            .and_then(|s| s.as_array())
            .filter(|_| pre["type"] == "Sequence")?;
        let [split, bl] = seq.as_slice() else {
            return None;
        };
        if split["type"] != "Split"
            || split["behavior"] != "Isolated"
            || split["invert"] != false
            || !byte_level(bl, false)
        {
            return None;
        }
        match split["pattern"]["Regex"].as_str()? {
            LLAMA3_PATTERN => Some(Pattern::Llama3 { max_digits: 3 }),
            QWEN2_PATTERN => Some(Pattern::Llama3 { max_digits: 1 }),
            _ => None,
        }
    }
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

/// Words the cache keeps at most, and the longest word it keeps (bytes): worst case ~13 MB
/// (32,768 × a 64-byte key, 64 ids, two boxes and a table slot).
const WORD_CACHE_WORDS: usize = 32_768;
const WORD_CACHE_MAX_BYTES: usize = 64;

/// Pre-tokens already merged: the raw bytes → their ids. BPE of a word depends on the word
/// alone, so a hit is exact. `tokenizers` has a word cache too, but a hit there clones the
/// word and allocates a `String` per token (14 % of a cold 32k-character decision, plus the
/// allocator's share); here a hit copies ids. An encode tries the read lock once and adds its
/// new words (each once) under one tried write lock at the end; a lock that is busy is done
/// without, never waited for. Once full, new words are merged every time (as `tokenizers`'
/// cache does). Keys come from clients: the map hashes with a random
/// key (`ahash::RandomState`).
type WordMap = std::collections::HashMap<Box<[u8]>, Box<[u32]>, ahash::RandomState>;

/// The direct encoder of one tokenizer (see the module doc).
pub struct ByteLevelBpe {
    words: RwLock<WordMap>,
    /// The model's merges by id ([`crate::merges`]), when it has that shape.
    merges: Option<Merges>,
    pattern: Pattern,
    /// An NFC normalizer (Qwen2's): pieces that are not already NFC are normalized first.
    nfc: bool,
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
        if tok.get_truncation().is_some()
            || tok.get_padding().is_some()
            || tok.get_encode_special_tokens()
        {
            return None;
        }
        let nfc = match tok.get_normalizer() {
            None => false,
            Some(NormalizerWrapper::NFC(_)) => true,
            Some(_) => return None,
        };
        let pattern = Pattern::of(&serde_json::to_value(tok.get_pre_tokenizer()?).ok()?)?;
        let ModelWrapper::BPE(bpe) = tok.get_model() else {
            return None;
        };
        // Dropout makes `tokenizers`' ids random: nothing to reproduce (or cache).
        if bpe.dropout.is_some_and(|d| d > 0.0) {
            return None;
        }
        let bytes = byte_chars();
        let merges = Merges::new(bpe, &bytes);
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
            // An added token whose id is another string's in the model: which one `tokenizers`
            // emits depends on its internals, so do not guess.
            if bpe.id_to_token(*id).is_some_and(|m| m != t.content) {
                return None;
            }
            if t.normalized {
                if nfc && !is_nfc(&t.content) {
                    return None;
                }
                normalized.push((&t.content, *id));
            } else {
                raw.push((&t.content, *id));
            }
        }
        let (special_before, special_after) = special_frame(tok)?;
        Some(ByteLevelBpe {
            words: RwLock::new(WordMap::default()),
            merges,
            pattern,
            nfc,
            raw: AddedScan::new(raw)?,
            normalized: AddedScan::new(normalized)?,
            special_before,
            special_after,
            bytes,
            classes: Classes::get()?,
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
        // The shared cache is only tried, never waited for: a reader that finds a writer in
        // (or a writer that finds readers) goes on without it, so one long encode cannot hold
        // up another request's.
        let known = self.words.try_read().ok();
        let room = known
            .as_ref()
            .map_or(0, |k| WORD_CACHE_WORDS.saturating_sub(k.len()));
        // Words merged during this encode (each once, however often it repeats).
        let mut new_words = WordMap::default();
        let mut word = |word: &str, ids: &mut Vec<u32>| {
            if failed.is_some() {
                return;
            }
            let key = word.as_bytes();
            if let Some(hit) = known
                .as_ref()
                .and_then(|k| k.get(key))
                .or_else(|| new_words.get(key))
            {
                ids.extend_from_slice(hit);
                return;
            }
            let start = ids.len();
            let merged_here = self.merges.as_ref().is_some_and(|m| m.word(key, ids));
            if !merged_here {
                mapped.clear();
                mapped.extend(word.bytes().map(|b| self.bytes[usize::from(b)]));
                match bpe.tokenize(&mapped) {
                    Ok(tokens) => ids.extend(tokens.iter().map(|t| t.id)),
                    Err(e) => {
                        failed = Some(e.to_string());
                        return;
                    }
                }
            }
            if key.len() <= WORD_CACHE_MAX_BYTES && new_words.len() < room {
                let merged = ids.get(start..).unwrap_or_default();
                new_words.insert(key.into(), merged.into());
            }
        };
        let mut piece = |p: &str, ids: &mut Vec<u32>| match self.pattern {
            Pattern::Gpt2 => split_gpt2(p, self.classes, |w| word(w, ids)),
            Pattern::Llama3 { max_digits } => {
                split_llama3(p, self.classes, max_digits, |w| word(w, ids))
            }
        };
        split_added(text, self.raw.as_ref(), &mut ids, |gap, ids| {
            if self.nfc && !is_nfc(gap) {
                // What `tokenizers`' NFC normalizer makes of the piece (the same crate), then
                // the same steps on the normalized text.
                let normalized: String = gap.nfc().map(|(c, _)| c).collect();
                split_added(&normalized, self.normalized.as_ref(), ids, &mut piece)
            } else {
                split_added(gap, self.normalized.as_ref(), ids, &mut piece)
            }
        });
        drop(known);
        if !new_words.is_empty() {
            if let Ok(mut words) = self.words.try_write() {
                for (k, v) in new_words {
                    if words.len() >= WORD_CACHE_WORDS {
                        break;
                    }
                    words.insert(k, v);
                }
            }
        }
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

/// The pre-tokens of `text` under GPT-2's pattern, or Llama 3's with `max_digits`.
#[cfg(test)]
pub(crate) fn pre_tokens(text: &str, llama3_digits: Option<usize>) -> Vec<&str> {
    let Some(classes) = Classes::get() else {
        panic!("the regex engine gave no character classes");
    };
    let mut out = Vec::new();
    match llama3_digits {
        None => split_gpt2(text, classes, |w| out.push(w)),
        Some(d) => split_llama3(text, classes, d, |w| out.push(w)),
    }
    out
}

/// The patterns, for tests that run them on the regex engine.
#[cfg(test)]
pub(crate) const PATTERNS: [(&str, Option<usize>); 3] = [
    (
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
        None,
    ),
    (LLAMA3_PATTERN, Some(3)),
    (QWEN2_PATTERN, Some(1)),
];

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn split(text: &str) -> Vec<&str> {
        let mut out = Vec::new();
        split_gpt2(text, Classes::get().unwrap(), |w| out.push(w));
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

    /// The fixture's tokenizer and its direct encoder.
    fn fixture() -> (Tokenizer, ByteLevelBpe) {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/tiny-llama/tokenizer.json"
        );
        let tok = Tokenizer::from_file(path).unwrap();
        let enc = ByteLevelBpe::new(&tok).unwrap();
        (tok, enc)
    }

    #[test]
    fn the_word_cache_is_bounded_and_its_hits_are_exact() {
        let (tok, enc) = fixture();
        // 40,000 distinct letter words, and one longer than the cache keeps.
        let word = |mut i: usize| {
            let mut w = String::from(" ");
            for _ in 0..4 {
                w.push(char::from(b'a' + (i % 26) as u8));
                i /= 26;
            }
            w
        };
        let mut text: String = (0..40_000).map(word).collect();
        text.push(' ');
        text.push_str(&"q".repeat(WORD_CACHE_MAX_BYTES + 1));
        let want = tok
            .encode_fast(text.as_str(), false)
            .unwrap()
            .get_ids()
            .to_vec();
        for _ in 0..2 {
            assert_eq!(enc.encode(&tok, &text, false).unwrap(), want);
        }
        let words = enc.words.read().unwrap();
        assert_eq!(words.len(), WORD_CACHE_WORDS);
        assert!(words.keys().all(|k| k.len() <= WORD_CACHE_MAX_BYTES));
    }

    /// An encode never waits for the word cache: with its write lock held elsewhere (a writer
    /// in) it encodes without the cache; with a read lock held elsewhere it does not add its
    /// words. (A blocking `read()`/`write()` here would deadlock this thread.)
    #[test]
    fn a_busy_word_cache_is_done_without() {
        let (tok, enc) = fixture();
        let text = "the model cache prefix token request server";
        let want = tok.encode_fast(text, false).unwrap().get_ids().to_vec();
        {
            let _writer = enc.words.write().unwrap();
            assert_eq!(enc.encode(&tok, text, false).unwrap(), want);
        }
        {
            let _reader = enc.words.read().unwrap();
            assert_eq!(enc.encode(&tok, text, false).unwrap(), want);
        }
        assert!(
            enc.words.read().unwrap().is_empty(),
            "added while a reader held it"
        );
        assert_eq!(enc.encode(&tok, text, false).unwrap(), want);
        assert_eq!(enc.words.read().unwrap().len(), 7);
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
