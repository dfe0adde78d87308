//! `[forward]`: how requests reach the backends (timeouts, the connection pool, retries and
//! their budget, TLS roots), with its defaults and checks (errors name `forward.FIELD`).

use serde::Deserialize;

use crate::config_error::ConfigError;

/// `[forward]`: the hyper client that forwards requests.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ForwardConfig {
    /// Connect timeout per attempt: TCP connect plus the TLS handshake for `https://` backends.
    pub connect_timeout_ms: u64,
    /// Time allowed for the backend's response headers (non-streaming requests send headers
    /// only when generation ends, so this bounds a whole generation).
    pub response_timeout_ms: u64,
    /// Attempts per request on connection failures, each on a different backend when possible.
    pub max_attempts: u32,
    /// Idle keep-alive connections kept per backend.
    pub pool_max_idle_per_backend: usize,
    /// How long an idle keep-alive connection is kept.
    pub pool_idle_timeout_ms: u64,
    /// Forward the client's `Authorization` header to backends that have no `api_key`.
    pub forward_client_authorization: bool,
    /// Longest silence between two chunks of a streaming response before it is cut.
    pub stream_idle_timeout_ms: u64,
    /// Longest a whole request may take, response body included (0 = no limit).
    pub request_timeout_ms: u64,
    /// Retry on another backend when a backend answers 5xx or 429 (before any byte reached
    /// the client), not only when it cannot be reached.
    pub retry_on_status: bool,
    /// Retries allowed as a fraction of requests, so retries cannot multiply load in an outage.
    pub retry_budget_ratio: f64,
    /// Retries per second always allowed on top of the ratio.
    pub retry_budget_min_per_sec: u32,
    /// How long a request counts towards the budget (1000–60000 ms).
    pub retry_budget_window_ms: u64,
    /// Backoff before retry n: min(max, base × 2ⁿ) × a random factor in [0.5, 1.5).
    pub backoff_base_ms: u64,
    pub backoff_max_ms: u64,
    /// PEM file of the CAs trusted for `https://` backends without a `ca_file` of their own
    /// (unset: the built-in Mozilla roots).
    pub ca_file: Option<std::path::PathBuf>,
    /// Forward a client's own top-level `kv_transfer_params` to backends (off: it is removed;
    /// see `crate::forward::kv_params` for why).
    pub allow_client_kv_transfer_params: bool,
}

impl Default for ForwardConfig {
    fn default() -> Self {
        ForwardConfig {
            connect_timeout_ms: 2_000,
            response_timeout_ms: 600_000,
            max_attempts: 3,
            pool_max_idle_per_backend: 256,
            pool_idle_timeout_ms: 4_000,
            forward_client_authorization: false,
            stream_idle_timeout_ms: 120_000,
            request_timeout_ms: 1_800_000,
            retry_on_status: true,
            retry_budget_ratio: 0.2,
            retry_budget_min_per_sec: 1,
            retry_budget_window_ms: 10_000,
            backoff_base_ms: 20,
            backoff_max_ms: 500,
            ca_file: None,
            allow_client_kv_transfer_params: false,
        }
    }
}

impl ForwardConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1_000..=60_000).contains(&self.retry_budget_window_ms) {
            return Err(ConfigError::invalid(
                "forward.retry_budget_window_ms",
                "must be within 1000..60000",
            ));
        }
        if self.retry_budget_min_per_sec > 1_000_000 {
            return Err(ConfigError::invalid(
                "forward.retry_budget_min_per_sec",
                "must be at most 1000000",
            ));
        }
        if !(0.0..=1.0).contains(&self.retry_budget_ratio) {
            return Err(ConfigError::invalid(
                "forward.retry_budget_ratio",
                "must be within 0..1",
            ));
        }
        for (field, v) in [
            ("forward.connect_timeout_ms", self.connect_timeout_ms),
            ("forward.response_timeout_ms", self.response_timeout_ms),
            (
                "forward.stream_idle_timeout_ms",
                self.stream_idle_timeout_ms,
            ),
        ] {
            if v == 0 {
                return Err(ConfigError::invalid(field, "must be greater than 0"));
            }
        }
        if self.max_attempts == 0 {
            return Err(ConfigError::invalid(
                "forward.max_attempts",
                "must be at least 1",
            ));
        }
        Ok(())
    }
}
