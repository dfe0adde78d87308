//! Configuration: every `vllm-sim` flag, spelled like `vllm serve` where vLLM has the flag.
//!
//! `SimConfig` is both the library's configuration and the binary's clap parser, so the CLI
//! defaults and `SimConfig::default()` cannot drift apart (a unit test checks it).

use std::time::Duration;

use clap::Parser;

use crate::cost::CostModel;
use crate::kv_events::KvEventsConfig;

/// Model name served when no `--model` / `--served-model-name` is given.
pub const DEFAULT_MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// A vLLM stand-in with a faithful KV cache, prefix cache, scheduler and latency model.
///
/// Serves the OpenAI API (`/v1/completions`, `/v1/chat/completions`, `/v1/responses`,
/// `/v1/models`), `/health`, Prometheus `/metrics` with vLLM's metric names, the probes
/// SGLang's and vLLM's routers send to workers, and `POST /sim/faults` to inject failures at
/// run time.
#[derive(Debug, Clone, PartialEq, Parser)]
#[command(name = "vllm-sim", version, about, long_about = None)]
pub struct SimConfig {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (with --fleet N: the first of N consecutive ports).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Model name (used as the served name when --served-model-name is not given).
    #[arg(long, default_value = DEFAULT_MODEL)]
    pub model: String,
    /// Names the model is served under; the first is the primary one shown in metrics.
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,
    /// Tokens per KV-cache block (vLLM: 16 on GPU, 128 on the CPU build).
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Number of KV-cache blocks (also accepted as vLLM's --num-gpu-blocks-override).
    #[arg(
        long = "num-gpu-blocks",
        alias = "num-gpu-blocks-override",
        default_value_t = 2048
    )]
    pub num_gpu_blocks: usize,
    /// Maximum number of sequences in a batch.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget of one engine step (prefill is chunked to fit it).
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// Maximum prompt + output length of one request.
    #[arg(long, default_value_t = 32768)]
    pub max_model_len: usize,
    /// LoRA adapters: `name=path` or vLLM's JSON form `{"name":..,"path":..}`.
    #[arg(long, num_args = 1.., value_parser = parse_lora)]
    pub lora_modules: Vec<LoraModule>,
    /// Distinct LoRA adapters that may run at once (others wait); `max_lora` in metrics.
    #[arg(long, default_value_t = 1)]
    pub max_loras: usize,
    /// Simulated-clock speed-up: 10 runs ten times faster than real time, keeping all ratios.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// No latency at all: steps cost nothing (for measuring a proxy's own overhead).
    #[arg(long)]
    pub instant: bool,
    /// Also expose the pre-v1 `vllm:gpu_cache_usage_perc` gauge.
    #[arg(long)]
    pub gpu_cache_usage_metric: bool,
    /// Report `usage.prompt_tokens_details.cached_tokens` (vLLM's flag of the same name).
    #[arg(long)]
    pub enable_prompt_tokens_details: bool,
    /// Cost model: fixed cost of every step, in simulated milliseconds.
    #[arg(long, default_value_t = 6.0)]
    pub cost_step_ms: f64,
    /// Cost model: cost of each computed prompt token, in simulated microseconds.
    #[arg(long, default_value_t = 80.0)]
    pub cost_prefill_token_us: f64,
    /// Cost model: cost of each sequence in a step, in simulated microseconds.
    #[arg(long, default_value_t = 60.0)]
    pub cost_sequence_us: f64,
    /// Cost model: cost of each context token read by attention, in simulated nanoseconds.
    #[arg(long, default_value_t = 50.0)]
    pub cost_context_token_ns: f64,
    /// Fault: fraction (0–1) of completion requests answered with HTTP 500.
    #[arg(long, default_value_t = 0.0)]
    pub fail_rate: f64,
    /// Fault: delay every /metrics answer by this many (wall-clock) milliseconds.
    #[arg(long, default_value_t = 0)]
    pub metrics_delay_ms: u64,
    /// Fault: /metrics never answers.
    #[arg(long)]
    pub metrics_hang: bool,
    /// Fault: /metrics answers 200 with text that is not Prometheus exposition.
    #[arg(long)]
    pub metrics_garbage: bool,
    /// Fault: hold the first token of every response back for this many wall-clock ms.
    #[arg(long, default_value_t = 0)]
    pub first_token_stall_ms: u64,
    /// Fault: end every response body abruptly after this many tokens (no [DONE]).
    #[arg(long)]
    pub cut_stream_after: Option<u32>,
    /// Fault: after this many completion requests, close the listener (connections refused)
    /// and drop open connections; come back with `POST /sim/faults {"refuse_connections":false}`
    /// on the admin port.
    #[arg(long)]
    pub refuse_after: Option<u64>,
    /// Serve `/sim/*` and `/health` on this extra port too, which stays up while the main port
    /// refuses connections (with --fleet: the first of N consecutive ports).
    #[arg(long)]
    pub admin_port: Option<u16>,
    /// Start N simulators on consecutive ports from --port and print their URLs.
    #[arg(long, default_value_t = 1)]
    pub fleet: usize,
    /// Hugging Face model directory (`tokenizer.json`, `tokenizer_config.json`,
    /// `chat_template.jinja`): tokenize chat and text prompts with it, as vLLM does, instead
    /// of the built-in stand-in tokenizer.
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<std::path::PathBuf>,
    /// vLLM's KV-cache event publisher, same JSON: e.g.
    /// `{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558",
    /// "topic":"kv"}` (keys: enable_kv_cache_events, publisher, endpoint, replay_endpoint,
    /// buffer_steps, hwm, max_queue_size, topic; unknown keys are refused). Binds when the
    /// endpoint has `*` or `::`, connects otherwise; `tcp://*:0` binds a free port (see
    /// `GET /kv_event_sources`). With --fleet, ports move up by one per simulator.
    #[arg(long, value_parser = parse_kv_events)]
    pub kv_events_config: Option<KvEventsConfig>,
    /// Fault: fraction (0–1) of KV-event batches not sent (sequence gaps; kept for replay).
    #[arg(long, default_value_t = 0.0)]
    pub kv_events_drop_rate: f64,
    /// Fault: after this many KV-event batches, stall the stream (see --kv-events-stall-ms).
    #[arg(long)]
    pub kv_events_stall_after: Option<u64>,
    /// Fault: how long the stall of --kv-events-stall-after lasts, in wall-clock ms (0: until
    /// `POST /sim/faults {"kv_events_stall":false}`).
    #[arg(long, default_value_t = 0)]
    pub kv_events_stall_ms: u64,
    /// Fault: after this many KV-event batches, restart the engine once (cache wiped, sequence
    /// back to 0 with AllBlocksCleared, event sockets re-opened).
    #[arg(long)]
    pub kv_events_restart_after: Option<u64>,
    /// P/D disaggregation role (vLLM's NixlConnector protocol, see README "P/D"): `prefill`
    /// holds KV for `kv_transfer_params.do_remote_decode` requests, `decode` pulls it for
    /// `do_remote_prefill` ones, `both` does either. A leg the role does not take is a 400.
    #[arg(long, value_enum, default_value_t = KvRole::Both)]
    pub kv_role: KvRole,
    /// `remote_engine_id` this simulator reports and answers pulls for (vLLM's
    /// `kv_transfer_config.engine_id`); default a random UUID.
    #[arg(long)]
    pub kv_engine_id: Option<String>,
    /// How long a prefill's KV blocks wait for a pull before they are freed, in wall-clock ms
    /// (vLLM's `kv_lease_duration`, 30 s).
    #[arg(long, default_value_t = 30_000)]
    pub kv_lease_ms: u64,
    /// KV bytes per token moved by a pull (2 × layers × kv_heads × head_dim × dtype bytes;
    /// 131072 = Llama-3-8B in bf16).
    #[arg(long, default_value_t = 131_072)]
    pub kv_bytes_per_token: u64,
    /// Bandwidth of a KV pull in GB/s (10⁹ bytes per second, not gigabits).
    #[arg(long, default_value_t = 25.0)]
    pub kv_transfer_gbps: f64,
    /// What a decode does when its pull fails (vLLM's `kv_load_failure_policy`): `fail` the
    /// request (500, or an error event in a stream) or `recompute` the prompt locally.
    #[arg(long, value_enum, default_value_t = KvLoadFailurePolicy::Fail)]
    pub kv_load_failure_policy: KvLoadFailurePolicy,
    /// Responses API store (vLLM's env var `VLLM_ENABLE_RESPONSES_API_STORE=1`, also read
    /// here): keep `/v1/responses` objects for GET, cancel, `previous_response_id` and
    /// `background`. Off: `store` is forced false and `background` is refused, as vLLM does.
    /// The env var takes vLLM's `1` / `0` (or true/false, yes/no, on/off).
    #[arg(long, env = "VLLM_ENABLE_RESPONSES_API_STORE",
          value_parser = clap::builder::BoolishValueParser::new())]
    pub responses_store: bool,
    /// Most responses the store keeps; beyond it the oldest is dropped (vLLM never drops any).
    #[arg(long, default_value_t = 10_000)]
    pub responses_store_limit: usize,
}

/// Which legs of a P/D request a simulator takes (`--kv-role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvRole {
    /// Prefill legs only (`do_remote_decode`).
    Prefill,
    /// Decode legs only (`do_remote_prefill`).
    Decode,
    /// Either leg, and plain requests (vLLM's `kv_both`).
    #[default]
    Both,
}

impl KvRole {
    pub fn prefills(self) -> bool {
        matches!(self, KvRole::Prefill | KvRole::Both)
    }
    pub fn decodes(self) -> bool {
        matches!(self, KvRole::Decode | KvRole::Both)
    }
}

/// vLLM's `kv_load_failure_policy` (`--kv-load-failure-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum KvLoadFailurePolicy {
    /// The request ends with an error (vLLM's default since PR #34896).
    #[default]
    Fail,
    /// The prompt is prefilled locally.
    Recompute,
}

fn parse_kv_events(s: &str) -> Result<KvEventsConfig, String> {
    KvEventsConfig::parse(s).map_err(|e| e.to_string())
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8000,
            model: DEFAULT_MODEL.into(),
            served_model_name: Vec::new(),
            block_size: 16,
            num_gpu_blocks: 2048,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 32768,
            lora_modules: Vec::new(),
            max_loras: 1,
            time_scale: 1.0,
            instant: false,
            gpu_cache_usage_metric: false,
            enable_prompt_tokens_details: false,
            cost_step_ms: 6.0,
            cost_prefill_token_us: 80.0,
            cost_sequence_us: 60.0,
            cost_context_token_ns: 50.0,
            fail_rate: 0.0,
            metrics_delay_ms: 0,
            metrics_hang: false,
            metrics_garbage: false,
            first_token_stall_ms: 0,
            cut_stream_after: None,
            refuse_after: None,
            admin_port: None,
            fleet: 1,
            tokenizer: None,
            kv_events_config: None,
            kv_events_drop_rate: 0.0,
            kv_events_stall_after: None,
            kv_events_stall_ms: 0,
            kv_events_restart_after: None,
            kv_role: KvRole::Both,
            kv_engine_id: None,
            kv_lease_ms: 30_000,
            kv_bytes_per_token: 131_072,
            kv_transfer_gbps: 25.0,
            kv_load_failure_policy: KvLoadFailurePolicy::Fail,
            responses_store: false,
            responses_store_limit: 10_000,
        }
    }
}

/// A LoRA adapter served on top of the base model.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct LoraModule {
    pub name: String,
    pub path: String,
    #[serde(default)]
    pub base_model_name: Option<String>,
}

fn parse_lora(s: &str) -> Result<LoraModule, String> {
    if s.trim_start().starts_with('{') {
        return serde_json::from_str(s).map_err(|e| format!("invalid LoRA JSON: {e}"));
    }
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => Ok(LoraModule {
            name: name.into(),
            path: path.into(),
            base_model_name: None,
        }),
        _ => Err(format!("expected name=path, got {s:?}")),
    }
}

/// A configuration that cannot run.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("{0} must be greater than zero")]
    Zero(&'static str),
    #[error("--time-scale must be a positive finite number, got {0}")]
    TimeScale(f64),
    #[error("--fail-rate must be within 0..=1, got {0}")]
    FailRate(f64),
    #[error("cost coefficients must be finite and non-negative")]
    Cost,
    #[error("--kv-events-drop-rate must be within 0..=1, got {0}")]
    KvDropRate(f64),
    #[error("{0} needs --kv-events-config with enable_kv_cache_events")]
    KvEventsOff(&'static str),
    #[error("--kv-transfer-gbps must be a positive finite number, got {0}")]
    KvBandwidth(f64),
}

impl SimConfig {
    /// Checks what would make the engine misbehave.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (v, name) in [
            (self.block_size, "--block-size"),
            (self.num_gpu_blocks, "--num-gpu-blocks"),
            (self.max_num_seqs, "--max-num-seqs"),
            (self.max_num_batched_tokens, "--max-num-batched-tokens"),
            (self.max_model_len, "--max-model-len"),
            (self.fleet, "--fleet"),
            (self.responses_store_limit, "--responses-store-limit"),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero(name));
            }
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(ConfigError::TimeScale(self.time_scale));
        }
        if !(0.0..=1.0).contains(&self.fail_rate) {
            return Err(ConfigError::FailRate(self.fail_rate));
        }
        let costs = [
            self.cost_step_ms,
            self.cost_prefill_token_us,
            self.cost_sequence_us,
            self.cost_context_token_ns,
        ];
        if costs.iter().any(|c| !c.is_finite() || *c < 0.0) {
            return Err(ConfigError::Cost);
        }
        if !(self.kv_transfer_gbps.is_finite() && self.kv_transfer_gbps > 0.0) {
            return Err(ConfigError::KvBandwidth(self.kv_transfer_gbps));
        }
        if !(0.0..=1.0).contains(&self.kv_events_drop_rate) {
            return Err(ConfigError::KvDropRate(self.kv_events_drop_rate));
        }
        if !self.kv_events() {
            let faults = [
                (self.kv_events_drop_rate > 0.0, "--kv-events-drop-rate"),
                (
                    self.kv_events_stall_after.is_some(),
                    "--kv-events-stall-after",
                ),
                (
                    self.kv_events_restart_after.is_some(),
                    "--kv-events-restart-after",
                ),
            ];
            if let Some((_, flag)) = faults.iter().find(|(on, _)| *on) {
                return Err(ConfigError::KvEventsOff(flag));
            }
        }
        Ok(())
    }

    /// Whether KV-cache events are published.
    pub fn kv_events(&self) -> bool {
        self.kv_events_config
            .as_ref()
            .is_some_and(KvEventsConfig::publishes)
    }

    /// Names the base model is served under; the first is the primary one.
    pub fn model_names(&self) -> Vec<String> {
        if self.served_model_name.is_empty() {
            vec![self.model.clone()]
        } else {
            self.served_model_name.clone()
        }
    }

    /// Wall-clock time of pulling `tokens` tokens of KV (whole blocks, `--kv-bytes-per-token`,
    /// `--kv-transfer-gbps`), divided by `--time-scale`; zero with `--instant`.
    pub fn kv_transfer_time(&self, tokens: usize) -> Duration {
        if self.instant {
            return Duration::ZERO;
        }
        let bs = self.block_size.max(1) as u64;
        let tokens = (tokens as u64).div_ceil(bs).saturating_mul(bs);
        let bytes = tokens.saturating_mul(self.kv_bytes_per_token) as f64;
        let secs = bytes / (self.kv_transfer_gbps * 1e9) / self.time_scale;
        Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX)
    }

    /// The step-time coefficients these flags describe (zero with `--instant`).
    pub fn cost_model(&self) -> CostModel {
        if self.instant {
            return CostModel::zero();
        }
        CostModel {
            step_overhead: Duration::from_secs_f64(self.cost_step_ms / 1e3),
            per_prefill_token: Duration::from_secs_f64(self.cost_prefill_token_us / 1e6),
            per_sequence: Duration::from_secs_f64(self.cost_sequence_us / 1e6),
            per_context_token: Duration::from_secs_f64(self.cost_context_token_ns / 1e9),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn responses_store_flags_parse() {
        let c = SimConfig::try_parse_from([
            "vllm-sim",
            "--responses-store",
            "--responses-store-limit",
            "5",
        ])
        .unwrap();
        assert!(c.responses_store);
        assert_eq!(c.responses_store_limit, 5);
        let zero = SimConfig {
            responses_store_limit: 0,
            ..SimConfig::default()
        };
        assert!(zero.validate().is_err());
    }

    #[test]
    fn default_matches_cli_defaults() {
        assert_eq!(
            SimConfig::try_parse_from(["vllm-sim"]).unwrap(),
            SimConfig::default()
        );
        assert_eq!(
            SimConfig::default().cost_model(),
            CostModel::llama31_8b_h100()
        );
        SimConfig::default().validate().unwrap();
    }

    #[test]
    fn vllm_spellings_parse() {
        let c = SimConfig::try_parse_from([
            "vllm-sim",
            "--served-model-name",
            "a",
            "b",
            "--num-gpu-blocks-override",
            "64",
            "--lora-modules",
            "sql=/p/sql",
            r#"{"name":"chat","path":"/p/chat","base_model_name":"a"}"#,
            "--block-size",
            "128",
        ])
        .unwrap();
        assert_eq!(c.model_names(), ["a", "b"]);
        assert_eq!(c.num_gpu_blocks, 64);
        assert_eq!(c.block_size, 128);
        assert_eq!(c.lora_modules.len(), 2);
        assert_eq!(c.lora_modules[1].base_model_name.as_deref(), Some("a"));
        assert!(SimConfig::try_parse_from(["vllm-sim", "--lora-modules", "noequals"]).is_err());
    }

    #[test]
    fn kv_events_flags_parse_and_validate() {
        let c = SimConfig::try_parse_from([
            "vllm-sim",
            "--kv-events-config",
            r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","topic":"t"}"#,
            "--kv-events-drop-rate",
            "0.5",
            "--kv-events-restart-after",
            "3",
        ])
        .unwrap();
        assert!(c.kv_events());
        c.validate().unwrap();
        assert_eq!(c.kv_events_config.as_ref().unwrap().topic, "t");
        let err = SimConfig::try_parse_from(["vllm-sim", "--kv-events-config", r#"{"topik":"t"}"#])
            .unwrap_err()
            .to_string();
        assert!(err.contains("topik"), "{err}");
        let off = SimConfig {
            kv_events_stall_after: Some(2),
            ..SimConfig::default()
        };
        assert_eq!(
            off.validate(),
            Err(ConfigError::KvEventsOff("--kv-events-stall-after"))
        );
        let bad = SimConfig {
            kv_events_drop_rate: 2.0,
            ..c
        };
        assert_eq!(bad.validate(), Err(ConfigError::KvDropRate(2.0)));
    }

    #[test]
    fn pd_flags_parse_and_transfer_time_counts_whole_blocks() {
        let c = SimConfig::try_parse_from([
            "vllm-sim",
            "--kv-role",
            "prefill",
            "--kv-load-failure-policy",
            "recompute",
            "--kv-transfer-gbps",
            "1",
            "--kv-bytes-per-token",
            "1000",
        ])
        .unwrap();
        assert_eq!(c.kv_role, KvRole::Prefill);
        assert!(c.kv_role.prefills() && !c.kv_role.decodes());
        assert_eq!(c.kv_load_failure_policy, KvLoadFailurePolicy::Recompute);
        // 17 tokens = 2 blocks of 16 = 32 tokens × 1000 B at 10⁹ B/s = 32 µs.
        assert_eq!(c.kv_transfer_time(17), Duration::from_micros(32));
        // The default: 4096 tokens of Llama-3-8B (512 MiB) at 25 GB/s ≈ 21.5 ms.
        let d = SimConfig::default().kv_transfer_time(4096);
        assert_eq!(d.as_micros(), 21_474);
        let bad = SimConfig {
            kv_transfer_gbps: 0.0,
            ..SimConfig::default()
        };
        assert_eq!(bad.validate(), Err(ConfigError::KvBandwidth(0.0)));
        assert!(SimConfig::try_parse_from(["vllm-sim", "--kv-role", "nope"]).is_err());
    }

    #[test]
    fn validation_rejects_nonsense() {
        let bad = SimConfig {
            time_scale: 0.0,
            ..SimConfig::default()
        };
        assert_eq!(bad.validate(), Err(ConfigError::TimeScale(0.0)));
        let bad = SimConfig {
            block_size: 0,
            ..SimConfig::default()
        };
        assert_eq!(bad.validate(), Err(ConfigError::Zero("--block-size")));
        let bad = SimConfig {
            fail_rate: 1.5,
            ..SimConfig::default()
        };
        assert!(bad.validate().is_err());
        let instant = SimConfig {
            instant: true,
            ..SimConfig::default()
        };
        assert_eq!(instant.cost_model(), CostModel::zero());
    }
}
