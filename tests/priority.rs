//! Priority classes and per-tenant fairness of the capacity queue, through the real router: a
//! backend with one in-flight slot holds every stream until the test opens its gate, so the
//! order in which queued requests reach it is the order the queue handed out the slot.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::Ordering;

use common::{
    client, config, metrics_text, start_router, until_backends_json, FakeBackend, TestRouter,
};
use futures_util::StreamExt;
use inferlb::config::{Config, KeyPriority};

/// One streamed chat request; returns its status and `Retry-After`, reading the whole body.
fn spawn_request(
    router: &TestRouter,
    key: Option<&str>,
    class: Option<&str>,
    tag: &str,
) -> tokio::task::JoinHandle<(u16, Option<String>)> {
    let url = router.url("/v1/chat/completions");
    let body = serde_json::json!({"model": "m", "stream": true,
        "messages": [{"role": "user", "content": tag}]});
    let (key, class) = (key.map(str::to_owned), class.map(str::to_owned));
    tokio::spawn(async move {
        let mut req = client().post(url).json(&body);
        if let Some(key) = key {
            req = req.bearer_auth(key);
        }
        if let Some(class) = class {
            req = req.header("x-inferlb-priority", class);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let retry = resp
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_owned());
        let mut body = resp.bytes_stream();
        while body.next().await.is_some() {}
        (status, retry)
    })
}

async fn until_waiting(router: &TestRouter, n: u64) {
    until_backends_json(router, |v| v["waiting_for_slot"] == n).await;
}

/// The tag of the `n`-th completion the backend received, once it has (waits on the arrival).
async fn received(b: &FakeBackend, n: u64) -> String {
    let body = b.nth_body(usize::try_from(n).unwrap()).await;
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    v["messages"][0]["content"].as_str().unwrap().to_owned()
}

/// One backend, one slot, streams held; the first request (`first`) holds the slot.
async fn setup(
    tweak: impl FnOnce(&mut Config),
    first_key: Option<&str>,
) -> (
    FakeBackend,
    TestRouter,
    tokio::task::JoinHandle<(u16, Option<String>)>,
) {
    let b = FakeBackend::start("a", &["m"]).await;
    b.state.hold_streams.store(true, Ordering::SeqCst);
    let mut cfg = config(&[&b]);
    cfg.limits.max_inflight_per_backend = 1;
    cfg.limits.queue_timeout_ms = 60_000;
    tweak(&mut cfg);
    let router = start_router(cfg).await;
    until_backends_json(&router, |v| v["backends"][0]["healthy"] == true).await;
    let first = spawn_request(&router, first_key, None, "first");
    assert_eq!(received(&b, 1).await, "first");
    (b, router, first)
}

/// Open the gate for the stream holding the slot; the slot goes to the next waiter, whose tag
/// the backend then sees.
async fn release_next(b: &FakeBackend, n: u64) -> String {
    b.state.gate.notify_one();
    received(b, n).await
}

#[tokio::test]
async fn higher_classes_go_first_and_a_key_cannot_promote_itself() {
    let (b, router, first) = setup(
        |cfg| {
            cfg.auth.api_keys = vec!["vip".into(), "bulk".into()];
            cfg.priority.keys = vec![
                KeyPriority {
                    key: "vip".into(),
                    default_class: None,
                    max_class: Some("interactive".into()),
                },
                KeyPriority {
                    key: "bulk".into(),
                    default_class: Some("batch".into()),
                    max_class: Some("batch".into()),
                },
            ];
        },
        Some("vip"),
    )
    .await;
    // bulk asks for interactive (capped to batch), then asks for nothing (batch by default);
    // vip asks for interactive last.
    let a = spawn_request(&router, Some("bulk"), Some("interactive"), "A");
    until_waiting(&router, 1).await;
    let bb = spawn_request(&router, Some("bulk"), None, "B");
    until_waiting(&router, 2).await;
    let s = spawn_request(&router, Some("vip"), None, "S");
    until_waiting(&router, 3).await;
    let c = spawn_request(&router, Some("vip"), Some("interactive"), "C");
    until_waiting(&router, 4).await;
    let order = [
        release_next(&b, 2).await,
        release_next(&b, 3).await,
        release_next(&b, 4).await,
        release_next(&b, 5).await,
    ];
    assert_eq!(
        order,
        ["C", "S", "A", "B"],
        "interactive, standard, then batch in order"
    );
    b.state.gate.notify_one();
    for h in [first, a, bb, s, c] {
        assert_eq!(h.await.unwrap().0, 200);
    }
    router.shutdown().await;
}

#[tokio::test]
async fn a_flooding_tenant_does_not_starve_a_light_one() {
    let (b, router, first) = setup(
        |cfg| cfg.auth.api_keys = vec!["flood".into(), "light".into()],
        Some("flood"),
    )
    .await;
    let mut flood = Vec::new();
    for i in 0..4u64 {
        flood.push(spawn_request(
            &router,
            Some("flood"),
            None,
            &format!("F{i}"),
        ));
        until_waiting(&router, i + 1).await;
    }
    let light = spawn_request(&router, Some("light"), None, "L");
    until_waiting(&router, 5).await;
    let mut order = Vec::new();
    for n in 2..=6 {
        order.push(release_next(&b, n).await);
    }
    // FIFO would serve L last; round-robin across tenants serves it second.
    assert_eq!(order, ["F0", "L", "F1", "F2", "F3"]);
    b.state.gate.notify_one();
    assert_eq!(first.await.unwrap().0, 200);
    assert_eq!(light.await.unwrap().0, 200);
    for h in flood {
        assert_eq!(h.await.unwrap().0, 200);
    }
    router.shutdown().await;
}

fn series(metrics: &str, prefix: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[tokio::test]
async fn a_full_queue_sheds_the_lowest_class_first() {
    let (b, router, first) = setup(
        |cfg| {
            cfg.limits.max_queued = 2;
            cfg.priority.max_class = "interactive".into();
        },
        None,
    )
    .await;
    let a = spawn_request(&router, None, Some("batch"), "A");
    until_waiting(&router, 1).await;
    let bb = spawn_request(&router, None, Some("batch"), "B");
    until_waiting(&router, 2).await;
    // The queue is full. A standard arrival sheds the newest batch request (B)…
    let c = spawn_request(&router, None, None, "C");
    assert_eq!(bb.await.unwrap(), (429, Some("1".into())));
    until_waiting(&router, 2).await;
    // …a batch arrival finds nothing lower to shed and is refused at once…
    let d = spawn_request(&router, None, Some("batch"), "D");
    assert_eq!(d.await.unwrap(), (429, Some("1".into())));
    // …and an interactive one sheds A, the last batch request.
    let e = spawn_request(&router, None, Some("interactive"), "E");
    assert_eq!(a.await.unwrap(), (429, Some("1".into())));
    until_waiting(&router, 2).await;
    assert_eq!(release_next(&b, 2).await, "E");
    assert_eq!(release_next(&b, 3).await, "C");
    b.state.gate.notify_one();
    for h in [first, c, e] {
        assert_eq!(h.await.unwrap().0, 200);
    }
    let m = metrics_text(&router).await;
    assert_eq!(
        series(
            &m,
            "inferlb_queue_shed_total{class=\"batch\",reason=\"displaced\"}"
        ),
        Some(2.0),
        "{m}"
    );
    assert_eq!(
        series(
            &m,
            "inferlb_queue_shed_total{class=\"batch\",reason=\"full\"}"
        ),
        Some(1.0)
    );
    assert!(
        m.contains("inferlb_queue_wait_seconds_count{class=\"interactive\"}"),
        "{m}"
    );
    assert!(
        m.contains("inferlb_requests_queued_by_class{class=\"standard\"}"),
        "{m}"
    );
    router.shutdown().await;
}

// On the real clock (tokio's paused clock cannot be used: the router's poller runs on a
// thread of its own, and the test runtime's idle clock raced past its own bounds while that
// thread scraped). Nothing here is a guess of how fast the machine is: the batch deadline
// must pass (it is only a lower bound), and the standard one is 10 minutes, so it cannot pass
// while even a starved test runs; every wait is on an event.
#[tokio::test]
async fn a_lower_class_deadline_passes_first() {
    let (b, router, first) = setup(
        |cfg| {
            cfg.limits.queue_timeout_ms = 600_000;
            cfg.priority.queue_timeout_ms.insert("batch".into(), 200);
        },
        None,
    )
    .await;
    let standard = spawn_request(&router, None, None, "S");
    until_waiting(&router, 1).await;
    let batch = spawn_request(&router, None, Some("batch"), "X");
    assert_eq!(batch.await.unwrap(), (429, Some("1".into())));
    // The standard request (10 min) still waits, and is served when the slot frees.
    let v = common::admin_view(&router).await;
    assert_eq!(v["waiting_for_slot"], 1);
    assert_eq!(release_next(&b, 2).await, "S");
    b.state.gate.notify_one();
    assert_eq!(first.await.unwrap().0, 200);
    assert_eq!(standard.await.unwrap().0, 200);
    router.shutdown().await;
}
