//! Pickers: choose one candidate from the weighted totals.
pub mod max_score;
pub mod random;
pub mod round_robin;
pub mod weighted_random;
