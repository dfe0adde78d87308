//! Passive health (outlier detection): eject a backend that keeps failing real requests, and
//! let it back in through one probe request.
//!
//! ```text
//!   serving ──(consecutive_failures in a row, fleet cap allows)──► ejected for T(k)
//!   ejected ──(T(k) elapsed)──► probation: exactly one request (the probe) may go there
//!   probation ──probe succeeds──► serving (k reset)
//!   probation ──probe fails─────► ejected for T(k+1)
//!   probation ──probe abandoned─► probation (the next request probes)
//!   T(k) = min(max_ejection, base_ejection × 2^(k−1)), k = ejections since the last success
//! ```
//!
//! Failures are connect errors, timeouts and 5xx answers that are the backend's fault (the
//! scheduling layer does not count a 5xx that several backends returned for the same request:
//! that is a poison request, not a bad backend). Whether an ejection may happen is the pool's
//! call ([`super::Pool::report_failure`]): at most `max_ejection_percent` of the fleet (at least
//! one backend) is out at once, and never the last healthy backend of a model.
//!
//! Time is tokio's clock, so the back-off is tested with a paused clock. The request path reads
//! one atomic flag per candidate; the state behind it is only locked while a backend is out or
//! on probation.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::endpoints::OutlierConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Serving,
    Ejected {
        until: Instant,
    },
    /// Back after an ejection; `claimed` while the probe request is in flight.
    Probation {
        claimed: bool,
    },
}

#[derive(Debug)]
struct Inner {
    phase: Phase,
}

/// What a scheduling decision may do with a backend right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Full traffic.
    Open,
    /// Out: ejected, or on probation with its probe already in flight.
    Closed,
    /// On probation with no probe in flight: the next request may be the probe.
    Probe,
}

/// What the admin view shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Serving,
    Ejected { remaining: Duration },
    Probation { probe_in_flight: bool },
}

#[derive(Debug)]
pub struct PassiveHealth {
    /// Fast path: false while serving, so a decision reads one atomic per candidate.
    out: AtomicBool,
    consecutive: AtomicU32,
    /// Ejections since the last success (the exponent of the back-off).
    ejections: AtomicU32,
    total_ejections: AtomicU32,
    inner: Mutex<Inner>,
}

impl Default for PassiveHealth {
    fn default() -> Self {
        PassiveHealth {
            out: AtomicBool::new(false),
            consecutive: AtomicU32::new(0),
            ejections: AtomicU32::new(0),
            total_ejections: AtomicU32::new(0),
            inner: Mutex::new(Inner {
                phase: Phase::Serving,
            }),
        }
    }
}

/// `min(max, base × 2^(k−1))` for the k-th ejection in a row.
fn ejection_length(cfg: &OutlierConfig, k: u32) -> Duration {
    let factor = 1u64 << k.saturating_sub(1).min(16);
    Duration::from_millis(
        cfg.base_ejection_ms
            .saturating_mul(factor)
            .min(cfg.max_ejection_ms),
    )
}

impl PassiveHealth {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Where the backend stands for a decision made at `now`. An ejection that has run out
    /// turns into probation here.
    pub fn admission(&self, now: Instant) -> Admission {
        if !self.out.load(Ordering::Acquire) {
            return Admission::Open;
        }
        let mut inner = self.lock();
        match inner.phase {
            Phase::Serving => Admission::Open,
            Phase::Ejected { until } if now < until => Admission::Closed,
            Phase::Ejected { .. } => {
                inner.phase = Phase::Probation { claimed: false };
                Admission::Probe
            }
            Phase::Probation { claimed: true } => Admission::Closed,
            Phase::Probation { claimed: false } => Admission::Probe,
        }
    }

    /// Take the probe slot of a backend on probation. `Open` when it is serving (no probe
    /// needed), `Probe` when this caller now holds the probe, `Closed` when it may not be used.
    pub fn claim(&self, now: Instant) -> Admission {
        match self.admission(now) {
            Admission::Probe => {
                let mut inner = self.lock();
                if inner.phase == (Phase::Probation { claimed: false }) {
                    inner.phase = Phase::Probation { claimed: true };
                    Admission::Probe
                } else {
                    Admission::Closed
                }
            }
            other => other,
        }
    }

    /// The probe ended without an outcome (client gone, request not sent): let the next
    /// request probe.
    pub fn release_probe(&self) {
        let mut inner = self.lock();
        if inner.phase == (Phase::Probation { claimed: true }) {
            inner.phase = Phase::Probation { claimed: false };
        }
    }

    /// Out of the fleet for the ejection cap: ejected or on probation.
    pub fn is_out(&self) -> bool {
        self.out.load(Ordering::Acquire) && self.lock().phase != Phase::Serving
    }

    /// A request succeeded: the failure streak and the back-off exponent reset; a probe's
    /// success brings the backend back to full traffic (then true is returned).
    pub fn record_success(&self) -> bool {
        // Loads first: on the common path nothing is written, so the line is not bounced
        // between cores on every response.
        if self.consecutive.load(Ordering::Relaxed) != 0 {
            self.consecutive.store(0, Ordering::Relaxed);
        }
        if self.out.load(Ordering::Acquire) {
            let mut inner = self.lock();
            if matches!(inner.phase, Phase::Probation { .. }) {
                inner.phase = Phase::Serving;
                self.ejections.store(0, Ordering::Relaxed);
                self.out.store(false, Ordering::Release);
                return true;
            }
        } else if self.ejections.load(Ordering::Relaxed) != 0 {
            self.ejections.store(0, Ordering::Relaxed);
        }
        false
    }

    /// Count a failure at `now`. `may_eject` is asked only when this failure would eject (it
    /// applies the fleet-wide cap). Returns true when the backend was ejected by this call.
    pub fn record_failure(
        &self,
        cfg: &OutlierConfig,
        now: Instant,
        may_eject: impl FnOnce() -> bool,
    ) -> bool {
        if cfg.consecutive_failures == 0 {
            return false;
        }
        if self.out.load(Ordering::Acquire) {
            let mut inner = self.lock();
            return match inner.phase {
                // The probe failed: straight back out, for longer. It is already counted as
                // out of the fleet, so the cap does not apply again.
                Phase::Probation { .. } => {
                    self.eject(&mut inner, cfg, now);
                    true
                }
                // Answers to requests sent before the ejection.
                Phase::Ejected { .. } | Phase::Serving => false,
            };
        }
        let n = self
            .consecutive
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        if n < cfg.consecutive_failures || !may_eject() {
            return false;
        }
        let mut inner = self.lock();
        if inner.phase != Phase::Serving {
            return false;
        }
        self.eject(&mut inner, cfg, now);
        true
    }

    fn eject(&self, inner: &mut Inner, cfg: &OutlierConfig, now: Instant) {
        let k = self
            .ejections
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        inner.phase = Phase::Ejected {
            until: now + ejection_length(cfg, k),
        };
        self.consecutive.store(0, Ordering::Relaxed);
        self.total_ejections.fetch_add(1, Ordering::Relaxed);
        self.out.store(true, Ordering::Release);
    }

    /// Ejections since start, for the admin view.
    pub fn total_ejections(&self) -> u32 {
        self.total_ejections.load(Ordering::Relaxed)
    }

    pub fn status(&self, now: Instant) -> Status {
        if !self.out.load(Ordering::Acquire) {
            return Status::Serving;
        }
        match self.lock().phase {
            Phase::Serving => Status::Serving,
            Phase::Ejected { until } if now < until => Status::Ejected {
                remaining: until - now,
            },
            Phase::Ejected { .. } => Status::Probation {
                probe_in_flight: false,
            },
            Phase::Probation { claimed } => Status::Probation {
                probe_in_flight: claimed,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(base: u64, max: u64) -> OutlierConfig {
        OutlierConfig {
            consecutive_failures: 3,
            base_ejection_ms: base,
            max_ejection_ms: max,
            ..OutlierConfig::default()
        }
    }

    fn fail(p: &PassiveHealth, c: &OutlierConfig) -> bool {
        p.record_failure(c, Instant::now(), || true)
    }

    /// Eject `p` (three failures) and return the ejection's length.
    fn eject(p: &PassiveHealth, c: &OutlierConfig) -> Duration {
        for _ in 0..2 {
            assert!(!fail(p, c));
        }
        assert!(fail(p, c));
        match p.status(Instant::now()) {
            Status::Ejected { remaining } => remaining,
            other => panic!("not ejected: {other:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn ejects_after_consecutive_failures_only() {
        let p = PassiveHealth::default();
        let c = cfg(60_000, 300_000);
        assert!(!fail(&p, &c));
        assert!(!fail(&p, &c));
        p.record_success();
        assert!(!fail(&p, &c));
        assert!(!fail(&p, &c));
        assert_eq!(p.admission(Instant::now()), Admission::Open);
        assert!(fail(&p, &c));
        assert_eq!(p.admission(Instant::now()), Admission::Closed);
        assert_eq!(
            p.status(Instant::now()),
            Status::Ejected {
                remaining: Duration::from_secs(60)
            }
        );
        assert!(p.is_out());
    }

    /// The back-off doubles per ejection in a row, stops at the cap, and a probe's success
    /// resets it; all on tokio's paused clock.
    #[tokio::test(start_paused = true)]
    async fn probation_admits_one_probe_and_backoff_doubles_to_the_cap() {
        let p = PassiveHealth::default();
        let c = cfg(1_000, 3_000);
        assert_eq!(eject(&p, &c), Duration::from_secs(1));
        tokio::time::advance(Duration::from_millis(999)).await;
        assert_eq!(p.admission(Instant::now()), Admission::Closed);
        tokio::time::advance(Duration::from_millis(1)).await;
        // Probation: one probe, and nobody else while it is in flight.
        assert_eq!(p.admission(Instant::now()), Admission::Probe);
        assert_eq!(p.claim(Instant::now()), Admission::Probe);
        assert_eq!(p.claim(Instant::now()), Admission::Closed);
        assert_eq!(p.admission(Instant::now()), Admission::Closed);
        // The probe fails: out again, twice as long, without needing three failures.
        assert!(fail(&p, &c));
        assert_eq!(
            p.status(Instant::now()),
            Status::Ejected {
                remaining: Duration::from_secs(2)
            }
        );
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(p.claim(Instant::now()), Admission::Probe);
        assert!(fail(&p, &c));
        // Third in a row: 4 s capped at 3 s.
        assert_eq!(
            p.status(Instant::now()),
            Status::Ejected {
                remaining: Duration::from_secs(3)
            }
        );
        tokio::time::advance(Duration::from_secs(3)).await;
        // An abandoned probe lets the next request probe.
        assert_eq!(p.claim(Instant::now()), Admission::Probe);
        p.release_probe();
        assert_eq!(p.claim(Instant::now()), Admission::Probe);
        // The probe succeeds: full traffic, and the next ejection starts from the base again.
        p.record_success();
        assert_eq!(p.admission(Instant::now()), Admission::Open);
        assert!(!p.is_out());
        assert_eq!(eject(&p, &c), Duration::from_secs(1));
        assert_eq!(p.total_ejections(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn failures_while_ejected_do_not_extend_it_and_the_cap_can_refuse() {
        let p = PassiveHealth::default();
        let c = cfg(1_000, 10_000);
        eject(&p, &c);
        for _ in 0..10 {
            assert!(
                !fail(&p, &c),
                "late answers of requests sent before the ejection"
            );
        }
        assert_eq!(
            p.status(Instant::now()),
            Status::Ejected {
                remaining: Duration::from_secs(1)
            }
        );
        let q = PassiveHealth::default();
        for _ in 0..10 {
            assert!(!q.record_failure(&c, Instant::now(), || false));
        }
        assert_eq!(q.admission(Instant::now()), Admission::Open);
    }

    #[test]
    fn disabled_never_ejects() {
        let p = PassiveHealth::default();
        let c = OutlierConfig {
            consecutive_failures: 0,
            ..cfg(1000, 1000)
        };
        for _ in 0..100 {
            assert!(!p.record_failure(&c, Instant::now(), || true));
        }
        assert_eq!(p.admission(Instant::now()), Admission::Open);
    }
}
