//! `pinned-filter`: a request pinned to one backend ([`RequestView::pinned`], by name) keeps
//! only that backend. The front door pins the Responses API's calls that name a response to
//! the backend holding it (`crate::responses`): any other backend would answer that it does
//! not know the id. Always part of every profile, after the health, model and role filters,
//! so a pinned request whose holder is unhealthy finds no candidate and is refused as
//! unavailable (503) rather than sent elsewhere; after a failed attempt (the holder excluded)
//! the retry finds none either, and the client gets the holder's own answer. Unpinned
//! requests pass untouched.
//!
//! Inputs: `RequestView::pinned`, `Backend::name`.

use std::sync::Arc;

use crate::endpoints::Candidate;
use crate::prompt::RequestView;
use crate::scheduling::framework::{Filter, Plugin, Rejection};
use crate::scheduling::plugins::identity;

pub struct PinnedFilter {
    name: Arc<str>,
}

impl PinnedFilter {
    pub const TYPE: &'static str = "pinned-filter";

    pub fn new(name: &str) -> Self {
        PinnedFilter { name: name.into() }
    }
}

impl Plugin for PinnedFilter {
    identity!();
}

impl Filter for PinnedFilter {
    fn filter(&self, request: &RequestView, candidates: &mut Vec<Candidate<'_>>) {
        if let Some(pinned) = &request.pinned {
            candidates.retain(|c| *c.backend.name == **pinned);
        }
    }

    fn when_empty(&self) -> Rejection {
        Rejection::Unavailable
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::endpoints::test_support::{candidates, healthy_backends};
    use crate::prompt::Operation;

    #[test]
    fn only_the_pinned_backend_stays() {
        let backends = healthy_backends(3);
        let f = PinnedFilter::new(PinnedFilter::TYPE);
        let mut view = RequestView::parse(Operation::Other, b"{}").unwrap();
        let mut all = candidates(&backends);
        f.filter(&view, &mut all);
        assert_eq!(all.len(), 3, "unpinned: untouched");
        view.pinned = Some(Arc::from(backends[1].name.as_str()));
        let mut one = candidates(&backends);
        f.filter(&view, &mut one);
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].backend.id, backends[1].id);
        view.pinned = Some(Arc::from("http://gone:1"));
        let mut none = candidates(&backends);
        f.filter(&view, &mut none);
        assert!(none.is_empty());
    }
}
