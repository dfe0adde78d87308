//! The backend inventory: who the backends are, what they serve, how loaded and healthy they are.
//!
//! Each [`Backend`] has a fixed identity (URL, engine, credentials) and a [`BackendState`] that
//! only the poller writes: it builds a fresh immutable state after every scrape and swaps it in
//! with `arc-swap`, so the request path reads the latest picture without taking a lock. The
//! router's own in-flight count is an atomic on the backend, because it changes per request
//! and is the one signal that is fresh between two polls.

pub mod capacity;
pub mod chars_per_token;
pub mod config;
pub mod engine;
pub mod membership;
pub mod passive;
pub mod poller;
pub mod prometheus;
pub mod sent_work;

pub use config::{BackendConfig, BackendRole, OutlierConfig, PollerConfig};

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use crate::telemetry as t;
use capacity::Waiters;
use passive::Admission;

use arc_swap::ArcSwap;
use http::uri::{Authority, Scheme};
use http::HeaderValue;

use crate::config_error::ConfigError;
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
    /// Characters of routing text per token the backend counted, measured.
    pub chars_per_token: chars_per_token::CharsPerToken,
}

/// Every backend instance starts its epochs in a range of its own, so affinity state recorded
/// for a backend that left can never be taken for that of a newcomer reusing its slot id.
fn fresh_epoch_base() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed) << 24
}

impl BackendState {
    /// The state of a backend that has not been scraped yet, its epochs starting at `epoch`.
    fn initial(models: Option<&[String]>, epoch: u64) -> Self {
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
            epoch,
            consecutive_failures: 0,
            consecutive_successes: 0,
            last_error: None,
            seen: false,
            chars_per_token: chars_per_token::CharsPerToken::default(),
        }
    }

    pub fn serves(&self, model: &str) -> bool {
        self.models.iter().any(|m| m.id == model)
    }
}

/// Where a backend came from and when it joined, for the admin view.
#[derive(Debug, Clone)]
pub struct Origin {
    /// `static`, `file`, `dns` or `kubernetes`.
    pub source: &'static str,
    pub labels: BTreeMap<String, String>,
    pub joined_at: SystemTime,
}

/// A backend server: fixed identity plus the swapped-in state.
#[derive(Debug)]
pub struct Backend {
    /// Slot id: small and dense, used by per-backend tables such as the prefix index's bit
    /// masks. Reused by a newcomer only once this backend is gone entirely (see
    /// [`membership`]).
    pub id: usize,
    /// Never reused: keys tables that must not outlive this backend (idle connections).
    pub uid: usize,
    /// The configuration it was built from (membership diffs compare it).
    pub config: BackendConfig,
    pub origin: Origin,
    /// The base URL as configured; also the `backend` label of metrics.
    pub name: String,
    pub scheme: Scheme,
    pub authority: Authority,
    /// Opens connections to it: plain TCP, or TLS for `https://`.
    pub connector: Connector,
    pub engine: EngineMetricNames,
    /// `Bearer <key>`, ready to send.
    pub authorization: Option<HeaderValue>,
    /// The `Host` header of requests to it and its name as the response's backend header,
    /// made once here instead of per request.
    pub host_header: HeaderValue,
    pub name_header: Option<HeaderValue>,
    /// Models fixed by config: discovery is skipped when set.
    pub static_models: bool,
    /// Prefill, decode or both (from its config; see [`BackendRole`]).
    pub role: BackendRole,
    state: ArcSwap<BackendState>,
    inflight: AtomicU64,
    inflight_gauge: metrics::Gauge,
    passive: passive::PassiveHealth,
    /// The pool's requests waiting for an in-flight slot.
    waiters: Arc<Waiters>,
    /// Left the pool: receives no new requests; running ones finish.
    draining: AtomicBool,
    /// Returns `id` to the pool's free list when the last reference goes.
    release: Option<Arc<membership::SlotIds>>,
    /// The blocks its KV-event stream reports (empty and `off` without a stream).
    kv: crate::kv_events::store::BlockStore,
    /// Prompt tokens sent to it and not finished (see [`sent_work`]).
    work: sent_work::SentWork,
}

fn next_uid() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Drop for Backend {
    fn drop(&mut self) {
        if let Some(slots) = &self.release {
            slots.release(self.id);
        }
    }
}

impl Backend {
    pub fn new(
        id: usize,
        config: &BackendConfig,
        engine: EngineMetricNames,
        waiters: Arc<Waiters>,
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
        let name = format!("{scheme}://{authority}");
        let host_header = HeaderValue::from_str(authority.as_str())
            .map_err(|_| ConfigError::invalid(format!("backends[{id}].url"), "not a valid host"))?;
        let name_header = HeaderValue::from_str(&name).ok();
        Ok(Backend {
            id,
            uid: next_uid(),
            config: config.clone(),
            origin: Origin {
                source: "static",
                labels: BTreeMap::new(),
                joined_at: SystemTime::now(),
            },
            draining: AtomicBool::new(false),
            release: None,
            inflight_gauge: metrics::gauge!(t::BACKEND_INFLIGHT, "backend" => name.clone()),
            name,
            scheme,
            authority,
            connector,
            engine,
            authorization,
            host_header,
            name_header,
            static_models: config.models.is_some(),
            role: config.role(),
            state: ArcSwap::from_pointee(BackendState::initial(
                config.models.as_deref(),
                fresh_epoch_base(),
            )),
            inflight: AtomicU64::new(0),
            passive: passive::PassiveHealth::default(),
            waiters,
            kv: Default::default(),
            work: Default::default(),
        })
    }

    /// Left the pool: no new requests.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// The latest published state.
    pub fn state(&self) -> Arc<BackendState> {
        self.state.load_full()
    }

    /// Publish a new state (poller only).
    pub fn publish(&self, state: BackendState) {
        self.state.store(Arc::new(state));
    }

    /// What its KV-event stream says its cache holds (see [`crate::kv_events`]).
    pub fn kv(&self) -> &crate::kv_events::store::BlockStore {
        &self.kv
    }

    /// The prompt tokens this router has sent to it that are not finished.
    pub fn work(&self) -> &sent_work::SentWork {
        &self.work
    }

    /// Outlier detection from forwarding results.
    pub fn passive(&self) -> &passive::PassiveHealth {
        &self.passive
    }

    pub fn inflight(&self) -> u64 {
        self.inflight.load(Ordering::Relaxed)
    }

    /// The in-flight count, ordered with the slot hand-off (see [`capacity`]).
    fn inflight_seq(&self) -> u64 {
        self.inflight.load(Ordering::SeqCst)
    }

    /// Add one to the in-flight count if it is below `limit`; see [`capacity::Slot`].
    fn try_add_inflight(&self, limit: Option<u64>) -> bool {
        let added = self
            .inflight
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                limit.is_none_or(|l| n < l).then(|| n.saturating_add(1))
            });
        match added {
            Ok(n) => {
                self.inflight_gauge.set(n.saturating_add(1) as f64);
                true
            }
            Err(_) => false,
        }
    }

    fn sub_inflight(&self) {
        let before = self
            .inflight
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                Some(n.saturating_sub(1))
            })
            .unwrap_or(0);
        self.inflight_gauge.set(before.saturating_sub(1) as f64);
    }

    fn waiters(&self) -> &Arc<Waiters> {
        &self.waiters
    }

    /// Healthy by the poller and not passively ejected, draining or not: it can answer for
    /// what it holds (a response of the Responses API) even while it takes no new work.
    pub fn answers(&self) -> bool {
        self.state.load().healthy
            && self.passive.admission(tokio::time::Instant::now()) != Admission::Closed
    }

    /// A member, healthy by the poller and not passively ejected: may be given a request now.
    pub fn schedulable(&self) -> bool {
        !self.is_draining() && self.answers()
    }
}

/// Called with a backend that just left the pool (drop its per-backend state).
pub type RemovalHook = Arc<dyn Fn(&Backend) + Send + Sync>;

/// The set of backends requests can go to: an immutable snapshot of members swapped in by
/// [`Pool::reconcile`], so a request reads membership without taking a lock.
pub struct Pool {
    members: ArcSwap<Vec<Arc<Backend>>>,
    stale_after: Duration,
    waiters: Arc<Waiters>,
    engines: BTreeMap<String, EngineMetricNames>,
    slots: Arc<membership::SlotIds>,
    /// Bumped on every membership change (the poller follows it).
    generation: tokio::sync::watch::Sender<u64>,
    hooks: Mutex<Vec<RemovalHook>>,
    /// One reconciliation at a time.
    reconciling: Mutex<()>,
    /// TLS client configurations by CA file, shared by the backends built here.
    tls: Mutex<ClientConfigs>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("members", &self.members.load().len())
            .finish()
    }
}

impl Pool {
    /// An empty pool: metrics older than `stale_after` count as unknown, `engines` are the
    /// configured metric name sets beside the built-in ones, `ca_file` the default TLS roots
    /// (`forward.ca_file`). `Pool::from_config` (in `config.rs`) builds it from a whole
    /// configuration.
    pub fn new(
        stale_after: Duration,
        engines: BTreeMap<String, EngineMetricNames>,
        ca_file: Option<std::path::PathBuf>,
    ) -> Self {
        Pool {
            members: ArcSwap::from_pointee(Vec::new()),
            stale_after,
            waiters: Arc::new(Waiters::default()),
            engines,
            slots: Arc::new(membership::SlotIds::default()),
            generation: tokio::sync::watch::channel(0).0,
            hooks: Mutex::new(Vec::new()),
            reconciling: Mutex::new(()),
            tls: Mutex::new(ClientConfigs::new(ca_file)),
        }
    }

    /// Put the static `[[backends]]` in the pool. They are configuration: a bad one is an error
    /// naming its field (a discovered one is skipped with a warning instead).
    pub fn add_static(&self, backends: &[BackendConfig]) -> Result<(), ConfigError> {
        for (i, b) in backends.iter().enumerate() {
            let engine = self.engine(&b.engine).ok_or_else(|| {
                ConfigError::invalid(
                    format!("backends[{i}].engine"),
                    format!("unknown engine `{}`", b.engine),
                )
            })?;
            let mut tls = self
                .tls
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            Backend::new(i, b, engine, Arc::clone(&self.waiters), &mut tls)?;
        }
        let desired = backends
            .iter()
            .cloned()
            .map(crate::discovery::DesiredBackend::new)
            .collect();
        self.reconcile("static", desired);
        Ok(())
    }

    fn engine(&self, name: &str) -> Option<EngineMetricNames> {
        self.engines
            .get(name)
            .cloned()
            .or_else(|| EngineMetricNames::builtin(name))
    }

    /// The current members (a snapshot: later changes do not affect it).
    pub fn backends(&self) -> Arc<Vec<Arc<Backend>>> {
        self.members.load_full()
    }

    /// Run `hook` for every backend that leaves the pool from now on.
    pub fn on_removed(&self, hook: RemovalHook) {
        self.hooks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(hook);
    }

    /// Set `inferlb_backends{state}`: members by state (called when metrics are rendered).
    pub fn count_states(&self) {
        let clock = tokio::time::Instant::now();
        let (mut healthy, mut unhealthy, mut ejected) = (0u32, 0u32, 0u32);
        for b in self.members.load().iter() {
            if b.passive.admission(clock) == Admission::Closed {
                ejected += 1;
            } else if b.state.load().healthy {
                healthy += 1;
            } else {
                unhealthy += 1;
            }
        }
        // Departed backends still referenced by running requests.
        let draining = self
            .slots
            .in_use()
            .saturating_sub(self.members.load().len());
        for (state, n) in [
            ("healthy", healthy as f64),
            ("unhealthy", unhealthy as f64),
            ("ejected", ejected as f64),
            ("draining", draining as f64),
        ] {
            metrics::gauge!(t::BACKENDS, "state" => state).set(n);
        }
    }

    /// Follow membership changes (the value is a generation counter).
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.generation.subscribe()
    }

    pub fn stale_after(&self) -> Duration {
        self.stale_after
    }

    /// Requests waiting for an in-flight slot.
    pub fn waiters(&self) -> &Arc<Waiters> {
        &self.waiters
    }

    /// A request to `backend` failed in a way that is the backend's fault. Ejects it when its
    /// failure streak reaches the threshold, unless that would take out more than
    /// `max_ejection_percent` of the fleet (at least one backend may always go) or the last
    /// healthy backend of one of its models. Returns true when it was ejected.
    pub fn report_failure(&self, backend: &Backend, cfg: &OutlierConfig) -> bool {
        let ejected = backend
            .passive
            .record_failure(cfg, tokio::time::Instant::now(), || {
                self.may_eject(backend, cfg)
            });
        if ejected {
            tracing::warn!(backend = %backend.name, "backend ejected after consecutive failures");
            metrics::counter!(t::BACKEND_EJECTIONS, "backend" => backend.name.clone()).increment(1);
            metrics::gauge!(t::BACKEND_EJECTED, "backend" => backend.name.clone()).set(1.0);
        }
        ejected
    }

    /// A request to `backend` got a good answer.
    pub fn report_success(&self, backend: &Backend) {
        if backend.passive.record_success() {
            tracing::info!(backend = %backend.name, "probe succeeded; backend back in full service");
            metrics::gauge!(t::BACKEND_EJECTED, "backend" => backend.name.clone()).set(0.0);
        }
    }

    fn may_eject(&self, backend: &Backend, cfg: &OutlierConfig) -> bool {
        let members = self.members.load();
        let n = members.len();
        let out = members.iter().filter(|b| b.passive.is_out()).count();
        let cap = (n.saturating_mul(cfg.max_ejection_percent as usize) / 100).max(1);
        if out >= cap {
            tracing::warn!(backend = %backend.name, out, cap, "not ejecting: the fleet's ejection cap is reached");
            return false;
        }
        let others: Vec<Arc<BackendState>> = members
            .iter()
            .filter(|b| b.id != backend.id && !b.passive.is_out())
            .map(|b| b.state())
            .filter(|s| s.healthy)
            .collect();
        let state = backend.state();
        let covered = if state.models.is_empty() {
            !others.is_empty()
        } else {
            state
                .models
                .iter()
                .all(|m| others.iter().any(|o| o.serves(&m.id)))
        };
        if !covered {
            tracing::warn!(backend = %backend.name, "not ejecting: it is the last healthy backend of a model it serves");
        }
        covered
    }

    /// Some backend lists `model` in its `/v1/models` (or config).
    pub fn lists_model(&self, model: &str) -> bool {
        self.members
            .load()
            .iter()
            .any(|b| b.state.load().serves(model))
    }

    pub fn any_healthy(&self) -> bool {
        self.members.load().iter().any(|b| b.state.load().healthy)
    }

    /// Candidates for one scheduling decision among `members` (a snapshot from
    /// [`Pool::backends`]), with their states read once.
    pub fn candidates<'a>(&self, members: &'a [Arc<Backend>], now: Instant) -> Vec<Candidate<'a>> {
        let clock = tokio::time::Instant::now();
        members
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
                    ejected: backend.passive.admission(clock) == Admission::Closed,
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
    /// Passively ejected by outlier detection at decision time (or on probation with its one
    /// probe request already in flight).
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
        let mut state = BackendState::initial(None, backend.state().epoch);
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
        let waiters = Arc::new(Waiters::default());
        (0..n)
            .map(|i| {
                let cfg = BackendConfig::from_url(format!("http://127.0.0.1:{}", 10_000 + i));
                Arc::new(
                    Backend::new(
                        i,
                        &cfg,
                        EngineMetricNames::builtin("vllm").unwrap(),
                        Arc::clone(&waiters),
                        &mut ClientConfigs::default(),
                    )
                    .unwrap(),
                )
            })
            .collect()
    }

    /// Like [`backends`], published healthy.
    pub fn healthy_backends(n: usize) -> Vec<Arc<Backend>> {
        let list = backends(n);
        for b in &list {
            let mut state = (*b.state()).clone();
            state.healthy = true;
            b.publish(state);
        }
        list
    }

    /// Each of `backends` as a candidate without metrics or in-flight requests.
    pub fn candidates(backends: &[Arc<Backend>]) -> Vec<Candidate<'_>> {
        backends
            .iter()
            .map(|b| Candidate::with_metrics(b, None, 0))
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
