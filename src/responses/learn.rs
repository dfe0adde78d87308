//! Learning a new response's id from the answer of `POST /v1/responses` as it streams to the
//! client: the body passes through frame by frame, unchanged and undelayed; a side scan reads
//! the id.
//!
//! - JSON (`stream: false`, also the immediate answer of `background: true`): the top-level
//!   `id` of the object. The frames are kept (reference-counted, not copied) up to
//!   [`MAX_JSON`] bytes, and parsed when a frame ends the object, so the id is recorded before
//!   the client has the last byte — before it can ask for the response by id.
//! - SSE (`stream: true`): vLLM's first event is `response.created`, whose `response.id` is the
//!   id (`api_router.py` writes `event: <type>\ndata: <json>\n\n`). Complete `data:` lines are
//!   parsed until one carries `response.id`, within the first [`MAX_SSE`] bytes.
//!
//! vLLM writes the id first (`{"id":"resp_…"` and `{"response":{"id":"resp_…"`, its pydantic
//! models' field order), so both scans first read it from the leading bytes alone: an answer
//! or a first event of any size (`response.created` repeats the request's `instructions` and
//! `tools`) is learnt from its first hundred bytes. The whole-document parse is the fallback
//! for servers that order their fields otherwise.
//!
//! Whatever the backend sends, the scan is bounded and never fails the response.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use http::Response;
use http_body::{Frame, SizeHint};
use serde::Deserialize;

use super::Directory;

/// The most bytes of a JSON answer kept for the scan.
pub const MAX_JSON: usize = 1 << 20;
/// The most bytes of an SSE answer scanned for the id.
pub const MAX_SSE: usize = 64 * 1024;
/// The most parse attempts of a JSON answer (one per frame that may end the object).
const MAX_JSON_PARSES: u32 = 8;

/// How a JSON answer starts when its id comes first.
const JSON_LEAD: &[u8] = br#"{"id":""#;
/// How an SSE event's data starts when it carries a response whose id comes first.
const SSE_LEAD: &[u8] = br#"{"response":{"id":""#;
/// The most bytes of a JSON answer kept for reading a leading id.
const HEAD: usize = 256;

/// What the leading bytes say about an id that comes first.
#[derive(Debug, PartialEq, Eq)]
enum Lead {
    Id(String),
    /// Not enough bytes yet.
    NotYet,
    /// The document does not start that way (or the id is not a plain one): parse it whole.
    No,
}

/// The id of `bytes` (leading whitespace aside) when it starts with `lead` followed by an id
/// of plain characters and its closing quote.
fn leading(bytes: &[u8], lead: &[u8]) -> Lead {
    let start = bytes
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(bytes.len());
    let bytes = &bytes[start..];
    if bytes.len() < lead.len() {
        return if lead.starts_with(bytes) {
            Lead::NotYet
        } else {
            Lead::No
        };
    }
    let Some(rest) = bytes.strip_prefix(lead) else {
        return Lead::No;
    };
    let plain = |b: &u8| b.is_ascii_alphanumeric() || *b == b'_' || *b == b'-';
    let len = rest.iter().take_while(|b| plain(b)).count();
    match rest.get(len) {
        Some(b'"') if len > 0 => Lead::Id(String::from_utf8_lossy(&rest[..len]).into_owned()),
        None if len <= crate::prompt::responses::MAX_ID_LEN => Lead::NotYet,
        _ => Lead::No,
    }
}

#[derive(Deserialize)]
struct WithId {
    id: String,
}

#[derive(Deserialize)]
struct Event {
    #[serde(default)]
    response: Option<WithId>,
}

enum Scan {
    Json {
        frames: Vec<Bytes>,
        len: usize,
        parses: u32,
        /// The first bytes, while a leading id may still be read from them.
        head: Option<Vec<u8>>,
    },
    Sse {
        pending: Vec<u8>,
        seen: usize,
    },
    Done,
}

impl Scan {
    /// Feed one data frame; `Some(id)` once found.
    fn feed(&mut self, data: &Bytes) -> Option<String> {
        match self {
            Scan::Done => None,
            Scan::Json {
                frames,
                len,
                parses,
                head,
            } => {
                if let Some(h) = head {
                    h.extend_from_slice(&data[..data.len().min(HEAD.saturating_sub(h.len()))]);
                    match leading(h, JSON_LEAD) {
                        Lead::Id(id) => {
                            *self = Scan::Done;
                            return Some(id);
                        }
                        Lead::NotYet if h.len() < HEAD => {}
                        _ => *head = None,
                    }
                }
                *len = len.saturating_add(data.len());
                if *len > MAX_JSON {
                    *self = Scan::Done;
                    return None;
                }
                frames.push(data.clone());
                let ends_object = data
                    .iter()
                    .rev()
                    .find(|b| !b.is_ascii_whitespace())
                    .is_some_and(|b| *b == b'}');
                if !ends_object {
                    return None;
                }
                *parses += 1;
                let whole: Vec<u8> = frames.iter().flat_map(|f| f.iter().copied()).collect();
                match serde_json::from_slice::<WithId>(&whole) {
                    Ok(found) => {
                        *self = Scan::Done;
                        Some(found.id)
                    }
                    Err(e) if e.is_eof() && *parses < MAX_JSON_PARSES => None,
                    Err(_) => {
                        *self = Scan::Done;
                        None
                    }
                }
            }
            Scan::Sse { pending, seen } => {
                *seen = seen.saturating_add(data.len());
                pending.extend_from_slice(data);
                let mut found = None;
                let mut consumed = 0;
                while let Some(end) = memchr::memchr(b'\n', &pending[consumed..]) {
                    let line = &pending[consumed..consumed + end];
                    consumed += end + 1;
                    let line = line.strip_suffix(b"\r").unwrap_or(line);
                    let Some(json) = line.strip_prefix(b"data:") else {
                        continue;
                    };
                    if let Lead::Id(id) = leading(json, SSE_LEAD) {
                        found = Some(id);
                        break;
                    }
                    if let Ok(Event {
                        response: Some(r), ..
                    }) = serde_json::from_slice::<Event>(json.trim_ascii())
                    {
                        found = Some(r.id);
                        break;
                    }
                }
                pending.drain(..consumed);
                // A data line still arriving (a large first event): its leading id may be
                // there already.
                if found.is_none() {
                    if let Some(json) = pending.strip_prefix(b"data:") {
                        if let Lead::Id(id) = leading(json, SSE_LEAD) {
                            found = Some(id);
                        }
                    }
                }
                if found.is_some() || *seen > MAX_SSE {
                    *self = Scan::Done;
                }
                found
            }
        }
    }
}

struct Tap {
    inner: Body,
    scan: Scan,
    directory: Arc<Directory>,
    backend: Arc<str>,
}

impl http_body::Body for Tap {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if let Some(data) = frame.data_ref() {
                if let Some(id) = this.scan.feed(data) {
                    tracing::debug!(id = %id, backend = %this.backend, "response id learnt");
                    this.directory.learn(&id, &this.backend);
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Pass `response` (a successful answer of `POST /v1/responses` from `backend`) on, learning
/// the id it creates into `directory`.
pub fn tap(
    response: Response<Body>,
    directory: Arc<Directory>,
    backend: Arc<str>,
) -> Response<Body> {
    let sse = response
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let scan = if sse {
        Scan::Sse {
            pending: Vec::new(),
            seen: 0,
        }
    } else {
        Scan::Json {
            frames: Vec::new(),
            len: 0,
            parses: 0,
            head: Some(Vec::new()),
        }
    };
    let (parts, inner) = response.into_parts();
    Response::from_parts(
        parts,
        Body::new(Tap {
            inner,
            scan,
            directory,
            backend,
        }),
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn json() -> Scan {
        Scan::Json {
            frames: Vec::new(),
            len: 0,
            parses: 0,
            head: Some(Vec::new()),
        }
    }

    fn sse() -> Scan {
        Scan::Sse {
            pending: Vec::new(),
            seen: 0,
        }
    }

    fn feed_all(mut scan: Scan, frames: &[&str]) -> Option<String> {
        frames
            .iter()
            .find_map(|f| scan.feed(&Bytes::copy_from_slice(f.as_bytes())))
    }

    #[test]
    fn the_json_id_is_read_across_frames_and_nested_ids_are_not_it() {
        let body = r#"{"object":"response","output":[{"id":"msg_1","type":"message"}],"id":"resp_abc","usage":{}}"#;
        let (a, b) = body.split_at(30);
        assert_eq!(feed_all(json(), &[a, b]).as_deref(), Some("resp_abc"));
        assert_eq!(feed_all(json(), &[body]).as_deref(), Some("resp_abc"));
        assert_eq!(feed_all(json(), &[r#"{"error":{"message":"x"}}"#]), None);
        assert_eq!(feed_all(json(), &["not json}"]), None);
    }

    #[test]
    fn the_sse_id_is_the_first_events_response_id() {
        let created = r#"data: {"response":{"id":"resp_s1","status":"in_progress"},"sequence_number":0,"type":"response.created"}"#;
        let frames = [
            "event: response.created\n",
            &created[..40],
            &created[40..],
            "\n\n",
        ];
        assert_eq!(feed_all(sse(), &frames).as_deref(), Some("resp_s1"));
        let crlf = format!("event: response.created\r\n{created}\r\n\r\n");
        assert_eq!(feed_all(sse(), &[&crlf]).as_deref(), Some("resp_s1"));
    }

    #[test]
    fn a_leading_id_is_read_from_the_first_bytes_of_any_size_of_answer() {
        // vLLM's order: the id first, then a first event far over the scan's bound.
        let big = format!(
            r#"data: {{"response":{{"id":"resp_big","instructions":"{}"}},"type":"response.created"}}"#,
            "x".repeat(4 * MAX_SSE)
        );
        let (a, b) = big.split_at(20);
        assert_eq!(
            feed_all(sse(), &["event: response.created\n", a, b]).as_deref(),
            Some("resp_big")
        );
        let body = format!(
            r#"{{"id":"resp_j","output":"{}"}}"#,
            "y".repeat(2 * MAX_JSON)
        );
        let (a, b) = body.split_at(5);
        assert_eq!(feed_all(json(), &[a, b]).as_deref(), Some("resp_j"));
        assert_eq!(
            leading(b"  {\"id\":\"resp_1\"", JSON_LEAD),
            Lead::Id("resp_1".into())
        );
        assert_eq!(leading(b"{\"id\":\"resp_", JSON_LEAD), Lead::NotYet);
        assert_eq!(leading(b"{\"i", JSON_LEAD), Lead::NotYet);
        assert_eq!(leading(b"{\"object\":1", JSON_LEAD), Lead::No);
        assert_eq!(leading(b"{\"id\":\"a\\u0041\"", JSON_LEAD), Lead::No);
        assert_eq!(leading(b"{\"id\":\"\"", JSON_LEAD), Lead::No);
    }

    #[test]
    fn the_scans_are_bounded() {
        let big = "x".repeat(MAX_SSE + 1);
        let mut scan = sse();
        assert_eq!(scan.feed(&Bytes::from(big)), None);
        assert!(matches!(scan, Scan::Done));
        let mut scan = json();
        assert_eq!(scan.feed(&Bytes::from(vec![b' '; MAX_JSON + 1])), None);
        assert!(matches!(scan, Scan::Done));
        // A backend sending one `}` after another gives up after a few parses.
        let mut scan = json();
        for _ in 0..MAX_JSON_PARSES {
            assert_eq!(scan.feed(&Bytes::from_static(b"{\"a\":{}")), None);
        }
        assert!(matches!(scan, Scan::Done));
    }
}
