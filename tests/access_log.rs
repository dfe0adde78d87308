//! The access log through the real binary: one JSON line per request under the target
//! `inferlb::access`, the text layout (plain `key=value`, no escape codes into a pipe), and
//! RUST_LOG-style filtering of that target.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::FakeBackend;

const BIN: &str = env!("CARGO_BIN_EXE_inferlb");

/// How long a wait for the binary's next line may take before the test gives up. Every wait
/// is on the line itself; this only bounds a binary that went silent, so it is far above what
/// a start-up or a drain takes even on a loaded machine (the 10 s it was could be a guess too
/// short for a start-up or drain under load).
const LINE_WITHIN: Duration = Duration::from_secs(120);

struct Running {
    child: Proc,
    addr: String,
    lines: tokio::sync::mpsc::UnboundedReceiver<serde_json::Value>,
}

/// The binary on a free port with `args`, and its stdout lines as they come.
fn spawn_lines(args: &[&str]) -> (Proc, tokio::sync::mpsc::UnboundedReceiver<String>) {
    let mut child = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, lines) = tokio::sync::mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (Proc(child), lines)
}

fn spawn(backend: &FakeBackend, log_level: &str) -> Running {
    spawn_json(&["--log-level", log_level, "--backend", &backend.url()])
}

/// The binary with `args`, JSON lines, once it has announced its address.
fn spawn_json(args: &[&str]) -> Running {
    let (child, mut raw) = spawn_lines(&[&["--log-format", "json"], args].concat());
    let (tx, mut lines) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        while let Some(line) = raw.blocking_recv() {
            let v: serde_json::Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
            if tx.send(v).is_err() {
                break;
            }
        }
    });
    let addr = loop {
        let v = lines
            .blocking_recv()
            .expect("the binary never announced its address");
        if let Some(addr) = v["fields"]["main_addr"].as_str() {
            break addr.to_owned();
        }
    };
    Running { child, addr, lines }
}

/// The binary, killed if a failed assertion drops it (it would otherwise outlive the test,
/// holding its port and the file descriptors it inherited).
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    /// SIGTERM, then a clean exit.
    fn stop(mut self) {
        Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status()
            .unwrap();
        assert!(self.0.wait().unwrap().success());
    }
}

impl Running {
    /// The next line whose target is `target` (within [`LINE_WITHIN`]), or `None` when `until` comes first.
    async fn next(&mut self, target: &str, until: &str) -> Option<serde_json::Value> {
        let wait = async {
            while let Some(v) = self.lines.recv().await {
                // An access line under any target counts, so a mis-targeted line is caught.
                if v["target"] == target || v["fields"]["request_id"].is_string() {
                    return Some(v);
                }
                if v["fields"]["message"] == until {
                    return None;
                }
            }
            None
        };
        tokio::time::timeout(LINE_WITHIN, wait)
            .await
            .unwrap_or_else(|_| panic!("no `{target}` or `{until}` line within {LINE_WITHIN:?}"))
    }

    fn stop(self) {
        self.child.stop();
    }
}

/// Several of the prefix scorer's 64-byte blocks long.
const PROMPT: &str = "hello there, access log: a prompt long enough to fill a few hashed blocks of the prefix index, so that the matched-block count has something to count";

async fn chat(addr: &str, id: &str, model: &str) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("http://{addr}/v1/chat/completions"))
        .header("x-request-id", id)
        .json(
            &serde_json::json!({"model": model, "messages": [{"role": "user", "content": PROMPT}]}),
        )
        .send()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn one_json_line_per_request_with_its_facts() {
    let backend = FakeBackend::start("a", &["m"]).await;
    let mut run = tokio::task::block_in_place(|| spawn(&backend, "info"));
    let resp = chat(&run.addr, "req-ok-1", "m").await;
    assert_eq!(resp.status(), 200);
    let _ = resp.bytes().await.unwrap();
    let line = run.next("inferlb::access", "-").await.unwrap();
    let f = &line["fields"];
    assert_eq!(line["level"], "INFO");
    assert_eq!(f["message"], "request");
    assert_eq!(f["request_id"], "req-ok-1");
    assert_eq!(f["model"], "m");
    assert_eq!(f["backend"], backend.url().as_str());
    assert_eq!(f["status"], 200);
    assert_eq!(f["attempts"], 1);
    assert_eq!(f["completed"], true);
    let (ttfb, total) = (
        f["ttfb_ms"].as_f64().unwrap(),
        f["duration_ms"].as_f64().unwrap(),
    );
    assert!(ttfb > 0.0 && ttfb <= total, "{f}");
    assert!(f["prompt_bytes"].as_u64().unwrap() >= PROMPT.len() as u64);
    assert!(f["prefix_blocks"].as_u64().unwrap() >= 1, "{f}");
    assert_eq!(
        f["prefix_blocks_matched"], 0,
        "first sight of this prompt: {f}"
    );

    // The same prompt again: its blocks are now recorded on that backend.
    let _ = chat(&run.addr, "req-ok-2", "m")
        .await
        .bytes()
        .await
        .unwrap();
    let again = run.next("inferlb::access", "-").await.unwrap();
    assert_eq!(again["fields"]["request_id"], "req-ok-2");
    assert_eq!(
        again["fields"]["prefix_blocks_matched"],
        again["fields"]["prefix_blocks"]
    );

    // A request id with JSON's special characters stays one valid line with the id intact.
    let odd = r#"req-"quoted"\back\slash"#;
    let _ = chat(&run.addr, odd, "m").await.bytes().await.unwrap();
    let quoted = run.next("inferlb::access", "-").await.unwrap();
    assert_eq!(quoted["fields"]["request_id"], odd);

    // A model nobody serves: 404, no backend, and the client's string is not logged as the model.
    let resp = chat(&run.addr, "req-404", "made-up-model-name").await;
    assert_eq!(resp.status(), 404);
    let _ = resp.bytes().await.unwrap();
    let miss = run.next("inferlb::access", "-").await.unwrap();
    let f = &miss["fields"];
    assert_eq!(f["request_id"], "req-404");
    assert_eq!(f["status"], 404);
    assert_eq!(f["backend"], "none");
    assert_eq!(f["model"], "other");
    assert_eq!(f["attempts"], 0);
    run.stop();
}

/// `key=value` pairs of a text line after its message.
fn text_fields(line: &str) -> std::collections::HashMap<String, String> {
    line.split(' ')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// The binary's stdout lines as they come, unparsed.
fn spawn_text(backend: &FakeBackend) -> (Proc, tokio::sync::mpsc::UnboundedReceiver<String>) {
    spawn_lines(&["--log-format", "text", "--backend", &backend.url()])
}

async fn next_line(lines: &mut tokio::sync::mpsc::UnboundedReceiver<String>) -> String {
    tokio::time::timeout(LINE_WITHIN, lines.recv())
        .await
        .expect("no line in time")
        .expect("stdout closed")
}

#[tokio::test(flavor = "multi_thread")]
async fn text_lines_are_plain_key_value_pairs() {
    let backend = FakeBackend::start("a", &["m"]).await;
    let (child, mut lines) = spawn_text(&backend);
    let addr = loop {
        let line = next_line(&mut lines).await;
        // Into a pipe, no line carries ANSI escape codes (the subscriber's or the access log's).
        assert!(!line.contains('\x1b'), "escape codes in {line:?}");
        if line.contains("inferlb listening") {
            break text_fields(&line)["main_addr"].clone();
        }
    };
    let _ = chat(&addr, "req-text-1", "m").await.bytes().await.unwrap();
    let line = loop {
        let line = next_line(&mut lines).await;
        assert!(!line.contains('\x1b'), "escape codes in {line:?}");
        if line.contains("request_id=") {
            break line;
        }
    };
    // `<RFC 3339 time>  INFO request key=value …`, as the subscriber lays out other lines.
    let (stamp, rest) = line.split_once(' ').unwrap();
    assert!(
        stamp.len() == 27 && stamp.ends_with('Z') && stamp.as_bytes()[10] == b'T',
        "{line}"
    );
    assert!(
        rest.starts_with(" INFO request request_id=req-text-1 "),
        "{line}"
    );
    let f = text_fields(&line);
    assert_eq!(f["model"], "m");
    assert_eq!(f["backend"], backend.url());
    assert_eq!(f["status"], "200");
    assert_eq!(f["attempts"], "1");
    assert_eq!(f["completed"], "true");
    let ttfb: f64 = f["ttfb_ms"].parse().unwrap();
    let total: f64 = f["duration_ms"].parse().unwrap();
    assert!(ttfb > 0.0 && ttfb <= total, "{line}");
    assert!(f["prompt_bytes"].parse::<usize>().unwrap() >= PROMPT.len());
    assert_eq!(f["prefix_blocks_matched"], "0");
    child.stop();
}

#[tokio::test(flavor = "multi_thread")]
async fn the_access_target_filters_like_any_other() {
    let backend = FakeBackend::start("a", &["m"]).await;
    let mut run = tokio::task::block_in_place(|| spawn(&backend, "info,inferlb::access=off"));
    let _ = chat(&run.addr, "req-quiet", "m")
        .await
        .bytes()
        .await
        .unwrap();
    // The shutdown line is written after every access line would have been: none came first.
    Command::new("kill")
        .args(["-TERM", &run.child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(run
        .next("inferlb::access", "inferlb stopped")
        .await
        .is_none());
    assert!(run.child.0.wait().unwrap().success());
}

/// A disaggregated request is one line naming both backends: `backend` the decode backend
/// that answered, `prefill_backend` the one that ran the prefill step, `pd` the path. Seen
/// failing with the P/D step left out of the line (no `pd` field).
#[tokio::test(flavor = "multi_thread")]
async fn a_disaggregated_request_is_one_line_naming_both_backends() {
    use vllm_sim::config::KvRole;
    let sim = |role| vllm_sim::SimConfig {
        kv_role: role,
        ..common::sim::config("m")
    };
    let p = common::sim::start(sim(KvRole::Prefill)).await;
    let d = common::sim::start(sim(KvRole::Decode)).await;
    let path = std::env::temp_dir().join(format!("inferlb-access-pd-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        format!(
            "[[backends]]\nurl = \"{}\"\nrole = \"prefill\"\n\n[[backends]]\nurl = \"{}\"\nrole = \"decode\"\n\n\
             [pd]\nenabled = true\nthreshold_tokens = 16\n",
            p.url(),
            d.url()
        ),
    )
    .unwrap();
    let path = path.to_str().unwrap().to_owned();
    let mut run =
        tokio::task::block_in_place(|| spawn_json(&["--log-level", "info", "--config", &path]));
    // Both backends polled healthy first (re-read every 20 ms, for at most 120 s).
    let admin = format!("http://{}/admin/backends", run.addr);
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(20));
    for _ in 0..6000 {
        tick.tick().await;
        let Ok(resp) = reqwest::get(&admin).await else {
            continue;
        };
        let v: serde_json::Value = resp.json().await.unwrap_or_default();
        let all = v["backends"]
            .as_array()
            .is_some_and(|l| l.len() == 2 && l.iter().all(|b| b["healthy"] == true));
        if all {
            break;
        }
    }
    let _ = std::fs::remove_file(&path);
    let resp = chat(&run.addr, "req-pd", "m").await;
    assert_eq!(resp.status(), 200);
    let _ = resp.bytes().await.unwrap();
    let line = run.next("inferlb::access", "-").await.unwrap();
    let fields = &line["fields"];
    assert_eq!(fields["request_id"], "req-pd");
    assert_eq!(fields["pd"], "disaggregated", "{fields}");
    assert_eq!(
        fields["pd_reason"],
        "uncached tokens above threshold_tokens"
    );
    assert_eq!(fields["backend"], d.url().as_str());
    assert_eq!(fields["prefill_backend"], p.url().as_str());
    assert_eq!(p.stats().kv_pulls, 1);
    run.stop();
}
