//! The status page (`GET /admin`) and recent decisions (`GET /admin/decisions?n=…`).
//!
//! The page is one self-contained HTML file (`status.html`, compiled in; no external assets)
//! whose script polls `/admin/backends` and `/admin/decisions` every two seconds. The page
//! itself holds no data, so it is served without the admin token; its script sends the token
//! (taken from the URL fragment, `/admin#token=…`, which browsers never send to the server)
//! with the JSON requests, which stay behind `auth.admin_token`.
//!
//! It owns the `[admin]` section ([`AdminConfig`]: its defaults and checks).

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;

use crate::config_error::ConfigError;

use super::AppState;

const PAGE: &str = include_str!("status.html");

/// `GET /admin`.
pub async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            // Nothing external, ever: the page works on an isolated admin network.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'",
            ),
        ],
        PAGE,
    )
        .into_response()
}

#[derive(Debug, Deserialize)]
pub struct DecisionsQuery {
    n: Option<usize>,
}

/// `GET /admin/decisions?n=N`: the newest `N` (default 20) decisions, newest first. Reading
/// arms the recording for ten minutes (see `scheduling::profile::decisions`).
pub async fn decisions(
    State(app): State<Arc<AppState>>,
    Query(q): Query<DecisionsQuery>,
) -> Response {
    let log = &app.decisions;
    let n = q.n.unwrap_or(20).min(log.capacity());
    let recent = log.recent(n);
    Json(serde_json::json!({
        "capacity": log.capacity(),
        // Seconds of recording left (null: always recording).
        "recording_for_s": log.armed_for(),
        "decisions": recent.iter().map(|r| &**r).collect::<Vec<_>>(),
    }))
    .into_response()
}

/// `[admin]`: what `/admin`, `/admin/decisions` and `x-inferlb-explain` keep and show.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Recent scheduling decisions kept (a ring; 0 = none). Recorded only while someone reads
    /// them (for 10 minutes after each read of `/admin/decisions`), unless `decisions_always`.
    pub decisions: usize,
    pub decisions_always: bool,
    /// Honour `x-inferlb-explain: 1` from every client (admin-token holders always may).
    pub explain: bool,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            decisions: 64,
            decisions_always: false,
            explain: false,
        }
    }
}

impl AdminConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.decisions > 10_000 {
            return Err(ConfigError::invalid("admin.decisions", "at most 10000"));
        }
        Ok(())
    }
}
