//! Metrics: the engine's counters, gauges and histograms, rendered as vLLM 0.32's `/metrics`.
//!
//! Names, types, HELP texts, label sets, label order (alphabetical), bucket boundaries and
//! number formatting follow a real vLLM 0.32 page (prometheus_client multiprocess output):
//! counters are exposed as `NAME_total` with a `NAME_created` gauge beside them, histograms as
//! `_bucket{le=..}`, `_count`, `_sum` plus `_created`, and every `vllm:` series carries
//! `engine="0"` and `model_name` (except `admission_rejections`, which vLLM exposes without
//! `engine`).
//!
//! All durations in histograms are *simulated* seconds: what a real GPU with the cost model's
//! speed would report, whatever `--time-scale` the simulator runs at.
//!
//! The engine updates one `Metrics` behind a mutex once per step; `/metrics` renders it
//! ([`page`]).

mod page;

pub use page::{fmt_value, query_names, render, restrict, PageInfo};

/// Finish reasons in vLLM's label order.
pub const FINISH_REASONS: [&str; 5] = ["stop", "length", "abort", "error", "repetition"];
/// Index of "length" in [`FINISH_REASONS`].
pub const FINISHED_LENGTH: usize = 1;
/// Index of "abort" in [`FINISH_REASONS`].
pub const FINISHED_ABORT: usize = 2;
/// Index of "error" in [`FINISH_REASONS`].
pub const FINISHED_ERROR: usize = 3;

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const REQUEST_TIME_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
const ITERATION_TOKEN_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];
const PARAMS_N_BUCKETS: &[f64] = &[1.0, 2.0, 5.0, 10.0, 20.0];
const PREEMPTION_BUCKETS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0];

/// vLLM's 1-2-5 series up to `max` (token-count histograms: 1, 2, 5, 10, 20, 50, ...).
pub fn buckets_1_2_5(max: usize) -> Vec<f64> {
    let mut out = Vec::new();
    let mut exp = 1.0;
    loop {
        for m in [1.0, 2.0, 5.0] {
            let v = m * exp;
            if v > max as f64 {
                return out;
            }
            out.push(v);
        }
        exp *= 10.0;
    }
}

/// A Prometheus histogram with fixed upper bounds.
#[derive(Debug, Clone)]
pub struct Histogram {
    le: Vec<f64>,
    /// Per-bucket (not cumulative) counts; the last slot is the +Inf bucket.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(le: &[f64]) -> Self {
        Self {
            le: le.to_vec(),
            counts: vec![0; le.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        let i = self
            .le
            .iter()
            .position(|&b| v <= b)
            .unwrap_or(self.le.len());
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn sum(&self) -> f64 {
        self.sum
    }
}

/// Everything `/metrics` shows, updated by the engine.
#[derive(Debug, Clone)]
pub struct Metrics {
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub preemptions: u64,
    /// Prompt tokens of requests whose prefill finished, split by source.
    pub prompt_tokens_computed: u64,
    pub prompt_tokens_cached: u64,
    /// P/D: prompt tokens whose KV came from a pull (vLLM's `external_kv_transfer`).
    pub prompt_tokens_external: u64,
    /// P/D: vLLM's connector prefix-cache counters (`vllm:external_prefix_cache_*`).
    pub external_queries: u64,
    pub external_hits: u64,
    pub generation_tokens: u64,
    /// Finished requests by reason, indexed like [`FINISH_REASONS`].
    pub finished: [u64; 5],
    pub running_loras: Vec<String>,
    pub waiting_loras: Vec<String>,
    /// Unix time of the last LoRA-state change (`vllm:lora_requests_info`'s value).
    pub lora_info_time: f64,
    pub request_prompt_tokens: Histogram,
    pub request_generation_tokens: Histogram,
    pub iteration_tokens: Histogram,
    pub request_max_num_generation_tokens: Histogram,
    pub request_params_n: Histogram,
    pub request_params_max_tokens: Histogram,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub tpot: Histogram,
    pub e2e: Histogram,
    pub queue_time: Histogram,
    pub inference_time: Histogram,
    pub prefill_time: Histogram,
    pub decode_time: Histogram,
    pub request_preemptions: Histogram,
    pub prefill_kv_computed_tokens: Histogram,
}

impl Metrics {
    pub fn new(max_model_len: usize) -> Self {
        let tokens = buckets_1_2_5(max_model_len);
        Self {
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
            prefix_queries: 0,
            prefix_hits: 0,
            preemptions: 0,
            prompt_tokens_computed: 0,
            prompt_tokens_cached: 0,
            prompt_tokens_external: 0,
            external_queries: 0,
            external_hits: 0,
            generation_tokens: 0,
            finished: [0; 5],
            running_loras: Vec::new(),
            waiting_loras: Vec::new(),
            lora_info_time: unix_now(),
            request_prompt_tokens: Histogram::new(&tokens),
            request_generation_tokens: Histogram::new(&tokens),
            iteration_tokens: Histogram::new(ITERATION_TOKEN_BUCKETS),
            request_max_num_generation_tokens: Histogram::new(&tokens),
            request_params_n: Histogram::new(PARAMS_N_BUCKETS),
            request_params_max_tokens: Histogram::new(&tokens),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            tpot: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(REQUEST_TIME_BUCKETS),
            queue_time: Histogram::new(REQUEST_TIME_BUCKETS),
            inference_time: Histogram::new(REQUEST_TIME_BUCKETS),
            prefill_time: Histogram::new(REQUEST_TIME_BUCKETS),
            decode_time: Histogram::new(REQUEST_TIME_BUCKETS),
            request_preemptions: Histogram::new(PREEMPTION_BUCKETS),
            prefill_kv_computed_tokens: Histogram::new(&tokens),
        }
    }
}

/// Seconds since the Unix epoch, as vLLM's `_created` and info-gauge values.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_buckets_follow_1_2_5() {
        assert_eq!(
            buckets_1_2_5(1024),
            [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0]
        );
        assert_eq!(buckets_1_2_5(32768).last(), Some(&20000.0));
    }
}
