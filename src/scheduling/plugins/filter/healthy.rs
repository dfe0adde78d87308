//! `healthy-filter`: keeps only backends the poller considers healthy and that outlier
//! detection has not ejected.
//!
//! Inputs: `BackendState::healthy` (consecutive scrape results) and the passive ejection state
//! (consecutive forwarding failures). Always part of every profile.

use std::sync::Arc;

use crate::endpoints::Candidate;
use crate::prompt::RequestView;
use crate::scheduling::framework::{Filter, Plugin};
use crate::scheduling::plugins::identity;

pub struct HealthyFilter {
    name: Arc<str>,
}

impl HealthyFilter {
    pub const TYPE: &'static str = "healthy-filter";

    pub fn new(name: &str) -> Self {
        HealthyFilter { name: name.into() }
    }
}

impl Plugin for HealthyFilter {
    identity!();
}

impl Filter for HealthyFilter {
    fn filter(&self, _request: &RequestView, candidates: &mut Vec<Candidate<'_>>) {
        candidates.retain(|c| c.state.healthy && !c.ejected);
    }
}
