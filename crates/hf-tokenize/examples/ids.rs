//! Print the prompt token ids hf-tokenize computes for request bodies, one JSON array per
//! line: `ids MODEL_DIR` reads lines `chat <json body>` or `completion <json body>` on stdin.
//! Used by `bench/tokenizer_fidelity.sh` to compare with a real vLLM's `/tokenize`.

use std::io::BufRead;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args()
        .nth(1)
        .ok_or("usage: ids MODEL_DIR < requests")?;
    let tok = hf_tokenize::HfTokenizer::from_dir(std::path::Path::new(&dir))?;
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let (kind, body) = line
            .split_once(' ')
            .ok_or("a line is `chat|completion BODY`")?;
        let ids = match kind {
            "chat" => tok.chat_ids(body.as_bytes()),
            _ => tok.completion_ids(body.as_bytes()),
        };
        match ids {
            Ok(ids) => println!("{}", serde_json::to_string(&ids)?),
            Err(e) => println!("{}", serde_json::json!({"error": e.to_string()})),
        }
    }
    Ok(())
}
