//! `saturation-filter`: drops candidates whose waiting queue or KV-cache usage is above a
//! threshold — unless that would drop them all, in which case it keeps them all (being busy
//! is not a reason to refuse service; the scorers then pick the least busy).
//!
//! Inputs: `waiting` and `kv_usage` from the last fresh scrape; a candidate with unknown
//! metrics is kept. Parameters: `max_waiting` (default 16), `max_kv_usage` (default 0.9).

use std::sync::Arc;

use serde::Deserialize;

use crate::config_error::ConfigError;
use crate::endpoints::Candidate;
use crate::prompt::RequestView;
use crate::scheduling::framework::{Filter, Plugin};
use crate::scheduling::plugins::{identity, parameters};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Params {
    max_waiting: f64,
    max_kv_usage: f64,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            max_waiting: 16.0,
            max_kv_usage: 0.9,
        }
    }
}

pub struct SaturationFilter {
    name: Arc<str>,
    max_waiting: f64,
    max_kv_usage: f64,
}

impl SaturationFilter {
    pub const TYPE: &'static str = "saturation-filter";

    pub fn from_parameters(name: &str, table: &toml::Table) -> Result<Self, ConfigError> {
        let p: Params = parameters(name, table)?;
        if !(0.0..=1.0).contains(&p.max_kv_usage) || p.max_waiting < 0.0 {
            return Err(ConfigError::invalid(
                format!("plugins.{name}.parameters"),
                "max_kv_usage must be within 0..1 and max_waiting at least 0",
            ));
        }
        Ok(SaturationFilter {
            name: name.into(),
            max_waiting: p.max_waiting,
            max_kv_usage: p.max_kv_usage,
        })
    }

    fn saturated(&self, c: &Candidate<'_>) -> bool {
        c.metrics().is_some_and(|m| {
            m.waiting.is_some_and(|w| w > self.max_waiting)
                || m.kv_usage.is_some_and(|k| k > self.max_kv_usage)
        })
    }
}

impl Plugin for SaturationFilter {
    identity!();
}

impl Filter for SaturationFilter {
    fn filter(&self, _request: &RequestView, candidates: &mut Vec<Candidate<'_>>) {
        if candidates.iter().any(|c| !self.saturated(c)) {
            candidates.retain(|c| !self.saturated(c));
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::endpoints::test_support::{backends, load};
    use crate::prompt::{Operation, RequestView};

    fn view() -> RequestView {
        RequestView::parse(Operation::Completions, br#"{"prompt":"x"}"#).unwrap()
    }

    #[test]
    fn drops_saturated_keeps_unknown() {
        let b = backends(4);
        let f = SaturationFilter::from_parameters("s", &toml::Table::new()).unwrap();
        let mut c = vec![
            Candidate::with_metrics(&b[0], Some(load(Some(20.0), Some(0.1))), 0),
            Candidate::with_metrics(&b[1], Some(load(Some(0.0), Some(0.95))), 0),
            Candidate::with_metrics(&b[2], Some(load(Some(16.0), Some(0.9))), 0),
            Candidate::with_metrics(&b[3], None, 0),
        ];
        f.filter(&view(), &mut c);
        let ids: Vec<_> = c.iter().map(|c| c.backend.id).collect();
        assert_eq!(ids, vec![2, 3]);
    }

    #[test]
    fn keeps_all_when_all_saturated() {
        let b = backends(2);
        let f = SaturationFilter::from_parameters("s", &toml::Table::new()).unwrap();
        let mut c = vec![
            Candidate::with_metrics(&b[0], Some(load(Some(20.0), None)), 0),
            Candidate::with_metrics(&b[1], Some(load(None, Some(1.0))), 0),
        ];
        f.filter(&view(), &mut c);
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn rejects_bad_parameters() {
        let bad: toml::Table = toml::from_str("max_kv_usage = 2.0").unwrap();
        assert!(SaturationFilter::from_parameters("s", &bad).is_err());
        let unknown: toml::Table = toml::from_str("max_queue = 2").unwrap();
        let err = SaturationFilter::from_parameters("s", &unknown)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("max_queue"), "{err}");
    }
}
