//! CPU probe: how much CPU a fleet of simulators burns per streamed token.
//!
//! Starts `vllm-sim --fleet N` as a child process, keeps C streaming chat requests open per
//! server for D seconds, and reports tokens/s and the child's CPU time (from /proc), so the
//! load generator's own cost is not counted.
//!
//!     cargo build --release -p vllm-sim --examples
//!     target/release/examples/cpu_probe target/release/vllm-sim [N=8] [C=32] [D=10] [scale=1]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use tokio::io::{AsyncBufReadExt, BufReader};

fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split(' ').collect();
    // Fields 14 and 15 of stat (utime, stime), counted after the command name.
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks / 100.0
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let bin = args.get(1).expect("path to vllm-sim").clone();
    let n: usize = args.get(2).map_or(8, |s| s.parse().unwrap());
    let c: usize = args.get(3).map_or(32, |s| s.parse().unwrap());
    let secs: u64 = args.get(4).map_or(10, |s| s.parse().unwrap());
    let scale: String = args.get(5).cloned().unwrap_or_else(|| "1".into());
    let mut child = tokio::process::Command::new(bin)
        .args([
            "--fleet",
            &n.to_string(),
            "--port",
            "0",
            "--time-scale",
            &scale,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut urls = Vec::new();
    for _ in 0..n {
        urls.push(lines.next_line().await.unwrap().unwrap());
    }
    let tokens = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(secs);
    let cpu0 = cpu_seconds(pid);
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for (i, url) in urls.iter().enumerate() {
        for k in 0..c {
            let (url, tokens) = (url.clone(), tokens.clone());
            tasks.push(tokio::spawn(async move {
                let client = reqwest::Client::new();
                let mut round = 0;
                while Instant::now() < deadline {
                    round += 1;
                    let body = serde_json::json!({
                        "messages": [
                            {"role": "system", "content": format!("System prompt of group {}. ", k % 4).repeat(50)},
                            {"role": "user", "content": format!("question {i} {k} {round}")}
                        ],
                        "max_tokens": 200, "stream": true
                    });
                    let r = client.post(format!("{url}/v1/chat/completions")).json(&body).send().await.unwrap();
                    let mut s = r.bytes_stream();
                    while let Some(Ok(b)) = s.next().await {
                        let n = b.windows(6).filter(|w| w == b"data: ").count() as u64;
                        tokens.fetch_add(n, Ordering::Relaxed);
                    }
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    let wall = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds(pid) - cpu0;
    let tok = tokens.load(Ordering::Relaxed) as f64;
    println!(
        "{n} servers x {c} streams, {wall:.1} s: {:.0} chunks/s, simulator CPU {:.1}% of one core, {:.1} us CPU per chunk",
        tok / wall,
        100.0 * cpu / wall,
        1e6 * cpu / tok
    );
}
