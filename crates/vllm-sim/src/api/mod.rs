//! HTTP API: the axum routes of one simulator and the state its handlers share.
//!
//! `generate` serves the OpenAI generation endpoints, `extra` everything else (models, health,
//! metrics, tokenizer, other routers' probes, `/sim/*` admin); `openai` parses and validates
//! request bodies; `pd` reads `kv_transfer_params` and runs the P/D side channel
//! (`POST /kv_transfer/pull`); `responses` serves OpenAI's Responses API (`/v1/responses`)
//! and keeps its store; `error` is the single place errors become HTTP responses.

pub mod error;
pub mod extra;
pub mod generate;
pub mod openai;
pub mod pd;
pub mod responses;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;

use crate::config::SimConfig;
use crate::engine::EngineHandle;
use crate::faults::Faults;
use crate::kv_events::publisher::PubStats;
use crate::kv_events::KvEventsConfig;
use crate::metrics::PageInfo;

/// What every handler can reach (cheap to clone).
#[derive(Debug, Clone)]
pub struct AppState(Arc<Inner>);

#[derive(Debug)]
pub struct Inner {
    pub config: SimConfig,
    /// Served names of the base model; the first is the primary one.
    pub names: Vec<String>,
    pub engine: EngineHandle,
    pub faults: Faults,
    pub page_info: PageInfo,
    pub addr: SocketAddr,
    /// `--tokenizer DIR`: the real tokenizer, replacing the stand-in for prompts.
    pub hf: Option<Arc<hf_tokenize::HfTokenizer>>,
    /// The KV-event publisher, when `--kv-events-config` enables one.
    pub kv: Option<KvInfo>,
    /// `remote_engine_id` of this server's prefill legs (`--kv-engine-id` or a random UUID).
    pub kv_engine_id: String,
    /// The Responses API store (empty unless `--responses-store`).
    pub responses: responses::store::Store,
}

/// What the HTTP layer knows of the KV-event publisher.
#[derive(Debug)]
pub struct KvInfo {
    /// As `/kv_event_sources` reports it.
    pub resolved: KvEventsConfig,
    /// The PUB and replay addresses as bound (what a subscriber dials).
    pub dial: (String, Option<String>),
    pub stats: Arc<PubStats>,
}

impl std::ops::Deref for AppState {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl AppState {
    pub fn new(inner: Inner) -> Self {
        Self(Arc::new(inner))
    }
}

/// All routes of the main port.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/completions", post(generate::completions))
        .route("/v1/chat/completions", post(generate::chat))
        .route("/v1/completions/render", post(extra::render))
        .route("/v1/chat/completions/render", post(extra::render))
        .route("/v1/models", get(extra::models))
        .route("/tokenize", post(extra::tokenize))
        .route("/detokenize", post(extra::detokenize))
        .route("/metrics", get(extra::metrics_page))
        .route("/metrics/", get(extra::metrics_page_filtered))
        .route("/version", get(extra::version))
        .route("/ping", get(extra::empty_ok).post(extra::empty_ok))
        .route("/get_model_info", get(extra::model_info))
        .route("/model_info", get(extra::model_info))
        .route("/get_server_info", get(extra::server_info))
        .route("/server_info", get(extra::server_info))
        .route("/get_load", get(extra::get_load))
        .route("/kv_event_sources", get(extra::kv_event_sources))
        .route("/reset_prefix_cache", post(extra::reset_prefix_cache))
        .route(pd::PULL_PATH, post(pd::serve_pull))
        .merge(responses::routes())
        .merge(admin_routes())
        // Long prompts as token-id arrays exceed axum's 2 MB default; vLLM has no such limit.
        .layer(DefaultBodyLimit::max(64 << 20))
        .with_state(state)
}

/// The routes that also live on `--admin-port`, which stays up while the main port refuses.
pub fn admin_router(state: AppState) -> Router {
    admin_routes().with_state(state)
}

fn admin_routes() -> Router<AppState> {
    Router::new()
        .route("/health", get(extra::empty_ok))
        .route(
            "/sim/faults",
            get(extra::get_faults).post(extra::post_faults),
        )
        .route("/sim/stats", get(extra::stats))
}
