//! Kubernetes discovery through the real binary, against the fake API server in
//! `tests/fake_kube`: scale-up, scale-down, a pod turning unready or terminating, a watch
//! that breaks, a `410 Gone` that forces a re-list, and InferencePool mode.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
mod fake_kube;

use std::time::Duration;

use common::binary::{spawn_with, Running};
use fake_kube::{FakeKube, Gone, PodServer};

/// The binary, its address, killed when dropped.
struct Inferlb {
    /// Killed when dropped (`Running`'s own `Drop`).
    _router: Running,
    addr: String,
    http: reqwest::Client,
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("inferlb-k8s-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Start the binary with `[discovery.kubernetes]` = `k8s_table` (TOML body) and a kubeconfig
/// pointing at `kube`; returns once it announced its address.
fn start(kube: &FakeKube, name: &str, k8s_table: &str, poll_ms: u64) -> Inferlb {
    let dir = temp_dir(name);
    let kubeconfig = kube.kubeconfig(&dir);
    let config = dir.join("inferlb.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:0\"\n[poller]\ninterval_ms = {poll_ms}\n\
             [discovery]\nsource = \"kubernetes\"\n[discovery.backend_defaults]\nmodels = [\"m\"]\n\
             [discovery.kubernetes]\n{k8s_table}\nkubeconfig = \"{}\"\n",
            kubeconfig.display()
        ),
    )
    .unwrap();
    // The shared launcher: JSON logs on a free port, returns once the address is announced.
    let router = spawn_with(&["--config", config.to_str().unwrap()]);
    let addr = router.addr.clone();
    Inferlb {
        _router: router,
        addr,
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(20))
            .build()
            .unwrap(),
    }
}

impl Inferlb {
    async fn backends(&self) -> serde_json::Value {
        common::admin_at(&self.addr).await
    }

    /// The URLs in `/admin/backends` that are healthy and not draining.
    async fn serving(&self) -> Vec<String> {
        let v = self.backends().await;
        let mut urls: Vec<String> = v["backends"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["healthy"] == true && b["draining"] == false)
            .map(|b| b["url"].as_str().unwrap().to_owned())
            .collect();
        urls.sort();
        urls
    }

    /// Wait (bounded: 30 s, re-reading every 20 ms) until the serving set is `want`.
    async fn until_serving(&self, want: &[String]) {
        let mut want = want.to_vec();
        want.sort();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        loop {
            let now = self.serving().await;
            if now == want {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "serving {now:?}, expected {want:?}"
            );
            tick.tick().await;
        }
    }

    /// `/admin/backends` has no entry at `url` (not even a draining one).
    async fn until_absent(&self, url: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        loop {
            let v = self.backends().await;
            if !v["backends"]
                .as_array()
                .unwrap()
                .iter()
                .any(|b| b["url"] == url)
            {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{url} still listed: {v}"
            );
            tick.tick().await;
        }
    }

    async fn chat(&self, i: usize) -> (u16, String) {
        let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": format!("hello {i}")}]});
        let resp = self
            .http
            .post(format!("http://{}/v1/chat/completions", self.addr))
            .json(&body)
            .send()
            .await
            .unwrap();
        let backend = resp
            .headers()
            .get("x-inferlb-backend")
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        (resp.status().as_u16(), backend)
    }
}

fn url(p: &PodServer) -> String {
    format!("http://{}", p.addr)
}

const APP: &[(&str, &str)] = &[("app", "vllm")];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_pods_by_selector_through_scale_unready_breaks_and_410() {
    let kube = FakeKube::start("prod").await;
    let (a, b, c, d) = (
        PodServer::start("127.0.0.1").await,
        PodServer::start("127.0.0.1").await,
        PodServer::start("127.0.0.1").await,
        PodServer::start("127.0.0.1").await,
    );
    // Pods listen on their container port named `http` (one IP, ports differ).
    kube.add_pod("vllm-a", APP, "127.0.0.1", a.addr.port());
    kube.add_pod("other", &[("app", "web")], "127.0.0.1", d.addr.port());
    let lb = tokio::task::block_in_place(|| {
        start(
            &kube,
            "selector",
            "namespace = \"prod\"\nlabel_selector = \"app=vllm\"\nport = \"http\"",
            20,
        )
    });
    lb.until_serving(&[url(&a)]).await;
    let v = lb.backends().await;
    let entry = &v["backends"][0];
    assert_eq!(entry["source"], "kubernetes", "{v}");
    assert_eq!(entry["labels"]["pod"], "vllm-a", "{v}");
    assert_eq!(entry["labels"]["namespace"], "prod", "{v}");
    let (lists, watches) = (kube.lists(), kube.watches());
    assert_eq!(lists, 1);

    // Scale-up: a new ready pod joins and receives requests.
    kube.add_pod("vllm-b", APP, "127.0.0.1", b.addr.port());
    lb.until_serving(&[url(&a), url(&b)]).await;
    for i in 0..200 {
        let (status, _) = lb.chat(i).await;
        assert_eq!(status, 200);
        if b.served() > 0 {
            break;
        }
    }
    assert!(b.served() > 0, "the new pod never received a request");

    // Unready: it leaves; ready again: it is back.
    kube.set_ready("vllm-b", false);
    lb.until_serving(&[url(&a)]).await;
    kube.set_ready("vllm-b", true);
    lb.until_serving(&[url(&a), url(&b)]).await;

    // Terminating (deletionTimestamp, still Ready): it leaves; then scale-down deletes it.
    kube.set_terminating("vllm-b");
    lb.until_absent(&url(&b)).await;
    kube.delete_pod("vllm-b");
    lb.until_serving(&[url(&a)]).await;
    for i in 0..20 {
        let (status, backend) = lb.chat(i).await;
        assert_eq!((status, backend.as_str()), (200, url(&a).as_str()));
    }

    // A broken watch: inferlb watches again from where it was (no re-list) and keeps
    // following.
    kube.bookmark();
    kube.break_watches();
    kube.until_watches(watches + 1).await;
    kube.add_pod("vllm-c", APP, "127.0.0.1", c.addr.port());
    lb.until_serving(&[url(&a), url(&c)]).await;
    assert_eq!(
        kube.lists(),
        lists,
        "a broken watch resumes without a re-list"
    );

    // 410 Gone: an update the watch never announced is seen through the re-list.
    kube.set_ready_unannounced("vllm-a", false);
    kube.force_gone();
    kube.until_lists(lists + 1).await;
    lb.until_serving(&[url(&c)]).await;
    // And the new watch follows changes again.
    kube.set_ready("vllm-a", true);
    kube.delete_pod("vllm-c");
    lb.until_serving(&[url(&a)]).await;
    assert_eq!(
        d.served(),
        0,
        "a pod the selector does not match never serves"
    );
}

/// A watch broken for longer than the server keeps history: the watch that resumes from the
/// last seen resourceVersion is refused with `410` (in the shape `gone`), and keeps being
/// refused for that version. Only a new list shows that a pod joined and one left in the gap.
async fn relists_after_a_410_at_watch_start(gone: Gone, name: &str) {
    let kube = FakeKube::start("prod").await;
    kube.set_gone(gone);
    let (a, b, c) = (
        PodServer::start("127.0.0.1").await,
        PodServer::start("127.0.0.1").await,
        PodServer::start("127.0.0.1").await,
    );
    kube.add_pod("vllm-a", APP, "127.0.0.1", a.addr.port());
    kube.add_pod("vllm-b", APP, "127.0.0.1", b.addr.port());
    let lb = tokio::task::block_in_place(|| {
        start(
            &kube,
            name,
            "namespace = \"prod\"\nlabel_selector = \"app=vllm\"\nport = \"http\"",
            20,
        )
    });
    lb.until_serving(&[url(&a), url(&b)]).await;
    let (lists, watches) = (kube.lists(), kube.watches());
    assert_eq!(lists, 1);

    kube.outage(|gap| {
        gap.add_pod("vllm-c", APP, "127.0.0.1", c.addr.port());
        gap.delete_pod("vllm-b");
    });
    // The resumed watch is refused ...
    kube.until_watches(watches + 1).await;
    // ... and the re-list brings the pod that joined and drops the one that left.
    lb.until_serving(&[url(&a), url(&c)]).await;
    assert!(
        kube.lists() > lists,
        "served the gap's changes without a list"
    );
    for i in 0..10 {
        let (status, backend) = lb.chat(i).await;
        assert_eq!(status, 200);
        assert_ne!(backend, url(&b), "a deleted pod still serves");
    }
    // The watch started after the list follows changes again.
    kube.delete_pod("vllm-c");
    lb.until_serving(&[url(&a)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relists_after_a_410_status_answering_the_watch() {
    relists_after_a_410_at_watch_start(Gone::HttpStatus, "gone-status").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relists_after_a_410_error_event_opening_the_watch() {
    relists_after_a_410_at_watch_start(Gone::ErrorEvent, "gone-event").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follows_the_pods_an_inference_pool_selects_on_its_target_port() {
    let kube = FakeKube::start("prod").await;
    let ips: Vec<String> = (2..5).map(|x| format!("127.0.0.{x}")).collect();
    let (port, listeners) = fake_kube::same_port(&ips);
    let pods: Vec<PodServer> = listeners.into_iter().map(PodServer::serve).collect();
    kube.add_pool("llama", &[("pool", "llama")], port);
    // Container ports differ from the pool's target port: the pool's port wins.
    kube.add_pod("llama-0", &[("pool", "llama"), ("app", "vllm")], &ips[0], 1);
    kube.add_pod("llama-1", &[("pool", "llama")], &ips[1], 1);
    kube.add_pod("other", APP, &ips[2], 1);
    let lb = tokio::task::block_in_place(|| {
        start(
            &kube,
            "pool",
            "namespace = \"prod\"\ninference_pool = \"llama\"",
            20,
        )
    });
    lb.until_serving(&[url(&pods[0]), url(&pods[1])]).await;
    let v = lb.backends().await;
    assert!(
        v["backends"]
            .as_array()
            .unwrap()
            .iter()
            .all(|b| b["labels"]["inference_pool"] == "llama"),
        "{v}"
    );
    kube.delete_pod("llama-0");
    lb.until_serving(&[url(&pods[1])]).await;
    for i in 0..10 {
        assert_eq!(lb.chat(i).await, (200, url(&pods[1])));
    }
    assert_eq!(pods[2].served(), 0);
}

/// The `llm-d.ai/role` Pod label: a Pod labelled `prefill` joins with role prefill, an
/// unlabelled one as both, and one with another value is not an endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_role_label_gives_a_pod_its_role() {
    let kube = FakeKube::start("prod").await;
    let (a, b, c) = (
        PodServer::start("127.0.0.1").await,
        PodServer::start("127.0.0.1").await,
        PodServer::start("127.0.0.1").await,
    );
    kube.add_pod(
        "vllm-p",
        &[("app", "vllm"), ("llm-d.ai/role", "prefill")],
        "127.0.0.1",
        a.addr.port(),
    );
    kube.add_pod("vllm-any", APP, "127.0.0.1", b.addr.port());
    kube.add_pod(
        "vllm-odd",
        &[("app", "vllm"), ("llm-d.ai/role", "encode")],
        "127.0.0.1",
        c.addr.port(),
    );
    let lb = tokio::task::block_in_place(|| {
        start(
            &kube,
            "roles",
            "namespace = \"prod\"\nlabel_selector = \"app=vllm\"\nport = \"http\"",
            20,
        )
    });
    lb.until_serving(&[url(&a), url(&b)]).await;
    let v = lb.backends().await;
    let role = |pod: &str| {
        v["backends"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["labels"]["pod"] == pod)
            .map(|e| e["role"].clone())
    };
    assert_eq!(role("vllm-p"), Some("prefill".into()), "{v}");
    assert_eq!(role("vllm-any"), Some("both".into()), "{v}");
    assert_eq!(role("vllm-odd"), None, "{v}");
}
