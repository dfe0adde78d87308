//! `vllm-sim` simulators as backends of the router under test, in-process on 127.0.0.1
//! port 0.

use vllm_sim::{KvEventsConfig, SimConfig, SimHandle};

/// A simulator config serving `model`, answering at once (`instant`), on port 0.
pub fn config(model: &str) -> SimConfig {
    SimConfig {
        port: 0,
        model: model.into(),
        instant: true,
        ..SimConfig::default()
    }
}

/// KV events published on `tcp://*:0` (the port it gets is in `/kv_event_sources`), topic
/// `kv@sim`.
pub fn kv_events() -> KvEventsConfig {
    KvEventsConfig::parse(
        r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:0","topic":"kv@sim"}"#,
    )
    .unwrap()
}

/// A simulator with `cfg`.
pub async fn start(cfg: SimConfig) -> SimHandle {
    vllm_sim::spawn(cfg).await.unwrap()
}
