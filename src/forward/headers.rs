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

/// A judge of hop-by-hop names for `headers`: the fixed set, plus the names its `Connection`
/// headers list. The `Connection` values are looked up once per map (not once per header)
/// and compared in place, ASCII case-insensitively, instead of being parsed into header
/// names: this runs for every header of every request and response. A `Connection` that
/// lists only `keep-alive` or `close` (nearly every one) names no header beyond the fixed
/// set, so then no header is compared with its list at all.
fn hop_by_hop(headers: &HeaderMap) -> impl Fn(&HeaderName) -> bool + '_ {
    let listed = headers.get_all(header::CONNECTION);
    // The names (or options) the `Connection` headers list, trimmed.
    let tokens = move || {
        listed
            .iter()
            .flat_map(|v| v.as_bytes().split(|b| *b == b','))
            .map(<[u8]>::trim_ascii)
    };
    let names_others = tokens().any(|token| {
        !(token.is_empty()
            || token.eq_ignore_ascii_case(b"keep-alive")
            || token.eq_ignore_ascii_case(b"close"))
    });
    move |name| {
        HOP_BY_HOP.contains(name)
            || name.as_str() == "keep-alive"
            // Reserved as a field name (RFC 9110 §7.6.1), so never end-to-end.
            || name.as_str() == "close"
            || (names_others
                && tokens().any(|token| token.eq_ignore_ascii_case(name.as_str().as_bytes())))
    }
}

/// Copy the end-to-end headers of a client request into `out`, for the backend.
pub fn request_headers(
    from: &HeaderMap,
    out: &mut HeaderMap,
    backend_authorization: Option<&HeaderValue>,
    forward_client_authorization: bool,
) {
    let hop = hop_by_hop(from);
    for (name, value) in from {
        if hop(name) || name == header::HOST || name == header::CONTENT_LENGTH {
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
    // Usually just `Connection: keep-alive`, or nothing. One name at a time, judged afresh
    // after each removal, so no list of names is allocated; `Connection` itself goes last,
    // as what it lists is judged by it. Each pass removes a name, so the loop ends.
    loop {
        let next = {
            let hop = hop_by_hop(headers);
            headers
                .keys()
                .find(|n| *n != header::CONNECTION && hop(n))
                .cloned()
        };
        match next {
            Some(name) => headers.remove(&name),
            None => break,
        };
    }
    headers.remove(header::CONNECTION);
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
        // A name `Connection` lists goes too, whatever the order of the two.
        for pairs in [
            [("connection", "Keep-Alive, X-Secret"), ("x-secret", "1")],
            [("x-secret", "1"), ("connection", "keep-alive,x-secret ")],
        ] {
            let mut h = map(&pairs);
            h.append("content-type", HeaderValue::from_static("application/json"));
            strip_response_headers(&mut h);
            let names: Vec<_> = h.keys().map(|k| k.as_str()).collect();
            assert_eq!(names, vec!["content-type"], "{pairs:?}");
        }
        // A `Connection` of connection options only names no header: the others stay, and
        // a field named `close` (a reserved name) goes whatever `Connection` says.
        for connection in ["Keep-Alive", "close", " keep-alive , CLOSE ,"] {
            let mut h = map(&[
                ("connection", connection),
                ("x-kept", "1"),
                ("close", "1"),
                ("keep-alive", "timeout=5"),
            ]);
            strip_response_headers(&mut h);
            let names: Vec<_> = h.keys().map(|k| k.as_str()).collect();
            assert_eq!(names, vec!["x-kept"], "{connection:?}");
        }
    }
}
