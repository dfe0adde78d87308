//! KV-cache events: what each backend's cache truly holds, from its own event stream.
//!
//! vLLM publishes `BlockStored` / `BlockRemoved` / `AllBlocksCleared` on a ZeroMQ PUB socket
//! (`--kv-events-config`). Per backend with a configured stream, a subscriber task
//! ([`subscriber`]) reads it, decodes it ([`wire`]), names every block by our own chain hash of
//! its token ids ([`chain`]) and keeps the backend's [`store::BlockStore`]: the set of blocks it
//! holds, bounded by its `num_gpu_blocks`, and the stream's [`store::Status`] (`live`,
//! `unsure` after lost events, `silent` when requests produced no events, `off`). The prefix
//! scorer reads the store through [`crate::endpoints::Backend::kv`] and scores a backend by the
//! blocks it holds while the stream is live, by the approximate index otherwise.
//!
//! Where a backend's stream is ([`Source`]): its own `kv_events` setting, else
//! `kv_events.default`: `off`, `auto` (the backend's `GET /kv_event_sources`, `*` replaced by
//! the backend's host) or `port+N` (the backend's host, its HTTP port + N). An endpoint with
//! `*` means the engine binds and we connect; `bind:tcp://…` (or an `auto` endpoint without
//! `*`: the engine connects) makes the subscriber bind.
//!
//! The subscriber tasks run on a thread of their own (like the poller) and follow pool
//! membership; the request path only ever reads the stores, without locks.

pub mod chain;
pub mod fleet;
pub mod store;
pub mod subscriber;
#[cfg(test)]
pub(crate) mod test_support;
pub mod wire;

use std::sync::Arc;

use serde::Deserialize;

use crate::endpoints::BackendConfig;

use crate::config_error::ConfigError;
use crate::endpoints::Backend;

/// Whether any of `backends` has a `live` stream at `now` ([`crate::clock::now_ms`]): only then can
/// token ids change a decision. One atomic load per backend until the first live one; never
/// waits.
pub fn any_live(backends: &[Arc<Backend>], now: u64) -> bool {
    backends
        .iter()
        .any(|b| b.kv().status(now) == store::Status::Live)
}

/// `[kv_events]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvEventsConfig {
    /// For backends without their own `kv_events`: `"off"`, `"auto"` or `"port+N"`.
    pub default: String,
    /// Replay endpoint for backends without `kv_events_replay`: `"auto"` (from
    /// `/kv_event_sources` when the stream is `auto`), `"off"` or `"port+N"`.
    pub replay: String,
    /// Subscription prefix (vLLM's `topic`); empty: every message.
    pub topic: String,
    /// A stream that stays quiet this long after a request that should have stored blocks is
    /// `silent`: that backend is scored by the approximate index until events flow again.
    pub quiet_ms: u64,
    /// How long a replay may take before the gap is given up (the backend becomes `unsure`).
    pub replay_timeout_ms: u64,
    /// Largest message accepted (bytes); larger ones are dropped and counted as errors.
    pub max_message_bytes: usize,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            default: "off".into(),
            replay: "auto".into(),
            topic: String::new(),
            quiet_ms: 10_000,
            replay_timeout_ms: 2_000,
            max_message_bytes: 64 << 20,
        }
    }
}

impl KvEventsConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        Rule::parse(&self.default, false)
            .map_err(|m| ConfigError::invalid("kv_events.default", m))?;
        Rule::parse(&self.replay, true).map_err(|m| ConfigError::invalid("kv_events.replay", m))?;
        for (field, v) in [
            ("kv_events.quiet_ms", self.quiet_ms),
            ("kv_events.replay_timeout_ms", self.replay_timeout_ms),
        ] {
            if v == 0 {
                return Err(ConfigError::invalid(field, "must be greater than 0"));
            }
        }
        if self.max_message_bytes == 0 {
            return Err(ConfigError::invalid(
                "kv_events.max_message_bytes",
                "must be greater than 0",
            ));
        }
        Ok(())
    }

    /// Is any stream possibly configured (so the subscriber thread is worth starting)?
    pub fn any(&self, backends: &[BackendConfig]) -> bool {
        self.default != "off"
            || backends
                .iter()
                .any(|b| b.kv_events.as_deref().is_some_and(|k| k != "off"))
    }
}

/// A rule for finding a backend's endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Rule {
    Off,
    Auto,
    PortPlus(u16),
    Endpoint(Endpoint),
}

impl Rule {
    fn parse(text: &str, replay: bool) -> Result<Rule, String> {
        match text {
            "off" => return Ok(Rule::Off),
            "auto" => return Ok(Rule::Auto),
            _ => {}
        }
        if let Some(n) = text.strip_prefix("port+") {
            return n
                .parse()
                .map(Rule::PortPlus)
                .map_err(|_| format!("`{text}`: port+N needs N within 0..65535"));
        }
        let e = Endpoint::parse(text)?;
        if replay && e.bind {
            return Err(format!(
                "`{text}`: a replay endpoint is always connected to"
            ));
        }
        Ok(Rule::Endpoint(e))
    }
}

/// A ZeroMQ endpoint and which side binds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// `tcp://HOST:PORT`.
    pub address: String,
    /// We bind (the engine connects to us).
    pub bind: bool,
}

impl Endpoint {
    fn parse(text: &str) -> Result<Endpoint, String> {
        let (bind, address) = match text.strip_prefix("bind:") {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let Some(hostport) = address.strip_prefix("tcp://") else {
            return Err(format!(
                "`{text}`: expected \"off\", \"auto\", \"port+N\", \"tcp://HOST:PORT\" or \"bind:tcp://HOST:PORT\""
            ));
        };
        let port = hostport.rsplit_once(':').map(|(_, p)| p);
        if hostport.contains('*') || port.and_then(|p| p.parse::<u16>().ok()).is_none() {
            return Err(format!("`{text}`: needs a host and a port"));
        }
        Ok(Endpoint {
            address: address.to_owned(),
            bind,
        })
    }

    /// From vLLM's own config (`/kv_event_sources`): `*` is replaced by `host` and means the
    /// engine binds (we connect); without it the engine connects (we bind).
    pub fn from_engine(text: &str, host: &str) -> Result<Endpoint, String> {
        let Some(rest) = text.strip_prefix("tcp://") else {
            return Err(format!("`{text}`: only tcp:// endpoints are supported"));
        };
        if rest.starts_with('*') {
            return Endpoint::parse(&format!("tcp://{}", rest.replacen('*', host, 1)));
        }
        Endpoint::parse(&format!("bind:{text}"))
    }
}

/// Where one backend's stream and replay socket are (resolved at subscribe time for `auto`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Off,
    /// Read the backend's `/kv_event_sources`; `replay` says whether to use its replay endpoint
    /// (or gives one).
    Auto {
        replay: Option<ReplayRule>,
    },
    Fixed {
        stream: Endpoint,
        replay: Option<Endpoint>,
    },
}

/// How the replay endpoint is found for an `auto` stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplayRule {
    FromSources,
    Fixed(Endpoint),
}

impl Source {
    /// The source for backend `b` under the global settings.
    pub fn from_backend(b: &BackendConfig, cfg: &KvEventsConfig) -> Result<Source, String> {
        let stream = match &b.kv_events {
            Some(text) => Rule::parse(text, false)?,
            None => Rule::parse(&cfg.default, false)?,
        };
        let replay = match &b.kv_events_replay {
            Some(text) => Rule::parse(text, true)?,
            None => Rule::parse(&cfg.replay, true)?,
        };
        let host_port = || -> Result<(String, u16), String> {
            let (_, authority) = crate::endpoints::parse_base_url(&b.url)?;
            let port = authority
                .port_u16()
                .unwrap_or(if b.url.starts_with("https") { 443 } else { 80 });
            Ok((authority.host().to_owned(), port))
        };
        let fixed_replay = |rule: &Rule| -> Result<Option<Endpoint>, String> {
            Ok(match rule {
                Rule::Off | Rule::Auto => None,
                Rule::Endpoint(e) => Some(e.clone()),
                Rule::PortPlus(n) => {
                    let (host, port) = host_port()?;
                    let port = port
                        .checked_add(*n)
                        .ok_or_else(|| format!("port {port} + {n} is beyond 65535"))?;
                    Some(Endpoint {
                        address: format!("tcp://{host}:{port}"),
                        bind: false,
                    })
                }
            })
        };
        Ok(match stream {
            Rule::Off => Source::Off,
            Rule::Auto => Source::Auto {
                replay: match &replay {
                    Rule::Off => None,
                    Rule::Auto => Some(ReplayRule::FromSources),
                    other => fixed_replay(other)?.map(ReplayRule::Fixed),
                },
            },
            Rule::Endpoint(stream) => Source::Fixed {
                stream,
                replay: fixed_replay(&replay)?,
            },
            Rule::PortPlus(n) => {
                let (host, port) = host_port()?;
                let port = port
                    .checked_add(n)
                    .ok_or_else(|| format!("port {port} + {n} is beyond 65535"))?;
                Source::Fixed {
                    stream: Endpoint {
                        address: format!("tcp://{host}:{port}"),
                        bind: false,
                    },
                    replay: fixed_replay(&replay)?,
                }
            }
        })
    }
}

/// `/kv_event_sources`: the publisher config per data-parallel rank; rank 0's endpoints.
pub fn parse_sources(body: &[u8], host: &str) -> Result<(Endpoint, Option<Endpoint>), String> {
    #[derive(Deserialize)]
    struct Rank {
        endpoint: Option<String>,
        replay_endpoint: Option<String>,
        enable_kv_cache_events: Option<bool>,
    }
    let ranks: std::collections::BTreeMap<String, Rank> =
        serde_json::from_slice(body).map_err(|e| format!("/kv_event_sources: {e}"))?;
    let rank = ranks
        .get("0")
        .or_else(|| ranks.values().next())
        .ok_or("/kv_event_sources lists no publisher")?;
    if rank.enable_kv_cache_events == Some(false) {
        return Err("the backend has KV-cache events disabled".into());
    }
    let endpoint = rank
        .endpoint
        .as_deref()
        .ok_or("/kv_event_sources has no endpoint")?;
    let stream = Endpoint::from_engine(endpoint, host)?;
    let replay = rank
        .replay_endpoint
        .as_deref()
        .filter(|r| !r.is_empty())
        .map(|r| Endpoint::from_engine(r, host))
        .transpose()?
        .map(|mut e| {
            // The replay socket is a ROUTER: we always connect to it.
            e.bind = false;
            e
        });
    Ok((stream, replay))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn backend(url: &str, kv: Option<&str>) -> BackendConfig {
        let mut b = BackendConfig::from_url(url);
        b.kv_events = kv.map(str::to_owned);
        b
    }

    #[test]
    fn sources_from_settings() {
        let cfg = KvEventsConfig::default();
        assert_eq!(
            Source::from_backend(&backend("http://h:8000", None), &cfg).unwrap(),
            Source::Off
        );
        assert_eq!(
            Source::from_backend(&backend("http://h:8000", Some("tcp://e:5557")), &cfg).unwrap(),
            Source::Fixed {
                stream: Endpoint {
                    address: "tcp://e:5557".into(),
                    bind: false
                },
                replay: None
            }
        );
        let ported = KvEventsConfig {
            default: "port+10000".into(),
            replay: "port+20000".into(),
            ..Default::default()
        };
        assert_eq!(
            Source::from_backend(&backend("http://h:8000", None), &ported).unwrap(),
            Source::Fixed {
                stream: Endpoint {
                    address: "tcp://h:18000".into(),
                    bind: false
                },
                replay: Some(Endpoint {
                    address: "tcp://h:28000".into(),
                    bind: false
                })
            }
        );
        assert!(Source::from_backend(&backend("http://h:60000", None), &ported).is_err());
        assert!(Source::from_backend(&backend("http://h:1", Some("tcp://*:1")), &cfg).is_err());
        assert!(Source::from_backend(&backend("http://h:1", Some("udp://x:1")), &cfg).is_err());
        assert_eq!(
            Source::from_backend(&backend("http://h:1", Some("auto")), &cfg).unwrap(),
            Source::Auto {
                replay: Some(ReplayRule::FromSources)
            }
        );
        let bad = KvEventsConfig {
            default: "sometimes".into(),
            ..Default::default()
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn kv_event_sources_of_a_real_server() {
        let body = include_bytes!("../../tests/fixtures/kv_event_sources.json");
        let (stream, replay) = parse_sources(body, "10.1.2.3").unwrap();
        assert_eq!(stream.address, "tcp://10.1.2.3:5557");
        assert!(!stream.bind, "vLLM binds on *: we connect");
        assert_eq!(replay.unwrap().address, "tcp://10.1.2.3:5558");
        let connecting = br#"{"0":{"endpoint":"tcp://10.0.0.9:7000"}}"#;
        let (stream, replay) = parse_sources(connecting, "h").unwrap();
        assert!(stream.bind, "vLLM connects: we bind");
        assert_eq!(replay, None);
        assert!(parse_sources(b"{}", "h").is_err());
        assert!(parse_sources(br#"{"0":{"enable_kv_cache_events":false}}"#, "h").is_err());
    }
}
