//! Passive health (outlier detection): eject a backend that keeps failing real requests.
//!
//! After `consecutive_failures` connect failures, timeouts or 5xx answers in a row, the
//! backend is ejected for `base_ejection × 2^(k−1)` (k = ejections since its last success,
//! capped at `max_ejection`). When the period ends it is eligible again — the next request is
//! the probe — and one success resets the count. The poller's active health check works beside
//! this: a backend must pass both to be scheduled.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::config::OutlierConfig;

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ms() -> u64 {
    epoch().elapsed().as_millis() as u64
}

#[derive(Debug, Default)]
pub struct PassiveHealth {
    consecutive: AtomicU32,
    ejections: AtomicU32,
    /// Milliseconds since the process epoch; 0 = not ejected.
    ejected_until: AtomicU64,
}

impl PassiveHealth {
    pub fn record_success(&self) {
        self.consecutive.store(0, Ordering::Relaxed);
        self.ejections.store(0, Ordering::Relaxed);
    }

    /// Count a failure; returns true when this failure ejected the backend.
    pub fn record_failure(&self, cfg: &OutlierConfig) -> bool {
        if cfg.consecutive_failures == 0 {
            return false;
        }
        let n = self.consecutive.fetch_add(1, Ordering::Relaxed) + 1;
        if n < cfg.consecutive_failures || self.is_ejected() {
            return false;
        }
        self.consecutive.store(0, Ordering::Relaxed);
        let k = self.ejections.fetch_add(1, Ordering::Relaxed).min(16);
        let length = Duration::from_millis(cfg.base_ejection_ms.saturating_mul(1 << k))
            .min(Duration::from_millis(cfg.max_ejection_ms));
        self.ejected_until
            .store(now_ms() + length.as_millis() as u64, Ordering::Relaxed);
        true
    }

    pub fn is_ejected(&self) -> bool {
        let until = self.ejected_until.load(Ordering::Relaxed);
        until != 0 && now_ms() < until
    }

    /// Remaining ejection, for the admin view.
    pub fn ejected_for(&self) -> Option<Duration> {
        let until = self.ejected_until.load(Ordering::Relaxed);
        let now = now_ms();
        (until > now).then(|| Duration::from_millis(until - now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(base: u64) -> OutlierConfig {
        OutlierConfig {
            consecutive_failures: 3,
            base_ejection_ms: base,
            max_ejection_ms: base * 3,
        }
    }

    #[test]
    fn ejects_after_consecutive_failures_only() {
        let p = PassiveHealth::default();
        let c = cfg(60_000);
        assert!(!p.record_failure(&c));
        assert!(!p.record_failure(&c));
        p.record_success();
        assert!(!p.record_failure(&c));
        assert!(!p.record_failure(&c));
        assert!(!p.is_ejected());
        assert!(p.record_failure(&c));
        assert!(p.is_ejected());
        let left = p.ejected_for().unwrap_or_default();
        assert!(
            left > Duration::from_secs(50) && left <= Duration::from_secs(60),
            "{left:?}"
        );
    }

    #[test]
    fn ejection_doubles_and_is_capped() {
        let p = PassiveHealth::default();
        let c = cfg(0);
        // Zero-length ejections let the test walk through several without waiting.
        for _ in 0..3 {
            p.record_failure(&c);
        }
        assert_eq!(p.ejections.load(Ordering::Relaxed), 1);
        let c = cfg(10_000);
        for _ in 0..3 {
            p.record_failure(&c);
        }
        // Second ejection: 10 s × 2 = 20 s.
        let left = p.ejected_for().unwrap_or_default();
        assert!(
            left > Duration::from_secs(15) && left <= Duration::from_secs(20),
            "{left:?}"
        );
    }

    #[test]
    fn disabled_never_ejects() {
        let p = PassiveHealth::default();
        let c = OutlierConfig {
            consecutive_failures: 0,
            ..cfg(1000)
        };
        for _ in 0..100 {
            assert!(!p.record_failure(&c));
        }
        assert!(!p.is_ejected());
    }
}
