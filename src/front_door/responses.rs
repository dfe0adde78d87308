//! The front door's part of the Responses API's affinity (`crate::responses`): which
//! response a call names, pinning it to the holder, the lookup's probes, and learning the id
//! a creating answer carries.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::http::{header, HeaderMap, Method, Response};
use bytes::Bytes;
use tower::ServiceExt;

use super::{new_request_id, AppState};
use crate::endpoints::capacity::Slot;
use crate::endpoints::Backend;
use crate::error::Error;
use crate::forward::{Dispatch, ProxyRequest};
use crate::prompt::responses::{invalid_id, valid_id};
use crate::prompt::{Operation, RequestView};
use crate::responses::lookup::Probe;
use crate::responses::Found;

/// The prefix of the routes on one response.
pub const BY_ID_PREFIX: &str = "/v1/responses/";

/// Marks a request that came in on a route of one response (`/v1/responses/{id}…`): its path
/// names the response. Set by that route's handler; the other routes under the prefix
/// (vLLM's `compact`, `render`) name none.
#[derive(Debug, Clone, Copy)]
pub struct ById;

/// The `{id}` of `/v1/responses/{id}[/…]`, from the raw path (not percent-decoded: an id with
/// an escape is refused, never decoded into something else).
pub fn id_in_path(path: &str) -> Result<&str, Error> {
    let rest = path.strip_prefix(BY_ID_PREFIX).unwrap_or_default();
    let id = rest.split('/').next().unwrap_or_default();
    if valid_id(id) {
        Ok(id)
    } else {
        Err(invalid_id("response_id"))
    }
}

/// Pin `view` to the backend holding `id`: vLLM's not-found error when nobody has it, 503
/// when that cannot be told now.
pub async fn pin(
    app: &AppState,
    id: &str,
    headers: &HeaderMap,
    view: &mut RequestView,
) -> Result<(), Error> {
    let members = app.pool.backends();
    let found = app
        .responses
        .holder(id, &members, |backend| probe(app, backend, id, headers))
        .await;
    match found {
        Found::Holder(backend) => {
            view.pinned = Some(Arc::from(backend.name.as_str()));
            Ok(())
        }
        Found::Absent => Err(Error::ResponseNotFound(id.to_owned())),
        Found::Unresolved => Err(Error::ResponseUnresolved(id.to_owned())),
    }
}

/// Ask `backend` whether it holds `id`: `GET /v1/responses/{id}` through the forwarder (its
/// connections, TLS, API key, passive health), with the client's `Authorization` for
/// backends that take the client's key.
async fn probe(app: &AppState, backend: Arc<Backend>, id: &str, client: &HeaderMap) -> Probe {
    // An id that makes no valid path cannot be asked about.
    let Ok(path_and_query) = http::uri::PathAndQuery::try_from(format!("{BY_ID_PREFIX}{id}"))
    else {
        return Probe::Unknown;
    };
    let view = Arc::new(RequestView::multipart(b"", ""));
    // Counted in flight, but outside the concurrency limit (a small GET must not wait behind
    // a full backend's generations) and never the probe of a backend on probation.
    let Some(slot) = Slot::try_reserve(&backend, None) else {
        return Probe::Unknown;
    };
    let guard = app.service.scheduler().guard(slot, &view);
    let mut headers = HeaderMap::new();
    if let Some(auth) = client.get(header::AUTHORIZATION) {
        headers.insert(header::AUTHORIZATION, auth.clone());
    }
    let request = ProxyRequest {
        method: Method::GET,
        path_and_query,
        headers,
        body: Bytes::new(),
        view,
        request_id: new_request_id(),
        received_at: Instant::now(),
    };
    let dispatch = Dispatch {
        request: Arc::new(request),
        backend,
        guard,
    };
    match app.service.inner().clone().oneshot(dispatch).await {
        Ok(response) => {
            let status = response.status();
            // Read to its end (bounded) so the connection is reused.
            crate::forward::discard(
                response,
                tokio::time::Instant::now() + std::time::Duration::from_secs(1),
            )
            .await;
            match status.as_u16() {
                200 => Probe::Has,
                404 => Probe::HasNot,
                _ => Probe::Unknown,
            }
        }
        Err(_) => Probe::Unknown,
    }
}

/// The response a call names: the `{id}` of a by-id route, or a create's
/// `previous_response_id`.
pub fn named(operation: Operation, by_id: Option<&str>, view: &RequestView) -> Option<String> {
    match (by_id, operation) {
        (Some(id), _) => Some(id.to_owned()),
        (None, Operation::Responses) => view.previous_response.clone(),
        _ => None,
    }
}

/// A successful answer to `POST /v1/responses`: learn the id it creates as it passes.
pub fn learn(app: &AppState, response: Response<Body>) -> Response<Body> {
    if !response.status().is_success() {
        return response;
    }
    let Some(backend) = response
        .headers()
        .get(&app.backend_header)
        .and_then(|v| v.to_str().ok())
        .map(Arc::<str>::from)
    else {
        return response;
    };
    crate::responses::learn::tap(response, Arc::clone(&app.responses.directory), backend)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_id_comes_from_the_raw_path() {
        assert_eq!(id_in_path("/v1/responses/resp_1").ok(), Some("resp_1"));
        assert_eq!(
            id_in_path("/v1/responses/resp_1/cancel").ok(),
            Some("resp_1")
        );
        assert_eq!(
            id_in_path("/v1/responses/resp_1/input_items").ok(),
            Some("resp_1")
        );
        for bad in [
            "/v1/responses/",
            "/v1/responses/a%2fb",
            "/v1/responses/..",
            "/v1/responses/a.b",
            "/v1/responses/%72esp",
        ] {
            assert!(id_in_path(bad).is_err(), "{bad}");
        }
        let long = format!("/v1/responses/{}", "a".repeat(129));
        assert!(id_in_path(&long).is_err());
    }
}
