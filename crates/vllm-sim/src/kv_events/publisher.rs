//! The publisher task: event batches from the engine → `[topic, seq, payload]` on a PUB socket,
//! a bounded replay buffer behind a ROUTER socket, and the event-stream faults.
//!
//! The engine numbers its batches (seq from 0 per engine "process") and hands them over a
//! bounded queue (`max_queue_size`; a batch that does not fit is lost and counted, leaving a
//! gap the subscriber can see). This task encodes each batch once, keeps the last
//! `buffer_steps` for replay and sends it, unless a fault says otherwise:
//!
//! * **drop** (`kv_events_drop_rate`): a batch is not sent, as if the PUB socket had dropped it
//!   at its high-water mark; it stays in the replay buffer, so a subscriber can recover it.
//! * **stall** (`kv_events_stall`): nothing is sent while it lasts; batches wait (at most `hwm`
//!   of them, further ones are dropped like the above) and go out in order when it ends.
//! * **restart** ([`PubMsg::Restart`], sent by the engine when it wipes its cache): the replay
//!   buffer and waiting batches are discarded, both sockets are closed and bound again on the
//!   same ports (subscribers see the connection drop and must reconnect), and the engine's next
//!   batch is seq 0, starting with `AllBlocksCleared`.
//!
//! Replay (vLLM's protocol): a DEALER sends `[b"", start_seq as u64 big-endian]`; each buffered
//! batch with `seq >= start_seq` comes back as `[b"", topic, seq, payload]`, then
//! `[b"", b"", -1 as i64 big-endian, b""]` ends the answer.
//!
//! Sending awaits each subscriber's socket (the crate's PUB has no per-peer high-water mark), so
//! a subscriber that stops reading slows this task, never the engine: the queue in between
//! absorbs it, then loses batches visibly. Connect mode (endpoint without a wildcard): the PUB
//! dials the subscriber, retrying every second until it answers and again after it goes away.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

use super::encode::{frames, Encoder};
use super::{bind_address, is_bind_endpoint, KvEvent, KvEventsConfig, MAX_QUEUE};
use crate::faults::Faults;

/// How often a connect-mode PUB re-dials a subscriber that is not there.
const DIAL_EVERY: Duration = Duration::from_secs(1);
const DIAL_TIMEOUT: Duration = Duration::from_millis(500);
/// Re-binding a port just closed can fail briefly.
const REBIND_TRIES: u32 = 50;

/// What the engine sends to the publisher, in order.
#[derive(Debug)]
pub enum PubMsg {
    Batch {
        seq: u64,
        /// Wall-clock seconds since the epoch (vLLM's `time.time()`).
        ts: f64,
        events: Vec<KvEvent>,
    },
    /// The engine restarted: forget everything, re-open the sockets.
    Restart,
}

/// Counters of the event stream (shared by the engine, the publisher and the replay task).
#[derive(Debug, Default)]
pub struct PubStats {
    published: AtomicU64,
    dropped: AtomicU64,
    overflowed: AtomicU64,
    lost: AtomicU64,
    restarts: AtomicU64,
    replays: AtomicU64,
    /// Last seq sent + 1 (0: none yet).
    next_seq: AtomicU64,
}

/// A snapshot of [`PubStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct KvStats {
    /// Batches sent on the PUB socket.
    pub published: u64,
    /// Batches not sent because of the drop fault.
    pub dropped: u64,
    /// Batches not sent because more than `hwm` waited during a stall.
    pub overflowed: u64,
    /// Batches the engine could not queue (publisher more than `max_queue_size` behind).
    pub lost: u64,
    pub restarts: u64,
    /// Replay requests answered.
    pub replays: u64,
    /// Seq of the last batch sent.
    pub last_seq: Option<u64>,
}

impl PubStats {
    pub fn snapshot(&self) -> KvStats {
        let next = self.next_seq.load(Ordering::Relaxed);
        KvStats {
            published: self.published.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            overflowed: self.overflowed.load(Ordering::Relaxed),
            lost: self.lost.load(Ordering::Relaxed),
            restarts: self.restarts.load(Ordering::Relaxed),
            replays: self.replays.load(Ordering::Relaxed),
            last_seq: next.checked_sub(1),
        }
    }

    pub(crate) fn count_lost(&self) {
        self.lost.fetch_add(1, Ordering::Relaxed);
    }
}

/// `--kv-events-stall-after N --kv-events-stall-ms MS`: once, after N batches, stall for MS
/// (0: until switched off).
#[derive(Debug, Clone, Copy, Default)]
pub struct StallPlan {
    pub after: Option<u64>,
    pub ms: u64,
}

/// A started publisher: the sockets are bound, the task is ready to run.
pub struct Publisher {
    pub tx: mpsc::Sender<PubMsg>,
    /// The config as `/kv_event_sources` reports it: as configured, port 0 replaced by the
    /// port bound (the wildcard stays, so a subscriber knows to connect, as from vLLM).
    pub resolved: KvEventsConfig,
    /// The addresses a subscriber dials (`tcp://127.0.0.1:PORT` for `tcp://*:0`): the PUB
    /// endpoint and the replay endpoint, as bound.
    pub dial: (String, Option<String>),
    pub stats: Arc<PubStats>,
    pub task: Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("resolved", &self.resolved)
            .finish()
    }
}

fn zmq_err(e: zeromq::ZmqError) -> io::Error {
    io::Error::other(format!("kv events: {e}"))
}

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

fn lock(b: &Buffer) -> std::sync::MutexGuard<'_, VecDeque<(u64, Bytes)>> {
    b.lock().unwrap_or_else(|e| e.into_inner())
}

/// Binds `addr` (a concrete `tcp://` address), retrying a little if the port is still held.
async fn bind_retry<S: Socket>(sock: &mut S, addr: &str) -> io::Result<zeromq::Endpoint> {
    let mut attempt = 0;
    loop {
        match sock.bind(addr).await {
            Ok(ep) => return Ok(ep),
            Err(e) if attempt + 1 >= REBIND_TRIES => return Err(zmq_err(e)),
            Err(_) => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// Binds the sockets `cfg` names (PUB only in bind mode) and returns the task to run.
pub async fn start(
    cfg: &KvEventsConfig,
    host: &str,
    encoder: Encoder,
    faults: Faults,
    stall: StallPlan,
) -> io::Result<Publisher> {
    let mut resolved = cfg.clone();
    resolved.publisher = Some(super::PublisherKind::Zmq);
    let mut pub_sock = PubSocket::new();
    let (pub_bind, connect) = if is_bind_endpoint(&cfg.endpoint) {
        let ep = bind_retry(&mut pub_sock, &bind_address(&cfg.endpoint, host)).await?;
        resolved.endpoint = with_bound_port(&cfg.endpoint, &ep.to_string());
        (Some(ep.to_string()), None)
    } else {
        (None, Some(cfg.endpoint.clone()))
    };
    let buffer: Buffer = Arc::new(Mutex::new(VecDeque::new()));
    let stats = Arc::new(PubStats::default());
    let topic = Bytes::copy_from_slice(cfg.topic.as_bytes());
    let (replay_bind, replay) = match &cfg.replay_endpoint {
        Some(ep) => {
            let mut router = RouterSocket::new();
            let bound = bind_retry(&mut router, &bind_address(ep, host)).await?;
            resolved.replay_endpoint = Some(with_bound_port(ep, &bound.to_string()));
            let task = Replay::spawn(router, buffer.clone(), topic.clone(), stats.clone());
            (Some(bound.to_string()), Some(task))
        }
        None => (None, None),
    };
    let (tx, rx) = mpsc::channel(cfg.max_queue_size.clamp(1, MAX_QUEUE));
    let monitor = connect.as_ref().map(|_| monitor_of(&mut pub_sock));
    let dial = (
        pub_bind.clone().unwrap_or_else(|| cfg.endpoint.clone()),
        replay_bind.clone(),
    );
    let task = Task {
        rx,
        encoder,
        topic: cfg.topic.clone(),
        stall_rx: faults.kv_stall_watch(),
        faults,
        stats: stats.clone(),
        buffer,
        buffer_steps: cfg.buffer_steps,
        hwm: cfg.hwm,
        pub_sock,
        pub_bind,
        connect,
        connected: false,
        monitor,
        replay_bind,
        replay,
        pending: VecDeque::new(),
        received: 0,
        stall,
    };
    Ok(Publisher {
        tx,
        resolved,
        dial,
        stats,
        task: Box::pin(task.run()),
    })
}

/// `configured` with its port replaced by `bound`'s (`tcp://*:0` bound as
/// `tcp://127.0.0.1:5000` → `tcp://*:5000`). Reporting the bound address itself would drop the
/// wildcard, and an endpoint without one tells a subscriber (inferlb, by vLLM's rule) that the
/// publisher connects, so it should bind: both sides would bind and never meet.
fn with_bound_port(configured: &str, bound: &str) -> String {
    match (configured.rsplit_once(':'), bound.rsplit_once(':')) {
        (Some((base, _)), Some((_, port))) if configured.starts_with("tcp://") => {
            format!("{base}:{port}")
        }
        _ => configured.to_string(),
    }
}

type Monitor = Pin<Box<dyn Stream<Item = SocketEvent> + Send>>;

fn monitor_of(sock: &mut PubSocket) -> Monitor {
    Box::pin(sock.monitor())
}

struct Task {
    rx: mpsc::Receiver<PubMsg>,
    encoder: Encoder,
    topic: String,
    faults: Faults,
    stall_rx: watch::Receiver<bool>,
    stats: Arc<PubStats>,
    buffer: Buffer,
    buffer_steps: usize,
    hwm: usize,
    pub_sock: PubSocket,
    /// Concrete bind address of the PUB socket (bind mode).
    pub_bind: Option<String>,
    /// Subscriber to dial (connect mode).
    connect: Option<String>,
    connected: bool,
    monitor: Option<Monitor>,
    replay_bind: Option<String>,
    replay: Option<Replay>,
    /// Batches held back by a stall, in seq order.
    pending: VecDeque<(u64, Bytes)>,
    /// Batches received since start or the last restart.
    received: u64,
    stall: StallPlan,
}

impl Task {
    async fn run(mut self) {
        if self.connect.is_some() {
            self.dial().await;
        }
        let mut stall_open = true;
        loop {
            let dial_due = self.connect.is_some() && !self.connected;
            tokio::select! {
                m = self.rx.recv() => match m {
                    Some(PubMsg::Batch { seq, ts, events }) => self.on_batch(seq, ts, &events).await,
                    Some(PubMsg::Restart) => self.restart().await,
                    None => break,
                },
                r = self.stall_rx.changed(), if stall_open => match r {
                    Ok(()) => self.flush().await,
                    Err(_) => stall_open = false,
                },
                ev = next_event(&mut self.monitor), if self.monitor.is_some() => match ev {
                    Some(SocketEvent::Disconnected(_)) => self.connected = false,
                    Some(_) => {}
                    None => self.monitor = None,
                },
                _ = tokio::time::sleep(DIAL_EVERY), if dial_due => self.dial().await,
            }
        }
        self.close().await;
    }

    async fn dial(&mut self) {
        let Some(ep) = self.connect.clone() else {
            return;
        };
        match tokio::time::timeout(DIAL_TIMEOUT, self.pub_sock.connect(&ep)).await {
            Ok(Ok(())) => {
                self.connected = true;
                tracing::info!(endpoint = %ep, "kv events: connected to subscriber");
            }
            Ok(Err(e)) => tracing::debug!(endpoint = %ep, error = %e, "kv events: dial failed"),
            Err(_) => tracing::debug!(endpoint = %ep, "kv events: dial timed out"),
        }
    }

    fn stalled(&self) -> bool {
        *self.stall_rx.borrow()
    }

    async fn on_batch(&mut self, seq: u64, ts: f64, events: &[KvEvent]) {
        let payload = match self.encoder.encode_batch(ts, events) {
            Ok(p) => Bytes::from(p),
            Err(e) => {
                tracing::error!(error = %e, seq, "kv events: cannot encode batch");
                return;
            }
        };
        {
            let mut buf = lock(&self.buffer);
            buf.push_back((seq, payload.clone()));
            while buf.len() > self.buffer_steps {
                buf.pop_front();
            }
        }
        if self.stalled() {
            if self.pending.len() < self.hwm {
                self.pending.push_back((seq, payload));
            } else {
                self.stats.overflowed.fetch_add(1, Ordering::Relaxed);
            }
        } else {
            self.send(seq, payload).await;
        }
        self.received += 1;
        if self.stall.after == Some(self.received) {
            let ms = (self.stall.ms > 0).then_some(Duration::from_millis(self.stall.ms));
            self.faults.stall_kv_events(ms);
        }
    }

    /// Sends what a stall held back, unless still stalled.
    async fn flush(&mut self) {
        while !self.stalled() {
            let Some((seq, payload)) = self.pending.pop_front() else {
                break;
            };
            self.send(seq, payload).await;
        }
    }

    async fn send(&mut self, seq: u64, payload: Bytes) {
        if self.faults.kv_should_drop() {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let Ok(msg) = ZmqMessage::try_from(frames(&self.topic, seq, payload).to_vec()) else {
            return;
        };
        if let Err(e) = self.pub_sock.send(msg).await {
            tracing::warn!(error = %e, seq, "kv events: send failed");
            return;
        }
        self.stats.published.fetch_add(1, Ordering::Relaxed);
        self.stats
            .next_seq
            .store(seq.saturating_add(1), Ordering::Relaxed);
    }

    async fn restart(&mut self) {
        self.pending.clear();
        lock(&self.buffer).clear();
        self.received = 0;
        self.stats.next_seq.store(0, Ordering::Relaxed);
        self.stats.restarts.fetch_add(1, Ordering::Relaxed);
        if let Some(r) = self.replay.take() {
            r.stop().await;
        }
        let old = std::mem::replace(&mut self.pub_sock, PubSocket::new());
        let _ = old.close().await;
        if let Some(addr) = self.pub_bind.clone() {
            if let Err(e) = bind_retry(&mut self.pub_sock, &addr).await {
                tracing::error!(error = %e, %addr, "kv events: cannot re-bind after restart");
            }
        }
        if self.connect.is_some() {
            self.connected = false;
            self.monitor = Some(monitor_of(&mut self.pub_sock));
            self.dial().await;
        }
        if let Some(addr) = self.replay_bind.clone() {
            let mut router = RouterSocket::new();
            match bind_retry(&mut router, &addr).await {
                Ok(_) => {
                    let topic = Bytes::copy_from_slice(self.topic.as_bytes());
                    self.replay = Some(Replay::spawn(
                        router,
                        self.buffer.clone(),
                        topic,
                        self.stats.clone(),
                    ));
                }
                Err(e) => tracing::error!(error = %e, %addr, "kv events: cannot re-bind replay"),
            }
        }
        tracing::info!("kv events: publisher restarted (seq from 0)");
    }

    async fn close(mut self) {
        if let Some(r) = self.replay.take() {
            r.stop().await;
        }
        let _ = self.pub_sock.close().await;
    }
}

async fn next_event(m: &mut Option<Monitor>) -> Option<SocketEvent> {
    match m {
        Some(m) => m.next().await,
        None => std::future::pending().await,
    }
}

/// The replay server: its own task, so a replay never delays live publishing.
struct Replay {
    stop: oneshot::Sender<()>,
    join: JoinHandle<()>,
}

impl Replay {
    fn spawn(router: RouterSocket, buffer: Buffer, topic: Bytes, stats: Arc<PubStats>) -> Self {
        let (stop, stopped) = oneshot::channel();
        let join = tokio::spawn(serve_replay(router, buffer, topic, stats, stopped));
        Self { stop, join }
    }

    /// Stops the task and waits until its socket is closed.
    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.join.await;
    }
}

/// `start_seq` as vLLM reads it: a big-endian unsigned integer of any length.
fn parse_start(b: &[u8]) -> u64 {
    let (high, low) = b.split_at(b.len().saturating_sub(8));
    if high.iter().any(|&x| x != 0) {
        return u64::MAX;
    }
    low.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x))
}

async fn serve_replay(
    mut router: RouterSocket,
    buffer: Buffer,
    topic: Bytes,
    stats: Arc<PubStats>,
    mut stop: oneshot::Receiver<()>,
) {
    loop {
        let msg = tokio::select! {
            _ = &mut stop => break,
            m = router.recv() => m,
        };
        let frames = match msg {
            Ok(m) => m.into_vec(),
            Err(e) => {
                tracing::debug!(error = %e, "kv events: replay receive failed");
                continue;
            }
        };
        // [identity, empty delimiter, start_seq]
        let [id, _, start] = frames.as_slice() else {
            tracing::warn!(frames = frames.len(), "kv events: invalid replay request");
            continue;
        };
        let start = parse_start(start);
        let batches: Vec<(u64, Bytes)> = lock(&buffer)
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        let mut ok = true;
        for (seq, payload) in batches {
            let f = vec![
                id.clone(),
                Bytes::new(),
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            if !send_to(&mut router, f).await {
                ok = false;
                break;
            }
        }
        if ok {
            let end = vec![
                id.clone(),
                Bytes::new(),
                Bytes::new(),
                Bytes::copy_from_slice(&(-1i64).to_be_bytes()),
                Bytes::new(),
            ];
            if send_to(&mut router, end).await {
                stats.replays.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    let _ = router.close().await;
}

async fn send_to(router: &mut RouterSocket, frames: Vec<Bytes>) -> bool {
    let Ok(msg) = ZmqMessage::try_from(frames) else {
        return false;
    };
    match router.send(msg).await {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!(error = %e, "kv events: replay send failed");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_seq_reads_like_int_from_bytes() {
        assert_eq!(parse_start(&13u64.to_be_bytes()), 13);
        assert_eq!(parse_start(&[1, 0]), 256);
        assert_eq!(parse_start(&[]), 0);
        assert_eq!(parse_start(&[0; 12]), 0);
        assert_eq!(parse_start(&[1, 0, 0, 0, 0, 0, 0, 0, 0]), u64::MAX);
    }
}
