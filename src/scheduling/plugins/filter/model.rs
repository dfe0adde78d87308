//! `model-filter`: keeps only backends whose `/v1/models` lists the requested model
//! (base models and LoRA adapters alike). A request without `model` keeps every backend,
//! as vLLM then serves its default model. A request pinned to one backend (the holder of the
//! response it names, `pinned-filter`) keeps it whatever it serves: that backend answers for
//! the model itself, as one vLLM would, rather than the router refusing the call for ever as
//! unavailable. Always part of every profile.

use std::sync::Arc;

use crate::endpoints::Candidate;
use crate::prompt::RequestView;
use crate::scheduling::framework::{Filter, Plugin, Rejection};
use crate::scheduling::plugins::identity;

pub struct ModelFilter {
    name: Arc<str>,
}

impl ModelFilter {
    pub const TYPE: &'static str = "model-filter";

    pub fn new(name: &str) -> Self {
        ModelFilter { name: name.into() }
    }
}

impl Plugin for ModelFilter {
    identity!();
}

impl Filter for ModelFilter {
    fn filter(&self, request: &RequestView, candidates: &mut Vec<Candidate<'_>>) {
        if request.pinned.is_some() {
            return;
        }
        if let Some(model) = request.model.as_deref() {
            candidates.retain(|c| c.state.serves(model));
        }
    }

    fn when_empty(&self) -> Rejection {
        Rejection::ModelNotServed
    }
}
