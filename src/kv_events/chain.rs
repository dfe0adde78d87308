//! The token-block chain hash: inferlb's own name for "the first `i + 1` blocks of a prompt".
//!
//! For block size `B`, only full blocks are hashed. Block `i`'s hash is XXH3-64 over
//!
//! ```text
//! prev (u64 LE: block i−1's hash, or SEED for block 0)
//! [0x01, len u32 LE, LoRA adapter name]        when the request / event is for an adapter
//! [0x02, len u32 LE, key] …                    block 0: the cache_salt; any block: other extra
//!                                              keys vLLM reports (multimodal hashes)
//! 0xFF, then the B token ids as u32 LE
//! ```
//!
//! so a hash names a whole prefix (every earlier token, the adapter and the salt), as vLLM's
//! own block hash does. vLLM's hash (SHA-256 over pickled or CBOR data with a per-process seed)
//! cannot be recomputed outside vLLM; events carry the token ids, and [`super::store`] keeps
//! a map from vLLM's hash to this one so removals apply. Both sides (request and event) use
//! [`block_hash`], so they agree by construction.

use xxhash_rust::xxh3::xxh3_64;

/// The `prev` of block 0 ("inferlb!" in ASCII).
pub const SEED: u64 = 0x696e_6665_726c_6221;

/// One block's hash. `scratch` is reused between calls (no allocation once it is big enough).
pub fn block_hash(
    prev: Option<u64>,
    lora: Option<&str>,
    extra: &[&str],
    tokens: &[u32],
    scratch: &mut Vec<u8>,
) -> u64 {
    scratch.clear();
    scratch.extend_from_slice(&prev.unwrap_or(SEED).to_le_bytes());
    if let Some(name) = lora {
        tagged(scratch, 0x01, name);
    }
    for key in extra {
        tagged(scratch, 0x02, key);
    }
    scratch.push(0xFF);
    // Grow once, then write the ids in place (a loop the compiler vectorizes; pushing 4 bytes
    // at a time re-checks the capacity for every token).
    let start = scratch.len();
    scratch.resize(start.saturating_add(tokens.len().saturating_mul(4)), 0);
    if let Some(dst) = scratch.get_mut(start..) {
        for (d, t) in dst.chunks_exact_mut(4).zip(tokens) {
            d.copy_from_slice(&t.to_le_bytes());
        }
    }
    xxh3_64(scratch)
}

fn tagged(out: &mut Vec<u8>, tag: u8, text: &str) {
    out.push(tag);
    out.extend_from_slice(&(text.len() as u32).to_le_bytes());
    out.extend_from_slice(text.as_bytes());
}

/// The chain of a prompt's full blocks, at most `max_blocks`, appended to `out`.
pub fn prompt_chain(
    tokens: &[u32],
    block_size: usize,
    lora: Option<&str>,
    cache_salt: Option<&str>,
    max_blocks: usize,
    out: &mut Vec<u64>,
) {
    if block_size == 0 {
        return;
    }
    let mut scratch = Vec::with_capacity(block_size.saturating_mul(4).saturating_add(64));
    let mut prev = None;
    let salted: Option<[&str; 1]> = cache_salt.map(|s| [s]);
    for (i, block) in tokens.chunks_exact(block_size).take(max_blocks).enumerate() {
        let salt: &[&str] = match (i, &salted) {
            (0, Some(s)) => s,
            _ => &[],
        };
        let h = block_hash(prev, lora, salt, block, &mut scratch);
        out.push(h);
        prev = Some(h);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn only_full_blocks_and_each_names_its_whole_prefix() {
        let tokens: Vec<u32> = (0..10).collect();
        let mut a = Vec::new();
        prompt_chain(&tokens, 4, None, None, 100, &mut a);
        assert_eq!(a.len(), 2, "the partial third block is not hashed");
        let mut b = Vec::new();
        let mut other = tokens.clone();
        other[0] = 99;
        prompt_chain(&other, 4, None, None, 100, &mut b);
        assert_ne!(a[1], b[1], "block 1 depends on block 0's tokens");
        let mut c = Vec::new();
        prompt_chain(&tokens[..8], 4, None, None, 100, &mut c);
        assert_eq!(a, c);
        let mut d = Vec::new();
        prompt_chain(&tokens, 4, None, None, 1, &mut d);
        assert_eq!(d, a[..1]);
        prompt_chain(&tokens, 0, None, None, 100, &mut d);
        assert_eq!(d.len(), 1);
    }

    #[test]
    fn lora_and_salt_separate_chains_and_match_the_event_side() {
        let tokens: Vec<u32> = (0..8).collect();
        let chain = |lora, salt| {
            let mut out = Vec::new();
            prompt_chain(&tokens, 4, lora, salt, 100, &mut out);
            out
        };
        let plain = chain(None, None);
        let lora = chain(Some("a"), None);
        let salted = chain(None, Some("s"));
        assert_ne!(plain[0], lora[0]);
        assert_ne!(plain[0], salted[0]);
        assert_ne!(lora[1], chain(Some("b"), None)[1]);
        // The event side: block by block with the salt as block 0's extra key.
        let mut scratch = Vec::new();
        let b0 = block_hash(None, None, &["s"], &tokens[..4], &mut scratch);
        let b1 = block_hash(Some(b0), None, &[], &tokens[4..], &mut scratch);
        assert_eq!(salted, vec![b0, b1]);
        // A name cannot pass for tokens: the tag and length keep the fields apart.
        assert_ne!(
            block_hash(None, Some(""), &[], &[], &mut scratch),
            block_hash(None, None, &[""], &[], &mut scratch)
        );
    }
}
