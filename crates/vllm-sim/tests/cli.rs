//! The `vllm-sim` binary: `--help`, a `--fleet` on free ports, flags reaching the server.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use common::kv::{get, kind, u64s};
use common::{client, get_json, get_response, metrics_text, post};

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
        "--kv-events-config",
        "--kv-events-drop-rate",
        "--kv-events-stall-after",
        "--kv-events-stall-ms",
        "--kv-events-restart-after",
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
    for url in &lines {
        assert!(url.starts_with("http://127.0.0.1:"), "{url}");
        assert_eq!(get_response(&format!("{url}/health")).await.status(), 200);
        let v: serde_json::Value = get_json(&format!("{url}/v1/models")).await;
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
    let c = client();
    let r = post(
        &format!("{url}/v1/completions"),
        &serde_json::json!({"prompt": "x"}),
    )
    .await;
    assert_eq!(r.status(), 500);
    let page = metrics_text(&c, url).await;
    assert!(page.contains("block_size=\"128\""));
    assert!(page.contains("num_gpu_blocks=\"64\""));
    assert!(page.contains("vllm:gpu_cache_usage_perc{"));
    let v: serde_json::Value = get_json(&format!("{admin}/sim/faults")).await;
    assert_eq!(v["fail_rate"], 1.0);
    child.kill().await.unwrap();
}

#[tokio::test]
async fn kv_events_flag_publishes_from_the_binary() {
    use zeromq::{Socket, SocketRecv, SubSocket};
    let cfg = r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:0","replay_endpoint":"tcp://*:0","topic":"kv@bin"}"#;
    let args = [
        "--port",
        "0",
        "--instant",
        "--block-size",
        "16",
        "--kv-events-config",
        cfg,
    ];
    let (mut child, lines) = start(&args, 1).await;
    let (url, ep) = lines[0].split_once(" kv_events=").unwrap();
    assert!(ep.starts_with("tcp://127.0.0.1:"), "{ep}");
    let c = client();
    let v: serde_json::Value = get_json(&format!("{url}/kv_event_sources")).await;
    assert_eq!(
        v["0"]["endpoint"],
        format!("tcp://*:{}", ep.rsplit_once(':').unwrap().1)
    );
    assert_eq!(v["0"]["topic"], "kv@bin");
    assert_eq!(v["0"]["buffer_steps"], 10_000);
    let mut sub = SubSocket::new();
    sub.connect(ep).await.unwrap();
    sub.subscribe("kv@").await.unwrap();
    // Until the subscription is in place, resets of the idle cache are published unseen.
    let mut seen = None;
    for _ in 0..100 {
        let r = c
            .post(format!("{url}/reset_prefix_cache"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        if let Ok(m) = tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {
            seen = Some(m.unwrap());
            break;
        }
    }
    let first = seen.expect("subscribed");
    assert_eq!(&first.get(0).unwrap()[..], b"kv@bin");
    let ids: Vec<u32> = (100..116).collect();
    let r = post(
        &format!("{url}/v1/completions"),
        &serde_json::json!({"prompt": ids, "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status(), 200);
    for _ in 0..100 {
        let m = tokio::time::timeout(Duration::from_secs(10), sub.recv())
            .await
            .unwrap()
            .unwrap();
        let payload = m.get(2).unwrap().clone();
        let v = rmpv::decode::read_value(&mut &payload[..]).unwrap();
        let events = v.as_array().unwrap()[1].as_array().unwrap().clone();
        if let Some(e) = events.iter().find(|e| kind(e) == "BlockStored") {
            let tokens: Vec<u32> = u64s(get(e, "token_ids"))
                .into_iter()
                .map(|t| t as u32)
                .collect();
            assert_eq!(tokens, ids);
            child.kill().await.unwrap();
            return;
        }
    }
    panic!("no BlockStored from the binary");
}

#[tokio::test]
async fn bad_kv_events_config_is_refused_naming_the_key() {
    let out = Command::new(env!("CARGO_BIN_EXE_vllm-sim"))
        .args([
            "--kv-events-config",
            r#"{"enable_kv_cache_events":true,"replay":"x"}"#,
        ])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("unknown field `replay`"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_vllm-sim"))
        .args(["--kv-events-drop-rate", "0.5"])
        .output()
        .await
        .unwrap();
    assert!(
        !out.status.success(),
        "a kv fault without kv events is a mistake"
    );
}

#[tokio::test]
async fn vllms_store_env_var_turns_the_responses_store_on() {
    for (value, status) in [("1", 200), ("0", 400)] {
        let mut child = bin()
            .args(["--port", "0", "--instant"])
            .env("VLLM_ENABLE_RESPONSES_API_STORE", value)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let url = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let body = serde_json::json!({"input": "x", "max_output_tokens": 1, "background": true});
        let r = post(&format!("{url}/v1/responses"), &body).await;
        assert_eq!(
            r.status(),
            status,
            "VLLM_ENABLE_RESPONSES_API_STORE={value}"
        );
        child.kill().await.unwrap();
    }
}
