//! Filters: drop candidates that must not (or should not) serve a request.
pub mod capacity;
pub mod healthy;
pub mod model;
pub mod pinned;
pub mod role;
pub mod saturation;
