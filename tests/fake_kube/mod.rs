//! A fake Kubernetes API server on 127.0.0.1: Pod list (paged with `limit`/`continue`) and
//! watch (newline-delimited ADDED/MODIFIED/DELETED/BOOKMARK/ERROR events from a
//! resourceVersion), and `InferencePool` get, the way the real API server answers them. The
//! test drives it through [`FakeKube`]: add pods, flip readiness, mark them terminating,
//! delete them, break the open watches, or force a `410 Gone`.
#![allow(dead_code, clippy::unwrap_used)]

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use bytes::Bytes;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

/// One open watch: its selector, whether it asked for bookmarks, and where its lines go.
struct Watcher {
    selector: Vec<(String, String)>,
    bookmarks: bool,
    tx: mpsc::UnboundedSender<Bytes>,
}

#[derive(Default)]
struct Inner {
    namespace: String,
    rv: u64,
    /// Watches from a resourceVersion below this get `410 Gone`.
    oldest: u64,
    pods: BTreeMap<String, Value>,
    /// (resourceVersion, event type, object) of every change, for watches that resume.
    history: Vec<(u64, &'static str, Value)>,
    pools: BTreeMap<String, Value>,
    watchers: Vec<Watcher>,
    /// Paged lists in progress: continue token → (resourceVersion, remaining items).
    pages: HashMap<u64, (u64, Vec<Value>)>,
    next_page: u64,
    /// How a watch from a compacted resourceVersion is refused.
    gone: Gone,
}

/// The two ways the real API server refuses a watch from a resourceVersion it compacted away.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Gone {
    /// `200 OK` whose first line is an `ERROR` event with a `410` Status (the watch cache's
    /// answer, the usual one).
    #[default]
    ErrorEvent,
    /// HTTP `410 Gone` with a Status body on the watch request itself (what a watch served from
    /// etcd directly answers).
    HttpStatus,
}

struct Shared {
    namespace: String,
    inner: Mutex<Inner>,
    /// Counts of list requests (first pages) and watch requests answered.
    lists: watch::Sender<u64>,
    watches: watch::Sender<u64>,
}

pub struct FakeKube {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn parse_selector(s: &str) -> Vec<(String, String)> {
    s.split(',')
        .filter(|t| !t.is_empty())
        .map(|t| {
            let (k, v) = t.split_once("==").or_else(|| t.split_once('=')).unwrap();
            (k.trim().to_owned(), v.trim().to_owned())
        })
        .collect()
}

fn matches(selector: &[(String, String)], obj: &Value) -> bool {
    selector
        .iter()
        .all(|(k, v)| obj["metadata"]["labels"][k].as_str() == Some(v.as_str()))
}

fn line(kind: &str, object: &Value) -> Bytes {
    let mut s = serde_json::to_vec(&json!({"type": kind, "object": object})).unwrap();
    s.push(b'\n');
    Bytes::from(s)
}

fn gone(rv: u64, oldest: u64) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": format!("too old resource version: {rv} ({oldest})"),
           "reason": "Expired", "code": 410})
}

impl Inner {
    fn pod(&self, name: &str, labels: &[(&str, &str)], ip: &str, port: u16) -> Value {
        let labels: serde_json::Map<String, Value> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect();
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": self.namespace, "labels": labels,
                         "uid": format!("uid-{name}")},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai",
                                     "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                       "conditions": [{"type": "Ready", "status": "True"}]}
        })
    }

    /// Record a change of `obj` (its resourceVersion set here) and send it to every watch.
    fn publish(&mut self, kind: &'static str, mut obj: Value) {
        self.rv += 1;
        obj["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        let name = obj["metadata"]["name"].as_str().unwrap().to_owned();
        if kind == "DELETED" {
            self.pods.remove(&name);
        } else {
            self.pods.insert(name, obj.clone());
        }
        let l = line(kind, &obj);
        self.watchers
            .retain(|w| !matches(&w.selector, &obj) || w.tx.send(l.clone()).is_ok());
        self.history.push((self.rv, kind, obj));
    }
}

impl FakeKube {
    pub async fn start(namespace: &str) -> FakeKube {
        let shared = Arc::new(Shared {
            namespace: namespace.to_owned(),
            inner: Mutex::new(Inner {
                namespace: namespace.to_owned(),
                rv: 100,
                ..Default::default()
            }),
            lists: watch::channel(0).0,
            watches: watch::channel(0).0,
        });
        let app = Router::new()
            .route("/api/v1/namespaces/{ns}/pods", get(pods))
            .route(
                "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/{name}",
                get(pool),
            )
            .fallback(|| async { not_found("no such resource") })
            .with_state(Arc::clone(&shared));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        FakeKube { addr, shared, task }
    }

    /// A kubeconfig pointing at this server (plain HTTP, no credentials), written to `dir`.
    pub fn kubeconfig(&self, dir: &std::path::Path) -> std::path::PathBuf {
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{}\n\
                 contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: nobody\n    namespace: {}\n\
                 current-context: fake\nusers:\n- name: nobody\n  user: {{}}\n",
                self.addr, self.shared.namespace
            ),
        )
        .unwrap();
        path
    }

    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        f(&mut self.shared.inner.lock().unwrap())
    }

    /// A Running, Ready pod `name` at `ip` with labels `labels` and one container whose port
    /// `http` is `port`.
    pub fn add_pod(&self, name: &str, labels: &[(&str, &str)], ip: &str, port: u16) {
        self.with(|i| {
            let pod = i.pod(name, labels, ip, port);
            i.publish("ADDED", pod);
        });
    }

    fn modify(&self, name: &str, f: impl FnOnce(&mut Value)) {
        self.with(|i| {
            let mut pod = i.pods.get(name).cloned().unwrap();
            f(&mut pod);
            i.publish("MODIFIED", pod);
        });
    }

    pub fn set_ready(&self, name: &str, ready: bool) {
        let status = if ready { "True" } else { "False" };
        self.modify(name, |p| {
            p["status"]["conditions"] = json!([{"type": "Ready", "status": status}]);
        });
    }

    /// What `kubectl delete` does first: the pod is terminating but still there (and Ready).
    pub fn set_terminating(&self, name: &str) {
        self.modify(name, |p| {
            p["metadata"]["deletionTimestamp"] = json!("2026-12-01T10:00:00Z");
        });
    }

    pub fn delete_pod(&self, name: &str) {
        self.with(|i| {
            let pod = i.pods.get(name).cloned().unwrap();
            i.publish("DELETED", pod);
        });
    }

    /// Change a pod without telling the open watches (as if their events were lost).
    pub fn set_ready_unannounced(&self, name: &str, ready: bool) {
        let status = if ready { "True" } else { "False" };
        self.with(|i| {
            let mut pod = i.pods.get(name).cloned().unwrap();
            pod["status"]["conditions"] = json!([{"type": "Ready", "status": status}]);
            i.rv += 1;
            pod["metadata"]["resourceVersion"] = json!(i.rv.to_string());
            i.pods.insert(name.to_owned(), pod.clone());
            i.history.push((i.rv, "MODIFIED", pod));
        });
    }

    /// Close every open watch stream (a network cut, an API server restart): clients resume
    /// from their last resourceVersion.
    pub fn break_watches(&self) {
        self.with(|i| i.watchers.clear());
    }

    /// Send `ERROR 410 Gone` on every open watch and close it, and forget the history: a
    /// client must re-list.
    pub fn force_gone(&self) {
        self.with(|i| {
            i.oldest = i.rv;
            let status = gone(i.rv.saturating_sub(1), i.oldest);
            for w in i.watchers.drain(..) {
                let _ = w.tx.send(line("ERROR", &status));
            }
            i.history.clear();
        });
    }

    /// How a watch from a compacted resourceVersion is refused from now on.
    pub fn set_gone(&self, shape: Gone) {
        self.with(|i| i.gone = shape);
    }

    /// A watch outage that outlives the history, in one step nobody can watch half of: every
    /// open watch is cut without a word, `during` changes the pods (no watch is told), and the
    /// history is compacted up to now. A client that resumes from the resourceVersion it last
    /// saw is refused with `410` (as [`Gone`] says) every time it tries, until it lists again.
    pub fn outage(&self, during: impl FnOnce(&mut Outage<'_>)) {
        self.with(|i| {
            i.watchers.clear();
            during(&mut Outage { inner: i });
            i.oldest = i.rv;
            i.history.clear();
        });
    }

    /// A BOOKMARK at the current resourceVersion to every watch that allowed bookmarks.
    pub fn bookmark(&self) {
        self.with(|i| {
            let obj = json!({"kind": "Pod", "apiVersion": "v1",
                             "metadata": {"resourceVersion": i.rv.to_string()}});
            let l = line("BOOKMARK", &obj);
            i.watchers
                .retain(|w| !w.bookmarks || w.tx.send(l.clone()).is_ok());
        });
    }

    pub fn add_pool(&self, name: &str, match_labels: &[(&str, &str)], port: u16) {
        let labels: serde_json::Map<String, Value> = match_labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), json!(v)))
            .collect();
        let pool = json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": self.shared.namespace,
                         "resourceVersion": "7", "uid": format!("uid-pool-{name}")},
            "spec": {"selector": {"matchLabels": labels},
                     "targetPorts": [{"number": port}],
                     "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}
        });
        self.with(|i| i.pools.insert(name.to_owned(), pool));
    }

    /// Number of list requests (first pages) answered so far.
    pub fn lists(&self) -> u64 {
        *self.shared.lists.borrow()
    }

    /// Wait (bounded) until `n` list requests in all were answered.
    pub async fn until_lists(&self, n: u64) {
        let mut rx = self.shared.lists.subscribe();
        tokio::time::timeout(std::time::Duration::from_secs(30), rx.wait_for(|c| *c >= n))
            .await
            .expect("no re-list in time")
            .unwrap();
    }

    /// Wait (bounded) until `n` watch requests in all were answered.
    pub async fn until_watches(&self, n: u64) {
        let mut rx = self.shared.watches.subscribe();
        tokio::time::timeout(std::time::Duration::from_secs(30), rx.wait_for(|c| *c >= n))
            .await
            .expect("no watch in time")
            .unwrap();
    }

    pub fn watches(&self) -> u64 {
        *self.shared.watches.borrow()
    }

    /// Open watch streams right now.
    pub fn open_watches(&self) -> usize {
        self.with(|i| {
            i.watchers.retain(|w| !w.tx.is_closed());
            i.watchers.len()
        })
    }
}

/// The pod changes of an [`FakeKube::outage`].
pub struct Outage<'a> {
    inner: &'a mut Inner,
}

impl Outage<'_> {
    pub fn add_pod(&mut self, name: &str, labels: &[(&str, &str)], ip: &str, port: u16) {
        let pod = self.inner.pod(name, labels, ip, port);
        self.inner.publish("ADDED", pod);
    }

    pub fn delete_pod(&mut self, name: &str) {
        let pod = self.inner.pods.get(name).cloned().unwrap();
        self.inner.publish("DELETED", pod);
    }
}

fn not_found(message: &str) -> Response {
    (
        StatusCode::NOT_FOUND,
        Json(
            json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": message, "reason": "NotFound", "code": 404}),
        ),
    )
        .into_response()
}

async fn pods(
    State(s): State<Arc<Shared>>,
    Path(ns): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if ns != s.namespace {
        return Json(json!({"kind": "PodList", "apiVersion": "v1",
                           "metadata": {"resourceVersion": "1"}, "items": []}))
        .into_response();
    }
    let selector = parse_selector(q.get("labelSelector").map_or("", String::as_str));
    if q.get("watch").map(String::as_str) == Some("true") {
        return watch_pods(&s, selector, &q);
    }
    let limit: usize = q
        .get("limit")
        .and_then(|l| l.parse().ok())
        .filter(|l| *l > 0)
        .unwrap_or(usize::MAX);
    let mut inner = s.inner.lock().unwrap();
    let (rv, mut items) = match q.get("continue").filter(|c| !c.is_empty()) {
        Some(token) => match token.parse().ok().and_then(|t| inner.pages.remove(&t)) {
            Some(page) => page,
            None => return (StatusCode::GONE, Json(gone(0, inner.oldest))).into_response(),
        },
        None => {
            s.lists.send_modify(|c| *c += 1);
            let items = inner
                .pods
                .values()
                .filter(|p| matches(&selector, p))
                .cloned()
                .collect();
            (inner.rv, items)
        }
    };
    let rest = if items.len() > limit {
        items.split_off(limit)
    } else {
        Vec::new()
    };
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if !rest.is_empty() {
        inner.next_page += 1;
        let token = inner.next_page;
        inner.pages.insert(token, (rv, rest));
        metadata["continue"] = json!(token.to_string());
    }
    // Items in a list carry no kind/apiVersion, like the real server's.
    for item in &mut items {
        if let Some(o) = item.as_object_mut() {
            o.remove("kind");
            o.remove("apiVersion");
        }
    }
    Json(json!({"kind": "PodList", "apiVersion": "v1", "metadata": metadata, "items": items}))
        .into_response()
}

fn watch_pods(
    s: &Arc<Shared>,
    selector: Vec<(String, String)>,
    q: &HashMap<String, String>,
) -> Response {
    s.watches.send_modify(|c| *c += 1);
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let bookmarks = q.get("allowWatchBookmarks").map(String::as_str) == Some("true");
    let (tx, mut rx) = mpsc::unbounded_channel::<Bytes>();
    {
        let mut inner = s.inner.lock().unwrap();
        if from < inner.oldest {
            let status = gone(from, inner.oldest);
            match inner.gone {
                // The watch cache answers 200 and sends the error as the first event.
                Gone::ErrorEvent => {
                    let _ = tx.send(line("ERROR", &status));
                }
                Gone::HttpStatus => {
                    return (StatusCode::GONE, Json(status)).into_response();
                }
            }
        } else {
            for (rv, kind, obj) in &inner.history {
                if *rv > from && matches(&selector, obj) {
                    let _ = tx.send(line(kind, obj));
                }
            }
            inner.watchers.push(Watcher {
                selector,
                bookmarks,
                tx,
            });
        }
    }
    let body = futures_util::stream::poll_fn(move |cx| {
        rx.poll_recv(cx).map(|l| l.map(Ok::<_, std::io::Error>))
    });
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from_stream(body))
        .unwrap()
}

async fn pool(State(s): State<Arc<Shared>>, Path((ns, name)): Path<(String, String)>) -> Response {
    let found = (ns == s.namespace)
        .then(|| s.inner.lock().unwrap().pools.get(&name).cloned())
        .flatten();
    match found {
        Some(p) => Json(p).into_response(),
        None => not_found(&format!("inferencepools \"{name}\" not found")),
    }
}

/// What a Pod serves: a vLLM-like `/metrics`, `/v1/models` (model `m`) and chat completions
/// answered with the serving address, on one listener. Counts the completions it answered.
pub struct PodServer {
    pub addr: SocketAddr,
    pub completions: Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for PodServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl PodServer {
    /// Serve on `listener` (bound by the caller to a 127.0.0.0/8 address).
    pub fn serve(listener: std::net::TcpListener) -> PodServer {
        listener.set_nonblocking(true).unwrap();
        let listener = TcpListener::from_std(listener).unwrap();
        let addr = listener.local_addr().unwrap();
        let completions = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let app = Router::new()
            .route(
                "/metrics",
                get(|| async {
                    "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0\n\
                     vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0\n\
                     vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0\n"
                }),
            )
            .route("/metrics/", get(StatusCode::NOT_FOUND))
            .route(
                "/v1/models",
                get(|| async {
                    Json(json!({"object": "list", "data": [{"id": "m", "object": "model"}]}))
                }),
            )
            .route(
                "/v1/chat/completions",
                axum::routing::post(
                    |State(n): State<Arc<std::sync::atomic::AtomicU64>>| async move {
                        n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        Json(json!({"object": "chat.completion", "choices": []}))
                    },
                ),
            )
            .with_state(Arc::clone(&completions));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        PodServer {
            addr,
            completions,
            task,
        }
    }

    pub async fn start(ip: &str) -> PodServer {
        Self::serve(std::net::TcpListener::bind((ip, 0)).unwrap())
    }

    pub fn served(&self) -> u64 {
        self.completions.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Bind `ips.len()` listeners, one per address, all on the same port (a fleet whose Pods all
/// listen on the pool's target port). Tries a few ports before giving up.
pub fn same_port(ips: &[String]) -> (u16, Vec<std::net::TcpListener>) {
    'port: for _ in 0..20 {
        let first = std::net::TcpListener::bind((ips[0].as_str(), 0)).unwrap();
        let port = first.local_addr().unwrap().port();
        let mut all = vec![first];
        for ip in &ips[1..] {
            match std::net::TcpListener::bind((ip.as_str(), port)) {
                Ok(l) => all.push(l),
                Err(_) => continue 'port,
            }
        }
        return (port, all);
    }
    panic!("no port free on all of {} addresses", ips.len());
}
