//! Seeded random-word text whose length is counted in the simulator's own tokens.

use vllm_sim::tokenizer;

/// Letters drawn for random words; lower case only so every word is one "word" to the
/// tokenizer (no punctuation that would change how pieces are cut).
const LETTERS: &[u8] = b"abcdefghijklmnopqrstuvwxyz";
/// Alphabet of the leading tag word (62 symbols, so 4 symbols give 62^4 distinct tags).
const TAG_ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
const TAG_SPACE: u64 = 14_776_336; // 62^4
/// Odd and not a multiple of 31, hence invertible modulo 62^4 = 2^4·31^4: distinct indices
/// get distinct tags, and neighbouring indices get unrelated-looking ones.
const TAG_MULTIPLIER: u64 = 1_000_003;

/// A 4-character word unique to `index` (for `index < 62^4`) within one `salt`.
///
/// Every group / conversation / unique prompt starts with its tag, so two of them differ
/// within their first four characters: all they share is the chat template's few tokens.
pub fn tag(index: u64, salt: u64) -> String {
    let mut v = (index
        .wrapping_mul(TAG_MULTIPLIER)
        .wrapping_add(salt % TAG_SPACE))
        % TAG_SPACE;
    let mut out = String::with_capacity(4);
    for _ in 0..4 {
        out.push(TAG_ALPHABET[(v % 62) as usize] as char);
        v /= 62;
    }
    out
}

/// Appends random words to `out` (starting with `first`, if any) until the text holds
/// `tokens` simulator tokens; returns the token count reached (≥ `tokens`, usually equal).
///
/// Words are 2–8 lower-case letters. The tokenizer never lets a piece cross whitespace, so
/// the token count of the text is the sum of the counts of its space-led words: counting word
/// by word is exact without re-tokenising the whole string.
pub fn words(rng: &mut fastrand::Rng, tokens: usize, first: Option<&str>, out: &mut String) {
    let mut count = 0usize;
    let mut word = String::with_capacity(12);
    let mut first = first;
    while count < tokens {
        word.clear();
        if !out.is_empty() {
            word.push(' ');
        }
        match first.take() {
            Some(f) => word.push_str(f),
            None => {
                // Short words when one token is missing, so the target is met exactly.
                let max_len = if tokens - count == 1 { 3 } else { 8 };
                let len = rng.usize(2..=max_len);
                for _ in 0..len {
                    word.push(LETTERS[rng.usize(..LETTERS.len())] as char);
                }
            }
        }
        count += tokenizer::tokenize(&word).len();
        out.push_str(&word);
    }
}

/// A fresh string of `tokens` tokens led by `tag`.
pub fn tagged_text(rng: &mut fastrand::Rng, tokens: usize, tag: &str) -> String {
    let mut s = String::with_capacity(tokens * 5);
    words(rng, tokens, Some(tag), &mut s);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_counts_are_exact_and_about_four_bytes_each() {
        let mut rng = fastrand::Rng::with_seed(7);
        for target in [1usize, 5, 16, 150, 1500] {
            let t = tagged_text(&mut rng, target, &tag(3, 0));
            let n = tokenizer::tokenize(&t).len();
            assert!(n >= target && n <= target + 1, "target {target} got {n}");
            if target >= 150 {
                let bytes_per_token = t.len() as f64 / n as f64;
                assert!((3.0..=5.0).contains(&bytes_per_token), "{bytes_per_token}");
            }
        }
    }

    #[test]
    fn tags_are_distinct_and_seeded_text_is_reproducible() {
        let tags: std::collections::HashSet<String> = (0..10_000).map(|i| tag(i, 42)).collect();
        assert_eq!(tags.len(), 10_000);
        let a = tagged_text(&mut fastrand::Rng::with_seed(1), 50, "x");
        let b = tagged_text(&mut fastrand::Rng::with_seed(1), 50, "x");
        assert_eq!(a, b);
    }
}
