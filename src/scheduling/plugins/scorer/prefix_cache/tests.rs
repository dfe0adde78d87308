//! Exact-value tests of the prefix scorer: matching, recording, capacity and purging.
#![allow(clippy::unwrap_used)]

use super::*;
use crate::endpoints::engine::LoadMetrics;
use crate::endpoints::test_support::{backends, candidates};
use crate::kv_events::test_support::{go_live, removed, stored};
use crate::prompt::Operation;

fn scorer(params: &str) -> PrefixCacheScorer {
    PrefixCacheScorer::from_parameters("prefix", &toml::from_str(params).unwrap()).unwrap()
}

/// `n` backends (ids 0..n) and a scorer with `params`.
fn setup(n: usize, params: &str) -> (Vec<Arc<Backend>>, PrefixCacheScorer) {
    (backends(n), scorer(params))
}

fn view(prompt: &str) -> RequestView {
    let body = serde_json::json!({"model": "m", "prompt": prompt}).to_string();
    RequestView::parse(Operation::Completions, body.as_bytes()).unwrap()
}

fn score(s: &PrefixCacheScorer, v: &RequestView, c: &[Candidate<'_>]) -> (Vec<f64>, CycleState) {
    let mut state = CycleState::default();
    let mut out = vec![0.0; c.len()];
    s.score(v, &mut state, c, &mut out);
    (out, state)
}

/// Scores `v` on `c`, then picks `backend`: the prompt is recorded there.
fn record(s: &PrefixCacheScorer, v: &RequestView, c: &[Candidate<'_>], backend: &Backend) {
    let (_, state) = score(s, v, c);
    s.after_pick(v, &state, backend);
}

#[test]
fn ratio_of_leading_blocks() {
    let (b, s) = setup(3, "block_size = 4\nroom_weight = 0.0");
    let c = candidates(&b);
    let first = view("aaaabbbbccccdddd");
    let (scores, state) = score(&s, &first, &c);
    assert_eq!(scores, vec![0.0, 0.0, 0.0], "empty index matches nothing");
    s.after_pick(&first, &state, &b[1]);
    let (scores, _) = score(&s, &first, &c);
    assert_eq!(scores, vec![0.0, 1.0, 0.0]);
    let second = view("aaaabbbbzzzzzzzz");
    let (scores, _) = score(&s, &second, &c);
    assert_eq!(scores, vec![0.0, 0.5, 0.0]);
}

#[test]
fn short_prompts_score_zero() {
    let (b, s) = setup(2, "block_size = 64");
    let c = candidates(&b);
    let (scores, state) = score(&s, &view("short"), &c);
    assert_eq!(scores, vec![0.0, 0.0]);
    s.after_pick(&view("short"), &state, &b[0]);
    assert_eq!(s.index().blocks(), 0);
}

#[test]
fn length_weight_prefers_long_partial_match() {
    let (b, s) = setup(
        2,
        "block_size = 4\nlength_weight = 0.5\nlong_match_chars = 16\nroom_weight = 0",
    );
    let c = candidates(&b);
    let long = view("aaaabbbbccccdddd");
    record(&s, &long, &c, &b[0]);
    // 2 of 4 blocks on backend 0: ratio 0.5, length 8/16 = 0.5 → 0.5.
    let (scores, _) = score(&s, &view("aaaabbbbxxxxyyyy"), &c);
    assert_eq!(scores, vec![0.5, 0.0]);
    // Full 4/4 match: ratio 1, length 1 → 1.
    let (scores, _) = score(&s, &long, &c);
    assert_eq!(scores, vec![1.0, 0.0]);
}

/// With block size 4 and capacity 8: records 4 blocks on backend 0 (`aaaabbbbccccdddd`), 2 on
/// backend 1 (`eeeeffff`), none on backend 2.
fn fill_4_2_0(s: &PrefixCacheScorer, b: &[Arc<Backend>], c: &[Candidate<'_>]) {
    for (prompt, backend) in [("aaaabbbbccccdddd", &b[0]), ("eeeeffff", &b[1])] {
        let v = view(prompt);
        record(s, &v, c, backend);
    }
}

#[test]
fn prefixes_nobody_holds_go_where_the_index_is_emptiest() {
    let (b, s) = setup(3, "block_size = 4\ncapacity = 8\nroom_work_weight = 0");
    let c = candidates(&b);
    fill_4_2_0(&s, &b, &c);
    let a = view("aaaabbbbccccdddd");
    // Fill 4/8, 2/8, 0/8 → room (min–max) 0, 0.5, 1; nobody matches, so room decides.
    let (scores, _) = score(&s, &view("xxxxyyyy"), &c);
    assert_eq!(scores, vec![0.0, 0.5, 1.0]);
    // Half of the prompt held by backend 0: the room term shrinks to (1 − 0.5).
    let (scores, _) = score(&s, &view("aaaabbbbzzzzzzzz"), &c);
    assert_eq!(scores, vec![0.5, 0.25, 0.5]);
    // A full match leaves no room term: the holder wins outright.
    let (scores, _) = score(&s, &a, &c);
    assert_eq!(scores, vec![1.0, 0.0, 0.0]);
}

#[test]
fn room_by_traffic_weighs_in_as_the_caches_are_free() {
    let b = backends(3);
    let s = scorer(
        "block_size = 4\ncapacity = 8\nroom_work_weight = 1.0\nroom_placed_weight = 0\nroom_work_slack = 0.5",
    );
    let none = candidates(&b);
    // Fill 4/8, 2/8, 0/8 (room by fill 0, 0.5, 1)…
    fill_4_2_0(&s, &b, &none);
    // …and recent traffic 0, 2,000, 8,000 tokens, as of now: the mean is 3,333, so only the
    // third is over the slack (5,000) and traffic moves the new prefix off it alone (room by
    // traffic 1, 1, 0; ranking all three by traffic would give 1, 0.75, 0), once that traffic
    // is a hot prefix's.
    let now = now_ms();
    b[0].work().note_sent(0, now);
    b[1].work().note_sent(2_000, now);
    b[2].work().note_sent(8_000, now);
    let with_kv = |kv: f64| -> Vec<Candidate<'_>> {
        b.iter()
            .map(|b| {
                let m = LoadMetrics {
                    kv_usage: Some(kv),
                    ..Default::default()
                };
                Candidate::with_metrics(b, Some(m), 0)
            })
            .collect()
    };
    let close = |got: &[f64], want: &[f64]| {
        assert!(
            got.iter().zip(want).all(|(g, w)| (g - w).abs() < 1e-3),
            "{got:?} != {want:?}"
        );
    };
    // An excess that no hot prefix brought is left to fill, even with idle caches…
    let (scores, _) = score(&s, &view("xxxxyyyy"), &with_kv(0.0));
    close(&scores, &[0.0, 0.5, 1.0]);
    // …and once the third backend's traffic came from a hot prefix, traffic places it.
    b[2].work().note_hot(8_000.0, now);
    // Idle caches: traffic alone places the new prefix (t = 1).
    let (scores, _) = score(&s, &view("xxxxyyyy"), &with_kv(0.0));
    close(&scores, &[1.0, 1.0, 0.0]);
    // Half busy: half and half (t = 0.5).
    let (scores, _) = score(&s, &view("xxxxyyyy"), &with_kv(0.5));
    close(&scores, &[0.5, 0.75, 0.5]);
    // Full: fill alone, as without the parameter.
    let (scores, _) = score(&s, &view("xxxxyyyy"), &with_kv(1.0));
    close(&scores, &[0.0, 0.5, 1.0]);
    // Unknown usage counts as half busy.
    let (scores, _) = score(&s, &view("xxxxyyyy"), &none);
    close(&scores, &[0.5, 0.75, 0.5]);
}

#[test]
fn recording_keeps_the_head_of_a_prompt_longest() {
    let b = backends(1);
    let c = candidates(&b);
    // Room for 3 of the 4 blocks: the tail block goes first, the head still matches.
    let s = scorer("block_size = 4\ncapacity = 3\nroom_weight = 0");
    let v = view("aaaabbbbccccdddd");
    record(&s, &v, &c, &b[0]);
    let (scores, _) = score(&s, &v, &c);
    assert_eq!(scores, vec![0.75]);
}

#[test]
fn model_separates_prefixes() {
    let (b, s) = setup(1, "block_size = 4\nroom_weight = 0");
    let c = candidates(&b);
    let v = view("aaaabbbb");
    record(&s, &v, &c, &b[0]);
    let other = RequestView::parse(
        Operation::Completions,
        br#"{"model":"other","prompt":"aaaabbbb"}"#,
    )
    .unwrap();
    let (scores, _) = score(&s, &other, &c);
    assert_eq!(scores, vec![0.0]);
}

/// `state` with fresh metrics that report only a cache of `num_gpu_blocks` blocks of
/// `block_size` tokens.
fn with_geometry(state: &BackendState, block_size: u64, num_gpu_blocks: u64) -> BackendState {
    let mut state = state.clone();
    state.metrics = Some((
        LoadMetrics {
            block_size: Some(block_size),
            num_gpu_blocks: Some(num_gpu_blocks),
            ..Default::default()
        },
        std::time::Instant::now(),
    ));
    state
}

#[test]
fn auto_capacity_from_cache_geometry() {
    let b = backends(1);
    let s = scorer("block_size = 64\nchars_per_token = 4.0");
    assert_eq!(
        s.capacity(&b[0], &b[0].state()),
        31_250,
        "fallback while geometry is unknown"
    );
    b[0].publish(with_geometry(&b[0].state(), 16, 1000));
    // 16 000 tokens × 4 chars ÷ 64 = 1000 blocks.
    assert_eq!(s.capacity(&b[0], &b[0].state()), 1000);
    let fixed = scorer("capacity = 7");
    assert_eq!(fixed.capacity(&b[0], &b[0].state()), 7);
}

/// One scrape without the cache-config series must not resize (let alone wipe) the records:
/// the capacity in use stays until a scrape reports a new geometry.
#[test]
fn a_scrape_without_geometry_keeps_the_capacity_in_use() {
    let b = backends(1);
    let s = scorer("block_size = 4\nchars_per_token = 1.0");
    let with_geometry = |blocks: Option<u64>| {
        let mut state = (*b[0].state()).clone();
        state.metrics = Some((
            LoadMetrics {
                block_size: blocks.map(|_| 4),
                num_gpu_blocks: blocks,
                ..Default::default()
            },
            std::time::Instant::now(),
        ));
        b[0].publish(state);
    };
    with_geometry(Some(10));
    let v = view("aaaabbbbcccc");
    let (_, state) = score(&s, &v, &[Candidate::with_metrics(&b[0], None, 0)]);
    s.after_pick(&v, &state, &b[0]);
    let epoch = b[0].state().epoch;
    assert_eq!(s.index().capacity(0, epoch), Some(10));
    with_geometry(None);
    assert_eq!(s.capacity(&b[0], &b[0].state()), 10);
    s.after_pick(&v, &state, &b[0]);
    assert_eq!(s.index().blocks(), 3, "records kept");
    with_geometry(Some(2));
    s.after_pick(&view("ddddeeee"), &CycleState::default(), &b[0]);
    assert_eq!(s.index().capacity(0, epoch), Some(2));
    assert_eq!(s.index().blocks(), 2);
}

/// The block hashes are computed once per request: a second scoring (a retry, a wake-up)
/// reuses them from the request's state.
#[test]
fn hashes_are_computed_once_per_request() {
    let b = backends(1);
    let s = scorer("block_size = 4");
    let v = view("aaaabbbb");
    let c = [Candidate::with_metrics(&b[0], None, 0)];
    let mut state = CycleState::default();
    let mut scores = vec![0.0; 1];
    s.score(&v, &mut state, &c, &mut scores);
    // Replace the stored hashes with a marker: a re-scoring that recomputed would not see it.
    let mut scratch = state.take::<Scratch>(&s.name).unwrap();
    assert_eq!(scratch.hashes.len(), 2);
    scratch.hashes = vec![7, 8, 9];
    state.put(&s.name, scratch);
    s.score(&v, &mut state, &c, &mut scores);
    assert_eq!(state.get::<Scratch>(&s.name).unwrap().hashes, vec![7, 8, 9]);
}

#[test]
fn bad_parameters_are_rejected_with_their_name() {
    for bad in [
        "block_size = 0",
        "length_weight = 2.0",
        "room_weight = 1.5",
        "memory_weight = -0.1",
        "room_work_weight = 1.1",
        "room_placed_weight = -1.0",
        "room_placed_weight = nan",
        "room_work_slack = -0.5",
        "replicate_share = 1.5",
        "replicate_min_prompts = -2.0",
        "replicate_overload = inf",
        "capacity = 0",
        "capacity = \"lots\"",
        "blocksize = 3",
    ] {
        let table: toml::Table = toml::from_str(bad).unwrap();
        let err = PrefixCacheScorer::from_parameters("prefix", &table)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("plugins.prefix.parameters"), "{bad}: {err}");
    }
}

fn token_view(ids: &[u32]) -> RequestView {
    let body = serde_json::json!({"model": "m", "prompt": ids}).to_string();
    RequestView::parse(Operation::Completions, body.as_bytes()).unwrap()
}

/// Backend `b` reports (via its event stream) holding the first `blocks` blocks of `ids`.
fn report(b: &Backend, ids: &[u32], bs: usize, blocks: usize, seq: u64) {
    go_live(b.kv(), 60_000);
    let n = blocks.min(ids.len() / bs);
    let hashes: Vec<u64> = (0..n as u64).map(|i| 1000 + i).collect();
    b.kv().apply(
        seq,
        &[stored(
            &hashes,
            None,
            ids[..n * bs].iter().copied(),
            bs as u32,
        )],
        crate::clock::now_ms(),
    );
}

#[test]
fn live_streams_score_by_the_blocks_they_hold_and_the_rest_by_the_index() {
    let (b, s) = setup(3, "block_size = 4\nroom_weight = 0.0");
    let c = candidates(&b);
    let ids: Vec<u32> = (0..64).collect();
    let v = token_view(&ids);
    // Backend 2 has no stream: the approximate index, which saw it get this prompt.
    record(&s, &v, &c, &b[2]);
    // Backend 0 reports 2 of the 4 blocks of 16 tokens, backend 1 all 4.
    report(&b[0], &ids, 16, 2, 0);
    report(&b[1], &ids, 16, 4, 0);
    let (scores, _) = score(&s, &v, &c);
    assert_eq!(scores, vec![0.5, 1.0, 1.0]);
    // Backend 1 evicts its first block: nothing consecutive from the start is left.
    b[1].kv().apply(1, &[removed(&[1000])], 0);
    let (scores, _) = score(&s, &v, &c);
    assert_eq!(scores, vec![0.5, 0.0, 1.0]);
    // A silent stream falls back to the index (which never saw backend 0 get it). Blocks sent
    // at 0 ms and unconfirmed for over 1 ms make it silent, so the process clock (which starts
    // at this process's first reading, maybe in this very test) must be past 1 ms: without
    // this the test failed whenever it ran first in its process.
    while crate::clock::now_ms() < 2 {
        std::hint::spin_loop();
    }
    go_live(b[0].kv(), 1);
    b[0].kv().note_sent(&[42], 0, 0, 1);
    let (scores, _) = score(&s, &v, &c);
    assert_eq!(scores[0], 0.0, "silent: approximate");
    // The precise source can be turned off.
    let off = scorer("block_size = 4\nroom_weight = 0.0\nprecise = false");
    let (scores, _) = score(&off, &v, &c);
    assert_eq!(scores, vec![0.0, 0.0, 0.0]);
}

#[test]
fn a_pick_counts_its_blocks_in_flight_on_that_backend() {
    let (b, s) = setup(
        2,
        "block_size = 4\nroom_weight = 0.0\ninflight_ms = 60000\nmemory_weight = 0.0",
    );
    let c = candidates(&b);
    let ids: Vec<u32> = (0..32).collect();
    // Both live, block size known, nothing of this prompt held.
    report(&b[0], &[7; 16], 16, 1, 0);
    report(&b[1], &[8; 16], 16, 1, 0);
    let v = token_view(&ids);
    let (scores, state) = score(&s, &v, &c);
    assert_eq!(scores, vec![0.0, 0.0]);
    s.after_pick(&v, &state, &b[1]);
    // The next request with the same prefix (before any event) goes to the same backend.
    let mut longer = ids.clone();
    longer.extend(100..116);
    let (scores, _) = score(&s, &token_view(&longer), &c);
    assert_eq!(scores[0], 0.0);
    assert!((scores[1] - 2.0 / 3.0).abs() < 1e-9, "{scores:?}");
}

#[test]
fn a_prefix_nobody_holds_goes_where_the_router_last_sent_it() {
    let b = backends(2);
    let c = candidates(&b);
    let ids: Vec<u32> = (0..64).collect();
    let v = token_view(&ids);
    // Both live with other blocks; nothing of this prompt is held (say, evicted everywhere).
    report(&b[0], &[7; 16], 16, 1, 0);
    report(&b[1], &[8; 16], 16, 1, 0);
    let s = scorer("block_size = 4\nroom_weight = 0.0\ninflight_ms = 1");
    let off = scorer("block_size = 4\nroom_weight = 0.0\ninflight_ms = 1\nmemory_weight = 0.0");
    for s in [&s, &off] {
        record(s, &v, &c, &b[1]);
    }
    // The in-flight blocks of that pick expire at once (1 ms).
    b[1].kv().purge_pending(crate::clock::now_ms() + 10);
    let (scores, _) = score(&s, &v, &c);
    assert_eq!(scores, vec![0.0, 1.0], "memory: the backend it was sent to");
    let (scores, _) = score(&off, &v, &c);
    assert_eq!(scores, vec![0.0, 0.0], "memory off: the truth alone");
    // The truth wins over memory: backend 0 now reports holding all of it.
    report(&b[0], &ids, 16, 4, 1);
    let (scores, _) = score(&s, &v, &c);
    assert_eq!(scores, vec![1.0, 0.0]);
}

/// Sends `v` to `backend` as the scheduling layer does: scored, recorded, and its prompt
/// tokens counted in the backend's recent work.
fn send(s: &PrefixCacheScorer, v: &RequestView, c: &[Candidate<'_>], backend: &Backend) {
    record(s, v, c, backend);
    backend
        .work()
        .note_sent(s.prompt_tokens(v).ceil() as u64, now_ms());
}

/// Small blocks, no room term, replication and the load bound on.
const REPLICATING: &str = "block_size = 4\ncapacity = 1000\nroom_weight = 0\nreplicate_share = 0.5";

/// What each candidate holds of `v`, asked in a decision of its own.
fn held_fresh(s: &PrefixCacheScorer, v: &RequestView, c: &[Candidate<'_>]) -> Vec<Held> {
    let mut state = CycleState::default();
    s.held(v, &mut state, c).into_owned()
}

#[test]
fn a_hot_prefix_on_an_overloaded_holder_gets_a_second_holder() {
    let (b, s) = setup(2, REPLICATING);
    let c = candidates(&b);
    let hot = view("hhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhqqqq");
    let cold = view("cccccccccccccccccccccccccccccccczzzz");
    // Three hot prompts on backend 0: not yet enough of them (4 prompts' worth) to replicate.
    for _ in 0..3 {
        send(&s, &hot, &c, &b[0]);
    }
    let held = |v: &RequestView| held_fresh(&s, v, &c);
    assert_ne!(held(&hot)[1].granted, Some(Grant::Replica));
    // Five: backend 0 took all the traffic, the prefix alone is more than half a fair share.
    // (Four would be exactly the threshold, which the traffic's decay puts just below it
    // whenever its 16 ms clock ticks between the first send and the check.)
    send(&s, &hot, &c, &b[0]);
    send(&s, &hot, &c, &b[0]);
    let h = held(&hot);
    assert_eq!(h[1].granted, Some(Grant::Replica), "{h:?}");
    assert_eq!((h[1].blocks, h[1].tokens), (h[0].blocks, h[0].tokens));
    assert_eq!(h[1].cached_tokens(), 0.0);
    let (scores, _) = score(&s, &hot, &c);
    assert_eq!(scores[0], scores[1]);
    // Backend 1 takes cold traffic until it carries more than backend 0: no replica then.
    for _ in 0..6 {
        send(&s, &cold, &c, &b[1]);
    }
    assert_ne!(held(&hot)[1].granted, Some(Grant::Replica));
}

/// Each of `backends` as a candidate with its published state.
fn as_published(backends: &[Arc<Backend>]) -> Vec<Candidate<'_>> {
    backends
        .iter()
        .map(|x| {
            let mut c = Candidate::with_metrics(x, None, 0);
            c.state = x.state();
            c
        })
        .collect()
}

/// `backend`'s state as if this router sent half of the requests it finished (one of two
/// replicas behind a round-robin front).
fn half_the_traffic(backend: &Backend) {
    use crate::endpoints::chars_per_token::{CharsPerToken, Reading};
    let at = |own: u64, finished: f64| Reading {
        chars: 0,
        own,
        tokens: Some(0.0),
        finished: Some(finished),
    };
    let mut state = backend.state().as_ref().clone();
    state.chars_per_token = CharsPerToken::default()
        .observe(at(0, 0.0), false)
        .observe(at(20, 40.0), false);
    assert_eq!(state.chars_per_token.share(), Some(0.5));
    backend.publish(state);
}

/// A router that sees half of each backend's traffic sees half of a hot prefix's: its
/// threshold is two of its prompts, so three replicate the prefix, where a router alone needs
/// more than three (the test above). (Two would be exactly the threshold: see above.)
#[test]
fn a_router_with_half_the_traffic_replicates_at_half_the_prompts() {
    let (b, s) = setup(2, REPLICATING);
    for backend in &b {
        half_the_traffic(backend);
    }
    let c = as_published(&b);
    let hot = view("hhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhqqqq");
    send(&s, &hot, &c, &b[0]);
    let held = |v: &RequestView| held_fresh(&s, v, &c);
    assert_ne!(held(&hot)[1].granted, Some(Grant::Replica));
    send(&s, &hot, &c, &b[0]);
    send(&s, &hot, &c, &b[0]);
    let h = held(&hot);
    assert_eq!(h[1].granted, Some(Grant::Replica), "{h:?}");
}

/// The hot gate counts the same: with half the traffic, a prefix that brought three prompts'
/// worth lately (over its two) is hot, and its next request counts in its backend's hot work;
/// for a router alone (four) it is not yet.
#[test]
fn a_router_with_half_the_traffic_counts_a_prefix_hot_at_half_the_prompts() {
    for (share_known, hot_after_three) in [(false, false), (true, true)] {
        let (b, s) = setup(
            2,
            "block_size = 4
capacity = 1000",
        );
        if share_known {
            for backend in &b {
                half_the_traffic(backend);
            }
        }
        let c = as_published(&b);
        let hot = view("hhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhqqqq");
        for _ in 0..4 {
            send(&s, &hot, &c, &b[0]);
        }
        // The fourth request found three prompts' worth of traffic before it. (The third
        // found two, exactly a half-share router's threshold: see the test above.)
        let is_hot = b[0].work().recent_hot(now_ms()) > 0.0;
        assert_eq!(is_hot, hot_after_three, "share known: {share_known}");
    }
}

#[test]
fn replication_is_off_with_a_zero_share_and_for_cold_prefixes() {
    let (b, s) = setup(2, "block_size = 4\ncapacity = 1000\nreplicate_share = 0");
    let c = candidates(&b);
    let hot = view("hhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhhqqqq");
    for _ in 0..8 {
        send(&s, &hot, &c, &b[0]);
    }
    let mut state = CycleState::default();
    assert_ne!(
        s.held(&hot, &mut state, &c)[1].granted,
        Some(Grant::Replica)
    );
    // With replication on, a prefix bringing a small part of the holder's traffic stays put.
    let (b, s) = setup(2, "block_size = 4\ncapacity = 1000\nreplicate_share = 0.5");
    let c = candidates(&b);
    let one = view("11111111111111111111111111111111qqqq");
    for i in 0..40 {
        let other = view(&format!("{i:0>32}qqqq"));
        send(&s, &other, &c, &b[0]);
    }
    for _ in 0..4 {
        send(&s, &one, &c, &b[0]);
    }
    let mut state = CycleState::default();
    assert_ne!(
        s.held(&one, &mut state, &c)[1].granted,
        Some(Grant::Replica)
    );
}

#[test]
fn a_copy_within_the_bound_takes_requests_from_holders_over_it() {
    let (b, s) = setup(2, REPLICATING);
    let c = candidates(&b);
    // One system prompt, two questions: the first held whole on backend 0, the second on 1.
    let first = view("ssssssssssssssssssssssssssssssssaaaaaaaa");
    let second = view("ssssssssssssssssssssssssssssssssbbbbbbbb");
    // Each prompt is 10 estimated tokens: 30 sent to each backend, both within the bound.
    for _ in 0..3 {
        send(&s, &first, &c, &b[0]);
        send(&s, &second, &c, &b[1]);
    }
    let held = |v: &RequestView| held_fresh(&s, v, &c);
    let h = held(&first);
    assert_eq!(h[1].granted, None, "{h:?}");
    // Backend 0 at 60 against 30: over the bound, 1.1 × 45. Backend 1, which holds the system
    // prompt, is offered as the prompt's holder and wins the tie…
    for _ in 0..3 {
        send(&s, &first, &c, &b[0]);
    }
    let h = held(&first);
    assert_eq!(h[1].granted, Some(Grant::Overflow), "{h:?}");
    assert_eq!((h[1].blocks, h[1].tokens), (h[0].blocks, h[0].tokens));
    assert_eq!(
        h[1].cached_tokens(),
        8.0,
        "it holds the system prompt's 8 blocks of 4 characters, 8 tokens: {h:?}"
    );
    let (scores, _) = score(&s, &first, &c);
    assert!(scores[1] > scores[0], "{scores:?}");
    // …until it carries as much: both within the bound, the whole prompt's holder again.
    for _ in 0..4 {
        send(&s, &second, &c, &b[1]);
    }
    let h = held(&first);
    assert_ne!(h[1].granted, Some(Grant::Overflow), "{h:?}");
}

/// A prompt the router sent to a live backend, whose events then report the head evicted,
/// comes back: from the fourth return on (fewer are no rate yet), four of five equal prompts,
/// four fifths of the recent tokens, are thrash.
#[test]
fn a_prefix_a_live_backend_reports_evicted_counts_as_thrash_when_it_comes_back() {
    let (b, s) = setup(2, "block_size = 4\nroom_weight = 0.0");
    let c = candidates(&b);
    let ids: Vec<u32> = (0..64).collect();
    let v = token_view(&ids);
    report(&b[0], &ids, 16, 4, 0);
    record(&s, &v, &c, &b[0]);
    assert_eq!(s.thrash(crate::clock::now_ms()), 0.0, "held: no thrash");
    b[0].kv()
        .apply(1, &[removed(&[1000])], crate::clock::now_ms());
    // Each time, the blocks just sent stop counting as in flight before the prompt returns.
    let returns = || {
        b[0].kv().purge_pending(crate::clock::now_ms() + 1_000_000);
        record(&s, &v, &c, &b[0]);
    };
    for _ in 0..3 {
        returns();
    }
    assert_eq!(s.thrash(crate::clock::now_ms()), 0.0, "three returns");
    returns();
    let thrash = s.thrash(crate::clock::now_ms());
    assert!((0.75..=0.85).contains(&thrash), "thrash {thrash}");
}

/// A backend's measured characters per token sizes its record (its own figure), and the
/// scorer's token estimates follow the candidates' mean figure once a match has seen one; with
/// `measure_chars_per_token = false` both keep `chars_per_token`; with `"auto"` only a backend
/// with a live KV-event stream is sized by its figure.
#[test]
fn measured_characters_per_token_size_the_record_and_scale_the_estimates() {
    use crate::endpoints::chars_per_token::{CharsPerToken, Reading};
    let measured = |chars: u64, tokens: f64| {
        let at = |chars: u64, tokens: f64| Reading {
            chars,
            own: 0,
            tokens: Some(tokens),
            finished: None,
        };
        CharsPerToken::default()
            .observe(at(0, 0.0), false)
            .observe(at(chars, tokens), false)
    };
    let b = backends(3);
    for (backend, ratio) in b
        .iter()
        .zip([Some((20_000, 10_000.0)), Some((10_000, 10_000.0)), None])
    {
        let mut state = with_geometry(&backend.state(), 16, 1000);
        if let Some((chars, tokens)) = ratio {
            state.chars_per_token = measured(chars, tokens);
        }
        backend.publish(state);
    }
    let v = view(&"x".repeat(1_200));
    let c = as_published(&b);
    let on = scorer("block_size = 64\nmeasure_chars_per_token = true");
    // 16 000 tokens × 2 (× 1, × the assumed 4) characters ÷ 64.
    let sizes: Vec<u64> = b.iter().map(|x| on.capacity(x, &x.state())).collect();
    assert_eq!(sizes, vec![500, 250, 1000]);
    assert_eq!(on.prompt_tokens(&v), 300.0, "4 per token before any match");
    let _ = score(&on, &v, &c);
    // The mean of 2 and 1 (the third has no figure yet).
    assert_eq!(on.prompt_tokens(&v), 800.0);
    let off = scorer("block_size = 64\nmeasure_chars_per_token = false");
    let _ = score(&off, &v, &c);
    let sizes: Vec<u64> = b.iter().map(|x| off.capacity(x, &x.state())).collect();
    assert_eq!(sizes, vec![1000, 1000, 1000]);
    assert_eq!(off.prompt_tokens(&v), 300.0);
    // "auto" (the default): measured only for a backend whose KV-event stream is live, and
    // the estimates stay at 4 (precise candidates count their token ids).
    let auto = scorer("block_size = 64");
    assert_eq!(auto.capacity(&b[0], &b[0].state()), 1000, "no live stream");
    go_live(b[0].kv(), 60_000);
    assert_eq!(auto.capacity(&b[0], &b[0].state()), 500, "live stream");
    assert_eq!(auto.capacity(&b[1], &b[1].state()), 1000);
    let _ = score(&auto, &v, &c);
    assert_eq!(auto.prompt_tokens(&v), 300.0);
    let auto_off = scorer("block_size = 64\nprecise = false");
    assert_eq!(
        auto_off.capacity(&b[0], &b[0].state()),
        1000,
        "precise scoring off"
    );
}

/// With every candidate scored from live KV events the placed weight is
/// `precise_room_placed_weight` (0 by default), else `room_placed_weight` (2): backend 0
/// carries 3,000 tokens of hot traffic, backend 1 1,000 and ten new prefixes just placed (the
/// average prefix brings 400). Counted at 0.5 each, backend 1's load equals backend 0's, nobody
/// is over the mean and fill ties them; counted at 2, backend 1 is over the mean but none of
/// its load is hot, so again nobody has an excess; counted at 0, backend 0 is 1,000 over the
/// mean and the new prefix goes to backend 1.
#[test]
fn precise_candidates_count_new_prefixes_at_the_precise_placed_weight() {
    let run = |params: &str, live: bool| -> Vec<f64> {
        let (b, s) = setup(2, params);
        let other: Vec<u32> = (1_000..1_016).collect();
        if live {
            for (i, x) in b.iter().enumerate() {
                report(x, &other, 16, 1, i as u64);
            }
        }
        let now = now_ms();
        b[0].work().note_sent(3_000, now);
        b[0].work().note_hot(3_000.0, now);
        b[1].work().note_sent(1_000, now);
        for _ in 0..10 {
            b[1].work().note_placed(now);
        }
        let ids: Vec<u32> = (0..64).collect();
        let (scores, _) = score(&s, &token_view(&ids), &candidates(&b));
        scores
    };
    let base =
        "block_size = 4\ncapacity = 1000\nroom_work_weight = 1.0\nprecise_room_work_weight = 1.0";
    let precise = run(base, true);
    assert!(
        precise[1] > precise[0],
        "precise, placed weight 0: {precise:?}"
    );
    let at_half = run(&format!("{base}\nprecise_room_placed_weight = 0.5"), true);
    assert_eq!(at_half[0], at_half[1], "precise, placed weight 0.5");
    let approximate = run(base, false);
    assert_eq!(
        approximate[0], approximate[1],
        "approximate: room_placed_weight 2"
    );
}
