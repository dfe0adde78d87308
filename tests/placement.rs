//! Where a prefix nobody holds goes, through the real router: by the caches' fill (the
//! default), or by the backends' recent traffic with `room_work_weight` while their caches are
//! free, so a hot prefix's holder is not handed new prefixes on top of its hot traffic.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{config, start_router, until_backends_json, TestRouter};
use inferlb::config::PluginSpec;

/// POST a chat whose one user message is `content`; the backend that answered.
async fn send(router: &TestRouter, content: &str) -> String {
    let (status, backend, _) = common::chat(router, "m", content).await;
    assert_eq!(status, 200);
    backend.unwrap()
}

/// Text of `chars` characters that shares no leading block with other seeds' text.
fn text(seed: char, chars: usize) -> String {
    let mut s = String::with_capacity(chars);
    while s.len() < chars {
        s.push(seed);
        s.push_str(" lorem ipsum dolor sit amet ");
        s.push_str(&s.len().to_string());
    }
    s
}

/// On two idle backends (KV usage 0): one long prompt fills backend X's recorded cache, then
/// one short prompt sent 20 times makes backend Y the busier by traffic while X stays the
/// fuller by fill. Returns (X, Y, where a new prefix then goes).
async fn place_new_prefix(room_work_weight: f64) -> (String, String, String) {
    let fakes = common::fakes(&["a", "b"]).await;
    let mut cfg = config(&fakes.iter().collect::<Vec<_>>());
    // The default profile, its prefix scorer's parameter set.
    cfg.plugins.push(PluginSpec {
        kind: "prefix-cache-scorer".into(),
        name: None,
        parameters: toml::from_str(&format!("room_work_weight = {room_work_weight:?}")).unwrap(),
    });
    let router = start_router(cfg).await;
    until_backends_json(&router, |v| {
        v["backends"].as_array().is_some_and(|l| {
            l.iter()
                .all(|b| b["healthy"] == true && b["metrics"]["kv_cache_usage"] == 0.0)
        })
    })
    .await;
    // ~1,000 tokens of fill on X.
    let x = send(&router, &text('L', 4_000)).await;
    // A hot prefix: its first request goes to the emptier and idler Y, the rest follow it.
    let y = send(&router, &text('H', 400)).await;
    assert_ne!(
        x, y,
        "the hot prefix's first request goes to the empty backend"
    );
    for _ in 0..19 {
        assert_eq!(send(&router, &text('H', 400)).await, y, "affinity holds");
    }
    let view = common::admin_view(&router).await;
    let recent = |url: &str| -> f64 {
        view["backends"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["url"] == url)
            .unwrap()["sent_tokens"]["recent"]
            .as_f64()
            .unwrap()
    };
    assert!(
        recent(&y) > 1.5 * recent(&x),
        "Y is the busier by recent traffic: {view}"
    );
    let new = send(&router, &text('N', 400)).await;
    router.shutdown().await;
    (x, y, new)
}

#[tokio::test]
async fn a_new_prefix_goes_to_the_emptiest_cache_by_default() {
    let (_x, y, new) = place_new_prefix(0.0).await;
    assert_eq!(new, y, "fill decides: Y holds only the short hot prefix");
}

#[tokio::test]
async fn with_room_work_weight_a_new_prefix_goes_to_the_idler_backend() {
    let (x, _y, new) = place_new_prefix(1.0).await;
    assert_eq!(new, x, "traffic decides while the caches are idle");
}
