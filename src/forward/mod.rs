//! Forwarding: send a scheduled request to its backend over pooled keep-alive connections and
//! stream the answer back.
//!
//! The request body is the client's original bytes (read once by the front door), less a
//! client's own `kv_transfer_params` ([`kv_params`]); the
//! response body streams frame by frame through [`body::GuardedBody`], so Server-Sent Events
//! reach the client as the backend emits them. The [`Forwarder`] is a tower `Service`; the
//! scheduler wraps it as a `Layer` and retries connection failures on another backend.

pub mod body;
pub mod config;
pub mod headers;
pub mod json_object;
pub mod kv_params;
pub mod pool;
pub mod tls;

pub use config::ForwardConfig;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response};
use http_body_util::Full;

use crate::endpoints::OutlierConfig;
use crate::endpoints::{Backend, Pool};
use crate::error::Error;
use crate::prompt::RequestView;
use crate::scheduling::InflightGuard;
use crate::telemetry as t;
use pool::{ConnPool, Lease};

/// A request as the front door hands it to the scheduler: parsed once, body kept as bytes.
#[derive(Debug)]
pub struct ProxyRequest {
    pub method: Method,
    /// Path and query to send to the backend, e.g. `/v1/chat/completions` (kept parsed: the
    /// request to the backend reuses it without parsing or copying it again).
    pub path_and_query: http::uri::PathAndQuery,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub view: Arc<RequestView>,
    pub request_id: HeaderValue,
    pub received_at: Instant,
}

impl ProxyRequest {
    /// The same request (method, path, headers, id, arrival) with another body and view, e.g.
    /// one step of a disaggregated request.
    pub fn with_body(&self, body: Bytes, view: Arc<RequestView>) -> ProxyRequest {
        ProxyRequest {
            method: self.method.clone(),
            path_and_query: self.path_and_query.clone(),
            headers: self.headers.clone(),
            body,
            view,
            request_id: self.request_id.clone(),
            received_at: self.received_at,
        }
    }
}

/// A request with its backend chosen.
pub struct Dispatch {
    pub request: Arc<ProxyRequest>,
    pub backend: Arc<Backend>,
    pub guard: InflightGuard,
}

/// Talks to backends over pooled keep-alive connections; cheap to clone.
#[derive(Clone)]
pub struct Forwarder {
    pool: Arc<ConnPool>,
    response_timeout: Duration,
    stream_idle_timeout: Duration,
    request_timeout: Option<Duration>,
    forward_client_authorization: bool,
    backend_header: HeaderName,
    /// Swapped by a config reload.
    outlier: Arc<arc_swap::ArcSwap<OutlierConfig>>,
    /// For passive health: failures are reported to the pool, which applies the fleet cap.
    backends: Arc<Pool>,
}

impl Forwarder {
    /// `backend` left the pool: close its idle connections (keyed by its never-reused uid, so
    /// a late check-in cannot reach a newcomer either).
    pub fn forget(&self, backend: &Backend) {
        self.pool.purge(backend.uid);
    }

    /// Outlier-detection settings from a reloaded config.
    pub fn set_outlier(&self, outlier: &OutlierConfig) {
        self.outlier.store(Arc::new(outlier.clone()));
    }

    /// `workers`: the per-core request workers that will use it (`crate::workers`; 0 for
    /// the shared runtime), each of which gets idle connections of its own.
    pub fn new(
        cfg: &ForwardConfig,
        outlier: &OutlierConfig,
        backend_header: HeaderName,
        backends: Arc<Pool>,
        workers: usize,
    ) -> Self {
        let pool = Arc::new(ConnPool::new(
            cfg.pool_max_idle_per_backend,
            Duration::from_millis(cfg.pool_idle_timeout_ms),
            Duration::from_millis(cfg.connect_timeout_ms),
            workers,
        ));
        Forwarder {
            pool,
            response_timeout: Duration::from_millis(cfg.response_timeout_ms),
            stream_idle_timeout: Duration::from_millis(cfg.stream_idle_timeout_ms),
            request_timeout: (cfg.request_timeout_ms > 0)
                .then(|| Duration::from_millis(cfg.request_timeout_ms)),
            forward_client_authorization: cfg.forward_client_authorization,
            backend_header,
            outlier: Arc::new(arc_swap::ArcSwap::from_pointee(outlier.clone())),
            backends,
        }
    }

    fn build_request(&self, d: &Dispatch) -> Result<Request<Full<Bytes>>, Error> {
        let req = &d.request;
        // Origin form on the wire; the backend is named by the Host header.
        let mut uri = http::uri::Parts::default();
        uri.path_and_query = Some(req.path_and_query.clone());
        let uri = http::Uri::from_parts(uri)
            .map_err(|e| Error::InvalidRequest(format!("invalid request path: {e}")))?;
        // The map sized once: the client's headers, Host, the request id and a backend key.
        let mut map = HeaderMap::with_capacity(req.headers.len().saturating_add(3));
        map.insert(http::header::HOST, d.backend.host_header.clone());
        headers::request_headers(
            &req.headers,
            &mut map,
            d.backend.authorization.as_ref(),
            self.forward_client_authorization,
        );
        map.insert(headers::REQUEST_ID, req.request_id.clone());
        let mut out = Request::new(Full::new(req.body.clone()));
        *out.method_mut() = req.method.clone();
        *out.uri_mut() = uri;
        *out.headers_mut() = map;
        Ok(out)
    }
}

fn attempt_failed(backend: &Backend, reason: &'static str) {
    metrics::counter!(t::UPSTREAM_ATTEMPT_FAILURES, "backend" => backend.name.clone(), "reason" => reason)
        .increment(1);
}

impl tower::Service<Dispatch> for Forwarder {
    type Response = Response<Body>;
    type Error = Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, d: Dispatch) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let request = this.build_request(&d)?;
            let deadline = this
                .request_timeout
                .map(|t| tokio::time::Instant::from_std(d.request.received_at + t));
            let response_by = tokio::time::Instant::now() + this.response_timeout;
            // Whichever limit comes first bounds the wait for the head, and is named if it fires.
            let (headers_by, limit, limit_ms) = match (deadline, this.request_timeout) {
                (Some(end), Some(total)) if end < response_by => {
                    (end, "forward.request_timeout_ms", total.as_millis() as u64)
                }
                _ => (
                    response_by,
                    "forward.response_timeout_ms",
                    this.response_timeout.as_millis() as u64,
                ),
            };
            let exchange = async {
                let (mut conn, reused) = this
                    .pool
                    .checkout(d.backend.uid, &d.backend.connector)
                    .await?;
                let response = pool::send_with_reconnect(
                    &mut conn,
                    reused,
                    &d.backend.connector,
                    this.pool.connect_timeout,
                    request,
                    || this.build_request(&d).ok(),
                )
                .await?;
                Ok::<_, pool::ConnError>((conn, response))
            };
            let sent = tokio::time::timeout_at(headers_by, exchange).await;
            let Dispatch {
                request: original,
                backend,
                guard,
            } = d;
            let (conn, response) = match sent {
                Err(_) => {
                    attempt_failed(&backend, "timeout");
                    this.backends.report_failure(&backend, &this.outlier.load());
                    return Err(Error::UpstreamTimeout {
                        backend: backend.name.clone(),
                        timeout_ms: limit_ms,
                        limit,
                    });
                }
                Ok(Err(e)) => {
                    attempt_failed(
                        &backend,
                        match e {
                            pool::ConnError::Tls { .. } => "tls",
                            _ if e.is_connect() => "connect",
                            _ => "io",
                        },
                    );
                    this.backends.report_failure(&backend, &this.outlier.load());
                    let reason = std::error::Error::source(&e)
                        .map_or_else(|| e.to_string(), |s| format!("{e}: {s}"));
                    return Err(Error::Upstream {
                        backend: backend.name.clone(),
                        reason,
                    });
                }
                Ok(Ok(exchanged)) => exchanged,
            };
            let (mut parts, incoming) = response.into_parts();
            let mut guard = guard;
            // Only a prompt the backend accepted has had its tokens counted there.
            if !parts.status.is_success() {
                guard.prompt_not_served();
            }
            // A 5xx is counted by the scheduling layer once the request is over (it may be
            // the request's fault, not the backend's); anything else is a success here.
            if !parts.status.is_server_error() {
                this.backends.report_success(&backend);
            }
            t::handles::upstream_responses(&backend.name, parts.status).increment(1);
            headers::strip_response_headers(&mut parts.headers);
            if let Some(v) = &backend.name_header {
                parts.headers.insert(this.backend_header.clone(), v.clone());
            }
            parts
                .headers
                .insert(headers::REQUEST_ID, original.request_id.clone());
            let error_status = parts.status.is_server_error();
            let sse = parts
                .headers
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("text/event-stream"))
                .then(|| {
                    if crate::responses::on_api_path(original.path_and_query.as_str()) {
                        body::SseEnd::ResponseEvent
                    } else {
                        body::SseEnd::Done
                    }
                });
            let limits = body::BodyLimits {
                idle: this.stream_idle_timeout,
                deadline,
            };
            let lease = Lease {
                conn,
                pool: this.pool.clone(),
                backend: backend.uid,
            };
            let body = body::GuardedBody::new(
                incoming,
                Some(lease),
                guard,
                original.received_at,
                error_status,
                sse,
                limits,
            );
            let discarded = body.discard_marker();
            let mut response = Response::from_parts(parts, Body::new(body));
            if error_status || response.status() == http::StatusCode::TOO_MANY_REQUESTS {
                response.extensions_mut().insert(discarded);
            }
            Ok(response)
        })
    }
}

/// Read an answer the scheduler will not return (it retries elsewhere) to its end by `by`, so
/// its keep-alive connection goes back to the pool. A body larger than 64 KiB or slower than
/// that is dropped instead, which closes its connection. Either way the attempt is not
/// counted as a client disconnect.
pub async fn discard(response: Response<Body>, by: tokio::time::Instant) {
    use http_body_util::BodyExt;
    const MAX: usize = 64 * 1024;
    if let Some(marker) = response.extensions().get::<body::Discard>() {
        marker.set();
    }
    let mut body = response.into_body();
    let drain = async {
        let mut read = 0usize;
        while let Some(Ok(frame)) = body.frame().await {
            if let Some(data) = frame.data_ref() {
                read = read.saturating_add(data.len());
                if read > MAX {
                    break;
                }
            }
        }
    };
    let _ = tokio::time::timeout_at(by, drain).await;
}
