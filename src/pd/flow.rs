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
use crate::forward::json_object::Members;
use crate::forward::{Dispatch, ProxyRequest};
use crate::prompt::RoleScope;
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
    /// P/D does not apply: the request goes to the decode pick as it is.
    pub fn unchanged(request: &Arc<ProxyRequest>) -> Self {
        Plan {
            request: Arc::clone(request),
            path: None,
        }
    }
}

/// The path this attempt took, as `inferlb_pd_requests_total` and the request's trace (the
/// explain header, the access log) report it.
fn took(path: Path, reason: &'static str, prefill: Option<&Backend>) {
    count(path);
    decisions::note_pd(PdStep {
        path: path.label(),
        reason,
        prefill_backend: prefill.map(|b| b.name.clone()),
    });
}

/// Decide and, when the rule says so, run step 1 on a prefill backend. Never fails: every
/// problem of step 1 is a colocated (`fallback`) plan. `decode_guard` holds the attempt's
/// decode backend, already charged by [`Scheduler::sent`] with the prompt tokens it lacks.
pub async fn plan<S>(
    cfg: &PdConfig,
    scheduler: &Scheduler,
    inner: S,
    request: &Arc<ProxyRequest>,
    decode_guard: &mut InflightGuard,
) -> Plan
where
    S: Service<Dispatch, Response = Response<Body>, Error = Error> + Clone + Send + 'static,
    S::Future: Send,
{
    if !cfg.enabled || !operation_eligible(&request.view) {
        return Plan::unchanged(request);
    }
    // The prefill backends' pending prompt tokens, and whether there are any.
    let (prefill_backends, queued) = scheduler
        .pool()
        .backends()
        .iter()
        .filter(|b| b.role == BackendRole::Prefill)
        .fold((0usize, 0u64), |(n, sum), b| {
            (n + 1, sum.saturating_add(b.work().prefill_tokens()))
        });
    if prefill_backends == 0 {
        return Plan::unchanged(request);
    }
    let decode = Arc::clone(decode_guard.backend());
    let local = |reason: &'static str| {
        tracing::debug!(decode = %decode.name, reason, "colocated by the P/D rule");
        took(Path::Local, reason, None);
        Plan {
            request: Arc::clone(request),
            path: Some(Path::Local),
        }
    };
    if decode.role == BackendRole::Prefill {
        return local("short prompt served whole on a prefill backend");
    }
    // The client's body, split once for the checks and both steps' bodies.
    let Ok(Members(members)) = Members::parse(&request.body) else {
        return local("body is not a JSON object");
    };
    if let Some(reason) = body_ineligible(&members) {
        return local(reason);
    }
    let view = &request.view;
    let uncached = decode_guard
        .charged_uncached()
        .unwrap_or_else(|| view.estimated_prompt_tokens());
    if let Err(reason) = wants_prefill(cfg, uncached, queued) {
        return local(reason);
    }
    // The prefill step: the prefill profile (or the active one), prefill backends only.
    let mut prefill_view = (**view).clone();
    prefill_view.roles = RoleScope::PrefillStep;
    let prefill_view = Arc::new(prefill_view);
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
    let dispatch = Dispatch {
        request: Arc::new(request.with_body(prefill_body(&members), prefill_view)),
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
    match outcome {
        Ok(params) => {
            decode_guard.prefilled_elsewhere();
            took(
                Path::Disaggregated,
                "uncached tokens above threshold_tokens",
                Some(&backend),
            );
            let body = decode_body(&members, &params);
            Plan {
                request: Arc::new(request.with_body(body, Arc::clone(&request.view))),
                path: Some(Path::Disaggregated),
            }
        }
        Err(reason) => {
            tracing::warn!(prefill = %backend.name, decode = %decode.name, reason, "serving colocated");
            took(Path::Fallback, reason, Some(&backend));
            Plan {
                request: Arc::clone(request),
                path: Some(Path::Fallback),
            }
        }
    }
}
