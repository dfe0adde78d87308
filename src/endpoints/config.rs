//! The endpoints' sections: `[[backends]]` (one backend server), `[poller]` (the metrics and
//! model poller) and `[outlier_detection]` (passive health), each with its defaults and its
//! checks. Errors name the field's full path (`backends[2].url`, `poller.interval_ms`).

use std::time::Duration;

use serde::Deserialize;

use crate::config_error::ConfigError;

/// The engine a backend runs when it names none.
pub const DEFAULT_ENGINE: &str = "vllm";

pub(crate) fn default_engine() -> String {
    DEFAULT_ENGINE.into()
}

/// What a backend does when prefill and decode are disaggregated (`role` in `[[backends]]`,
/// `discovery.backend_defaults` and file entries; the `llm-d.ai/role` Pod label).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum BackendRole {
    /// Only the prefill leg of a disaggregated request: never an ordinary request.
    Prefill,
    /// Decode legs, and ordinary requests.
    Decode,
    /// Anything (the default).
    #[default]
    Both,
}

impl BackendRole {
    /// The accepted spellings, for error messages.
    pub const VALUES: &'static str = "`prefill`, `decode` or `both`";

    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "prefill" => Some(BackendRole::Prefill),
            "decode" => Some(BackendRole::Decode),
            "both" => Some(BackendRole::Both),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            BackendRole::Prefill => "prefill",
            BackendRole::Decode => "decode",
            BackendRole::Both => "both",
        }
    }

    /// May it serve a whole request (prompt and generation)?
    pub fn serves_whole_requests(self) -> bool {
        self != BackendRole::Prefill
    }
}

/// A `role` setting as written (`None`: unset, i.e. `both`), checked by [`check_role`] so the
/// error names the field rather than a TOML line.
pub(crate) fn check_role(role: Option<&str>, field: impl Into<String>) -> Result<(), ConfigError> {
    match role {
        Some(r) if BackendRole::parse(r).is_none() => Err(ConfigError::invalid(
            field,
            format!("unknown role `{r}`: must be {}", BackendRole::VALUES),
        )),
        _ => Ok(()),
    }
}

/// One backend server.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    /// Base URL, e.g. `http://10.0.0.5:8000` (no path).
    pub url: String,
    /// Metric name set to read: `vllm` (default), `sglang`, or one from `[engines]`.
    #[serde(default = "default_engine")]
    pub engine: String,
    /// Sent as `Authorization: Bearer …` to this backend, replacing the client's header.
    #[serde(default)]
    pub api_key: Option<String>,
    /// Served models; when set, `/v1/models` discovery is skipped for this backend.
    #[serde(default)]
    pub models: Option<Vec<String>>,
    /// PEM file of the CAs trusted for this `https://` backend (replaces `forward.ca_file`).
    #[serde(default)]
    pub ca_file: Option<std::path::PathBuf>,
    /// Its KV-cache event stream: `"tcp://HOST:PORT"` (connect), `"bind:tcp://HOST:PORT"` (the
    /// engine connects to us), `"auto"` (read its `GET /kv_event_sources`) or `"off"`; unset:
    /// `kv_events.default`.
    #[serde(default)]
    pub kv_events: Option<String>,
    /// Its replay endpoint (`"tcp://HOST:PORT"`), asked to resend lost events; unset: found by
    /// `"auto"` or `kv_events.replay`.
    #[serde(default)]
    pub kv_events_replay: Option<String>,
    /// `prefill`, `decode` or `both` (unset: `both`); see [`BackendRole`].
    #[serde(default)]
    pub role: Option<String>,
}

impl BackendConfig {
    pub fn from_url(url: impl Into<String>) -> Self {
        BackendConfig {
            url: url.into(),
            engine: default_engine(),
            api_key: None,
            models: None,
            ca_file: None,
            kv_events: None,
            kv_events_replay: None,
            role: None,
        }
    }

    /// Its [`BackendRole`] (`both` when unset; an unknown value is refused by `validate`).
    pub fn role(&self) -> BackendRole {
        self.role
            .as_deref()
            .and_then(BackendRole::parse)
            .unwrap_or_default()
    }

    /// The checks of its own fields, as `backends[index]` (its engine and KV-event stream
    /// are checked against `[engines]` and `[kv_events]` by the composition).
    pub fn validate(&self, index: usize) -> Result<(), ConfigError> {
        let (scheme, _) = super::parse_base_url(&self.url)
            .map_err(|m| ConfigError::invalid(format!("backends[{index}].url"), m))?;
        if self.ca_file.is_some() && scheme != http::uri::Scheme::HTTPS {
            return Err(ConfigError::invalid(
                format!("backends[{index}].ca_file"),
                "set on a backend whose URL is not https://",
            ));
        }
        check_role(self.role.as_deref(), format!("backends[{index}].role"))?;
        Ok(())
    }
}

/// `[poller]`: the metrics and model poller.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PollerConfig {
    /// How often every backend's `/metrics` is scraped.
    pub interval_ms: u64,
    /// Per-scrape timeout; a slow backend never delays the others.
    pub timeout_ms: u64,
    /// Metrics older than this are treated as unknown by scorers.
    pub stale_after_ms: u64,
    /// How often each backend's `/v1/models` is re-read.
    pub models_interval_ms: u64,
    /// Consecutive failed scrapes that mark a backend unhealthy.
    pub unhealthy_after: u32,
    /// Consecutive successful scrapes that re-admit an unhealthy backend.
    pub healthy_after: u32,
    /// Ask backends for only the series inferlb reads (`/metrics?name[]=…`).
    pub filter_metrics: bool,
}

impl Default for PollerConfig {
    fn default() -> Self {
        PollerConfig {
            interval_ms: 50,
            timeout_ms: 500,
            stale_after_ms: 1_000,
            models_interval_ms: 10_000,
            unhealthy_after: 3,
            healthy_after: 2,
            filter_metrics: true,
        }
    }
}

impl PollerConfig {
    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms)
    }
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }
    pub fn stale_after(&self) -> Duration {
        Duration::from_millis(self.stale_after_ms)
    }
    pub fn models_interval(&self) -> Duration {
        Duration::from_millis(self.models_interval_ms)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, v) in [
            ("poller.interval_ms", self.interval_ms),
            ("poller.timeout_ms", self.timeout_ms),
            ("poller.stale_after_ms", self.stale_after_ms),
            ("poller.models_interval_ms", self.models_interval_ms),
        ] {
            if v == 0 {
                return Err(ConfigError::invalid(field, "must be greater than 0"));
            }
        }
        if self.unhealthy_after == 0 || self.healthy_after == 0 {
            return Err(ConfigError::invalid(
                "poller",
                "unhealthy_after and healthy_after must be at least 1",
            ));
        }
        Ok(())
    }
}

/// `[outlier_detection]`: passive health, ejecting a backend that keeps failing requests.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutlierConfig {
    /// Consecutive connect failures or 5xx answers that eject a backend (0 = off).
    pub consecutive_failures: u32,
    /// First ejection length; each further ejection doubles it.
    pub base_ejection_ms: u64,
    pub max_ejection_ms: u64,
    /// Largest share of the fleet (percent) passively ejected at once; at least one backend
    /// may always be ejected, but never the last healthy backend of a model.
    pub max_ejection_percent: u32,
}

impl Default for OutlierConfig {
    fn default() -> Self {
        OutlierConfig {
            consecutive_failures: 5,
            base_ejection_ms: 5_000,
            max_ejection_ms: 300_000,
            max_ejection_percent: 50,
        }
    }
}

impl OutlierConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.max_ejection_percent > 100 {
            return Err(ConfigError::invalid(
                "outlier_detection.max_ejection_percent",
                "must be within 0..100",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn invalid_backend_url_is_named() {
        for url in [
            "not a url",
            "ftp://x:1",
            "http://",
            "http://h:1/path",
            "http://h:99999",
            "https://user:pw@h:1",
        ] {
            let err = BackendConfig::from_url(url).validate(0).unwrap_err();
            assert!(err.to_string().contains("backends[0].url"), "{url}: {err}");
        }
    }

    #[test]
    fn https_backends_are_accepted_and_ca_file_needs_https() {
        BackendConfig::from_url("https://vllm.example:8443")
            .validate(0)
            .unwrap();
        let b: BackendConfig =
            toml::from_str("url = \"http://h:1\"\nca_file = \"/etc/ca.pem\"\n").unwrap();
        let err = b.validate(3).unwrap_err().to_string();
        assert!(err.contains("backends[3].ca_file"), "{err}");
    }

    #[test]
    fn role_parses_defaults_to_both_and_a_bad_one_is_named() {
        let b: BackendConfig = toml::from_str("url = \"http://h:1\"\n").unwrap();
        assert_eq!(b.role(), BackendRole::Both);
        for (text, role) in [
            ("prefill", BackendRole::Prefill),
            ("decode", BackendRole::Decode),
            ("both", BackendRole::Both),
        ] {
            let b: BackendConfig =
                toml::from_str(&format!("url = \"http://h:1\"\nrole = \"{text}\"\n")).unwrap();
            b.validate(0).unwrap();
            assert_eq!(b.role(), role);
            assert_eq!(role.as_str(), text);
        }
        let b: BackendConfig =
            toml::from_str("url = \"http://h:1\"\nrole = \"prefill-decode\"\n").unwrap();
        let err = b.validate(2).unwrap_err().to_string();
        assert!(err.contains("backends[2].role"), "{err}");
        assert!(err.contains("prefill-decode"), "{err}");
    }

    #[test]
    fn poller_and_outlier_limits_are_named() {
        PollerConfig::default().validate().unwrap();
        OutlierConfig::default().validate().unwrap();
        let zero = PollerConfig {
            stale_after_ms: 0,
            ..PollerConfig::default()
        };
        let err = zero.validate().unwrap_err().to_string();
        assert!(err.contains("poller.stale_after_ms"), "{err}");
        let never = PollerConfig {
            healthy_after: 0,
            ..PollerConfig::default()
        };
        assert!(never.validate().is_err());
        let over = OutlierConfig {
            max_ejection_percent: 101,
            ..OutlierConfig::default()
        };
        let err = over.validate().unwrap_err().to_string();
        assert!(
            err.contains("outlier_detection.max_ejection_percent"),
            "{err}"
        );
    }
}
