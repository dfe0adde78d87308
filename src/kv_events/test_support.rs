//! Unit-test fixtures for what feeds a block store: events as vLLM publishes them, and a store
//! whose stream is live.

use super::store::BlockStore;
use super::wire::{Event, Medium, Stored};

/// `BlockStored` of GPU blocks `hashes` holding `tokens`, chained to `parent`.
pub fn stored(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: impl IntoIterator<Item = u32>,
    block_size: u32,
) -> Event {
    Event::Stored(Stored {
        block_hashes: hashes.to_vec(),
        parent,
        token_ids: tokens.into_iter().collect(),
        block_size,
        lora_name: None,
        medium: Medium::Gpu,
        extra_keys: Vec::new(),
    })
}

/// `BlockRemoved` of GPU blocks `hashes`.
pub fn removed(hashes: &[u64]) -> Event {
    Event::Removed {
        block_hashes: hashes.to_vec(),
        medium: Medium::Gpu,
    }
}

/// Turns `store`'s stream on (silent after `quiet_ms` without events) and connected: live.
pub fn go_live(store: &BlockStore, quiet_ms: u64) {
    store.turn_on(quiet_ms, "tcp://test:1".into());
    store.set_connected(true);
}
