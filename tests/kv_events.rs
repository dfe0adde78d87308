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
            if socket
                .bind(&format!("tcp://127.0.0.1:{port}"))
                .await
                .is_ok()
            {
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
    let with: Vec<_> = backends.iter().map(|(b, p)| (*b, *p, None)).collect();
    router_with(dir, name, &with, "")
}

/// [`router`], with a replay port per backend and `extra` config (plugins, a profile).
fn router_with(
    dir: &std::path::Path,
    name: &str,
    backends: &[(&FakeBackend, u16, Option<u16>)],
    extra: &str,
) -> Running {
    let mut text = String::from("[poller]\ninterval_ms = 50\n\n[kv_events]\nquiet_ms = 600\n\n");
    for (b, port, replay) in backends {
        text.push_str(&format!(
            "[[backends]]\nurl = \"{}\"\nmodels = [\"m\"]\nkv_events = \"tcp://127.0.0.1:{port}\"\n",
            b.url()
        ));
        if let Some(r) = replay {
            text.push_str(&format!("kv_events_replay = \"tcp://127.0.0.1:{r}\"\n"));
        }
        text.push('\n');
    }
    text.push_str(extra);
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

/// Two fake backends serving `m`, each with its own publisher, behind one router (`extra`
/// config appended); each publisher has announced one unrelated block, so both streams are
/// live and their block size is known.
struct Pair {
    a: FakeBackend,
    b: FakeBackend,
    pa: Publisher,
    pb: Publisher,
    r: Running,
}

async fn live_pair(name: &str, extra: &str) -> Pair {
    let a = FakeBackend::start("a", &["m"]).await;
    let b = FakeBackend::start("b", &["m"]).await;
    let mut pa = Publisher::bind(0).await;
    let mut pb = Publisher::bind(0).await;
    let r = router_with(
        &tempdir(name),
        name,
        &[(&a, pa.port, None), (&b, pb.port, None)],
        extra,
    );
    until_healthy(&r.addr, 2).await;
    pa.hello(&r.addr, &a.url(), &[stored(1, None, &prompt(90, 1))])
        .await;
    pb.hello(&r.addr, &b.url(), &[stored(1, None, &prompt(91, 1))])
        .await;
    Pair { a, b, pa, pb, r }
}

/// `/kv_event_sources` as vLLM answers it, for a publisher at `endpoint`.
fn sources(endpoint: &str) -> String {
    format!(
        r#"{{"0":{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"{endpoint}","replay_endpoint":"","topic":"kv@test"}}}}"#
    )
}

/// The binary with `--kv-events auto` in front of the one backend at `url` (serving `m`),
/// once that backend is healthy.
async fn auto_router(name: &str, url: &str) -> Running {
    let path = tempdir(name).join(format!("{name}.toml"));
    std::fs::write(
        &path,
        format!("[poller]\ninterval_ms = 50\n\n[[backends]]\nurl = \"{url}\"\nmodels = [\"m\"]\n"),
    )
    .unwrap();
    let r = spawn_with(&["--config", path.to_str().unwrap(), "--kv-events", "auto"]);
    until_healthy(&r.addr, 1).await;
    r
}

fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BS) as u32)
        .map(|i| seed * 100_000 + i)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn precise_scores_follow_what_each_publisher_reports() {
    // Each publisher has announced an unrelated block (the block size is known).
    let Pair {
        a,
        b,
        mut pa,
        mut pb,
        r,
    } = live_pair("follow", "").await;
    let addr = r.addr.clone();
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
        publisher
            .send(&[stored(1000 + 10 * i as u64, None, p)])
            .await;
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

/// A vLLM-like replay socket (ROUTER): answers `[b"", start_seq]` with the buffered messages
/// from `start_seq` on, then the end marker (seq -1, empty payload). Returns its port and a
/// count of the requests it answered.
async fn replay_server(
    buffered: Vec<(u64, Vec<Event>)>,
) -> (u16, std::sync::Arc<std::sync::atomic::AtomicU64>) {
    use zeromq::{RouterSocket, SocketRecv};
    let mut socket = RouterSocket::new();
    let port = match socket.bind("tcp://127.0.0.1:0").await.unwrap() {
        zeromq::Endpoint::Tcp(_, port) => port,
        other => panic!("{other:?}"),
    };
    let asked = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let count = std::sync::Arc::clone(&asked);
    tokio::spawn(async move {
        while let Ok(msg) = socket.recv().await {
            let frames = msg.into_vec();
            let identity = frames[0].clone();
            let start = u64::from_be_bytes(frames.last().unwrap()[..].try_into().unwrap());
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            // As vLLM 0.32 answers (seen on a real server): delimiter, topic, seq, payload.
            for (seq, events) in buffered.iter().filter(|(s, _)| *s >= start) {
                let mut out = ZmqMessage::from(identity.clone());
                out.push_back(Bytes::new());
                out.push_back(Bytes::from_static(b"kv@test"));
                out.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
                out.push_back(Bytes::from(encode::payload(0.0, events)));
                socket.send(out).await.unwrap();
            }
            let mut end = ZmqMessage::from(identity.clone());
            end.push_back(Bytes::new());
            end.push_back(Bytes::new());
            end.push_back(Bytes::copy_from_slice(&(-1i64).to_be_bytes()));
            end.push_back(Bytes::new());
            socket.send(end).await.unwrap();
        }
    });
    (port, asked)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_replayed_when_possible_and_makes_the_backend_unsure_otherwise() {
    let a = FakeBackend::start("a", &["m"]).await;
    let b = FakeBackend::start("b", &["m"]).await;
    let mut pa = Publisher::bind(0).await;
    let mut pb = Publisher::bind(0).await;
    // Message 1 of `a` is lost on the live stream but still in its replay buffer.
    let lost = vec![stored(300, None, &prompt(30, 2))];
    let (replay, asked) = replay_server(vec![(1, lost)]).await;
    let dir = tempdir("gap");
    let r = router_with(
        &dir,
        "r",
        &[(&a, pa.port, Some(replay)), (&b, pb.port, None)],
        "",
    );
    let addr = r.addr.clone();
    until_healthy(&addr, 2).await;
    pa.hello(&addr, &a.url(), &[stored(1, None, &prompt(90, 1))])
        .await;
    pb.hello(&addr, &b.url(), &[stored(1, None, &prompt(91, 1))])
        .await;
    pa.seq = 2;
    pa.send(&[stored(400, None, &prompt(40, 1))]).await;
    until_kv(&addr, &a.url(), |k| k["last_seq"] == 2).await;
    let v = admin_at(&addr).await;
    let k = kv(&v, &a.url());
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(k["blocks"], 4, "hello 1 + replayed 2 + live 1: {k}");
    assert_eq!(
        (k["gaps"].as_u64(), k["status"].as_str()),
        (Some(1), Some("live"))
    );
    // `b` has no replay endpoint: the same gap leaves it unsure, visibly.
    pb.seq = 2;
    pb.send(&[stored(400, None, &prompt(40, 1))]).await;
    until_kv(&addr, &b.url(), |k| k["status"] == "unsure").await;
    let m = metrics_at(&addr).await;
    assert!(
        m.contains("inferlb_kv_event_streams{state=\"unsure\"} 1"),
        "{m}"
    );
    stop(r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_auto_reads_the_backends_kv_event_sources() {
    let a = FakeBackend::start("a", &["m"]).await;
    let mut pa = Publisher::bind(0).await;
    // As vLLM answers it: the endpoint with `*` (it binds; the router connects to the
    // backend's host).
    *a.state.kv_sources.lock().unwrap() = Some(sources(&format!("tcp://*:{}", pa.port)));
    let r = auto_router("auto", &a.url()).await;
    let addr = r.addr.clone();
    pa.hello(&addr, &a.url(), &[stored(1, None, &prompt(90, 3))])
        .await;
    until_kv(&addr, &a.url(), |k| {
        k["blocks"] == 3 && k["endpoint"] == format!("tcp://127.0.0.1:{}", pa.port)
    })
    .await;
    stop(r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_auto_follows_a_simulator_that_bound_port_0() {
    // What `loadgen compare --sim-kv-events` runs: the simulator binds `tcp://*:0`, and its
    // `/kv_event_sources` must keep the wildcard with the port it got, so the router connects.
    // (Reported as `tcp://127.0.0.1:PORT`, the router would bind that address too, fail with
    // "address in use" and never see an event.)
    let sim = vllm_sim::spawn(vllm_sim::SimConfig {
        port: 0,
        model: "m".into(),
        instant: true,
        block_size: BS,
        kv_events_config: Some(
            vllm_sim::KvEventsConfig::parse(
                r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:0","topic":"kv@sim"}"#,
            )
            .unwrap(),
        ),
        ..vllm_sim::SimConfig::default()
    })
    .await
    .unwrap();
    let r = auto_router("sim0", &sim.url()).await;
    let addr = r.addr.clone();
    until_kv(&addr, &sim.url(), |k| k["status"] == "live").await;
    // A PUB socket drops what it sends before the subscription reaches it: send until the
    // router has applied a stored block (bounded).
    let tokens: Vec<u32> = (1..=(4 * BS) as u32).collect();
    for _ in 0..100 {
        route(&addr, &tokens).await;
        if kv(&admin_at(&addr).await, &sim.url())["blocks_stored"]
            .as_u64()
            .is_some_and(|n| n >= 4)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    until_kv(&addr, &sim.url(), |k| {
        k["status"] == "live" && k["blocks"].as_u64().is_some_and(|n| n >= 4)
    })
    .await;
    stop(r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_socket_cannot_open_is_broken_not_live() {
    // The backend names an endpoint without a wildcard (vLLM's rule: the publisher connects,
    // the subscriber binds) on a port someone else holds: the router cannot bind it.
    let a = FakeBackend::start("a", &["m"]).await;
    let squatter = Publisher::bind(0).await;
    *a.state.kv_sources.lock().unwrap() =
        Some(sources(&format!("tcp://127.0.0.1:{}", squatter.port)));
    let r = auto_router("broken", &a.url()).await;
    let addr = r.addr.clone();
    until_kv(&addr, &a.url(), |k| k["status"] == "broken").await;
    let m = metrics_at(&addr).await;
    assert!(
        m.contains("inferlb_kv_event_streams{state=\"broken\"} 1"),
        "{m}"
    );
    // It stays broken (retried with back-off), never reported live while the socket is shut.
    for _ in 0..10 {
        assert_eq!(kv(&admin_at(&addr).await, &a.url())["status"], "broken");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Once the port is free, the router binds it and the stream is live.
    drop(squatter);
    until_kv(&addr, &a.url(), |k| k["status"] == "live").await;
    stop(r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_evicted_everywhere_returns_to_the_backend_it_was_sent_to() {
    // Nobody holds the prefix any more (stored, then evicted, events flowing): the room term
    // alone would move it to the backend the router filled least; the router's memory keeps it
    // where it went before. With `memory_weight = 0` this sends it to the other backend.
    let Pair {
        a,
        b,
        mut pa,
        mut pb,
        r,
    } = live_pair(
        "memory",
        "[[plugins]]\ntype = \"prefix-cache-scorer\"\n[plugins.parameters]\ninflight_ms = 1\n\
         [[plugins]]\ntype = \"max-score-picker\"\n\
         [[scheduling_profiles]]\nname = \"p\"\nplugins = [{ plugin_ref = \"prefix-cache-scorer\" }, { plugin_ref = \"max-score-picker\" }]\n",
    )
    .await;
    let addr = r.addr.clone();
    for round in 0..3u32 {
        let p = prompt(10 + round, 4);
        let first = route(&addr, &p).await;
        let (held, publisher) = if first == a.url() {
            (&a, &mut pa)
        } else {
            (&b, &mut pb)
        };
        // It stores the prompt's 4 blocks, then evicts them.
        let base = 1_000 * u64::from(round + 1);
        publisher.send(&[stored(base, None, &p)]).await;
        until_kv(&addr, &held.url(), |k| k["blocks"] == 5).await;
        publisher
            .send(&[removed(&[base, base + 1, base + 2, base + 3])])
            .await;
        until_kv(&addr, &held.url(), |k| {
            k["blocks"] == 1 && k["in_flight_blocks"] == 0 && k["status"] == "live"
        })
        .await;
        assert_eq!(route(&addr, &p).await, first, "round {round}");
    }
    stop(r);
}
