//! KV-event helpers of the integration tests: a simulator config that publishes, a SUB that
//! waits for its subscription to take effect, a replay client, msgpack decoding with `rmpv`.

use std::time::Duration;

use bytes::Bytes;
use rmpv::Value;
use serde_json::{json, Value as Json};
use vllm_sim::{KvEventsConfig, SimConfig, SimHandle};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::{post, start};

pub const BS: usize = 16;

pub fn kv_config(replay: bool, buffer_steps: usize) -> KvEventsConfig {
    let replay = if replay {
        r#","replay_endpoint":"tcp://*:0""#
    } else {
        ""
    };
    KvEventsConfig::parse(&format!(
        r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:0","topic":"kv@sim","buffer_steps":{buffer_steps}{replay}}}"#
    ))
    .unwrap()
}

pub fn config(blocks: usize) -> SimConfig {
    SimConfig {
        instant: true,
        block_size: BS,
        num_gpu_blocks: blocks,
        kv_events_config: Some(kv_config(true, 1000)),
        ..SimConfig::default()
    }
}

/// One received message, decoded.
#[derive(Debug, Clone)]
pub struct Batch {
    pub topic: Vec<u8>,
    pub seq: u64,
    pub raw: Bytes,
    pub events: Vec<Value>,
}

pub fn decode(topic: &[u8], seq: &[u8], payload: Bytes) -> Batch {
    let seq = u64::from_be_bytes(seq.try_into().expect("seq is 8 bytes"));
    let v = rmpv::decode::read_value(&mut &payload[..]).unwrap();
    let p = v.as_array().unwrap();
    assert_eq!(p.len(), 3, "[ts, events, dp_rank]");
    assert!(p[0].is_f64());
    assert_eq!(p[2].as_u64(), Some(0));
    Batch {
        topic: topic.to_vec(),
        seq,
        raw: payload,
        events: p[1].as_array().unwrap().clone(),
    }
}

pub fn get<'a>(e: &'a Value, key: &str) -> &'a Value {
    e.as_map()
        .unwrap()
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no {key} in {e}"))
}

pub fn kind(e: &Value) -> &str {
    get(e, "type").as_str().unwrap()
}

pub fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// A simulator with `cfg` and a [`Sub`] whose subscription has taken effect.
pub async fn start_subscribed(cfg: SimConfig) -> (SimHandle, Sub) {
    let sim = start(cfg).await;
    let sub = Sub::ready(&sim).await;
    (sim, sub)
}

pub struct Sub {
    sock: SubSocket,
    /// Batches with a seq up to this one were warm-up traffic.
    pub skip_to: Option<u64>,
}

impl Sub {
    /// Subscribes to everything and waits until the subscription has reached the publisher
    /// (ZeroMQ drops what a PUB sends before that): resets of the idle cache publish
    /// `AllBlocksCleared` until one arrives.
    pub async fn ready(sim: &SimHandle) -> Self {
        let mut sock = SubSocket::new();
        sock.connect(&sim.kv_events_endpoint().unwrap())
            .await
            .unwrap();
        sock.subscribe("").await.unwrap();
        let mut sub = Sub {
            sock,
            skip_to: None,
        };
        for _ in 0..100 {
            assert!(sim.reset_prefix_cache(false).await);
            if sub.next_within(Duration::from_millis(100)).await.is_some() {
                sub.skip_to = sim.kv_stats().unwrap().last_seq;
                return sub;
            }
        }
        panic!("the subscription never took effect");
    }

    pub async fn next_within(&mut self, d: Duration) -> Option<Batch> {
        loop {
            let m = tokio::time::timeout(d, self.sock.recv())
                .await
                .ok()?
                .unwrap();
            let f = m.into_vec();
            assert_eq!(f.len(), 3, "[topic, seq, payload]");
            let b = decode(&f[0], &f[1], f[2].clone());
            if self.skip_to.is_some_and(|s| b.seq <= s) {
                continue;
            }
            return Some(b);
        }
    }

    pub async fn next(&mut self) -> Batch {
        self.next_within(Duration::from_secs(10))
            .await
            .expect("a batch within 10 s")
    }
}

/// `n` distinct prompt token ids, different for each `salt`.
pub fn ids(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (salt * 1000 + i) % 30_000 + 2)
        .collect()
}

pub async fn complete(sim: &SimHandle, body: Json) -> Json {
    let r = post(&format!("{}/v1/completions", sim.url()), &body).await;
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

pub async fn prompt(sim: &SimHandle, tokens: &[u32]) {
    complete(sim, json!({"prompt": tokens, "max_tokens": 1})).await;
}

/// The BlockStored events of the next batch that has any.
pub async fn next_stored(sub: &mut Sub) -> (Batch, Vec<Value>) {
    for _ in 0..50 {
        let b = sub.next().await;
        let stored: Vec<Value> = b
            .events
            .iter()
            .filter(|e| kind(e) == "BlockStored")
            .cloned()
            .collect();
        if !stored.is_empty() {
            return (b, stored);
        }
    }
    panic!("no BlockStored");
}

/// Replays from `start` over a DEALER: the (seq, payload) pairs until the end marker.
pub async fn replay(endpoint: &str, start: u64) -> Vec<(u64, Bytes)> {
    let mut d = DealerSocket::new();
    d.connect(endpoint).await.unwrap();
    let req = vec![Bytes::new(), Bytes::copy_from_slice(&start.to_be_bytes())];
    d.send(ZmqMessage::try_from(req).unwrap()).await.unwrap();
    let mut out = Vec::new();
    for _ in 0..10_000 {
        let m = tokio::time::timeout(Duration::from_secs(10), d.recv())
            .await
            .expect("replay answers")
            .unwrap();
        let f = m.into_vec();
        assert_eq!(f.len(), 4, "[b\"\", topic, seq, payload]");
        assert!(f[0].is_empty());
        let seq = i64::from_be_bytes(f[2][..].try_into().unwrap());
        if seq == -1 {
            assert!(f[3].is_empty() && f[1].is_empty(), "end marker");
            return out;
        }
        assert_eq!(&f[1][..], b"kv@sim");
        out.push((seq as u64, f[3].clone()));
    }
    panic!("no end marker");
}

/// Polls `pred` every 10 ms for at most 10 s.
pub async fn eventually(what: &str, pred: impl Fn() -> bool) {
    for _ in 0..1000 {
        if pred() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never: {what}");
}

/// Sends distinct prompts until a batch arrives (a subscriber reconnects after a restart).
pub async fn first_after_restart(sim: &SimHandle, sub: &mut Sub) -> Batch {
    for salt in 100..200 {
        prompt(sim, &ids(BS, salt)).await;
        if let Some(b) = sub.next_within(Duration::from_millis(200)).await {
            return b;
        }
    }
    panic!("nothing after the restart");
}
