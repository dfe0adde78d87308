//! API errors: the one place that turns failures into HTTP statuses and vLLM's error JSON.
//!
//! vLLM 0.32 answers `{"error":{"message","type","param","code"}}`. Its own checks use
//! `"type":"BadRequestError"` (with `param` naming the field when there is one); bodies that
//! fail schema validation (bad JSON, wrong types, missing fields) get `"type":"Bad Request"`.
//! The Responses API's own checks use `"type":"invalid_request_error"`; routes vLLM does not
//! serve get Starlette's default `{"detail": "..."}` body.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

/// Why a request was not served.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A rule of vLLM's request checks; `param` names the offending field.
    #[error("{message}")]
    BadRequest {
        message: String,
        param: Option<&'static str>,
    },
    /// The body does not parse into the request schema.
    #[error("{0}")]
    Validation(String),
    #[error("The model `{name}` does not exist. Valid aliases: {valid}.")]
    ModelNotFound { name: String, valid: String },
    /// A Responses API check (`"type":"invalid_request_error"`).
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<&'static str>,
    },
    /// No stored response of that id (also an unknown `previous_response_id`).
    #[error("Response with id '{0}' not found.")]
    ResponseNotFound(String),
    /// A route vLLM does not serve: Starlette's 404 / 405, `{"detail": reason}`.
    #[error("{}", .0.canonical_reason().unwrap_or("Error"))]
    NotServed(StatusCode),
    #[error("{0}")]
    Internal(String),
    #[error("{0}")]
    Unavailable(String),
}

impl ApiError {
    /// A 400 without a parameter.
    pub fn bad(message: impl Into<String>) -> Self {
        ApiError::BadRequest {
            message: message.into(),
            param: None,
        }
    }

    /// A Responses API 400 (`invalid_request_error`) about one field.
    pub fn invalid(message: impl Into<String>, param: &'static str) -> Self {
        ApiError::InvalidRequest {
            message: message.into(),
            param: Some(param),
        }
    }

    /// A 400 about one field.
    pub fn bad_param(message: impl Into<String>, param: &'static str) -> Self {
        ApiError::BadRequest {
            message: message.into(),
            param: Some(param),
        }
    }

    fn status_type_param(&self) -> (StatusCode, &'static str, Option<&'static str>) {
        match self {
            ApiError::BadRequest { param, .. } => {
                (StatusCode::BAD_REQUEST, "BadRequestError", *param)
            }
            ApiError::Validation(_) => (StatusCode::BAD_REQUEST, "Bad Request", None),
            ApiError::InvalidRequest { param, .. } => {
                (StatusCode::BAD_REQUEST, "invalid_request_error", *param)
            }
            ApiError::ResponseNotFound(_) => (
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                Some("response_id"),
            ),
            ApiError::NotServed(status) => (*status, "", None),
            ApiError::ModelNotFound { .. } => {
                (StatusCode::NOT_FOUND, "NotFoundError", Some("model"))
            }
            ApiError::Internal(_) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalServerError",
                None,
            ),
            ApiError::Unavailable(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailableError",
                None,
            ),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, kind, param) = self.status_type_param();
        if let ApiError::NotServed(_) = self {
            return (
                status,
                Json(serde_json::json!({"detail": self.to_string()})),
            )
                .into_response();
        }
        let body = serde_json::json!({
            "error": {
                "message": self.to_string(),
                "type": kind,
                "param": param,
                "code": status.as_u16(),
            }
        });
        (status, Json(body)).into_response()
    }
}

/// Parses a JSON body; syntax and type errors are 400s, as vLLM's schema validation gives.
pub fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::Validation(format!("1 validation error: {e}")))
}
