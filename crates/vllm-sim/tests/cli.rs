//! The `vllm-sim` binary: `--help`, a `--fleet` on free ports, flags reaching the server.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_vllm-sim"));
    c.stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    c
}

/// Starts the binary and reads the `n` URL lines it prints.
async fn start(args: &[&str], n: usize) -> (Child, Vec<String>) {
    let mut child = bin().args(args).spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut out = Vec::new();
    for _ in 0..n {
        let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        out.push(line);
    }
    (child, out)
}

#[tokio::test]
async fn help_lists_the_vllm_flags() {
    let out = Command::new(env!("CARGO_BIN_EXE_vllm-sim"))
        .arg("--help")
        .output()
        .await
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for flag in [
        "--served-model-name",
        "--block-size",
        "--num-gpu-blocks",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--max-model-len",
        "--lora-modules",
        "--time-scale",
        "--gpu-cache-usage-metric",
        "--fleet",
        "--instant",
        "--fail-rate",
        "--metrics-delay-ms",
        "--metrics-hang",
        "--metrics-garbage",
        "--first-token-stall-ms",
        "--cut-stream-after",
        "--refuse-after",
        "--admin-port",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}");
    }
    let bad = Command::new(env!("CARGO_BIN_EXE_vllm-sim"))
        .args(["--time-scale", "0"])
        .output()
        .await
        .unwrap();
    assert!(!bad.status.success(), "invalid config exits non-zero");
}

#[tokio::test]
async fn fleet_prints_urls_that_serve() {
    let (mut child, lines) = start(
        &["--fleet", "3", "--port", "0", "--served-model-name", "m"],
        3,
    )
    .await;
    let c = reqwest::Client::new();
    for url in &lines {
        assert!(url.starts_with("http://127.0.0.1:"), "{url}");
        assert_eq!(
            c.get(format!("{url}/health"))
                .send()
                .await
                .unwrap()
                .status(),
            200
        );
        let v: serde_json::Value = c
            .get(format!("{url}/v1/models"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(v["data"][0]["id"], "m");
    }
    let distinct: std::collections::BTreeSet<&String> = lines.iter().collect();
    assert_eq!(distinct.len(), 3, "three distinct servers");
    child.kill().await.unwrap();
}

#[tokio::test]
async fn fault_and_engine_flags_reach_the_server() {
    let args = [
        "--port",
        "0",
        "--admin-port",
        "0",
        "--fail-rate",
        "1",
        "--num-gpu-blocks-override",
        "64",
        "--block-size",
        "128",
        "--gpu-cache-usage-metric",
        "--instant",
    ];
    let (mut child, lines) = start(&args, 1).await;
    let (url, admin) = lines[0].split_once(" admin=").unwrap();
    let c = reqwest::Client::new();
    let r = c
        .post(format!("{url}/v1/completions"))
        .json(&serde_json::json!({"prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 500);
    let page = c
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains("block_size=\"128\""));
    assert!(page.contains("num_gpu_blocks=\"64\""));
    assert!(page.contains("vllm:gpu_cache_usage_perc{"));
    let v: serde_json::Value = c
        .get(format!("{admin}/sim/faults"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["fail_rate"], 1.0);
    child.kill().await.unwrap();
}
