//! Drives the real `inferlb` binary: flags, config errors, and serving a request.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use common::FakeBackend;

const BIN: &str = env!("CARGO_BIN_EXE_inferlb");

#[test]
fn help_explains_flags() {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    for flag in [
        "--config",
        "--listen",
        "--backend",
        "--log-format",
        "--admin-listen",
        "--check",
    ] {
        assert!(text.contains(flag), "{flag} missing from --help:\n{text}");
    }
}

#[test]
fn shipped_config_checks() {
    let out = Command::new(BIN)
        .args(["--config", "config.toml", "--check"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn config_errors_name_the_field_and_exit_2() {
    let dir = std::env::temp_dir().join(format!("inferlb-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        ("listen = \"127.0.0.1:1\"\nlisen = 3\n", "lisen"),
        ("[[backends]]\nurl = \"http://h:1/x\"\n", "backends[0].url"),
        (
            "[[backends]]\nurl = \"http://h:1\"\n[[scheduling_profiles]]\nname = \"p\"\nplugins = [{ plugin_ref = \"ghost\", weight = 1 }]\n",
            "plugin_ref",
        ),
    ];
    for (i, (text, needle)) in cases.iter().enumerate() {
        let path = dir.join(format!("c{i}.toml"));
        std::fs::write(&path, text).unwrap();
        let out = Command::new(BIN)
            .arg("--config")
            .arg(&path)
            .arg("--check")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{text}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{needle} not in: {err}");
    }
    let out = Command::new(BIN).args(["--check"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "no backends is an error");
    assert!(String::from_utf8_lossy(&out.stderr).contains("backends"));
}

#[tokio::test]
async fn binary_serves_requests_with_cli_overrides() {
    let backend = FakeBackend::start("a", &["m"]).await;
    let mut child = Command::new(BIN)
        .args([
            "--config",
            "config.toml",
            "--listen",
            "127.0.0.1:0",
            "--log-format",
            "json",
        ])
        .args(["--backend", &backend.url()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    // The JSON log line announcing the listener carries the bound address.
    let addr = tokio::task::spawn_blocking(move || {
        for line in BufReader::new(stdout).lines() {
            let line = line.unwrap();
            let v: serde_json::Value = serde_json::from_str(&line).unwrap();
            if let Some(addr) = v["fields"]["main_addr"].as_str() {
                return addr.to_owned();
            }
        }
        panic!("the binary never announced its address");
    })
    .await
    .unwrap();
    let resp = reqwest::Client::new()
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-inferlb-backend"], backend.url().as_str());
    // SIGTERM drains and exits 0.
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(status.success(), "{status:?}");
}

/// Start the binary in front of `backend`; returns the child and its address.
fn spawn_binary(backend: &FakeBackend) -> (std::process::Child, String) {
    spawn_with(&["--config", "config.toml", "--backend", &backend.url()])
}

/// Start the binary with `args` on a free port; returns the child and its address.
fn spawn_with(args: &[&str]) -> (std::process::Child, String) {
    let mut child = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0", "--log-format", "json"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    for line in lines.by_ref() {
        // The demo also prints plain lines for people; only JSON log lines matter here.
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&line.unwrap()) else {
            continue;
        };
        if let Some(addr) = v["fields"]["main_addr"].as_str() {
            // Keep draining stdout so the child never blocks on a full pipe.
            std::thread::spawn(move || for _ in lines {});
            return (child, addr.to_owned());
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("the binary never announced its address");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_signal_drains_second_exits_at_once() {
    use futures_util::StreamExt;
    use std::sync::atomic::Ordering;
    let backend = FakeBackend::start("a", &["m"]).await;
    backend.state.hold_streams.store(true, Ordering::Relaxed);
    let (child, addr) = tokio::task::block_in_place(|| spawn_binary(&backend));
    let body = serde_json::json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let resp = reqwest::Client::new()
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let mut stream = resp.bytes_stream();
    let _first = stream.next().await.unwrap().unwrap();
    let pid = child.id().to_string();
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    // Draining: the listener closes at once, but the held stream keeps the process alive.
    let mut refused = false;
    for _ in 0..1000 {
        if tokio::net::TcpStream::connect(&addr).await.is_err() {
            refused = true;
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(refused, "the first signal must close the listener");
    let mut child = child;
    assert!(
        child.try_wait().unwrap().is_none(),
        "must not exit while a stream is in flight"
    );
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    let status = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        tokio::task::spawn_blocking(move || child.wait().unwrap()),
    )
    .await
    .expect("the second signal must end the process promptly")
    .unwrap();
    assert_eq!(status.code(), Some(130));
}

#[cfg(feature = "demo")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_serves_a_streaming_chat_in_front_of_simulators() {
    let (mut child, addr) = tokio::task::block_in_place(|| spawn_with(&["--demo", "2"]));
    let body = serde_json::json!({
        "model": "demo-llama", "stream": true, "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hello!"}]
    });
    let resp = reqwest::Client::new()
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().contains_key("x-inferlb-backend"));
    let text = resp.text().await.unwrap();
    assert_eq!(text.matches("chat.completion.chunk").count(), 5, "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(status.success());
}
