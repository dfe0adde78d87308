//! Session and LoRA affinity through the real router: sessions stick to a backend and move
//! (then stay) when it fails; adapter requests go where the adapter is running on simulators.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;

use common::{
    backend_of, client, config_for, profile, start_router, until_all_healthy, until_backends_json,
    FakeBackend, TestRouter,
};
use futures_util::StreamExt;
use inferlb::config::Config;

async fn send(router: &TestRouter, headers: &[(&str, &str)], body: serde_json::Value) -> String {
    let mut req = client()
        .post(router.url("/v1/chat/completions"))
        .json(&body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let backend = backend_of(&resp);
    let _ = resp.bytes().await;
    backend
}

/// Fakes a, b and c behind a router with the session scorer against an in-flight scorer that,
/// on idle backends, ties everyone (without affinity each request lands anywhere), its config
/// as `configure` leaves it; once all are healthy.
async fn session_fleet(configure: impl FnOnce(&mut Config)) -> (Vec<FakeBackend>, TestRouter) {
    common::fleet(&["a", "b", "c"], |cfg| {
        configure(cfg);
        profile(
            cfg,
            &[("session-affinity-scorer", 2.0), ("inflight-scorer", 1.0)],
        );
    })
    .await
}

/// Sends `n` requests with `headers`, the `i`-th with `body(i)`; how many each backend answered.
async fn tally(
    router: &TestRouter,
    headers: &[(&str, &str)],
    n: usize,
    body: impl Fn(usize) -> serde_json::Value,
) -> HashMap<String, usize> {
    let mut seen = HashMap::new();
    for i in 0..n {
        *seen
            .entry(send(router, headers, body(i)).await)
            .or_insert(0) += 1;
    }
    seen
}

fn chat(content: &str) -> serde_json::Value {
    serde_json::json!({"model": "m", "messages": [{"role": "user", "content": content}]})
}

#[tokio::test]
async fn a_session_sticks_to_its_backend_moves_when_it_fails_and_stays_moved() {
    let (fakes, router) = session_fleet(|cfg| cfg.poller.stale_after_ms = 1_000).await;

    // Twenty turns of one session, each a different prompt: one backend.
    let session = [("x-session-id", "chat-1")];
    let seen = tally(&router, &session, 20, |turn| chat(&format!("turn {turn}"))).await;
    assert_eq!(seen.len(), 1, "one session, one backend: {seen:?}");
    let home = seen.keys().next().unwrap().clone();

    // Without a session header the same requests spread.
    let spread = tally(&router, &[], 30, |turn| chat(&format!("turn {turn}"))).await;
    assert!(spread.len() >= 2, "no session, no stickiness: {spread:?}");

    // Many sessions use more than one backend (rendezvous placement, not one for all).
    let mut homes = HashMap::new();
    for s in 0..30 {
        let b = send(&router, &[("x-session-id", &format!("s-{s}"))], chat("hi")).await;
        *homes.entry(b).or_insert(0) += 1;
    }
    assert!(
        homes.len() >= 2,
        "sessions spread over the fleet: {homes:?}"
    );

    // The home fails its scrapes: the session moves to one other backend…
    let failing = fakes.iter().find(|f| f.url() == home).unwrap();
    failing.set_metrics(|m| m.status = 500);
    until_backends_json(&router, |v| {
        v["backends"].as_array().is_some_and(|l| {
            l.iter()
                .any(|b| b["url"] == home.as_str() && b["healthy"] == false)
        })
    })
    .await;
    let moved = tally(&router, &session, 10, |turn| chat(&format!("more {turn}"))).await;
    assert_eq!(moved.len(), 1, "{moved:?}");
    let new_home = moved.keys().next().unwrap().clone();
    assert_ne!(new_home, home);

    // …and stays there when the old home comes back.
    failing.set_metrics(|m| m.status = 200);
    until_all_healthy(&router).await;
    for turn in 0..10 {
        let b = send(&router, &session, chat(&format!("back {turn}"))).await;
        assert_eq!(b, new_home, "the session stays where it moved");
    }
    router.shutdown().await;
}

#[tokio::test]
async fn the_user_field_keys_the_session_when_configured() {
    let (_fakes, router) = session_fleet(|cfg| cfg.session_from_user = true).await;
    let seen = tally(&router, &[], 20, |turn| {
        serde_json::json!({"model": "m", "user": "alice",
            "messages": [{"role": "user", "content": format!("q {turn}")}]})
    })
    .await;
    assert_eq!(seen.len(), 1, "{seen:?}");
    router.shutdown().await;
}

/// Two simulators with adapters `a` and `b` and one LoRA slot each; sim 0 runs a long `a`
/// request and sim 1 a long `b` one (sent to them directly). Short requests for `a` and `b`
/// through the router go where their adapter runs — no swap — while without the LoRA scorer
/// they land on either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapter_requests_go_where_the_adapter_runs() {
    let sim_cfg = vllm_sim::SimConfig {
        served_model_name: vec!["base".into()],
        lora_modules: vec![
            vllm_sim::LoraModule {
                name: "a".into(),
                path: "/a".into(),
                base_model_name: None,
            },
            vllm_sim::LoraModule {
                name: "b".into(),
                path: "/b".into(),
                base_model_name: None,
            },
        ],
        max_loras: 1,
        max_num_seqs: 64,
        ..Default::default()
    };
    let sims = vllm_sim::spawn_fleet(2, sim_cfg).await.unwrap();
    // Long streams that keep each adapter running for the whole test.
    let mut holds = Vec::new();
    for (sim, adapter) in sims.iter().zip(["a", "b"]) {
        let body = serde_json::json!({"model": adapter, "stream": true, "max_tokens": 30000,
            "ignore_eos": true, "messages": [{"role": "user", "content": "hold"}]});
        let resp = client()
            .post(format!("{}/v1/chat/completions", sim.url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        let mut stream = resp.bytes_stream();
        let _ = stream.next().await.unwrap().unwrap();
        holds.push(stream);
    }
    let mut cfg = config_for(sims.iter().map(|s| s.url()));
    profile(
        &mut cfg,
        &[("lora-affinity-scorer", 2.0), ("inflight-scorer", 1.0)],
    );
    let router = start_router(cfg).await;
    until_backends_json(&router, |v| {
        v["backends"].as_array().is_some_and(|l| {
            l.iter().all(|b| {
                b["metrics"]["running_lora_adapters"]
                    .as_array()
                    .is_some_and(|a| a.len() == 1)
            })
        })
    })
    .await;
    let loads_before: Vec<u64> = sims.iter().map(|s| s.stats().lora_loads).collect();
    assert_eq!(loads_before, vec![1, 1]);
    for i in 0..12 {
        let adapter = if i % 2 == 0 { "a" } else { "b" };
        let body = serde_json::json!({"model": adapter, "max_tokens": 2,
            "messages": [{"role": "user", "content": format!("q {i}")}]});
        let backend = send(&router, &[], body).await;
        let want = if adapter == "a" {
            sims[0].url()
        } else {
            sims[1].url()
        };
        assert_eq!(backend, want, "request {i} for {adapter}");
    }
    let loads_after: Vec<u64> = sims.iter().map(|s| s.stats().lora_loads).collect();
    assert_eq!(loads_after, loads_before, "no adapter was swapped in");
    drop(holds);
    router.shutdown().await;
}
