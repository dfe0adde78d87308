//! Unit tests of the engine's P/D holds, on tokio's paused clock: held blocks, pulls, leases.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::scheduler::Limits;

const LEASE: Duration = Duration::from_millis(1_000);

fn engine() -> EngineHandle {
    let (handle, run) = start(EngineConfig {
        limits: Limits {
            block_size: 4,
            max_num_seqs: 8,
            max_num_batched_tokens: 256,
            max_loras: 1,
        },
        num_blocks: 32,
        cost: CostModel::llama31_8b_h100(),
        time_scale: 1.0,
        max_model_len: 1024,
        lora_names: Vec::new(),
        kv: None,
        kv_lease: LEASE,
    });
    tokio::spawn(run);
    handle
}

fn prompt() -> Vec<u32> {
    (100..110).collect()
}

fn sub(external: usize, hold: Option<Hold>) -> Submission {
    Submission {
        tokens: prompt(),
        max_tokens: 1,
        hash_seed: 0,
        lora: None,
        cache_salt: None,
        arrival: None,
        external,
        hold,
    }
}

/// Runs a prefill leg to its end; the held blocks and tokens.
async fn prefill(e: &EngineHandle, key: &str) -> (Vec<BlockId>, usize) {
    let (reply, held) = oneshot::channel();
    let hold = Hold {
        key: key.into(),
        reply,
    };
    let (mut guard, mut rx) = e.submit(sub(0, Some(hold)));
    let ev = rx.recv().await.unwrap();
    assert!(ev.finish.is_some());
    guard.finished();
    held.await.unwrap()
}

#[tokio::test(start_paused = true)]
async fn the_first_pull_takes_the_blocks_and_a_second_is_refused() {
    let e = engine();
    let (blocks, tokens) = prefill(&e, "k").await;
    assert_eq!(blocks.len(), 3, "10 prompt tokens in blocks of 4");
    assert_eq!(tokens, 10);
    let s = e.shared.stats();
    assert_eq!((s.kv_held, s.used_blocks), (1, 3), "held after the finish");
    assert_eq!(
        e.pull("k".into(), Some(vec![9, 9, 9])).await,
        Err(PullRefused::WrongBlocks)
    );
    assert_eq!(e.pull("k".into(), Some(blocks.clone())).await, Ok(10));
    let s = e.shared.stats();
    assert_eq!((s.kv_held, s.used_blocks, s.kv_pulls), (0, 0, 1));
    assert_eq!(
        e.pull("k".into(), Some(blocks)).await,
        Err(PullRefused::NotHeld),
        "the first pull freed them"
    );
    assert_eq!(
        e.pull("never".into(), None).await,
        Err(PullRefused::NotHeld)
    );
}

#[tokio::test(start_paused = true)]
async fn an_unpulled_hold_ends_with_its_lease() {
    let e = engine();
    prefill(&e, "k").await;
    let t0 = Instant::now();
    tokio::time::sleep_until(t0 + LEASE - Duration::from_millis(1)).await;
    assert_eq!(
        e.shared.stats().kv_held,
        1,
        "still held just before the lease ends"
    );
    tokio::time::sleep_until(t0 + LEASE + Duration::from_millis(1)).await;
    let s = e.shared.stats();
    assert_eq!((s.kv_held, s.used_blocks, s.kv_expired), (0, 0, 1));
    assert_eq!(e.pull("k".into(), None).await, Err(PullRefused::NotHeld));
    // A dropped hold (the prefill-dies fault) is gone at once, and its lease finds nothing.
    prefill(&e, "d").await;
    e.drop_held("d".into());
    assert_eq!(e.pull("d".into(), None).await, Err(PullRefused::NotHeld));
    tokio::time::sleep(LEASE * 2).await;
    assert_eq!(e.shared.stats().kv_expired, 1, "nothing left to expire");
}

#[tokio::test(start_paused = true)]
async fn an_aborted_prefill_holds_nothing() {
    let e = engine();
    let (reply, held) = oneshot::channel();
    let hold = Hold {
        key: "a".into(),
        reply,
    };
    let (guard, rx) = e.submit(sub(0, Some(hold)));
    drop(guard);
    drop(rx);
    let announced = tokio::time::timeout(Duration::from_secs(5), held).await;
    assert!(matches!(announced, Ok(Err(_))), "no blocks announced");
    let (s, ok) = e
        .shared
        .wait_for(Duration::from_secs(5), |s| s.aborted == 1)
        .await;
    assert!(ok);
    assert_eq!((s.kv_held, s.used_blocks), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn pulled_tokens_are_not_computed_and_enter_the_prefix_cache() {
    let e = engine();
    let (_g, mut rx) = e.submit(sub(10, None));
    let ev = rx.recv().await.unwrap();
    // All but the last prompt token come from the pull; the last is computed for its logits.
    assert_eq!(ev.cached_tokens, 9);
    {
        let m = e.shared.metrics();
        assert_eq!(m.prompt_tokens_external, 9);
        assert_eq!(m.prompt_tokens_computed, 1);
        assert_eq!(m.prompt_tokens_cached, 0);
        assert_eq!((m.prefix_queries, m.prefix_hits), (10, 0));
        assert_eq!((m.external_queries, m.external_hits), (10, 9));
    }
    // The pulled full blocks (2 of 4 tokens) are now local prefix-cache hits.
    let (_g2, mut rx2) = e.submit(sub(0, None));
    assert_eq!(rx2.recv().await.unwrap().cached_tokens, 8);
    let m = e.shared.metrics();
    assert_eq!((m.prefix_queries, m.prefix_hits), (20, 8));
    assert_eq!(m.prompt_tokens_cached, 8);
    assert_eq!(m.external_hits, 9, "a plain request adds no external hits");
}
