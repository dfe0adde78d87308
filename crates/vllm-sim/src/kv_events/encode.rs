//! msgpack encoding of an event batch, byte-compatible with what vLLM 0.32's msgspec encoder sends.
//!
//! Payload: an array `[ts: f64, [event, ...], data_parallel_rank]` (msgspec `array_like`; the
//! rank is always 0 here, and vLLM's publisher always fills it in). Each event is a map whose first
//! key is `"type"`, then the fields in vLLM's declaration order; fields without a default are
//! always written (nil when empty: `parent_block_hash`, `lora_id`, `lora_name`), fields whose
//! value equals their default are left out (`omit_defaults`):
//!
//! * `BlockStored`: `type, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//!   lora_name, extra_keys, group_idx, kv_cache_spec_kind` — as in the capture of a real server
//!   (one full-attention KV-cache group: `group_idx` 0, `kv_cache_spec_kind` `"full_attention"`;
//!   `extra_keys` one entry per block: nil, or the block's extra hash keys in vLLM's order —
//!   `lora_name` for an adapter's blocks, then `cache_salt` on the prompt's first block).
//! * `BlockRemoved`: `type, block_hashes, medium, group_idx` (vLLM sends one per evicted block).
//! * `AllBlocksCleared`: `type` only.
//!
//! Integers use the shortest msgpack form (as msgspec does), block hashes are unsigned.
//! `lora_id` is the adapter's 1-based position in `--lora-modules`, as vLLM numbers
//! `--lora-modules` adapters.

use std::io;

use bytes::Bytes;
use rmp::encode::{write_array_len, write_f64, write_map_len, write_nil, write_str, write_uint};

use super::KvEvent;

/// vLLM's `MEDIUM_GPU`.
pub const MEDIUM_GPU: &str = "GPU";
/// The kind of the simulator's one KV-cache group.
pub const SPEC_KIND: &str = "full_attention";

/// Encodes batches of one engine: knows its block size and adapter names.
#[derive(Debug, Clone)]
pub struct Encoder {
    pub block_size: u64,
    /// Adapter names by index (`--lora-modules` order).
    pub loras: Vec<String>,
}

fn len32(n: usize) -> io::Result<u32> {
    u32::try_from(n).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "array too long"))
}

fn write_opt_u64(out: &mut Vec<u8>, v: Option<u64>) -> io::Result<()> {
    match v {
        Some(v) => write_uint(out, v).map(|_| ()).map_err(io::Error::from),
        None => write_nil(out),
    }
}

impl Encoder {
    /// The msgpack payload of one batch.
    pub fn encode_batch(&self, ts: f64, events: &[KvEvent]) -> io::Result<Vec<u8>> {
        let mut out = Vec::with_capacity(64);
        write_array_len(&mut out, 3)?;
        write_f64(&mut out, ts)?;
        write_array_len(&mut out, len32(events.len())?)?;
        for e in events {
            self.encode_event(&mut out, e)?;
        }
        write_uint(&mut out, 0)?; // data_parallel_rank
        Ok(out)
    }

    fn encode_event(&self, out: &mut Vec<u8>, e: &KvEvent) -> io::Result<()> {
        match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                lora,
                cache_salt,
            } => {
                let lora_name = lora.and_then(|i| self.loras.get(usize::from(i)));
                write_map_len(out, 11)?;
                write_str(out, "type")?;
                write_str(out, "BlockStored")?;
                write_str(out, "block_hashes")?;
                write_array_len(out, len32(block_hashes.len())?)?;
                for h in block_hashes {
                    write_uint(out, *h)?;
                }
                write_str(out, "parent_block_hash")?;
                write_opt_u64(out, *parent_block_hash)?;
                write_str(out, "token_ids")?;
                write_array_len(out, len32(token_ids.len())?)?;
                for t in token_ids {
                    write_uint(out, u64::from(*t))?;
                }
                write_str(out, "block_size")?;
                write_uint(out, self.block_size)?;
                write_str(out, "lora_id")?;
                write_opt_u64(out, lora_name.and(lora.map(|i| u64::from(i) + 1)))?;
                write_str(out, "medium")?;
                write_str(out, MEDIUM_GPU)?;
                write_str(out, "lora_name")?;
                match lora_name {
                    Some(n) => write_str(out, n)?,
                    None => write_nil(out)?,
                }
                write_str(out, "extra_keys")?;
                write_array_len(out, len32(block_hashes.len())?)?;
                for i in 0..block_hashes.len() {
                    let salt = cache_salt.as_deref().filter(|_| i == 0);
                    let keys: Vec<&str> = lora_name
                        .map(String::as_str)
                        .into_iter()
                        .chain(salt)
                        .collect();
                    if keys.is_empty() {
                        write_nil(out)?;
                    } else {
                        write_array_len(out, len32(keys.len())?)?;
                        for k in keys {
                            write_str(out, k)?;
                        }
                    }
                }
                write_str(out, "group_idx")?;
                write_uint(out, 0)?;
                write_str(out, "kv_cache_spec_kind")?;
                write_str(out, SPEC_KIND)?;
            }
            KvEvent::BlockRemoved { block_hash } => {
                write_map_len(out, 4)?;
                write_str(out, "type")?;
                write_str(out, "BlockRemoved")?;
                write_str(out, "block_hashes")?;
                write_array_len(out, 1)?;
                write_uint(out, *block_hash)?;
                write_str(out, "medium")?;
                write_str(out, MEDIUM_GPU)?;
                write_str(out, "group_idx")?;
                write_uint(out, 0)?;
            }
            KvEvent::AllBlocksCleared => {
                write_map_len(out, 1)?;
                write_str(out, "type")?;
                write_str(out, "AllBlocksCleared")?;
            }
        }
        Ok(())
    }
}

/// The three frames of one message: `[topic, seq as u64 big-endian, payload]`.
pub fn frames(topic: &str, seq: u64, payload: impl Into<Bytes>) -> [Bytes; 3] {
    [
        Bytes::copy_from_slice(topic.as_bytes()),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        payload.into(),
    ]
}

#[cfg(test)]
#[path = "encode_tests.rs"]
mod tests;
