//! The KV-event stream's faults (drop, stall, restart), by `/sim/faults`, by the `Faults`
//! handle and by flag, observed through a real SUB socket and the replay endpoint.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::kv::*;
use common::{set_faults, start};
use serde_json::{json, Value as Json};
use vllm_sim::SimConfig;

#[tokio::test]
async fn dropped_batches_leave_a_gap_that_replay_fills() {
    let (sim, mut sub) = start_subscribed(config(64)).await;
    prompt(&sim, &ids(BS, 1)).await;
    let (a, _) = next_stored(&mut sub).await;
    let r = set_faults(&sim.url(), json!({"kv_events_drop_rate": 1.0})).await;
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
    let (sim, mut sub) = start_subscribed(config(64)).await;
    prompt(&sim, &ids(BS, 1)).await;
    let (a, _) = next_stored(&mut sub).await;
    let r = set_faults(&sim.url(), json!({"kv_events_stall": true})).await;
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

#[tokio::test]
async fn stall_flags_stall_after_n_batches_for_a_while() {
    let sim = start(SimConfig {
        kv_events_stall_after: Some(2),
        kv_events_stall_ms: 2000,
        ..config(64)
    })
    .await;
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

#[tokio::test]
async fn restart_resets_the_sequence_and_wipes_the_cache() {
    let (sim, mut sub) = start_subscribed(config(64)).await;
    let p = ids(2 * BS, 1);
    for salt in 2..5 {
        prompt(&sim, &ids(BS, salt)).await;
        next_stored(&mut sub).await;
    }
    prompt(&sim, &p).await;
    let (before, s) = next_stored(&mut sub).await;
    let hashes = u64s(get(&s[0], "block_hashes"));
    assert!(before.seq >= 4);
    let r = set_faults(&sim.url(), json!({"kv_events_restart": true})).await;
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
    let (sim, mut sub) = start_subscribed(SimConfig {
        kv_events_restart_after: Some(20),
        ..config(64)
    })
    .await;
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
