//! The poller: one plain loop per backend that scrapes `/metrics` every interval and
//! re-reads `/v1/models` now and then, publishing a new [`BackendState`] after each pass.
//!
//! Backends are polled by independent tasks with a per-request timeout, so one slow or hung
//! backend never delays another's picture. Health follows consecutive results: `unhealthy_after`
//! failures eject a backend, `healthy_after` successes re-admit it (the very first success
//! admits at once). A page that arrives but cannot be parsed is counted as an error and ignored:
//! the backend is up, so its health is not touched, and its previous metrics simply go stale.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderValue, Request, Uri};
use http_body_util::Full;
use serde::Deserialize;
use tokio::sync::watch;
use tokio::time::sleep_until;

use super::chars_per_token::Reading;
use super::engine::{extract, LoadMetrics};
use super::{Backend, BackendState, ModelEntry, Pool};
use crate::endpoints::PollerConfig;
use crate::forward::pool::{self, Conn};
use crate::telemetry as t;

/// The result of one scrape.
#[derive(Debug)]
pub enum Scrape {
    Ok(LoadMetrics),
    /// The server answered 2xx but the page is not usable.
    Unusable(String),
    /// Connect error, timeout or error status.
    Failed(String),
}

/// Pure health/metrics transition, kept apart from I/O so it can be tested exhaustively.
pub fn next_state(
    prev: &BackendState,
    scrape: Scrape,
    cfg: &PollerConfig,
    now: Instant,
) -> BackendState {
    let mut next = prev.clone();
    let answered = match scrape {
        Scrape::Ok(metrics) => {
            // A prefix-cache counter going backwards means the server restarted with a cold cache.
            let restarted = matches!(
                (prev.metrics.as_ref().and_then(|(m, _)| m.prefix_cache_queries), metrics.prefix_cache_queries),
                (Some(before), Some(after)) if after < before
            );
            if restarted && prev.healthy {
                next.epoch += 1;
            }
            next.metrics = Some((metrics, now));
            next.last_error = None;
            true
        }
        // The server is up (it answered 2xx) but its page is unusable: health as for a
        // success, while its old metrics are kept with their old time and go stale.
        Scrape::Unusable(reason) => {
            next.last_error = Some(reason);
            true
        }
        Scrape::Failed(reason) => {
            next.last_error = Some(reason);
            false
        }
    };
    if answered {
        next.consecutive_failures = 0;
        next.consecutive_successes = prev.consecutive_successes.saturating_add(1);
        let first_ever = !prev.healthy && !prev.seen;
        if !prev.healthy && (first_ever || next.consecutive_successes >= cfg.healthy_after) {
            next.healthy = true;
            if !first_ever {
                next.epoch += 1;
            }
        }
        next.seen = true;
    } else {
        next.consecutive_successes = 0;
        next.consecutive_failures = prev.consecutive_failures.saturating_add(1);
        if prev.healthy && next.consecutive_failures >= cfg.unhealthy_after {
            next.healthy = false;
        }
    }
    next
}

/// Largest page or model list read from a backend.
const MAX_BODY: usize = 16 << 20;
/// At most this many models per backend are kept from `/v1/models` (ids become metric labels).
pub const MAX_MODELS: usize = 1024;
/// Longest model id kept (bytes).
pub const MAX_MODEL_ID_BYTES: usize = 256;

/// Why a GET to a backend failed; `kind` is the label of the scrape-error counter.
struct FetchError {
    kind: &'static str,
    reason: String,
}

/// The keep-alive connection of one backend's poll loop, kept between scrapes.
type ConnSlot = Option<Conn>;

/// What one backend's loop scrapes. vLLM serves `/metrics` itself whole, but `/metrics/` through
/// `prometheus_client`'s exposition app, which honours `?name[]=…` (a 1.5 KB page instead of
/// 50 KB on vLLM 0.32). A backend that answers the filtered path with an error or with a page
/// that lacks every load signal is read at `/metrics` from then on.
struct Target {
    uri: Uri,
    filtered: bool,
}

impl Target {
    fn plain() -> Self {
        Target {
            uri: Uri::from_static("/metrics"),
            filtered: false,
        }
    }
}

/// Scrapes backends; cheap to clone.
///
/// Each backend's loop keeps one keep-alive connection and drives it itself (see
/// [`crate::forward::pool`]): a scrape is one task reading one socket, with no client task or
/// channel between the bytes and the parser.
#[derive(Clone)]
pub struct Poller {
    pool: Arc<Pool>,
    cfg: PollerConfig,
}

/// One backend's metric handles, looked up once per loop instead of once per scrape.
struct Handles {
    scrape_duration: metrics::Histogram,
    healthy: metrics::Gauge,
    inflight: metrics::Gauge,
    ejected: metrics::Gauge,
    kv_usage: metrics::Gauge,
    chars_per_token: metrics::Gauge,
    traffic_share: metrics::Gauge,
    waiting: metrics::Gauge,
    running: metrics::Gauge,
    /// `inferlb_backend_info{backend, role}`, always 1 (its labels are the information).
    info: metrics::Gauge,
}

impl Handles {
    fn new(backend: &Backend) -> Self {
        let b = backend.name.clone();
        Handles {
            scrape_duration: metrics::histogram!(t::BACKEND_SCRAPE_DURATION, "backend" => b.clone()),
            healthy: metrics::gauge!(t::BACKEND_HEALTHY, "backend" => b.clone()),
            inflight: metrics::gauge!(t::BACKEND_INFLIGHT, "backend" => b.clone()),
            ejected: metrics::gauge!(t::BACKEND_EJECTED, "backend" => b.clone()),
            kv_usage: metrics::gauge!(t::BACKEND_KV_USAGE, "backend" => b.clone()),
            chars_per_token: metrics::gauge!(t::BACKEND_CHARS_PER_TOKEN, "backend" => b.clone()),
            traffic_share: metrics::gauge!(t::BACKEND_TRAFFIC_SHARE, "backend" => b.clone()),
            waiting: metrics::gauge!(t::BACKEND_WAITING, "backend" => b.clone()),
            running: metrics::gauge!(t::BACKEND_RUNNING, "backend" => b.clone()),
            info: metrics::gauge!(t::BACKEND_INFO, "backend" => b, "role" => backend.role.as_str()),
        }
    }
}

/// The first tick at or after `now` on the grid `epoch + k × interval`: every loop ticks on
/// the same grid, so the runtime wakes once per interval for all backends rather than once per
/// backend at scattered instants.
fn next_tick(epoch: Instant, interval: std::time::Duration, now: Instant) -> Instant {
    let step = interval.as_nanos().max(1);
    let k = now.saturating_duration_since(epoch).as_nanos() / step + 1;
    epoch + std::time::Duration::from_nanos(u64::try_from(k * step).unwrap_or(u64::MAX))
}

#[derive(Deserialize)]
struct ModelList {
    data: Vec<serde_json::Value>,
}

impl Poller {
    pub fn new(pool: Arc<Pool>, cfg: PollerConfig) -> Self {
        Poller { pool, cfg }
    }

    /// Poll every backend once, concurrently, and wait for all of them (bounded by the timeout).
    pub async fn first_pass(&self) {
        let members = self.pool.backends();
        let passes = members.iter().map(|b| async {
            self.poll_once(&mut None, &mut self.target(b), &Handles::new(b), b, true)
                .await
        });
        futures_util::future::join_all(passes).await;
    }

    /// Keep one loop per member backend — started when a backend joins, stopped when it
    /// leaves — until `shutdown` changes or is dropped.
    ///
    /// The loops run on a thread of their own with a single-threaded runtime: thousands of
    /// small scrapes a second then cost no cross-thread wake-ups, and a burst of scrape work
    /// never queues behind (or in front of) request handling on the main runtime. If that
    /// thread cannot be started, the loops run on the current runtime instead.
    pub fn spawn(&self, shutdown: watch::Receiver<bool>) {
        let this = self.clone();
        let loops = move || this.supervise(shutdown);
        crate::background::spawn_on_own_thread("inferlb-poller", "poller", loops);
    }

    /// Follow membership: start a loop for each backend that joins, stop the loop of each that
    /// leaves. The work per change is one pass over the members.
    async fn supervise(self, mut shutdown: watch::Receiver<bool>) {
        let epoch = Instant::now();
        let mut loops = tokio::task::JoinSet::new();
        let mut running: HashMap<usize, tokio::task::AbortHandle> = HashMap::new();
        let mut changes = self.pool.changes();
        loop {
            let members = self.pool.backends();
            let live: HashSet<usize> = members.iter().map(|b| b.uid).collect();
            running.retain(|uid, handle| {
                let keep = live.contains(uid);
                if !keep {
                    handle.abort();
                }
                keep
            });
            for backend in members.iter() {
                if let std::collections::hash_map::Entry::Vacant(slot) = running.entry(backend.uid)
                {
                    slot.insert(loops.spawn(self.clone().run(
                        Arc::clone(backend),
                        epoch,
                        shutdown.clone(),
                    )));
                }
            }
            drop(members);
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { break },
                _ = shutdown.changed() => break,
                // Reap loops that ended (aborted ones, or a shutdown).
                Some(_) = loops.join_next(), if !loops.is_empty() => {}
            }
        }
        loops.shutdown().await;
    }

    /// One backend's loop: scrape on every tick of the shared grid until shutdown.
    async fn run(self, backend: Arc<Backend>, epoch: Instant, mut shutdown: watch::Receiver<bool>) {
        let mut conn: ConnSlot = None;
        let mut target = self.target(&backend);
        let handles = Handles::new(&backend);
        let interval = self.cfg.interval();
        let mut next = next_tick(epoch, interval, Instant::now());
        let mut models_due = Instant::now() + self.cfg.models_interval();
        loop {
            tokio::select! {
                _ = sleep_until(next.into()) => {}
                _ = shutdown.changed() => break,
            }
            let now = Instant::now();
            let refresh_models = now >= models_due;
            if refresh_models {
                models_due = now + self.cfg.models_interval();
            }
            self.poll_once(&mut conn, &mut target, &handles, &backend, refresh_models)
                .await;
            // The next grid tick: missed ticks after a slow scrape are skipped.
            next = next_tick(epoch, interval, Instant::now());
        }
    }

    /// What to scrape on `backend` first: the filtered page when enabled.
    fn target(&self, backend: &Backend) -> Target {
        if !self.cfg.filter_metrics {
            return Target::plain();
        }
        match Uri::try_from(format!("/metrics/?{}", backend.engine.filter_query())) {
            Ok(uri) => Target {
                uri,
                filtered: true,
            },
            Err(_) => Target::plain(),
        }
    }

    async fn poll_once(
        &self,
        conn: &mut ConnSlot,
        target: &mut Target,
        handles: &Handles,
        backend: &Backend,
        refresh_models: bool,
    ) {
        let started = Instant::now();
        // Read before the scrape: every prompt and request counted here was counted by the
        // backend.
        let (served_chars, served_requests) = (
            backend.work().served_chars(),
            backend.work().served_requests(),
        );
        let mut scrape = self.scrape(conn, target, backend).await;
        if target.filtered && matches!(scrape, Scrape::Unusable(_)) {
            tracing::info!(backend = %backend.name, path = %target.uri, "no usable filtered metrics page; reading /metrics whole");
            *target = Target::plain();
            scrape = self.scrape(conn, target, backend).await;
        }
        handles
            .scrape_duration
            .record(started.elapsed().as_secs_f64());
        let prev = backend.state();
        let fresh = matches!(scrape, Scrape::Ok(_));
        let mut next = next_state(&prev, scrape, &self.cfg, Instant::now());
        if fresh {
            let metrics = next.metrics.as_ref().map(|(m, _)| m);
            let reading = Reading {
                chars: served_chars,
                own: served_requests,
                tokens: metrics.and_then(|m| m.prefix_cache_queries),
                finished: metrics.and_then(|m| m.requests_finished),
            };
            next.chars_per_token = prev
                .chars_per_token
                .observe(reading, next.epoch != prev.epoch);
            if let Some(r) = next.chars_per_token.ratio() {
                handles.chars_per_token.set(r);
            }
            if let Some(share) = next.chars_per_token.share() {
                handles.traffic_share.set(share);
            }
        }
        // Discover models at start, periodically, on re-admission, and while none are known.
        let need_models = !backend.static_models
            && next.healthy
            && (refresh_models || prev.models.is_empty() || !prev.healthy);
        if need_models {
            match self.models(conn, backend).await {
                Ok(models) => next.models = models,
                Err(e) => {
                    tracing::warn!(backend = %backend.name, error = %e, "model discovery failed")
                }
            }
        }
        if prev.healthy != next.healthy {
            if next.healthy {
                tracing::info!(backend = %backend.name, "backend admitted");
            } else {
                tracing::warn!(backend = %backend.name, error = ?next.last_error, "backend ejected");
            }
        }
        handles.healthy.set(if next.healthy { 1.0 } else { 0.0 });
        handles.info.set(1.0);
        // Refreshed every pass so a member's series never idle out (see telemetry).
        handles.inflight.set(backend.inflight() as f64);
        let out = backend.passive().is_out();
        handles.ejected.set(if out { 1.0 } else { 0.0 });
        if let Some((m, _)) = &next.metrics {
            if let Some(v) = m.kv_usage {
                handles.kv_usage.set(v);
            }
            if let Some(v) = m.waiting {
                handles.waiting.set(v);
            }
            if let Some(v) = m.running {
                handles.running.set(v);
            }
        }
        backend.publish(next);
    }

    /// One scrape of `target`. On the filtered path, an answer that is not a usable page
    /// (error status, garbage, no load signal at all) is reported as `Unusable` without being
    /// counted, so the caller can fall back to the plain path.
    async fn scrape(&self, conn: &mut ConnSlot, target: &Target, backend: &Backend) -> Scrape {
        let trial = target.filtered;
        let fail = |kind: &'static str, reason: String| {
            metrics::counter!(t::BACKEND_SCRAPE_ERRORS, "backend" => backend.name.clone(), "kind" => kind)
                .increment(1);
            reason
        };
        // On the filtered path, an answer that is not a usable page is not counted: the caller
        // falls back to `/metrics`, where it is.
        let unusable = |kind: &'static str, reason: String| {
            Scrape::Unusable(if trial { reason } else { fail(kind, reason) })
        };
        let url = &backend.name;
        let bytes = match self.get(conn, backend, &target.uri).await {
            Ok(b) => b,
            Err(e) if trial && e.kind == "status" => {
                return unusable("status", format!("GET {url}{}: {}", target.uri, e.reason))
            }
            Err(e) => {
                return Scrape::Failed(fail(
                    e.kind,
                    format!("GET {url}{}: {}", target.uri, e.reason),
                ))
            }
        };
        // Raw bytes and a UTF-8 check: no charset sniffing or lossy copy of a 50 KB page.
        let Ok(page) = std::str::from_utf8(&bytes) else {
            return unusable(
                "parse",
                format!("GET {url}{}: the page is not UTF-8", target.uri),
            );
        };
        match extract(page, &backend.engine) {
            Ok(m)
                if trial && m.waiting.is_none() && m.running.is_none() && m.kv_usage.is_none() =>
            {
                unusable("parse", format!("GET {url}{}: no load signal", target.uri))
            }
            Ok(m) => Scrape::Ok(m),
            Err(e) => unusable("parse", format!("GET {url}{}: {e}", target.uri)),
        }
    }

    /// GET `path` on `backend` (with its credentials, if any) over the loop's connection,
    /// opening one if there is none or the old one closed; the whole exchange is bounded by
    /// the poll timeout. A 2xx answer's body is returned, any other status is an error; a
    /// failed or timed-out exchange also drops the connection.
    async fn get(
        &self,
        slot: &mut ConnSlot,
        backend: &Backend,
        uri: &Uri,
    ) -> Result<Bytes, FetchError> {
        let host = HeaderValue::from_str(backend.authority.as_str()).map_err(|e| FetchError {
            kind: "connect",
            reason: e.to_string(),
        })?;
        let make = || {
            let mut request = Request::new(Full::new(Bytes::new()));
            *request.uri_mut() = uri.clone();
            request
                .headers_mut()
                .insert(http::header::HOST, host.clone());
            if let Some(auth) = &backend.authorization {
                request
                    .headers_mut()
                    .insert(http::header::AUTHORIZATION, auth.clone());
            }
            request
        };
        let timeout = self.cfg.timeout();
        let exchange = async {
            // The backend may close a kept connection at any moment, even as the request goes
            // out. A scrape is an idempotent GET, so whatever fails on a kept connection is
            // tried once more on a fresh one.
            if let Some(mut conn) = slot.take().and_then(|mut c| c.reusable().then_some(c)) {
                if let Ok(answer) = conn.fetch(make(), MAX_BODY).await {
                    return Ok((conn, answer));
                }
            }
            let mut conn = backend.connector.connect(timeout).await?;
            let answer = conn.fetch(make(), MAX_BODY).await?;
            Ok::<_, pool::ConnError>((conn, answer))
        };
        let (conn, (status, body)) = match tokio::time::timeout(timeout, exchange).await {
            Err(_) => {
                return Err(FetchError {
                    kind: "timeout",
                    reason: format!("no answer within {} ms", timeout.as_millis()),
                })
            }
            Ok(Err(e)) => {
                let kind = match e {
                    pool::ConnError::TooLarge(_) => "parse",
                    pool::ConnError::Tls { .. } => "tls",
                    _ => "connect",
                };
                return Err(FetchError {
                    kind,
                    reason: e.to_string(),
                });
            }
            Ok(Ok(done)) => done,
        };
        *slot = Some(conn);
        if !status.is_success() {
            return Err(FetchError {
                kind: "status",
                reason: format!("status {status}"),
            });
        }
        Ok(body)
    }

    async fn models(
        &self,
        conn: &mut ConnSlot,
        backend: &Backend,
    ) -> Result<Arc<[ModelEntry]>, String> {
        let bytes = self
            .get(conn, backend, &Uri::from_static("/v1/models"))
            .await
            .map_err(|e| e.reason)?;
        let list: ModelList =
            serde_json::from_slice(&bytes).map_err(|e| format!("invalid model list: {e}"))?;
        // Model ids become metric labels and admin output: keep a bounded number of sane ones.
        let mut seen = std::collections::HashSet::new();
        let models: Vec<ModelEntry> = list
            .data
            .into_iter()
            .filter_map(|object| {
                let id = object.get("id")?.as_str()?.to_owned();
                let sane = !id.is_empty()
                    && id.len() <= MAX_MODEL_ID_BYTES
                    && !id.chars().any(char::is_control);
                (sane && seen.insert(id.clone())).then_some(ModelEntry { id, object })
            })
            .take(MAX_MODELS)
            .collect();
        Ok(models.into())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn cfg() -> PollerConfig {
        PollerConfig {
            unhealthy_after: 3,
            healthy_after: 2,
            ..Default::default()
        }
    }

    fn ok(q: Option<f64>) -> Scrape {
        Scrape::Ok(LoadMetrics {
            prefix_cache_queries: q,
            ..Default::default()
        })
    }

    fn fresh() -> BackendState {
        BackendState::initial(None, 0)
    }

    #[test]
    fn ticks_fall_on_one_grid() {
        let epoch = Instant::now();
        let i = std::time::Duration::from_millis(50);
        let at = |ms| epoch + std::time::Duration::from_millis(ms);
        assert_eq!(next_tick(epoch, i, epoch), at(50));
        assert_eq!(next_tick(epoch, i, at(49)), at(50));
        assert_eq!(next_tick(epoch, i, at(50)), at(100));
        assert_eq!(
            next_tick(epoch, i, at(173)),
            at(200),
            "missed ticks are skipped"
        );
    }

    #[test]
    fn first_success_admits_at_once_without_new_epoch() {
        let s = next_state(&fresh(), ok(None), &cfg(), Instant::now());
        assert!(s.healthy);
        assert_eq!(s.epoch, 0);
    }

    #[test]
    fn ejected_after_n_failures_and_readmitted_after_m_successes() {
        let c = cfg();
        let now = Instant::now();
        let mut s = next_state(&fresh(), ok(None), &c, now);
        for i in 1..=3 {
            s = next_state(&s, Scrape::Failed("x".into()), &c, now);
            assert_eq!(s.healthy, i < 3, "after {i} failures");
        }
        s = next_state(&s, ok(None), &c, now);
        assert!(!s.healthy, "one success is not enough");
        s = next_state(&s, Scrape::Failed("x".into()), &c, now);
        s = next_state(&s, ok(None), &c, now);
        assert!(!s.healthy, "successes must be consecutive");
        s = next_state(&s, ok(None), &c, now);
        assert!(s.healthy);
        assert_eq!(s.epoch, 1, "re-admission forgets affinity");
    }

    #[test]
    fn failures_before_first_success_keep_it_out() {
        let c = cfg();
        let s = next_state(
            &fresh(),
            Scrape::Failed("refused".into()),
            &c,
            Instant::now(),
        );
        assert!(!s.healthy);
        assert_eq!(s.last_error.as_deref(), Some("refused"));
    }

    #[test]
    fn unusable_page_keeps_health_and_old_metrics() {
        let c = cfg();
        let now = Instant::now();
        let s = next_state(&fresh(), ok(Some(5.0)), &c, now);
        let t = next_state(
            &s,
            Scrape::Unusable("garbage".into()),
            &c,
            now + std::time::Duration::from_secs(1),
        );
        assert!(t.healthy);
        assert_eq!(
            t.metrics.as_ref().unwrap().1,
            now,
            "old metrics kept with their old time"
        );
        assert_eq!(t.consecutive_failures, 0);
    }

    #[test]
    fn a_server_with_an_unusable_page_is_admitted_without_metrics() {
        let s = next_state(
            &fresh(),
            Scrape::Unusable("garbage".into()),
            &cfg(),
            Instant::now(),
        );
        assert!(s.healthy);
        assert!(s.metrics.is_none());
    }

    #[test]
    fn counter_reset_bumps_epoch() {
        let c = cfg();
        let now = Instant::now();
        let s = next_state(&fresh(), ok(Some(100.0)), &c, now);
        let s = next_state(&s, ok(Some(150.0)), &c, now);
        assert_eq!(s.epoch, 0);
        let s = next_state(&s, ok(Some(10.0)), &c, now);
        assert_eq!(s.epoch, 1);
    }
}
