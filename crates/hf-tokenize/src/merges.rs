//! BPE merges of one byte-level word, without `tokenizers`' per-word allocations.
//!
//! `tokenizers`' `BPE::tokenize` of a word maps it to a `String`, looks every character up in
//! the vocabulary by string, builds a `Word` (a symbol list and a heap of merge candidates),
//! clones a `String` per token and tries its own cache: ~470 ns a word that was never seen
//! (bench/results/tokenize-2026-12-02.md). Here the word's bytes index a 256-entry table of
//! their ids, and the merge loop runs over a fixed array.
//!
//! The rule is `tokenizers`' (`Word::merge_all`): repeatedly merge the adjacent pair with the
//! lowest merge rank, the leftmost of equal ones (equal ranks are the same pair twice), until
//! no adjacent pair has a merge. `tokenizers` pops (rank, position) from a heap and skips stale
//! entries; here each pair's rank is kept in an array, the minimum found by a scan, and only
//! the two pairs beside a merge are looked up again — the same sequence of merges. With
//! `ignore_merges` (Llama 3), a word that is itself in the vocabulary is that one token, as
//! `tokenizers` checks first.
//!
//! Words of more than [`MAX_SYMBOLS`] bytes are left to `tokenizers` (the scan is quadratic in
//! the word's length). A model with dropout, a continuing-subword prefix, an end-of-word suffix,
//! byte fallback, a byte whose character is not in the vocabulary, or two strings with one id
//! gets no [`Merges`].

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use tokenizers::models::bpe::BPE;

/// The longest word merged here (bytes).
pub const MAX_SYMBOLS: usize = 64;

/// A pair of ids as one `u64`, hashed by a folded multiply. The table is built from the
/// vocabulary at load and never grows, so lookups of client-chosen pairs cannot lengthen its
/// chains: no keyed hash needed.
#[derive(Default)]
pub struct PairHash(u64);

impl Hasher for PairHash {
    fn finish(&self) -> u64 {
        let m = u128::from(self.0) * 0x9e37_79b9_7f4a_7c15_u128;
        (m >> 64) as u64 ^ m as u64
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type PairMap = HashMap<u64, (u32, u32), BuildHasherDefault<PairHash>>;

fn pair(a: u32, b: u32) -> u64 {
    (u64::from(a) << 32) | u64::from(b)
}

/// One BPE model's merges, by ids.
pub struct Merges {
    byte_ids: [u32; 256],
    /// (left id, right id) → (rank, merged id).
    pairs: PairMap,
    /// With `ignore_merges`: every vocabulary token as raw bytes → its id.
    whole: Option<HashMap<Box<[u8]>, u32, ahash::RandomState>>,
}

impl Merges {
    /// The merges of `bpe`, whose byte-level alphabet is `bytes` (byte → character); `None`
    /// for a model this module does not reproduce (see the module doc).
    pub fn new(bpe: &BPE, bytes: &[char; 256]) -> Option<Merges> {
        if bpe.dropout.is_some_and(|d| d > 0.0)
            || bpe.continuing_subword_prefix.is_some()
            || bpe.end_of_word_suffix.is_some()
            || bpe.byte_fallback
        {
            return None;
        }
        let vocab = bpe.get_vocab();
        // Two strings with one id: the merged id rebuilt from a merge's strings could name the
        // other one.
        let distinct: std::collections::HashSet<u32> = vocab.values().copied().collect();
        if distinct.len() != vocab.len() {
            return None;
        }
        let mut byte_ids = [0u32; 256];
        for (b, c) in bytes.iter().enumerate() {
            byte_ids[b] = *vocab.get(c.to_string().as_str())?;
        }
        // The model serialises its merges in rank order, as (left, right) token strings.
        let json = serde_json::to_value(bpe).ok()?;
        let list = json.get("merges")?.as_array()?;
        let mut pairs = PairMap::with_capacity_and_hasher(list.len(), Default::default());
        for (rank, m) in list.iter().enumerate() {
            let (a, b) = match m {
                serde_json::Value::Array(ab) => match ab.as_slice() {
                    [a, b] => (a.as_str()?, b.as_str()?),
                    _ => return None,
                },
                serde_json::Value::String(s) => s.split_once(' ')?,
                _ => return None,
            };
            let merged = vocab.get(format!("{a}{b}").as_str())?;
            pairs.insert(
                pair(*vocab.get(a)?, *vocab.get(b)?),
                (u32::try_from(rank).ok()?, *merged),
            );
        }
        let whole = bpe.ignore_merges.then(|| {
            let mut char_byte: HashMap<char, u8> = HashMap::new();
            for (b, c) in bytes.iter().enumerate() {
                char_byte.insert(*c, b as u8);
            }
            vocab
                .iter()
                .filter_map(|(token, id)| {
                    let raw: Option<Vec<u8>> =
                        token.chars().map(|c| char_byte.get(&c).copied()).collect();
                    Some((raw?.into_boxed_slice(), *id))
                })
                .collect()
        });
        Some(Merges {
            byte_ids,
            pairs,
            whole,
        })
    }

    fn rank(&self, a: u32, b: u32) -> (u32, u32) {
        self.pairs
            .get(&pair(a, b))
            .copied()
            .unwrap_or((u32::MAX, 0))
    }

    /// Push the ids of `word` (raw bytes, not empty) onto `out`; false (nothing pushed) when
    /// it is longer than [`MAX_SYMBOLS`].
    pub fn word(&self, word: &[u8], out: &mut Vec<u32>) -> bool {
        let n = word.len();
        if n > MAX_SYMBOLS || n == 0 {
            return false;
        }
        if let Some(id) = self.whole.as_ref().and_then(|w| w.get(word)) {
            out.push(*id);
            return true;
        }
        let mut sym = [0u32; MAX_SYMBOLS];
        for (s, &b) in sym.iter_mut().zip(word) {
            *s = self.byte_ids[usize::from(b)];
        }
        // rank[i], merged[i]: the merge of the pair (sym[i], sym[i + 1]).
        let mut rank = [u32::MAX; MAX_SYMBOLS];
        let mut merged = [0u32; MAX_SYMBOLS];
        for i in 0..n - 1 {
            (rank[i], merged[i]) = self.rank(sym[i], sym[i + 1]);
        }
        let mut len = n;
        while len > 1 {
            let mut best = u32::MAX;
            let mut at = usize::MAX;
            for (i, &r) in rank[..len - 1].iter().enumerate() {
                if r < best {
                    best = r;
                    at = i;
                }
            }
            if at == usize::MAX {
                break;
            }
            sym[at] = merged[at];
            sym.copy_within(at + 2..len, at + 1);
            let tail = (at + 2).min(len - 1);
            rank.copy_within(tail..len - 1, at + 1);
            merged.copy_within(tail..len - 1, at + 1);
            len -= 1;
            if at + 1 < len {
                (rank[at], merged[at]) = self.rank(sym[at], sym[at + 1]);
            } else {
                rank[at] = u32::MAX;
            }
            if at > 0 {
                (rank[at - 1], merged[at - 1]) = self.rank(sym[at - 1], sym[at]);
            }
        }
        out.extend_from_slice(&sym[..len]);
        true
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tokenizers::models::ModelWrapper;
    use tokenizers::Model;

    fn fixture_bpe() -> BPE {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/tiny-llama/tokenizer.json"
        );
        match tokenizers::Tokenizer::from_file(path).unwrap().get_model() {
            ModelWrapper::BPE(b) => b.clone(),
            _ => panic!("not BPE"),
        }
    }

    /// Words: random bytes from a small alphabet (repeats make equal-rank pairs), the
    /// fixture's own tokens glued together, and long runs.
    fn words() -> Vec<Vec<u8>> {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let alphabet = b"aabbeenst  \n\n.,'\xc3\xa9\xe4\xb8";
        let mut out: Vec<Vec<u8>> = (0..5_000)
            .map(|_| {
                let len = 1 + (next() % 20) as usize;
                (0..len)
                    .map(|_| alphabet[(next() % alphabet.len() as u64) as usize])
                    .collect()
            })
            .collect();
        out.extend((1..=MAX_SYMBOLS).map(|n| vec![b' '; n]));
        out.extend((1..=MAX_SYMBOLS).map(|n| b"ab".repeat(n).into_iter().take(n).collect()));
        out.push(b" the model cache prefix token request".to_vec());
        out
    }

    fn check(bpe: &BPE) {
        let bytes = crate::byte_level::byte_chars();
        let m = Merges::new(bpe, &bytes).unwrap();
        for w in words() {
            let mapped: String = w.iter().map(|&b| bytes[usize::from(b)]).collect();
            let want: Vec<u32> = bpe
                .tokenize(&mapped)
                .unwrap()
                .iter()
                .map(|t| t.id)
                .collect();
            let mut got = Vec::new();
            assert!(m.word(&w, &mut got));
            assert_eq!(got, want, "word {:?}", String::from_utf8_lossy(&w));
        }
        let mut out = Vec::new();
        assert!(!m.word(&[b'a'; MAX_SYMBOLS + 1], &mut out));
        assert!(out.is_empty());
    }

    #[test]
    fn merges_give_the_ids_of_tokenizers_bpe() {
        check(&fixture_bpe());
    }

    #[test]
    fn ignore_merges_takes_a_whole_vocabulary_word_first() {
        let mut bpe = fixture_bpe();
        bpe.ignore_merges = true;
        check(&bpe);
        // A vocabulary word no merge sequence reaches: "abc" (merges give "a" + "bc").
        let bytes = crate::byte_level::byte_chars();
        let mut vocab: tokenizers::models::bpe::Vocab = bytes
            .iter()
            .enumerate()
            .map(|(i, c)| (c.to_string(), i as u32))
            .collect();
        for (i, t) in ["bc", "ab", "abc"].iter().enumerate() {
            vocab.insert((*t).to_owned(), 256 + i as u32);
        }
        let merges = vec![("b".into(), "c".into()), ("a".into(), "b".into())];
        for ignore in [false, true] {
            let bpe = BPE::builder()
                .vocab_and_merges(vocab.clone(), merges.clone())
                .ignore_merges(ignore)
                .build()
                .unwrap();
            let want: Vec<u32> = bpe.tokenize("abc").unwrap().iter().map(|t| t.id).collect();
            assert_eq!(want, if ignore { vec![258] } else { vec![97, 256] });
            let mut got = Vec::new();
            assert!(Merges::new(&bpe, &bytes).unwrap().word(b"abc", &mut got));
            assert_eq!(got, want, "ignore_merges {ignore}");
        }
    }
}
