//! The prefill-cost scorer through the real router: a hot prefix stays on the backend that
//! holds it while that backend's queue of prefills is short, spills to a second backend when
//! the queue grows longer than the prefix, and the sent work is released when responses end.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{admin_view, backend_of, client, fleet, post_chat, profile, FakeBackend};

/// 1,600 tokens of shared system prompt (6,400 characters, 4 per token).
fn system() -> String {
    "You are a careful assistant. ".repeat(221)[..6_400].to_owned()
}

/// A chat whose system prompt is shared and whose question (400 tokens) is its own.
fn chat(i: usize, stream: bool) -> serde_json::Value {
    let question = format!("question {i:04} ").repeat(120)[..1_600].to_owned();
    serde_json::json!({
        "model": "m",
        "stream": stream,
        "messages": [
            {"role": "system", "content": system()},
            {"role": "user", "content": question},
        ],
    })
}

fn sent(admin: &serde_json::Value, url: &str) -> (u64, u64) {
    let b = admin["backends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["url"] == url)
        .unwrap();
    (
        b["sent_tokens"]["prefill"].as_u64().unwrap(),
        b["sent_tokens"]["decode"].as_u64().unwrap(),
    )
}

#[tokio::test]
async fn a_hot_prefix_spills_to_a_second_backend_when_its_holders_prefill_queue_outgrows_it() {
    let (fakes, router) = fleet(&["a", "b"], |cfg| {
        profile(cfg, &[("prefill-cost-scorer", 1.0)]);
        let scorer = cfg
            .plugins
            .iter_mut()
            .find(|p| p.kind == "prefill-cost-scorer");
        let parameters = &mut scorer.unwrap().parameters;
        parameters.insert("decode_weight".into(), toml::Value::Float(0.0));
        parameters.insert("smoothing".into(), toml::Value::Float(1.0));
    })
    .await;

    // The first request puts the prefix on one backend: the holder.
    let resp = post_chat(&router, &chat(0, false)).await;
    assert_eq!(resp.status(), 200);
    let holder_url = backend_of(&resp);
    let _ = resp.bytes().await.unwrap();
    let other = fakes.iter().find(|f| f.url() != holder_url).unwrap();
    assert_eq!(sent(&admin_view(&router).await, &holder_url), (0, 0));

    // Streams that send nothing after their head: requests waiting for their prefill. Each
    // costs the holder its 400 uncached question tokens (and a little of the prefix's last
    // partial block); the other backend would have to prefill all ~2,000 tokens.
    for f in &fakes {
        f.state.hold_first.send_replace(true);
    }
    let mut open = Vec::new();
    let mut on_holder = 0;
    let mut spilled = false;
    for i in 1..=12 {
        let resp = post_chat(&router, &chat(i, true)).await;
        assert_eq!(resp.status(), 200);
        let to = backend_of(&resp);
        open.push(resp);
        if to == holder_url {
            on_holder += 1;
        } else {
            spilled = true;
            break;
        }
    }
    assert!(
        spilled,
        "twelve queued prefills never moved the hot prefix off its holder"
    );
    // 1,600 prefix tokens ÷ ~400 uncached each: about four fit before the other backend is
    // cheaper; the holder must have taken several, not just the first.
    assert!((3..=6).contains(&on_holder), "{on_holder} on the holder");
    let admin = admin_view(&router).await;
    let (prefill, decode) = sent(&admin, &holder_url);
    assert!(
        (1_600..=2_400).contains(&prefill) && decode == 0,
        "holder's sent work {prefill}/{decode}"
    );
    let (prefill, decode) = sent(&admin, &other.url());
    assert!(
        prefill >= 1_900 && decode == 0,
        "other's {prefill}/{decode}"
    );

    // First tokens arrive: the prefill moves to decode; the streams end: nothing is left.
    for f in &fakes {
        f.state
            .hold_streams
            .store(true, std::sync::atomic::Ordering::SeqCst);
        f.state.hold_first.send_replace(false);
    }
    let mut streams = Vec::new();
    for resp in open {
        let mut body = resp.bytes_stream();
        use futures_util::StreamExt;
        let first = body.next().await.unwrap().unwrap();
        assert!(first.starts_with(b"data: {\"first\""));
        streams.push(body);
    }
    let admin = admin_view(&router).await;
    let (prefill, decode) = sent(&admin, &holder_url);
    assert_eq!(prefill, 0);
    assert!(decode >= on_holder * 1_990, "decode {decode}");
    let rest = tokio::spawn(async move {
        use futures_util::StreamExt;
        for body in streams {
            let chunks: Vec<_> = body.collect().await;
            assert!(chunks.iter().all(|c| c.is_ok()));
        }
    });
    for f in &fakes {
        f.state
            .hold_streams
            .store(false, std::sync::atomic::Ordering::SeqCst);
    }
    // A held stream waits on the gate; wake them until every body has ended (a wake-up can
    // come before a stream reaches the gate, so repeat it, boundedly).
    for _ in 0..500 {
        if rest.is_finished() {
            break;
        }
        for f in &fakes {
            f.state.gate.notify_waiters();
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    rest.await.unwrap();
    // The slot and the charge go when each body has ended; poll until the router has settled.
    let mut settled = false;
    for _ in 0..200 {
        let admin = admin_view(&router).await;
        if sent(&admin, &holder_url) == (0, 0) && sent(&admin, &other.url()) == (0, 0) {
            settled = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(settled, "sent work left after every response ended");
    router.shutdown().await;
}

/// The default profile's two prefix-aware scorers work through one matcher: every request
/// sent is recorded once (one `inferlb_prefix_match_ratio` observation per request; with a
/// matcher each, every pick was recorded, and counted, twice), and the second request of a
/// prefix is seen to match it. The real binary with the shipped config, so the metrics are
/// this process's alone.
#[tokio::test]
async fn the_default_profile_records_each_pick_once() {
    let b = FakeBackend::start("a", &["m"]).await;
    let router = common::binary::spawn_with(&["--config", "config.toml", "--backend", &b.url()]);
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(20));
    while !common::healthy(&common::admin_at(&router.addr).await, &b.url()) {
        assert!(tokio::time::Instant::now() < deadline, "never healthy");
        tick.tick().await;
    }
    let http = client();
    for i in 0..5 {
        let resp = http
            .post(format!("http://{}/v1/chat/completions", router.addr))
            .json(&chat(i, false))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        resp.bytes().await.unwrap();
    }
    let page = common::metrics_at(&router.addr).await;
    let value = |series: &str| -> f64 {
        page.lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no `{series}` in:\n{page}"))
    };
    assert_eq!(value("inferlb_prefix_match_ratio_count "), 5.0, "{page}");
    // One candidate per decision, scored from the approximate index (no KV events): counted
    // once per decision, not once per scorer reading the matcher.
    assert_eq!(
        value("inferlb_prefix_precise_candidates_total{source=\"approximate\"} "),
        5.0
    );
    // Requests 2–5 found the shared system prompt (its 100 blocks of the prompt's 125): the
    // ratios add up to 4 × 0.8.
    let sum = value("inferlb_prefix_match_ratio_sum ");
    assert!((sum - 3.2).abs() < 0.05, "sum {sum}");
}
