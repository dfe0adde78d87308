//! The backend inventory: who the backends are, what they serve, how loaded and healthy they are.
//!
//! Each [`Backend`] has a fixed identity (URL, engine, credentials) and a [`BackendState`] that
//! only the poller writes: it builds a fresh immutable state after every scrape and swaps it in
//! with `arc-swap`, so the request path reads the latest picture without taking a lock. The
//! router's own in-flight count is an atomic on the backend, because it changes per request
//! and is the one signal that is fresh between two polls.

pub mod engine;
pub mod passive;
pub mod poller;
pub mod prometheus;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use http::uri::{Authority, Scheme};
use http::HeaderValue;

use crate::config::{BackendConfig, Config, ConfigError};
use crate::forward::pool::Connector;
use crate::forward::tls::ClientConfigs;
use engine::{EngineMetricNames, LoadMetrics};

/// Parse a backend base URL: `http://host:port` or `https://host:port`, no path, query or
/// credentials.
pub fn parse_base_url(url: &str) -> Result<(Scheme, Authority), String> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("`{url}` is not a URL: {e}"))?;
    let scheme = uri
        .scheme()
        .cloned()
        .ok_or_else(|| format!("`{url}` has no scheme (use http:// or https://)"))?;
    if scheme != Scheme::HTTP && scheme != Scheme::HTTPS {
        return Err(format!(
            "`{url}`: only http:// and https:// backends are supported"
        ));
    }
    let authority = uri
        .authority()
        .cloned()
        .filter(|a| !a.host().is_empty())
        .ok_or_else(|| format!("`{url}` has no host"))?;
    if authority.as_str().contains('@') {
        return Err(format!(
            "`{url}`: credentials in the URL are not allowed; use api_key"
        ));
    }
    let text = authority.as_str();
    if let Some(colon) = text.rfind(':') {
        let port = &text[colon + 1..];
        if !port.contains(']') && port.parse::<u16>().is_err() {
            return Err(format!("`{url}` has an invalid port"));
        }
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(format!("`{url}` must not have a path or query"));
    }
    Ok((scheme, authority))
}

/// One model a backend serves, as its `/v1/models` listed it.
#[derive(Debug, Clone)]
pub struct ModelEntry {
    pub id: String,
    /// The backend's own JSON object for the model, passed through to clients.
    pub object: serde_json::Value,
}

/// What the poller last learned about a backend. Immutable once published.
#[derive(Debug, Clone)]
pub struct BackendState {
    pub healthy: bool,
    /// Last good metrics and when they were scraped.
    pub metrics: Option<(LoadMetrics, Instant)>,
    pub models: Arc<[ModelEntry]>,
    /// Bumped whenever the backend's cache may have been wiped (restart, re-admission), so
    /// affinity state about it can be forgotten.
    pub epoch: u64,
    pub consecutive_failures: u32,
    pub consecutive_successes: u32,
    pub last_error: Option<String>,
    /// Has answered at least one scrape (the first answer admits at once).
    pub seen: bool,
}

impl BackendState {
    fn initial(models: Option<&[String]>) -> Self {
        let models: Arc<[ModelEntry]> = models
            .unwrap_or_default()
            .iter()
            .map(|id| ModelEntry {
                id: id.clone(),
                object: serde_json::json!({"id": id, "object": "model", "owned_by": "inferlb"}),
            })
            .collect();
        BackendState {
            healthy: false,
            metrics: None,
            models,
            epoch: 0,
            consecutive_failures: 0,
            consecutive_successes: 0,
            last_error: None,
            seen: false,
        }
    }

    pub fn serves(&self, model: &str) -> bool {
        self.models.iter().any(|m| m.id == model)
    }
}

/// A backend server: fixed identity plus the swapped-in state.
#[derive(Debug)]
pub struct Backend {
    /// Dense index in the pool, used by per-backend tables such as the prefix index.
    pub id: usize,
    /// The base URL as configured; also the `backend` label of metrics.
    pub name: String,
    pub scheme: Scheme,
    pub authority: Authority,
    /// Opens connections to it: plain TCP, or TLS for `https://`.
    pub connector: Connector,
    pub engine: EngineMetricNames,
    /// `Bearer <key>`, ready to send.
    pub authorization: Option<HeaderValue>,
    /// Models fixed by config: discovery is skipped when set.
    pub static_models: bool,
    state: ArcSwap<BackendState>,
    inflight: AtomicU64,
    passive: passive::PassiveHealth,
    /// Pool-wide signal that some backend released in-flight capacity.
    freed: Arc<tokio::sync::Notify>,
}

impl Backend {
    pub fn new(
        id: usize,
        config: &BackendConfig,
        engine: EngineMetricNames,
        freed: Arc<tokio::sync::Notify>,
        tls: &mut ClientConfigs,
    ) -> Result<Self, ConfigError> {
        let (scheme, authority) = parse_base_url(&config.url)
            .map_err(|m| ConfigError::invalid(format!("backends[{id}].url"), m))?;
        let connector = if scheme == Scheme::HTTPS {
            let field = if config.ca_file.is_some() {
                format!("backends[{id}].ca_file")
            } else {
                "forward.ca_file".to_owned()
            };
            let client = tls
                .get(config.ca_file.as_deref())
                .map_err(|e| ConfigError::invalid(field, e.to_string()))?;
            Connector::tls(authority.clone(), client)
                .map_err(|m| ConfigError::invalid(format!("backends[{id}].url"), m))?
        } else {
            Connector::plain(authority.clone())
        };
        let authorization = config
            .api_key
            .as_ref()
            .map(|key| {
                let mut value = HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| {
                    ConfigError::invalid(
                        format!("backends[{id}].api_key"),
                        "not a valid header value",
                    )
                })?;
                // Never printed by `Debug` or logged.
                value.set_sensitive(true);
                Ok(value)
            })
            .transpose()?;
        Ok(Backend {
            id,
            name: format!("{scheme}://{authority}"),
            scheme,
            authority,
            connector,
            engine,
            authorization,
            static_models: config.models.is_some(),
            state: ArcSwap::from_pointee(BackendState::initial(config.models.as_deref())),
            inflight: AtomicU64::new(0),
            passive: passive::PassiveHealth::default(),
            freed,
        })
    }

    /// The latest published state.
    pub fn state(&self) -> Arc<BackendState> {
        self.state.load_full()
    }

    /// Publish a new state (poller only).
    pub fn publish(&self, state: BackendState) {
        self.state.store(Arc::new(state));
    }

    /// Outlier detection from forwarding results.
    pub fn passive(&self) -> &passive::PassiveHealth {
        &self.passive
    }

    pub fn inflight(&self) -> u64 {
        self.inflight.load(Ordering::Relaxed)
    }

    pub(crate) fn inflight_add(&self) -> u64 {
        self.inflight.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub(crate) fn inflight_sub(&self) -> u64 {
        let n = self
            .inflight
            .fetch_sub(1, Ordering::Relaxed)
            .saturating_sub(1);
        self.freed.notify_waiters();
        n
    }
}

/// The set of backends requests can go to.
#[derive(Debug)]
pub struct Pool {
    backends: Vec<Arc<Backend>>,
    stale_after: Duration,
    freed: Arc<tokio::sync::Notify>,
}

impl Pool {
    pub fn from_config(config: &Config) -> Result<Self, ConfigError> {
        let freed = Arc::new(tokio::sync::Notify::new());
        let mut tls = ClientConfigs::new(config.forward.ca_file.clone());
        let backends = config
            .backends
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let engine = config.engine(&b.engine).ok_or_else(|| {
                    ConfigError::invalid(
                        format!("backends[{i}].engine"),
                        format!("unknown engine `{}`", b.engine),
                    )
                })?;
                Backend::new(i, b, engine, Arc::clone(&freed), &mut tls).map(Arc::new)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Pool {
            backends,
            stale_after: config.poller.stale_after(),
            freed,
        })
    }

    pub fn backends(&self) -> &[Arc<Backend>] {
        &self.backends
    }

    pub fn stale_after(&self) -> Duration {
        self.stale_after
    }

    /// Notified whenever any backend's in-flight count drops.
    pub fn capacity_freed(&self) -> &tokio::sync::Notify {
        &self.freed
    }

    pub fn any_healthy(&self) -> bool {
        self.backends.iter().any(|b| b.state.load().healthy)
    }

    /// Candidates for one scheduling decision, with their states read once.
    pub fn candidates(&self, now: Instant) -> Vec<Candidate<'_>> {
        self.backends
            .iter()
            .map(|backend| {
                let state = backend.state();
                let fresh = state
                    .metrics
                    .as_ref()
                    .is_some_and(|(_, at)| now.saturating_duration_since(*at) <= self.stale_after);
                Candidate {
                    backend,
                    inflight: backend.inflight(),
                    state,
                    fresh,
                    ejected: backend.passive.is_ejected(),
                }
            })
            .collect()
    }
}

/// A backend as one scheduling decision sees it.
#[derive(Debug, Clone)]
pub struct Candidate<'a> {
    pub backend: &'a Arc<Backend>,
    pub state: Arc<BackendState>,
    /// The router's own in-flight count at decision time.
    pub inflight: u64,
    fresh: bool,
    /// Passively ejected by outlier detection at decision time.
    pub ejected: bool,
}

impl<'a> Candidate<'a> {
    /// Polled metrics, or `None` when never scraped or stale.
    pub fn metrics(&self) -> Option<&LoadMetrics> {
        if self.fresh {
            self.state.metrics.as_ref().map(|(m, _)| m)
        } else {
            None
        }
    }

    /// For tests and benches: a candidate with given metrics, fresh.
    pub fn with_metrics(
        backend: &'a Arc<Backend>,
        metrics: Option<LoadMetrics>,
        inflight: u64,
    ) -> Self {
        let mut state = BackendState::initial(None);
        state.healthy = true;
        let fresh = metrics.is_some();
        state.metrics = metrics.map(|m| (m, Instant::now()));
        Candidate {
            backend,
            state: Arc::new(state),
            inflight,
            fresh,
            ejected: false,
        }
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// `n` backends with ids 0..n on made-up ports.
    pub fn backends(n: usize) -> Vec<Arc<Backend>> {
        (0..n)
            .map(|i| {
                let cfg = BackendConfig::from_url(format!("http://127.0.0.1:{}", 10_000 + i));
                Arc::new(
                    Backend::new(
                        i,
                        &cfg,
                        EngineMetricNames::builtin("vllm").unwrap(),
                        Default::default(),
                        &mut ClientConfigs::default(),
                    )
                    .unwrap(),
                )
            })
            .collect()
    }

    pub fn load(waiting: Option<f64>, kv: Option<f64>) -> LoadMetrics {
        LoadMetrics {
            waiting,
            kv_usage: kv,
            ..Default::default()
        }
    }
}
