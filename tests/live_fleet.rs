//! A live fleet through the real binary: backends that come and go through file discovery,
//! and configuration reloads (SIGHUP, or a change of the config file) under load.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::binary::spawn_with;
use common::{admin_at as admin, client, metrics_at as metrics, FakeBackend};
use futures_util::StreamExt;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("inferlb-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Write `text` to `path` through a rename, so a reader never sees half a file.
fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Re-check `cond` on the router's admin view every 20 ms, for at most 30 s.
async fn until_admin(addr: &str, what: &str, cond: impl Fn(&serde_json::Value) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let v = admin(addr).await;
        if cond(&v) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "never: {what}: {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Re-check `cond` on the router's metrics page every 50 ms, for at most 30 s.
async fn until_metrics(addr: &str, what: &str, cond: impl Fn(&str) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let page = metrics(addr).await;
        if cond(&page) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn member<'a>(v: &'a serde_json::Value, url: &str) -> Option<&'a serde_json::Value> {
    v["backends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["url"] == url)
}

fn healthy_member(v: &serde_json::Value, url: &str) -> bool {
    member(v, url).is_some_and(|b| b["healthy"] == true)
}

async fn chat(addr: &str, model: &str, content: &str) -> (u16, String) {
    let resp = client()
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&serde_json::json!({"model": model, "messages": [{"role": "user", "content": content}]}))
        .send()
        .await
        .unwrap();
    let served = resp
        .headers()
        .get("x-inferlb-backend")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (resp.status().as_u16(), served)
}

fn gauge_series_of(page: &str, url: &str) -> Vec<String> {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            [
                "inferlb_backend_healthy",
                "inferlb_backend_inflight",
                "inferlb_backend_kv_cache_usage_ratio",
                "inferlb_backend_waiting_requests",
                "inferlb_backend_running_requests",
                "inferlb_backend_ejected",
            ]
            .iter()
            .any(|g| l.starts_with(&format!("{g}{{")))
        })
        .filter(|l| l.contains(&format!("backend=\"{url}\"")))
        .map(str::to_owned)
        .collect()
}

/// A backend added to the file starts receiving requests; one removed receives no new request
/// while its in-flight stream completes with `[DONE]`; its prefix records and gauge series go;
/// a file that does not parse keeps the last good set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_discovery_adds_and_drains_backends() {
    let a = FakeBackend::start("a", &["m", "only-a"]).await;
    let b = FakeBackend::start("b", &["m"]).await;
    let dir = temp_dir("file-discovery");
    let list = dir.join("backends.json");
    write_atomically(&list, &format!(r#"[{{"url":"{}"}}]"#, a.url()));
    let cfg = dir.join("inferlb.toml");
    std::fs::write(
        &cfg,
        format!(
            "metrics_idle_timeout_ms = 500\n[poller]\ninterval_ms = 20\n\
             [discovery]\nsource = \"file\"\n[discovery.file]\npath = \"{}\"\npoll_interval_ms = 20\n",
            list.display()
        ),
    )
    .unwrap();
    let mut r = spawn_with(&["--config", cfg.to_str().unwrap()]);
    let addr = r.addr.clone();
    until_admin(&addr, "a healthy", |v| healthy_member(v, &a.url())).await;
    assert_eq!(
        member(&admin(&addr).await, &a.url()).unwrap()["source"],
        "file"
    );
    for i in 0..3 {
        assert_eq!(chat(&addr, "m", &format!("q{i}")).await, (200, a.url()));
    }

    // Scale up: b joins and takes requests.
    write_atomically(
        &list,
        &format!(r#"[{{"url":"{}"}},{{"url":"{}"}}]"#, a.url(), b.url()),
    );
    until_admin(&addr, "b healthy", |v| healthy_member(v, &b.url())).await;
    let mut on_b = 0;
    for i in 0..40 {
        let (status, served) = chat(&addr, "m", &format!("spread {i} {}", "x".repeat(300))).await;
        assert_eq!(status, 200);
        on_b += usize::from(served == b.url());
    }
    assert!(on_b > 0, "the new backend never got a request");

    // A stream in flight on a, then a leaves the file.
    a.state.hold_streams.store(true, Ordering::Relaxed);
    let resp = client()
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&serde_json::json!({"model": "only-a", "stream": true, "messages": [{"role": "user", "content": "long"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-inferlb-backend"], a.url().as_str());
    let mut stream = resp.bytes_stream();
    let first = stream.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: {\"first\""));
    let blocks_before = index_blocks(&metrics(&addr).await);
    let before = a.state.completions.load(Ordering::Relaxed);
    write_atomically(&list, &format!(r#"[{{"url":"{}"}}]"#, b.url()));
    until_admin(&addr, "a gone", |v| member(v, &a.url()).is_none()).await;
    for i in 0..10 {
        assert_eq!(
            chat(&addr, "m", &format!("after {i}")).await,
            (200, b.url())
        );
    }
    let (status, _) = chat(&addr, "only-a", "nobody serves it now").await;
    assert!(status == 404 || status == 503, "{status}");
    assert_eq!(
        a.state.completions.load(Ordering::Relaxed),
        before,
        "a got no new request after it left"
    );
    // The running stream finishes as sent.
    a.state.gate.notify_one();
    let mut rest = Vec::new();
    while let Some(chunk) = stream.next().await {
        rest.extend_from_slice(&chunk.unwrap());
    }
    let rest = String::from_utf8(rest).unwrap();
    assert!(rest.trim_end().ends_with("data: [DONE]"), "{rest}");
    // Its prefix records are dropped and its gauges leave /metrics.
    let blocks_after = index_blocks(&metrics(&addr).await);
    assert!(
        blocks_after < blocks_before,
        "prefix index blocks {blocks_before} → {blocks_after}"
    );
    let gone = a.url();
    until_metrics(&addr, "a's gauge series gone", |page| {
        gauge_series_of(page, &gone).is_empty()
    })
    .await;
    assert!(!gauge_series_of(&metrics(&addr).await, &b.url()).is_empty());

    // A broken file keeps the last good set.
    write_atomically(&list, "[{\"url\": ");
    until_metrics(&addr, "a discovery error counted", |page| {
        page.lines()
            .any(|l| l.starts_with("inferlb_discovery_errors_total{source=\"file\"}"))
    })
    .await;
    assert!(healthy_member(&admin(&addr).await, &b.url()));
    assert_eq!(chat(&addr, "m", "still").await, (200, b.url()));
    r.signal("-TERM");
    r.log("inferlb stopped").await;
    assert!(r.exit().await.success());
}

fn index_blocks(page: &str) -> f64 {
    page.lines()
        .find(|l| l.starts_with("inferlb_prefix_index_blocks "))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

fn profile_config(a: &FakeBackend, b: &FakeBackend, kv_weight: u32) -> String {
    format!(
        "[poller]\ninterval_ms = 20\n\
         [[backends]]\nurl = \"{}\"\n[[backends]]\nurl = \"{}\"\n\
         [[plugins]]\ntype = \"prefix-cache-scorer\"\n\
         [[plugins]]\ntype = \"kv-cache-utilization-scorer\"\n\
         [[scheduling_profiles]]\nname = \"p\"\n\
         plugins = [{{ plugin_ref = \"prefix-cache-scorer\", weight = 1 }}, {{ plugin_ref = \"kv-cache-utilization-scorer\", weight = {kv_weight} }}]\n",
        a.url(),
        b.url()
    )
}

fn reloads(page: &str, result: &str) -> f64 {
    page.lines()
        .filter(|l| {
            l.starts_with("inferlb_config_reloads_total{")
                && l.contains(&format!("result=\"{result}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Weights changed while 8 clients send requests: no request fails and the new profile is in
/// effect; an invalid file is refused (named in the log, counted) and the router keeps
/// serving with the previous configuration; SIGHUP re-reads an unchanged file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_under_load_and_an_invalid_file_is_refused() {
    let a = FakeBackend::start("a", &["m"]).await;
    let b = FakeBackend::start("b", &["m"]).await;
    let dir = temp_dir("reload");
    let cfg = dir.join("inferlb.toml");
    write_atomically(&cfg, &profile_config(&a, &b, 1));
    let mut r = spawn_with(&["--config", cfg.to_str().unwrap()]);
    let addr = r.addr.clone();
    until_admin(&addr, "both healthy", |v| {
        healthy_member(v, &a.url()) && healthy_member(v, &b.url())
    })
    .await;
    assert!(admin(&addr).await["profile"]
        .as_str()
        .unwrap()
        .contains("kv-cache-utilization-scorer×1"));
    let clients: Vec<_> = (0..8)
        .map(|c| {
            let addr = addr.clone();
            tokio::spawn(async move {
                let mut failed = Vec::new();
                for i in 0..40 {
                    let (status, _) = chat(&addr, "m", &format!("client {c} request {i}")).await;
                    if status != 200 {
                        failed.push(status);
                    }
                }
                failed
            })
        })
        .collect();
    // The file changes: the binary notices and reloads.
    write_atomically(&cfg, &profile_config(&a, &b, 5));
    until_admin(&addr, "the new weights in effect", |v| {
        v["profile"]
            .as_str()
            .unwrap()
            .contains("kv-cache-utilization-scorer×5")
    })
    .await;
    // An invalid file is refused and the router keeps serving.
    write_atomically(
        &cfg,
        &format!("{}\nmax_bodyy_bytes = 1\n", profile_config(&a, &b, 9)),
    );
    until_metrics(&addr, "a refused reload counted", |page| {
        reloads(page, "error") >= 1.0
    })
    .await;
    let refused = r
        .log("configuration reload refused; the previous configuration stays in effect")
        .await;
    assert!(
        refused.to_string().contains("max_bodyy_bytes"),
        "the refusal names the field: {refused}"
    );
    assert!(admin(&addr).await["profile"]
        .as_str()
        .unwrap()
        .contains("kv-cache-utilization-scorer×5"));
    for client in clients {
        let failed = client.await.unwrap();
        assert!(
            failed.is_empty(),
            "failed requests during reloads: {failed:?}"
        );
    }
    // SIGHUP re-reads the file (fixed again) even when nothing else would notice.
    write_atomically(&cfg, &profile_config(&a, &b, 2));
    until_admin(&addr, "weights 2", |v| {
        v["profile"]
            .as_str()
            .unwrap()
            .contains("kv-cache-utilization-scorer×2")
    })
    .await;
    let ok_before = reloads(&metrics(&addr).await, "ok");
    r.signal("-HUP");
    until_metrics(&addr, "SIGHUP reload", |page| {
        reloads(page, "ok") > ok_before
    })
    .await;
    assert_eq!(chat(&addr, "m", "after reloads").await.0, 200);
    // The front door's own settings are reloaded too: a body limit lowered in the file refuses
    // the next request that is over it.
    let long = "x".repeat(400);
    assert_eq!(chat(&addr, "m", &long).await.0, 200);
    let ok_before = reloads(&metrics(&addr).await, "ok");
    write_atomically(
        &cfg,
        &format!("max_body_bytes = 256\n{}", profile_config(&a, &b, 2)),
    );
    until_metrics(&addr, "the body limit reloaded", |page| {
        reloads(page, "ok") > ok_before
    })
    .await;
    assert_eq!(chat(&addr, "m", &long).await.0, 413);
    assert_eq!(chat(&addr, "m", "short").await.0, 200);
    r.signal("-TERM");
    assert!(r.exit().await.success());
}
