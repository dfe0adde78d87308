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
//! Idle connections wait in a per-backend LIFO stack, unpolled. With per-core request workers
//! (`crate::workers`) every worker has stacks of its own: a connection's socket is registered
//! with the runtime of the worker that opened it, so only that worker reuses it (another one
//! would be woken through the first one's I/O driver, a cross-thread hop on every read), and
//! the stacks' locks are never contended. A connection the backend
//! closed meanwhile is usually noticed at checkout (polling its driver once sees the end of
//! the stream) and dropped; when the close is only seen while sending, hyper hands the
//! unsent request back and it goes out on a fresh connection ([`send_with_reconnect`]) — a
//! keep-alive race, not a backend failure. Connections idle past the timeout are closed when
//! met. A connection is returned only when its response was read to the end; anything else
//! (client gone, error, deadline) drops it, which closes the socket — the signal vLLM takes to
//! abort the generation.
//!
//! A connection is plain TCP or TLS ([`Stream`]); a backend's [`Connector`] knows which, so
//! the pool, the forwarder and the poller never look at the scheme.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::uri::Authority;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::{Body as _, Incoming};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use crate::telemetry as t;

type Driver = http1::Connection<TokioIo<Stream>, Full<Bytes>>;

/// Why a connection could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("connect to {authority}: {reason}")]
    Connect { authority: String, reason: String },
    /// The TLS handshake failed (for instance, a certificate no trusted CA signed).
    #[error("TLS handshake with {authority}: {reason}")]
    Tls { authority: String, reason: String },
    /// The connection closed before the request was written: sending it again is safe.
    #[error("the connection closed before the request was sent")]
    NotSent,
    #[error("{0}")]
    Http(#[from] hyper::Error),
    #[error("the response body is larger than {0} bytes")]
    TooLarge(usize),
    #[error("the backend connection closed mid-response")]
    Closed,
}

impl ConnError {
    /// No connection was made: nothing was sent, another backend may be tried.
    pub fn is_connect(&self) -> bool {
        matches!(self, ConnError::Connect { .. } | ConnError::Tls { .. })
    }
}

/// The host of an authority as a connect target: IPv6 without brackets.
fn host(authority: &Authority) -> &str {
    let host = authority.host();
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

/// Where to connect for a backend's authority: host (IPv6 without brackets) and port
/// (`default_port` when the URL names none).
pub fn target(authority: &Authority, default_port: u16) -> (&str, u16) {
    (
        host(authority),
        authority.port_u16().unwrap_or(default_port),
    )
}

/// A backend connection's byte stream: plain TCP or TLS over TCP.
pub enum Stream {
    Plain(TcpStream),
    /// Boxed: a TLS session is a few hundred bytes of state the plain variant need not carry.
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// TLS settings of one backend: the client configuration and the name its certificate must
/// carry (sent as SNI when it is a DNS name).
#[derive(Clone)]
struct TlsTarget {
    connector: TlsConnector,
    server_name: ServerName<'static>,
}

/// How to open a connection to one backend: where, and whether through TLS.
#[derive(Clone)]
pub struct Connector {
    authority: Authority,
    tls: Option<TlsTarget>,
}

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector")
            .field("authority", &self.authority)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl Connector {
    /// Plain TCP (`http://`).
    pub fn plain(authority: Authority) -> Self {
        Connector {
            authority,
            tls: None,
        }
    }

    /// TLS (`https://`), verifying the server's certificate against `config`'s roots for the
    /// authority's host, which is also the SNI name.
    pub fn tls(authority: Authority, config: Arc<rustls::ClientConfig>) -> Result<Self, String> {
        let server_name = ServerName::try_from(host(&authority).to_owned())
            .map_err(|e| format!("`{}` is not a valid TLS server name: {e}", authority.host()))?;
        Ok(Connector {
            authority,
            tls: Some(TlsTarget {
                connector: TlsConnector::from(config),
                server_name,
            }),
        })
    }

    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Open a connection within `timeout` (TCP connect and TLS handshake together).
    pub async fn connect(&self, timeout: Duration) -> Result<Conn, ConnError> {
        let authority = &self.authority;
        let failed = |reason: String| ConnError::Connect {
            authority: authority.to_string(),
            reason,
        };
        let default_port = if self.tls.is_some() { 443 } else { 80 };
        let open = async {
            let tcp = TcpStream::connect(target(authority, default_port))
                .await
                .map_err(|e| failed(e.to_string()))?;
            tcp.set_nodelay(true).map_err(|e| failed(e.to_string()))?;
            let Some(tls) = &self.tls else {
                return Ok(Stream::Plain(tcp));
            };
            let stream = tls
                .connector
                .connect(tls.server_name.clone(), tcp)
                .await
                .map_err(|e| ConnError::Tls {
                    authority: authority.to_string(),
                    reason: e.to_string(),
                })?;
            Ok::<_, ConnError>(Stream::Tls(Box::new(stream)))
        };
        let stream = tokio::time::timeout(timeout, open)
            .await
            .map_err(|_| failed(format!("timed out after {timeout:?}")))??;
        let (send, driver) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| failed(e.to_string()))?;
        metrics::counter!(t::UPSTREAM_CONNECTIONS_OPENED).increment(1);
        Ok(Conn {
            send,
            driver: Some(Box::new(driver)),
        })
    }
}

/// One HTTP/1.1 connection: the request sender and the state machine that must be polled for
/// anything to move.
pub struct Conn {
    send: http1::SendRequest<Full<Bytes>>,
    /// `None` once the connection has closed. Dropping the finished driver also fails any
    /// request still queued on it (with the request handed back, see [`ConnError::NotSent`]).
    /// Boxed (once per connection): hyper's connection state is some 650 bytes, and a `Conn`
    /// is moved several times per request (checkout, lease, check-in).
    driver: Option<Box<Driver>>,
}

impl Conn {
    /// Move the connection's I/O along. Returns `true` while the connection is open.
    pub fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        if let Some(driver) = &mut self.driver {
            if Pin::new(driver.as_mut()).poll(cx).is_ready() {
                self.driver = None;
            }
        }
        self.driver.is_some()
    }

    /// Idle and able to carry another request, once driven.
    pub fn reusable(&mut self) -> bool {
        self.drive(&mut Context::from_waker(Waker::noop()));
        self.ready_as_driven()
    }

    /// Idle and able to carry another request as its last drive left it, without another
    /// poll of the connection (a pass of hyper's dispatcher, ~800 instructions).
    fn ready_as_driven(&self) -> bool {
        self.driver.is_some() && self.send.is_ready()
    }

    /// Send `request` and drive the connection until the response head arrives.
    pub async fn send(
        &mut self,
        request: Request<Full<Bytes>>,
    ) -> Result<Response<Incoming>, ConnError> {
        let response = self.send.try_send_request(request);
        let mut response = std::pin::pin!(response);
        std::future::poll_fn(|cx| {
            self.drive(cx);
            response.as_mut().poll(cx)
        })
        .await
        .map_err(|mut e| {
            if e.take_message().is_some() {
                ConnError::NotSent
            } else {
                ConnError::Http(e.into_error())
            }
        })
    }

    /// Drive the connection, then take the next frame of `body` (received on it). A body
    /// still waiting when the connection has ended can get nothing more: that is an error, not
    /// a wait.
    pub fn poll_body(
        &mut self,
        cx: &mut Context<'_>,
        body: &mut Incoming,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, ConnError>>> {
        let open = self.drive(cx);
        match Pin::new(body).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(frame.map(|r| r.map_err(ConnError::Http))),
            Poll::Pending if !open => Poll::Ready(Some(Err(ConnError::Closed))),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Send `request` and read its whole response (a body of at most `limit` bytes).
    pub async fn fetch(
        &mut self,
        request: Request<Full<Bytes>>,
        limit: usize,
    ) -> Result<(http::StatusCode, Bytes), ConnError> {
        let response = self.send(request).await?;
        self.read_whole(response, limit).await
    }

    /// Read the whole body of `response` (received on this connection), at most `limit` bytes.
    async fn read_whole(
        &mut self,
        response: Response<Incoming>,
        limit: usize,
    ) -> Result<(http::StatusCode, Bytes), ConnError> {
        let (parts, mut body) = response.into_parts();
        let mut buf = BytesMut::new();
        std::future::poll_fn(|cx| loop {
            match std::task::ready!(self.poll_body(cx, &mut body)) {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        if buf.len() + data.len() > limit {
                            return Poll::Ready(Err(ConnError::TooLarge(limit)));
                        }
                        buf.extend_from_slice(&data);
                    }
                }
                Some(Err(e)) => return Poll::Ready(Err(e)),
                None => return Poll::Ready(Ok(())),
            }
        })
        .await?;
        Ok((parts.status, buf.freeze()))
    }
}

/// Send `request` over `conn`, or over a fresh connection when `conn` came from a pool and
/// turns out to have been closed by the backend before the request left (`rebuild` makes the
/// request again). Keep-alive servers close idle connections on their own schedule; such a
/// race is not the backend's failure and must not count as one.
pub async fn send_with_reconnect(
    conn: &mut Conn,
    reused: bool,
    connector: &Connector,
    connect_timeout: Duration,
    request: Request<Full<Bytes>>,
    rebuild: impl FnOnce() -> Option<Request<Full<Bytes>>>,
) -> Result<Response<Incoming>, ConnError> {
    match conn.send(request).await {
        Err(ConnError::NotSent) if reused => {
            let request = rebuild().ok_or(ConnError::NotSent)?;
            *conn = Box::pin(connector.connect(connect_timeout)).await?;
            conn.send(request).await
        }
        other => other,
    }
}

struct Idle {
    conn: Conn,
    since: Instant,
}

/// Keyed by backend uid, hashed with foldhash (looked up twice per request; SipHash is for
/// keys an attacker picks, and these are the router's own).
type Stacks = Mutex<HashMap<usize, VecDeque<Idle>, foldhash::fast::RandomState>>;

/// Per-backend stacks of idle connections, one set per request worker.
pub struct ConnPool {
    /// Index 0: threads that are no per-core worker (the shared runtime); `1 + i`: worker `i`.
    shards: Box<[Stacks]>,
    max_idle: usize,
    idle_timeout: Duration,
    pub connect_timeout: Duration,
}

impl ConnPool {
    /// `workers`: how many per-core request workers will use the pool (0: none).
    pub fn new(
        max_idle: usize,
        idle_timeout: Duration,
        connect_timeout: Duration,
        workers: usize,
    ) -> Self {
        ConnPool {
            shards: (0..=workers.min(crate::workers::MAX_WORKERS))
                .map(|_| Mutex::new(HashMap::default()))
                .collect(),
            max_idle,
            idle_timeout,
            connect_timeout,
        }
    }

    /// The calling thread's stacks.
    fn stacks(&self) -> &Stacks {
        let i = crate::workers::current().map_or(0, |w| w.saturating_add(1));
        // A worker beyond the pool's count (never, when sized from the same config) shares.
        let i = if i < self.shards.len() { i } else { 0 };
        &self.shards[i]
    }

    /// A connection to `backend`: the most recently idle one that still looks open (`true`:
    /// reused), or a new one.
    pub async fn checkout(
        &self,
        backend: usize,
        connector: &Connector,
    ) -> Result<(Conn, bool), ConnError> {
        loop {
            let idle = {
                let mut map = self.stacks().lock().unwrap_or_else(PoisonError::into_inner);
                map.get_mut(&backend).and_then(VecDeque::pop_back)
            };
            let Some(mut idle) = idle else { break };
            if idle.since.elapsed() < self.idle_timeout && idle.conn.reusable() {
                return Ok((idle.conn, true));
            }
        }
        // Boxed: a connect future (TCP and TLS) is over a kilobyte, and a reused connection,
        // the usual case, should not carry it.
        Ok((
            Box::pin(connector.connect(self.connect_timeout)).await?,
            false,
        ))
    }

    /// Give back a connection whose response was read to the end. Connections idle past the
    /// timeout are closed here too, so sockets the backend gave up on do not linger.
    /// Close every idle connection of `backend` (it left the pool).
    pub fn purge(&self, backend: usize) {
        for stacks in &self.shards {
            let mut map = stacks.lock().unwrap_or_else(PoisonError::into_inner);
            map.remove(&backend);
        }
    }

    pub fn checkin(&self, backend: usize, mut conn: Conn) {
        // A response body's last frame has just driven the connection, which usually left it
        // ready for the next request; only when it did not is it driven again here. Whatever
        // happens to it while it waits, `checkout` drives it before lending it.
        if !(conn.ready_as_driven() || conn.reusable()) {
            return;
        }
        let mut map = self.stacks().lock().unwrap_or_else(PoisonError::into_inner);
        let stack = map.entry(backend).or_default();
        while stack
            .front()
            .is_some_and(|i| i.since.elapsed() >= self.idle_timeout)
            || stack.len() >= self.max_idle.max(1)
        {
            stack.pop_front();
        }
        if self.max_idle > 0 {
            stack.push_back(Idle {
                conn,
                since: Instant::now(),
            });
        }
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn connect_target_defaults_the_port_and_unbrackets_ipv6() {
        let a: Authority = "vllm.internal".parse().unwrap();
        assert_eq!(target(&a, 80), ("vllm.internal", 80));
        assert_eq!(target(&a, 443), ("vllm.internal", 443));
        let a: Authority = "127.0.0.1:8000".parse().unwrap();
        assert_eq!(target(&a, 443), ("127.0.0.1", 8000));
        let a: Authority = "[::1]:9000".parse().unwrap();
        assert_eq!(target(&a, 80), ("::1", 9000));
    }

    #[test]
    fn tls_server_name_is_the_host() {
        let config = crate::forward::tls::client_config(None).unwrap();
        let c = Connector::tls("[::1]:9000".parse().unwrap(), Arc::clone(&config)).unwrap();
        assert!(c.is_tls());
        let name = &c.tls.as_ref().unwrap().server_name;
        assert_eq!(name.to_str(), "::1");
        let c = Connector::tls("vllm.internal:8443".parse().unwrap(), config).unwrap();
        assert_eq!(c.tls.unwrap().server_name.to_str(), "vllm.internal");
    }
}
