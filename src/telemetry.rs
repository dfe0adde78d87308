//! inferlb's own Prometheus metrics and logging set-up.
//!
//! Metric names live here as constants so the README's metrics reference can be checked
//! against one list. The recorder is process-global (the `metrics` facade is), so it is
//! installed once and every router in the process — tests start several — shares it.
//!
//! It owns the `log_format` key ([`LogFormat`]).

use std::sync::OnceLock;

use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use metrics_util::MetricKindMask;

pub mod handles;
pub mod line;
pub mod log_writer;

/// The `model` label of requests whose model no backend lists (or that name none): a client's
/// string never becomes a label, so clients cannot grow the number of series.
pub const OTHER_MODEL: &str = "other";

pub const REQUESTS_TOTAL: &str = "inferlb_requests_total";
pub const REQUEST_DURATION: &str = "inferlb_request_duration_seconds";
pub const TIME_TO_FIRST_BYTE: &str = "inferlb_time_to_first_byte_seconds";
pub const SCHEDULING_DURATION: &str = "inferlb_scheduling_duration_seconds";
pub const UPSTREAM_RESPONSES: &str = "inferlb_upstream_responses_total";
pub const STREAMS_INTERRUPTED: &str = "inferlb_streams_interrupted_total";
pub const UPSTREAM_ATTEMPT_FAILURES: &str = "inferlb_upstream_attempt_failures_total";
pub const CLIENT_DISCONNECTS: &str = "inferlb_client_disconnects_total";
pub const UPSTREAM_CONNECTIONS_OPENED: &str = "inferlb_upstream_connections_opened_total";
pub const BACKEND_HEALTHY: &str = "inferlb_backend_healthy";
pub const BACKEND_INFO: &str = "inferlb_backend_info";
pub const BACKEND_INFLIGHT: &str = "inferlb_backend_inflight";
pub const BACKEND_EJECTED: &str = "inferlb_backend_ejected";
pub const BACKEND_EJECTIONS: &str = "inferlb_backend_ejections_total";
pub const BACKEND_KV_USAGE: &str = "inferlb_backend_kv_cache_usage_ratio";
pub const BACKEND_CHARS_PER_TOKEN: &str = "inferlb_backend_chars_per_token";
pub const BACKEND_TRAFFIC_SHARE: &str = "inferlb_backend_traffic_share";
pub const BACKEND_WAITING: &str = "inferlb_backend_waiting_requests";
pub const BACKEND_RUNNING: &str = "inferlb_backend_running_requests";
pub const BACKEND_SCRAPE_ERRORS: &str = "inferlb_backend_scrape_errors_total";
pub const BACKEND_SCRAPE_DURATION: &str = "inferlb_backend_scrape_duration_seconds";
pub const PREFIX_INDEX_BLOCKS: &str = "inferlb_prefix_index_blocks";
pub const CONFIG_RELOADS: &str = "inferlb_config_reloads_total";
pub const DISCOVERY_ERRORS: &str = "inferlb_discovery_errors_total";
pub const TOKENIZE_SKIPPED_TOTAL: &str = "inferlb_tokenize_skipped_total";
pub const TOKENIZE_DURATION: &str = "inferlb_tokenize_duration_seconds";
pub const TOKENIZE_TOKENS: &str = "inferlb_tokenize_tokens_total";
pub const BACKENDS: &str = "inferlb_backends";
pub const REQUESTS_QUEUED: &str = "inferlb_requests_queued";
pub const QUEUE_WAIT: &str = "inferlb_queue_wait_seconds";
pub const QUEUED_BY_CLASS: &str = "inferlb_requests_queued_by_class";
pub const QUEUE_SHED: &str = "inferlb_queue_shed_total";
pub const PREFIX_MATCH_RATIO: &str = "inferlb_prefix_match_ratio";
pub const PREFIX_REPLICAS: &str = "inferlb_prefix_replicas_total";
pub const PREFIX_OVERFLOWS: &str = "inferlb_prefix_overflows_total";
pub const PREFIX_RETURNS: &str = "inferlb_prefix_returns_total";
pub const PREFIX_THRASH: &str = "inferlb_prefix_thrash_ratio";
pub const CONNECTIONS_REFUSED: &str = "inferlb_connections_refused_total";
pub const KV_STREAMS: &str = "inferlb_kv_event_streams";
pub const KV_EVENT_MESSAGES: &str = "inferlb_kv_event_messages_total";
pub const KV_EVENT_ERRORS: &str = "inferlb_kv_event_errors_total";
pub const KV_EVENT_GAPS: &str = "inferlb_kv_event_gaps_total";
pub const KV_EVENT_RESETS: &str = "inferlb_kv_event_resets_total";
pub const KV_PRECISE_DECISIONS: &str = "inferlb_prefix_precise_candidates_total";
pub const KV_TRANSFER_PARAMS_STRIPPED: &str = "inferlb_kv_transfer_params_stripped_total";
pub const PD_REQUESTS: &str = "inferlb_pd_requests_total";
pub const PD_STEP_DURATION: &str = "inferlb_pd_step_duration_seconds";
pub const RESPONSES_AFFINITY: &str = "inferlb_responses_affinity_total";
pub const RESPONSES_LOOKUP_DURATION: &str = "inferlb_responses_lookup_duration_seconds";
pub const RESPONSES_IDS: &str = "inferlb_responses_ids";

/// Every series inferlb exports, with its help text (also the README's reference).
pub const DESCRIPTIONS: &[(&str, &str)] = &[
    (REQUESTS_TOTAL, "Client requests answered, once each, by backend, model and final HTTP status code (backend=\"none\" when none answered; model=\"other\" when no backend lists the requested model)."),
    (UPSTREAM_RESPONSES, "Responses received from backends, per attempt (retries count again), by backend and status code."),
    (STREAMS_INTERRUPTED, "Responses whose body broke after the headers (cut, idle or over time), by backend."),
    (REQUEST_DURATION, "Time from receiving a request to the end of its response body, by backend and model."),
    (TIME_TO_FIRST_BYTE, "Time from receiving a request to the first response body byte from the backend, by backend and model."),
    (SCHEDULING_DURATION, "Time spent choosing a backend for one request."),
    (UPSTREAM_ATTEMPT_FAILURES, "Forwarding attempts that failed before a response, by backend and reason."),
    (CLIENT_DISCONNECTS, "Responses abandoned by the client before their body ended, by backend."),
    (UPSTREAM_CONNECTIONS_OPENED, "TCP connections opened to backends, for requests and scrapes; far below the request rate when keep-alive works."),
    (BACKEND_INFO, "1 per member backend; its role label is the backend's prefill/decode role (prefill, decode or both)."),
    (BACKEND_HEALTHY, "1 when the backend passes the poller's active health check, 0 when it does not."),
    (BACKEND_EJECTED, "1 while outlier detection has the backend ejected or on probation (one probe request at a time), else 0."),
    (BACKEND_EJECTIONS, "Passive ejections of the backend by outlier detection (consecutive failures of real requests)."),
    (BACKEND_INFLIGHT, "Requests inferlb has in flight to the backend."),
    (BACKEND_KV_USAGE, "The backend's KV-cache usage (0-1) from its last scrape."),
    (BACKEND_CHARS_PER_TOKEN, "Routing-text bytes per prompt token the backend counted, measured from its prefix_cache_queries counter (absent until 8,192 tokens are counted); sizes the prefix index's record of its cache."),
    (BACKEND_TRAFFIC_SHARE, "This router's share (0-1) of the requests the backend finished (its vllm:request_success counter), once 16 are counted: 1 alone on the backend, 1/N for each of N replicas behind a round-robin front; scales the chars-per-token figure and the prefix scorer's traffic thresholds."),
    (BACKEND_WAITING, "Requests waiting in the backend's queue at its last scrape."),
    (BACKEND_RUNNING, "Requests running on the backend at its last scrape."),
    (BACKEND_SCRAPE_ERRORS, "Failed or unusable /metrics scrapes, by backend and kind (connect, status, timeout, parse)."),
    (BACKEND_SCRAPE_DURATION, "Duration of /metrics scrapes, by backend."),
    (CONFIG_RELOADS, "Configuration reloads (SIGHUP or a change of the --config file), by result (ok, error)."),
    (DISCOVERY_ERRORS, "Discovery passes that failed (the last good backend set is kept), by source."),
    (TOKENIZE_SKIPPED_TOTAL, "Requests for a model with a tokenizer that were routed without token ids, by reason (unsupported, invalid, no_chat_template, template, tokenizer; no_live_stream: no backend had a live KV-event stream, so tokenizing was skipped; too_long: the body exceeded tokenization.max_body_bytes)."),
    (TOKENIZE_DURATION, "Time to compute one request's prompt token ids (render the chat template, tokenize), by operation (chat, completions)."),
    (TOKENIZE_TOKENS, "Prompt token ids computed for requests, by where they came from (prefix_cache: a cached prefix of an earlier request; tokenizer: tokenized for this request)."),
    (BACKENDS, "Backends in the pool, by state (healthy, unhealthy, ejected, draining)."),
    (REQUESTS_QUEUED, "Requests waiting in the router's queue for capacity (router-wide limit or a per-backend in-flight slot)."),
    (QUEUE_WAIT, "Time requests waited in the router's queue for a backend slot before being dispatched or refused, by priority class."),
    (QUEUED_BY_CLASS, "Requests waiting for a backend slot, by priority class."),
    (QUEUE_SHED, "Requests refused by the capacity queue with 429, by priority class and reason (full: the queue was full and nothing less deserving could be shed; displaced: shed for a higher-class or lighter-tenant arrival; deadline: the class's queue timeout passed)."),
    (PREFIX_INDEX_BLOCKS, "Prompt blocks held in the prefix index, over all backends."),
    (PREFIX_MATCH_RATIO, "Fraction of a request's prompt blocks found on the backend it was sent to."),
    (PREFIX_REPLICAS, "Requests sent to a backend as a new replica of their hot prefix (prefix-cache-scorer replicate_share)."),
    (PREFIX_OVERFLOWS, "Requests sent to a backend holding part of their prefix because every backend holding more was over its load bound (prefix-cache-scorer replicate_overload)."),
    (PREFIX_RETURNS, "Requests whose prompt prefix came back after the backend holding the most of it had evicted the next block (by the router's record of what it sent each backend)."),
    (PREFIX_THRASH, "Share of recent prompt tokens (one-minute half-life) whose prefix came back after a cache had evicted it: the fleet's caches are too small for their working set when this is high."),
    (CONNECTIONS_REFUSED, "Client connections closed on arrival because the listener was at limits.max_connections."),
    (KV_STREAMS, "Member backends by KV-event stream status (off, live, unsure, silent); only live streams are used for precise prefix scoring."),
    (KV_EVENT_MESSAGES, "KV-event messages applied (live and replayed), over all backends."),
    (KV_EVENT_ERRORS, "KV-event messages dropped, by kind (frames, too_large, decode)."),
    (KV_EVENT_GAPS, "Gaps in a backend's KV-event sequence (lost messages), replayed or not."),
    (KV_EVENT_RESETS, "KV-event sequences that went backwards (engine restarts): that backend's block store was cleared."),
    (KV_TRANSFER_PARAMS_STRIPPED, "Client requests whose own top-level kv_transfer_params was removed before forwarding (forward.allow_client_kv_transfer_params is off)."),
    (PD_REQUESTS, "Chat and completions requests while [pd] is enabled with prefill backends, by path (disaggregated: prefill and decode on two backends; local: colocated by the rule; fallback: the prefill step failed, served colocated)."),
    (PD_STEP_DURATION, "Time of one step of a disaggregated request, by step (prefill: until the prefill answer is read; decode: until the decode backend's response head)."),
    (RESPONSES_AFFINITY, "Responses API calls naming a response (previous_response_id, /v1/responses/{id}...), by how its backend was found (known: the id table; found: a lookup; not_found: nobody has it, answered 404; unresolved: a lookup could not ask every backend, answered 503)."),
    (RESPONSES_LOOKUP_DURATION, "Time of one lookup of an unknown response id across the fleet (GET /v1/responses/{id} to the schedulable backends)."),
    (RESPONSES_IDS, "Response ids in the router's table (id -> holding backend), approximate."),
    (KV_PRECISE_DECISIONS, "Candidates scored by the prefix scorer, by source (precise: from the backend's KV events; approximate: from the router's own index)."),
];

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Install the global recorder once; later calls return the same handle. Gauges not set for
/// `idle` disappear from `/metrics`: the poller refreshes every member backend's gauges on each
/// pass, so only the series of backends that left the pool go (no ghosts on dashboards);
/// counters and histograms keep their history.
pub fn prometheus(idle: Duration) -> Option<PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let latency = [
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                60.0, 120.0, 300.0,
            ];
            let micro = [
                0.000_001,
                0.000_002_5,
                0.000_005,
                0.000_01,
                0.000_025,
                0.000_05,
                0.000_1,
                0.000_25,
                0.000_5,
                0.001,
                0.005,
            ];
            let tokenize = [
                0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005,
                0.01, 0.025, 0.05, 0.1,
            ];
            let ratio = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0];
            let builder = PrometheusBuilder::new()
                .idle_timeout(MetricKindMask::GAUGE, Some(idle))
                .set_buckets_for_metric(Matcher::Full(SCHEDULING_DURATION.into()), &micro)
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(PREFIX_MATCH_RATIO.into()), &ratio)
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(TOKENIZE_DURATION.into()), &tokenize)
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &latency)
                })
                .ok()?;
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder).ok()?;
            for (name, help) in DESCRIPTIONS {
                metrics::describe_counter!(*name, *help);
            }
            Some(handle)
        })
        .clone()
}

/// Set up `tracing` output; a second call (tests) is a no-op. Text is ANSI-styled only when
/// stdout is a terminal and `NO_COLOR` is not set (a log file gets no escape codes).
pub fn init_logging(format: LogFormat, filter: &str) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = std::io::stdout().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(log_writer::BufferedStdout)
        .with_ansi(ansi)
        .with_target(false);
    let installed = match format {
        // JSON lines name their target (`inferlb::access` for the access log) for log pipelines.
        LogFormat::Json => builder.with_target(true).json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
    if installed.is_ok() {
        line::set_style(match format {
            LogFormat::Json => line::Style::Json,
            LogFormat::Text if ansi => line::Style::TextAnsi,
            LogFormat::Text => line::Style::Text,
        });
    }
}

/// How logs are written.
#[derive(Debug, Clone, Copy, Default, serde::Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[cfg(test)]
mod tests {
    /// The README's metrics table lists every series inferlb exports, and nothing else.
    #[test]
    fn the_readme_lists_every_series() {
        let readme = include_str!("../README.md");
        let table: Vec<&str> = readme
            .split("\n## Metrics\n")
            .nth(1)
            .and_then(|rest| rest.split("\n## ").next())
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.strip_prefix("| `")?.split('`').next())
            .collect();
        let exported: Vec<&str> = super::DESCRIPTIONS.iter().map(|(name, _)| *name).collect();
        let missing: Vec<&&str> = exported.iter().filter(|n| !table.contains(n)).collect();
        let extra: Vec<&&str> = table.iter().filter(|n| !exported.contains(n)).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "README metrics table: missing {missing:?}, not exported {extra:?}"
        );
    }
}
