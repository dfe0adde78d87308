//! Which metric names an inference engine exposes, and how a scraped page becomes [`LoadMetrics`].
//!
//! vLLM and SGLang are built in; any other engine is a `[engines.NAME]` table in the config,
//! so supporting a new server is a config change, not a code change. For each signal the names
//! are tried in order and the first one present wins (vLLM renamed `gpu_cache_usage_perc` to
//! `kv_cache_usage_perc`; listing both keeps old and new servers working). A signal whose
//! series is absent stays `None` — *unknown*, never zero.

use serde::Deserialize;

use super::prometheus::{samples_where, Sample};

/// Metric names for one engine. Counter names may be given with or without `_total`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EngineMetricNames {
    /// Requests waiting for admission (summed over series).
    pub waiting: Vec<String>,
    /// Requests in the running batch (summed over series).
    pub running: Vec<String>,
    /// KV-cache usage (averaged over series), multiplied by `kv_usage_scale` to give 0–1.
    pub kv_usage: Vec<String>,
    pub kv_usage_scale: f64,
    /// Info gauge with `block_size` and `num_gpu_blocks` labels.
    pub cache_config: Option<String>,
    /// Info gauge with `running_lora_adapters`, `waiting_lora_adapters`, `max_lora` labels.
    pub lora: Option<String>,
    /// Prefix-cache counters (tokens); a decrease means the server restarted.
    pub prefix_cache_hits: Option<String>,
    pub prefix_cache_queries: Option<String>,
    /// Requests the engine finished (a counter, summed over series: vLLM labels it by
    /// `finished_reason`). Beside the requests this router saw answered, it gives the router's
    /// share of the backend's traffic ([`super::chars_per_token`]).
    pub requests_finished: Option<String>,
}

impl Default for EngineMetricNames {
    fn default() -> Self {
        EngineMetricNames {
            waiting: Vec::new(),
            running: Vec::new(),
            kv_usage: Vec::new(),
            kv_usage_scale: 1.0,
            cache_config: None,
            lora: None,
            prefix_cache_hits: None,
            prefix_cache_queries: None,
            requests_finished: None,
        }
    }
}

impl EngineMetricNames {
    pub fn builtin(name: &str) -> Option<Self> {
        let s = |v: &[&str]| v.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
        match name {
            "vllm" => Some(EngineMetricNames {
                waiting: s(&["vllm:num_requests_waiting"]),
                running: s(&["vllm:num_requests_running"]),
                kv_usage: s(&["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"]),
                kv_usage_scale: 1.0,
                cache_config: Some("vllm:cache_config_info".into()),
                lora: Some("vllm:lora_requests_info".into()),
                prefix_cache_hits: Some("vllm:prefix_cache_hits".into()),
                prefix_cache_queries: Some("vllm:prefix_cache_queries".into()),
                requests_finished: Some("vllm:request_success".into()),
            }),
            "sglang" => Some(EngineMetricNames {
                waiting: s(&["sglang:num_queue_reqs"]),
                running: s(&["sglang:num_running_reqs"]),
                kv_usage: s(&["sglang:token_usage"]),
                kv_usage_scale: 1.0,
                cache_config: None,
                lora: None,
                prefix_cache_hits: None,
                prefix_cache_queries: None,
                requests_finished: None,
            }),
            _ => None,
        }
    }
}

impl EngineMetricNames {
    /// The query `name[]=a&name[]=b…` asking a server for only the series read here. Python
    /// servers built on `prometheus_client`'s exposition app honour it and send a page of a
    /// few hundred bytes instead of tens of kilobytes; servers that ignore it send the whole
    /// page, which is read the same way. The counter families are asked for as `x_total` too.
    pub fn filter_query(&self) -> String {
        let counters = [
            &self.prefix_cache_hits,
            &self.prefix_cache_queries,
            &self.requests_finished,
        ];
        let gauges = [&self.cache_config, &self.lora];
        let mut names: Vec<String> = self
            .waiting
            .iter()
            .chain(&self.running)
            .chain(&self.kv_usage)
            .chain(gauges.into_iter().flatten())
            .cloned()
            .collect();
        for name in counters.into_iter().flatten() {
            names.push(name.clone());
            if !name.ends_with("_total") {
                names.push(format!("{name}_total"));
            }
        }
        let mut q = String::new();
        for name in &names {
            if !q.is_empty() {
                q.push('&');
            }
            q.push_str("name%5B%5D=");
            for b in name.bytes() {
                if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.' {
                    q.push(char::from(b));
                } else {
                    q.push_str(&format!("%{b:02X}"));
                }
            }
        }
        q
    }
}

/// Largest plausible tokens per KV block (vLLM uses 1–256).
pub const MAX_BLOCK_SIZE: u64 = 1 << 16;
/// Largest plausible number of KV blocks on one server (2^32 × 2^16 tokens still fits u64).
pub const MAX_GPU_BLOCKS: u64 = 1 << 32;

/// What the scorers can know about a backend's load, read from one scrape.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoadMetrics {
    pub waiting: Option<f64>,
    pub running: Option<f64>,
    /// Fraction 0–1 of KV blocks held by running requests.
    pub kv_usage: Option<f64>,
    /// Tokens per KV block, from the cache-config info gauge.
    pub block_size: Option<u64>,
    pub num_gpu_blocks: Option<u64>,
    pub running_loras: Vec<String>,
    pub waiting_loras: Vec<String>,
    pub max_lora: Option<u64>,
    pub prefix_cache_hits: Option<f64>,
    pub prefix_cache_queries: Option<f64>,
    /// Requests the engine finished, every reason summed.
    pub requests_finished: Option<f64>,
}

impl LoadMetrics {
    /// KV-cache capacity in tokens, when the geometry is known and plausible. The numbers come
    /// from a backend's labels, so they are bounded and multiplied without overflow.
    pub fn kv_capacity_tokens(&self) -> Option<u64> {
        let block = self
            .block_size
            .filter(|b| (1..=MAX_BLOCK_SIZE).contains(b))?;
        let blocks = self
            .num_gpu_blocks
            .filter(|n| (1..=MAX_GPU_BLOCKS).contains(n))?;
        block.checked_mul(blocks)
    }
}

/// Accumulates one signal over the series of a page; the first listed name present wins.
struct Signal<'n> {
    names: &'n [String],
    /// (priority of the matched name, sum, count)
    best: Option<(usize, f64, u32)>,
}

impl<'n> Signal<'n> {
    fn new(names: &'n [String]) -> Self {
        Signal { names, best: None }
    }

    fn offer(&mut self, sample: &Sample<'_>) {
        let Some(rank) = self.names.iter().position(|n| name_matches(sample.name, n)) else {
            return;
        };
        if !sample.value.is_finite() {
            return;
        }
        match &mut self.best {
            Some((r, sum, count)) if *r == rank => {
                *sum += sample.value;
                *count += 1;
            }
            Some((r, _, _)) if *r < rank => {}
            _ => self.best = Some((rank, sample.value, 1)),
        }
    }

    fn sum(&self) -> Option<f64> {
        self.best.map(|(_, sum, _)| sum)
    }

    fn mean(&self) -> Option<f64> {
        self.best.map(|(_, sum, n)| sum / f64::from(n))
    }
}

/// A counter may be exposed as `name_total`; configured names may carry the suffix or not.
fn name_matches(series: &str, configured: &str) -> bool {
    series == configured
        || series
            .strip_suffix("_total")
            .is_some_and(|base| base == configured.strip_suffix("_total").unwrap_or(configured))
}

fn split_list(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Why a page could not be used.
#[derive(Debug, thiserror::Error)]
#[error("unreadable metrics page: {0}")]
pub struct PageError(#[from] super::prometheus::ParseError);

/// Read the signals of `names` from a metrics page. A page with a malformed line among the
/// series read, or a line that is not a series at all, is rejected whole: a server that writes
/// garbage cannot be trusted for the lines that happen to parse.
pub fn extract(page: &str, names: &EngineMetricNames) -> Result<LoadMetrics, PageError> {
    let one = |n: &Option<String>| n.iter().cloned().collect::<Vec<_>>();
    let (hits_names, queries_names, finished_names) = (
        one(&names.prefix_cache_hits),
        one(&names.prefix_cache_queries),
        one(&names.requests_finished),
    );
    let mut waiting = Signal::new(&names.waiting);
    let mut running = Signal::new(&names.running);
    let mut kv = Signal::new(&names.kv_usage);
    let mut hits = Signal::new(&hits_names);
    let mut queries = Signal::new(&queries_names);
    let mut finished = Signal::new(&finished_names);
    let mut out = LoadMetrics::default();
    let mut lora_stamp = f64::NEG_INFINITY;
    let all_names: Vec<&str> = names
        .waiting
        .iter()
        .chain(&names.running)
        .chain(&names.kv_usage)
        .chain(&hits_names)
        .chain(&queries_names)
        .chain(&finished_names)
        .chain(&names.cache_config)
        .chain(&names.lora)
        .map(|n| n.strip_suffix("_total").unwrap_or(n))
        .collect();
    // Cheap test per line: most lines of a vLLM page are series nobody here reads.
    let wanted = |series: &str| {
        let base = series.strip_suffix("_total").unwrap_or(series);
        all_names.iter().any(|n| *n == base || *n == series)
    };
    for sample in samples_where(page, wanted) {
        let sample = sample?;
        waiting.offer(&sample);
        running.offer(&sample);
        kv.offer(&sample);
        hits.offer(&sample);
        queries.offer(&sample);
        finished.offer(&sample);
        if names.cache_config.as_deref() == Some(sample.name) {
            out.block_size = sample.label("block_size").and_then(|v| v.parse().ok());
            out.num_gpu_blocks = sample.label("num_gpu_blocks").and_then(|v| v.parse().ok());
        }
        // The LoRA info gauge's value is a timestamp; old label sets linger, so keep the newest.
        if names.lora.as_deref() == Some(sample.name) && sample.value > lora_stamp {
            lora_stamp = sample.value;
            out.running_loras = sample
                .label("running_lora_adapters")
                .map(|v| split_list(&v))
                .unwrap_or_default();
            out.waiting_loras = sample
                .label("waiting_lora_adapters")
                .map(|v| split_list(&v))
                .unwrap_or_default();
            out.max_lora = sample.label("max_lora").and_then(|v| v.parse().ok());
        }
    }
    out.waiting = waiting.sum();
    out.running = running.sum();
    out.kv_usage = kv
        .mean()
        .map(|v| (v * names.kv_usage_scale).clamp(0.0, 1.0));
    out.prefix_cache_hits = hits.sum();
    out.prefix_cache_queries = queries.sum();
    out.requests_finished = finished.sum();
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const REAL: &str = include_str!("../../tests/fixtures/vllm-0.32-cpu.txt");

    fn vllm() -> EngineMetricNames {
        EngineMetricNames::builtin("vllm").unwrap()
    }

    #[test]
    fn filter_query_names_every_series_read_percent_encoded() {
        let q = EngineMetricNames::builtin("sglang").unwrap().filter_query();
        assert_eq!(
            q,
            "name%5B%5D=sglang%3Anum_queue_reqs&name%5B%5D=sglang%3Anum_running_reqs&name%5B%5D=sglang%3Atoken_usage"
        );
        let q = vllm().filter_query();
        assert!(q.contains("name%5B%5D=vllm%3Acache_config_info&"), "{q}");
        assert!(
            q.ends_with("name%5B%5D=vllm%3Arequest_success_total"),
            "{q}"
        );
        assert_eq!(q.matches("name%5B%5D=").count(), 12, "{q}");
    }

    #[test]
    fn real_vllm_032_page() {
        let m = extract(REAL, &vllm()).unwrap();
        assert_eq!(m.waiting, Some(0.0));
        assert_eq!(m.running, Some(0.0));
        assert_eq!(m.kv_usage, Some(0.0));
        assert_eq!(m.block_size, Some(128));
        assert_eq!(m.num_gpu_blocks, Some(4096));
        assert_eq!(m.kv_capacity_tokens(), Some(524_288));
        assert_eq!(m.prefix_cache_hits, Some(768.0));
        assert_eq!(m.prefix_cache_queries, Some(2072.0));
        // Summed over its five `finished_reason` series; `request_success_created` is not it.
        assert_eq!(m.requests_finished, Some(10.0));
        assert!(m.running_loras.is_empty());
    }

    #[test]
    fn finished_requests_sum_every_reason() {
        let page = "vllm:request_success_total{finished_reason=\"stop\"} 7\n\
                    vllm:request_success_total{finished_reason=\"length\"} 3\n\
                    vllm:request_success_total{finished_reason=\"abort\"} 2\n\
                    vllm:request_success_created{finished_reason=\"stop\"} 1.7e9\n";
        assert_eq!(
            extract(page, &vllm()).unwrap().requests_finished,
            Some(12.0)
        );
    }

    #[test]
    fn old_kv_metric_name_is_the_fallback() {
        let page = "vllm:gpu_cache_usage_perc{engine=\"0\"} 0.25\nvllm:num_requests_waiting 3\n";
        let m = extract(page, &vllm()).unwrap();
        assert_eq!(m.kv_usage, Some(0.25));
        assert_eq!(m.waiting, Some(3.0));
        assert_eq!(m.running, None, "absent is unknown, not zero");
        let both = "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.1\n";
        assert_eq!(
            extract(both, &vllm()).unwrap().kv_usage,
            Some(0.1),
            "new name wins"
        );
        let reversed = "vllm:kv_cache_usage_perc 0.1\nvllm:gpu_cache_usage_perc 0.9\n";
        assert_eq!(extract(reversed, &vllm()).unwrap().kv_usage, Some(0.1));
    }

    #[test]
    fn several_engines_sum_counts_and_average_usage() {
        let page = "vllm:num_requests_waiting{engine=\"0\"} 2\nvllm:num_requests_waiting{engine=\"1\"} 3\n\
                    vllm:kv_cache_usage_perc{engine=\"0\"} 0.2\nvllm:kv_cache_usage_perc{engine=\"1\"} 0.6\n";
        let m = extract(page, &vllm()).unwrap();
        assert_eq!(m.waiting, Some(5.0));
        assert!((m.kv_usage.unwrap() - 0.4).abs() < 1e-12);
    }

    #[test]
    fn lora_info_takes_newest_series() {
        let page = "vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"a\",waiting_lora_adapters=\"\"} 100\n\
                    vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"b, c\",waiting_lora_adapters=\"d\"} 200\n";
        let m = extract(page, &vllm()).unwrap();
        assert_eq!(m.running_loras, vec!["b", "c"]);
        assert_eq!(m.waiting_loras, vec!["d"]);
        assert_eq!(m.max_lora, Some(4));
    }

    #[test]
    fn sglang_names() {
        let page = "sglang:num_queue_reqs{model_name=\"m\"} 4\nsglang:num_running_reqs 2\nsglang:token_usage 0.5\n";
        let m = extract(page, &EngineMetricNames::builtin("sglang").unwrap()).unwrap();
        assert_eq!(
            (m.waiting, m.running, m.kv_usage),
            (Some(4.0), Some(2.0), Some(0.5))
        );
        assert_eq!(m.block_size, None);
    }

    #[test]
    fn percent_scale_and_clamp() {
        let names = EngineMetricNames {
            kv_usage: vec!["usage".into()],
            kv_usage_scale: 0.01,
            ..Default::default()
        };
        assert_eq!(extract("usage 50\n", &names).unwrap().kv_usage, Some(0.5));
        assert_eq!(extract("usage 250\n", &names).unwrap().kv_usage, Some(1.0));
        assert_eq!(extract("usage NaN\n", &names).unwrap().kv_usage, None);
    }

    #[test]
    fn garbage_page_is_rejected() {
        assert!(extract("<html>oops</html>", &vllm()).is_err());
        assert!(extract("vllm:num_requests_waiting{ 3\n", &vllm()).is_err());
        let empty = extract("", &vllm()).unwrap();
        assert_eq!(empty, LoadMetrics::default());
    }

    /// Backend labels are untrusted: a product that would overflow (a panic in debug builds,
    /// a wrapped value in release before) or an implausible geometry gives "unknown".
    #[test]
    fn cache_geometry_from_labels_is_bounded() {
        let page = |bs: &str, n: &str| {
            format!("vllm:cache_config_info{{block_size=\"{bs}\",num_gpu_blocks=\"{n}\"}} 1\n")
        };
        let cap = |bs: &str, n: &str| extract(&page(bs, n), &vllm()).unwrap().kv_capacity_tokens();
        assert_eq!(cap("16", "1000"), Some(16_000));
        assert_eq!(cap("18446744073709551615", "2"), None);
        assert_eq!(cap("4294967296", "4294967296"), None);
        assert_eq!(cap("65536", "4294967296"), Some(1 << 48));
        assert_eq!(cap("0", "10"), None);
        assert_eq!(cap("16", "0"), None);
        assert_eq!(cap("-16", "10"), None);
    }
}
