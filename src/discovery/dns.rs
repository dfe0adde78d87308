//! `dns` discovery: a name re-resolved every interval; each A/AAAA address becomes a backend
//! at `scheme://ADDR:port` (a Kubernetes headless Service gives one address per ready Pod).
//! A failed lookup is reported and the last good set stays; so does an empty answer, which is
//! more often a resolver hiccup than a fleet scaled to zero.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use super::{DesiredBackend, Discovery, DiscoveryError, NextSet};
use crate::config_error::ConfigError;
use crate::discovery::{BackendDefaults, DnsDiscoveryConfig};

pub struct DnsDiscovery {
    name: String,
    port: u16,
    interval: Duration,
    defaults: BackendDefaults,
    last: Option<BTreeSet<IpAddr>>,
}

/// The desired set for `addresses` (sorted, de-duplicated).
pub fn backends_for(
    addresses: &BTreeSet<IpAddr>,
    port: u16,
    name: &str,
    d: &BackendDefaults,
) -> Vec<DesiredBackend> {
    addresses
        .iter()
        .map(|ip| {
            let mut b = DesiredBackend::new(d.backend(&ip.to_string(), port));
            b.labels.insert("dns_name".into(), name.to_owned());
            b
        })
        .collect()
}

impl DnsDiscovery {
    pub fn new(cfg: &DnsDiscoveryConfig, defaults: &BackendDefaults) -> Result<Self, ConfigError> {
        let name = cfg.name.clone().filter(|n| !n.is_empty()).ok_or_else(|| {
            ConfigError::invalid("discovery.dns.name", "the dns source needs a name")
        })?;
        if cfg.interval_ms == 0 || cfg.port == 0 {
            return Err(ConfigError::invalid(
                "discovery.dns",
                "interval_ms and port must be greater than 0",
            ));
        }
        Ok(DnsDiscovery {
            name,
            port: cfg.port,
            interval: Duration::from_millis(cfg.interval_ms),
            defaults: defaults.clone(),
            last: None,
        })
    }

    async fn resolve(&self) -> Result<BTreeSet<IpAddr>, DiscoveryError> {
        let found = tokio::net::lookup_host((self.name.as_str(), self.port))
            .await
            .map_err(|e| DiscoveryError {
                source_name: "dns",
                message: format!("{}: {e}", self.name),
            })?;
        Ok(found.map(|a| a.ip()).collect())
    }
}

impl Discovery for DnsDiscovery {
    fn source(&self) -> &'static str {
        "dns"
    }

    fn next(&mut self) -> NextSet<'_> {
        Box::pin(async move {
            loop {
                if self.last.is_some() {
                    tokio::time::sleep(self.interval).await;
                }
                let addresses = match self.resolve().await {
                    Ok(a) if a.is_empty() => Err(DiscoveryError {
                        source_name: "dns",
                        message: format!("{}: no addresses (keeping the last set)", self.name),
                    }),
                    other => other,
                };
                let addresses = match addresses {
                    Ok(a) => a,
                    Err(e) => {
                        // Try again next interval; report now.
                        self.last.get_or_insert_with(BTreeSet::new);
                        return Err(e);
                    }
                };
                if self.last.as_ref() != Some(&addresses) {
                    let set = backends_for(&addresses, self.port, &self.name, &self.defaults);
                    self.last = Some(addresses);
                    return Ok(set);
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn addresses_become_backends_ipv6_bracketed() {
        let a: BTreeSet<IpAddr> = ["10.0.0.2", "10.0.0.1", "::1"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        let set = backends_for(&a, 8000, "vllm", &BackendDefaults::default());
        let urls: Vec<_> = set.iter().map(|b| b.config.url.as_str()).collect();
        assert_eq!(
            urls,
            vec![
                "http://10.0.0.1:8000",
                "http://10.0.0.2:8000",
                "http://[::1]:8000"
            ]
        );
        assert_eq!(set[0].labels["dns_name"], "vllm");
    }

    #[tokio::test]
    async fn localhost_resolves_and_an_unchanged_answer_is_not_repeated() {
        let cfg = DnsDiscoveryConfig {
            name: Some("localhost".into()),
            port: 9,
            interval_ms: 1,
        };
        let mut d = DnsDiscovery::new(&cfg, &BackendDefaults::default()).unwrap();
        let first = d.next().await.unwrap();
        assert!(
            first.iter().any(|b| b.config.url == "http://127.0.0.1:9"),
            "{first:?}"
        );
        let again = tokio::time::timeout(Duration::from_millis(50), d.next()).await;
        assert!(again.is_err(), "no new set while the answer stays the same");
        let bad = DnsDiscoveryConfig {
            name: Some("no-such-host.invalid".into()),
            ..cfg
        };
        let mut b = DnsDiscovery::new(&bad, &BackendDefaults::default()).unwrap();
        assert!(b.next().await.is_err());
    }
}
