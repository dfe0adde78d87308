//! The poller: one plain loop per backend that scrapes `/metrics` every interval and
//! re-reads `/v1/models` now and then, publishing a new [`BackendState`] after each pass.
//!
//! Backends are polled by independent tasks with a per-request timeout, so one slow or hung
//! backend never delays another's picture. Health follows consecutive results: `unhealthy_after`
//! failures eject a backend, `healthy_after` successes re-admit it (the very first success
//! admits at once). A page that arrives but cannot be parsed is counted as an error and ignored:
//! the backend is up, so its health is not touched, and its previous metrics simply go stale.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderValue, Request};
use http_body_util::Full;
use serde::Deserialize;
use tokio::sync::watch;
use tokio::time::sleep_until;

use super::engine::{extract, LoadMetrics};
use super::{Backend, BackendState, ModelEntry, Pool};
use crate::config::PollerConfig;
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
        let first_ever = !prev.healthy && prev.epoch == 0 && !prev.seen;
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

/// Why a GET to a backend failed; `kind` is the label of the scrape-error counter.
struct FetchError {
    kind: &'static str,
    reason: String,
}

/// The keep-alive connection of one backend's poll loop, kept between scrapes.
type ConnSlot = Option<Conn>;

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
        let passes = self
            .pool
            .backends()
            .iter()
            .map(|b| async { self.poll_once(&mut None, b, true).await });
        futures_util::future::join_all(passes).await;
    }

    /// Start one loop per backend; they stop when `shutdown` changes or is dropped.
    pub fn spawn(&self, shutdown: watch::Receiver<bool>) {
        for backend in self.pool.backends() {
            let this = self.clone();
            let backend = Arc::clone(backend);
            let mut shutdown = shutdown.clone();
            tokio::spawn(async move {
                let mut conn: ConnSlot = None;
                let interval = this.cfg.interval();
                let mut next = Instant::now() + interval;
                let mut models_due = Instant::now() + this.cfg.models_interval();
                loop {
                    tokio::select! {
                        _ = sleep_until(next.into()) => {}
                        _ = shutdown.changed() => break,
                    }
                    let now = Instant::now();
                    let refresh_models = now >= models_due;
                    if refresh_models {
                        models_due = now + this.cfg.models_interval();
                    }
                    this.poll_once(&mut conn, &backend, refresh_models).await;
                    // Skip missed ticks instead of bursting to catch up after a slow scrape.
                    next = (next + interval).max(Instant::now());
                }
            });
        }
    }

    async fn poll_once(&self, conn: &mut ConnSlot, backend: &Backend, refresh_models: bool) {
        let started = Instant::now();
        let scrape = self.scrape(conn, backend).await;
        let label = backend.name.clone();
        metrics::histogram!(t::BACKEND_SCRAPE_DURATION, "backend" => label.clone())
            .record(started.elapsed().as_secs_f64());
        let prev = backend.state();
        let mut next = next_state(&prev, scrape, &self.cfg, Instant::now());
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
        metrics::gauge!(t::BACKEND_HEALTHY, "backend" => label.clone()).set(if next.healthy {
            1.0
        } else {
            0.0
        });
        if let Some((m, _)) = &next.metrics {
            if let Some(v) = m.kv_usage {
                metrics::gauge!(t::BACKEND_KV_USAGE, "backend" => label.clone()).set(v);
            }
            if let Some(v) = m.waiting {
                metrics::gauge!(t::BACKEND_WAITING, "backend" => label.clone()).set(v);
            }
            if let Some(v) = m.running {
                metrics::gauge!(t::BACKEND_RUNNING, "backend" => label).set(v);
            }
        }
        backend.publish(next);
    }

    async fn scrape(&self, conn: &mut ConnSlot, backend: &Backend) -> Scrape {
        let fail = |kind: &'static str, reason: String| {
            metrics::counter!(t::BACKEND_SCRAPE_ERRORS, "backend" => backend.name.clone(), "kind" => kind)
                .increment(1);
            reason
        };
        let url = &backend.name;
        let bytes = match self.get(conn, backend, "/metrics").await {
            Ok(b) => b,
            Err(e) => {
                return Scrape::Failed(fail(e.kind, format!("GET {url}/metrics: {}", e.reason)))
            }
        };
        // Raw bytes and a UTF-8 check: no charset sniffing or lossy copy of a 50 KB page.
        let Ok(page) = std::str::from_utf8(&bytes) else {
            return Scrape::Unusable(fail(
                "parse",
                format!("GET {url}/metrics: the page is not UTF-8"),
            ));
        };
        match extract(page, &backend.engine) {
            Ok(m) => Scrape::Ok(m),
            Err(e) => Scrape::Unusable(fail("parse", format!("GET {url}/metrics: {e}"))),
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
        path: &'static str,
    ) -> Result<Bytes, FetchError> {
        let host = HeaderValue::from_str(backend.authority.as_str()).map_err(|e| FetchError {
            kind: "connect",
            reason: e.to_string(),
        })?;
        let make = || {
            let mut request = Request::new(Full::new(Bytes::new()));
            *request.uri_mut() = http::Uri::from_static(path);
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
            let kept = slot.take().and_then(|mut c| c.reusable().then_some(c));
            let reused = kept.is_some();
            let mut conn = match kept {
                Some(c) => c,
                None => pool::connect(&backend.authority, timeout).await?,
            };
            let answer = match conn.fetch(make(), MAX_BODY).await {
                // The backend closed the kept connection before the request left: reconnect.
                Err(pool::ConnError::NotSent) if reused => {
                    conn = pool::connect(&backend.authority, timeout).await?;
                    conn.fetch(make(), MAX_BODY).await?
                }
                other => other?,
            };
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
            .get(conn, backend, "/v1/models")
            .await
            .map_err(|e| e.reason)?;
        let list: ModelList =
            serde_json::from_slice(&bytes).map_err(|e| format!("invalid model list: {e}"))?;
        Ok(list
            .data
            .into_iter()
            .filter_map(|object| {
                let id = object.get("id")?.as_str()?.to_owned();
                Some(ModelEntry { id, object })
            })
            .collect())
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
        BackendState::initial(None)
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
