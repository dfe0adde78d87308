//! Backend `/metrics` scraping: prefix-cache counters, preemptions, and the sampled queue.
//!
//! Two hit rates are read. vLLM's own, Δ`prefix_cache_hits` ÷ Δ`prefix_cache_queries`, counts
//! a request once in vLLM 0.32 (re-admissions after preemption go to counters it does not
//! export), but counted every re-admission in older versions, where preemption inflates it.
//! The per-request one, Δ`prompt_tokens_cached` ÷ Δ`prompt_tokens`, counts each request's
//! prompt once, with the tokens cached at its first admission, in every version that has the
//! series: preemption cannot inflate it. `hit/max` uses the per-request rate when present.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::sync::watch;

const HITS: &str = "vllm:prefix_cache_hits_total";
const QUERIES: &str = "vllm:prefix_cache_queries_total";
const PREEMPTIONS: &str = "vllm:num_preemptions_total";
const SUCCESS: &str = "vllm:request_success_total";
const WAITING: &str = "vllm:num_requests_waiting";
const PROMPT_TOKENS: &str = "vllm:prompt_tokens_total";
const PROMPT_TOKENS_CACHED: &str = "vllm:prompt_tokens_cached_total";

/// Sum of every sample of metric `name` (all label sets) in a Prometheus text page; `None`
/// when the page has no such series.
pub fn sum_metric(page: &str, name: &str) -> Option<f64> {
    let mut total = None;
    for line in page.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        // The name must end here: `foo` must not match `foo_created`.
        let rest = match rest.as_bytes().first() {
            Some(b'{') => match rest.find('}') {
                Some(end) => &rest[end + 1..],
                None => continue,
            },
            Some(b' ') | Some(b'\t') => rest,
            _ => continue,
        };
        let Some(value) = rest.split_whitespace().next() else {
            continue;
        };
        if let Ok(v) = value.parse::<f64>() {
            *total.get_or_insert(0.0) += v;
        }
    }
    total
}

/// One backend's counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counters {
    pub hits: f64,
    pub queries: f64,
    pub preemptions: f64,
    pub success: f64,
    /// Prompt tokens, once per request, and those cached at its first admission (`None`:
    /// the backend has no such series).
    pub prompt_tokens: Option<f64>,
    pub prompt_tokens_cached: Option<f64>,
}

impl Counters {
    pub fn from_page(page: &str) -> Counters {
        Counters {
            hits: sum_metric(page, HITS).unwrap_or(0.0),
            queries: sum_metric(page, QUERIES).unwrap_or(0.0),
            preemptions: sum_metric(page, PREEMPTIONS).unwrap_or(0.0),
            success: sum_metric(page, SUCCESS).unwrap_or(0.0),
            prompt_tokens: sum_metric(page, PROMPT_TOKENS),
            prompt_tokens_cached: sum_metric(page, PROMPT_TOKENS_CACHED),
        }
    }
}

/// The fleet over one run, from the backends' own metrics.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FleetReport {
    pub backends: usize,
    pub prefix_cache_hits: f64,
    pub prefix_cache_queries: f64,
    /// Δhits / Δqueries over the run (0 when nothing was queried): vLLM's own counter.
    pub hit_rate: f64,
    /// Δ`vllm:prompt_tokens_total` and Δ`vllm:prompt_tokens_cached_total` over the run.
    pub prompt_tokens: f64,
    pub prompt_tokens_cached: f64,
    /// Δcached ÷ Δprompt tokens: hits counted once per request, whatever the preemptions;
    /// `None` when a backend lacks the series (then only `hit_rate` is known).
    pub hit_rate_per_request: Option<f64>,
    pub preemptions: f64,
    /// `vllm:num_requests_waiting` averaged over the samples and the backends.
    pub mean_waiting: f64,
    pub waiting_samples: u64,
    /// Δ`vllm:request_success_total` per backend URL, as a share of all backends' total.
    pub request_share: BTreeMap<String, f64>,
    /// Δhits ÷ Δqueries per backend URL (absent for a backend queried nothing): which caches
    /// a policy's placement starved or overfilled.
    pub hit_rate_by_backend: BTreeMap<String, f64>,
    /// Backends whose `/metrics` could not be read before and after the run.
    pub scrape_failures: u64,
}

/// Scrapes a fixed set of backends: counters before, periodic queue samples, counters after.
pub struct FleetScraper {
    client: reqwest::Client,
    urls: Vec<String>,
    before: Vec<Option<Counters>>,
    stop: Option<watch::Sender<bool>>,
    sampler: Option<tokio::task::JoinHandle<(f64, u64)>>,
}

async fn fetch(client: &reqwest::Client, base: &str) -> Option<String> {
    let url = format!("{}/metrics", base.trim_end_matches('/'));
    let resp = client.get(url).send().await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    resp.text().await.ok()
}

impl FleetScraper {
    /// Reads every backend's counters now (the "before" picture).
    pub async fn start(urls: Vec<String>, interval: Duration) -> FleetScraper {
        let client = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap_or_default();
        let pages = futures_util::future::join_all(urls.iter().map(|u| fetch(&client, u))).await;
        let before = pages
            .iter()
            .map(|p| p.as_deref().map(Counters::from_page))
            .collect();
        let (stop, mut stopped) = watch::channel(false);
        let sample_client = client.clone();
        let sample_urls = Arc::new(urls.clone());
        let sampler = tokio::spawn(async move {
            let mut sum = 0.0;
            let mut n = 0u64;
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stopped.changed() => break,
                }
                let pages = futures_util::future::join_all(
                    sample_urls.iter().map(|u| fetch(&sample_client, u)),
                )
                .await;
                for page in pages.iter().flatten() {
                    if let Some(w) = sum_metric(page, WAITING) {
                        sum += w;
                        n += 1;
                    }
                }
            }
            (sum, n)
        });
        FleetScraper {
            client,
            urls,
            before,
            stop: Some(stop),
            sampler: Some(sampler),
        }
    }

    /// Stops sampling, reads the counters again and reports the differences.
    pub async fn finish(mut self) -> FleetReport {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(true);
        }
        let (sum, n) = match self.sampler.take() {
            Some(t) => t.await.unwrap_or((0.0, 0)),
            None => (0.0, 0),
        };
        let pages =
            futures_util::future::join_all(self.urls.iter().map(|u| fetch(&self.client, u))).await;
        let mut report = FleetReport {
            backends: self.urls.len(),
            mean_waiting: if n == 0 { 0.0 } else { sum / n as f64 },
            waiting_samples: n,
            ..FleetReport::default()
        };
        let mut successes = Vec::new();
        let mut per_request_known = !self.urls.is_empty();
        for ((url, before), page) in self.urls.iter().zip(&self.before).zip(&pages) {
            let (Some(before), Some(page)) = (before, page) else {
                report.scrape_failures += 1;
                continue;
            };
            let after = Counters::from_page(page);
            // A counter that went backwards means the backend restarted: count from zero.
            let d = |a: f64, b: f64| if a >= b { a - b } else { a };
            let (hits, queries) = (d(after.hits, before.hits), d(after.queries, before.queries));
            report.prefix_cache_hits += hits;
            report.prefix_cache_queries += queries;
            if queries > 0.0 {
                report
                    .hit_rate_by_backend
                    .insert(url.clone(), hits / queries);
            }
            report.preemptions += d(after.preemptions, before.preemptions);
            successes.push((url.clone(), d(after.success, before.success)));
            match (
                before.prompt_tokens.zip(before.prompt_tokens_cached),
                after.prompt_tokens.zip(after.prompt_tokens_cached),
            ) {
                (Some((p0, c0)), Some((p1, c1))) => {
                    report.prompt_tokens += d(p1, p0);
                    report.prompt_tokens_cached += d(c1, c0);
                }
                _ => per_request_known = false,
            }
        }
        if report.prefix_cache_queries > 0.0 {
            report.hit_rate = report.prefix_cache_hits / report.prefix_cache_queries;
        }
        if per_request_known && report.scrape_failures == 0 && report.prompt_tokens > 0.0 {
            report.hit_rate_per_request = Some(report.prompt_tokens_cached / report.prompt_tokens);
        }
        let total: f64 = successes.iter().map(|(_, s)| s).sum();
        for (url, s) in successes {
            let share = if total > 0.0 { s / total } else { 0.0 };
            report.request_share.insert(url, share);
        }
        report
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_label_sets_and_ignores_lookalikes() {
        let page = "# HELP vllm:prefix_cache_hits_total x\n\
                    vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 10.0\n\
                    vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"m\"} 5\n\
                    vllm:prefix_cache_hits_created{engine=\"0\"} 1.7e9\n\
                    vllm:num_requests_waiting 3\n";
        assert_eq!(sum_metric(page, HITS), Some(15.0));
        assert_eq!(sum_metric(page, WAITING), Some(3.0));
        assert_eq!(sum_metric(page, QUERIES), None);
        let c = Counters::from_page(page);
        assert_eq!(c.hits, 15.0);
        assert_eq!(c.queries, 0.0);
        assert_eq!(c.prompt_tokens, None, "absent, not zero");
    }
}
