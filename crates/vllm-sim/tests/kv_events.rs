//! KV-cache events, observed as inferlb's subscriber observes them: a ZeroMQ SUB socket on the
//! simulator's PUB endpoint, a DEALER on its replay endpoint, msgpack decoded with `rmpv`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use bytes::Bytes;
use common::client;
use rmpv::Value;
use serde_json::{json, Value as Json};
use vllm_sim::{KvEventsConfig, SimConfig, SimHandle};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

const BS: usize = 16;

fn kv_config(replay: bool, buffer_steps: usize) -> KvEventsConfig {
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

fn config(blocks: usize) -> SimConfig {
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
struct Batch {
    topic: Vec<u8>,
    seq: u64,
    raw: Bytes,
    events: Vec<Value>,
}

fn decode(topic: &[u8], seq: &[u8], payload: Bytes) -> Batch {
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

fn get<'a>(e: &'a Value, key: &str) -> &'a Value {
    e.as_map()
        .unwrap()
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no {key} in {e}"))
}

fn kind(e: &Value) -> &str {
    get(e, "type").as_str().unwrap()
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

struct Sub {
    sock: SubSocket,
    /// Batches with a seq up to this one were warm-up traffic.
    skip_to: Option<u64>,
}

impl Sub {
    /// Subscribes to everything and waits until the subscription has reached the publisher
    /// (ZeroMQ drops what a PUB sends before that): resets of the idle cache publish
    /// `AllBlocksCleared` until one arrives.
    async fn ready(sim: &SimHandle) -> Self {
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

    async fn next_within(&mut self, d: Duration) -> Option<Batch> {
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

    async fn next(&mut self) -> Batch {
        self.next_within(Duration::from_secs(10))
            .await
            .expect("a batch within 10 s")
    }
}

/// `n` distinct prompt token ids, different for each `salt`.
fn ids(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (salt * 1000 + i) % 30_000 + 2)
        .collect()
}

async fn complete(sim: &SimHandle, body: Json) -> Json {
    let r = client()
        .post(format!("{}/v1/completions", sim.url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

async fn prompt(sim: &SimHandle, tokens: &[u32]) {
    complete(sim, json!({"prompt": tokens, "max_tokens": 1})).await;
}

/// The BlockStored events of the next batch that has any.
async fn next_stored(sub: &mut Sub) -> (Batch, Vec<Value>) {
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
async fn replay(endpoint: &str, start: u64) -> Vec<(u64, Bytes)> {
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

#[tokio::test]
async fn block_stored_carries_each_full_block_and_its_token_ids() {
    let sim = vllm_sim::spawn(config(64)).await.unwrap();
    let mut sub = Sub::ready(&sim).await;
    // 2 full blocks and 8 tokens: only the full blocks are cached and reported.
    let p = ids(2 * BS + 8, 1);
    prompt(&sim, &p).await;
    let (b, stored) = next_stored(&mut sub).await;
    assert_eq!(b.topic, b"kv@sim");
    assert_eq!(stored.len(), 1, "one event per request and step");
    let e = &stored[0];
    let hashes = u64s(get(e, "block_hashes"));
    assert_eq!(hashes.len(), 2);
    assert!(
        get(e, "parent_block_hash").is_nil(),
        "the chain starts at the prompt"
    );
    let tokens: Vec<u32> = u64s(get(e, "token_ids"))
        .into_iter()
        .map(|t| t as u32)
        .collect();
    assert_eq!(tokens, p[..2 * BS], "the prompt's ids, as given");
    assert_eq!(get(e, "block_size").as_u64(), Some(BS as u64));
    assert_eq!(get(e, "medium").as_str(), Some("GPU"));
    assert!(get(e, "lora_id").is_nil() && get(e, "lora_name").is_nil());
    // The same prompt again hits both blocks: nothing new is stored. A longer one extends the
    // chain: its event starts after the cached blocks, parented on the last of them.
    let mut longer = p[..2 * BS].to_vec();
    longer.extend(ids(BS + 1, 2));
    prompt(&sim, &longer).await;
    let (_, stored) = next_stored(&mut sub).await;
    let e = &stored[0];
    assert_eq!(get(e, "parent_block_hash").as_u64(), Some(hashes[1]));
    assert_eq!(u64s(get(e, "block_hashes")).len(), 1);
    let t: Vec<u32> = u64s(get(e, "token_ids"))
        .into_iter()
        .map(|t| t as u32)
        .collect();
    assert_eq!(t, longer[2 * BS..3 * BS]);
    // `/kv_event_sources` names the bound endpoints.
    let v: Json = client()
        .get(format!("{}/kv_event_sources", sim.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["0"]["endpoint"], sim.kv_events_endpoint().unwrap());
    assert_eq!(v["0"]["replay_endpoint"], sim.kv_replay_endpoint().unwrap());
    assert_eq!(v["0"]["publisher"], "zmq");
    assert_eq!(v["0"]["topic"], "kv@sim");
    assert_eq!(v["0"]["enable_kv_cache_events"], true);
    assert!(sim
        .kv_events_endpoint()
        .unwrap()
        .starts_with("tcp://127.0.0.1:"));
}

#[tokio::test]
async fn adapter_blocks_name_the_adapter() {
    let sim = vllm_sim::spawn(SimConfig {
        lora_modules: vec![vllm_sim::LoraModule {
            name: "sql".into(),
            path: "/p/sql".into(),
            base_model_name: None,
        }],
        ..config(64)
    })
    .await
    .unwrap();
    let mut sub = Sub::ready(&sim).await;
    complete(
        &sim,
        json!({"model": "sql", "prompt": ids(BS, 3), "max_tokens": 1}),
    )
    .await;
    let (_, stored) = next_stored(&mut sub).await;
    let e = &stored[0];
    assert_eq!(get(e, "lora_name").as_str(), Some("sql"));
    assert_eq!(get(e, "lora_id").as_u64(), Some(1));
    assert_eq!(get(e, "extra_keys").to_string(), r#"[["sql"]]"#);
}

#[tokio::test]
async fn cache_salt_isolates_blocks_and_is_reported_on_the_first() {
    let sim = vllm_sim::spawn(config(64)).await.unwrap();
    let mut sub = Sub::ready(&sim).await;
    let p = ids(2 * BS, 4);
    complete(
        &sim,
        json!({"prompt": p, "max_tokens": 1, "cache_salt": "tenant-a"}),
    )
    .await;
    let (_, s1) = next_stored(&mut sub).await;
    assert_eq!(
        get(&s1[0], "extra_keys").to_string(),
        r#"[["tenant-a"], nil]"#
    );
    // The same tokens unsalted are a miss: stored again, under other hashes.
    prompt(&sim, &p).await;
    let (_, s2) = next_stored(&mut sub).await;
    assert_eq!(get(&s2[0], "extra_keys").to_string(), "[nil, nil]");
    assert_ne!(
        u64s(get(&s1[0], "block_hashes")),
        u64s(get(&s2[0], "block_hashes"))
    );
    assert_eq!(sim.stats().prefix_hits, 0);
}

#[tokio::test]
async fn eviction_under_cache_pressure_removes_what_was_stored() {
    // 8 blocks; each prompt fills 4. The third prompt must evict the first one's blocks.
    let sim = vllm_sim::spawn(config(8)).await.unwrap();
    let mut sub = Sub::ready(&sim).await;
    prompt(&sim, &ids(4 * BS, 1)).await;
    let (_, s1) = next_stored(&mut sub).await;
    let first: BTreeSet<u64> = u64s(get(&s1[0], "block_hashes")).into_iter().collect();
    assert_eq!(first.len(), 4);
    prompt(&sim, &ids(4 * BS, 2)).await;
    let (b2, _) = next_stored(&mut sub).await;
    assert!(
        b2.events.iter().all(|e| kind(e) != "BlockRemoved"),
        "free blocks were left"
    );
    prompt(&sim, &ids(4 * BS, 3)).await;
    let (b3, _) = next_stored(&mut sub).await;
    let removed: BTreeSet<u64> = b3
        .events
        .iter()
        .filter(|e| kind(e) == "BlockRemoved")
        .flat_map(|e| {
            assert_eq!(get(e, "medium").as_str(), Some("GPU"));
            u64s(get(e, "block_hashes"))
        })
        .collect();
    assert_eq!(removed, first, "the least recently used blocks go");
    // Removals come before the store that needed their room.
    assert_eq!(kind(b3.events.last().unwrap()), "BlockStored");
}

#[tokio::test]
async fn reset_prefix_cache_publishes_all_blocks_cleared() {
    let sim = vllm_sim::spawn(SimConfig {
        instant: false,
        time_scale: 1.0,
        ..config(64)
    })
    .await
    .unwrap();
    let mut sub = Sub::ready(&sim).await;
    let url = format!("{}/reset_prefix_cache", sim.url());
    // A request that runs for a while holds blocks: a plain reset fails, as vLLM's does.
    let long = {
        let url = sim.url();
        tokio::spawn(async move {
            // ~600 steps of 6 ms: seconds of holding blocks (the cache holds 1024 tokens).
            let _ = client()
                .post(format!("{url}/v1/completions"))
                .json(&json!({"prompt": ids(2 * BS, 9), "max_tokens": 600}))
                .send()
                .await;
        })
    };
    let (_, running) = sim
        .wait_for_stats(Duration::from_secs(10), |s| s.running == 1)
        .await;
    assert!(running);
    let v: Json = client()
        .post(&url)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v, json!({"success": false}));
    let v: Json = client()
        .post(format!("{url}?reset_running_requests=true"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v, json!({"success": true}));
    let mut cleared = false;
    for _ in 0..20 {
        let b = sub.next().await;
        if b.events.iter().any(|e| kind(e) == "AllBlocksCleared") {
            assert_eq!(b.events.len(), 1);
            cleared = true;
            break;
        }
    }
    assert!(cleared, "AllBlocksCleared published");
    long.abort();
}

#[tokio::test]
async fn replay_returns_the_buffered_batches() {
    let sim = vllm_sim::spawn(config(64)).await.unwrap();
    let mut sub = Sub::ready(&sim).await;
    let mut seen = Vec::new();
    for salt in 0..3 {
        prompt(&sim, &ids(BS, salt)).await;
        let (b, _) = next_stored(&mut sub).await;
        seen.push(b);
    }
    let ep = sim.kv_replay_endpoint().unwrap();
    let all = replay(&ep, 0).await;
    let seqs: Vec<u64> = all.iter().map(|(s, _)| *s).collect();
    assert_eq!(
        seqs,
        (0..seqs.len() as u64).collect::<Vec<_>>(),
        "every batch from 0"
    );
    for b in &seen {
        let (_, raw) = all.iter().find(|(s, _)| *s == b.seq).unwrap();
        assert_eq!(raw, &b.raw, "replayed payload = published payload");
    }
    let from = replay(&ep, seen[1].seq).await;
    assert_eq!(from.first().unwrap().0, seen[1].seq);
    assert_eq!(from.last().unwrap().0, seen[2].seq);
    assert!(
        replay(&ep, seen[2].seq + 1).await.is_empty(),
        "nothing newer: just the end"
    );
}

#[tokio::test]
async fn replay_buffer_is_bounded_by_buffer_steps() {
    let sim = vllm_sim::spawn(SimConfig {
        kv_events_config: Some(kv_config(true, 2)),
        ..config(64)
    })
    .await
    .unwrap();
    let mut sub = Sub::ready(&sim).await;
    for salt in 0..4 {
        prompt(&sim, &ids(BS, salt)).await;
        next_stored(&mut sub).await;
    }
    let last = sim.kv_stats().unwrap().last_seq.unwrap();
    let got: Vec<u64> = replay(&sim.kv_replay_endpoint().unwrap(), 0)
        .await
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(got, [last - 1, last]);
}

#[tokio::test]
async fn dropped_batches_leave_a_gap_that_replay_fills() {
    let sim = vllm_sim::spawn(config(64)).await.unwrap();
    let mut sub = Sub::ready(&sim).await;
    prompt(&sim, &ids(BS, 1)).await;
    let (a, _) = next_stored(&mut sub).await;
    let r = client()
        .post(format!("{}/sim/faults", sim.url()))
        .json(&json!({"kv_events_drop_rate": 1.0}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let lost = ids(BS, 2);
    prompt(&sim, &lost).await;
    sim.faults().set_kv_drop_rate(0.0);
    prompt(&sim, &ids(BS, 3)).await;
    let (c, _) = next_stored(&mut sub).await;
    assert_eq!(c.seq, a.seq + 2, "one batch missing: a sequence gap");
    assert_eq!(sim.kv_stats().unwrap().dropped, 1);
    let replayed = replay(&sim.kv_replay_endpoint().unwrap(), a.seq + 1).await;
    let b = decode(
        b"kv@sim",
        &replayed[0].0.to_be_bytes(),
        replayed[0].1.clone(),
    );
    assert_eq!(b.seq, a.seq + 1);
    let t: Vec<u32> = u64s(get(&b.events[0], "token_ids"))
        .into_iter()
        .map(|t| t as u32)
        .collect();
    assert_eq!(t, lost, "the dropped batch is in the replay buffer");
}

#[tokio::test]
async fn a_stalled_stream_goes_silent_then_delivers_in_order() {
    let sim = vllm_sim::spawn(config(64)).await.unwrap();
    let mut sub = Sub::ready(&sim).await;
    prompt(&sim, &ids(BS, 1)).await;
    let (a, _) = next_stored(&mut sub).await;
    let r = client()
        .post(format!("{}/sim/faults", sim.url()))
        .json(&json!({"kv_events_stall": true}))
        .send()
        .await
        .unwrap();
    let v: Json = r.json().await.unwrap();
    assert_eq!(v["kv_events_stalled"], true);
    prompt(&sim, &ids(BS, 2)).await;
    prompt(&sim, &ids(BS, 3)).await;
    assert!(
        sub.next_within(Duration::from_millis(300)).await.is_none(),
        "nothing is published during a stall"
    );
    assert_eq!(sim.kv_stats().unwrap().last_seq, Some(a.seq));
    sim.faults().resume_kv_events();
    let b = sub.next().await;
    let c = sub.next().await;
    assert_eq!(
        (b.seq, c.seq),
        (a.seq + 1, a.seq + 2),
        "held batches, in order, none lost"
    );
}

/// Polls `pred` every 10 ms for at most 10 s.
async fn eventually(what: &str, pred: impl Fn() -> bool) {
    for _ in 0..1000 {
        if pred() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never: {what}");
}

#[tokio::test]
async fn stall_flags_stall_after_n_batches_for_a_while() {
    let sim = vllm_sim::spawn(SimConfig {
        kv_events_stall_after: Some(2),
        kv_events_stall_ms: 2000,
        ..config(64)
    })
    .await
    .unwrap();
    for salt in 0..3 {
        prompt(&sim, &ids(BS, salt)).await;
    }
    eventually("stalled after 2 batches", || {
        sim.faults().snapshot().kv_events_stalled
    })
    .await;
    let s = sim.kv_stats().unwrap();
    assert_eq!((s.published, s.last_seq), (2, Some(1)), "the third waits");
    // The stall ends by itself; then the held batch goes out.
    eventually("resumed, third batch sent", || {
        !sim.faults().snapshot().kv_events_stalled && sim.kv_stats().unwrap().published == 3
    })
    .await;
    assert_eq!(sim.kv_stats().unwrap().last_seq, Some(2));
}

/// Sends distinct prompts until a batch arrives (a subscriber reconnects after a restart).
async fn first_after_restart(sim: &SimHandle, sub: &mut Sub) -> Batch {
    for salt in 100..200 {
        prompt(sim, &ids(BS, salt)).await;
        if let Some(b) = sub.next_within(Duration::from_millis(200)).await {
            return b;
        }
    }
    panic!("nothing after the restart");
}

#[tokio::test]
async fn restart_resets_the_sequence_and_wipes_the_cache() {
    let sim = vllm_sim::spawn(config(64)).await.unwrap();
    let mut sub = Sub::ready(&sim).await;
    let p = ids(2 * BS, 1);
    for salt in 2..5 {
        prompt(&sim, &ids(BS, salt)).await;
        next_stored(&mut sub).await;
    }
    prompt(&sim, &p).await;
    let (before, s) = next_stored(&mut sub).await;
    let hashes = u64s(get(&s[0], "block_hashes"));
    assert!(before.seq >= 4);
    let r = client()
        .post(format!("{}/sim/faults", sim.url()))
        .json(&json!({"kv_events_restart": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    sub.skip_to = None;
    let b = first_after_restart(&sim, &mut sub).await;
    assert!(
        b.seq < before.seq,
        "sequence went back: {} after {}",
        b.seq,
        before.seq
    );
    assert_eq!(sim.kv_stats().unwrap().restarts, 1);
    // Seq 0 of the new "process" is AllBlocksCleared, kept for replay.
    let rep = replay(&sim.kv_replay_endpoint().unwrap(), 0).await;
    let first = decode(b"kv@sim", &rep[0].0.to_be_bytes(), rep[0].1.clone());
    assert_eq!(first.seq, 0);
    assert_eq!(first.events.len(), 1);
    assert_eq!(kind(&first.events[0]), "AllBlocksCleared");
    // The cache is empty: the earlier prompt is computed and stored again, same hashes.
    let hits = sim.stats().prefix_hits;
    prompt(&sim, &p).await;
    let (_, s) = next_stored(&mut sub).await;
    assert_eq!(u64s(get(&s[0], "block_hashes")), hashes);
    assert_eq!(sim.stats().prefix_hits, hits, "no hit after the wipe");
}

#[tokio::test]
async fn restart_flag_restarts_once_after_n_batches() {
    let sim = vllm_sim::spawn(SimConfig {
        kv_events_restart_after: Some(20),
        ..config(64)
    })
    .await
    .unwrap();
    let mut sub = Sub::ready(&sim).await;
    let start = sim.kv_stats().unwrap();
    assert_eq!(start.restarts, 0);
    // Resets (one batch each) up to the 20th batch at least (published ones lag behind the
    // engine's count, so this may overshoot, never undershoot).
    let mut n = start.last_seq.unwrap() + 1;
    while n < 20 {
        assert!(sim.reset_prefix_cache(false).await);
        n += 1;
    }
    sub.skip_to = None;
    // What a subscriber sees: the sequence goes back (batches already queued to it before the
    // restart come first).
    let mut prev = None;
    let mut went_back = false;
    for salt in 100..300 {
        match sub.next_within(Duration::from_millis(200)).await {
            Some(b) if prev.is_some_and(|p| b.seq < p) => {
                went_back = true;
                break;
            }
            Some(b) => prev = Some(b.seq),
            None => prompt(&sim, &ids(BS, salt)).await,
        }
    }
    assert!(went_back, "no sequence reset seen after {prev:?}");
    assert_eq!(sim.kv_stats().unwrap().restarts, 1);
}

#[tokio::test]
async fn without_the_config_nothing_is_published() {
    let sim = vllm_sim::spawn(SimConfig {
        instant: true,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    assert_eq!(sim.kv_events_endpoint(), None);
    let v: Json = client()
        .get(format!("{}/kv_event_sources", sim.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v, json!({}));
    // The reset works without events too.
    assert!(sim.reset_prefix_cache(false).await);
}
