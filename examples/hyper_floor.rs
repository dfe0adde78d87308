//! The floor of a hyper proxy, for `bench/overhead.sh`: what forwarding costs on the stack
//! inferlb is built on before inferlb does anything of its own.
//!
//! One current-thread tokio runtime per core, each with its own `SO_REUSEPORT` listener and its
//! own stacks of idle HTTP/1 backend connections (inferlb's worker model), hyper's HTTP/1 server
//! and client connection APIs, backends taken round-robin. The request's head and body go to
//! the backend as they came (no parsing, no scheduling, no header edits, no metrics, no
//! timeouts, no retries) and the backend's response streams back. A backend connection goes
//! back to its stack when its response body has ended. Not a product: no error handling beyond
//! a 502, no limits.
//!
//! `cargo run --profile dist --example hyper_floor -- 127.0.0.1:PORT BACKEND_ADDR...`
//! (prints the bound address).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::cell::{Cell, RefCell};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

type Sender = SendRequest<Incoming>;
type Out = UnsyncBoxBody<Bytes, hyper::Error>;

thread_local! {
    /// Idle connections per backend, this thread's own.
    static IDLE: RefCell<Vec<Vec<Sender>>> = const { RefCell::new(Vec::new()) };
    static NEXT: Cell<usize> = const { Cell::new(0) };
}

/// The backend's response body; hands its connection back to the idle stack at its end.
struct Returning {
    inner: Incoming,
    back: Option<(usize, Sender)>,
}

impl Returning {
    fn give_back(&mut self) {
        if let Some((i, sender)) = self.back.take() {
            IDLE.with(|idle| idle.borrow_mut()[i].push(sender));
        }
    }
}

impl Body for Returning {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        // hyper's server stops polling a body that says it has ended, so look after each frame.
        if matches!(polled, Poll::Ready(None)) || self.inner.is_end_stream() {
            self.give_back();
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

async fn connect(addr: SocketAddr) -> Option<Sender> {
    let tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
    let _ = tcp.set_nodelay(true);
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .ok()?;
    tokio::task::spawn_local(conn);
    Some(sender)
}

async fn forward(backends: Arc<Vec<SocketAddr>>, req: Request<Incoming>) -> Response<Out> {
    let i = NEXT.with(|n| {
        let i = n.get();
        n.set(i.wrapping_add(1));
        i % backends.len()
    });
    // A connection whose last response has just ended may not have told its sender yet that it
    // is ready again: wait for that rather than open another.
    let mut sender = None;
    while let Some(mut idle) = IDLE.with(|idle| idle.borrow_mut()[i].pop()) {
        if idle.ready().await.is_ok() {
            sender = Some(idle);
            break;
        }
    }
    let sender = match sender {
        Some(s) => Some(s),
        None => connect(backends[i]).await,
    };
    let bad = || {
        Response::builder()
            .status(StatusCode::BAD_GATEWAY)
            .body(
                Full::new(Bytes::new())
                    .map_err(|never| match never {})
                    .boxed_unsync(),
            )
            .expect("response")
    };
    let Some(mut sender) = sender else {
        return bad();
    };
    match sender.send_request(req).await {
        Ok(res) => res.map(|inner| {
            Returning {
                inner,
                back: Some((i, sender)),
            }
            .boxed_unsync()
        }),
        Err(_) => bad(),
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut addr: SocketAddr = args
        .next()
        .unwrap_or_else(|| "127.0.0.1:0".into())
        .parse()
        .expect("address");
    let backends: Arc<Vec<SocketAddr>> =
        Arc::new(args.map(|a| a.parse().expect("backend address")).collect());
    assert!(!backends.is_empty(), "name at least one backend");
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    // The first worker binds (and picks the port when it is 0); the others join its port.
    let (bound_tx, bound_rx) = std::sync::mpsc::channel();
    let mut threads = Vec::new();
    for n in 0..cores {
        let backends = Arc::clone(&backends);
        let bound_tx = bound_tx.clone();
        threads.push(std::thread::spawn(move || worker(addr, backends, bound_tx)));
        let bound: SocketAddr = bound_rx.recv().expect("a worker bound its listener");
        if n == 0 {
            addr = bound;
            println!("{addr}");
        }
    }
    for t in threads {
        let _ = t.join();
    }
}

fn worker(
    addr: SocketAddr,
    backends: Arc<Vec<SocketAddr>>,
    bound: std::sync::mpsc::Sender<SocketAddr>,
) {
    IDLE.with(|idle| *idle.borrow_mut() = (0..backends.len()).map(|_| Vec::new()).collect());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.set_reuseport(true).expect("reuseport");
        socket.set_reuseaddr(true).expect("reuseaddr");
        socket.bind(addr).expect("bind");
        let listener = socket.listen(1024).expect("listen");
        let _ = bound.send(listener.local_addr().expect("addr"));
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let backends = Arc::clone(&backends);
            tokio::task::spawn_local(async move {
                let service = hyper::service::service_fn(move |req| {
                    let backends = Arc::clone(&backends);
                    async move { Ok::<_, Infallible>(forward(backends, req).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tcp), service)
                    .await;
            });
        }
    });
}
