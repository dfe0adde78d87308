//! KV-cache events: what the block pool caches and evicts, published over ZeroMQ as vLLM 0.32 does.
//!
//! `--kv-events-config JSON` takes vLLM's own JSON ([`KvEventsConfig`], same keys, same defaults,
//! unknown keys rejected as vLLM's pydantic config class rejects them). With
//! `enable_kv_cache_events: true` and the `zmq` publisher, the engine collects, per step, the
//! events of its block pool ([`KvEvent`]: `BlockStored` for the blocks that became full and
//! cached, `BlockRemoved` for each cached block evicted to make room, `AllBlocksCleared` when the
//! prefix cache is reset) and hands them, as one batch with the next sequence number, to the
//! [`publisher`] task, which encodes them ([`encode`]) and sends `[topic, seq, payload]` on a PUB
//! socket. A ROUTER socket at `replay_endpoint` serves the last `buffer_steps` batches again.
//!
//! Endpoint rule (vLLM's): the PUB socket **binds** when the endpoint contains `*` or `::` or
//! starts with `ipc://` / `inproc://`, and **connects** otherwise (then the subscriber binds).
//! `tcp://*:N` binds every interface; `tcp://*:0` binds a free port on the simulator's `--host`
//! and `/kv_event_sources` reports the port it got (vLLM does the same with the node's IP).
//! The replay endpoint always binds. Only `tcp://` is supported (the ZeroMQ crate is built with
//! its TCP transport only).
//!
//! Block hashes are the simulator's own chain hashes (u64, see [`crate::kv_cache`]); consumers
//! hash the events' `token_ids` themselves, as they must with vLLM.

pub mod encode;
pub mod publisher;

use serde::{Deserialize, Serialize};

/// vLLM's default `endpoint`.
pub const DEFAULT_ENDPOINT: &str = "tcp://*:5557";
/// Batches kept for replay when `buffer_steps` is not given.
pub const DEFAULT_BUFFER_STEPS: usize = 10_000;
/// vLLM's default `hwm` and `max_queue_size`.
pub const DEFAULT_HWM: usize = 100_000;
/// Largest engine → publisher queue, whatever `max_queue_size` says (0 means "unbounded" to
/// vLLM's Python queue; here it means this).
pub const MAX_QUEUE: usize = 1 << 20;

/// Which publisher vLLM would create.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PublisherKind {
    Null,
    Zmq,
}

/// `--kv-events-config`: vLLM 0.32's `KVEventsConfig`, field for field.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEventsConfig {
    #[serde(default)]
    pub enable_kv_cache_events: bool,
    /// Absent: `zmq` when events are enabled, else `null` (vLLM's `__post_init__`).
    #[serde(default)]
    pub publisher: Option<PublisherKind>,
    #[serde(default = "default_endpoint")]
    pub endpoint: String,
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    #[serde(default = "default_buffer_steps")]
    pub buffer_steps: usize,
    #[serde(default = "default_hwm")]
    pub hwm: usize,
    #[serde(default = "default_hwm")]
    pub max_queue_size: usize,
    #[serde(default)]
    pub topic: String,
}

fn default_endpoint() -> String {
    DEFAULT_ENDPOINT.into()
}
fn default_buffer_steps() -> usize {
    DEFAULT_BUFFER_STEPS
}
fn default_hwm() -> usize {
    DEFAULT_HWM
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            enable_kv_cache_events: false,
            publisher: None,
            endpoint: default_endpoint(),
            replay_endpoint: None,
            buffer_steps: DEFAULT_BUFFER_STEPS,
            hwm: DEFAULT_HWM,
            max_queue_size: DEFAULT_HWM,
            topic: String::new(),
        }
    }
}

/// A `--kv-events-config` the simulator cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvConfigError {
    #[error("--kv-events-config: {0}")]
    Json(String),
    #[error(
        "--kv-events-config: {field} {endpoint:?}: only tcp:// endpoints are supported by vllm-sim"
    )]
    Transport {
        field: &'static str,
        endpoint: String,
    },
    #[error("--kv-events-config: {field} {endpoint:?} has no port")]
    NoPort {
        field: &'static str,
        endpoint: String,
    },
}

impl KvEventsConfig {
    /// Parses vLLM's JSON form; an unknown key is an error naming it (as vLLM's
    /// `extra="forbid"` config does).
    pub fn parse(json: &str) -> Result<Self, KvConfigError> {
        let c: Self = serde_json::from_str(json).map_err(|e| KvConfigError::Json(e.to_string()))?;
        c.check()?;
        Ok(c)
    }

    /// The publisher vLLM would pick for this config.
    pub fn publisher_kind(&self) -> PublisherKind {
        match self.publisher {
            Some(p) => p,
            None if self.enable_kv_cache_events => PublisherKind::Zmq,
            None => PublisherKind::Null,
        }
    }

    /// Whether events are published at all (vLLM's `EventPublisherFactory.create`).
    pub fn publishes(&self) -> bool {
        self.enable_kv_cache_events && self.publisher_kind() == PublisherKind::Zmq
    }

    fn check(&self) -> Result<(), KvConfigError> {
        let eps = [
            ("endpoint", Some(&self.endpoint)),
            ("replay_endpoint", self.replay_endpoint.as_ref()),
        ];
        for (field, ep) in eps {
            let Some(ep) = ep else { continue };
            if !ep.starts_with("tcp://") {
                return Err(KvConfigError::Transport {
                    field,
                    endpoint: ep.clone(),
                });
            }
            if split_port(ep).is_none() {
                return Err(KvConfigError::NoPort {
                    field,
                    endpoint: ep.clone(),
                });
            }
        }
        Ok(())
    }

    /// The config of the `i`-th simulator of a `--fleet`: ports moved up by `i`, as vLLM moves
    /// them by the data-parallel rank (port 0 stays 0).
    pub fn offset_ports(&self, i: usize) -> Self {
        let mut c = self.clone();
        c.endpoint = offset_port(&c.endpoint, i);
        c.replay_endpoint = c.replay_endpoint.as_deref().map(|e| offset_port(e, i));
        c
    }
}

/// vLLM's rule: bind on wildcards and local transports, connect otherwise.
pub fn is_bind_endpoint(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// `(everything before the last ':', port)` of a tcp endpoint.
fn split_port(endpoint: &str) -> Option<(&str, u16)> {
    let (base, port) = endpoint.rsplit_once(':')?;
    Some((base, port.parse().ok()?))
}

fn offset_port(endpoint: &str, i: usize) -> String {
    match split_port(endpoint) {
        Some((base, port)) if port != 0 => {
            let p = usize::from(port)
                .saturating_add(i)
                .min(usize::from(u16::MAX));
            format!("{base}:{p}")
        }
        _ => endpoint.to_string(),
    }
}

/// Where to bind a wildcard endpoint: `*` means every IPv4 interface, except that port 0 binds
/// on `host` (so the reported endpoint names an address a subscriber can dial).
pub(crate) fn bind_address(endpoint: &str, host: &str) -> String {
    match split_port(endpoint) {
        Some((base, 0)) if base.contains('*') => format!("tcp://{host}:0"),
        _ => endpoint.replace('*', "0.0.0.0"),
    }
}

/// One change to the block pool, in the order it happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive blocks of one sequence became full and cached in this step: `block_hashes[i]`
    /// covers `token_ids[i*B .. (i+1)*B]`; `parent_block_hash` names the block before the
    /// first (None: the chain starts at the prompt's beginning).
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        /// Index of the LoRA adapter (`--lora-modules` order), None for the base model.
        lora: Option<u16>,
        /// The request's `cache_salt`, when the event starts at the prompt's first block (vLLM
        /// mixes the salt into the first block only).
        cache_salt: Option<String>,
    },
    /// A cached block was evicted (its contents are gone).
    BlockRemoved { block_hash: u64 },
    /// The whole prefix cache was dropped.
    AllBlocksCleared,
}

/// The config as `/kv_event_sources` reports it: publisher resolved, endpoints as bound.
pub fn sources_json(resolved: &KvEventsConfig) -> serde_json::Value {
    serde_json::json!({
        "0": {
            "enable_kv_cache_events": true,
            "publisher": resolved.publisher_kind(),
            "endpoint": resolved.endpoint,
            "replay_endpoint": resolved.replay_endpoint,
            "buffer_steps": resolved.buffer_steps,
            "hwm": resolved.hwm,
            "max_queue_size": resolved.max_queue_size,
            "topic": resolved.topic,
        }
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn vllm_json_parses_with_vllm_defaults() {
        let c = KvEventsConfig::parse(r#"{"enable_kv_cache_events":true}"#).unwrap();
        assert_eq!(c.publisher_kind(), PublisherKind::Zmq);
        assert!(c.publishes());
        assert_eq!(c.endpoint, "tcp://*:5557");
        assert_eq!(
            (c.buffer_steps, c.hwm, c.max_queue_size),
            (10_000, 100_000, 100_000)
        );
        assert_eq!(c.replay_endpoint, None);
        assert_eq!(c.topic, "");
        let off = KvEventsConfig::parse("{}").unwrap();
        assert_eq!(off.publisher_kind(), PublisherKind::Null);
        assert!(!off.publishes());
        let null =
            KvEventsConfig::parse(r#"{"enable_kv_cache_events":true,"publisher":"null"}"#).unwrap();
        assert!(!null.publishes());
    }

    #[test]
    fn unknown_keys_and_bad_values_are_rejected() {
        let e =
            KvEventsConfig::parse(r#"{"enable_kv_cache_events":true,"endpont":"x"}"#).unwrap_err();
        assert!(e.to_string().contains("endpont"), "{e}");
        assert!(KvEventsConfig::parse(r#"{"publisher":"kafka"}"#).is_err());
        assert!(KvEventsConfig::parse(r#"{"hwm":-1}"#).is_err());
        assert!(matches!(
            KvEventsConfig::parse(r#"{"endpoint":"ipc:///tmp/x"}"#),
            Err(KvConfigError::Transport { .. })
        ));
        assert!(matches!(
            KvEventsConfig::parse(r#"{"replay_endpoint":"tcp://*"}"#),
            Err(KvConfigError::NoPort { .. })
        ));
    }

    #[test]
    fn endpoint_rule_is_vllms() {
        assert!(is_bind_endpoint("tcp://*:5557"));
        assert!(is_bind_endpoint("tcp://[::]:5557"));
        assert!(is_bind_endpoint("ipc:///tmp/kv"));
        assert!(is_bind_endpoint("inproc://kv"));
        assert!(!is_bind_endpoint("tcp://127.0.0.1:5557"));
        assert!(!is_bind_endpoint("tcp://router.local:5557"));
        assert_eq!(
            bind_address("tcp://*:5557", "127.0.0.1"),
            "tcp://0.0.0.0:5557"
        );
        assert_eq!(bind_address("tcp://*:0", "127.0.0.1"), "tcp://127.0.0.1:0");
        assert_eq!(bind_address("tcp://[::]:7", "h"), "tcp://[::]:7");
    }

    #[test]
    fn fleet_offsets_ports_like_dp_ranks() {
        let c = KvEventsConfig::parse(
            r#"{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:0"}"#,
        )
        .unwrap();
        let c2 = c.offset_ports(2);
        assert_eq!(c2.endpoint, "tcp://*:5559");
        assert_eq!(c2.replay_endpoint.as_deref(), Some("tcp://*:0"));
        assert_eq!(c.offset_ports(0), c);
    }

    #[test]
    fn sources_json_matches_vllms_answer() {
        let fixture: serde_json::Value = serde_json::from_str(include_str!(
            "../../tests/fixtures/vllm-kv-events/kv_event_sources.json"
        ))
        .unwrap();
        let c = KvEventsConfig::parse(
            r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"kv@127.0.0.1:18102@tiny-llama"}"#,
        )
        .unwrap();
        assert_eq!(sources_json(&c), fixture);
    }
}
