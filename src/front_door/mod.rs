//! The front door: axum routes for the OpenAI API, health, readiness, metrics and admin.
//!
//! A proxied request is read once (bounded by `max_body_bytes`), parsed once into a
//! [`RequestView`], and handed with its original bytes to the scheduling service stack.
//! Every failure on the way is a typed [`Error`], turned into OpenAI's error JSON by
//! `error.rs` — including axum's own 404 and 405.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use metrics_exporter_prometheus::PrometheusHandle;
use tower::ServiceExt;

pub mod access;
pub mod auth;
mod drain;
pub mod responses;
pub mod serve;
pub mod status;

use crate::endpoints::passive::Status;
use crate::endpoints::Pool;
use crate::error::Error;
use crate::forward::{Forwarder, ProxyRequest};
use crate::prompt::{Operation, RequestView};
use crate::scheduling::priority::{class_of, ClassRule};
use crate::scheduling::profile::decisions::{self, DecisionLog, RequestTrace};
use crate::scheduling::SchedulerService;
use crate::telemetry as t;

/// The settings the front door reads per request: its own sections (`[server]`, `[admin]`)
/// and the request-shaping keys of the file, taken from the configuration by its composer
/// (`crate::config`), so that this module never names the whole file's type.
#[derive(Debug, Clone, Default)]
pub struct Settings {
    pub server: serve::ServerConfig,
    pub admin: status::AdminConfig,
    pub max_body_bytes: usize,
    pub max_messages: usize,
    /// `session_header`, parsed once (`None` only in a default-built value): a `&str` name is
    /// parsed again on every lookup.
    pub session_header: Option<header::HeaderName>,
    pub session_from_user: bool,
    pub priority: crate::scheduling::priority::PriorityConfig,
    /// `priority.header`, parsed once.
    pub priority_header: Option<header::HeaderName>,
    /// `forward.allow_client_kv_transfer_params`.
    pub allow_client_kv_transfer_params: bool,
}

/// Everything a handler needs; shared by all requests.
pub struct AppState {
    /// The settings in effect; swapped by a config reload.
    pub config: ArcSwap<Settings>,
    pub pool: Arc<Pool>,
    pub service: SchedulerService<Forwarder>,
    pub metrics: Option<PrometheusHandle>,
    pub backend_header: header::HeaderName,
    /// Keys and per-client limits; swapped by a config reload.
    pub auth: Arc<ArcSwap<auth::Auth>>,
    /// Recent scheduling decisions (`/admin/decisions`, the status page).
    pub decisions: Arc<DecisionLog>,
    /// Model → Hugging Face tokenizer (loaded at start-up; empty when none is configured).
    pub tokenizers: Arc<crate::tokenization::Tokenizers>,
    /// Which backend holds which response (the Responses API's affinity).
    pub responses: Arc<crate::responses::Lookup>,
}

/// Request header asking for the decision summary (`1`); honoured with `admin.explain` or
/// with the admin token in [`ADMIN_TOKEN_HEADER`].
pub const EXPLAIN_HEADER: header::HeaderName = header::HeaderName::from_static("x-inferlb-explain");
pub const ADMIN_TOKEN_HEADER: header::HeaderName =
    header::HeaderName::from_static("x-inferlb-admin-token");
/// Response header carrying the summary of the request's last scheduling decision.
pub const DECISION_HEADER: &str = "x-inferlb-decision";
/// The prefix of every header name the router reads for itself.
const OUR_PREFIX: &str = "x-inferlb-";

/// Routes of the OpenAI-compatible listener. When `with_admin` is set, `/metrics` and
/// `/admin/*` are served here too (no separate admin listener configured).
pub fn router(state: Arc<AppState>, with_admin: bool) -> Router {
    let openai = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/responses", post(responses_create))
        // vLLM's own routes under /v1/responses/ that name no response.
        .route("/v1/responses/compact", post(other))
        .route("/v1/responses/render", post(other))
        // Any method on one response (GET, cancel, and what vLLM may add): to its holder.
        .route("/v1/responses/{id}", any(response_by_id))
        .route("/v1/responses/{id}/{*rest}", any(response_by_id))
        .route("/v1/{*rest}", post(other))
        .route_layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state.auth),
            auth::client_gate,
        ));
    let mut router = openai
        .route("/health", get(health))
        .route("/ready", get(ready));
    if with_admin {
        router = router.merge(admin_routes(&state));
    }
    router
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// What a listener serves. On the OpenAI listener the two hot routes, `POST
/// /v1/chat/completions` and `POST /v1/completions`, go straight to the proxy through the
/// same client gate as the router's OpenAI routes, without the router's tree, layers and
/// extractors; everything else (other methods on those paths included) goes to the router.
#[derive(Clone)]
pub struct Routes {
    router: Router,
    hot: Option<Arc<AppState>>,
}

impl From<Router> for Routes {
    /// A listener served by `router` alone.
    fn from(router: Router) -> Self {
        Routes { router, hot: None }
    }
}

impl Routes {
    /// The OpenAI listener: [`router`] with the hot routes taken before it.
    pub fn openai(state: Arc<AppState>, with_admin: bool) -> Self {
        Routes {
            router: router(Arc::clone(&state), with_admin),
            hot: Some(state),
        }
    }

    /// Serve one request from `peer`. The router's routes find the peer as axum's
    /// `ConnectInfo` extension; the hot routes get it (and the client's tenant) as arguments.
    pub async fn call(
        &self,
        mut req: http::Request<hyper::body::Incoming>,
        peer: SocketAddr,
    ) -> Response {
        if let Some(app) = &self.hot {
            let operation = match (req.method() == Method::POST, req.uri().path()) {
                (true, "/v1/chat/completions") => Some(Operation::ChatCompletions),
                (true, "/v1/completions") => Some(Operation::Completions),
                _ => None,
            };
            if let Some(operation) = operation {
                let req = req.map(Body::new);
                // Boxed: every future nested by value is copied into the one awaiting it, and
                // this one is the largest on the path (two more layers wrap it here).
                let proxied =
                    |req, tenant| Box::pin(proxy_as(Arc::clone(app), operation, req, Some(tenant)));
                return auth::gate(&app.auth, req, Some(peer), proxied).await;
            }
        }
        req.extensions_mut().insert(ConnectInfo(peer));
        self.router
            .clone()
            .oneshot(req)
            .await
            .unwrap_or_else(|e| match e {})
    }
}

/// Routes of the admin listener.
pub fn admin_router(state: Arc<AppState>) -> Router {
    admin_routes(&state)
        .route("/health", get(health))
        .route("/ready", get(ready))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

fn admin_routes(state: &AppState) -> Router<Arc<AppState>> {
    Router::new()
        .route("/metrics", get(prometheus))
        .route("/admin/backends", get(backends))
        .route("/admin/decisions", get(status::decisions))
        .route_layer(axum::middleware::from_fn_with_state(
            Arc::clone(&state.auth),
            auth::admin_gate,
        ))
        // The page holds no data (its script fetches the routes above with the token).
        .route("/admin", get(status::page))
}

async fn chat(State(app): State<Arc<AppState>>, req: Request) -> Response {
    proxy(app, Operation::ChatCompletions, req).await
}

async fn completions(State(app): State<Arc<AppState>>, req: Request) -> Response {
    proxy(app, Operation::Completions, req).await
}

async fn other(State(app): State<Arc<AppState>>, req: Request) -> Response {
    proxy(app, Operation::Other, req).await
}

async fn responses_create(State(app): State<Arc<AppState>>, req: Request) -> Response {
    proxy(app, Operation::Responses, req).await
}

/// `/v1/responses/{id}…`: routed as any other call, pinned to the response's holder.
async fn response_by_id(State(app): State<Arc<AppState>>, mut req: Request) -> Response {
    req.extensions_mut().insert(responses::ById);
    proxy(app, Operation::Other, req).await
}

/// May this request have its decision explained? Takes the explain and admin-token headers
/// off the request (they are for the router, not the backend).
fn explain_allowed(app: &AppState, headers: &mut HeaderMap) -> bool {
    // Both names start `x-inferlb-`: one pass over the request's few names finds whether
    // either can be present, where a removal hashes its name and probes even when absent.
    if !headers
        .keys()
        .any(|name| name.as_str().starts_with(OUR_PREFIX))
    {
        return false;
    }
    let asked = headers
        .remove(EXPLAIN_HEADER)
        .is_some_and(|v| v.as_bytes() == b"1");
    let token = headers.remove(ADMIN_TOKEN_HEADER);
    asked
        && (app.config.load().admin.explain
            || token.is_some_and(|t| app.auth.load().is_admin_token(t.as_bytes())))
}

/// What `forward` learnt that the access log reports.
#[derive(Default)]
struct Facts {
    request_id: Option<HeaderValue>,
    prompt_bytes: usize,
}

/// Counts every client request exactly once, with its final status; adds the explain header
/// and the access-log line when wanted.
async fn proxy(app: Arc<AppState>, operation: Operation, req: Request) -> Response {
    proxy_as(app, operation, req, None).await
}

/// [`proxy`] for a client the gate identified as `tenant` (`None`: read the [`auth::Tenant`]
/// extension the router's gate put on the request).
async fn proxy_as(
    app: Arc<AppState>,
    operation: Operation,
    mut req: Request,
    tenant: Option<auth::Tenant>,
) -> Response {
    let received_at = Instant::now();
    let explain = explain_allowed(&app, req.headers_mut());
    let log = access::enabled();
    let trace = (explain || log).then(|| RequestTrace::new(explain));
    // Filled only with a model some backend lists, so client-chosen names never become labels.
    let mut model: Option<String> = None;
    let mut facts = Facts::default();
    let forwarding = forward(
        &app,
        operation,
        req,
        tenant,
        received_at,
        &mut model,
        &mut facts,
    );
    let result = match &trace {
        Some(trace) => decisions::scope(Arc::clone(trace), forwarding).await,
        None => forwarding.await,
    };
    let model = model.unwrap_or_else(|| t::OTHER_MODEL.into());
    let Some(trace) = trace else {
        return count(&app, result, &model).0;
    };
    let (mut response, backend) = count(&app, result, &model);
    if explain {
        let summary = match trace.last_decision() {
            Some(record) => decisions::summary(&record, trace.picks(), trace.pd().as_ref(), 4096),
            None => "none (no scheduling decision was made for this request)".to_owned(),
        };
        if let Ok(value) = HeaderValue::from_str(&summary) {
            response.headers_mut().insert(DECISION_HEADER, value);
        }
    }
    if !log {
        return response;
    }
    let entry = access::Entry {
        request_id: facts.request_id,
        model,
        backend,
        status: response.status().as_u16(),
        attempts: trace.picks(),
        prompt_bytes: facts.prompt_bytes,
        prefix_matched: trace.prefix(),
        pd: trace.pd(),
    };
    access::log_at_end(response, entry, received_at)
}

/// Count the request and give back its response with the backend header's value (`None`
/// when no backend answered), which the access log reports without looking it up again.
fn count(
    app: &AppState,
    result: Result<Response, Error>,
    model: &str,
) -> (Response, Option<HeaderValue>) {
    match result {
        Ok(response) => {
            let backend = response.headers().get(&app.backend_header).cloned();
            let label = backend
                .as_ref()
                .and_then(|v| v.to_str().ok())
                .unwrap_or("none");
            t::handles::requests_total(label, model, response.status()).increment(1);
            (response, backend)
        }
        Err(err) => {
            let status = err.parts().0;
            t::handles::requests_total("none", model, status).increment(1);
            if status.is_server_error() {
                tracing::warn!(error = %err, "request failed");
            } else {
                tracing::debug!(error = %err, "request rejected");
            }
            (err.into_response(), None)
        }
    }
}

async fn forward(
    app: &AppState,
    operation: Operation,
    req: Request,
    tenant: Option<auth::Tenant>,
    received_at: Instant,
    model_label: &mut Option<String>,
    facts: &mut Facts,
) -> Result<Response, Error> {
    let (mut parts, body) = req.into_parts();
    let config = app.config.load();
    let server = &config.server;
    let body = timed_if_waiting(
        std::time::Duration::from_millis(server.body_read_timeout_ms),
        read_body(body, &parts.headers, config.max_body_bytes),
    )
    .await
    .map_err(|_| Error::BodyTimeout(server.body_read_timeout_ms))??;
    // Multipart form data (audio) on the other /v1/* routes: not JSON, forwarded as it came.
    let form_boundary = match operation {
        Operation::Other => crate::prompt::multipart::boundary(
            parts
                .headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok()),
        )?,
        _ => None,
    };
    if form_boundary.is_none() && crate::prompt::deeper_than(&body, server.max_json_depth) {
        return Err(Error::InvalidRequest(format!(
            "JSON nesting is deeper than the limit of {}",
            server.max_json_depth
        )));
    }
    let limits = crate::prompt::ParseLimits {
        max_messages: config.max_messages,
    };
    let mut view = match form_boundary {
        Some(boundary) => RequestView::multipart(&body, boundary),
        None => RequestView::parse_with(operation, &body, &limits)?,
    };
    // The prompt stage's second half: token ids, for models with a tokenizer (the body limit
    // bounds the work; a model without one costs a map lookup), and only while some backend's
    // KV-event stream is live (nothing else reads them).
    if form_boundary.is_none() {
        app.tokenizers.fill_if(&mut view, &body, || {
            crate::kv_events::any_live(&app.pool.backends(), crate::clock::now_ms())
        });
    }
    let tenant = tenant.or_else(|| parts.extensions.get::<auth::Tenant>().copied());
    tag(&config, &mut parts, tenant, &mut view);
    let request_id = parts
        .headers
        .get(crate::forward::headers::REQUEST_ID)
        .filter(|v| !v.is_empty() && v.len() <= 128)
        .cloned()
        .unwrap_or_else(new_request_id);
    let path_and_query = parts
        .uri
        .path_and_query()
        .cloned()
        .ok_or_else(|| Error::InvalidRequest("the request names no path".into()))?;
    if has_dot_segment(parts.uri.path()) {
        return Err(Error::InvalidRequest(
            "the path must not contain `.` or `..` segments, encoded slashes or backslashes".into(),
        ));
    }
    // The Responses API's calls naming a response go to its holder.
    let by_id = match parts.extensions.get::<responses::ById>() {
        Some(_) => Some(responses::id_in_path(parts.uri.path())?),
        None => None,
    };
    if let Some(id) = responses::named(operation, by_id, &view) {
        // Boxed: only Responses API calls take this path, and its future is large.
        Box::pin(responses::pin(app, &id, &parts.headers, &mut view)).await?;
    }
    facts.request_id = Some(request_id.clone());
    facts.prompt_bytes = view.routing_text.as_ref().map_or(0, String::len);
    // Only a model some backend lists may become a label; anything else is `other`.
    *model_label = view.model.clone().filter(|m| app.pool.lists_model(m));
    let body = crate::forward::kv_params::client_body(
        body,
        view.kv_transfer_params,
        config.allow_client_kv_transfer_params,
    )?;
    let request = ProxyRequest {
        method: parts.method,
        path_and_query,
        headers: parts.headers,
        body,
        view: Arc::new(view),
        request_id,
        received_at,
    };
    let response = app.service.send(request).await?;
    Ok(match operation {
        Operation::Responses => responses::learn(app, response),
        _ => response,
    })
}

/// Fill in the view's session key, tenant and priority class from the headers and the auth
/// gate's [`auth::Tenant`]; the priority header is for the router and is taken off.
fn tag(
    config: &Settings,
    parts: &mut http::request::Parts,
    tenant: Option<auth::Tenant>,
    view: &mut RequestView,
) {
    let header = config
        .session_header
        .as_ref()
        .and_then(|name| parts.headers.get(name))
        .filter(|v| !v.is_empty())
        .map(|v| xxhash_rust::xxh3::xxh3_64(v.as_bytes()));
    view.session = if config.session_from_user {
        view.user.or(header)
    } else {
        header
    };
    view.tenant = tenant.map_or(0, |t| t.id);
    let rule = tenant
        .and_then(|t| t.classes)
        .unwrap_or_else(|| ClassRule::global(&config.priority));
    let asked = config
        .priority_header
        .as_ref()
        .and_then(|name| parts.headers.remove(name));
    view.priority = class_of(&config.priority, asked.as_ref(), rule);
}

/// `.` or `..` path segments, raw or percent-encoded: a backend that normalises them could be
/// steered to a path outside `/v1/`. Also backslashes and encoded slashes or backslashes.
/// Allocation-free: it runs on every proxied request.
fn has_dot_segment(path: &str) -> bool {
    /// A segment that decodes to one or two dots (`%2e` and `%2E` count as a dot).
    fn dots_only(mut seg: &[u8]) -> bool {
        let mut dots = 0;
        while !seg.is_empty() {
            if seg[0] == b'.' {
                seg = &seg[1..];
            } else if seg.len() >= 3 && seg[0] == b'%' && seg[1] == b'2' && seg[2] | 0x20 == b'e' {
                seg = &seg[3..];
            } else {
                return false;
            }
            dots += 1;
        }
        dots == 1 || dots == 2
    }
    let bytes = path.as_bytes();
    // The common path has none of the three bytes any finding needs: one vectorised scan.
    if memchr::memchr3(b'.', b'%', b'\\', bytes).is_none() {
        return false;
    }
    let encoded_slash = bytes.windows(3).any(|w| {
        w[0] == b'%'
            && ((w[1] == b'2' && w[2] | 0x20 == b'f') || (w[1] == b'5' && w[2] | 0x20 == b'c'))
    });
    encoded_slash || bytes.contains(&b'\\') || bytes.split(|b| *b == b'/').any(dots_only)
}

fn new_request_id() -> HeaderValue {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut id = [0u8; 32];
    // Two hex digits per random byte (a nibble at a time cost a 128-bit shift per digit).
    let n = fastrand::u128(..).to_be_bytes();
    for (pair, byte) in id.chunks_exact_mut(2).zip(n) {
        pair[0] = HEX[usize::from(byte >> 4)];
        pair[1] = HEX[usize::from(byte & 0xf)];
    }
    HeaderValue::from_bytes(&id).unwrap_or_else(|_| HeaderValue::from_static("0"))
}

/// `work` within `limit`, the clock started only if it cannot finish at once: a request body
/// that came with its head (nearly every one) is read without making a timer (a clock read,
/// the runtime handle's clone and the timer's setup and drop, ~200 instructions a request).
/// The limit then counts from the first wait, microseconds later than from the call.
async fn timed_if_waiting<F: std::future::Future>(
    limit: std::time::Duration,
    work: F,
) -> Result<F::Output, tokio::time::error::Elapsed> {
    let mut work = std::pin::pin!(work);
    let first = std::future::poll_fn(|cx| {
        std::task::Poll::Ready(std::future::Future::poll(work.as_mut(), cx))
    })
    .await;
    match first {
        std::task::Poll::Ready(out) => Ok(out),
        std::task::Poll::Pending => tokio::time::timeout(limit, work).await,
    }
}

/// Read the whole body, refusing early on `Content-Length` and enforcing the limit while reading.
async fn read_body(body: Body, headers: &HeaderMap, limit: usize) -> Result<Bytes, Error> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(Error::BodyTooLarge { limit });
    }
    let failed = |e: axum::BoxError| {
        if e.downcast_ref::<LengthLimitError>().is_some() {
            Error::BodyTooLarge { limit }
        } else {
            Error::BodyRead(e.to_string())
        }
    };
    // A body in one frame (the usual case: it came with the head) is kept as it is; only a
    // body in several frames is copied together. `collect().to_bytes()` does the same, but
    // its buffer list cost ~1.7k more instructions per request (bench/instr_per_request.sh:
    // 75.4k against 77.1k, same run).
    let mut body = Limited::new(body, limit);
    let mut first = Bytes::new();
    let mut joined: Option<bytes::BytesMut> = None;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(failed)?.into_data() else {
            continue; // trailers
        };
        match &mut joined {
            Some(all) => all.extend_from_slice(&data),
            None if first.is_empty() => first = data,
            None => {
                let mut all =
                    bytes::BytesMut::with_capacity(first.len().saturating_add(data.len()));
                all.extend_from_slice(&first);
                all.extend_from_slice(&data);
                joined = Some(all);
            }
        }
    }
    Ok(joined.map_or(first, bytes::BytesMut::freeze))
}

/// `GET /v1/models`: the union of the models of healthy backends, de-duplicated by id.
async fn models(State(app): State<Arc<AppState>>) -> Response {
    let mut seen = std::collections::HashSet::new();
    let mut data = Vec::new();
    for backend in app.pool.backends().iter() {
        let state = backend.state();
        if !state.healthy {
            continue;
        }
        for model in state.models.iter() {
            if seen.insert(model.id.clone()) {
                data.push(model.object.clone());
            }
        }
    }
    Json(serde_json::json!({"object": "list", "data": data})).into_response()
}

async fn health() -> Response {
    (StatusCode::OK, "ok").into_response()
}

/// 200 while at least one backend is healthy.
async fn ready(State(app): State<Arc<AppState>>) -> Response {
    if app.pool.any_healthy() {
        (StatusCode::OK, "ready").into_response()
    } else {
        Error::NoHealthyBackend("(any)".into()).into_response()
    }
}

async fn prometheus(State(app): State<Arc<AppState>>) -> Response {
    app.pool.count_states();
    crate::kv_events::subscriber::count_streams(&app.pool);
    app.service.refresh_metrics();
    metrics::gauge!(t::RESPONSES_IDS).set(app.responses.directory.len() as f64);
    match &app.metrics {
        Some(handle) => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            handle.render(),
        )
            .into_response(),
        None => {
            Error::Internal("the metrics recorder could not be installed".into()).into_response()
        }
    }
}

/// `GET /admin/backends`: what the router believes about each backend right now.
async fn backends(State(app): State<Arc<AppState>>) -> Response {
    let now = Instant::now();
    let clock = tokio::time::Instant::now();
    let list: Vec<_> = app
        .pool
        .backends()
        .iter()
        .map(|b| {
            let s = b.state();
            let metrics = s.metrics.as_ref().map(|(m, at)| {
                serde_json::json!({
                    "age_ms": now.saturating_duration_since(*at).as_millis() as u64,
                    "waiting": m.waiting,
                    "running": m.running,
                    "kv_cache_usage": m.kv_usage,
                    "block_size": m.block_size,
                    "num_gpu_blocks": m.num_gpu_blocks,
                    "running_lora_adapters": m.running_loras,
                })
            });
            let passive = match b.passive().status(clock) {
                Status::Serving => serde_json::json!({"state": "serving"}),
                Status::Ejected { remaining } => serde_json::json!({
                    "state": "ejected",
                    "remaining_ms": remaining.as_millis() as u64,
                }),
                Status::Probation { probe_in_flight } => serde_json::json!({
                    "state": "probation",
                    "probe_in_flight": probe_in_flight,
                }),
            };
            let joined = crate::clock::unix_ms_of(b.origin.joined_at) / 1000;
            serde_json::json!({
                "url": b.name,
                "id": b.id,
                "source": b.origin.source,
                "role": b.role.as_str(),
                "labels": crate::endpoints::membership::labels_json(&b.origin.labels),
                "joined_unix": joined,
                "draining": b.is_draining(),
                "healthy": s.healthy,
                "outlier": passive,
                "ejections": b.passive().total_ejections(),
                "inflight": b.inflight(),
                "sent_tokens": {
                    "prefill": b.work().prefill_tokens(),
                    "decode": b.work().decode_tokens(),
                    "recent": b.work().recent_tokens(crate::clock::now_ms()).round(),
                    "recent_hot": b.work().recent_hot(crate::clock::now_ms()).round(),
                },
                "chars_per_token": {
                    "measured": s.chars_per_token.ratio(),
                    "tokens_counted": s.chars_per_token.tokens_counted().round(),
                    "served_chars": b.work().served_chars(),
                    "served_requests": b.work().served_requests(),
                    "traffic_share": s.chars_per_token.share(),
                },
                "epoch": s.epoch,
                "consecutive_failures": s.consecutive_failures,
                "last_error": s.last_error,
                "models": s.models.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(),
                "metrics": metrics,
                "kv_events": b.kv().admin_json(crate::clock::now_ms()),
            })
        })
        .collect();
    Json(serde_json::json!({
        "backends": list,
        "profile": app.service.profile_description(),
        "queued": app.service.queued(),
        "waiting_for_slot": app.pool.waiters().len(),
    }))
    .into_response()
}

async fn not_found(req: Request) -> Response {
    Error::NotFound(req.uri().path().to_owned()).into_response()
}

async fn method_not_allowed(method: Method) -> Response {
    Error::MethodNotAllowed(method.to_string()).into_response()
}

#[cfg(test)]
mod tests {
    use super::has_dot_segment;

    #[test]
    fn dot_segments_encoded_slashes_and_backslashes() {
        let refused = [
            "/v1/..",
            "/v1/../metrics",
            "/v1/./chat",
            "/v1/a/./b",
            "/../v1",
            "/v1/%2e%2e/metrics",
            "/v1/%2E%2E/metrics",
            "/v1/%2e./metrics",
            "/v1/.%2E/metrics",
            "/v1/%2e/x",
            "/v1/x%2fy",
            "/v1/x%2Fy",
            "/v1/x%5cy",
            "/v1/x%5Cy",
            "/v1/x\\y",
            "/v1\\..\\metrics",
        ];
        for path in refused {
            assert!(has_dot_segment(path), "{path} must be refused");
        }
        let allowed = [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/models/my.model",
            "/v1/...",
            "/v1/.hidden",
            "/v1/a..b",
            "/v1/%2e%2e%2e",
            "/v1/x%252e%252e",
            "/v1/",
            "/",
        ];
        for path in allowed {
            assert!(!has_dot_segment(path), "{path} must pass");
        }
    }
}
