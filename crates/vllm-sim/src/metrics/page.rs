//! The `/metrics` page writer: vLLM 0.32's families, label order and number format.

use std::fmt::Write as _;

use super::{Histogram, Metrics, FINISH_REASONS};

/// Static facts shown in `vllm:cache_config_info` and used for labels.
#[derive(Debug, Clone)]
pub struct PageInfo {
    pub model_name: String,
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub max_model_len: usize,
    pub max_loras: usize,
    pub lora_enabled: bool,
    pub gpu_cache_usage_metric: bool,
    /// Unix time the metrics were created (the `_created` values).
    pub created: f64,
}

/// Formats a sample value the way prometheus_client does (Python `repr`, with Go-style
/// exponents for numbers of more than six integer digits): `0.0`, `10.0`, `1.79e+09`.
pub fn fmt_value(v: f64) -> String {
    if v.is_nan() {
        return "NaN".into();
    }
    if v.is_infinite() {
        return if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        };
    }
    let mut s = format!("{v}");
    if !s.contains('.') && !s.contains('e') {
        s.push_str(".0");
    }
    if v > 0.0 {
        if let Some(dot) = s.find('.') {
            if dot > 6 {
                let digits = format!("{}{}", &s[1..dot], &s[dot + 1..]);
                let mantissa = format!("{}.{}", &s[..1], digits);
                let mantissa = mantissa.trim_end_matches(['0', '.']);
                return format!("{mantissa}e+0{}", dot - 1);
            }
        }
    }
    s
}

/// Writes one page; the base labels are added to every `vllm:` series.
struct Page<'a> {
    out: &'a mut String,
    model: &'a str,
    created: f64,
}

type Labels<'a> = &'a [(&'a str, &'a str)];

impl Page<'_> {
    fn labels(&self, extra: Labels, with_engine: bool) -> String {
        let mut all: Vec<(&str, &str)> = Vec::with_capacity(extra.len() + 2);
        if with_engine {
            all.push(("engine", "0"));
        }
        all.push(("model_name", self.model));
        all.extend_from_slice(extra);
        all.sort_by(|a, b| a.0.cmp(b.0));
        let mut s = String::from("{");
        for (i, (k, v)) in all.iter().enumerate() {
            if i > 0 {
                s.push(',');
            }
            let _ = write!(s, "{k}=\"{}\"", escape_label(v));
        }
        s.push('}');
        s
    }

    fn header(&mut self, name: &str, help: &str, kind: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &str, v: f64) {
        let _ = writeln!(self.out, "{name}{labels} {}", fmt_value(v));
    }

    fn gauge(&mut self, name: &str, help: &str, series: &[(Labels, f64)]) {
        self.header(name, help, "gauge");
        for (extra, v) in series {
            let l = self.labels(extra, true);
            self.sample(name, &l, *v);
        }
    }

    fn counter(&mut self, name: &str, help: &str, series: &[(Labels, f64)], with_engine: bool) {
        let total = format!("{name}_total");
        self.header(&total, help, "counter");
        for (extra, v) in series {
            let l = self.labels(extra, with_engine);
            self.sample(&total, &l, *v);
        }
        self.created(name, help, series.iter().map(|s| s.0), with_engine);
    }

    fn created<'l>(
        &mut self,
        name: &str,
        help: &str,
        label_sets: impl Iterator<Item = Labels<'l>>,
        with_engine: bool,
    ) {
        let created = format!("{name}_created");
        self.header(&created, help, "gauge");
        for extra in label_sets {
            let l = self.labels(extra, with_engine);
            self.sample(&created, &l, self.created);
        }
    }

    fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.header(name, help, "histogram");
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0;
        for (i, c) in h.counts.iter().enumerate() {
            cumulative += c;
            let le = h.le.get(i).map_or("+Inf".to_string(), |b| fmt_value(*b));
            let l = self.labels(&[("le", &le)], true);
            self.sample(&bucket, &l, cumulative as f64);
        }
        let l = self.labels(&[], true);
        self.sample(&format!("{name}_count"), &l, h.count as f64);
        self.sample(&format!("{name}_sum"), &l, h.sum);
        self.created(name, help, std::iter::once(&[][..]), true);
    }
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Renders the whole `vllm:` page.
pub fn render(m: &Metrics, info: &PageInfo) -> String {
    let mut out = String::with_capacity(24 * 1024);
    let mut p = Page {
        out: &mut out,
        model: &info.model_name,
        created: info.created,
    };
    let none: Labels = &[];

    for (name, help) in [
        ("vllm:estimated_flops_per_gpu", "Estimated number of floating point operations per GPU (for Model Flops Utilization calculations)."),
        ("vllm:estimated_read_bytes_per_gpu", "Estimated number of bytes read from memory per GPU (for Model Flops Utilization calculations)."),
        ("vllm:estimated_write_bytes_per_gpu", "Estimated number of bytes written to memory per GPU (for Model Flops Utilization calculations)."),
    ] {
        p.counter(name, help, &[(none, 0.0)], true);
    }
    p.gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        &[(none, m.running as f64)],
    );
    p.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        &[(none, m.waiting as f64)],
    );
    p.gauge(
        "vllm:num_requests_waiting_by_reason",
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
        &[(&[("reason", "capacity")], m.waiting as f64), (&[("reason", "deferred")], 0.0)],
    );
    p.gauge(
        "vllm:engine_sleep_state",
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
        &[
            (&[("sleep_state", "awake")], 1.0),
            (&[("sleep_state", "weights_offloaded")], 0.0),
            (&[("sleep_state", "discard_all")], 0.0),
        ],
    );
    if info.gpu_cache_usage_metric {
        p.gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage.",
            &[(none, m.kv_usage)],
        );
    }
    p.gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        &[(none, m.kv_usage)],
    );
    p.counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        &[(none, m.prefix_queries as f64)],
        true,
    );
    p.counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        &[(none, m.prefix_hits as f64)],
        true,
    );
    p.counter(
        "vllm:external_prefix_cache_queries",
        "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.",
        &[(none, m.external_queries as f64)],
        true,
    );
    p.counter(
        "vllm:external_prefix_cache_hits",
        "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.",
        &[(none, m.external_hits as f64)],
        true,
    );
    for (name, help) in [
        (
            "vllm:mm_cache_queries",
            "Multi-modal cache queries, in terms of number of queried items.",
        ),
        (
            "vllm:mm_cache_hits",
            "Multi-modal cache hits, in terms of number of cached items.",
        ),
    ] {
        p.counter(name, help, &[(none, 0.0)], true);
    }
    p.counter(
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        &[(none, m.preemptions as f64)],
        true,
    );
    let external = m.prompt_tokens_external as f64;
    let prompt_total = (m.prompt_tokens_computed + m.prompt_tokens_cached) as f64 + external;
    let local_hit = m.prompt_tokens_cached as f64;
    p.counter(
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        &[(none, prompt_total)],
        true,
    );
    p.counter(
        "vllm:prompt_tokens_by_source",
        "Number of prompt tokens by source.",
        &[
            (
                &[("source", "local_compute")],
                m.prompt_tokens_computed as f64,
            ),
            (&[("source", "local_cache_hit")], local_hit),
            (&[("source", "external_kv_transfer")], external),
        ],
        true,
    );
    p.counter(
        "vllm:prompt_tokens_cached",
        "Number of cached prompt tokens (local + external).",
        &[(none, local_hit + external)],
        true,
    );
    p.counter(
        "vllm:prompt_tokens_cached_by_source",
        "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
        &[
            (&[("source", "device")], m.prefix_hits as f64),
            (&[("source", "host")], 0.0),
            (&[("source", "p2p")], 0.0),
            (&[("source", "disk")], 0.0),
            (&[("source", "external_unspecified")], m.external_hits as f64),
        ],
        true,
    );
    p.counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        &[(none, m.generation_tokens as f64)],
        true,
    );
    let finished: Vec<([(&str, &str); 1], f64)> = FINISH_REASONS
        .iter()
        .zip(m.finished)
        .map(|(r, n)| ([("finished_reason", *r)], n as f64))
        .collect();
    let finished: Vec<(Labels, f64)> = finished.iter().map(|(l, v)| (&l[..], *v)).collect();
    p.counter(
        "vllm:request_success",
        "Count of successfully processed requests.",
        &finished,
        true,
    );
    p.counter(
        "vllm:admission_rejections",
        "Number of admission attempts rejected by a queue limit, by reason.",
        &[
            (&[("reason", "max_num_queued_reqs")], 0.0),
            (&[("reason", "max_num_queued_tokens")], 0.0),
        ],
        false,
    );
    p.histogram(
        "vllm:request_prompt_tokens",
        "Number of prefill tokens processed.",
        &m.request_prompt_tokens,
    );
    p.histogram(
        "vllm:request_generation_tokens",
        "Number of generation tokens processed.",
        &m.request_generation_tokens,
    );
    p.histogram(
        "vllm:iteration_tokens_total",
        "Histogram of number of tokens per engine_step.",
        &m.iteration_tokens,
    );
    p.histogram(
        "vllm:request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
        &m.request_max_num_generation_tokens,
    );
    p.histogram(
        "vllm:request_params_n",
        "Histogram of the n request parameter.",
        &m.request_params_n,
    );
    p.histogram(
        "vllm:request_params_max_tokens",
        "Histogram of the max_tokens request parameter.",
        &m.request_params_max_tokens,
    );
    p.histogram(
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &m.ttft,
    );
    p.histogram(
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        &m.itl,
    );
    p.histogram(
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        &m.tpot,
    );
    p.histogram(
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        &m.e2e,
    );
    p.histogram(
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        &m.queue_time,
    );
    p.histogram(
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        &m.inference_time,
    );
    p.histogram(
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        &m.prefill_time,
    );
    p.histogram(
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        &m.decode_time,
    );
    p.histogram(
        "vllm:request_num_preemptions",
        "Histogram of the number of times a request was preempted.",
        &m.request_preemptions,
    );
    p.histogram(
        "vllm:request_prefill_kv_computed_tokens",
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
        &m.prefill_kv_computed_tokens,
    );
    if info.lora_enabled {
        let running = m.running_loras.join(",");
        let waiting = m.waiting_loras.join(",");
        let max_lora = info.max_loras.to_string();
        p.gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            &[(
                &[
                    ("max_lora", &max_lora),
                    ("running_lora_adapters", &running),
                    ("waiting_lora_adapters", &waiting),
                ],
                m.lora_info_time,
            )],
        );
    }
    cache_config_info(&mut p, info);
    out
}

fn cache_config_info(p: &mut Page, info: &PageInfo) {
    let tokens = info.block_size * info.num_gpu_blocks;
    // Llama-3.1-8B in bf16 keeps 128 KiB of KV per token (see cost.rs).
    let bytes = tokens as u64 * 131_072;
    let concurrency = fmt_value(tokens as f64 / info.max_model_len as f64);
    let (bs, blocks, toks, mem) = (
        info.block_size.to_string(),
        info.num_gpu_blocks.to_string(),
        tokens.to_string(),
        bytes.to_string(),
    );
    let labels: &[(&str, &str)] = &[
        ("_block_size_resolved", "True"),
        ("block_size", &bs),
        ("cache_dtype", "auto"),
        ("cache_hit_alignment_tokens", "None"),
        ("effective_attention_block_size", &bs),
        ("enable_prefix_caching", "True"),
        ("gpu_memory_utilization", "0.9"),
        ("hash_block_size", "None"),
        ("is_attention_free", "False"),
        ("kv_cache_max_concurrency", &concurrency),
        ("kv_cache_memory_bytes", &mem),
        ("kv_cache_size_tokens", &toks),
        ("kv_sharing_fast_prefill", "False"),
        ("num_cpu_blocks", "None"),
        ("num_gpu_blocks", &blocks),
        ("num_gpu_blocks_override", &blocks),
        ("prefix_caching_hash_algo", "xxh3"),
        ("sliding_window", "None"),
        ("user_specified_block_size", "True"),
    ];
    p.gauge(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        &[(labels, 1.0)],
    );
}

/// The page restricted to the samples named in `names`, as `prometheus_client`'s exposition
/// app answers `?name[]=…` (vLLM serves that app at `/metrics/`): a family keeps its `# HELP`
/// and `# TYPE` lines when at least one of its samples is kept.
pub fn restrict(page: &str, names: &[String]) -> String {
    let mut out = String::with_capacity(1024);
    let mut header: Vec<&str> = Vec::new();
    for line in page.lines() {
        if line.starts_with("# HELP ") {
            header.clear();
            header.push(line);
            continue;
        }
        if line.starts_with('#') {
            header.push(line);
            continue;
        }
        let name = line.split(['{', ' ']).next().unwrap_or("");
        if names.iter().any(|n| n == name) {
            for h in header.drain(..) {
                out.push_str(h);
                out.push('\n');
            }
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The `name[]` values of a query string, percent-decoded.
pub fn query_names(query: &str) -> Vec<String> {
    query
        .split('&')
        .filter_map(|pair| {
            let (k, v) = pair.split_once('=')?;
            (percent_decode(k) == "name[]").then(|| percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match b[i] {
            b'%' if i + 2 < b.len() => match (hex(b[i + 1]), hex(b[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    #[test]
    fn restricted_page_keeps_named_samples_and_their_headers() {
        let page = "# HELP a A.\n# TYPE a gauge\na{x=\"1\"} 1\n# HELP b_total B.\n# TYPE b_total counter\nb_total 2\nb_created 3\n# HELP c C.\n# TYPE c gauge\nc 4\n";
        let names = super::query_names("name%5B%5D=b_total&name[]=c&other=1");
        assert_eq!(names, vec!["b_total".to_string(), "c".to_string()]);
        assert_eq!(
            super::restrict(page, &names),
            "# HELP b_total B.\n# TYPE b_total counter\nb_total 2\n# HELP c C.\n# TYPE c gauge\nc 4\n"
        );
        assert_eq!(super::restrict(page, &[]), "");
    }

    use super::*;
    use crate::metrics::Metrics;

    #[test]
    fn values_format_like_prometheus_client() {
        assert_eq!(fmt_value(0.0), "0.0");
        assert_eq!(fmt_value(2072.0), "2072.0");
        assert_eq!(fmt_value(0.001), "0.001");
        assert_eq!(fmt_value(f64::INFINITY), "+Inf");
        assert_eq!(fmt_value(1_796_052_487.656_368_5), "1.7960524876563685e+09");
        assert_eq!(fmt_value(1_000_000.0), "1e+06");
        assert_eq!(fmt_value(0.203), "0.203");
    }

    #[test]
    fn histogram_buckets_are_cumulative_in_output() {
        let mut m = Metrics::new(2048);
        m.ttft.observe(0.015);
        m.ttft.observe(3.0);
        let info = PageInfo {
            model_name: "m".into(),
            block_size: 16,
            num_gpu_blocks: 8,
            max_model_len: 2048,
            max_loras: 1,
            lora_enabled: false,
            gpu_cache_usage_metric: false,
            created: 1.0,
        };
        let page = render(&m, &info);
        assert!(page.contains(
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.01\",model_name=\"m\"} 0.0\n"
        ));
        assert!(page.contains(
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"0.02\",model_name=\"m\"} 1.0\n"
        ));
        assert!(page.contains(
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"m\"} 2.0\n"
        ));
        assert!(page.contains(
            "vllm:time_to_first_token_seconds_sum{engine=\"0\",model_name=\"m\"} 3.015\n"
        ));
        assert!(!page.contains("gpu_cache_usage_perc"));
        assert!(!page.contains("lora_requests_info"));
        assert!(page.contains(
            "vllm:admission_rejections_total{model_name=\"m\",reason=\"max_num_queued_reqs\"} 0.0"
        ));
    }
}
