//! Stateful OpenAI APIs across a fleet: the Responses API's response ids.
//!
//! vLLM keeps each response it stores (with `VLLM_ENABLE_RESPONSES_API_STORE=1`) in the
//! memory of the one server that made it (`OpenAIServingResponses.response_store`,
//! `msg_store`, `event_store` in `vllm/entrypoints/openai/responses/serving.py`, vLLM 0.32.0).
//! A call that names a response — `previous_response_id` in a `POST /v1/responses` body, or
//! the `{id}` of `GET /v1/responses/{id}` (also `?stream=true&starting_after=N`, the resumption
//! of a background stream), `POST /v1/responses/{id}/cancel`, and any other method or sub-path
//! under it — must reach that server. This module finds it:
//!
//! 1. [`Directory`]: a bounded table id → backend name, learnt from the answers of
//!    `POST /v1/responses` as they pass ([`learn`]: the `id` of the JSON body, or of the
//!    `response` in the first SSE events; the body streams on untouched). Entries expire after
//!    `ttl_secs`, and at most `max_ids` are kept (least recently used out first).
//! 2. When the id is unknown (another router replica made it, this router restarted, the
//!    entry expired): [`lookup`] asks the backends that serve whole requests and can answer
//!    (healthy, not ejected, draining or not) `GET /v1/responses/{id}`, at most
//!    `lookup_concurrency` at once and within `lookup_timeout_ms`; the first `200` is the
//!    holder, recorded in the table. `prefill` backends make no responses (`crate::pd` never
//!    sends them a Responses call) and are not asked. Every backend answering `404` means nobody has it: the
//!    client gets vLLM's own not-found error (404, `Response with id '…' not found.`),
//!    remembered for `not_found_ttl_ms` so a client repeating a bad id costs the fleet one
//!    round of lookups. A backend that could not answer (down, ejected, a failed probe)
//!    leaves the question open: 503.
//!    Concurrent calls for one id share one lookup; at most `max_lookups` run at once
//!    router-wide.
//! 3. The request is pinned to the holder (`RequestView::pinned`, `pinned-filter`): it waits
//!    for the holder's capacity like any request, is never retried elsewhere, and gets 503
//!    while the holder is unhealthy. A holder that left the fleet is treated as unknown
//!    (step 2), which ends in the not-found answer when nobody else has it.
//!
//! Read at start-up (a reload does not change it).

pub mod learn;
pub mod lookup;

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::config_error::ConfigError;

pub use lookup::{Found, Lookup};

/// The Responses API's path: `POST` creates, `/{id}…` names one response.
pub const PATH: &str = "/v1/responses";

/// Is this request path (with its query) the Responses API's?
pub fn on_api_path(path_and_query: &str) -> bool {
    path_and_query.starts_with(PATH)
}

/// `[responses]`: affinity of the Responses API's calls to the backend holding the response.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResponsesConfig {
    /// The most response ids remembered (least recently used forgotten first).
    pub max_ids: u64,
    /// How long an id is remembered after it was learnt or last used, in seconds.
    pub ttl_secs: u64,
    /// An unknown id's lookup must be answered within this, in milliseconds.
    pub lookup_timeout_ms: u64,
    /// Backends asked at once by one lookup.
    pub lookup_concurrency: usize,
    /// Lookups running at once across the router; more wait up to `lookup_timeout_ms`.
    pub max_lookups: usize,
    /// How long an id every backend said it does not have is answered 404 without asking
    /// again, in milliseconds (0: always ask).
    pub not_found_ttl_ms: u64,
}

impl Default for ResponsesConfig {
    fn default() -> Self {
        ResponsesConfig {
            max_ids: 100_000,
            ttl_secs: 24 * 3600,
            lookup_timeout_ms: 2_000,
            lookup_concurrency: 16,
            max_lookups: 64,
            not_found_ttl_ms: 1_000,
        }
    }
}

impl ResponsesConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("responses.max_ids", self.max_ids),
            ("responses.ttl_secs", self.ttl_secs),
            ("responses.lookup_timeout_ms", self.lookup_timeout_ms),
            (
                "responses.lookup_concurrency",
                self.lookup_concurrency as u64,
            ),
            ("responses.max_lookups", self.max_lookups as u64),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(ConfigError::invalid(field, "must be greater than 0"));
            }
        }
        // The cache refuses durations of centuries; nothing needs more than these.
        let bounds = [
            ("responses.ttl_secs", self.ttl_secs, 10 * 365 * 24 * 3600),
            (
                "responses.not_found_ttl_ms",
                self.not_found_ttl_ms,
                24 * 3600 * 1000,
            ),
            (
                "responses.lookup_timeout_ms",
                self.lookup_timeout_ms,
                10 * 60 * 1000,
            ),
        ];
        for (field, value, max) in bounds {
            if value > max {
                return Err(ConfigError::invalid(
                    field,
                    format!("must be at most {max}"),
                ));
            }
        }
        Ok(())
    }
}

/// Response id → the name of the backend that holds it.
pub struct Directory {
    ids: moka::sync::Cache<Arc<str>, Arc<str>>,
    /// Ids nobody had at the last lookup.
    absent: moka::sync::Cache<Arc<str>, ()>,
}

impl Directory {
    pub fn new(cfg: &ResponsesConfig) -> Self {
        let absent = moka::sync::Cache::builder().max_capacity(cfg.max_ids.min(10_000));
        let absent = match cfg.not_found_ttl_ms {
            0 => absent.max_capacity(0),
            ms => absent.time_to_live(Duration::from_millis(ms)),
        };
        Directory {
            ids: moka::sync::Cache::builder()
                .max_capacity(cfg.max_ids)
                .time_to_idle(Duration::from_secs(cfg.ttl_secs))
                .build(),
            absent: absent.build(),
        }
    }

    /// The holder of `id`, when known.
    pub fn holder(&self, id: &str) -> Option<Arc<str>> {
        self.ids.get(id)
    }

    /// `backend` holds `id`.
    pub fn learn(&self, id: &str, backend: &str) {
        if !crate::prompt::responses::valid_id(id) {
            return;
        }
        self.absent.invalidate(id);
        self.ids.insert(Arc::from(id), Arc::from(backend));
    }

    /// `id`'s holder is gone or wrong: ask again next time.
    pub fn forget(&self, id: &str) {
        self.ids.invalidate(id);
    }

    /// Did the last lookup of `id`, not long ago, find nobody?
    pub fn known_absent(&self, id: &str) -> bool {
        self.absent.contains_key(id)
    }

    pub fn note_absent(&self, id: &str) {
        self.absent.insert(Arc::from(id), ());
    }

    /// Ids remembered now (approximate: moka counts lazily).
    pub fn len(&self) -> u64 {
        self.ids.entry_count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How a call naming a response found its backend, the `outcome` label of
/// `inferlb_responses_affinity_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The table knew the holder.
    Known,
    /// A lookup found it.
    Found,
    /// Nobody has it (404 to the client).
    NotFound,
    /// Not every backend could answer the lookup (503 to the client).
    Unresolved,
}

impl Outcome {
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Known => "known",
            Outcome::Found => "found",
            Outcome::NotFound => "not_found",
            Outcome::Unresolved => "unresolved",
        }
    }
}

pub fn count(outcome: Outcome) {
    metrics::counter!(crate::telemetry::RESPONSES_AFFINITY, "outcome" => outcome.label())
        .increment(1);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_directory_learns_forgets_and_refuses_bad_ids() {
        let d = Directory::new(&ResponsesConfig::default());
        d.learn("resp_0123456789abcdef", "http://a");
        assert_eq!(
            d.holder("resp_0123456789abcdef").as_deref(),
            Some("http://a")
        );
        d.learn("resp_0123456789abcdef", "http://b");
        assert_eq!(
            d.holder("resp_0123456789abcdef").as_deref(),
            Some("http://b")
        );
        d.forget("resp_0123456789abcdef");
        assert_eq!(d.holder("resp_0123456789abcdef"), None);
        d.learn("../x", "http://a");
        d.learn(&"a".repeat(200), "http://a");
        assert_eq!(d.holder("../x"), None);
        d.note_absent("resp_x");
        assert!(d.known_absent("resp_x"));
        d.learn("resp_x", "http://a");
        assert!(
            !d.known_absent("resp_x"),
            "learning an id clears its absence"
        );
    }

    #[test]
    fn the_table_is_bounded() {
        let d = Directory::new(&ResponsesConfig {
            max_ids: 100,
            ..ResponsesConfig::default()
        });
        for i in 0..1_000 {
            d.learn(&format!("resp_{i}"), "http://a");
        }
        d.ids.run_pending_tasks();
        assert!(d.len() <= 100, "{}", d.len());
    }

    #[test]
    fn durations_beyond_reason_are_refused_by_name() {
        let e = ResponsesConfig {
            ttl_secs: u64::MAX,
            ..ResponsesConfig::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("responses.ttl_secs"), "{e}");
    }

    #[test]
    fn zero_limits_are_refused_by_name() {
        let e = ResponsesConfig {
            lookup_concurrency: 0,
            ..ResponsesConfig::default()
        }
        .validate()
        .unwrap_err();
        assert!(
            e.to_string().contains("responses.lookup_concurrency"),
            "{e}"
        );
    }
}
