//! KV-event fixtures of `tests/kv_events.rs`: vLLM-like ZeroMQ publishers and replay sockets
//! (messages encoded as vLLM 0.32 encodes them) for fake backends, routers configured with
//! their streams, and waits on what the router's `/admin/backends` reports of them.

use std::time::Duration;

use bytes::Bytes;
use inferlb::kv_events::wire::{encode, Event, Medium, Stored};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

use super::binary::{spawn_with, Running};
use super::{admin_at, client, FakeBackend};

pub const BS: usize = 16;

/// A vLLM-like publisher: a PUB socket bound on 127.0.0.1 and its sequence counter.
pub struct Publisher {
    pub socket: PubSocket,
    pub port: u16,
    pub seq: u64,
}

impl Publisher {
    pub async fn bind(port: u16) -> Publisher {
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
    pub async fn rebind(port: u16) -> Publisher {
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

    pub async fn send_seq(&mut self, seq: u64, events: &[Event]) {
        let mut msg = ZmqMessage::from(Bytes::from_static(b"kv@test"));
        msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        msg.push_back(Bytes::from(encode::payload(0.0, events)));
        self.socket.send(msg).await.unwrap();
    }

    /// Publish `events` as the next message.
    pub async fn send(&mut self, events: &[Event]) {
        self.send_seq(self.seq, events).await;
        self.seq += 1;
    }

    /// Repeat message 0 (`events`; later copies are duplicates to the router) until `router`
    /// has applied it for `backend`: a PUB socket drops what it sends before a subscriber is
    /// connected, as vLLM's does.
    pub async fn hello(&mut self, router: &str, backend: &str, events: &[Event]) {
        self.hello_until(router, backend, events, |k| {
            k["messages"].as_u64().unwrap_or(0) >= 1
        })
        .await
    }

    /// [`Publisher::hello`] with one block (hash 1) of `seed`'s tokens that no test prompt
    /// shares: the stream is then live and its block size known.
    pub async fn announce(&mut self, router: &str, backend: &str, seed: u32) {
        self.hello(router, backend, &[stored(1, None, &prompt(seed, 1))])
            .await
    }

    /// [`Publisher::hello`] until `heard` holds for the backend's `kv_events`.
    pub async fn hello_until(
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

pub fn kv<'a>(v: &'a serde_json::Value, backend: &str) -> &'a serde_json::Value {
    v["backends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["url"] == backend)
        .map(|b| &b["kv_events"])
        .unwrap_or_else(|| panic!("no backend {backend} in {v}"))
}

/// `BlockStored` of `tokens`' full blocks, vLLM hashes `base..`, chained to `parent`.
pub fn stored(base: u64, parent: Option<u64>, tokens: &[u32]) -> Event {
    let n = tokens.len() / BS;
    // GPU blocks of no adapter, without extra keys.
    Event::Stored(Stored {
        block_hashes: (0..n as u64).map(|i| base + i).collect(),
        parent,
        token_ids: tokens[..n * BS].to_vec(),
        block_size: BS as u32,
        ..Stored::default()
    })
}

pub fn removed(hashes: &[u64]) -> Event {
    Event::Removed {
        block_hashes: hashes.to_vec(),
        medium: Medium::Gpu,
    }
}

/// Write a config naming `backends` with their publishers and start the binary with it.
pub fn router(dir: &std::path::Path, name: &str, backends: &[(&FakeBackend, u16)]) -> Running {
    let with: Vec<_> = backends.iter().map(|(b, p)| (*b, *p, None)).collect();
    router_with(dir, name, &with, "")
}

/// [`router`], with a replay port per backend and `extra` config (plugins, a profile).
pub fn router_with(
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

pub fn stop(mut r: Running) {
    let _ = r.child.kill();
    let _ = r.child.wait();
}

pub fn tempdir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("inferlb-kv-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Send a token-id completion; the backend that answered.
pub async fn route(router: &str, tokens: &[u32]) -> String {
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
pub async fn until_kv(router: &str, backend: &str, pred: impl Fn(&serde_json::Value) -> bool) {
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

pub async fn until_healthy(router: &str, n: usize) {
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
pub struct Pair {
    pub a: FakeBackend,
    pub b: FakeBackend,
    pub pa: Publisher,
    pub pb: Publisher,
    pub r: Running,
}

pub async fn live_pair(name: &str, extra: &str) -> Pair {
    live_pair_with(name, [None, None], extra).await
}

/// [`live_pair`], `a` and `b` with the replay ports `replays`.
pub async fn live_pair_with(name: &str, replays: [Option<u16>; 2], extra: &str) -> Pair {
    let (a, mut pa) = published("a").await;
    let (b, mut pb) = published("b").await;
    let r = router_with(
        &tempdir(name),
        name,
        &[(&a, pa.port, replays[0]), (&b, pb.port, replays[1])],
        extra,
    );
    until_healthy(&r.addr, 2).await;
    pa.announce(&r.addr, &a.url(), 90).await;
    pb.announce(&r.addr, &b.url(), 91).await;
    Pair { a, b, pa, pb, r }
}

/// A fake backend `name` serving `m`, and a publisher of its own.
pub async fn published(name: &str) -> (FakeBackend, Publisher) {
    (
        FakeBackend::start(name, &["m"]).await,
        Publisher::bind(0).await,
    )
}

/// One fake backend `a` and its publisher behind a router (config `name`), its stream live.
pub async fn live_one(name: &str) -> (FakeBackend, Publisher, Running) {
    let (a, mut pa) = published("a").await;
    let r = router(&tempdir(name), "r", &[(&a, pa.port)]);
    until_healthy(&r.addr, 1).await;
    pa.announce(&r.addr, &a.url(), 90).await;
    (a, pa, r)
}

/// `/kv_event_sources` as vLLM answers it, for a publisher at `endpoint`.
pub fn sources(endpoint: &str) -> String {
    format!(
        r#"{{"0":{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"{endpoint}","replay_endpoint":"","topic":"kv@test"}}}}"#
    )
}

/// The binary with `--kv-events auto` in front of the one backend at `url` (serving `m`),
/// once that backend is healthy.
pub async fn auto_router(name: &str, url: &str) -> Running {
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

pub fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BS) as u32)
        .map(|i| seed * 100_000 + i)
        .collect()
}

/// A vLLM-like replay socket (ROUTER): answers `[b"", start_seq]` with the buffered messages
/// from `start_seq` on, then the end marker (seq -1, empty payload). Returns its port and a
/// count of the requests it answered.
pub async fn replay_server(
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
