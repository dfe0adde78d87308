//! `[discovery]`: which source fills the pool, each source's own table, and the settings every
//! discovered backend gets (`[discovery.backend_defaults]`). A source's settings are checked by
//! building it ([`DiscoveryConfig::validate`]); errors name the field's full path, such as
//! `discovery.kubernetes.namespace`, or `--discovery` for the command-line shorthand.

use serde::Deserialize;

use crate::config_error::ConfigError;
use crate::endpoints::config::{check_role, default_engine};
use crate::endpoints::BackendConfig;

/// Which discovery source fills the pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiscoverySource {
    /// `[[backends]]` / `--backend`.
    #[default]
    Static,
    File,
    Dns,
    Kubernetes,
}

/// `[discovery]`: one source, with its own table.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    pub source: DiscoverySource,
    pub file: FileDiscoveryConfig,
    pub dns: DnsDiscoveryConfig,
    pub kubernetes: KubernetesDiscoveryConfig,
    /// Engine, API key and fixed models given to every discovered backend (file entries may
    /// set their own).
    pub backend_defaults: BackendDefaults,
}

impl DiscoveryConfig {
    /// Builds the chosen source without starting it, which checks its settings (a `static`
    /// source has none: the composition checks that `[[backends]]` is not empty).
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_role(
            self.backend_defaults.role.as_deref(),
            "discovery.backend_defaults.role",
        )?;
        super::from_config(self).map(drop)
    }

    /// Apply a `--discovery` shorthand: `file:PATH`, `dns:NAME:PORT`,
    /// `k8s:NAMESPACE/LABEL_SELECTOR:PORT` (port by number or name) or `k8s-pool:NAMESPACE/NAME`.
    pub fn apply_shorthand(&mut self, spec: &str) -> Result<(), ConfigError> {
        let bad = |why: &str| {
            ConfigError::invalid(
                "--discovery",
                format!(
                    "`{spec}`: {why} (use file:PATH, dns:NAME:PORT, k8s:NAMESPACE/SELECTOR:PORT or k8s-pool:NAMESPACE/NAME)"
                ),
            )
        };
        let (kind, rest) = spec.split_once(':').ok_or_else(|| bad("no source"))?;
        match kind {
            "file" if !rest.is_empty() => {
                self.source = DiscoverySource::File;
                self.file.path = Some(rest.into());
            }
            "dns" => {
                let (name, port) = rest.rsplit_once(':').ok_or_else(|| bad("no port"))?;
                self.source = DiscoverySource::Dns;
                self.dns.name = Some(name.to_owned());
                self.dns.port = port.parse().map_err(|_| bad("invalid port"))?;
            }
            "k8s" => {
                let (namespace, rest) = rest.split_once('/').ok_or_else(|| bad("no namespace"))?;
                let (selector, port) = rest.rsplit_once(':').ok_or_else(|| bad("no port"))?;
                self.source = DiscoverySource::Kubernetes;
                self.kubernetes.namespace = namespace.to_owned();
                self.kubernetes.label_selector = Some(selector.to_owned());
                self.kubernetes.inference_pool = None;
                self.kubernetes.port = match port.parse() {
                    Ok(n) => PortRef::Number(n),
                    Err(_) if !port.is_empty() => PortRef::Name(port.to_owned()),
                    Err(_) => return Err(bad("no port")),
                };
            }
            "k8s-pool" => {
                let (namespace, name) = rest.split_once('/').ok_or_else(|| bad("no namespace"))?;
                self.source = DiscoverySource::Kubernetes;
                self.kubernetes.namespace = namespace.to_owned();
                self.kubernetes.inference_pool = Some(name.to_owned());
                self.kubernetes.label_selector = None;
            }
            _ => return Err(bad("unknown source")),
        }
        Ok(())
    }
}

/// Settings every discovered backend gets.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BackendDefaults {
    pub engine: String,
    pub api_key: Option<String>,
    pub models: Option<Vec<String>>,
    /// `http` or `https` for DNS and Kubernetes addresses.
    pub scheme: String,
    /// CA bundle for `https` backends (default: `forward.ca_file`, else built-in roots).
    pub ca_file: Option<std::path::PathBuf>,
    /// `prefill`, `decode` or `both` (unset: `both`) for backends whose source says nothing
    /// (file entries may set their own; Kubernetes reads `role_label`).
    pub role: Option<String>,
}

impl Default for BackendDefaults {
    fn default() -> Self {
        BackendDefaults {
            engine: default_engine(),
            api_key: None,
            models: None,
            scheme: "http".into(),
            ca_file: None,
            role: None,
        }
    }
}

impl BackendDefaults {
    /// A backend at `host:port` with these defaults.
    pub fn backend(&self, host: &str, port: u16) -> BackendConfig {
        let host = if host.contains(':') && !host.starts_with('[') {
            format!("[{host}]")
        } else {
            host.to_owned()
        };
        BackendConfig {
            url: format!("{}://{host}:{port}", self.scheme),
            engine: self.engine.clone(),
            api_key: self.api_key.clone(),
            models: self.models.clone(),
            ca_file: self.ca_file.clone(),
            kv_events: None,
            kv_events_replay: None,
            role: self.role.clone(),
        }
    }
}

/// `[discovery.file]`: a TOML (`[[backends]]` tables as in config.toml) or JSON (a list of the
/// same objects) file, chosen by extension, re-read when its modification time or size changes.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FileDiscoveryConfig {
    pub path: Option<std::path::PathBuf>,
    /// How often the file's metadata is checked.
    pub poll_interval_ms: u64,
}

impl Default for FileDiscoveryConfig {
    fn default() -> Self {
        FileDiscoveryConfig {
            path: None,
            poll_interval_ms: 1_000,
        }
    }
}

/// `[discovery.dns]`: every A/AAAA address of `name` becomes `scheme://ADDR:port`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DnsDiscoveryConfig {
    pub name: Option<String>,
    pub port: u16,
    pub interval_ms: u64,
}

impl Default for DnsDiscoveryConfig {
    fn default() -> Self {
        DnsDiscoveryConfig {
            name: None,
            port: 8000,
            interval_ms: 5_000,
        }
    }
}

/// A container port, by number or by name.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum PortRef {
    Number(u16),
    Name(String),
}

/// `[discovery.kubernetes]`: Pods selected by `label_selector` in `namespace`, or the Pods an
/// `InferencePool` (inference.networking.k8s.io/v1) selects when `inference_pool` is set.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KubernetesDiscoveryConfig {
    pub namespace: String,
    pub label_selector: Option<String>,
    pub port: PortRef,
    pub inference_pool: Option<String>,
    /// A kubeconfig file; default: in-cluster service account, then `KUBECONFIG`, then
    /// `~/.kube/config`.
    pub kubeconfig: Option<std::path::PathBuf>,
    /// The Pod label naming its prefill/decode role (`prefill`, `decode` or `both`; no label:
    /// `both`; any other value: the Pod is not used, with a warning).
    pub role_label: String,
}

impl Default for KubernetesDiscoveryConfig {
    fn default() -> Self {
        KubernetesDiscoveryConfig {
            namespace: "default".into(),
            label_selector: None,
            port: PortRef::Number(8000),
            inference_pool: None,
            kubeconfig: None,
            role_label: "llm-d.ai/role".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn discovery_shorthands() {
        let mut d = DiscoveryConfig::default();
        d.apply_shorthand("file:/etc/inferlb/backends.json")
            .unwrap();
        assert_eq!(d.source, DiscoverySource::File);
        assert_eq!(
            d.file.path.as_deref(),
            Some(std::path::Path::new("/etc/inferlb/backends.json"))
        );
        d.apply_shorthand("dns:vllm.prod.svc:8000").unwrap();
        assert_eq!(
            (d.source, d.dns.name.as_deref(), d.dns.port),
            (DiscoverySource::Dns, Some("vllm.prod.svc"), 8000)
        );
        d.apply_shorthand("k8s:prod/app=vllm,tier=gpu:http")
            .unwrap();
        assert_eq!(d.source, DiscoverySource::Kubernetes);
        assert_eq!(d.kubernetes.namespace, "prod");
        assert_eq!(
            d.kubernetes.label_selector.as_deref(),
            Some("app=vllm,tier=gpu")
        );
        assert_eq!(d.kubernetes.port, PortRef::Name("http".into()));
        d.apply_shorthand("k8s:prod/app=vllm:8000").unwrap();
        assert_eq!(d.kubernetes.port, PortRef::Number(8000));
        d.apply_shorthand("k8s-pool:prod/my-pool").unwrap();
        assert_eq!(d.kubernetes.inference_pool.as_deref(), Some("my-pool"));
        assert_eq!(d.kubernetes.label_selector, None);
        for bad in [
            "file:",
            "dns:host",
            "dns:host:x",
            "k8s:noslash:1",
            "k8s:ns/sel:",
            "nope:x",
            "x",
        ] {
            assert!(d.apply_shorthand(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn validate_builds_the_source_and_names_its_field() {
        DiscoveryConfig::default().validate().unwrap();
        let mut d = DiscoveryConfig {
            source: DiscoverySource::Dns,
            ..DiscoveryConfig::default()
        };
        let err = d.validate().unwrap_err().to_string();
        assert!(err.contains("discovery.dns.name"), "{err}");
        d.dns.name = Some("vllm.prod.svc".into());
        d.validate().unwrap();
    }
}
