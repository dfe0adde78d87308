//! `capacity-filter`: drops backends that already have `max_inflight` requests in flight from
//! this router. Unlike the soft saturation filter it may empty the candidate list: the
//! scheduler then queues the request until capacity frees up (or answers 429), instead of
//! overloading a backend. The limit is exact: the scheduler reserves the picked backend's
//! slot atomically under it (see [`crate::endpoints::capacity`]). Added to every profile when
//! `limits.max_inflight_per_backend > 0`.

use std::sync::Arc;

use serde::Deserialize;

use crate::config_error::ConfigError;
use crate::endpoints::Candidate;
use crate::prompt::RequestView;
use crate::scheduling::framework::{Filter, Plugin};
use crate::scheduling::plugins::{identity, parameters};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Params {
    max_inflight: u64,
}

pub struct CapacityFilter {
    name: Arc<str>,
    max_inflight: u64,
}

impl CapacityFilter {
    pub const TYPE: &'static str = "capacity-filter";

    pub fn new(name: &str, max_inflight: u64) -> Self {
        CapacityFilter {
            name: name.into(),
            max_inflight,
        }
    }

    pub fn from_parameters(name: &str, table: &toml::Table) -> Result<Self, ConfigError> {
        let p: Params = parameters(name, table)?;
        if p.max_inflight == 0 {
            return Err(ConfigError::invalid(
                format!("plugins.{name}.parameters"),
                "max_inflight must be > 0",
            ));
        }
        Ok(Self::new(name, p.max_inflight))
    }
}

impl Plugin for CapacityFilter {
    identity!();
}

impl Filter for CapacityFilter {
    fn filter(&self, _request: &RequestView, candidates: &mut Vec<Candidate<'_>>) {
        candidates.retain(|c| c.inflight < self.max_inflight);
    }

    fn capacity(&self) -> Option<u64> {
        Some(self.max_inflight)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::endpoints::test_support::backends;
    use crate::prompt::Operation;

    #[test]
    fn drops_full_backends_even_all_of_them() {
        let b = backends(3);
        let view = RequestView::parse(Operation::Completions, br#"{"prompt":"x"}"#).unwrap();
        let f = CapacityFilter::new("c", 2);
        let mut c: Vec<_> = [0, 2, 1]
            .iter()
            .enumerate()
            .map(|(i, n)| Candidate::with_metrics(&b[i], None, *n))
            .collect();
        f.filter(&view, &mut c);
        assert_eq!(
            c.iter().map(|c| c.backend.id).collect::<Vec<_>>(),
            vec![0, 2]
        );
        let mut full: Vec<_> = (0..3)
            .map(|i| Candidate::with_metrics(&b[i], None, 5))
            .collect();
        f.filter(&view, &mut full);
        assert!(full.is_empty());
        assert!(
            CapacityFilter::from_parameters("c", &toml::from_str("max_inflight = 0").unwrap())
                .is_err()
        );
    }
}
