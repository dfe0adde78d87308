//! KV-cache events, observed as inferlb's subscriber observes them: a ZeroMQ SUB socket on the
//! simulator's PUB endpoint, a DEALER on its replay endpoint, msgpack decoded with `rmpv`.
//! The stream's faults are in `kv_faults.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::kv::*;
use common::{client, get_json, json_of, start};
use serde_json::{json, Value as Json};
use vllm_sim::SimConfig;

#[tokio::test]
async fn block_stored_carries_each_full_block_and_its_token_ids() {
    let (sim, mut sub) = start_subscribed(config(64)).await;
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
    // `/kv_event_sources` names the bound ports and keeps the wildcard, as vLLM reports a
    // publisher that binds (an endpoint without one would tell a subscriber to bind).
    let v: Json = get_json(&format!("{}/kv_event_sources", sim.url())).await;
    let port = |ep: String| ep.rsplit_once(':').unwrap().1.to_string();
    assert_eq!(
        v["0"]["endpoint"],
        format!("tcp://*:{}", port(sim.kv_events_endpoint().unwrap()))
    );
    assert_eq!(
        v["0"]["replay_endpoint"],
        format!("tcp://*:{}", port(sim.kv_replay_endpoint().unwrap()))
    );
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
    let (sim, mut sub) = start_subscribed(SimConfig {
        lora_modules: vec![vllm_sim::LoraModule {
            name: "sql".into(),
            path: "/p/sql".into(),
            base_model_name: None,
        }],
        ..config(64)
    })
    .await;
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
    let (sim, mut sub) = start_subscribed(config(64)).await;
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
    let (sim, mut sub) = start_subscribed(config(8)).await;
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
    let (sim, mut sub) = start_subscribed(SimConfig {
        instant: false,
        time_scale: 1.0,
        ..config(64)
    })
    .await;
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
    let v: Json = json_of(client().post(&url)).await;
    assert_eq!(v, json!({"success": false}));
    let v: Json = json_of(client().post(format!("{url}?reset_running_requests=true"))).await;
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
    let (sim, mut sub) = start_subscribed(config(64)).await;
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
    let (sim, mut sub) = start_subscribed(SimConfig {
        kv_events_config: Some(kv_config(true, 2)),
        ..config(64)
    })
    .await;
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
async fn without_the_config_nothing_is_published() {
    let sim = start(SimConfig {
        instant: true,
        ..SimConfig::default()
    })
    .await;
    assert_eq!(sim.kv_events_endpoint(), None);
    let v: Json = get_json(&format!("{}/kv_event_sources", sim.url())).await;
    assert_eq!(v, json!({}));
    // The reset works without events too.
    assert!(sim.reset_prefix_cache(false).await);
}
