//! Prefill/decode disaggregation: the two-step path for chat and completions.
//!
//! When `[pd] enabled` and the fleet has `prefill`-role backends, a request whose decode
//! backend `D` (picked first, by the active profile over `decode`/`both` backends) lacks
//! `u = prompt tokens − tokens D already holds` (the estimate of the first plugin that
//! reports prompt work, e.g. the prefix or prefill-cost scorer; the whole prompt estimate
//! without one) with `u > threshold_tokens` (llm-d's rule), and — when
//! `max_prefill_queue_tokens` is set — `Σ pending prefill tokens of the prefill pool <
//! max_prefill_queue_tokens` (Dynamo's rule), is sent in two steps:
//!
//! 1. to a prefill backend `P` (picked by `pd.prefill_profile`, else the active profile, its
//!    candidates narrowed to `prefill` roles by the role filter): the client's body with
//!    `stream: false`, `max_tokens: 1` (and `max_completion_tokens: 1` when present), no
//!    `stream_options`/`min_tokens`/`min_completion_tokens`, and `kv_transfer_params:
//!    {do_remote_decode: true, do_remote_prefill: false, remote_*: null}`, with the client's
//!    request id; its JSON answer (read up to [`MAX_PREFILL_RESPONSE`] bytes within
//!    `prefill_timeout_ms`) carries P's params;
//! 2. to `D`: the client's body plus P's `kv_transfer_params`, copied as raw JSON (whatever
//!    fields the engine's connector puts there — engine id, block ids, host, port, request
//!    id, parallel sizes, lease expiry — reach D unchanged). D is charged no prefill work.
//!
//! This is what vLLM's own proxy for its NIXL connector does
//! (`tests/v1/kv_connector/nixl_integration/toy_proxy_server.py` at vllm-project/vllm
//! 030ea52e), with the fields the connector reads
//! (`vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py` at 002a1057: a decode
//! request pulls only when `remote_block_ids`, `remote_engine_id`, `remote_host`,
//! `remote_port` — its NIXL side channel, not its HTTP address — and, in newer versions,
//! `remote_request_id` are all present).
//!
//! Failure modes, and what this module does about them:
//! - Blocks nobody pulls: P holds them for a lease and then frees them
//!   (`kv_lease_duration`, 30 s by default, in `kv_connector/v1/nixl/pull_scheduler.py` at
//!   0050936b and `docs/design/nixl_kv_cache_lease.md` at 0ade2c81; older versions used
//!   `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`). A prefill step given up (timeout, client gone) is
//!   dropped with its connection, so P aborts it when it is still running.
//! - A failed pull on D: `kv_load_failure_policy` (`vllm/config/kv_transfer.py`) is `fail`
//!   by default in current vLLM (`docs/features/nixl_connector_usage.md` at 026c83f9; it was
//!   `recompute` before), so D answers an error (500, or an error event in a stream already
//!   under way). P frees its blocks after the first read, and the router cannot tell whether a
//!   failed decode had read them, so a decode that fails before its first byte is never
//!   retried with the same params: the retry (on another decode backend, by the layer's
//!   ordinary retry policy) plans anew, with a new prefill step.
//! - Anything that goes wrong in step 1 (refused, 5xx, broken connection, timeout, an answer
//!   without usable params) serves the request colocated on `D` with the client's body: the
//!   client never sees the prefill failure. No prefill backend available: colocated too.
//!
//! `n > 1`, `best_of`, `echo`, `prompt_logprobs` and beam search stay colocated: the decode
//! engine never computes the prompt positions it pulls.
//!
//! A prompt whose whole estimate is within `threshold_tokens` can never be disaggregated, so
//! with `prefill_serves_short_prompts` (the default) the prefill backends are candidates for
//! it too ([`whole_request_roles`]): a P/D fleet keeps every server for short prompts instead
//! of leaving its prefill servers idle while the decode servers queue them. A vLLM server with
//! the NIXL connector (`kv_role: kv_both`) serves a request without `kv_transfer_params` as
//! any server does.

pub mod flow;

use std::time::Duration;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::config_error::ConfigError;
use crate::forward::json_object::{self, Members};
use crate::forward::kv_params::FIELD;
use crate::prompt::{Operation, RequestView, RoleScope};

/// The largest prefill answer read (a one-token completion is well under a kilobyte).
pub const MAX_PREFILL_RESPONSE: usize = 256 * 1024;

/// `[pd]`: prefill/decode disaggregation.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PdConfig {
    /// Send long prompts in two steps when the fleet has prefill backends (default false).
    pub enabled: bool,
    /// Disaggregate only when more prompt tokens than this are not cached on the decode
    /// backend.
    pub threshold_tokens: u64,
    /// Disaggregate only while the prefill pool's pending prefill tokens (sent, first token
    /// not yet seen) are below this; unset: no limit.
    pub max_prefill_queue_tokens: Option<u64>,
    /// The prefill step's whole answer must arrive within this, else the request runs
    /// colocated on the decode backend.
    pub prefill_timeout_ms: u64,
    /// The scheduling profile that picks the prefill backend (default: the active `profile`,
    /// which always picks the decode backend). Checked when the profiles are built.
    pub prefill_profile: Option<String>,
    /// Prefill backends also serve whole requests whose prompt is no longer than
    /// `threshold_tokens` (they can never be disaggregated), so short prompts keep the whole
    /// fleet (default true). Off: prefill backends take prefill steps only.
    pub prefill_serves_short_prompts: bool,
}

impl Default for PdConfig {
    fn default() -> Self {
        PdConfig {
            enabled: false,
            threshold_tokens: 512,
            max_prefill_queue_tokens: None,
            prefill_timeout_ms: 10_000,
            prefill_profile: None,
            prefill_serves_short_prompts: true,
        }
    }
}

impl PdConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.prefill_timeout_ms == 0 {
            return Err(ConfigError::invalid(
                "pd.prefill_timeout_ms",
                "must be greater than 0",
            ));
        }
        if self.max_prefill_queue_tokens == Some(0) {
            return Err(ConfigError::invalid(
                "pd.max_prefill_queue_tokens",
                "must be greater than 0 (leave it unset for no limit)",
            ));
        }
        Ok(())
    }

    pub fn prefill_timeout(&self) -> Duration {
        Duration::from_millis(self.prefill_timeout_ms)
    }
}

/// Which way a request went, the `path` label of `inferlb_pd_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Prefill on P, decode on D.
    Disaggregated,
    /// Not disaggregated by the rule (short prompt, ineligible request, busy prefill pool…).
    Local,
    /// Meant to be disaggregated, but the prefill step failed: colocated on D.
    Fallback,
}

impl Path {
    pub fn label(self) -> &'static str {
        match self {
            Path::Disaggregated => "disaggregated",
            Path::Local => "local",
            Path::Fallback => "fallback",
        }
    }
}

/// Count one request's path.
pub fn count(path: Path) {
    metrics::counter!(crate::telemetry::PD_REQUESTS, "path" => path.label()).increment(1);
}

/// Record one step's latency (`step` = `prefill` or `decode`).
pub fn record_step(step: &'static str, took: Duration) {
    metrics::histogram!(crate::telemetry::PD_STEP_DURATION, "step" => step)
        .record(took.as_secs_f64());
}

/// Whether the rule sends a request with `uncached` tokens missing on D in two steps, given
/// the prefill pool's pending prefill tokens.
pub fn wants_prefill(
    cfg: &PdConfig,
    uncached: u64,
    prefill_queue: u64,
) -> Result<(), &'static str> {
    if uncached <= cfg.threshold_tokens {
        return Err("below threshold_tokens");
    }
    if cfg
        .max_prefill_queue_tokens
        .is_some_and(|max| prefill_queue >= max)
    {
        return Err("prefill queue at max_prefill_queue_tokens");
    }
    Ok(())
}

/// The roles that may serve `view` whole: any backend when P/D is on and the prompt is too
/// short ever to be disaggregated (its whole estimate is within `threshold_tokens`) and
/// `prefill_serves_short_prompts` lets prefill backends take such requests; else decode and
/// both backends.
pub fn whole_request_roles(cfg: &PdConfig, view: &RequestView) -> RoleScope {
    if cfg.enabled
        && cfg.prefill_serves_short_prompts
        && operation_eligible(view)
        && view.estimated_prompt_tokens() <= cfg.threshold_tokens
    {
        RoleScope::WholeShort
    } else {
        RoleScope::Whole
    }
}

/// Only chat and completions can be disaggregated.
pub fn operation_eligible(view: &RequestView) -> bool {
    matches!(
        view.operation,
        Operation::ChatCompletions | Operation::Completions
    )
}

/// The params of the prefill step's request.
const PREFILL_PARAMS: &str = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// A client body's top-level members (parsed once per request by [`flow::plan`]).
pub type ClientMembers<'a> = [(String, &'a RawValue)];

/// Why a body is not sent in two steps (`None`: it can be). The decode backend never computes
/// the prompt positions it pulls, so `echo` and `prompt_logprobs` stay colocated, as do
/// several choices and beam search.
pub fn body_ineligible(members: &ClientMembers<'_>) -> Option<&'static str> {
    for (key, value) in members {
        let v = value.get().trim();
        let set = !matches!(v, "null" | "false");
        match key.as_str() {
            "n" | "best_of" if v != "1" && v != "null" => return Some("several choices"),
            "use_beam_search" if set => return Some("beam search"),
            "echo" if set => return Some("echo"),
            "prompt_logprobs" if set => return Some("prompt_logprobs"),
            _ => {}
        }
    }
    None
}

/// Step 1's body: the client's with the overrides of the module docs.
pub fn prefill_body(members: &ClientMembers<'_>) -> Bytes {
    let mut out: Vec<(&str, &str)> = Vec::with_capacity(members.len() + 3);
    let mut has_max_completion = false;
    for (key, value) in members {
        match key.as_str() {
            "stream" | "max_tokens" | "stream_options" | "min_tokens" | "min_completion_tokens" => {
            }
            k if k == FIELD => {}
            "max_completion_tokens" => has_max_completion = true,
            k => out.push((k, value.get())),
        }
    }
    out.push(("stream", "false"));
    out.push(("max_tokens", "1"));
    if has_max_completion {
        out.push(("max_completion_tokens", "1"));
    }
    out.push((FIELD, PREFILL_PARAMS));
    Bytes::from(json_object::write(out))
}

/// The `kv_transfer_params` of a prefill answer, as raw JSON, when it is a usable object
/// (`do_remote_prefill` true).
pub fn params_of_response(body: &[u8]) -> Option<String> {
    let Members(members) = Members::parse(body).ok()?;
    let (_, raw) = members.iter().find(|(k, _)| k == FIELD)?;
    let value: serde_json::Value = serde_json::from_str(raw.get()).ok()?;
    let usable = value
        .as_object()
        .is_some_and(|o| o.get("do_remote_prefill") == Some(&serde_json::Value::Bool(true)));
    usable.then(|| raw.get().to_owned())
}

/// Step 2's body: the client's with `params` (raw JSON) as its `kv_transfer_params`.
pub fn decode_body(members: &ClientMembers<'_>, params: &str) -> Bytes {
    let kept = members
        .iter()
        .filter(|(k, _)| k != FIELD)
        .map(|(k, v)| (k.as_str(), v.get()));
    Bytes::from(json_object::write(
        kept.chain(std::iter::once((FIELD, params))),
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::{json, Value};

    fn parse(b: &Bytes) -> Value {
        serde_json::from_slice(b).unwrap()
    }

    fn members(body: &[u8]) -> Vec<(String, &RawValue)> {
        Members::parse(body).unwrap().0
    }

    #[test]
    fn the_prefill_body_has_exactly_the_overrides() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":64,"max_completion_tokens":64,"min_tokens":3,"min_completion_tokens":2,"temperature":0.5,"kv_transfer_params":{"x":1}}"#;
        let out = parse(&prefill_body(&members(body)));
        assert_eq!(
            out,
            json!({"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0.5,
                   "stream":false,"max_tokens":1,"max_completion_tokens":1,
                   "kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,
                   "remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}})
        );
        let plain = parse(&prefill_body(&members(br#"{"prompt":"p"}"#)));
        assert!(plain.get("max_completion_tokens").is_none());
        assert_eq!(plain["max_tokens"], 1);
    }

    #[test]
    fn params_are_copied_verbatim() {
        let answer = br#"{"id":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[[0, 1]],"unknown":12345678901234567890123,"remote_port":5600}}"#;
        let params = params_of_response(answer).unwrap();
        assert_eq!(
            params,
            r#"{"do_remote_prefill":true,"remote_block_ids":[[0, 1]],"unknown":12345678901234567890123,"remote_port":5600}"#
        );
        let d = decode_body(
            &members(br#"{"model":"m","stream":true,"max_tokens":9}"#),
            &params,
        );
        assert_eq!(
            std::str::from_utf8(&d).unwrap(),
            format!(
                r#"{{"model":"m","stream":true,"max_tokens":9,"kv_transfer_params":{params}}}"#
            )
        );
        assert_eq!(params_of_response(br#"{"kv_transfer_params":null}"#), None);
        assert_eq!(params_of_response(br#"{"id":1}"#), None);
        assert_eq!(params_of_response(b"not json"), None);
        assert_eq!(
            params_of_response(br#"{"kv_transfer_params":{"do_remote_prefill":false}}"#),
            None
        );
    }

    #[test]
    fn what_stays_colocated() {
        assert_eq!(body_ineligible(&members(br#"{"n":1,"echo":false}"#)), None);
        assert_eq!(
            body_ineligible(&members(br#"{"n":2}"#)),
            Some("several choices")
        );
        assert_eq!(body_ineligible(&members(br#"{"echo":true}"#)), Some("echo"));
        assert_eq!(
            body_ineligible(&members(br#"{"prompt_logprobs":1}"#)),
            Some("prompt_logprobs")
        );
        assert_eq!(
            body_ineligible(&members(br#"{"use_beam_search":true}"#)),
            Some("beam search")
        );
    }

    #[test]
    fn the_rule() {
        let cfg = PdConfig {
            threshold_tokens: 100,
            max_prefill_queue_tokens: Some(1000),
            ..PdConfig::default()
        };
        assert!(wants_prefill(&cfg, 100, 0).is_err());
        assert!(wants_prefill(&cfg, 101, 999).is_ok());
        assert!(wants_prefill(&cfg, 101, 1000).is_err());
        assert!(PdConfig::default().validate().is_ok());
        assert!(PdConfig {
            prefill_timeout_ms: 0,
            ..PdConfig::default()
        }
        .validate()
        .is_err());
    }

    #[test]
    fn which_roles_serve_a_whole_request() {
        let cfg = PdConfig {
            enabled: true,
            threshold_tokens: 100,
            ..PdConfig::default()
        };
        let view = |op, chars: usize| {
            let mut v = RequestView::parse(Operation::Completions, br#"{"prompt":"x"}"#).unwrap();
            v.operation = op;
            v.routing_text = Some("x".repeat(chars));
            v
        };
        // 400 characters ≈ 100 tokens: within the threshold, so never disaggregated.
        let short = view(Operation::Completions, 400);
        let long = view(Operation::Completions, 404);
        assert_eq!(whole_request_roles(&cfg, &short), RoleScope::WholeShort);
        assert_eq!(whole_request_roles(&cfg, &long), RoleScope::Whole);
        let other = view(Operation::Other, 4);
        assert_eq!(whole_request_roles(&cfg, &other), RoleScope::Whole);
        for off in [
            PdConfig {
                enabled: false,
                ..cfg.clone()
            },
            PdConfig {
                prefill_serves_short_prompts: false,
                ..cfg.clone()
            },
        ] {
            assert_eq!(whole_request_roles(&off, &short), RoleScope::Whole);
        }
    }
}
