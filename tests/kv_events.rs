//! Precise prefix routing from KV-cache events, through the real `inferlb` binary: in-test
//! ZeroMQ publishers (`common/kv_events.rs`) send vLLM 0.32-encoded messages (the encoder is
//! checked against the real capture in the unit tests) for fake backends, and the router's
//! choices, `/admin/backends` and `/metrics` must follow what each publisher reports.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::kv_events::*;
use common::{admin_at, metrics_at, FakeBackend};
use zeromq::Socket;

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
    let (a, mut pa, r) = live_one("silent").await;
    let addr = r.addr.clone();
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
    let (a, mut pa, r) = live_one("restart").await;
    let port = pa.port;
    let addr = r.addr.clone();
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
    let (a, mut pa) = published("a").await;
    let (b, mut pb) = published("b").await;
    let dir = tempdir("replicas");
    let r1 = router(&dir, "r1", &[(&a, pa.port), (&b, pb.port)]);
    let r2 = router(&dir, "r2", &[(&a, pa.port), (&b, pb.port)]);
    let (x1, x2) = (r1.addr.clone(), r2.addr.clone());
    until_healthy(&x1, 2).await;
    until_healthy(&x2, 2).await;
    // Both replicas must have heard message 0 of each publisher.
    for (p, backend) in [(&mut pa, a.url()), (&mut pb, b.url())] {
        p.announce(&x1, &backend, 90).await;
        p.seq = 0;
        p.announce(&x2, &backend, 90).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_replayed_when_possible_and_makes_the_backend_unsure_otherwise() {
    // Message 1 of `a` is lost on the live stream but still in its replay buffer.
    let lost = vec![stored(300, None, &prompt(30, 2))];
    let (replay, asked) = replay_server(vec![(1, lost)]).await;
    let Pair {
        a,
        b,
        mut pa,
        mut pb,
        r,
    } = live_pair_with("gap", [Some(replay), None], "").await;
    let addr = r.addr.clone();
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
    let (a, mut pa) = published("a").await;
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
    let sim = common::sim::start(vllm_sim::SimConfig {
        block_size: BS,
        kv_events_config: Some(common::sim::kv_events()),
        ..common::sim::config("m")
    })
    .await;
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

/// On a live pair (the default profile, `params` on its prefix scorer): a long prompt fills
/// backend X's cache, a short one sent 20 times makes Y the busier by traffic; each stored as
/// its backend reports. Returns X, Y and where a new prefix then goes.
async fn precise_new_prefix(name: &str, params: &str) -> (String, String, String) {
    let extra =
        format!("[[plugins]]\ntype = \"prefix-cache-scorer\"\n[plugins.parameters]\n{params}\n");
    let Pair {
        a,
        b: _b,
        mut pa,
        mut pb,
        r,
    } = live_pair(name, &extra).await;
    let addr = r.addr.clone();
    // Placement by traffic needs the caches' usage (0 on the fakes) to be known.
    for _ in 0..600 {
        let v = admin_at(&addr).await;
        let known = v["backends"]
            .as_array()
            .unwrap()
            .iter()
            .all(|b| b["metrics"]["kv_cache_usage"] == 0.0);
        if known {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let publisher = |url: &str| if url == a.url() { 0 } else { 1 };
    let publishers = [&mut pa, &mut pb];
    let long = prompt(3, 40);
    let x = route(&addr, &long).await;
    publishers[publisher(&x)]
        .send(&[stored(1_000, None, &long)])
        .await;
    until_kv(&addr, &x, |k| k["blocks"] == 41).await;
    let hot = prompt(4, 8);
    let y = route(&addr, &hot).await;
    assert_ne!(
        x, y,
        "the hot prefix's first request goes to the emptier cache"
    );
    publishers[publisher(&y)]
        .send(&[stored(2_000, None, &hot)])
        .await;
    until_kv(&addr, &y, |k| k["blocks"] == 9).await;
    // A hundred hot prompts: Y carries more than the mean recent traffic, from a hot prefix, X
    // far less.
    for _ in 0..99 {
        assert_eq!(
            route(&addr, &hot).await,
            y,
            "the hot prefix stays where it is held"
        );
    }
    let new = route(&addr, &prompt(5, 8)).await;
    let v = admin_at(&addr).await;
    for url in [&x, &y] {
        assert_eq!(kv(&v, url)["status"], "live", "{v}");
    }
    stop(r);
    (x, y, new)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_prefix_goes_to_the_idler_backend_by_default() {
    // Every candidate is scored precisely: by default the prefix is placed by traffic (Y's
    // excess is a hot prefix's), not by the caches' fill, which picks Y with
    // precise_room_work_weight = 0.
    let (x, _y, new) = precise_new_prefix("idler", "").await;
    assert_eq!(
        new, x,
        "traffic decides while the caches are idle and not thrashing"
    );
    let (_x, y, new) = precise_new_prefix("idler-off", "precise_room_work_weight = 0.0").await;
    assert_eq!(new, y, "fill decides with the weight at 0");
}

/// The unlabelled Prometheus sample `name` on `router`'s `/metrics` (0 when absent).
async fn sample_at(router: &str, name: &str) -> f64 {
    let m = metrics_at(router).await;
    m.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_missing_from_a_cache_that_evicted_nothing_has_not_come_back() {
    // Blocks sent count as held for 1 ms only: a prompt whose events never came is missing at
    // once.
    let Pair {
        a,
        b: _b,
        mut pa,
        mut pb,
        r,
    } = live_pair(
        "returns",
        "[[plugins]]\ntype = \"prefix-cache-scorer\"\n[plugins.parameters]\ninflight_ms = 1\n",
    )
    .await;
    let addr = r.addr.clone();
    let p = prompt(7, 4);
    let x = route(&addr, &p).await;
    let publisher = if x == a.url() { &mut pa } else { &mut pb };
    // X reports other blocks (its stream stays live), never the prompt's.
    publisher.send(&[stored(3_000, None, &prompt(8, 1))]).await;
    until_kv(&addr, &x, |k| k["blocks"] == 2 && k["status"] == "live").await;
    route(&addr, &p).await;
    assert_eq!(
        sample_at(&addr, "inferlb_prefix_returns_total").await,
        0.0,
        "X evicted nothing: the prompt's blocks are late or were named otherwise"
    );
    // Once X's events report an eviction, the same miss counts as the prefix coming back.
    publisher.send(&[removed(&[3_000])]).await;
    until_kv(&addr, &x, |k| {
        k["blocks_removed"] == 1 && k["status"] == "live"
    })
    .await;
    route(&addr, &p).await;
    assert_eq!(sample_at(&addr, "inferlb_prefix_returns_total").await, 1.0);
    stop(r);
}

/// On a live pair whose prefix index has room for far more than is sent (its ghost of
/// evictions never speaks, as when the router's record of a cache is larger than the cache):
/// `n` distinct 4-block prompts are routed once each, and the backend each went to reports it
/// stored, then evicted. Returns the pair and the prompts; every one of them is then held
/// nowhere, and each came back if routed again.
async fn sent_then_evicted(name: &str, n: u32) -> (Pair, Vec<Vec<u32>>) {
    let mut pair = live_pair(
        name,
        "[[plugins]]\ntype = \"prefix-cache-scorer\"\n[plugins.parameters]\ninflight_ms = 1\n\
         capacity = 100000\n",
    )
    .await;
    let addr = pair.r.addr.clone();
    let a = pair.a.url();
    let mut removed_on = [0u64; 2];
    let prompts: Vec<Vec<u32>> = (0..n).map(|i| prompt(20 + i, 4)).collect();
    for (i, p) in prompts.iter().enumerate() {
        let x = route(&addr, p).await;
        let (publisher, on) = if x == a {
            (&mut pair.pa, 0)
        } else {
            (&mut pair.pb, 1)
        };
        let base = 10_000 * (i as u64 + 1);
        publisher.send(&[stored(base, None, p)]).await;
        publisher
            .send(&[removed(&[base, base + 1, base + 2, base + 3])])
            .await;
        removed_on[on] += 4;
    }
    for (url, removed) in [(a, removed_on[0]), (pair.b.url(), removed_on[1])] {
        until_kv(&addr, &url, |k| {
            k["blocks"] == 1
                && k["blocks_removed"] == removed
                && k["in_flight_blocks"] == 0
                && k["status"] == "live"
        })
        .await;
    }
    (pair, prompts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_a_live_backend_reports_evicted_count_as_thrash_when_they_come_back() {
    // Six prompts, each stored then evicted by its backend as its events report, routed again:
    // each comes back whole (the router sent it all, nobody holds any of it), which only the
    // events can tell (the index still records each where it went). Half the recent prompt
    // tokens came back: the thrash the placement gate reads is 0.5. With the live-events
    // return skipped the router counts no return and no thrash.
    let (pair, prompts) = sent_then_evicted("thrash-precise", 6).await;
    let addr = pair.r.addr.clone();
    for p in &prompts {
        route(&addr, p).await;
    }
    let thrash = sample_at(&addr, "inferlb_prefix_thrash_ratio").await;
    assert!(
        (0.45..=0.55).contains(&thrash),
        "six of twelve equal prompts came back: thrash {thrash}"
    );
    assert_eq!(
        sample_at(&addr, "inferlb_prefix_returns_total").await,
        6.0,
        "each evicted prompt routed again came back"
    );
    stop(pair.r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fewer_than_four_prompts_worth_of_returns_is_not_thrash() {
    // Three of six evicted prompts come back: three prompts' worth of returns, a quarter of the
    // recent prompt tokens, under the four prompts' worth the thrash count starts from: no
    // thrash (with the minimum at 0 this reads 0.33). Two more make five: thrash.
    let (pair, prompts) = sent_then_evicted("thrash-min", 6).await;
    let addr = pair.r.addr.clone();
    for p in &prompts[..3] {
        route(&addr, p).await;
    }
    assert_eq!(sample_at(&addr, "inferlb_prefix_returns_total").await, 3.0);
    assert_eq!(
        sample_at(&addr, "inferlb_prefix_thrash_ratio").await,
        0.0,
        "three prompts' worth of returns is not thrash yet"
    );
    for p in &prompts[3..5] {
        route(&addr, p).await;
    }
    assert_eq!(sample_at(&addr, "inferlb_prefix_returns_total").await, 5.0);
    let thrash = sample_at(&addr, "inferlb_prefix_thrash_ratio").await;
    assert!(
        (0.4..=0.5).contains(&thrash),
        "five prompts' worth of returns of eleven prompts: thrash {thrash}"
    );
    stop(pair.r);
}
