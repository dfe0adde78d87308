//! Where a prefix goes, through the real router: a prefix nobody holds by the caches' fill
//! (`room_work_weight = 0`) or by the backends' recent traffic (the default) while that traffic
//! is a hot prefix's, the new prefixes each was just given counted at a multiple of an average
//! prefix's traffic (`room_placed_weight`), and by fill again while the caches thrash; and a hot prefix whose holder takes too much of the traffic to a second
//! holder (hot-prefix replication).
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

/// A router over two idle fakes (KV usage 0) with the default profile, its prefix scorer's
/// parameters set to `parameters`.
async fn two_backends(parameters: &str) -> (Vec<common::FakeBackend>, TestRouter) {
    over(common::fakes(&["a", "b"]).await, parameters).await
}

/// A router over `fakes` as [`two_backends`] starts it.
async fn over(
    fakes: Vec<common::FakeBackend>,
    parameters: &str,
) -> (Vec<common::FakeBackend>, TestRouter) {
    let mut cfg = config(&fakes.iter().collect::<Vec<_>>());
    cfg.plugins.push(PluginSpec {
        kind: "prefix-cache-scorer".into(),
        name: None,
        parameters: toml::from_str(parameters).unwrap(),
    });
    let router = start_router(cfg).await;
    until_backends_json(&router, |v| {
        v["backends"].as_array().is_some_and(|l| {
            l.iter()
                .all(|b| b["healthy"] == true && b["metrics"]["kv_cache_usage"] == 0.0)
        })
    })
    .await;
    (fakes, router)
}

/// On two idle backends: one long prompt fills backend X's recorded cache, then one short
/// prompt sent `hot` times (at least 20) makes backend Y the busier by traffic while X stays
/// the fuller by fill. Returns the router, X and Y.
async fn hot_on_y(
    parameters: &str,
    hot: usize,
) -> (Vec<common::FakeBackend>, TestRouter, String, String) {
    let (fakes, router) = two_backends(parameters).await;
    // ~1,000 tokens of fill on X.
    let x = send(&router, &text('L', 4_000)).await;
    // A hot prefix: its first request goes to the emptier and idler Y, the rest follow it.
    let y = send(&router, &text('H', 400)).await;
    assert_ne!(
        x, y,
        "the hot prefix's first request goes to the empty backend"
    );
    for _ in 1..hot {
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
    (fakes, router, x, y)
}

/// Where a new prefix goes after [`hot_on_y`] with `hot` requests of the hot prefix
/// (replication off: it is not what is tested).
async fn place_new_prefix(room: &str, hot: usize) -> (String, String, String) {
    let (_fakes, router, x, y) = hot_on_y(&format!("{room}\nreplicate_share = 0.0"), hot).await;
    let new = send(&router, &text('N', 400)).await;
    router.shutdown().await;
    (x, y, new)
}

#[tokio::test]
async fn without_room_work_weight_a_new_prefix_goes_to_the_emptiest_cache() {
    let (_x, y, new) = place_new_prefix("room_work_weight = 0.0", 20).await;
    assert_eq!(new, y, "fill decides: Y holds only the short hot prefix");
}

#[tokio::test]
async fn with_room_work_weight_a_new_prefix_goes_to_the_idler_backend() {
    let (x, _y, new) = place_new_prefix("room_work_weight = 1.0\nroom_work_slack = 0.0", 20).await;
    assert_eq!(new, x, "traffic decides while the caches are idle");
}

#[tokio::test]
async fn only_a_hot_prefixs_traffic_moves_a_new_prefix() {
    // Y carries about 2,000 tokens and X 1,000, and each was given one new prefix, counted at
    // twice the average prefix's traffic (2 × 1,500, the default weight): 5,000 and 4,000. Y's
    // excess over their mean came from one prefix bringing more than half a backend's mean work
    // (hot): traffic moves the new prefix to X…
    let (x, _y, new) = place_new_prefix("room_work_weight = 1.0", 20).await;
    assert_eq!(new, x, "a hot prefix's excess moves it");
    // …while with no prefix counted hot (a share no prefix reaches) the same excess is
    // traffic spread over prefixes, and fill places it (Y, the emptier).
    let (_x, y, new) =
        place_new_prefix("room_work_weight = 1.0\nroom_hot_share = 1000.0", 20).await;
    assert_eq!(new, y, "an excess from no hot prefix is left to fill");
    // A slack over the excess leaves it to fill as well (Y: 5,000 < 1.5 × 4,500).
    let (_x, y, new) = place_new_prefix("room_work_weight = 1.0\nroom_work_slack = 0.5", 20).await;
    assert_eq!(new, y, "within the slack, fill decides");
}

/// After [`hot_on_y`], ten new prefixes: how many the busy backend Y is given, with
/// `room_placed_weight` set (`None`: its default).
async fn new_prefixes_on_the_busy_backend(room_placed_weight: Option<f64>) -> usize {
    let placed =
        room_placed_weight.map_or(String::new(), |w| format!("room_placed_weight = {w:?}\n"));
    let (_fakes, router, _x, y) = hot_on_y(
        &format!("room_work_weight = 1.0\n{placed}room_work_slack = 0.0\nreplicate_share = 0.0"),
        20,
    )
    .await;
    let mut on_y = 0;
    for i in 0..10 {
        let seed = char::from(b'a' + i);
        if send(&router, &text(seed, 400)).await == y {
            on_y += 1;
        }
    }
    router.shutdown().await;
    on_y
}

#[tokio::test]
async fn new_prefixes_count_ahead_of_their_traffic() {
    // X stays the idler by traffic alone (Y's hot prompts outweigh ten short prompts), so
    // judged by traffic alone every new prefix goes to X…
    assert_eq!(new_prefixes_on_the_busy_backend(Some(0.0)).await, 0);
    // …while each new prefix X is given counts as an average prefix's traffic: Y takes turns.
    let on_y = new_prefixes_on_the_busy_backend(Some(1.0)).await;
    assert!((3..=7).contains(&on_y), "Y was given {on_y} of 10");
}

#[tokio::test]
async fn by_default_a_new_prefix_counts_as_two_average_prefixes() {
    // The default weight is 2: a backend that was just given prefixes stops looking idle
    // sooner than at the 0.5 it was until 2026-12-07, so the hot prefix's backend Y is given
    // more of the new prefixes (on the simulator's Zipf shape the idlest backend had been
    // given a third of the groups, more than its cache kept).
    let by_default = new_prefixes_on_the_busy_backend(None).await;
    let at_two = new_prefixes_on_the_busy_backend(Some(2.0)).await;
    let at_half = new_prefixes_on_the_busy_backend(Some(0.5)).await;
    assert_eq!(by_default, at_two, "the default is 2");
    assert!(
        by_default > at_half,
        "Y was given {by_default} of 10 by default, {at_half} at 0.5"
    );
}

/// Twenty requests of one hot prefix on two idle backends: (backends that served it,
/// requests sent to a new replica).
async fn hot_prefix(replicate_share: f64) -> (std::collections::BTreeSet<String>, f64) {
    let (_fakes, router) = two_backends(&format!("replicate_share = {replicate_share:?}")).await;
    // The metrics registry is the process's: count what this router adds.
    let replicas = || common::sample(&router, "inferlb_prefix_replicas_total");
    let before = replicas().await;
    let mut served = std::collections::BTreeSet::new();
    for _ in 0..20 {
        served.insert(send(&router, &text('H', 400)).await);
    }
    let added = replicas().await - before;
    router.shutdown().await;
    (served, added)
}

#[tokio::test]
async fn a_hot_prefix_whose_holder_takes_all_the_traffic_gets_a_second_holder() {
    // Its holder carries all the traffic, the prefix more than half a backend's fair share:
    // from the fifth request on, the other backend is offered as a replica and ties with the
    // holder, so it serves the prefix too (each request after the fourth: a coin toss).
    let (served, replicas) = hot_prefix(0.5).await;
    assert_eq!(served.len(), 2, "both backends serve the hot prefix");
    assert!(replicas >= 1.0, "inferlb_prefix_replicas_total {replicas}");
    // Without replication affinity keeps it on its first holder.
    let (served, replicas) = hot_prefix(0.0).await;
    assert_eq!(served.len(), 1, "one holder: {served:?}");
    assert_eq!(replicas, 0.0);
}

/// Forty requests cycling through four prompts that share one long prefix (each with its own
/// tail, each repeated) on two idle backends, replication on: how many each backend served,
/// and the requests sent to a copy because the holders were over their load bound.
async fn four_tails_of_one_prefix(
    parameters: &str,
) -> (std::collections::BTreeMap<String, usize>, f64) {
    let (_fakes, router) = two_backends(parameters).await;
    let overflows = || common::sample(&router, "inferlb_prefix_overflows_total");
    let before = overflows().await;
    let shared = text('H', 2_000);
    let mut served = std::collections::BTreeMap::new();
    for i in 0..40 {
        let tail = text(char::from(b'a' + (i % 4) as u8), 300);
        *served
            .entry(send(&router, &format!("{shared}{tail}")).await)
            .or_insert(0) += 1;
    }
    let added = overflows().await - before;
    router.shutdown().await;
    (served, added)
}

#[tokio::test]
async fn a_copy_of_the_prefix_takes_requests_while_every_full_holder_is_over_its_bound() {
    // The prefix is replicated once; each prompt is held whole only where it went first, so
    // without the bound its requests keep going there (the copy holds it all but the tail) and
    // the first holder carries most of the traffic. With it, a holder more than 10 % over the
    // fair share yields its requests to the copy.
    let (served, overflows) = four_tails_of_one_prefix("replicate_share = 0.5").await;
    assert_eq!(served.len(), 2, "{served:?}");
    let busiest = served.values().copied().max().unwrap();
    assert!(busiest <= 28, "busiest served {busiest} of 40: {served:?}");
    assert!(
        overflows >= 1.0,
        "inferlb_prefix_overflows_total {overflows}"
    );
}

/// Backend X serves models `m` and `t`, Y only `m`; every cache holds 16 blocks. `cycled`
/// prompts of model `t` go to X (only X serves it) in turn, nine requests; then forty requests
/// of one short hot prompt of model `m` go to Y (emptier and idler), which ends the busier by
/// traffic while X stays the fuller. Returns where a new prefix of `m` goes, X and Y, and the
/// requests counted in `inferlb_prefix_returns_total` meanwhile.
async fn new_prefix_after(
    cycled: &[String],
    room_thrash_limit: f64,
) -> (String, String, String, f64) {
    let fakes = vec![
        common::FakeBackend::start("x", &["m", "t"]).await,
        common::FakeBackend::start("y", &["m"]).await,
    ];
    let (_fakes, router) = over(
        fakes,
        &format!(
            "room_work_weight = 1.0\nroom_placed_weight = 0.0\nreplicate_share = 0.0\n\
             room_work_slack = 0.0\ncapacity = 16\nroom_thrash_limit = {room_thrash_limit:?}"
        ),
    )
    .await;
    let returns = || common::sample(&router, "inferlb_prefix_returns_total");
    let before = returns().await;
    let mut x = None;
    for prompt in cycled.iter().cycle().take(9) {
        let (status, backend, _) = common::chat(&router, "t", prompt).await;
        assert_eq!(status, 200);
        x = backend;
    }
    let x = x.unwrap();
    let y = send(&router, &text('H', 400)).await;
    assert_ne!(x, y, "the hot prompt goes to the emptier, idler backend");
    for _ in 0..39 {
        assert_eq!(send(&router, &text('H', 400)).await, y, "affinity holds");
    }
    let new = send(&router, &text('N', 400)).await;
    let added = returns().await - before;
    router.shutdown().await;
    (new, x, y, added)
}

/// Three 15-block prompts cycled on a 16-block cache: from the fourth on, each comes back
/// after X's cache dropped it whole.
async fn new_prefix_after_thrash(room_thrash_limit: f64) -> (String, String, String, f64) {
    let cycled: Vec<String> = (0..3u8)
        .map(|i| text(char::from(b'p' + i), 1_000))
        .collect();
    new_prefix_after(&cycled, room_thrash_limit).await
}

#[tokio::test]
async fn while_the_caches_thrash_a_new_prefix_goes_by_fill_not_by_traffic() {
    // Six of the nine cycled prompts came back after eviction (over a fifth of the recent
    // prompt tokens, above the default 2 % limit): traffic no longer decides, fill does, and Y holds
    // only the hot prompt.
    let (new, _x, y, returns) = new_prefix_after_thrash(0.02).await;
    assert!(returns >= 6.0, "inferlb_prefix_returns_total {returns}");
    assert_eq!(new, y, "fill decides while the caches thrash");
    // With a limit the thrash never reaches, traffic decides: X carried less.
    let (new, x, _y, _) = new_prefix_after_thrash(1e9).await;
    assert_eq!(new, x, "traffic decides when the limit is out of reach");
}

#[tokio::test]
async fn a_repeated_prompt_that_lost_only_its_tail_is_not_thrash() {
    // Four prompts of one 10-block prefix and 3-block tails of their own, cycled on a 16-block
    // cache: the shared prefix stays (it is touched by every request), each prompt's tail is
    // evicted before it comes back. From the fifth request on each is a return, but what it
    // lost is its tail: five returns of under a quarter of a prompt each are not four prompts'
    // worth, so the caches are not thrashing and traffic decides (counted whole, the returns
    // closed the gate and fill sent the new prefix to Y).
    let shared = text('S', 640);
    let cycled: Vec<String> = (0..4u8)
        .map(|i| format!("{shared}{}", text(char::from(b'w' + i), 190)))
        .collect();
    let (new, x, _y, returns) = new_prefix_after(&cycled, 0.02).await;
    assert!(returns >= 5.0, "inferlb_prefix_returns_total {returns}");
    assert_eq!(new, x, "traffic decides: the returns lost only their tails");
}

/// Text of about `chars` characters of lowercase words drawn from `seed` (like loadgen's
/// shared-prefix prompts, which tokenize at far fewer than 4 characters per token).
fn words(seed: u64, chars: usize) -> String {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut s = String::with_capacity(chars + 16);
    while s.len() < chars {
        for _ in 0..(3 + x % 6) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            s.push(char::from(b'a' + (x % 26) as u8));
        }
        s.push(' ');
    }
    s
}

/// The value of the first sample of `name` on a Prometheus page.
fn sample(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with([' ', '{']) || name.ends_with('}'))
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// The real binary with `config` as its config file, in front of `backends`, polled every
/// 20 ms; and the directory holding the file, named for `name` (remove it when done).
fn spawn_router(
    name: &str,
    config: &str,
    backends: &[&str],
) -> (common::binary::Running, std::path::PathBuf) {
    let mut args = Vec::new();
    for backend in backends {
        args.extend(["--backend", backend]);
    }
    args.extend(["--poll-interval-ms", "20"]);
    common::binary::spawn_with_config(name, config, &args)
}

/// What `read` finds in the `/admin/backends` of the router at `addr`, asked up to `tries`
/// times 50 ms apart (a bounded wait on the router's own report).
async fn admin_until<T>(
    addr: &str,
    tries: usize,
    read: impl Fn(&serde_json::Value) -> Option<T>,
) -> Option<T> {
    for i in 0..tries {
        if let Some(found) = read(&common::admin_at(addr).await) {
            return Some(found);
        }
        if i + 1 < tries {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
    None
}

/// One completion of `prompt` (one token) from `url`, answered 200 and read whole.
async fn complete(client: &reqwest::Client, url: &str, prompt: String) {
    let resp = client
        .post(url)
        .json(&serde_json::json!({"model": "tiny-llama", "prompt": prompt, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.bytes().await.unwrap();
}

/// What one router (the real binary, `config` as its config file) makes of a tokenizing
/// simulator with a 4,096-token cache (KV events published when `kv_events`) after 25 prompts
/// of words that tokenize at under 2 characters per token: the characters per token it
/// measured, the simulator's own count (prompt bytes ÷ its `prefix_cache_queries`), and the
/// blocks of 64 characters its prefix index holds for that cache. The binary, so that its
/// metrics (the index's size) are its own, not shared with the other tests' routers here.
/// With `others`, another client sends as many prompts of the same kind to the simulator
/// directly, one beside each of the router's (another replica behind a round-robin front).
struct Record {
    measured: f64,
    truth: f64,
    blocks: f64,
    /// The router's share of the simulator's finished requests, as `/admin/backends` shows it.
    share: Option<f64>,
}

async fn record_of_a_4096_token_cache(
    name: &str,
    config: &str,
    kv_events: bool,
    others: bool,
) -> Record {
    const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-llama");
    let sim = common::sim::start(vllm_sim::SimConfig {
        tokenizer: Some(FIXTURE.into()),
        block_size: 16,
        num_gpu_blocks: 256,
        kv_events_config: kv_events.then(common::sim::kv_events),
        ..common::sim::config("tiny-llama")
    })
    .await;
    let (router, dir) = spawn_router(&format!("cpt-{name}"), config, &[&sim.url()]);
    let admin = || common::admin_at(&router.addr);
    // Admitted; stream live when published.
    let ready = |v: &serde_json::Value| {
        let b = &v["backends"][0];
        (b["healthy"] == true && (!kv_events || b["kv_events"]["status"] == "live")).then_some(())
    };
    let admitted = admin_until(&router.addr, 201, ready).await;
    assert!(admitted.is_some(), "not ready: {}", admin().await);
    let client = common::client();
    let url = format!("http://{}/v1/completions", router.addr);
    let direct = format!("{}/v1/completions", sim.url());
    let mut sent_chars = 0usize;
    let mut send = |seed: u64| {
        let prompt = words(seed, 1_500);
        sent_chars += prompt.len();
        // The other client's prompt: other words, as long.
        let other = others.then(|| words(seed + 1_000, 1_500));
        sent_chars += other.as_ref().map_or(0, String::len);
        let (client, url, direct) = (&client, &url, &direct);
        async move {
            complete(client, url, prompt).await;
            if let Some(other) = other {
                complete(client, direct, other).await;
            }
        }
    };
    for seed in 0..24 {
        send(seed).await;
    }
    // The figure is published once the poller has read 8,192 tokens counted.
    let measured = admin_until(&router.addr, 100, |v| {
        v["backends"][0]["chars_per_token"]["measured"].as_f64()
    })
    .await
    .expect("no characters per token measured within 5 s");
    // One more prompt records the index at the size the router now gives it.
    send(24).await;
    let tokens = sample(
        &common::client()
            .get(format!("{}/metrics", sim.url()))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
        "vllm:prefix_cache_queries_total",
    )
    .expect("the simulator counts prompt tokens");
    let truth = sent_chars as f64 / tokens;
    assert!(
        truth < 2.5,
        "the prompts tokenize at {truth} characters per token"
    );
    let page = common::metrics_at(&router.addr).await;
    // The poller may have moved the figure since (by over 1/16 octave): compare, not equal.
    let series = format!(
        "inferlb_backend_chars_per_token{{backend=\"{}\"}}",
        sim.url()
    );
    let gauge = sample(&page, &series).expect("the figure is exported");
    assert!(
        (gauge / measured - 1.0).abs() < 0.1,
        "{gauge} against {measured}"
    );
    let blocks = sample(&page, "inferlb_prefix_index_blocks").unwrap();
    let share = admin().await["backends"][0]["chars_per_token"]["traffic_share"].as_f64();
    common::kv_events::stop(router);
    let _ = std::fs::remove_dir_all(&dir);
    Record {
        measured,
        truth,
        blocks,
        share,
    }
}

/// Do `blocks` of 64 characters fill a record of a 4,096-token cache at `per_token` characters
/// per token? (The last prompt may leave up to 24 of them free, and the figure the record was
/// sized by may differ from `per_token` by the 1/16 octave it moves by.)
fn full_record(blocks: f64, per_token: f64) -> bool {
    let bound = (4_096.0 * per_token / 64.0).ceil();
    blocks <= 1.05 * bound && blocks >= 0.95 * bound - 24.0
}

const MEASURE: &str =
    "[[plugins]]\ntype = \"prefix-cache-scorer\"\n[plugins.parameters]\nmeasure_chars_per_token = ";

/// With `measure_chars_per_token = true` the prefix index sizes a backend's record by the
/// characters per token it measured there, not by the assumed 4: about 4,096 × that figure
/// characters, the figure being the simulator's own count of the prompts' tokens. With
/// `false` (or the measurement broken) the record keeps 4 per token, 256 blocks, and this
/// fails.
#[tokio::test]
async fn the_prefix_index_is_sized_by_the_measured_characters_per_token() {
    let Record {
        measured,
        truth,
        blocks,
        ..
    } = record_of_a_4096_token_cache("true", &format!("{MEASURE}true\n"), false, false).await;
    assert!(
        (measured / truth - 1.0).abs() < 0.1,
        "measured {measured} characters per token, the simulator counted {truth}"
    );
    assert!(
        full_record(blocks, measured),
        "the index holds {blocks} blocks for a 4,096-token cache at {measured} characters per \
         token (4 per token would be 256)"
    );
}

/// By default (`"auto"`) a backend whose KV-event stream is live is sized by its measured
/// figure, and one without a stream keeps the assumed 4 (256 blocks). With
/// `measure_chars_per_token = false` the first half fails; with `true` the second.
#[tokio::test]
async fn by_default_only_a_backend_with_a_live_stream_is_sized_by_its_measured_figure() {
    let live = "[kv_events]\ndefault = \"auto\"\n";
    let Record {
        measured,
        truth,
        blocks,
        ..
    } = record_of_a_4096_token_cache("auto-live", live, true, false).await;
    assert!(
        (measured / truth - 1.0).abs() < 0.1,
        "{measured} against {truth}"
    );
    assert!(
        full_record(blocks, measured),
        "live stream: {blocks} blocks at {measured} characters per token"
    );
    let Record {
        measured, blocks, ..
    } = record_of_a_4096_token_cache("auto-none", "", false, false).await;
    assert!(
        full_record(blocks, 4.0),
        "no stream: {blocks} blocks, not the assumed 256 (measured {measured})"
    );
}

/// A backend that another client uses as much as this router (a second replica behind a
/// round-robin front, or users calling it directly): the router reads its share of the
/// backend's finished requests, about a half, and divides its figure by it, so it still reads
/// the workload's characters per token rather than half of them. With the share ignored the
/// figure is half the truth and this fails.
#[tokio::test]
async fn a_router_sending_half_of_a_backends_traffic_still_measures_the_whole_figure() {
    let Record {
        measured,
        truth,
        share,
        ..
    } = record_of_a_4096_token_cache("shared", &format!("{MEASURE}true\n"), false, true).await;
    let share = share.expect("a share is measured");
    assert!((0.4..=0.6).contains(&share), "share {share}");
    assert!(
        (measured / truth - 1.0).abs() < 0.1,
        "measured {measured} characters per token, the simulator counted {truth} over both clients"
    );
}

/// A prefix counts as hot from `replicate_min_prompts` (4) prompts' worth of recent traffic,
/// in the fleet's terms: a router that sees half of its backend's traffic (a second client
/// sends as many requests straight to the simulator) finds a prefix hot once two of its own
/// prompts' worth came lately, as a router alone does at four. Four sends of one prompt: the
/// fourth finds three before it, and counts in the backend's `recent_hot`. With the share
/// ignored the threshold stays at four prompts and this fails.
#[tokio::test]
async fn a_router_with_half_of_a_backends_traffic_counts_a_prefix_hot_at_half_the_prompts() {
    let sim = common::sim::start(common::sim::config("tiny-llama")).await;
    let backend = sim.url();
    // Only the absolute gate: no relative one against the backend's mean work.
    let config = format!("{MEASURE}false\nroom_hot_share = 0.0\nreplicate_min_prompts = 4.0\n");
    let (router, dir) = spawn_router("hot-share", &config, &[&backend]);
    admin_until(&router.addr, 200, |v| {
        (v["backends"][0]["healthy"] == true).then_some(())
    })
    .await;
    let client = common::client();
    let through = format!("http://{}/v1/completions", router.addr);
    let direct = format!("{backend}/v1/completions");
    for seed in 0..20 {
        complete(&client, &through, words(seed, 1_500)).await;
        complete(&client, &direct, words(seed + 1_000, 1_500)).await;
    }
    let share = admin_until(&router.addr, 100, |v| {
        v["backends"][0]["chars_per_token"]["traffic_share"].as_f64()
    })
    .await
    .expect("no traffic share measured within 5 s");
    assert!((0.4..=0.6).contains(&share), "share {share}");
    let hot = words(999, 1_500);
    for _ in 0..4 {
        complete(&client, &through, hot.clone()).await;
    }
    let recent_hot = common::admin_at(&router.addr).await["backends"][0]["sent_tokens"]
        ["recent_hot"]
        .as_f64()
        .unwrap();
    assert!(
        recent_hot > 0.0,
        "the fourth send found three prompts' worth before it, over 4 × {share}: not counted hot"
    );
    drop(router);
    let _ = std::fs::remove_dir_all(&dir);
}

/// One completion of `prompt` (one token) from the router at `addr`, with its decision
/// explained: the backend that answered, and each candidate's prefix-cache-scorer score by URL.
async fn complete_explained(
    client: &reqwest::Client,
    addr: &str,
    prompt: String,
) -> (String, std::collections::BTreeMap<String, f64>) {
    let resp = client
        .post(format!("http://{addr}/v1/completions"))
        .header("x-inferlb-explain", "1")
        .json(&serde_json::json!({"model": "tiny-llama", "prompt": prompt, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let backend = resp.headers()["x-inferlb-backend"]
        .to_str()
        .unwrap()
        .to_owned();
    let summary = resp.headers()["x-inferlb-decision"]
        .to_str()
        .unwrap()
        .to_owned();
    resp.bytes().await.unwrap();
    let scores = summary
        .split("; ")
        .filter_map(|part| {
            let (url, rest) = part.split_once(" total=")?;
            let score = rest
                .split(' ')
                .find_map(|kv| kv.strip_prefix("prefix-cache-scorer="))?;
            Some((url.to_owned(), score.parse().unwrap()))
        })
        .collect();
    (backend, scores)
}

/// Hot-prefix replication waits for `replicate_min_prompts` (4) prompts' worth of a prefix's
/// recent traffic, in the fleet's terms: a router that sees half of each backend's traffic
/// (another client sends each backend one request beside each of the router's) offers a hot
/// prefix a second holder once two of its own prompts' worth came lately, as a router alone
/// does at four. One prompt sent four times, its holder over its load bound from the first:
/// the second send (one prompt's worth before it) leaves the other backend scoring 0, the
/// fourth (three) scores it as the holder (a replica, or a holder already if the third made
/// it one). With the share ignored the threshold stays at four prompts and this fails.
#[tokio::test]
async fn a_router_with_half_of_each_backends_traffic_replicates_a_hot_prefix_at_half_the_prompts() {
    let sims = [
        common::sim::start(common::sim::config("tiny-llama")).await,
        common::sim::start(common::sim::config("tiny-llama")).await,
    ];
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    let config = format!(
        "[admin]\nexplain = true\n\n{MEASURE}false\nreplicate_share = 0.5\n\
         replicate_min_prompts = 4.0\n"
    );
    let (router, dir) = spawn_router("replicate-share", &config, &[&urls[0], &urls[1]]);
    let healthy = admin_until(&router.addr, 200, |v| {
        let list = v["backends"].as_array()?;
        (list.len() == 2 && list.iter().all(|b| b["healthy"] == true)).then_some(())
    })
    .await;
    assert!(
        healthy.is_some(),
        "{}",
        common::admin_at(&router.addr).await
    );
    let client = common::client();
    // Prompts shorter than a block (no prefix, one token each): the share is measured while
    // the backends' recent work stays next to nothing beside the hot prompt's.
    for seed in 0..48 {
        let (backend, _) = complete_explained(&client, &router.addr, format!("w{seed}")).await;
        complete(
            &client,
            &format!("{backend}/v1/completions"),
            format!("v{seed}"),
        )
        .await;
    }
    let shares = admin_until(&router.addr, 100, |v| {
        v["backends"]
            .as_array()?
            .iter()
            .map(|b| b["chars_per_token"]["traffic_share"].as_f64())
            .collect::<Option<Vec<f64>>>()
            .filter(|s| s.len() == 2)
    })
    .await
    .expect("no traffic share measured on both backends within 5 s");
    assert!(
        shares.iter().all(|s| (0.4..=0.6).contains(s)),
        "shares {shares:?}"
    );
    let hot = words(999, 1_500);
    let (holder, _) = complete_explained(&client, &router.addr, hot.clone()).await;
    let (_, second) = complete_explained(&client, &router.addr, hot.clone()).await;
    let other = second
        .keys()
        .find(|url| **url != holder)
        .expect("two candidates")
        .clone();
    assert!(
        second[&other] < second[&holder],
        "one prompt's worth before it, under 4 × {shares:?}: no replica yet: {second:?}"
    );
    complete_explained(&client, &router.addr, hot.clone()).await;
    let (_, fourth) = complete_explained(&client, &router.addr, hot).await;
    assert!(
        fourth[&holder] > 0.0 && fourth[&other] == fourth[&holder],
        "three prompts' worth before it, over 4 × {shares:?}: the other backend is offered \
         as a replica: {fourth:?}"
    );
    drop(router);
    let _ = std::fs::remove_dir_all(&dir);
}
