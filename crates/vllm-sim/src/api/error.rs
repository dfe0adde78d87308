//! API errors: the one place that turns failures into HTTP statuses and vLLM's error JSON.
//!
//! vLLM 0.32 answers `{"error":{"message":..,"type":"BadRequestError","param":null,"code":400}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

/// Why a request was not served.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    #[error("{0}")]
    Internal(String),
    #[error("{0}")]
    Unavailable(String),
}

impl ApiError {
    fn status_and_type(&self) -> (StatusCode, &'static str) {
        match self {
            ApiError::BadRequest(_) => (StatusCode::BAD_REQUEST, "BadRequestError"),
            ApiError::ModelNotFound(_) => (StatusCode::NOT_FOUND, "NotFoundError"),
            ApiError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "InternalServerError"),
            ApiError::Unavailable(_) => {
                (StatusCode::SERVICE_UNAVAILABLE, "ServiceUnavailableError")
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, kind) = self.status_and_type();
        let param = match self {
            ApiError::ModelNotFound(_) => serde_json::Value::from("model"),
            _ => serde_json::Value::Null,
        };
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

/// Parses a JSON body, turning syntax and type errors into 400s (as vLLM does).
pub fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::BadRequest(format!("Invalid request body: {e}")))
}
