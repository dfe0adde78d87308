//! Drives the real `inferlb` binary: flags, config errors, and serving a request.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::binary::{spawn_with, Running, BIN};
use common::FakeBackend;

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

/// Start the binary in front of `backend` with the shipped config.
fn spawn_binary(backend: &FakeBackend) -> Running {
    spawn_with(&["--config", "config.toml", "--backend", &backend.url()])
}

/// A streaming request through the binary whose backend holds the stream after its first
/// chunk; returns the body stream once that chunk has arrived.
async fn held_stream(
    addr: &str,
) -> impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin {
    use futures_util::StreamExt;
    let body = serde_json::json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let resp = reqwest::Client::new()
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let first = stream.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: {\"first\""), "{first:?}");
    stream
}

/// The listener is closed once the process logs `draining` (it drops the listener first).
async fn assert_refused(addr: &str) {
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "new connections must be refused during the drain"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_signal_drains_an_inflight_stream_then_exits_0() {
    use futures_util::StreamExt;
    let backend = FakeBackend::start("a", &["m"]).await;
    backend.state.hold_streams.store(true, Ordering::Relaxed);
    let mut bin = tokio::task::block_in_place(|| spawn_binary(&backend));
    let mut stream = held_stream(&bin.addr).await;
    bin.signal("-TERM");
    let draining = bin.log("draining").await;
    assert_eq!(draining["fields"]["connections"], 1, "{draining}");
    assert_refused(&bin.addr).await;
    assert!(
        bin.child.try_wait().unwrap().is_none(),
        "must not exit while a stream is in flight"
    );
    // Let the stream finish: it completes through the draining process.
    backend.state.gate.notify_one();
    let mut rest = Vec::new();
    while let Some(chunk) = stream.next().await {
        rest.extend_from_slice(&chunk.unwrap());
    }
    assert!(
        rest.ends_with(b"data: [DONE]\n\n"),
        "the in-flight stream completes: {}",
        String::from_utf8_lossy(&rest)
    );
    let stopped = bin.log("inferlb stopped").await;
    assert_eq!(stopped["fields"]["drained"], true, "{stopped}");
    let status = bin.exit().await;
    assert_eq!(status.code(), Some(0), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_deadline_cuts_what_is_left_and_exits_0() {
    use futures_util::StreamExt;
    let backend = FakeBackend::start("a", &["m"]).await;
    backend.state.hold_streams.store(true, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("inferlb-deadline-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("deadline.toml");
    std::fs::write(&config, "[server]\nshutdown_timeout_ms = 300\n").unwrap();
    let config = config.to_str().unwrap().to_owned();
    let mut bin = tokio::task::block_in_place(|| {
        spawn_with(&["--config", &config, "--backend", &backend.url()])
    });
    let mut stream = held_stream(&bin.addr).await;
    let signalled = std::time::Instant::now();
    bin.signal("-TERM");
    bin.log("draining").await;
    assert_refused(&bin.addr).await;
    // The stream is never released: the deadline ends it.
    bin.log("drain deadline passed; closing remaining connections")
        .await;
    assert!(
        signalled.elapsed() >= Duration::from_millis(300),
        "the deadline came early: {:?}",
        signalled.elapsed()
    );
    let stopped = bin.log("inferlb stopped").await;
    assert_eq!(stopped["fields"]["drained"], false, "{stopped}");
    let status = bin.exit().await;
    assert_eq!(status.code(), Some(0), "{status:?}");
    // The client's stream ends there, unfinished, and the backend sees its request go away.
    let mut rest = Vec::new();
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(chunk) = stream.next().await {
            match chunk {
                Ok(c) => rest.extend_from_slice(&c),
                Err(_) => break,
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the cut stream must end");
    assert!(
        !rest.ends_with(b"data: [DONE]\n\n"),
        "held, yet it finished"
    );
    let mut abandoned = backend.state.stream_abandoned.subscribe();
    tokio::time::timeout(Duration::from_secs(10), abandoned.wait_for(|v| *v))
        .await
        .expect("the backend must see the request go away")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_signal_drains_second_exits_at_once() {
    let backend = FakeBackend::start("a", &["m"]).await;
    backend.state.hold_streams.store(true, Ordering::Relaxed);
    let mut bin = tokio::task::block_in_place(|| spawn_binary(&backend));
    let _stream = held_stream(&bin.addr).await;
    bin.signal("-TERM");
    bin.log("draining").await;
    assert_refused(&bin.addr).await;
    assert!(
        bin.child.try_wait().unwrap().is_none(),
        "must not exit while a stream is in flight"
    );
    bin.signal("-TERM");
    bin.log("second signal: exiting without waiting for in-flight requests")
        .await;
    let status = bin.exit().await;
    assert_eq!(status.code(), Some(130));
}

#[cfg(feature = "demo")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_serves_a_streaming_chat_in_front_of_simulators() {
    let bin = tokio::task::block_in_place(|| spawn_with(&["--demo", "2"]));
    let addr = bin.addr.clone();
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
    bin.signal("-TERM");
    assert!(bin.exit().await.success());
}

/// A SIGTERM that arrives during start-up (here: while the first scrape of a backend that
/// never answers is still waiting) is a drain and exit 0, not death by the signal's default
/// action. The handlers used to be installed only when the accept loop first polled for the
/// signal, after the first scrape; this test then saw the process killed by SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigterm_during_start_up_is_a_clean_exit() {
    // Accepts connections (the kernel does) and never answers them.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let config =
        std::env::temp_dir().join(format!("inferlb-slow-start-{}.toml", std::process::id()));
    std::fs::write(&config, "[poller]\ntimeout_ms = 4000\n").unwrap();
    let mut child = Command::new(BIN)
        .args(["--listen", "127.0.0.1:0", "--log-format", "json"])
        .args(["--config", config.to_str().unwrap()])
        .args([
            "--backend",
            &format!("http://{}", silent.local_addr().unwrap()),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, mut lines) = tokio::sync::mpsc::unbounded_channel::<serde_json::Value>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Ok(v) = serde_json::from_str(&line) {
                let _ = tx.send(v);
            }
        }
    });
    // Logged just before the first scrape, which waits up to 4 s on the silent backend.
    tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(v) = lines.recv().await {
            assert!(
                v["fields"]["main_addr"].is_null(),
                "start-up finished before the signal could be sent: {v}"
            );
            if v["fields"]["message"] == "scheduling profile" {
                return;
            }
        }
        panic!("the binary ended its log before the scheduling profile line");
    })
    .await
    .expect("no scheduling profile line within 30 s");
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let status = tokio::time::timeout(
        Duration::from_secs(20),
        tokio::task::spawn_blocking(move || child.wait().unwrap()),
    )
    .await
    .expect("the process did not exit within 20 s")
    .unwrap();
    let _ = std::fs::remove_file(&config);
    assert!(status.success(), "{status:?}");
    drop(silent);
}
