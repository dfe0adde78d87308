//! Forwarding: send a scheduled request to its backend over pooled keep-alive connections and
//! stream the answer back.
//!
//! The request body is the client's original bytes (read once by the front door); the
//! response body streams frame by frame through [`body::GuardedBody`], so Server-Sent Events
//! reach the client as the backend emits them. The [`Forwarder`] is a tower `Service`; the
//! scheduler wraps it as a `Layer` and retries connection failures on another backend.

pub mod body;
pub mod headers;
pub mod pool;
pub mod tls;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response};
use http_body_util::Full;

use crate::config::{ForwardConfig, OutlierConfig};
use crate::endpoints::Backend;
use crate::error::Error;
use crate::prompt::RequestView;
use crate::scheduling::framework::Outcome;
use crate::scheduling::InflightGuard;
use crate::telemetry as t;
use pool::{ConnPool, Lease};

/// A request as the front door hands it to the scheduler: parsed once, body kept as bytes.
#[derive(Debug)]
pub struct ProxyRequest {
    pub method: Method,
    /// Path and query to send to the backend, e.g. `/v1/chat/completions`.
    pub path_and_query: String,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub view: Arc<RequestView>,
    pub request_id: HeaderValue,
    pub received_at: Instant,
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
    outlier: OutlierConfig,
}

impl Forwarder {
    pub fn new(cfg: &ForwardConfig, outlier: &OutlierConfig, backend_header: HeaderName) -> Self {
        let pool = Arc::new(ConnPool::new(
            cfg.pool_max_idle_per_backend,
            Duration::from_millis(cfg.pool_idle_timeout_ms),
            Duration::from_millis(cfg.connect_timeout_ms),
        ));
        Forwarder {
            pool,
            response_timeout: Duration::from_millis(cfg.response_timeout_ms),
            stream_idle_timeout: Duration::from_millis(cfg.stream_idle_timeout_ms),
            request_timeout: (cfg.request_timeout_ms > 0)
                .then(|| Duration::from_millis(cfg.request_timeout_ms)),
            forward_client_authorization: cfg.forward_client_authorization,
            backend_header,
            outlier: outlier.clone(),
        }
    }

    fn build_request(&self, d: &Dispatch) -> Result<Request<Full<Bytes>>, Error> {
        let req = &d.request;
        // Origin form on the wire; the backend is named by the Host header.
        let uri = http::Uri::try_from(req.path_and_query.as_str())
            .map_err(|e| Error::InvalidRequest(format!("invalid request path: {e}")))?;
        let host = HeaderValue::from_str(d.backend.authority.as_str())
            .map_err(|e| Error::Internal(e.to_string()))?;
        let mut out = Request::builder()
            .method(req.method.clone())
            .uri(uri)
            .header(http::header::HOST, host)
            .body(Full::new(req.body.clone()))
            .map_err(|e| Error::Internal(e.to_string()))?;
        headers::request_headers(
            &req.headers,
            out.headers_mut(),
            d.backend.authorization.as_ref(),
            self.forward_client_authorization,
        );
        out.headers_mut()
            .insert("x-request-id", req.request_id.clone());
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
            let headers_by = {
                let by = tokio::time::Instant::now() + this.response_timeout;
                deadline.map_or(by, |end| end.min(by))
            };
            let exchange = async {
                let (mut conn, reused) = this
                    .pool
                    .checkout(d.backend.id, &d.backend.connector)
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
                mut guard,
            } = d;
            let (conn, response) = match sent {
                Err(_) => {
                    attempt_failed(&backend, "timeout");
                    backend.passive().record_failure(&this.outlier);
                    guard.set_outcome(Outcome::Failed);
                    return Err(Error::UpstreamTimeout {
                        backend: backend.name.clone(),
                        timeout_ms: this.response_timeout.as_millis() as u64,
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
                    if backend.passive().record_failure(&this.outlier) {
                        tracing::warn!(backend = %backend.name, "backend ejected after consecutive failures");
                    }
                    guard.set_outcome(Outcome::Failed);
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
            if parts.status.is_server_error() {
                if backend.passive().record_failure(&this.outlier) {
                    tracing::warn!(backend = %backend.name, "backend ejected after consecutive failures");
                }
            } else {
                backend.passive().record_success();
            }
            metrics::counter!(
                t::UPSTREAM_RESPONSES,
                "backend" => backend.name.clone(),
                "code" => parts.status.as_str().to_owned()
            )
            .increment(1);
            headers::strip_response_headers(&mut parts.headers);
            if let Ok(v) = HeaderValue::from_str(&backend.name) {
                parts.headers.insert(this.backend_header.clone(), v);
            }
            parts
                .headers
                .insert("x-request-id", original.request_id.clone());
            let error_status = parts.status.is_server_error();
            let sse = parts
                .headers
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("text/event-stream"));
            let limits = body::BodyLimits {
                idle: this.stream_idle_timeout,
                deadline,
            };
            let lease = Lease {
                conn,
                pool: this.pool.clone(),
                backend: backend.id,
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
            Ok(Response::from_parts(parts, Body::new(body)))
        })
    }
}
