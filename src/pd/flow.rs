//! Step 1 of a disaggregated request, run by the scheduling layer just before it sends an
//! attempt to its decode backend: decide, send the prefill step, and hand back the request to
//! send instead (the decode step, or the client's own for the colocated path).

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use http::Response;
use http_body_util::BodyExt;
use tower::{Service, ServiceExt};

use super::{
    body_ineligible, count, decode_body, operation_eligible, params_of_response, prefill_body,
    record_step, wants_prefill, Path, PdConfig, MAX_PREFILL_RESPONSE,
};
use crate::endpoints::{Backend, BackendRole};
use crate::error::Error;
use crate::forward::{Dispatch, ProxyRequest};
use crate::scheduling::framework::CycleState;
use crate::scheduling::profile::decisions::{self, PdStep};
use crate::scheduling::{InflightGuard, Scheduler};

/// What [`plan`] decided for one attempt.
pub struct Plan {
    /// What to send to the decode backend.
    pub request: Arc<ProxyRequest>,
    /// `None`: P/D does not apply (disabled, no prefill backends, another operation).
    pub path: Option<Path>,
}

impl Plan {
    fn unchanged(request: &Arc<ProxyRequest>) -> Self {
        Plan {
            request: Arc::clone(request),
            path: None,
        }
    }
}

/// Decide and, when the rule says so, run step 1 on a prefill backend. Never fails: every
/// problem of step 1 is a colocated (`fallback`) plan. `state` is the request's cycle state
/// after `decode` was picked (its prompt-work estimate gives the uncached tokens).
pub async fn plan<S>(
    cfg: &PdConfig,
    scheduler: &Scheduler,
    inner: S,
    request: &Arc<ProxyRequest>,
    state: &CycleState,
    decode_guard: &mut InflightGuard,
) -> Plan
where
    S: Service<Dispatch, Response = Response<Body>, Error = Error> + Clone + Send + 'static,
    S::Future: Send,
{
    let decode = Arc::clone(decode_guard.backend());
    if !cfg.enabled || !operation_eligible(&request.view) {
        return Plan::unchanged(request);
    }
    let members = scheduler.pool().backends();
    let prefill_pool: Vec<&Arc<Backend>> = members
        .iter()
        .filter(|b| b.role == BackendRole::Prefill)
        .collect();
    if prefill_pool.is_empty() {
        return Plan::unchanged(request);
    }
    let local = |reason: &'static str| {
        tracing::debug!(decode = %decode.name, reason, "colocated by the P/D rule");
        count(Path::Local);
        decisions::note_pd(PdStep {
            path: Path::Local.label(),
            reason,
            prefill_backend: None,
        });
        Plan {
            request: Arc::clone(request),
            path: Some(Path::Local),
        }
    };
    if let Some(reason) = body_ineligible(&request.body) {
        return local(reason);
    }
    let view = &request.view;
    let uncached = scheduler
        .profile()
        .plugins()
        .find_map(|p| p.prompt_work(view, state, &decode))
        .map_or_else(|| view.estimated_prompt_tokens(), |w| w.uncached);
    let queued = prefill_pool
        .iter()
        .fold(0u64, |sum, b| sum.saturating_add(b.work().prefill_tokens()));
    if let Err(reason) = wants_prefill(cfg, uncached, queued) {
        return local(reason);
    }
    // The prefill step is scheduled by the same profile, narrowed to prefill backends.
    let mut prefill_view = (**view).clone();
    prefill_view.prefill_leg = true;
    let prefill_view = Arc::new(prefill_view);
    let Some(body) = prefill_body(&request.body) else {
        return local("body is not a JSON object");
    };
    // Its own trace: the request's explain header and access log keep the decode pick.
    let picked = decisions::aside(|| {
        let mut prefill_state = CycleState::default();
        let mut guard = scheduler
            .schedule(&prefill_view, &mut prefill_state, &[])
            .ok()?;
        scheduler.sent(&prefill_view, &prefill_state, &mut guard);
        Some(guard)
    });
    let Some(guard) = picked else {
        return local("no prefill backend available");
    };
    let backend = Arc::clone(guard.backend());
    let step = ProxyRequest {
        method: request.method.clone(),
        path_and_query: request.path_and_query.clone(),
        headers: request.headers.clone(),
        body,
        view: prefill_view,
        request_id: request.request_id.clone(),
        received_at: request.received_at,
    };
    let dispatch = Dispatch {
        request: Arc::new(step),
        backend: Arc::clone(&backend),
        guard,
    };
    let started = Instant::now();
    // Dropping this future (client gone, timeout) closes the prefill connection, which makes
    // vLLM abort the request and free its blocks.
    let exchange = async {
        let response = inner.oneshot(dispatch).await.map_err(|e| {
            tracing::warn!(backend = %backend.name, error = %e, "prefill step failed");
            "prefill step failed"
        })?;
        if !response.status().is_success() {
            tracing::warn!(backend = %backend.name, status = %response.status(), "prefill step refused");
            return Err("prefill step answered an error");
        }
        let body = http_body_util::Limited::new(response.into_body(), MAX_PREFILL_RESPONSE)
            .collect()
            .await
            .map_err(|_| "prefill answer unreadable or too large")?
            .to_bytes();
        params_of_response(&body).ok_or("prefill answer without usable kv_transfer_params")
    };
    let outcome = match tokio::time::timeout(cfg.prefill_timeout(), exchange).await {
        Ok(outcome) => outcome,
        Err(_) => Err("prefill step timed out (pd.prefill_timeout_ms)"),
    };
    record_step("prefill", started.elapsed());
    let decode_request = outcome
        .and_then(|params| decode_body(&request.body, &params).ok_or("body is not a JSON object"));
    match decode_request {
        Ok(body) => {
            decode_guard.prefilled_elsewhere();
            count(Path::Disaggregated);
            decisions::note_pd(PdStep {
                path: Path::Disaggregated.label(),
                reason: "uncached tokens above threshold_tokens",
                prefill_backend: Some(backend.name.clone()),
            });
            let step = ProxyRequest {
                method: request.method.clone(),
                path_and_query: request.path_and_query.clone(),
                headers: request.headers.clone(),
                body,
                view: Arc::clone(&request.view),
                request_id: request.request_id.clone(),
                received_at: request.received_at,
            };
            Plan {
                request: Arc::new(step),
                path: Some(Path::Disaggregated),
            }
        }
        Err(reason) => {
            tracing::warn!(prefill = %backend.name, decode = %decode.name, reason, "serving colocated");
            count(Path::Fallback);
            decisions::note_pd(PdStep {
                path: Path::Fallback.label(),
                reason,
                prefill_backend: Some(backend.name.clone()),
            });
            Plan {
                request: Arc::clone(request),
                path: Some(Path::Fallback),
            }
        }
    }
}
