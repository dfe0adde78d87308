//! Header hygiene between client and backend (RFC 9110 §7.6.1 and §7.2).
//!
//! Hop-by-hop headers describe one connection and must not cross the proxy: the fixed set
//! below plus every header the `Connection` header names. `Host` is rewritten to the backend
//! (hyper derives it from the absolute URI). Credentials: a backend's configured key replaces
//! whatever the client sent; without one, the client's `Authorization` is forwarded only when
//! the operator opted in, so a client's key for inferlb is never shown to a backend by accident.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// `x-request-id`, as a constant: a `&str` header name is parsed and copied on every use.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

const HOP_BY_HOP: &[HeaderName] = &[
    header::CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Is `name` hop-by-hop: in the fixed set, or named by a `Connection` header of `headers`?
/// Allocation-free (it runs for every header of every request and response): the
/// `Connection` values are compared in place, ASCII case-insensitively, instead of being
/// parsed into header names.
fn is_hop_by_hop(name: &HeaderName, headers: &HeaderMap) -> bool {
    HOP_BY_HOP.contains(name)
        || name.as_str() == "keep-alive"
        || headers
            .get_all(header::CONNECTION)
            .iter()
            .flat_map(|v| v.as_bytes().split(|b| *b == b','))
            .any(|listed| {
                listed
                    .trim_ascii()
                    .eq_ignore_ascii_case(name.as_str().as_bytes())
            })
}

/// Copy the end-to-end headers of a client request into `out`, for the backend.
pub fn request_headers(
    from: &HeaderMap,
    out: &mut HeaderMap,
    backend_authorization: Option<&HeaderValue>,
    forward_client_authorization: bool,
) {
    for (name, value) in from {
        if is_hop_by_hop(name, from) || name == header::HOST || name == header::CONTENT_LENGTH {
            continue;
        }
        if name == header::AUTHORIZATION
            && (backend_authorization.is_some() || !forward_client_authorization)
        {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    if let Some(auth) = backend_authorization {
        out.insert(header::AUTHORIZATION, auth.clone());
    }
}

/// Drop hop-by-hop headers from a backend response before it goes to the client.
pub fn strip_response_headers(headers: &mut HeaderMap) {
    // Usually just `Connection: keep-alive`, or nothing: look before collecting.
    if !headers.keys().any(|n| is_hop_by_hop(n, headers)) {
        return;
    }
    let doomed: Vec<HeaderName> = headers
        .keys()
        .filter(|n| is_hop_by_hop(n, headers))
        .cloned()
        .collect();
    for name in doomed {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        m
    }

    #[test]
    fn hop_by_hop_and_connection_listed_are_dropped() {
        let from = map(&[
            ("connection", "keep-alive,  X-Secret "),
            ("keep-alive", "timeout=5"),
            ("x-secret", "1"),
            ("te", "trailers"),
            ("host", "inferlb"),
            ("content-length", "3"),
            ("content-type", "application/json"),
            ("x-request-id", "abc"),
        ]);
        let mut out = HeaderMap::new();
        request_headers(&from, &mut out, None, false);
        let names: Vec<_> = out.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, vec!["content-type", "x-request-id"]);
    }

    #[test]
    fn authorization_rules() {
        let from = map(&[("authorization", "Bearer client")]);
        let backend = HeaderValue::from_static("Bearer backend");
        let mut out = HeaderMap::new();
        request_headers(&from, &mut out, Some(&backend), true);
        assert_eq!(out.get("authorization").unwrap(), "Bearer backend");
        let mut out = HeaderMap::new();
        request_headers(&from, &mut out, None, false);
        assert!(
            out.get("authorization").is_none(),
            "not forwarded by default"
        );
        let mut out = HeaderMap::new();
        request_headers(&from, &mut out, None, true);
        assert_eq!(out.get("authorization").unwrap(), "Bearer client");
    }

    #[test]
    fn response_hop_by_hop_stripped() {
        let mut h = map(&[
            ("transfer-encoding", "chunked"),
            ("content-type", "text/event-stream"),
            ("connection", "close"),
        ]);
        strip_response_headers(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("content-type"));
    }
}
