//! Configuration: serde types with a default for every field, then `validate()`.
//!
//! The flow is parse → defaults → CLI overrides → validate → build. Every struct denies
//! unknown fields, so a typo in `config.toml` stops the router at start with a message that
//! names the field instead of being silently ignored. The shipped `config.toml` documents
//! each field; keep the two in step.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use serde::Deserialize;

pub use crate::discovery::{
    BackendDefaults, DiscoveryConfig, DiscoverySource, DnsDiscoveryConfig, FileDiscoveryConfig,
    KubernetesDiscoveryConfig, PortRef,
};
use crate::endpoints::engine::EngineMetricNames;
pub use crate::endpoints::{BackendConfig, OutlierConfig, PollerConfig};

pub use crate::config_error::ConfigError;

/// How logs are written.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// The whole file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Address of the OpenAI-compatible front door.
    pub listen: SocketAddr,
    /// Optional separate listener for `/metrics`, `/health`, `/ready` and `/admin/*`.
    pub admin_listen: Option<SocketAddr>,
    pub log_format: LogFormat,
    /// A tracing filter such as `info` or `inferlb=debug`.
    pub log_level: String,
    /// Largest request body accepted, in bytes (413 above it).
    pub max_body_bytes: usize,
    /// Response header naming the backend that served the request.
    pub backend_header: String,
    /// Request header naming the client's session (read by `session-affinity-scorer`).
    pub session_header: String,
    /// Key sessions by the OpenAI `user` field when a request has one (else the header).
    pub session_from_user: bool,
    /// A per-backend gauge not refreshed for this long leaves `/metrics` (the series of a
    /// backend that left the pool); at least three poll intervals are used.
    pub metrics_idle_timeout_ms: u64,
    pub server: ServerConfig,
    pub poller: PollerConfig,
    pub forward: ForwardConfig,
    pub limits: LimitsConfig,
    pub outlier_detection: OutlierConfig,
    pub auth: AuthConfig,
    /// Priority classes of queued requests and who may use them.
    pub priority: PriorityConfig,
    /// Extra engines (metric name sets) beside the built-in `vllm` and `sglang`.
    pub engines: BTreeMap<String, EngineMetricNames>,
    pub backends: Vec<BackendConfig>,
    /// Where the backend set comes from (default: the static `[[backends]]`).
    pub discovery: DiscoveryConfig,
    pub plugins: Vec<PluginSpec>,
    pub scheduling_profiles: Vec<ProfileSpec>,
    /// Which profile schedules requests; the first one when unset.
    pub profile: Option<String>,
    /// The status page, recent decisions and the explain header.
    pub admin: AdminConfig,
    /// Hugging Face tokenizers: the token ids vLLM will compute, per model.
    pub tokenization: TokenizationConfig,
    /// `[kv_events]`: subscribing to the backends' KV-cache event streams (precise prefix routing).
    pub kv_events: crate::kv_events::KvEventsConfig,
}

/// `[tokenization]`: which models get in-process tokenization (chat template + tokenizer).
///
/// Per model name, not per backend: a model name stands for one tokenizer (backends that
/// serve the same name with different tokenizers would not share a prefix cache anyway).
/// Loaded once at start-up; a reload does not reload tokenizers.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TokenizationConfig {
    /// Model directory (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`)
    /// for every model without its own entry in `models` (`--tokenizer DIR`).
    pub dir: Option<std::path::PathBuf>,
    /// Served model name → model directory.
    pub models: BTreeMap<String, std::path::PathBuf>,
    /// Token ids kept by each tokenizer's prefix cache (0 = no cache).
    pub prefix_cache_tokens: u64,
    /// Requests whose body is larger are routed without token ids (counted as `too_long`):
    /// it bounds the work and memory one request's tokenization can take (one pre-token of
    /// millions of characters costs `tokenizers` hundreds of bytes per token).
    pub max_body_bytes: usize,
}

impl Default for TokenizationConfig {
    fn default() -> Self {
        TokenizationConfig {
            dir: None,
            models: BTreeMap::new(),
            prefix_cache_tokens: 4_000_000,
            max_body_bytes: 2 * 1024 * 1024,
        }
    }
}

/// `[admin]`: what `/admin`, `/admin/decisions` and `x-inferlb-explain` keep and show.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Recent scheduling decisions kept (a ring; 0 = none). Recorded only while someone reads
    /// them (for 10 minutes after each read of `/admin/decisions`), unless `decisions_always`.
    pub decisions: usize,
    pub decisions_always: bool,
    /// Honour `x-inferlb-explain: 1` from every client (admin-token holders always may).
    pub explain: bool,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            decisions: 64,
            decisions_always: false,
            explain: false,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8000)),
            admin_listen: None,
            log_format: LogFormat::Text,
            log_level: "info".into(),
            max_body_bytes: 32 * 1024 * 1024,
            backend_header: "x-inferlb-backend".into(),
            session_header: "x-session-id".into(),
            session_from_user: false,
            metrics_idle_timeout_ms: 60_000,
            server: ServerConfig::default(),
            poller: PollerConfig::default(),
            forward: ForwardConfig::default(),
            limits: LimitsConfig::default(),
            outlier_detection: OutlierConfig::default(),
            auth: AuthConfig::default(),
            priority: PriorityConfig::default(),
            engines: BTreeMap::new(),
            backends: Vec::new(),
            discovery: DiscoveryConfig::default(),
            plugins: Vec::new(),
            scheduling_profiles: Vec::new(),
            profile: None,
            admin: AdminConfig::default(),
            tokenization: TokenizationConfig::default(),
            kv_events: crate::kv_events::KvEventsConfig::default(),
        }
    }
}

/// The front door's connection handling.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// A client must send its request headers within this time.
    pub header_read_timeout_ms: u64,
    /// A client must send its whole request body within this time (408 otherwise).
    pub body_read_timeout_ms: u64,
    /// On SIGTERM/SIGINT, in-flight requests get this long to finish.
    pub shutdown_timeout_ms: u64,
    /// Deepest JSON nesting accepted in a request body (400 above it).
    pub max_json_depth: usize,
    /// Largest request line plus headers, in bytes (431 above it); at least 8192.
    pub max_header_bytes: usize,
    /// Request worker threads: `"auto"` (one per core), a number, or `"shared"` (one
    /// work-stealing runtime); see [`crate::workers`]. Read at start-up only.
    pub workers: crate::workers::Workers,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 30_000,
            shutdown_timeout_ms: 30_000,
            max_json_depth: 64,
            max_header_bytes: 65_536,
            workers: crate::workers::Workers::Auto,
        }
    }
}

/// Concurrency limits and the router-side queue.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Requests in flight through the router at once (0 = no limit).
    pub max_inflight: usize,
    /// Requests in flight to one backend at once (0 = no limit).
    pub max_inflight_per_backend: u64,
    /// Requests allowed to wait for capacity; more get 429 at once.
    pub max_queued: usize,
    /// How long a request may wait for capacity before 429.
    pub queue_timeout_ms: u64,
    /// Client connections open at once on each listener (0 = no limit); more are closed on
    /// arrival.
    pub max_connections: usize,
    /// Most messages in one chat request (400 above it); at most 100000.
    pub max_messages: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_inflight: 0,
            max_inflight_per_backend: 0,
            max_queued: 1024,
            queue_timeout_ms: 10_000,
            max_connections: 10_000,
            max_messages: 10_000,
        }
    }
}

/// Client authentication and per-key rate limits.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Accepted bearer tokens. Authentication is on when any key is configured.
    pub api_keys: Vec<String>,
    /// A file with one key per line (`#` comments allowed).
    pub api_keys_file: Option<std::path::PathBuf>,
    /// Name of an environment variable holding comma-separated keys.
    pub api_keys_env: Option<String>,
    /// Bearer token required on `/metrics` and `/admin/*` (unset = open).
    pub admin_token: Option<String>,
    /// Sustained requests per second per key (0 = unlimited).
    pub requests_per_second: f64,
    /// Burst size per key (0 = same as `requests_per_second`, at least 1).
    pub burst: f64,
    /// Requests in flight per key (0 = unlimited).
    pub max_concurrent_per_key: usize,
}

/// The most priority classes a config may define (each is a metric label value).
pub const MAX_PRIORITY_CLASSES: usize = 8;

/// `[priority]`: classes of requests waiting for a backend slot, highest first. A request asks
/// for a class with the `header`; it gets at most its `max_class` (per API key, else the
/// global one) and `default_class` when it asks for none or for an unknown name.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PriorityConfig {
    pub header: String,
    /// Class names, highest priority first (1..=8, `[a-z0-9_-]`, at most 32 bytes each).
    pub classes: Vec<String>,
    pub default_class: String,
    /// The highest class a request may ask for.
    pub max_class: String,
    /// Per-class queue timeouts (ms) replacing `limits.queue_timeout_ms`.
    pub queue_timeout_ms: BTreeMap<String, u64>,
    /// Per-API-key default and ceiling.
    pub keys: Vec<KeyPriority>,
}

impl Default for PriorityConfig {
    fn default() -> Self {
        PriorityConfig {
            header: "x-inferlb-priority".into(),
            classes: vec!["interactive".into(), "standard".into(), "batch".into()],
            default_class: "standard".into(),
            max_class: "standard".into(),
            queue_timeout_ms: BTreeMap::new(),
            keys: Vec::new(),
        }
    }
}

/// `[[priority.keys]]`: the class rules of one API key (one of `auth.api_keys` or the files).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KeyPriority {
    pub key: String,
    /// Defaults to `priority.default_class`.
    #[serde(default)]
    pub default_class: Option<String>,
    /// Defaults to `priority.max_class`.
    #[serde(default)]
    pub max_class: Option<String>,
}

impl PriorityConfig {
    /// The index (0 = highest) of class `name`.
    pub fn index(&self, name: &str) -> Option<u8> {
        self.classes
            .iter()
            .position(|c| c == name)
            .and_then(|i| u8::try_from(i).ok())
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let n = self.classes.len();
        if n == 0 || n > MAX_PRIORITY_CLASSES {
            return Err(ConfigError::invalid(
                "priority.classes",
                format!("needs 1..={MAX_PRIORITY_CLASSES} classes"),
            ));
        }
        for (i, c) in self.classes.iter().enumerate() {
            let ok = !c.is_empty()
                && c.len() <= 32
                && c.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-'
                });
            if !ok {
                return Err(ConfigError::invalid(
                    format!("priority.classes[{i}]"),
                    format!("`{c}`: class names are 1..=32 of [a-z0-9_-]"),
                ));
            }
            if self.classes[..i].contains(c) {
                return Err(ConfigError::invalid(
                    format!("priority.classes[{i}]"),
                    format!("`{c}` is listed twice"),
                ));
            }
        }
        let known = |field: String, name: &str| {
            if self.index(name).is_some() {
                Ok(())
            } else {
                Err(ConfigError::invalid(
                    field,
                    format!(
                        "unknown class `{name}` (classes: {})",
                        self.classes.join(", ")
                    ),
                ))
            }
        };
        known("priority.default_class".into(), &self.default_class)?;
        known("priority.max_class".into(), &self.max_class)?;
        for (name, ms) in &self.queue_timeout_ms {
            known(format!("priority.queue_timeout_ms.{name}"), name)?;
            if *ms == 0 {
                return Err(ConfigError::invalid(
                    format!("priority.queue_timeout_ms.{name}"),
                    "must be greater than 0",
                ));
            }
        }
        for (i, k) in self.keys.iter().enumerate() {
            if let Some(c) = &k.default_class {
                known(format!("priority.keys[{i}].default_class"), c)?;
            }
            if let Some(c) = &k.max_class {
                known(format!("priority.keys[{i}].max_class"), c)?;
            }
        }
        if http::HeaderName::from_bytes(self.header.as_bytes()).is_err() {
            return Err(ConfigError::invalid(
                "priority.header",
                format!("`{}` is not a valid header name", self.header),
            ));
        }
        Ok(())
    }
}

/// The hyper client that forwards requests.
#[derive(Debug, Clone, Deserialize)]
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
        }
    }
}

/// A plugin instance: `type` picks the factory, `name` is how profiles refer to it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginSpec {
    #[serde(rename = "type")]
    pub kind: String,
    /// Defaults to the type name.
    #[serde(default)]
    pub name: Option<String>,
    /// Handed to the plugin's own factory, which rejects unknown keys.
    #[serde(default)]
    pub parameters: toml::Table,
}

impl PluginSpec {
    pub fn instance_name(&self) -> &str {
        self.name.as_deref().unwrap_or(&self.kind)
    }
}

/// A scheduling profile: the plugins it uses, scorers with weights.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileSpec {
    pub name: String,
    pub plugins: Vec<ProfilePluginRef>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfilePluginRef {
    pub plugin_ref: String,
    /// Only meaningful for scorers; defaults to 1.
    #[serde(default)]
    pub weight: Option<f64>,
}

impl Config {
    /// Read and parse a TOML file (no validation yet: CLI overrides come first).
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Config::from_toml(&text, &path.display().to_string())
    }

    pub fn from_toml(text: &str, origin: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: origin.to_owned(),
            message: e.to_string(),
        })
    }

    /// Checks that need the whole picture; plugin parameters are checked by their factories.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.admin.decisions > 10_000 {
            return Err(ConfigError::invalid("admin.decisions", "at most 10000"));
        }
        self.discovery.validate()?;
        if self.discovery.source == DiscoverySource::Static && self.backends.is_empty() {
            return Err(ConfigError::invalid(
                "backends",
                "no backends configured: add [[backends]] url = \"http://host:port\" or pass --backend",
            ));
        }
        for (i, b) in self.backends.iter().enumerate() {
            b.validate(i)?;
            crate::kv_events::Source::from_backend(b, &self.kv_events)
                .map_err(|m| ConfigError::invalid(format!("backends[{i}].kv_events"), m))?;
            if self.engine(&b.engine).is_none() {
                return Err(ConfigError::invalid(
                    format!("backends[{i}].engine"),
                    format!(
                        "unknown engine `{}` (built in: vllm, sglang; or define [engines.{}])",
                        b.engine, b.engine
                    ),
                ));
            }
        }
        self.kv_events.validate()?;
        if self.max_body_bytes == 0 {
            return Err(ConfigError::invalid(
                "max_body_bytes",
                "must be greater than 0",
            ));
        }
        self.outlier_detection.validate()?;
        self.poller.validate()?;
        if !(1_000..=60_000).contains(&self.forward.retry_budget_window_ms) {
            return Err(ConfigError::invalid(
                "forward.retry_budget_window_ms",
                "must be within 1000..60000",
            ));
        }
        if self.forward.retry_budget_min_per_sec > 1_000_000 {
            return Err(ConfigError::invalid(
                "forward.retry_budget_min_per_sec",
                "must be at most 1000000",
            ));
        }
        if !(0.0..=1.0).contains(&self.forward.retry_budget_ratio) {
            return Err(ConfigError::invalid(
                "forward.retry_budget_ratio",
                "must be within 0..1",
            ));
        }
        if !(self.auth.requests_per_second >= 0.0 && self.auth.requests_per_second.is_finite()) {
            return Err(ConfigError::invalid(
                "auth.requests_per_second",
                "must be a number ≥ 0",
            ));
        }
        let rps = self.auth.requests_per_second;
        if rps > 0.0 && rps < crate::front_door::auth::MIN_REQUESTS_PER_SECOND {
            return Err(ConfigError::invalid(
                "auth.requests_per_second",
                "must be 0 (no limit) or at least one request per day (1/86400)",
            ));
        }
        if !(self.auth.burst >= 0.0 && self.auth.burst <= crate::front_door::auth::MAX_BURST) {
            return Err(ConfigError::invalid(
                "auth.burst",
                "must be a number within 0..=100000",
            ));
        }
        for (field, v) in [
            (
                "server.header_read_timeout_ms",
                self.server.header_read_timeout_ms,
            ),
            (
                "server.body_read_timeout_ms",
                self.server.body_read_timeout_ms,
            ),
            (
                "forward.connect_timeout_ms",
                self.forward.connect_timeout_ms,
            ),
            (
                "forward.response_timeout_ms",
                self.forward.response_timeout_ms,
            ),
            (
                "forward.stream_idle_timeout_ms",
                self.forward.stream_idle_timeout_ms,
            ),
        ] {
            if v == 0 {
                return Err(ConfigError::invalid(field, "must be greater than 0"));
            }
        }
        if self.server.max_header_bytes < crate::front_door::serve::MIN_HEADER_BYTES {
            return Err(ConfigError::invalid(
                "server.max_header_bytes",
                format!(
                    "must be at least {}",
                    crate::front_door::serve::MIN_HEADER_BYTES
                ),
            ));
        }
        if !(1..=crate::prompt::MAX_MESSAGES_CEILING).contains(&self.limits.max_messages) {
            return Err(ConfigError::invalid(
                "limits.max_messages",
                format!("must be within 1..={}", crate::prompt::MAX_MESSAGES_CEILING),
            ));
        }
        if self.server.max_json_depth == 0 {
            return Err(ConfigError::invalid(
                "server.max_json_depth",
                "must be at least 1",
            ));
        }
        if self.forward.max_attempts == 0 {
            return Err(ConfigError::invalid(
                "forward.max_attempts",
                "must be at least 1",
            ));
        }
        for (field, value) in [
            ("backend_header", &self.backend_header),
            ("session_header", &self.session_header),
        ] {
            http::HeaderName::from_bytes(value.as_bytes()).map_err(|_| {
                ConfigError::invalid(field, format!("`{value}` is not a valid header name"))
            })?;
        }
        self.priority.validate()?;
        Ok(())
    }

    /// The metric names of an engine, built-in or configured.
    pub fn engine(&self, name: &str) -> Option<EngineMetricNames> {
        self.engines
            .get(name)
            .cloned()
            .or_else(|| EngineMetricNames::builtin(name))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn empty_file_gives_defaults() {
        let c = Config::from_toml("", "t").unwrap();
        assert_eq!(c.poller.interval_ms, 50);
        assert_eq!(c.listen.port(), 8000);
        assert!(c.validate().is_err(), "no backends must be rejected");
    }

    #[test]
    fn unknown_field_is_named() {
        let err =
            Config::from_toml("listen = \"127.0.0.1:1\"\nlisten_port = 3\n", "t").unwrap_err();
        assert!(err.to_string().contains("listen_port"), "{err}");
        let err = Config::from_toml("[poller]\ninterval = 3\n", "t").unwrap_err();
        assert!(err.to_string().contains("interval"), "{err}");
        let err =
            Config::from_toml("[[backends]]\nurl = \"http://a:1\"\nweight = 2\n", "t").unwrap_err();
        assert!(err.to_string().contains("weight"), "{err}");
    }

    #[test]
    fn unknown_engine_is_named() {
        let c = Config::from_toml(
            "[[backends]]\nurl = \"http://h:1\"\nengine = \"tgi\"\n",
            "t",
        )
        .unwrap();
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("backends[0].engine"));
    }

    #[test]
    fn custom_engine_is_accepted() {
        let c = Config::from_toml(
            "[engines.tgi]\nwaiting = [\"tgi_queue_size\"]\n[[backends]]\nurl = \"http://h:1\"\nengine = \"tgi\"\n",
            "t",
        )
        .unwrap();
        c.validate().unwrap();
        assert_eq!(
            c.engine("tgi").unwrap().waiting,
            vec!["tgi_queue_size".to_owned()]
        );
    }

    #[test]
    fn priority_classes_are_checked_and_named() {
        let base = "[[backends]]\nurl = \"http://h:1\"\n";
        let c = Config::from_toml(base, "t").unwrap();
        c.validate().unwrap();
        assert_eq!(c.priority.index("interactive"), Some(0));
        assert_eq!(c.priority.index("batch"), Some(2));
        for (extra, field) in [
            ("[priority]\nclasses = []\n", "priority.classes"),
            (
                "[priority]\nclasses = [\"a\", \"a\"]\ndefault_class = \"a\"\nmax_class = \"a\"\n",
                "priority.classes[1]",
            ),
            (
                "[priority]\nclasses = [\"Has Space\"]\n",
                "priority.classes[0]",
            ),
            (
                "[priority]\ndefault_class = \"gold\"\n",
                "priority.default_class",
            ),
            ("[priority]\nmax_class = \"gold\"\n", "priority.max_class"),
            (
                "[priority.queue_timeout_ms]\ngold = 5\n",
                "priority.queue_timeout_ms.gold",
            ),
            (
                "[priority.queue_timeout_ms]\nbatch = 0\n",
                "priority.queue_timeout_ms.batch",
            ),
            (
                "[[priority.keys]]\nkey = \"k\"\nmax_class = \"gold\"\n",
                "priority.keys[0].max_class",
            ),
            ("[priority]\nheader = \"bad header\"\n", "priority.header"),
            ("session_header = \"bad header\"\n", "session_header"),
        ] {
            let text = if extra.starts_with('[') {
                format!("{base}{extra}")
            } else {
                format!("{extra}{base}")
            };
            let err = Config::from_toml(&text, "t")
                .unwrap()
                .validate()
                .unwrap_err()
                .to_string();
            assert!(err.contains(field), "{extra}: {err}");
        }
        let err = Config::from_toml("[priority]\nlevels = 3\n", "t").unwrap_err();
        assert!(err.to_string().contains("levels"), "{err}");
    }

    #[test]
    fn bad_header_name_is_rejected() {
        let c = Config::from_toml(
            "backend_header = \"bad header\"\n[[backends]]\nurl = \"http://h:1\"\n",
            "t",
        )
        .unwrap();
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("backend_header"));
    }
}

#[cfg(test)]
mod shipped {
    #![allow(clippy::unwrap_used)]

    #[test]
    fn shipped_config_toml_is_valid_and_matches_defaults() {
        let text = include_str!("../config.toml");
        let c = super::Config::from_toml(text, "config.toml").unwrap();
        c.validate().unwrap();
        crate::scheduling::profile::build_active(&c).unwrap();
        let d = super::Config::default();
        assert_eq!(c.listen, d.listen);
        assert_eq!(c.max_body_bytes, d.max_body_bytes);
        assert_eq!(c.poller.interval_ms, d.poller.interval_ms);
        assert_eq!(c.poller.timeout_ms, d.poller.timeout_ms);
        assert_eq!(c.poller.stale_after_ms, d.poller.stale_after_ms);
        assert_eq!(c.poller.models_interval_ms, d.poller.models_interval_ms);
        assert_eq!(c.poller.unhealthy_after, d.poller.unhealthy_after);
        assert_eq!(c.poller.healthy_after, d.poller.healthy_after);
        assert_eq!(c.poller.filter_metrics, d.poller.filter_metrics);
        assert_eq!(c.forward.connect_timeout_ms, d.forward.connect_timeout_ms);
        assert_eq!(c.forward.response_timeout_ms, d.forward.response_timeout_ms);
        assert_eq!(c.forward.max_attempts, d.forward.max_attempts);
        assert_eq!(
            c.forward.pool_max_idle_per_backend,
            d.forward.pool_max_idle_per_backend
        );
        assert_eq!(
            c.forward.pool_idle_timeout_ms,
            d.forward.pool_idle_timeout_ms
        );
        assert_eq!(
            c.forward.forward_client_authorization,
            d.forward.forward_client_authorization
        );
        assert_eq!(c.backend_header, d.backend_header);
        assert_eq!(c.session_header, d.session_header);
        assert_eq!(c.session_from_user, d.session_from_user);
        assert_eq!(c.priority, d.priority);
        assert_eq!(
            c.server.header_read_timeout_ms,
            d.server.header_read_timeout_ms
        );
        assert_eq!(c.server.body_read_timeout_ms, d.server.body_read_timeout_ms);
        assert_eq!(c.server.shutdown_timeout_ms, d.server.shutdown_timeout_ms);
        assert_eq!(c.server.max_json_depth, d.server.max_json_depth);
        assert_eq!(c.server.max_header_bytes, d.server.max_header_bytes);
        assert_eq!(c.limits.max_connections, d.limits.max_connections);
        assert_eq!(c.limits.max_messages, d.limits.max_messages);
        assert_eq!(
            c.forward.stream_idle_timeout_ms,
            d.forward.stream_idle_timeout_ms
        );
        assert_eq!(c.forward.request_timeout_ms, d.forward.request_timeout_ms);
        assert_eq!(c.forward.retry_on_status, d.forward.retry_on_status);
        assert_eq!(c.forward.retry_budget_ratio, d.forward.retry_budget_ratio);
        assert_eq!(
            c.forward.retry_budget_min_per_sec,
            d.forward.retry_budget_min_per_sec
        );
        assert_eq!(
            c.forward.retry_budget_window_ms,
            d.forward.retry_budget_window_ms
        );
        assert_eq!(c.forward.backoff_base_ms, d.forward.backoff_base_ms);
        assert_eq!(c.forward.backoff_max_ms, d.forward.backoff_max_ms);
        assert_eq!(c.forward.ca_file, d.forward.ca_file);
        assert_eq!(c.limits.max_inflight, d.limits.max_inflight);
        assert_eq!(
            c.limits.max_inflight_per_backend,
            d.limits.max_inflight_per_backend
        );
        assert_eq!(c.limits.max_queued, d.limits.max_queued);
        assert_eq!(c.limits.queue_timeout_ms, d.limits.queue_timeout_ms);
        assert_eq!(
            c.outlier_detection.consecutive_failures,
            d.outlier_detection.consecutive_failures
        );
        assert_eq!(
            c.outlier_detection.base_ejection_ms,
            d.outlier_detection.base_ejection_ms
        );
        assert_eq!(
            c.outlier_detection.max_ejection_ms,
            d.outlier_detection.max_ejection_ms
        );
        assert_eq!(c.auth.api_keys, d.auth.api_keys);
        assert_eq!(c.auth.requests_per_second, d.auth.requests_per_second);
        assert_eq!(c.auth.burst, d.auth.burst);
        assert_eq!(c.auth.max_concurrent_per_key, d.auth.max_concurrent_per_key);
    }
}
