//! Prefix cache of token ids: the ids of a rendered prompt's prefix, found again when the next
//! request starts with the same text (a repeated system prompt, earlier turns of a chat).
//!
//! Only prefixes that end at a *safe cut* are stored ([`hf_tokenize::cuts`]: right after an
//! added token such as the template's `<|end|>`), because there `ids(whole) == ids(prefix) ++
//! ids(rest)` holds exactly; at any other byte a BPE merge may cross the boundary. A lookup
//! hashes the text once (a chained XXH3 over the pieces between cuts, so every cut's key comes
//! out of one pass), probes the cuts from the longest down, tokenizes only the text after the
//! hit, and stores the new cuts. The pieces are tokenized separately, which is exact by the
//! same argument, and gives each cut's token count without offsets.
//!
//! Bounded: moka with a weigher in tokens (`tokenization.prefix_cache_tokens`); entries of one
//! request share one id buffer, so the weights over-count and the real memory is below
//! 4 bytes × the bound. At most [`MAX_NEW_CUTS`] entries per request. Keys are 64-bit hashes
//! with the prefix length mixed in; a collision would give a request wrong ids, which can only
//! misroute it (the body sent to vLLM is never changed).

use std::sync::Arc;

use hf_tokenize::{HfTokenizer, TokenizeError};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// New entries stored per request (the last cut always, the rest spread evenly).
pub const MAX_NEW_CUTS: usize = 32;

#[derive(Clone)]
struct Entry {
    ids: Arc<[u32]>,
    len: usize,
}

pub struct PrefixCache {
    cache: Option<moka::sync::Cache<u64, Entry>>,
}

impl PrefixCache {
    /// A cache holding about `max_tokens` token ids; 0 disables it.
    pub fn new(max_tokens: u64) -> PrefixCache {
        let cache = (max_tokens > 0).then(|| {
            moka::sync::Cache::builder()
                .max_capacity(max_tokens)
                .weigher(|_, e: &Entry| u32::try_from(e.len).unwrap_or(u32::MAX).max(1))
                .build()
        });
        PrefixCache { cache }
    }

    /// `tok`'s ids of `text` (special tokens off), given its safe cuts (ascending), and how
    /// many of them (a prefix) came from the cache.
    pub fn encode(
        &self,
        tok: &HfTokenizer,
        text: &str,
        cuts: &[usize],
    ) -> Result<(Vec<u32>, usize), TokenizeError> {
        let Some(cache) = &self.cache else {
            return Ok((tok.encode(text, false)?, 0));
        };
        let keys = chain_keys(text, cuts);
        // The longest cached prefix.
        let hit = keys
            .iter()
            .enumerate()
            .rev()
            .find_map(|(i, k)| cache.get(k).map(|e| (i, e)));
        let (start_cut, mut ids) = match &hit {
            Some((i, e)) => (Some(*i), e.ids.get(..e.len).unwrap_or_default().to_vec()),
            None => (None, Vec::new()),
        };
        let reused = ids.len();
        let from = start_cut.map_or(0, |i| cuts[i]);
        let later: Vec<usize> = match start_cut {
            Some(i) => (i + 1..cuts.len()).collect(),
            None => (0..cuts.len()).collect(),
        };
        let chosen = spread(&later, MAX_NEW_CUTS);
        // Tokenize the rest piece by piece between the chosen cuts (exact: they are safe cuts).
        let mut new_entries: Vec<(usize, usize)> = Vec::with_capacity(chosen.len());
        let mut pos = from;
        for &ci in &chosen {
            let end = cuts[ci];
            ids.extend(tok.encode(text.get(pos..end).unwrap_or_default(), false)?);
            new_entries.push((ci, ids.len()));
            pos = end;
        }
        ids.extend(tok.encode(text.get(pos..).unwrap_or_default(), false)?);
        if !new_entries.is_empty() {
            let shared: Arc<[u32]> = Arc::from(ids.as_slice());
            for (ci, len) in new_entries {
                cache.insert(
                    keys[ci],
                    Entry {
                        ids: Arc::clone(&shared),
                        len,
                    },
                );
            }
        }
        Ok((ids, reused))
    }
}

/// The key of every cut: XXH3 of the piece since the previous cut, seeded with the previous
/// key and the cut's offset.
fn chain_keys(text: &str, cuts: &[usize]) -> Vec<u64> {
    let bytes = text.as_bytes();
    let mut keys = Vec::with_capacity(cuts.len());
    let (mut prev, mut key) = (0usize, 0x9e37_79b9_7f4a_7c15u64);
    for &c in cuts {
        let piece = bytes.get(prev..c).unwrap_or_default();
        key = xxh3_64_with_seed(piece, key ^ (c as u64));
        keys.push(key);
        prev = c;
    }
    keys
}

/// At most `max` of `items`, always including the last, the others evenly spaced.
fn spread(items: &[usize], max: usize) -> Vec<usize> {
    if items.len() <= max {
        return items.to_vec();
    }
    let step = items.len().div_ceil(max.saturating_sub(1).max(1));
    let mut out: Vec<usize> = items.iter().step_by(step.max(1)).copied().collect();
    out.truncate(max.saturating_sub(1));
    if let Some(&last) = items.last() {
        if out.last() != Some(&last) {
            out.push(last);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn tiny() -> HfTokenizer {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama");
        HfTokenizer::from_dir(&dir).unwrap()
    }

    fn chat(tok: &HfTokenizer, body: serde_json::Value) -> String {
        let req = hf_tokenize::ChatRequest::from_body(body.to_string().as_bytes()).unwrap();
        tok.render_chat(&req).unwrap()
    }

    #[test]
    fn cached_prefixes_give_the_ids_of_the_whole_text() {
        let tok = tiny();
        let cache = PrefixCache::new(1 << 20);
        let system = "You are a helpful model. the cache prefix token ".repeat(20);
        let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
        // Multi-turn: every request extends the previous one; a new user message each time.
        for turn in 0..6 {
            messages.push(serde_json::json!({"role": "user", "content": format!("question {turn} about the load")}));
            let text = chat(&tok, serde_json::json!({"messages": messages}));
            let cuts = tok.safe_cuts(&text).unwrap();
            let whole = tok.encode(&text, false).unwrap();
            let (ids, reused) = cache.encode(&tok, &text, &cuts).unwrap();
            assert_eq!(ids, whole, "turn {turn}");
            // Turn 0 is new; later turns reuse the earlier turns' ids.
            assert_eq!(reused > 0, turn > 0, "turn {turn}: {reused} reused");
            // Again: now served from the longest cut.
            let (ids, reused) = cache.encode(&tok, &text, &cuts).unwrap();
            assert_eq!(ids, whole, "turn {turn} again");
            assert!(reused > 0 && reused < ids.len(), "turn {turn} again");
            messages.push(
                serde_json::json!({"role": "assistant", "content": format!(" answer {turn} ")}),
            );
        }
        // Same system prompt, a fresh conversation: the system prefix is reused.
        let text = chat(
            &tok,
            serde_json::json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": "new"}]}),
        );
        let cuts = tok.safe_cuts(&text).unwrap();
        assert_eq!(
            cache.encode(&tok, &text, &cuts).unwrap().0,
            tok.encode(&text, false).unwrap()
        );
        assert!(cache.cache.as_ref().unwrap().iter().count() > 0);
    }

    #[test]
    fn spread_keeps_the_last_and_the_bound() {
        let items: Vec<usize> = (0..100).collect();
        let s = spread(&items, 8);
        assert!(s.len() <= 8, "{s:?}");
        assert_eq!(s.last(), Some(&99));
        assert_eq!(spread(&items[..3], 8), vec![0, 1, 2]);
    }
}
