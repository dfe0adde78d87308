//! Tokenizer and chat template: the deterministic stand-in for a model's BPE tokenizer.
//!
//! The simulator has no vocabulary file, yet routing experiments need three properties of a
//! real tokenizer: token counts in the right ballpark (~4 UTF-8 bytes per token for English),
//! identical text prefixes giving identical token prefixes (that is what makes prefix caching
//! work), and speed. The rule:
//!
//! 1. Text is cut into *pieces*. A run of non-whitespace characters (a "word") is cut into
//!    chunks of at most 4 bytes (never splitting a character).
//! 2. A single whitespace character directly before a word is glued to the word's first chunk
//!    (like GPT tokenizers' `" word"` tokens); any other whitespace character is a piece of its
//!    own. So `"hello  world\n"` → `"hell"`, `"o"`, `" "`, `" wor"`, `"ld"`, `"\n"`.
//! 3. Each piece maps to a token id: `xxh3_64(piece bytes) mod 32000`.
//!
//! Because a piece never reaches past the next whitespace character, appending text that starts
//! with whitespace never changes earlier tokens. The chat template relies on this: every message
//! ends with `"\n"`, so a conversation's tokens are a prefix of the next turn's tokens.
//!
//! Chat template (fixed, applied before tokenising as vLLM does with the model's template):
//!
//! ```text
//! <|system|>\n{content}\n<|user|>\n{content}\n ... <|assistant|>\n
//! ```
//!
//! Generated text is filler made of 4-byte pieces (`" the"`, `" and"`, ...) whose token ids are
//! exactly the ids the tokenizer gives that text back: a client that sends the answer back in
//! the next turn re-creates the same tokens, so the blocks filled while decoding are hits.
//!
//! Completion prompts given as text get a BOS token (id 1) in front, as Llama tokenizers add.

use xxhash_rust::xxh3::xxh3_64;

/// Size of the pretend vocabulary; ids are hashes reduced into `0..VOCAB_SIZE`.
pub const VOCAB_SIZE: u32 = 32_000;
/// Beginning-of-sequence id put before text completion prompts (Llama convention).
pub const BOS_ID: u32 = 1;

/// The filler words generated text is made of: each is exactly one piece (space + 3 letters).
const FILLER: [&str; 32] = [
    " the", " and", " for", " you", " are", " was", " but", " not", " all", " can", " her", " one",
    " our", " out", " day", " get", " has", " him", " his", " how", " man", " new", " now", " old",
    " see", " two", " way", " who", " boy", " did", " its", " let",
];

/// Token id of one piece.
#[inline]
pub fn piece_id(piece: &str) -> u32 {
    (xxh3_64(piece.as_bytes()) % u64::from(VOCAB_SIZE)) as u32
}

/// Calls `f` with every piece of `text`, in order (rule in the module doc).
pub fn for_each_piece(text: &str, mut f: impl FnMut(&str)) {
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        let c = next_char(text, i);
        if c.is_whitespace() {
            i += c.len_utf8();
            let glued = i < bytes.len() && !next_char(text, i).is_whitespace();
            if !glued {
                f(&text[start..i]);
                continue;
            }
        }
        // First chunk of a word (possibly behind its leading whitespace), then further chunks.
        // The glued whitespace counts toward the chunk's 4 bytes.
        let mut chunk_start = start;
        let mut chunk_bytes = i - start;
        while i < bytes.len() {
            let c = next_char(text, i);
            if c.is_whitespace() {
                break;
            }
            let len = c.len_utf8();
            if chunk_bytes > 0 && chunk_bytes + len > 4 {
                f(&text[chunk_start..i]);
                chunk_start = i;
                chunk_bytes = 0;
            }
            chunk_bytes += len;
            i += len;
        }
        f(&text[chunk_start..i]);
    }
}

fn next_char(text: &str, at: usize) -> char {
    text[at..].chars().next().unwrap_or(' ')
}

/// Appends the token ids of `text` to `out`.
pub fn tokenize_into(text: &str, out: &mut Vec<u32>) {
    out.reserve(text.len() / 3 + 1);
    for_each_piece(text, |p| out.push(piece_id(p)));
}

/// Token ids of `text` (no BOS).
pub fn tokenize(text: &str) -> Vec<u32> {
    let mut out = Vec::new();
    tokenize_into(text, &mut out);
    out
}

/// Token ids of a text completion prompt: BOS then the text's tokens.
pub fn tokenize_prompt(text: &str) -> Vec<u32> {
    let mut out = vec![BOS_ID];
    tokenize_into(text, &mut out);
    out
}

/// Text of the `i`-th generated token (0-based): deterministic filler.
#[inline]
pub fn filler_piece(i: u32) -> &'static str {
    FILLER[(i as usize) % FILLER.len()]
}

/// Token id of the `i`-th generated token; equals `tokenize(filler_piece(i))[0]`.
#[inline]
pub fn filler_id(i: u32) -> u32 {
    piece_id(filler_piece(i))
}

/// Text of `n` generated tokens.
pub fn filler_text(n: u32) -> String {
    let mut s = String::with_capacity(n as usize * 4);
    for i in 0..n {
        s.push_str(filler_piece(i));
    }
    s
}

/// Best-effort inverse for `/detokenize`: BOS and filler ids map back to their text, any other
/// id (a hash of unknown text) to a `<id>` placeholder.
pub fn detokenize(ids: &[u32]) -> String {
    let mut s = String::new();
    for &id in ids {
        if id == BOS_ID {
            s.push_str("<s>");
        } else if let Some(p) = FILLER.iter().find(|p| piece_id(p) == id) {
            s.push_str(p);
        } else {
            s.push_str(&format!("<{id}>"));
        }
    }
    s
}

/// One chat message after parsing: role and the text its content renders to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// Renders a conversation through the fixed chat template (see module doc).
pub fn render_chat(messages: &[ChatMessage], add_generation_prompt: bool) -> String {
    let mut s = String::new();
    for m in messages {
        s.push_str("<|");
        s.push_str(&m.role);
        s.push_str("|>\n");
        s.push_str(&m.content);
        s.push('\n');
    }
    if add_generation_prompt {
        s.push_str("<|assistant|>\n");
    }
    s
}

/// The text an `image_url` content part renders to: a run of 16 placeholder words derived
/// from the URL, so the same image gives the same tokens and different images differ.
pub fn image_placeholder(url: &str) -> String {
    let h = xxh3_64(url.as_bytes());
    let mut s = String::from("<image>");
    for k in 0..16u32 {
        let word = (h.rotate_left(k * 4) & 0xffff) as u16;
        s.push_str(&format!(" i{word:04x}"));
    }
    s.push_str(" </image>");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str) -> Vec<String> {
        let mut v = Vec::new();
        for_each_piece(text, |p| v.push(p.to_string()));
        v
    }

    #[test]
    fn pieces_follow_the_rule() {
        assert_eq!(
            pieces("hello  world\n"),
            ["hell", "o", " ", " wor", "ld", "\n"]
        );
        assert_eq!(pieces(" lor ips"), [" lor", " ips"]);
        assert_eq!(pieces("héllo"), ["hél", "lo"]);
        assert!(pieces("").is_empty());
        // Pieces always concatenate back to the input.
        let t = "Some  text,\twith\n\nodd   spacing and ünïcödé wörds!";
        assert_eq!(pieces(t).concat(), t);
    }

    #[test]
    fn about_four_bytes_per_token_on_english() {
        let text = "The quick brown fox jumps over the lazy dog while the router keeps \
                    requests that share a prefix on the server that already holds it.";
        let n = tokenize(text).len();
        let ratio = text.len() as f64 / n as f64;
        assert!((3.0..=4.5).contains(&ratio), "bytes per token {ratio}");
    }

    #[test]
    fn whitespace_led_suffix_keeps_the_prefix_tokens() {
        let a = "<|user|>\nhello there";
        let b = "\n<|assistant|>\n lots more text";
        let joined = tokenize(&format!("{a}{b}"));
        let head = tokenize(a);
        assert_eq!(&joined[..head.len()], &head[..]);
    }

    #[test]
    fn conversation_prefix_gives_token_prefix() {
        let turn1 = vec![
            ChatMessage {
                role: "system".into(),
                content: "Be brief.".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "Hi!".into(),
            },
        ];
        let p1 = tokenize(&render_chat(&turn1, true));
        let mut turn2 = turn1.clone();
        turn2.push(ChatMessage {
            role: "assistant".into(),
            content: filler_text(5),
        });
        turn2.push(ChatMessage {
            role: "user".into(),
            content: "More".into(),
        });
        let p2 = tokenize(&render_chat(&turn2, true));
        assert_eq!(&p2[..p1.len()], &p1[..]);
        // The generated tokens re-tokenise to exactly the ids the engine produced.
        let gen: Vec<u32> = (0..5).map(filler_id).collect();
        assert_eq!(&p2[p1.len()..p1.len() + 5], &gen[..]);
    }

    #[test]
    fn filler_is_one_token_per_piece() {
        for i in 0..64 {
            assert_eq!(tokenize(filler_piece(i)), vec![filler_id(i)]);
        }
        assert_eq!(tokenize(&filler_text(40)).len(), 40);
        assert_eq!(detokenize(&[filler_id(0), filler_id(1)]), " the and");
    }

    #[test]
    fn ids_are_in_vocab_and_distinct_texts_differ() {
        let a = tokenize("alpha beta gamma");
        let b = tokenize("alpha beta delta");
        assert!(a.iter().chain(&b).all(|&t| t < VOCAB_SIZE));
        assert_eq!(a[..3], b[..3]);
        assert_ne!(a, b);
        assert_eq!(tokenize_prompt("x")[0], BOS_ID);
    }

    #[test]
    fn images_render_by_url() {
        assert_eq!(image_placeholder("a.png"), image_placeholder("a.png"));
        assert_ne!(image_placeholder("a.png"), image_placeholder("b.png"));
    }
}
