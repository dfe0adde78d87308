//! The router's clock in milliseconds, read in one place: what the KV-event stores, the
//! scheduler (sent work, the prefix scorer's in-flight blocks), the decision log and the admin
//! view stamp and compare.
//!
//! ```text
//! now_ms()  = ms elapsed since the process first read this clock     (monotonic)
//! unix_ms() = ms since 1970-01-01 UTC by the wall clock              (0 if it reads earlier)
//! ```
//!
//! Durations and deadlines use `now_ms` (a wall clock may step); `unix_ms` only labels what a
//! person reads.

use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Milliseconds since the process's first call: monotonic, shared by every caller.
pub fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    u64::try_from(START.get_or_init(Instant::now).elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// Milliseconds since the Unix epoch by the wall clock (0 for a clock set before 1970).
pub fn unix_ms() -> u64 {
    unix_ms_of(SystemTime::now())
}

/// `at` in milliseconds since the Unix epoch (0 before it).
pub fn unix_ms_of(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn now_never_goes_back_and_unix_time_is_the_wall_clock() {
        let a = now_ms();
        let b = now_ms();
        assert!(b >= a);
        assert_eq!(unix_ms_of(UNIX_EPOCH + Duration::from_millis(1_234)), 1_234);
        assert_eq!(unix_ms_of(UNIX_EPOCH - Duration::from_secs(1)), 0);
        // 2020-01-01 and later.
        assert!(unix_ms() > 1_577_836_800_000);
    }
}
