//! Test harness: the real router and small axum fake backends, all on 127.0.0.1 port 0.
//!
//! A [`FakeBackend`] serves `/v1/models`, a `/metrics` page whose values the test sets, and
//! completions that name the backend in their body; [`fleet`] starts several behind a router
//! and waits until all are healthy. [`sim`] starts `vllm-sim` simulators instead;
//! [`kv_events`] publishes KV-cache events for fakes; [`binary`] runs the real binary. Tests
//! wait on observable events (a scrape counter on a watch channel, a gate for streaming)
//! instead of sleeping.
#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use inferlb::config::{BackendConfig, Config, PluginSpec, ProfilePluginRef, ProfileSpec};
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch, Notify};

pub mod binary;
pub mod kv_events;
pub mod sim;

/// What a fake backend's `/metrics` reports.
#[derive(Debug, Clone)]
pub struct FakeMetrics {
    pub waiting: f64,
    pub running: f64,
    pub kv: f64,
    /// Non-200 makes the scrape fail.
    pub status: u16,
}

impl Default for FakeMetrics {
    fn default() -> Self {
        FakeMetrics {
            waiting: 0.0,
            running: 0.0,
            kv: 0.0,
            status: 200,
        }
    }
}

pub struct FakeState {
    pub name: String,
    pub models: Vec<String>,
    pub metrics: Mutex<FakeMetrics>,
    scrapes: watch::Sender<u64>,
    /// Streaming responses send their first chunk, then wait here before the rest.
    pub gate: Notify,
    pub hold_streams: std::sync::atomic::AtomicBool,
    pub last_headers: Mutex<Option<HeaderMap>>,
    /// The path and query of the last completion request.
    pub last_uri: Mutex<Option<String>>,
    pub last_body: Mutex<Option<Bytes>>,
    /// Every completion body received, in order, published once the body is stored (wait on
    /// it with [`FakeBackend::nth_body`]; `completions` counts a request before its body is
    /// kept, so reading `last_body` by that count could read the one before).
    pub bodies: watch::Sender<Vec<Bytes>>,
    pub completions: std::sync::atomic::AtomicU64,
    /// Status of completion answers (200 = normal).
    pub completion_status: std::sync::atomic::AtomicU16,
    /// Streams end after the first chunk, without `[DONE]`.
    pub cut_streams: std::sync::atomic::AtomicBool,
    /// Set when a stream's receiver went away before it finished (client disconnect).
    pub stream_abandoned: watch::Sender<bool>,
    /// While true, streams send nothing (not even their first chunk) after the response head:
    /// the request looks like one waiting for its prefill. Set it false to let them go.
    pub hold_first: watch::Sender<bool>,
    /// Streams send this many extra chunks, one every `drip_ms`, before `[DONE]`.
    pub drip_chunks: std::sync::atomic::AtomicU64,
    pub drip_ms: std::sync::atomic::AtomicU64,
    /// TLS fakes: the SNI name of the last handshake, and how many handshakes failed.
    pub sni: Mutex<Option<String>>,
    pub tls_failures: std::sync::atomic::AtomicU64,
    /// Requests that matched none of the routes above (any method, any path), and the last
    /// such path: a router that lets a client steer it elsewhere shows up here.
    pub stray: std::sync::atomic::AtomicU64,
    pub last_stray: Mutex<Option<String>>,
    /// `GET /kv_event_sources` answers this JSON (404 while unset), as vLLM with KV events does.
    pub kv_sources: Mutex<Option<String>>,
}

pub struct FakeBackend {
    pub addr: SocketAddr,
    pub state: Arc<FakeState>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    tls: bool,
}

fn fake_state(name: &str, models: &[&str]) -> Arc<FakeState> {
    let (scrapes, _) = watch::channel(0);
    Arc::new(FakeState {
        name: name.to_owned(),
        models: models.iter().map(|m| (*m).to_owned()).collect(),
        metrics: Mutex::new(FakeMetrics::default()),
        scrapes,
        gate: Notify::new(),
        hold_streams: false.into(),
        last_headers: Mutex::new(None),
        last_uri: Mutex::new(None),
        last_body: Mutex::new(None),
        bodies: watch::channel(Vec::new()).0,
        completions: 0.into(),
        completion_status: 200.into(),
        cut_streams: false.into(),
        stream_abandoned: watch::channel(false).0,
        hold_first: watch::channel(false).0,
        drip_chunks: 0.into(),
        drip_ms: 0.into(),
        sni: Mutex::new(None),
        tls_failures: 0.into(),
        stray: 0.into(),
        last_stray: Mutex::new(None),
        kv_sources: Mutex::new(None),
    })
}

fn fake_app(state: &Arc<FakeState>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        // The poller asks for vLLM's filtered page first; this backend, like an older vLLM,
        // has none (the poller falls back to `/metrics`).
        .route("/metrics/", get(StatusCode::NOT_FOUND))
        .route("/v1/models", get(list_models))
        .route("/kv_event_sources", get(kv_sources))
        .route("/v1/chat/completions", post(complete))
        .route("/v1/completions", post(complete))
        .route("/v1/embeddings", post(complete))
        .route("/v1/audio/transcriptions", post(complete))
        .fallback(stray)
        .with_state(Arc::clone(state))
}

impl FakeBackend {
    /// The `n`-th completion body this backend received (1-based), once it has: waits on the
    /// arrival itself, bounded at 60 s (a router that never sends it).
    pub async fn nth_body(&self, n: usize) -> Bytes {
        let mut rx = self.state.bodies.subscribe();
        let all = tokio::time::timeout(Duration::from_secs(60), rx.wait_for(|b| b.len() >= n))
            .await
            .unwrap_or_else(|_| panic!("{} never received completion {n}", self.state.name))
            .unwrap();
        all[n - 1].clone()
    }

    pub async fn start(name: &str, models: &[&str]) -> FakeBackend {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::serve(listener, name, models).await
    }

    async fn serve(listener: TcpListener, name: &str, models: &[&str]) -> FakeBackend {
        let addr = listener.local_addr().unwrap();
        let state = fake_state(name, models);
        let app = fake_app(&state);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
        FakeBackend {
            addr,
            state,
            stop: Some(stop),
            task: Some(task),
            tls: false,
        }
    }

    /// The same fake, served over TLS with `tls` on 127.0.0.1. The SNI name each handshake
    /// carried is kept in `state.sni`; failed handshakes are counted in `state.tls_failures`.
    pub async fn start_tls(
        name: &str,
        models: &[&str],
        tls: Arc<tokio_rustls::rustls::ServerConfig>,
    ) -> FakeBackend {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = fake_state(name, models);
        let app = fake_app(&state);
        let acceptor = tokio_rustls::TlsAcceptor::from(tls);
        let (stop, mut stopped) = oneshot::channel::<()>();
        let fake = Arc::clone(&state);
        let task = tokio::spawn(async move {
            loop {
                let (tcp, _) = tokio::select! {
                    accepted = listener.accept() => accepted.unwrap(),
                    _ = &mut stopped => return,
                };
                let (acceptor, app, fake) = (acceptor.clone(), app.clone(), Arc::clone(&fake));
                tokio::spawn(async move {
                    let stream = match acceptor.accept(tcp).await {
                        Ok(s) => s,
                        Err(_) => {
                            fake.tls_failures.fetch_add(1, Ordering::Relaxed);
                            return;
                        }
                    };
                    *fake.sni.lock().unwrap() = stream.get_ref().1.server_name().map(str::to_owned);
                    let service = hyper::service::service_fn(
                        move |req: hyper::Request<hyper::body::Incoming>| {
                            tower::ServiceExt::oneshot(app.clone(), req)
                        },
                    );
                    let _ = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
                });
            }
        });
        FakeBackend {
            addr,
            state,
            stop: Some(stop),
            task: Some(task),
            tls: true,
        }
    }

    /// `http://127.0.0.1:port`, or `https://localhost:port` for a TLS fake (a DNS name, so
    /// the router sends SNI).
    pub fn url(&self) -> String {
        if self.tls {
            format!("https://localhost:{}", self.addr.port())
        } else {
            format!("http://{}", self.addr)
        }
    }

    pub fn set_metrics(&self, f: impl FnOnce(&mut FakeMetrics)) {
        f(&mut self.state.metrics.lock().unwrap());
    }

    /// Wait until `n` more scrapes have been answered (bounded).
    pub async fn scrapes(&self, n: u64) {
        let mut rx = self.state.scrapes.subscribe();
        let target = *rx.borrow() + n;
        tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|c| *c >= target))
            .await
            .expect("scrapes did not happen in time")
            .unwrap();
    }

    /// Stop serving and close the port.
    pub async fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

async fn metrics(State(s): State<Arc<FakeState>>) -> Response {
    let m = s.metrics.lock().unwrap().clone();
    s.scrapes.send_modify(|c| *c += 1);
    if m.status != 200 {
        return StatusCode::from_u16(m.status).unwrap().into_response();
    }
    format!(
        "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {}\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {}\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {}\n\
         vllm:cache_config_info{{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"1000\"}} 1.0\n",
        m.waiting, m.running, m.kv
    )
    .into_response()
}

async fn stray(State(s): State<Arc<FakeState>>, uri: axum::http::Uri) -> Response {
    s.stray.fetch_add(1, Ordering::SeqCst);
    *s.last_stray.lock().unwrap() = Some(uri.to_string());
    StatusCode::NOT_FOUND.into_response()
}

async fn list_models(State(s): State<Arc<FakeState>>) -> Response {
    let data: Vec<_> = s
        .models
        .iter()
        .map(|m| serde_json::json!({"id": m, "object": "model", "owned_by": "vllm", "root": m}))
        .collect();
    Json(serde_json::json!({"object": "list", "data": data})).into_response()
}

async fn kv_sources(State(s): State<Arc<FakeState>>) -> Response {
    match s.kv_sources.lock().unwrap().clone() {
        Some(json) => ([("content-type", "application/json")], json).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn complete(
    State(s): State<Arc<FakeState>>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    s.completions.fetch_add(1, Ordering::Relaxed);
    *s.last_headers.lock().unwrap() = Some(headers);
    *s.last_uri.lock().unwrap() = uri.path_and_query().map(|pq| pq.to_string());
    let status = s.completion_status.load(Ordering::Relaxed);
    if status != 200 {
        return (
            StatusCode::from_u16(status).unwrap(),
            format!("{{\"error\":\"{}\"}}", s.name),
        )
            .into_response();
    }
    let stream = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("stream").and_then(|s| s.as_bool()))
        .unwrap_or(false);
    *s.last_body.lock().unwrap() = Some(body.clone());
    s.bodies.send_modify(|all| all.push(body.clone()));
    if !stream {
        return Json(serde_json::json!({"object": "chat.completion", "served_by": s.name}))
            .into_response();
    }
    let state = Arc::clone(&s);
    let chunks = async_stream(state);
    (
        [("content-type", "text/event-stream")],
        axum::body::Body::from_stream(chunks),
    )
        .into_response()
}

fn async_stream(
    s: Arc<FakeState>,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    tokio::spawn(async move {
        let mut first = s.hold_first.subscribe();
        tokio::select! {
            _ = first.wait_for(|held| !held) => {}
            _ = tx.closed() => return,
        }
        let _ = tx
            .send(Ok(Bytes::from(format!(
                "data: {{\"first\":\"{}\"}}\n\n",
                s.name
            ))))
            .await;
        if s.cut_streams.load(Ordering::Relaxed) {
            return;
        }
        if s.hold_streams.load(Ordering::Relaxed) {
            tokio::select! {
                _ = s.gate.notified() => {}
                _ = tx.closed() => {
                    s.stream_abandoned.send_replace(true);
                    return;
                }
            }
        }
        let drip = Duration::from_millis(s.drip_ms.load(Ordering::Relaxed));
        for i in 0..s.drip_chunks.load(Ordering::Relaxed) {
            tokio::time::sleep(drip).await;
            let chunk = format!("data: {{\"drip\":{i}}}\n\n");
            if tx.send(Ok(Bytes::from(chunk))).await.is_err() {
                return;
            }
        }
        let _ = tx
            .send(Ok(Bytes::from_static(b"data: {\"second\":true}\n\n")))
            .await;
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
    });
    futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
}

/// A running router.
pub struct TestRouter {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    pub task: tokio::task::JoinHandle<Result<(), inferlb::RunError>>,
}

impl TestRouter {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// The stop switch and the task, for tests that drive the drain themselves.
    pub fn into_parts(mut self) -> RouterParts {
        RouterParts {
            stop: self.stop.take().unwrap(),
            task: self.task,
        }
    }

    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(10), &mut self.task).await;
    }
}

pub struct RouterParts {
    pub stop: oneshot::Sender<()>,
    pub task: tokio::task::JoinHandle<Result<(), inferlb::RunError>>,
}

/// A config for tests: fast polling, given backends.
pub fn config(backends: &[&FakeBackend]) -> Config {
    let mut c = config_for(backends.iter().map(|b| b.url()));
    c.poller.stale_after_ms = 5_000;
    c
}

/// The default config with 20 ms polling and the backends at `urls`.
pub fn config_for(urls: impl IntoIterator<Item = String>) -> Config {
    let mut c = Config::default();
    c.poller.interval_ms = 20;
    c.backends = urls.into_iter().map(BackendConfig::from_url).collect();
    c
}

/// One fake backend per name in `names`, each serving model `m`.
pub async fn fakes(names: &[&str]) -> Vec<FakeBackend> {
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        out.push(FakeBackend::start(name, &["m"]).await);
    }
    out
}

/// [`fakes`] named `names` behind a router started with their [`config`] as `configure`
/// leaves it, once the router sees every one of them healthy.
pub async fn fleet(
    names: &[&str],
    configure: impl FnOnce(&mut Config),
) -> (Vec<FakeBackend>, TestRouter) {
    let fakes = fakes(names).await;
    let mut cfg = config(&fakes.iter().collect::<Vec<_>>());
    configure(&mut cfg);
    let router = start_router(cfg).await;
    until_all_healthy(&router).await;
    (fakes, router)
}

pub async fn start_router(config: Config) -> TestRouter {
    let main = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = main.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(inferlb::run(
        config,
        inferlb::Listeners { main, admin: None },
        async {
            let _ = stopped.await;
        },
    ));
    TestRouter {
        addr,
        stop: Some(stop),
        task,
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

/// POST a chat request; returns (status, backend header, body json).
pub async fn chat(
    router: &TestRouter,
    model: &str,
    content: &str,
) -> (u16, Option<String>, serde_json::Value) {
    let body =
        serde_json::json!({"model": model, "messages": [{"role": "user", "content": content}]});
    let resp = post_chat(router, &body).await;
    let status = resp.status().as_u16();
    let backend = resp
        .headers()
        .get("x-inferlb-backend")
        .map(|v| v.to_str().unwrap().to_owned());
    let json = resp.json().await.unwrap_or(serde_json::Value::Null);
    (status, backend, json)
}

/// Wait until the router's admin view satisfies `pred`, re-checking after each scrape of
/// `watch` (the poller's own rhythm), for at most 200 scrapes.
pub async fn until_backends(
    router: &TestRouter,
    watch: &FakeBackend,
    pred: impl Fn(&serde_json::Value) -> bool,
) {
    for _ in 0..200 {
        let v = admin_view(router).await;
        if pred(&v) {
            return;
        }
        watch.scrapes(1).await;
    }
    panic!("the router never reached the expected backend state");
}

pub fn stream_body() -> serde_json::Value {
    serde_json::json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]})
}

/// POST a streaming chat request through `router`.
pub async fn open_stream(router: &TestRouter) -> reqwest::Response {
    post_chat(router, &stream_body()).await
}

/// POST `body` to the router's `/v1/chat/completions`; the response.
pub async fn post_chat(router: &TestRouter, body: &serde_json::Value) -> reqwest::Response {
    client()
        .post(router.url("/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap()
}

/// The backend that answered `resp`: its `x-inferlb-backend` header.
pub fn backend_of(resp: &reqwest::Response) -> String {
    resp.headers()["x-inferlb-backend"]
        .to_str()
        .unwrap()
        .to_owned()
}

/// The router's `/metrics` page.
pub async fn metrics_text(router: &TestRouter) -> String {
    metrics_at(&router.addr.to_string()).await
}

/// The `/metrics` page of the router listening on `addr` (host:port).
pub async fn metrics_at(addr: &str) -> String {
    let resp = client()
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .unwrap();
    resp.text().await.unwrap()
}

/// The router's `/admin/backends` answer.
pub async fn admin_view(router: &TestRouter) -> serde_json::Value {
    admin_at(&router.addr.to_string()).await
}

/// The `/admin/backends` answer of the router listening on `addr` (host:port).
pub async fn admin_at(addr: &str) -> serde_json::Value {
    get_json(&format!("http://{addr}/admin/backends")).await
}

/// Sends `req`; the answer's body as JSON (whatever its status).
pub async fn json_of(req: reqwest::RequestBuilder) -> serde_json::Value {
    req.send().await.unwrap().json().await.unwrap()
}

/// `GET url`; the answer's body as JSON.
pub async fn get_json(url: &str) -> serde_json::Value {
    json_of(client().get(url)).await
}

/// `POST url` with the JSON `body`; the answer's body as JSON.
pub async fn post_json(url: &str, body: &serde_json::Value) -> serde_json::Value {
    json_of(client().post(url).json(body)).await
}

/// `healthy` of the backend at `url` in an `/admin/backends` answer.
pub fn healthy(v: &serde_json::Value, url: &str) -> bool {
    v["backends"]
        .as_array()
        .unwrap()
        .iter()
        .any(|b| b["url"] == url && b["healthy"] == true)
}

/// Wait until every backend in the router's admin view is healthy ([`until_backends_json`]).
pub async fn until_all_healthy(router: &TestRouter) {
    until_backends_json(router, |v| {
        v["backends"]
            .as_array()
            .is_some_and(|l| l.iter().all(|b| b["healthy"] == true))
    })
    .await;
}

/// Wait until the router's admin view satisfies `pred`, re-reading it after each of the
/// router's own poll intervals (20 ms in tests), for at most 30 s (a loaded 2-core CI machine).
pub async fn until_backends_json(router: &TestRouter, pred: impl Fn(&serde_json::Value) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    loop {
        let v = admin_view(router).await;
        if pred(&v) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the router never reached the expected state: {v}"
        );
        tick.tick().await;
    }
}

/// Wait until the router sees some backend unhealthy.
pub async fn until_any_unhealthy(router: &TestRouter) {
    until_backends_json(router, |v| {
        v["backends"]
            .as_array()
            .is_some_and(|l| l.iter().any(|b| b["healthy"] == false))
    })
    .await;
}

/// The sample `name{label="value"}` on the router's `/metrics` (0 when absent).
pub async fn labelled_sample(router: &TestRouter, name: &str, label: &str, value: &str) -> f64 {
    sample_of(router, &format!("{name}{{{label}=\"{value}\"}}")).await
}

/// The unlabelled sample `name` on the router's `/metrics` (0 when absent).
pub async fn sample(router: &TestRouter, name: &str) -> f64 {
    sample_of(router, name).await
}

/// The value on the `/metrics` line that starts with `series` and a space (0 when absent).
async fn sample_of(router: &TestRouter, series: &str) -> f64 {
    metrics_text(router)
        .await
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// A profile of `scorers` (type, weight) and the max-score picker.
pub fn profile(cfg: &mut Config, scorers: &[(&str, f64)]) {
    let mut refs = Vec::new();
    for (kind, weight) in scorers {
        cfg.plugins.push(PluginSpec {
            kind: (*kind).into(),
            name: None,
            parameters: toml::Table::new(),
        });
        refs.push(ProfilePluginRef {
            plugin_ref: (*kind).into(),
            weight: Some(*weight),
        });
    }
    cfg.plugins.push(PluginSpec {
        kind: "max-score-picker".into(),
        name: None,
        parameters: toml::Table::new(),
    });
    refs.push(ProfilePluginRef {
        plugin_ref: "max-score-picker".into(),
        weight: None,
    });
    cfg.scheduling_profiles = vec![ProfileSpec {
        name: "p".into(),
        plugins: refs,
    }];
}
