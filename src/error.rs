//! The one place where errors become HTTP statuses and OpenAI-shaped JSON bodies.
//!
//! Everything inside inferlb returns a typed [`Error`]; only the front door calls
//! [`Error::into_response`]. Keeping the mapping here means a status code can be
//! audited in one table instead of being scattered through handlers.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// Every failure a request can meet between the front door and the backend.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The body is not valid JSON, or a field has the wrong type.
    #[error("{0}")]
    InvalidRequest(String),
    /// A required field (`messages`, `prompt`) is missing.
    #[error("missing required field `{0}`")]
    MissingField(&'static str),
    /// A field the router checks has a value no backend would accept (out of range, the wrong
    /// shape, a content part without its payload, too many messages).
    #[error("{message}")]
    InvalidParam { param: String, message: String },
    /// The body is larger than `max_body_bytes`.
    #[error("request body is larger than the limit of {limit} bytes")]
    BodyTooLarge { limit: usize },
    /// The client stopped sending the body or the connection broke while reading it.
    #[error("failed to read the request body: {0}")]
    BodyRead(String),
    /// No backend in the pool has ever served this model.
    #[error("the model `{0}` does not exist")]
    ModelNotFound(String),
    /// Backends serve the model, but none of them is currently eligible.
    #[error("no healthy backend is available for model `{0}`")]
    NoHealthyBackend(String),
    /// Every attempt to reach a backend failed before a response arrived.
    #[error("upstream {backend} failed: {reason}")]
    Upstream { backend: String, reason: String },
    /// The backend did not send response headers in time; `limit` names the setting that
    /// fired (`forward.response_timeout_ms`, or `forward.request_timeout_ms` when the whole
    /// request's deadline came first).
    #[error("upstream {backend} did not answer within {timeout_ms} ms ({limit})")]
    UpstreamTimeout {
        backend: String,
        timeout_ms: u64,
        limit: &'static str,
    },
    /// The client did not send its body in time.
    #[error("the request body was not received within {0} ms")]
    BodyTimeout(u64),
    /// Missing or wrong API key.
    #[error("invalid or missing API key: send `Authorization: Bearer <key>`")]
    Unauthorized,
    /// Over a rate or concurrency limit, or the router-side queue is full or timed out.
    #[error("{reason}; retry after {retry_after_secs} s")]
    TooManyRequests {
        reason: String,
        retry_after_secs: u64,
    },
    /// Every eligible backend is at its in-flight limit (the scheduler queues on this).
    #[error("every eligible backend is at its concurrency limit")]
    Saturated,
    /// No route matches the path.
    #[error("no route for {0}")]
    NotFound(String),
    /// The route exists but not for this method.
    #[error("method {0} is not allowed on this route")]
    MethodNotAllowed(String),
    /// No backend holds the response a Responses API call names (vLLM's own wording).
    #[error("Response with id '{0}' not found.")]
    ResponseNotFound(String),
    /// Whether some backend holds the named response cannot be told now (a backend did not
    /// answer the lookup).
    #[error(
        "could not tell which backend holds response '{0}' (not every backend answered); retry"
    )]
    ResponseUnresolved(String),
    /// A bug or an impossible state: reported as 500 without crashing.
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// HTTP status, OpenAI error `type` and `code` for this error.
    pub fn parts(&self) -> (StatusCode, &'static str, Option<&'static str>) {
        match self {
            Error::InvalidRequest(_)
            | Error::MissingField(_)
            | Error::InvalidParam { .. }
            | Error::BodyRead(_) => (StatusCode::BAD_REQUEST, "invalid_request_error", None),
            Error::BodyTooLarge { .. } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                Some("request_too_large"),
            ),
            Error::ModelNotFound(_) => (
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                Some("model_not_found"),
            ),
            Error::NoHealthyBackend(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                Some("no_healthy_backend"),
            ),
            Error::Upstream { .. } => (
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                Some("upstream_unreachable"),
            ),
            Error::UpstreamTimeout { .. } => (
                StatusCode::GATEWAY_TIMEOUT,
                "upstream_error",
                Some("upstream_timeout"),
            ),
            Error::BodyTimeout(_) => (
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                Some("request_timeout"),
            ),
            Error::Unauthorized => (
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                Some("invalid_api_key"),
            ),
            Error::TooManyRequests { .. } | Error::Saturated => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                Some("rate_limit_exceeded"),
            ),
            Error::NotFound(_) => (
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                Some("not_found"),
            ),
            Error::MethodNotAllowed(_) => (
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                Some("method_not_allowed"),
            ),
            Error::ResponseNotFound(_) => (StatusCode::NOT_FOUND, "invalid_request_error", None),
            Error::ResponseUnresolved(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                Some("response_lookup_incomplete"),
            ),
            Error::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal_error", None),
        }
    }

    /// The request parameter the error is about, when there is one.
    fn param(&self) -> Option<&str> {
        match self {
            Error::MissingField(field) => Some(field),
            Error::InvalidParam { param, .. } => Some(param),
            Error::ModelNotFound(_) | Error::NoHealthyBackend(_) => Some("model"),
            Error::ResponseNotFound(_) | Error::ResponseUnresolved(_) => Some("response_id"),
            _ => None,
        }
    }
}

#[derive(Serialize)]
struct Envelope<'a> {
    error: Body<'a>,
}

#[derive(Serialize)]
struct Body<'a> {
    message: String,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

/// Render an OpenAI error body; used for errors and for axum's own rejections.
pub fn openai_error_body(
    message: String,
    kind: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> String {
    let envelope = Envelope {
        error: Body {
            message,
            kind,
            param,
            code,
        },
    };
    // Serialising plain strings cannot fail; fall back to a fixed body rather than panic.
    serde_json::to_string(&envelope)
        .unwrap_or_else(|_| r#"{"error":{"message":"internal error","type":"internal_error","param":null,"code":null}}"#.to_owned())
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let (status, kind, code) = self.parts();
        let body = match &self {
            // vLLM's body for it, whose `code` is the status number (`ErrorInfo` in
            // `vllm/entrypoints/serve/engine/protocol.py`, 0.32.0), so a client sees the same
            // answer behind the router as from one vLLM.
            Error::ResponseNotFound(_) => serde_json::json!({"error": {
                "message": self.to_string(),
                "type": kind,
                "param": self.param(),
                "code": status.as_u16(),
            }})
            .to_string(),
            _ => openai_error_body(self.to_string(), kind, self.param(), code),
        };
        let retry_after = match &self {
            Error::TooManyRequests {
                retry_after_secs, ..
            } => Some(*retry_after_secs),
            Error::NoHealthyBackend(_) | Error::Saturated | Error::ResponseUnresolved(_) => Some(1),
            _ => None,
        };
        let unauthorized = matches!(self, Error::Unauthorized);
        let mut response = (status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(secs) = retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if unauthorized {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn every_error_renders_openai_shape() {
        let cases = [
            (Error::InvalidRequest("bad".into()), 400),
            (Error::MissingField("messages"), 400),
            (
                Error::InvalidParam {
                    param: "temperature".into(),
                    message: "`temperature` must be ≥ 0".into(),
                },
                400,
            ),
            (Error::BodyTooLarge { limit: 10 }, 413),
            (Error::ModelNotFound("m".into()), 404),
            (Error::NoHealthyBackend("m".into()), 503),
            (
                Error::Upstream {
                    backend: "b".into(),
                    reason: "refused".into(),
                },
                502,
            ),
            (
                Error::UpstreamTimeout {
                    backend: "b".into(),
                    timeout_ms: 1,
                    limit: "forward.response_timeout_ms",
                },
                504,
            ),
            (Error::NotFound("/x".into()), 404),
            (Error::MethodNotAllowed("GET".into()), 405),
            (Error::BodyTimeout(5), 408),
            (Error::Saturated, 429),
            (Error::Unauthorized, 401),
            (
                Error::TooManyRequests {
                    reason: "busy".into(),
                    retry_after_secs: 1,
                },
                429,
            ),
            (Error::Internal("x".into()), 500),
        ];
        for (err, status) in cases {
            let (s, kind, code) = err.parts();
            assert_eq!(s.as_u16(), status, "{err}");
            let body = openai_error_body(err.to_string(), kind, err.param(), code);
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert!(v["error"]["message"].is_string());
            assert!(v["error"]["type"].is_string());
            assert!(v["error"].get("param").is_some());
            assert!(v["error"].get("code").is_some());
        }
    }

    #[test]
    fn model_not_found_has_code() {
        let err = Error::ModelNotFound("gpt".into());
        let (_, _, code) = err.parts();
        assert_eq!(code, Some("model_not_found"));
        assert_eq!(err.param(), Some("model"));
    }
}
