//! `role-filter`: keeps the backends whose prefill/decode role may take the request, by its
//! [`RoleScope`]: a whole request goes to `decode` and `both` backends; the prefill step of a
//! disaggregated request (prompt in, KV cache out, one token, see `crate::pd`) to `prefill`
//! backends only; a whole request whose prompt is too short ever to be disaggregated
//! (`pd.prefill_serves_short_prompts`, set by the scheduling layer) to any of the three, so a
//! P/D fleet keeps all its servers for short prompts. Always part of every profile, after the
//! health and model filters: when no backend of an allowed role serves the model, the request
//! is refused as unavailable (503).
//!
//! Inputs: `Backend::role` (from `role` in `[[backends]]`, discovery's `backend_defaults`, a
//! file entry, or the Kubernetes role label).

use std::sync::Arc;

use crate::endpoints::{BackendRole, Candidate};
use crate::prompt::{RequestView, RoleScope};
use crate::scheduling::framework::{Filter, Plugin, Rejection};
use crate::scheduling::plugins::identity;

pub struct RoleFilter {
    name: Arc<str>,
}

impl RoleFilter {
    pub const TYPE: &'static str = "role-filter";

    pub fn new(name: &str) -> Self {
        RoleFilter { name: name.into() }
    }
}

impl Plugin for RoleFilter {
    identity!();
}

impl Filter for RoleFilter {
    fn filter(&self, request: &RequestView, candidates: &mut Vec<Candidate<'_>>) {
        match request.roles {
            RoleScope::Whole => candidates.retain(|c| c.backend.role.serves_whole_requests()),
            RoleScope::PrefillStep => {
                candidates.retain(|c| c.backend.role == BackendRole::Prefill);
            }
            RoleScope::WholeShort => {}
        }
    }

    fn when_empty(&self) -> Rejection {
        Rejection::Unavailable
    }
}
