//! Per-core request workers (`[server] workers`, `crate::workers`): each worker accepts on a
//! socket of its own and serves what it accepted; the limits and the drain hold for the
//! listener as a whole.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::binary::spawn_with;
use common::*;
use inferlb::workers::Workers;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Send `GET /health` on `stream` (kept open); the answer, or nothing when the router closed
/// the connection first (within 10 s).
async fn health(stream: &mut TcpStream) -> Vec<u8> {
    let _ = stream
        .write_all(b"GET /health HTTP/1.1\r\nhost: inferlb\r\n\r\n")
        .await;
    let mut buf = vec![0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
        .await
        .expect("an answer or a close within 10 s")
        .unwrap_or(0);
    buf.truncate(n);
    buf
}

/// `max_connections` counts the connections of every worker together: with 4 workers and a
/// cap of 2, of 10 connections held open exactly 2 are served, whichever workers accepted them.
/// (With a cap per worker, connections accepted by the other workers were served too.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_cap_holds_for_all_workers_together() {
    let b = FakeBackend::start("a", &["m"]).await;
    let mut cfg = config(&[&b]);
    cfg.server.workers = Workers::Count(4);
    cfg.limits.max_connections = 2;
    cfg.server.header_read_timeout_ms = 60_000;
    let router = start_router(cfg).await;
    let mut open = Vec::new();
    let mut served = 0;
    for _ in 0..10 {
        let mut s = TcpStream::connect(router.addr).await.unwrap();
        if health(&mut s).await.starts_with(b"HTTP/1.1 200") {
            served += 1;
        }
        open.push(s);
    }
    assert_eq!(
        served, 2,
        "served connections with a cap of 2 over 4 workers"
    );
    drop(open);
    router.shutdown().await;
}

/// The binary with `--workers 3`: three workers start, and 24 concurrent keep-alive clients
/// (spread by the kernel over the workers' SO_REUSEPORT sockets) all get their answers, each
/// from the backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_concurrent_clients_on_three_workers() {
    let backend = FakeBackend::start("a", &["m"]).await;
    let mut bin = tokio::task::block_in_place(|| {
        spawn_with(&["--backend", &backend.url(), "--workers", "3"])
    });
    let started = bin.log("request workers started").await;
    assert_eq!(started["fields"]["workers"], 3, "{started}");
    let addr = bin.addr.clone();
    let clients = (0..24).map(|i| {
        let addr = addr.clone();
        tokio::spawn(async move {
            // A client of its own: a connection of its own.
            let client = reqwest::Client::new();
            for j in 0..3 {
                let resp = client
                    .post(format!("http://{addr}/v1/chat/completions"))
                    .json(&serde_json::json!({"model": "m", "messages": [{"role": "user", "content": format!("client {i} turn {j}")}]}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(resp.status(), 200);
                assert!(resp.headers().contains_key("x-inferlb-backend"));
                resp.bytes().await.unwrap();
            }
        })
    });
    for c in clients {
        c.await.unwrap();
    }
    bin.signal("-TERM");
    bin.log("inferlb stopped").await;
    assert!(bin.exit().await.success());
}

/// `--workers` is checked like any setting: a bad value exits 2 naming what is accepted.
#[test]
fn a_bad_workers_value_is_refused() {
    let out = std::process::Command::new(common::binary::BIN)
        .args(["--workers", "0", "--check"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("1..=1024"), "{err}");
}
