//! `role-filter`: keeps only backends that serve whole requests, i.e. whose prefill/decode
//! role is `decode` or `both`. A `prefill` backend is meant for the prefill leg of a
//! disaggregated request (prompt in, KV cache out, one token, see `crate::pd`), so an ordinary
//! request must never land there, and the prefill step ([`RequestView::prefill_leg`]) only
//! there. Always part of every profile, after the health and model filters: when only prefill
//! backends serve the model, the request is refused as unavailable (503).
//!
//! Inputs: `Backend::role` (from `role` in `[[backends]]`, discovery's `backend_defaults`, a
//! file entry, or the Kubernetes role label).

use std::sync::Arc;

use crate::endpoints::{BackendRole, Candidate};
use crate::prompt::RequestView;
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
        if request.prefill_leg {
            candidates.retain(|c| c.backend.role == BackendRole::Prefill);
        } else {
            candidates.retain(|c| c.backend.role.serves_whole_requests());
        }
    }

    fn when_empty(&self) -> Rejection {
        Rejection::Unavailable
    }
}
