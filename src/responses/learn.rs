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
            } => {
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
                    if let Ok(Event {
                        response: Some(r), ..
                    }) = serde_json::from_slice::<Event>(json.trim_ascii())
                    {
                        found = Some(r.id);
                        break;
                    }
                }
                pending.drain(..consumed);
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
