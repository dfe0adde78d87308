//! Keep-alive connections to backends, driven by the request that is using them.
//!
//! A general HTTP client runs each connection in a task of its own and hands response chunks
//! to the caller through a one-slot channel: every SSE chunk then costs two task wake-ups (the
//! connection task decodes it and waits; the response task takes it and wakes the connection
//! again). Here a [`Conn`] is polled by whoever holds it — the forwarder while it waits for
//! the response head, then the response body while it streams — so decoding a chunk and
//! handing it on happen in one poll of one task, and every chunk already in the socket buffer
//! can be taken in the same poll.
//!
//! Idle connections wait in a per-backend LIFO stack, unpolled. A connection the backend
//! closed meanwhile is noticed at checkout (its driver resolves, or it is no longer ready) and
//! dropped; one older than the idle timeout is dropped too. A connection is returned only when
//! its response was read to the end; anything else (client gone, error, deadline) drops it,
//! which closes the socket — the signal vLLM takes to abort the generation.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::{Body as _, Incoming};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::telemetry as t;

type Driver = http1::Connection<TokioIo<TcpStream>, Full<Bytes>>;

/// Why a connection could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("connect to {authority}: {reason}")]
    Connect { authority: String, reason: String },
    #[error("{0}")]
    Http(#[from] hyper::Error),
    #[error("the response body is larger than {0} bytes")]
    TooLarge(usize),
}

impl ConnError {
    pub fn is_connect(&self) -> bool {
        matches!(self, ConnError::Connect { .. })
    }
}

/// One HTTP/1.1 connection: the request sender and the state machine that must be polled for
/// anything to move.
pub struct Conn {
    send: http1::SendRequest<Full<Bytes>>,
    driver: Driver,
    /// The driver resolved: the connection is closed and must not be polled again.
    closed: bool,
}

impl Conn {
    /// Move the connection's I/O along. Returns `true` while the connection is open.
    pub fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.closed && Pin::new(&mut self.driver).poll(cx).is_ready() {
            self.closed = true;
        }
        !self.closed
    }

    /// Idle and able to carry another request.
    pub fn reusable(&mut self) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        self.drive(&mut cx) && self.send.is_ready()
    }

    /// Send `request` and drive the connection until the response head arrives.
    pub async fn send(
        &mut self,
        request: Request<Full<Bytes>>,
    ) -> Result<Response<Incoming>, ConnError> {
        let response = self.send.send_request(request);
        let mut response = std::pin::pin!(response);
        std::future::poll_fn(|cx| {
            self.drive(cx);
            response.as_mut().poll(cx)
        })
        .await
        .map_err(ConnError::Http)
    }

    /// Send `request` and read its whole response (a body of at most `limit` bytes).
    pub async fn fetch(
        &mut self,
        request: Request<Full<Bytes>>,
        limit: usize,
    ) -> Result<(http::StatusCode, Bytes), ConnError> {
        let (parts, mut body) = self.send(request).await?.into_parts();
        let mut buf = BytesMut::new();
        std::future::poll_fn(|cx| loop {
            self.drive(cx);
            match std::task::ready!(Pin::new(&mut body).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        if buf.len() + data.len() > limit {
                            return Poll::Ready(Err(ConnError::TooLarge(limit)));
                        }
                        buf.extend_from_slice(&data);
                    }
                }
                Some(Err(e)) => return Poll::Ready(Err(ConnError::Http(e))),
                None => return Poll::Ready(Ok(())),
            }
        })
        .await?;
        Ok((parts.status, buf.freeze()))
    }
}

/// Open a connection to `authority` (`host:port`) within `timeout`.
pub async fn connect(authority: &str, timeout: Duration) -> Result<Conn, ConnError> {
    let failed = |reason: String| ConnError::Connect {
        authority: authority.to_owned(),
        reason,
    };
    let stream = tokio::time::timeout(timeout, TcpStream::connect(authority))
        .await
        .map_err(|_| failed(format!("timed out after {timeout:?}")))?
        .map_err(|e| failed(e.to_string()))?;
    stream
        .set_nodelay(true)
        .map_err(|e| failed(e.to_string()))?;
    let (send, driver) = http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| failed(e.to_string()))?;
    metrics::counter!(t::UPSTREAM_CONNECTIONS_OPENED).increment(1);
    Ok(Conn {
        send,
        driver,
        closed: false,
    })
}

struct Idle {
    conn: Conn,
    since: Instant,
}

/// Per-backend stacks of idle connections.
pub struct ConnPool {
    idle: Mutex<HashMap<usize, Vec<Idle>>>,
    max_idle: usize,
    idle_timeout: Duration,
    connect_timeout: Duration,
}

impl ConnPool {
    pub fn new(max_idle: usize, idle_timeout: Duration, connect_timeout: Duration) -> Self {
        ConnPool {
            idle: Mutex::new(HashMap::new()),
            max_idle,
            idle_timeout,
            connect_timeout,
        }
    }

    /// A ready connection to `backend` at `authority` (`host:port`): the most recently idle
    /// one that is still open, or a new one.
    pub async fn checkout(&self, backend: usize, authority: &str) -> Result<Conn, ConnError> {
        loop {
            let idle = {
                let mut map = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
                map.get_mut(&backend).and_then(Vec::pop)
            };
            let Some(mut idle) = idle else { break };
            if idle.since.elapsed() < self.idle_timeout && idle.conn.reusable() {
                return Ok(idle.conn);
            }
        }
        connect(authority, self.connect_timeout).await
    }

    /// Give back a connection whose response was read to the end.
    pub fn checkin(&self, backend: usize, mut conn: Conn) {
        if !conn.reusable() {
            return;
        }
        let mut map = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let stack = map.entry(backend).or_default();
        if stack.len() >= self.max_idle {
            // Keep the freshest: the oldest idle connection is the likeliest to be stale.
            stack.remove(0);
        }
        stack.push(Idle {
            conn,
            since: Instant::now(),
        });
    }
}

/// A connection lent to one response body, returned to its pool when the body has ended.
pub struct Lease {
    pub conn: Conn,
    pub pool: Arc<ConnPool>,
    pub backend: usize,
}

impl Lease {
    pub fn release(self) {
        self.pool.checkin(self.backend, self.conn);
    }
}
