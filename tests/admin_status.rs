//! The status page, `/admin/decisions` and the explain header, through the HTTP surface of a
//! real router on loopback with fake backends.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{client, config, start_router, FakeBackend, TestRouter};
use serde_json::Value;

const SECRET: &str = "a-very-private-prompt-text";

async fn decisions(router: &TestRouter, n: usize) -> Value {
    let resp = client()
        .get(router.url(&format!("/admin/decisions?n={n}")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.json().await.unwrap()
}

async fn chat_with(router: &TestRouter, headers: &[(&str, &str)], i: usize) -> reqwest::Response {
    let mut req = client().post(router.url("/v1/chat/completions")).json(
        &serde_json::json!({"model": "m", "messages": [{"role": "user", "content": format!("{SECRET} {i}")}]}),
    );
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    assert_eq!(resp.status(), 200);
    resp
}

async fn ready(router: &TestRouter, n: usize) {
    common::until_backends_json(router, |v| {
        v["backends"]
            .as_array()
            .is_some_and(|b| b.iter().filter(|b| b["healthy"] == true).count() == n)
    })
    .await;
}

#[tokio::test]
async fn decisions_json_lists_every_candidate_score_and_the_winner() {
    let a = FakeBackend::start("a", &["m"]).await;
    let b = FakeBackend::start("b", &["m"]).await;
    let mut c = config(&[&a, &b]);
    c.admin.decisions = 4;
    let router = start_router(c).await;
    ready(&router, 2).await;

    // Nobody has looked yet: nothing is recorded (the request path pays nothing).
    chat_with(&router, &[], 0).await;
    let first = decisions(&router, 10).await;
    assert_eq!(first["decisions"].as_array().unwrap().len(), 0, "{first}");
    assert_eq!(first["capacity"], 4);
    assert!(first["recording_for_s"].as_u64().unwrap() > 500, "{first}");

    // Now it records: six requests into a ring of four.
    let mut served = Vec::new();
    for i in 1..=6 {
        let resp = chat_with(&router, &[], i).await;
        served.push(
            resp.headers()["x-inferlb-backend"]
                .to_str()
                .unwrap()
                .to_owned(),
        );
    }
    let v = decisions(&router, 100).await;
    let list = v["decisions"].as_array().unwrap();
    assert_eq!(list.len(), 4, "bounded by admin.decisions: {v}");
    let seqs: Vec<u64> = list.iter().map(|d| d["seq"].as_u64().unwrap()).collect();
    assert!(
        seqs.windows(2).all(|w| w[0] == w[1] + 1),
        "newest first: {seqs:?}"
    );
    let newest = &list[0];
    assert_eq!(newest["winner"], served[5].as_str());
    let scorers: Vec<&str> = newest["scorers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        scorers,
        [
            "prefix-cache-scorer",
            "prefill-cost-scorer",
            "kv-cache-utilization-scorer"
        ]
    );
    let candidates = newest["candidates"].as_array().unwrap();
    assert_eq!(
        candidates.len(),
        2,
        "both backends were candidates: {newest}"
    );
    let picked: Vec<&Value> = candidates.iter().filter(|c| c["picked"] == true).collect();
    assert_eq!(picked.len(), 1);
    assert_eq!(picked[0]["backend"], newest["winner"]);
    for c in candidates {
        assert_eq!(c["scores"].as_array().unwrap().len(), 3, "{c}");
        let weighted: f64 = c["scores"]
            .as_array()
            .unwrap()
            .iter()
            .zip(newest["scorers"].as_array().unwrap())
            .map(|(s, w)| s.as_f64().unwrap().clamp(0.0, 1.0) * w["weight"].as_f64().unwrap())
            .sum();
        assert!(
            (weighted - c["total"].as_f64().unwrap()).abs() < 1e-9,
            "{c}"
        );
        assert!(c["total"].as_f64().unwrap() <= picked[0]["total"].as_f64().unwrap());
    }
    // Lengths and hashes only, never the prompt.
    assert!(newest["prompt_bytes"].as_u64().unwrap() > SECRET.len() as u64);
    assert_eq!(newest["prompt_hash"].as_str().unwrap().len(), 16);
    assert!(!v.to_string().contains(SECRET), "prompt text leaked: {v}");
    assert_eq!(
        decisions(&router, 2).await["decisions"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    router.shutdown().await;
}

fn decision_header(resp: &reqwest::Response) -> Option<String> {
    resp.headers()
        .get("x-inferlb-decision")
        .map(|v| v.to_str().unwrap().to_owned())
}

#[tokio::test]
async fn explain_header_only_when_enabled_or_for_admin_token_holders() {
    let a = FakeBackend::start("a", &["m"]).await;
    let b = FakeBackend::start("b", &["m"]).await;
    let mut c = config(&[&a, &b]);
    c.auth.admin_token = Some("admin-secret".into());
    let router = start_router(c).await;
    // The admin routes need the token here.
    let unauth = client()
        .get(router.url("/admin/decisions"))
        .send()
        .await
        .unwrap();
    assert_eq!(unauth.status(), 401);
    common::until_backends_json(&router, |_| true).await;

    let plain = chat_with(&router, &[("x-inferlb-explain", "1")], 0).await;
    assert_eq!(decision_header(&plain), None, "explain without the token");
    let wrong = chat_with(
        &router,
        &[
            ("x-inferlb-explain", "1"),
            ("x-inferlb-admin-token", "guess"),
        ],
        1,
    )
    .await;
    assert_eq!(decision_header(&wrong), None, "explain with a wrong token");
    let asked = chat_with(
        &router,
        &[
            ("x-inferlb-explain", "1"),
            ("x-inferlb-admin-token", "admin-secret"),
        ],
        2,
    )
    .await;
    let backend = asked.headers()["x-inferlb-backend"]
        .to_str()
        .unwrap()
        .to_owned();
    let summary = decision_header(&asked).expect("explained for the token holder");
    assert!(
        summary.contains(&format!("winner={backend}")),
        "{summary} names another winner than {backend}"
    );
    assert!(summary.contains("decisions=1"), "{summary}");
    for name in [
        "prefix-cache-scorer=",
        "prefill-cost-scorer=",
        "kv-cache-utilization-scorer=",
    ] {
        assert_eq!(
            summary.matches(name).count(),
            2,
            "{name} for both candidates: {summary}"
        );
    }
    // The router's own headers never reach the backend.
    let served = if backend == a.url() { &a } else { &b };
    let seen = served.state.last_headers.lock().unwrap().clone().unwrap();
    assert!(seen.get("x-inferlb-admin-token").is_none() && seen.get("x-inferlb-explain").is_none());
    router.shutdown().await;

    // With admin.explain every client may ask, and only asking gets it.
    let mut c = config(&[&a, &b]);
    c.admin.explain = true;
    let router = start_router(c).await;
    common::until_backends_json(&router, |_| true).await;
    let asked = chat_with(&router, &[("x-inferlb-explain", "1")], 3).await;
    assert!(decision_header(&asked).is_some_and(|s| s.starts_with("seq=")));
    let silent = chat_with(&router, &[], 4).await;
    assert_eq!(decision_header(&silent), None);
    router.shutdown().await;
}

#[tokio::test]
async fn status_page_is_self_contained_html_served_without_the_token() {
    let a = FakeBackend::start("a", &["m"]).await;
    let mut c = config(&[&a]);
    c.auth.admin_token = Some("admin-secret".into());
    let router = start_router(c).await;
    let resp = client().get(router.url("/admin")).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    let csp = resp.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(csp.contains("default-src 'none'"), "{csp}");
    let html = resp.text().await.unwrap();
    assert!(html.contains("<title>inferlb status</title>"));
    assert!(html.contains("/admin/backends") && html.contains("/admin/decisions"));
    for external in ["src=", "href=", "http://", "https://", "@import"] {
        assert!(
            !html.contains(external),
            "external asset reference `{external}`"
        );
    }
    router.shutdown().await;
}
