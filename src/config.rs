//! Configuration: the whole file, composed of the sections each module owns.
//!
//! Every section is defined beside the code that uses it, with its defaults and its own
//! `validate()` (the table below); this module only composes them into [`Config`], loads the
//! file ([`Config::from_file`]; `main.rs` applies the command-line overrides), and in
//! [`Config::validate`] runs each section's checks and then the checks that span sections.
//! The arrows run one way: this module imports the sections, no section imports it, and all
//! report a [`ConfigError`] naming the field's full path (from the leaf
//! [`crate::config_error`]).
//!
//! | key | type | owner |
//! | --- | --- | --- |
//! | `log_format` | [`LogFormat`] | [`crate::telemetry`] |
//! | `[server]` | [`ServerConfig`] | [`crate::front_door::serve`] |
//! | `[auth]` | [`AuthConfig`] | [`crate::front_door::auth`] |
//! | `[admin]` | [`AdminConfig`] | [`crate::front_door::status`] |
//! | `[limits]` | [`LimitsConfig`] | [`crate::scheduling::admission`] |
//! | `[priority]` | [`PriorityConfig`] | [`crate::scheduling::priority`] |
//! | `[[plugins]]`, `[[scheduling_profiles]]` | [`PluginSpec`], [`ProfileSpec`] | [`crate::scheduling::config`] |
//! | `[forward]` | [`ForwardConfig`] | [`crate::forward::config`] |
//! | `[[backends]]`, `[poller]`, `[outlier_detection]` | [`BackendConfig`], [`PollerConfig`], [`OutlierConfig`] | [`crate::endpoints::config`] |
//! | `[engines.NAME]` | [`EngineMetricNames`] | [`crate::endpoints::engine`] |
//! | `[discovery]` | [`DiscoveryConfig`] | [`crate::discovery::config`] |
//! | `[kv_events]` | [`KvEventsConfig`] | [`crate::kv_events`] |
//! | `[tokenization]` | [`TokenizationConfig`] | [`crate::tokenization`] |
//! | `[pd]` | [`PdConfig`] | [`crate::pd`] |
//! | `[responses]` | [`ResponsesConfig`] | [`crate::responses`] |
//!
//! The flow is parse → defaults → CLI overrides → validate → build. Every struct denies
//! unknown fields, so a typo in `config.toml` stops the router at start with a message that
//! names the field instead of being silently ignored. The shipped `config.toml` documents
//! each field; keep the two in step (a test loads it, and every `bench/policies/` file).
//! The section types are re-exported here for callers that build a whole `Config`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use serde::Deserialize;

pub use crate::discovery::{
    BackendDefaults, DiscoveryConfig, DiscoverySource, DnsDiscoveryConfig, FileDiscoveryConfig,
    KubernetesDiscoveryConfig, PortRef,
};
pub use crate::endpoints::capacity::MAX_PRIORITY_CLASSES;
use crate::endpoints::engine::EngineMetricNames;
pub use crate::endpoints::{BackendConfig, OutlierConfig, PollerConfig};
pub use crate::forward::ForwardConfig;
pub use crate::front_door::{auth::AuthConfig, serve::ServerConfig, status::AdminConfig};
pub use crate::kv_events::KvEventsConfig;
pub use crate::pd::PdConfig;
pub use crate::responses::ResponsesConfig;
pub use crate::scheduling::admission::LimitsConfig;
pub use crate::scheduling::config::{PluginSpec, ProfilePluginRef, ProfileSpec};
pub use crate::scheduling::priority::{KeyPriority, PriorityConfig};
pub use crate::telemetry::LogFormat;
pub use crate::tokenization::TokenizationConfig;

pub use crate::config_error::ConfigError;

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
    pub kv_events: KvEventsConfig,
    /// `[pd]`: prefill/decode disaggregation (off by default).
    pub pd: PdConfig,
    /// `[responses]`: the Responses API's calls follow the response to its backend.
    pub responses: ResponsesConfig,
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
            kv_events: KvEventsConfig::default(),
            pd: PdConfig::default(),
            responses: ResponsesConfig::default(),
        }
    }
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
        self.admin.validate()?;
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
        self.forward.validate()?;
        self.auth.validate()?;
        self.server.validate()?;
        self.limits.validate()?;
        for (field, value) in [
            ("backend_header", &self.backend_header),
            ("session_header", &self.session_header),
        ] {
            http::HeaderName::from_bytes(value.as_bytes()).map_err(|_| {
                ConfigError::invalid(field, format!("`{value}` is not a valid header name"))
            })?;
        }
        self.priority.validate()?;
        self.pd.validate()?;
        self.responses.validate()?;
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

impl Config {
    /// What building the scheduling profiles reads.
    pub fn scheduling(&self) -> crate::scheduling::config::ProfileInputs<'_> {
        crate::scheduling::config::ProfileInputs {
            plugins: &self.plugins,
            scheduling_profiles: &self.scheduling_profiles,
            profile: self.profile.as_deref(),
            prefill_profile: self.pd.prefill_profile.as_deref(),
            decisions: self.admin.decisions,
            decisions_always: self.admin.decisions_always,
            max_inflight_per_backend: self.limits.max_inflight_per_backend,
        }
    }

    /// Each static backend's engine and its metric names (`None`: an engine nobody defines).
    pub fn backend_engines(&self) -> Vec<(&str, Option<EngineMetricNames>)> {
        self.backends
            .iter()
            .map(|b| (b.engine.as_str(), self.engine(&b.engine)))
            .collect()
    }

    /// What the front door reads per request (its sections and the request-shaping keys).
    pub fn front_door(&self) -> crate::front_door::Settings {
        crate::front_door::Settings {
            server: self.server.clone(),
            admin: self.admin.clone(),
            max_body_bytes: self.max_body_bytes,
            max_messages: self.limits.max_messages,
            // Both names were checked by `validate`.
            session_header: http::HeaderName::from_bytes(self.session_header.as_bytes()).ok(),
            session_from_user: self.session_from_user,
            priority: self.priority.clone(),
            priority_header: http::HeaderName::from_bytes(self.priority.header.as_bytes()).ok(),
            allow_client_kv_transfer_params: self.forward.allow_client_kv_transfer_params,
        }
    }
}

impl crate::endpoints::Pool {
    /// The pool of a whole configuration (composition, so it is built here): the poller's
    /// staleness, `[engines]`, `forward.ca_file`, and the static `[[backends]]` unless another
    /// discovery source will fill it.
    pub fn from_config(config: &Config) -> Result<Self, ConfigError> {
        let pool = Self::new(
            config.poller.stale_after(),
            config.engines.clone(),
            config.forward.ca_file.clone(),
        );
        if config.discovery.source == DiscoverySource::Static {
            pool.add_static(&config.backends)?;
        }
        Ok(pool)
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
