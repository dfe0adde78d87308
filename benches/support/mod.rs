//! What the benches share: prose-like prompt text and a chat body around it.

const WORDS: &[&str] = &[
    "the",
    "model",
    "cache",
    "prefix",
    "token",
    "request",
    "server",
    "router",
    "load",
    "balance",
    "hello",
    "world",
    "system",
    "user",
    "assistant",
    "question",
    "answer",
    "number",
    "water",
];

/// Prose-like text of at least `chars` characters (whole words from a fixed vocabulary,
/// newlines now and then; `seed` changes it from the first word).
pub fn prose(chars: usize, seed: u64) -> String {
    let mut s = String::with_capacity(chars + 16);
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    while s.len() < chars {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
        s.push(if x % 11 == 0 { '\n' } else { ' ' });
    }
    s
}

/// A chat completion body with a system and a user message.
pub fn chat_body(system: &str, user: &str) -> Vec<u8> {
    serde_json::json!({"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]})
    .to_string()
    .into_bytes()
}
