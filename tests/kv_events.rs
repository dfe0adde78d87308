//! Precise prefix routing from KV-cache events, through the real `inferlb` binary: in-test
//! ZeroMQ publishers send vLLM 0.32-encoded messages (the encoder is checked against the real
//! capture in the unit tests) for fake backends, and the router's choices, `/admin/backends`
//! and `/metrics` must follow what each publisher reports.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::binary::{spawn_with, Running};
use common::{admin_at, client, metrics_at, FakeBackend};
use inferlb::kv_events::wire::{encode, Event, Medium, Stored};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const BS: usize = 16;

/// A vLLM-like publisher: a PUB socket bound on 127.0.0.1 and its sequence counter.
struct Publisher {
    socket: PubSocket,
    port: u16,
    seq: u64,
}

impl Publisher {
    async fn bind(port: u16) -> Publisher {
        let mut socket = PubSocket::new();
        let endpoint = socket
            .bind(&format!("tcp://127.0.0.1:{port}"))
            .await
            .unwrap();
        let port = match endpoint {
            zeromq::Endpoint::Tcp(_, port) => port,
            other => panic!("{other:?}"),
        };
        Publisher {
            socket,
            port,
            seq: 0,
        }
    }

    /// Bind `port` again once the old socket has let go of it (at most 5 s).
    async fn rebind(port: u16) -> Publisher {
        for _ in 0..100 {
            let mut socket = PubSocket::new();
            if socket.bind(&format!("tcp://127.0.0.1:{port}")).await.is_ok() {
                return Publisher {
                    socket,
                    port,
                    seq: 0,
                };
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("port {port} never became free");
    }

    async fn send_seq(&mut self, seq: u64, events: &[Event]) {
        let mut msg = ZmqMessage::from(Bytes::from_static(b"kv@test"));
        msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        msg.push_back(Bytes::from(encode::payload(0.0, events)));
        self.socket.send(msg).await.unwrap();
    }

    /// Publish `events` as the next message.
    async fn send(&mut self, events: &[Event]) {
        self.send_seq(self.seq, events).await;
        self.seq += 1;
    }

    /// Repeat message 0 (`events`; later copies are duplicates to the router) until `router`
    /// has applied it for `backend`: a PUB socket drops what it sends before a subscriber is
    /// connected, as vLLM's does.
    async fn hello(&mut self, router: &str, backend: &str, events: &[Event]) {
        self.hello_until(router, backend, events, |k| {
            k["messages"].as_u64().unwrap_or(0) >= 1
        })
        .await
    }

    /// [`Publisher::hello`] until `heard` holds for the backend's `kv_events`.
    async fn hello_until(
        &mut self,
        router: &str,
        backend: &str,
        events: &[Event],
        heard: impl Fn(&serde_json::Value) -> bool,
    ) {
        assert_eq!(self.seq, 0);
        for _ in 0..300 {
            self.send_seq(0, events).await;
            let v = admin_at(router).await;
            if heard(kv(&v, backend)) {
                self.seq = 1;
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the router never received the publisher's first message");
    }
}

fn kv<'a>(v: &'a serde_json::Value, backend: &str) -> &'a serde_json::Value {
    v["backends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["url"] == backend)
        .map(|b| &b["kv_events"])
        .unwrap_or_else(|| panic!("no backend {backend} in {v}"))
}

/// `BlockStored` of `tokens`' full blocks, vLLM hashes `base..`, chained to `parent`.
fn stored(base: u64, parent: Option<u64>, tokens: &[u32]) -> Event {
    let n = tokens.len() / BS;
    Event::Stored(Stored {
        block_hashes: (0..n as u64).map(|i| base + i).collect(),
        parent,
        token_ids: tokens[..n * BS].to_vec(),
        block_size: BS as u32,
        lora_name: None,
        medium: Medium::Gpu,
        extra_keys: Vec::new(),
    })
}

fn removed(hashes: &[u64]) -> Event {
    Event::Removed {
        block_hashes: hashes.to_vec(),
        medium: Medium::Gpu,
    }
}

/// Write a config naming `backends` with their publishers and start the binary with it.
fn router(dir: &std::path::Path, name: &str, backends: &[(&FakeBackend, u16)]) -> Running {
    let mut text = String::from(
        "[poller]\ninterval_ms = 50\n\n[kv_events]\nquiet_ms = 600\ninflight_ms = 300\n\n",
    );
    for (b, port) in backends {
        text.push_str(&format!(
            "[[backends]]\nurl = \"{}\"\nmodels = [\"m\"]\nkv_events = \"tcp://127.0.0.1:{port}\"\n\n",
            b.url()
        ));
    }
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, text).unwrap();
    spawn_with(&["--config", path.to_str().unwrap()])
}

fn stop(mut r: Running) {
    let _ = r.child.kill();
    let _ = r.child.wait();
}

fn tempdir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("inferlb-kv-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Send a token-id completion; the backend that answered.
async fn route(router: &str, tokens: &[u32]) -> String {
    let resp = client()
        .post(format!("http://{router}/v1/completions"))
        .json(&serde_json::json!({"model": "m", "prompt": tokens, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.headers()["x-inferlb-backend"]
        .to_str()
        .unwrap()
        .to_owned()
}

/// Poll `router`'s admin view until `pred` holds for `backend`'s `kv_events` (at most 30 s).
async fn until_kv(router: &str, backend: &str, pred: impl Fn(&serde_json::Value) -> bool) {
    for _ in 0..600 {
        let v = admin_at(router).await;
        if pred(kv(&v, backend)) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let v = admin_at(router).await;
    panic!("never reached: {}", kv(&v, backend));
}

async fn until_healthy(router: &str, n: usize) {
    for _ in 0..600 {
        let v = admin_at(router).await;
        if v["backends"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["healthy"] == true)
            .count()
            == n
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("backends never healthy");
}

fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BS) as u32).map(|i| seed * 100_000 + i).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn precise_scores_follow_what_each_publisher_reports() {
    let a = FakeBackend::start("a", &["m"]).await;
    let b = FakeBackend::start("b", &["m"]).await;
    let mut pa = Publisher::bind(0).await;
    let mut pb = Publisher::bind(0).await;
    let dir = tempdir("follow");
    let r = router(&dir, "r", &[(&a, pa.port), (&b, pb.port)]);
    let addr = r.addr.clone();
    until_healthy(&addr, 2).await;
    // Each publisher announces an unrelated block (the block size becomes known).
    pa.hello(&addr, &a.url(), &[stored(1, None, &prompt(90, 1))])
        .await;
    pb.hello(&addr, &b.url(), &[stored(1, None, &prompt(91, 1))])
        .await;
    let p = prompt(1, 8);
    // `a` reports the prompt's 8 blocks (in two chained events): every request goes there.
    pa.send(&[stored(100, None, &p[..4 * BS])]).await;
    pa.send(&[stored(104, Some(103), &p[4 * BS..])]).await;
    until_kv(&addr, &a.url(), |k| k["blocks"] == 9).await;
    for _ in 0..5 {
        assert_eq!(route(&addr, &p).await, a.url());
    }
    // `a` evicts the prompt's first block, `b` stores the whole prompt: routing moves to b.
    pa.send(&[removed(&[100])]).await;
    pb.send(&[stored(200, None, &p)]).await;
    until_kv(&addr, &a.url(), |k| k["blocks"] == 8).await;
    until_kv(&addr, &b.url(), |k| k["blocks"] == 9).await;
    for _ in 0..5 {
        assert_eq!(route(&addr, &p).await, b.url());
    }
    let v = admin_at(&addr).await;
    assert_eq!(kv(&v, &a.url())["status"], "live");
    assert_eq!(kv(&v, &a.url())["blocks_removed"], 1);
    let m = metrics_at(&addr).await;
    assert!(
        m.contains("inferlb_kv_event_streams{state=\"live\"} 2"),
        "{m}"
    );
    assert!(m.contains("inferlb_prefix_precise_candidates_total{source=\"precise\"}"));
    stop(r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_stream_falls_back_visibly_and_comes_back() {
    let a = FakeBackend::start("a", &["m"]).await;
    let mut pa = Publisher::bind(0).await;
    let dir = tempdir("silent");
    let r = router(&dir, "r", &[(&a, pa.port)]);
    let addr = r.addr.clone();
    until_healthy(&addr, 1).await;
    pa.hello(&addr, &a.url(), &[stored(1, None, &prompt(90, 1))])
        .await;
    // A request with blocks `a` does not hold, and no event follows within quiet_ms.
    route(&addr, &prompt(2, 4)).await;
    until_kv(&addr, &a.url(), |k| k["status"] == "silent").await;
    let m = metrics_at(&addr).await;
    assert!(
        m.contains("inferlb_kv_event_streams{state=\"silent\"} 1"),
        "{m}"
    );
    route(&addr, &prompt(2, 4)).await;
    let m = metrics_at(&addr).await;
    assert!(
        m.contains("inferlb_prefix_precise_candidates_total{source=\"approximate\"}"),
        "{m}"
    );
    // Events flow again: live. (The router may have re-opened its socket: send until heard.)
    for _ in 0..300 {
        pa.send(&[stored(500, None, &prompt(3, 1))]).await;
        let v = admin_at(&addr).await;
        if kv(&v, &a.url())["status"] == "live" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    until_kv(&addr, &a.url(), |k| k["status"] == "live").await;
    stop(r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_restart_on_the_same_port_is_followed_and_clears() {
    let a = FakeBackend::start("a", &["m"]).await;
    let mut pa = Publisher::bind(0).await;
    let port = pa.port;
    let dir = tempdir("restart");
    let r = router(&dir, "r", &[(&a, port)]);
    let addr = r.addr.clone();
    until_healthy(&addr, 1).await;
    pa.hello(&addr, &a.url(), &[stored(1, None, &prompt(90, 1))])
        .await;
    for i in 0..5 {
        pa.send(&[stored(10 + i, None, &prompt(10 + i as u32, 1))])
            .await;
    }
    until_kv(&addr, &a.url(), |k| k["blocks"] == 6 && k["last_seq"] == 5).await;
    // The engine restarts on the same port; its sequence starts again at 0.
    pa.socket.close().await;
    let mut pa = Publisher::rebind(port).await;
    assert_eq!(pa.port, port);
    pa.hello_until(&addr, &a.url(), &[stored(77, None, &prompt(77, 2))], |k| {
        k["restarts"] == 1
    })
    .await;
    until_kv(&addr, &a.url(), |k| {
        k["restarts"] == 1 && k["blocks"] == 2 && k["status"] == "live"
    })
    .await;
    stop(r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_on_the_same_streams_route_a_shared_prefix_alike() {
    let a = FakeBackend::start("a", &["m"]).await;
    let b = FakeBackend::start("b", &["m"]).await;
    let mut pa = Publisher::bind(0).await;
    let mut pb = Publisher::bind(0).await;
    let dir = tempdir("replicas");
    let r1 = router(&dir, "r1", &[(&a, pa.port), (&b, pb.port)]);
    let r2 = router(&dir, "r2", &[(&a, pa.port), (&b, pb.port)]);
    let (x1, x2) = (r1.addr.clone(), r2.addr.clone());
    until_healthy(&x1, 2).await;
    until_healthy(&x2, 2).await;
    // Both replicas must have heard message 0 of each publisher.
    for (p, backend) in [(&mut pa, a.url()), (&mut pb, b.url())] {
        let first = [stored(1, None, &prompt(90, 1))];
        p.hello(&x1, &backend, &first).await;
        p.seq = 0;
        p.hello(&x2, &backend, &first).await;
    }
    // Shared prefixes, each reported by one backend.
    let shared: Vec<Vec<u32>> = (0..6).map(|i| prompt(40 + i, 4)).collect();
    for (i, p) in shared.iter().enumerate() {
        let publisher = if i % 2 == 0 { &mut pa } else { &mut pb };
        publisher.send(&[stored(1000 + 10 * i as u64, None, p)]).await;
    }
    until_kv(&x1, &a.url(), |k| k["blocks"] == 13).await;
    until_kv(&x2, &b.url(), |k| k["blocks"] == 13).await;
    until_kv(&x2, &a.url(), |k| k["blocks"] == 13).await;
    until_kv(&x1, &b.url(), |k| k["blocks"] == 13).await;
    for (i, p) in shared.iter().enumerate() {
        // A longer prompt sharing the prefix: the new tail is nobody's yet.
        let mut q = p.clone();
        q.extend(prompt(60 + i as u32, 1));
        let want = if i % 2 == 0 { a.url() } else { b.url() };
        assert_eq!(route(&x1, &q).await, want, "replica 1, prefix {i}");
        assert_eq!(route(&x2, &q).await, want, "replica 2, prefix {i}");
    }
    stop(r1);
    stop(r2);
}
