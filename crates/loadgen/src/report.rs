//! Aggregation of request records into percentiles, rates and shares; the human table.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::client::Record;
use crate::scrape::FleetReport;
use crate::workload::HitBound;

/// Latency histogram in microseconds (3 significant digits, grows as needed).
#[derive(Debug, Clone)]
pub struct Latency {
    hist: Histogram<u64>,
    sum: f64,
}

impl Default for Latency {
    fn default() -> Self {
        Latency {
            hist: new_histogram(),
            sum: 0.0,
        }
    }
}

/// An auto-resizing histogram with 3 significant figures.
#[allow(clippy::expect_used)] // precision 3 is inside hdrhistogram's valid 0..=5: cannot fail
fn new_histogram() -> Histogram<u64> {
    Histogram::new(3).expect("precision 3 is valid")
}

impl Latency {
    pub fn record(&mut self, secs: f64) {
        let us = (secs * 1e6).round().max(1.0) as u64;
        let _ = self.hist.record(us);
        self.sum += secs;
    }

    pub fn stats(&self, scale: f64) -> Pcts {
        let n = self.hist.len();
        if n == 0 {
            return Pcts::default();
        }
        let q = |p: f64| self.hist.value_at_quantile(p) as f64 / 1e6 * scale;
        Pcts {
            count: n,
            mean: self.sum / n as f64 * scale,
            p50: q(0.5),
            p90: q(0.9),
            p99: q(0.99),
            max: self.hist.max() as f64 / 1e6 * scale,
        }
    }
}

/// Percentiles in seconds.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Pcts {
    pub count: u64,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

/// A service-level objective (DistServe's goodput measure): a request is *good* when its TTFT
/// and its TPOT (time per output token after the first: `(E2E − TTFT) ÷ (tokens − 1)`) are
/// both within these, in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Slo {
    pub ttft: f64,
    pub tpot: f64,
}

impl Slo {
    /// The same objective with times divided by `factor` (simulated → wall seconds).
    pub fn scaled_down(self, factor: f64) -> Slo {
        Slo {
            ttft: self.ttft / factor,
            tpot: self.tpot / factor,
        }
    }
}

/// A request's time per output token after the first, when it has more than one.
fn tpot(r: &Record) -> Option<f64> {
    let ttft = r.ttft?;
    (r.output_tokens > 1).then(|| (r.e2e - ttft).max(0.0) / (r.output_tokens - 1) as f64)
}

/// Accumulates records as they arrive (records are dropped after counting).
#[derive(Debug, Default)]
pub struct Collector {
    pub ttft: Latency,
    pub itl: Latency,
    pub tpot: Latency,
    pub e2e: Latency,
    /// The objective requests are judged by (wall seconds), if any.
    pub slo: Option<Slo>,
    /// Successful requests within [`Self::slo`].
    pub good: u64,
    pub sent: u64,
    pub ok: u64,
    pub output_tokens: u64,
    pub errors: BTreeMap<String, u64>,
    pub by_backend: BTreeMap<String, u64>,
}

impl Collector {
    pub fn add(&mut self, r: &Record) {
        self.sent += 1;
        if let Some(b) = &r.backend {
            *self.by_backend.entry(b.clone()).or_default() += 1;
        }
        match &r.error {
            Some(kind) => *self.errors.entry(kind.clone()).or_default() += 1,
            None => {
                self.ok += 1;
                self.output_tokens += r.output_tokens;
                if let Some(t) = r.ttft {
                    self.ttft.record(t);
                }
                for &g in &r.itl {
                    self.itl.record(g);
                }
                let tpot = tpot(r);
                if let Some(t) = tpot {
                    self.tpot.record(t);
                }
                self.e2e.record(r.e2e);
                if let (Some(slo), Some(ttft)) = (self.slo, r.ttft) {
                    if ttft <= slo.ttft && tpot.unwrap_or(0.0) <= slo.tpot {
                        self.good += 1;
                    }
                }
            }
        }
    }

    pub fn count_error(&mut self, kind: &str, n: u64) {
        if n > 0 {
            self.sent += n;
            *self.errors.entry(kind.into()).or_default() += n;
        }
    }
}

/// Everything one run measured. With `time_scale` ≠ 1 every time is in *simulated* seconds
/// (wall × time_scale) and every rate per simulated second (wall rate ÷ time_scale).
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub label: String,
    pub time_scale: f64,
    pub duration_s: f64,
    pub requests: u64,
    pub ok: u64,
    pub errors: BTreeMap<String, u64>,
    pub requests_per_s: f64,
    pub output_tokens: u64,
    pub output_tokens_per_s: f64,
    pub ttft: Pcts,
    pub itl: Pcts,
    /// Per-request time per output token after the first.
    pub tpot: Pcts,
    pub e2e: Pcts,
    /// The objective (in reported seconds) and the successful requests per second within it.
    pub slo: Option<Slo>,
    pub goodput_per_s: Option<f64>,
    /// Share of requests per backend from the router's backend header (empty when absent).
    pub backend_share_header: BTreeMap<String, f64>,
    pub fleet: Option<FleetReport>,
    pub max_hit: Option<HitBound>,
    /// Fleet hit rate counted once per request (vLLM's own counter when the backends lack
    /// the per-request series) ÷ the workload's maximum achievable hit rate: at most 1.
    pub hit_rate_vs_max: Option<f64>,
}

impl Summary {
    pub fn new(
        label: &str,
        c: &Collector,
        wall_secs: f64,
        time_scale: f64,
        fleet: Option<FleetReport>,
        max_hit: Option<HitBound>,
    ) -> Summary {
        let sim_secs = (wall_secs * time_scale).max(1e-9);
        let total: u64 = c.by_backend.values().sum();
        let backend_share_header = c
            .by_backend
            .iter()
            .map(|(k, v)| (k.clone(), *v as f64 / total.max(1) as f64))
            .collect();
        let hit_rate_vs_max = match (&fleet, &max_hit) {
            (Some(f), Some(b)) if b.rate() > 0.0 => {
                Some(f.hit_rate_per_request.unwrap_or(f.hit_rate) / b.rate())
            }
            _ => None,
        };
        Summary {
            label: label.into(),
            time_scale,
            duration_s: sim_secs,
            requests: c.sent,
            ok: c.ok,
            errors: c.errors.clone(),
            requests_per_s: c.ok as f64 / sim_secs,
            output_tokens: c.output_tokens,
            output_tokens_per_s: c.output_tokens as f64 / sim_secs,
            ttft: c.ttft.stats(time_scale),
            itl: c.itl.stats(time_scale),
            tpot: c.tpot.stats(time_scale),
            e2e: c.e2e.stats(time_scale),
            slo: c.slo.map(|s| s.scaled_down(1.0 / time_scale)),
            goodput_per_s: c.slo.map(|_| c.good as f64 / sim_secs),
            backend_share_header,
            fleet,
            max_hit,
            hit_rate_vs_max,
        }
    }

    /// Largest and smallest per-backend share of requests: from the backends' own success
    /// counters when they were scraped, else from the router's header.
    pub fn share_range(&self) -> Option<(f64, f64)> {
        let shares: Vec<f64> = match &self.fleet {
            Some(f) if !f.request_share.is_empty() => f.request_share.values().copied().collect(),
            _ => self.backend_share_header.values().copied().collect(),
        };
        let max = shares.iter().copied().fold(f64::NAN, f64::max);
        let min = shares.iter().copied().fold(f64::NAN, f64::min);
        (!shares.is_empty()).then_some((max, min))
    }

    pub fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }

    pub fn errors_text(&self) -> String {
        if self.errors.is_empty() {
            return "0".into();
        }
        self.errors
            .iter()
            .map(|(k, v)| format!("{k}:{v}"))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The single-run human report.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let unit = if self.time_scale == 1.0 {
            "s".to_string()
        } else {
            format!("simulated s (wall × {})", self.time_scale)
        };
        let _ = writeln!(s, "run: {}   times in {unit}", self.label);
        let _ = writeln!(
            s,
            "requests {} ok {} errors {}   duration {:.2}   {:.2} req/s   {:.1} output tok/s",
            self.requests,
            self.ok,
            self.errors_text(),
            self.duration_s,
            self.requests_per_s,
            self.output_tokens_per_s
        );
        let _ = writeln!(
            s,
            "{:<6} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "", "mean", "p50", "p90", "p99", "max"
        );
        for (name, p) in [
            ("TTFT", self.ttft),
            ("ITL", self.itl),
            ("TPOT", self.tpot),
            ("E2E", self.e2e),
        ] {
            let _ = writeln!(
                s,
                "{name:<6} {:>9} {:>9} {:>9} {:>9} {:>9}",
                secs(p.mean),
                secs(p.p50),
                secs(p.p90),
                secs(p.p99),
                secs(p.max)
            );
        }
        if let (Some(slo), Some(g)) = (self.slo, self.goodput_per_s) {
            let _ = writeln!(
                s,
                "goodput {g:.3} req/s within TTFT ≤ {} and TPOT ≤ {}",
                secs(slo.ttft),
                secs(slo.tpot)
            );
        }
        if let Some(f) = &self.fleet {
            let _ = write!(
                s,
                "fleet ({} backends): hit rate {:.3} (vLLM's counter)",
                f.backends, f.hit_rate
            );
            if let Some(r) = f.hit_rate_per_request {
                let _ = write!(s, ", {r:.3} once per request");
            }
            if let (Some(b), Some(r)) = (&self.max_hit, self.hit_rate_vs_max) {
                let _ = write!(
                    s,
                    " (max achievable {:.3}, ratio {:.2}; shared prefixes alone {:.3})",
                    b.rate(),
                    r,
                    b.prefix_only_rate()
                );
            }
            let _ = writeln!(
                s,
                "   preemptions {}   mean waiting {:.2}",
                f.preemptions, f.mean_waiting
            );
            for (url, share) in &f.request_share {
                let _ = write!(s, "  {url}: {:.1}% of requests", share * 100.0);
                if let Some(hit) = f.hit_rate_by_backend.get(url) {
                    let _ = write!(s, ", hit rate {hit:.3}");
                }
                let _ = writeln!(s);
            }
        }
        if !self.backend_share_header.is_empty() {
            let _ = writeln!(s, "backend header shares:");
            for (b, share) in &self.backend_share_header {
                let _ = writeln!(s, "  {b}: {:.1}%", share * 100.0);
            }
        }
        s
    }
}

/// Seconds with a unit that keeps three significant-ish digits.
pub fn secs(v: f64) -> String {
    if v == 0.0 {
        "-".into()
    } else if v < 0.001 {
        format!("{:.0}µs", v * 1e6)
    } else if v < 1.0 {
        format!("{:.1}ms", v * 1e3)
    } else {
        format!("{v:.2}s")
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn percentiles_and_scaling() {
        let mut c = Collector::default();
        for i in 1..=100u32 {
            c.add(&Record {
                ttft: Some(f64::from(i) / 1000.0),
                e2e: 0.5,
                output_tokens: 10,
                backend: Some(if i % 4 == 0 { "a" } else { "b" }.into()),
                ..Record::default()
            });
        }
        c.add(&Record {
            error: Some("http_503".into()),
            ..Record::default()
        });
        let s = Summary::new("t", &c, 10.0, 2.0, None, None);
        assert_eq!(s.requests, 101);
        assert_eq!(s.ok, 100);
        assert!((s.ttft.p90 - 0.180).abs() < 0.002, "{}", s.ttft.p90);
        assert!((s.output_tokens_per_s - 50.0).abs() < 1e-9);
        assert_eq!(s.share_range(), Some((0.75, 0.25)));
        assert_eq!(s.errors_text(), "http_503:1");
        assert!(s.render().contains("TTFT"));
        assert_eq!(s.goodput_per_s, None);
    }

    #[test]
    fn goodput_counts_requests_within_both_objectives() {
        // Wall seconds; reported ×2.
        let mut c = Collector {
            slo: Some(Slo {
                ttft: 0.2,
                tpot: 0.01,
            }),
            ..Collector::default()
        };
        // (ttft, e2e, tokens): good; TTFT too slow; TPOT (0.9/9 = 0.1) too slow; one token.
        for (ttft, e2e, tokens) in [
            (0.1, 0.19, 10),
            (0.3, 0.31, 2),
            (0.1, 1.0, 10),
            (0.2, 0.2, 1),
        ] {
            c.add(&Record {
                ttft: Some(ttft),
                e2e,
                output_tokens: tokens,
                ..Record::default()
            });
        }
        let s = Summary::new("t", &c, 10.0, 2.0, None, None);
        assert_eq!(c.good, 2);
        assert!(
            (s.goodput_per_s.unwrap() - 0.1).abs() < 1e-12,
            "2 in 20 simulated s"
        );
        assert_eq!(
            s.slo,
            Some(Slo {
                ttft: 0.4,
                tpot: 0.02
            })
        );
        assert_eq!(s.tpot.count, 3);
        assert!((s.tpot.max - 0.2).abs() < 1e-3, "{}", s.tpot.max);
        assert!(s.render().contains("goodput 0.100 req/s"));
    }
}
