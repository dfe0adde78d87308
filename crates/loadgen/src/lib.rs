//! loadgen: seeded OpenAI load generation and routing-policy comparison for inferlb.
//!
//! # Layout
//!
//! * [`text`] — random words counted in the simulator's tokens (~4 bytes each).
//! * [`workload`] — `shared-prefix`, `multi-turn` and `unique` sessions, and the maximum hit
//!   rate any router could reach on them.
//! * [`arrival`] — Poisson, stepped ramp, closed-loop concurrency.
//! * [`client`] — one streamed (or whole) chat request, timed.
//! * [`runner`] — a whole run: dispatch, drain, bounds, progress bar.
//! * [`scrape`] — backends' `/metrics` before, during and after a run.
//! * [`report`] — percentiles, rates, shares, the human table.
//! * [`router`] — inferlb or another router as a subprocess (or in-process for tests).
//! * [`compare`] — one workload, a cold simulated fleet per policy, one table.
//! * [`machine`] — date and CPU facts written next to results.

pub mod arrival;
pub mod client;
pub mod compare;
pub mod machine;
pub mod report;
pub mod router;
pub mod runner;
pub mod scrape;
pub mod text;
pub mod workload;

/// True when `url`'s host is a loopback address or `localhost`.
pub fn is_loopback(url: &str) -> bool {
    let Ok(u) = reqwest::Url::parse(url) else {
        return false;
    };
    let Some(host) = u.host_str() else {
        return false;
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    #[test]
    fn loopback_only() {
        assert!(super::is_loopback("http://127.0.0.1:8000"));
        assert!(super::is_loopback("http://localhost/v1"));
        assert!(super::is_loopback("http://[::1]:9/"));
        assert!(!super::is_loopback("http://10.0.0.1:8000"));
        assert!(!super::is_loopback("http://example.com"));
        assert!(!super::is_loopback("not a url"));
    }
}
