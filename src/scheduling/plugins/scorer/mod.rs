//! Scorers: give each candidate a score in [0, 1]; the profile weighs and sums them.
pub mod inflight;
pub mod kv_cache_utilization;
pub mod lora_affinity;
pub mod prefill_cost;
pub mod prefix_cache;
pub mod queue;
pub mod session_affinity;
