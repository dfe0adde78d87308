//! The subscriber loops: one task per backend with a configured stream, on a thread of its own.
//!
//! A loop resolves the backend's [`Source`] (for `auto`, `GET /kv_event_sources` on the backend),
//! opens a ZeroMQ SUB socket (connect, or bind when the engine connects), subscribes to the
//! topic and applies every message to the backend's [`BlockStore`]:
//! * the next sequence number: applied;
//! * a gap: the replay socket (DEALER, `[b"", start_seq]`) is asked for the missed messages;
//!   without one, or when it cannot fill the gap in time, the store is `unsure`;
//! * a sequence that goes backwards: the engine restarted, the store is cleared;
//! * once a second: expired in-flight blocks are dropped and the capacity follows the
//!   backend's `num_gpu_blocks`; a `silent` stream has its socket re-opened (and an `auto`
//!   source re-read), in case the engine moved.
//!
//! A connected SUB socket of `zeromq` 0.6 re-dials a publisher that went away and re-sends its
//! subscriptions, so a restarted engine on the same port is followed without a new socket.
//! The loops start and stop with pool membership ([`crate::endpoints::Pool::changes`]); a
//! backend that leaves has its loop aborted and its store turned off.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Uri};
use http_body_util::Full;
use tokio::sync::watch;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::store::{BlockStore, SeqCheck, Status};
use super::wire::{decode_payload, split_frames, END_OF_REPLAY};
use super::{parse_sources, Endpoint, KvEventsConfig, ReplayRule, Source};
use crate::clock::now_ms;
use crate::endpoints::{Backend, Pool};
use crate::telemetry as t;

/// The subscriber tasks of one router.
#[derive(Clone)]
pub struct Subscribers {
    pool: Arc<Pool>,
    cfg: Arc<KvEventsConfig>,
}

impl Subscribers {
    pub fn new(pool: Arc<Pool>, cfg: KvEventsConfig) -> Self {
        Subscribers {
            pool,
            cfg: Arc::new(cfg),
        }
    }

    /// Start the loops on a thread of their own with a single-threaded runtime (as the
    /// poller), so a flood of events never queues behind or in front of request handling.
    pub fn spawn(&self, shutdown: watch::Receiver<bool>) {
        let this = self.clone();
        let loops = move || this.supervise(shutdown);
        crate::background::spawn_on_own_thread("inferlb-kv-events", "KV-event", loops);
    }

    async fn supervise(self, mut shutdown: watch::Receiver<bool>) {
        let mut loops = tokio::task::JoinSet::new();
        let mut running: HashMap<usize, (tokio::task::AbortHandle, Arc<Backend>)> = HashMap::new();
        let mut changes = self.pool.changes();
        loop {
            let members = self.pool.backends();
            let live: HashSet<usize> = members.iter().map(|b| b.uid).collect();
            running.retain(|uid, (handle, backend)| {
                let keep = live.contains(uid);
                if !keep {
                    handle.abort();
                    backend.kv().turn_off();
                }
                keep
            });
            for backend in members.iter() {
                if running.contains_key(&backend.uid) {
                    continue;
                }
                let source = match Source::from_backend(&backend.config, &self.cfg) {
                    Ok(Source::Off) => continue,
                    Ok(source) => source,
                    Err(e) => {
                        tracing::warn!(backend = %backend.name, error = %e, "no KV-event stream");
                        continue;
                    }
                };
                let handle = loops.spawn(self.clone().run(Arc::clone(backend), source));
                running.insert(backend.uid, (handle, Arc::clone(backend)));
            }
            drop(members);
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { break },
                _ = shutdown.changed() => break,
                Some(_) = loops.join_next(), if !loops.is_empty() => {}
            }
        }
        loops.shutdown().await;
    }

    /// One backend's loop: (re)open the stream until aborted.
    async fn run(self, backend: Arc<Backend>, source: Source) {
        let store = backend.kv();
        let mut backoff = Duration::from_millis(200);
        loop {
            let resolved = match &source {
                Source::Off => return,
                Source::Fixed { stream, replay } => Ok((stream.clone(), replay.clone())),
                Source::Auto { replay } => {
                    let fetched = fetch_sources(&backend).await;
                    fetched.map(|(stream, found)| {
                        let replay = match replay {
                            None => None,
                            Some(ReplayRule::FromSources) => found,
                            Some(ReplayRule::Fixed(e)) => Some(e.clone()),
                        };
                        (stream, replay)
                    })
                }
            };
            let (stream, replay) = match resolved {
                Ok(r) => r,
                Err(e) => {
                    tracing::debug!(backend = %backend.name, error = %e, "KV-event source not found yet");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(10));
                    continue;
                }
            };
            store.turn_on(self.cfg.quiet_ms, stream.address.clone());
            match self.follow(&backend, &stream, replay.as_ref()).await {
                Ok(()) => backoff = Duration::from_millis(200),
                Err(e) => {
                    store.set_connected(false);
                    tracing::info!(backend = %backend.name, endpoint = %stream.address, error = %e, "KV-event stream interrupted");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(10));
                }
            }
        }
    }

    /// Subscribe and apply messages until the stream goes silent (Ok: re-open) or fails.
    async fn follow(
        &self,
        backend: &Backend,
        stream: &Endpoint,
        replay: Option<&Endpoint>,
    ) -> Result<(), zeromq::ZmqError> {
        let store = backend.kv();
        let mut sub = SubSocket::new();
        sub.subscribe(&self.cfg.topic).await?;
        if stream.bind {
            sub.bind(&stream.address).await?;
        } else {
            sub.connect(&stream.address).await?;
        }
        store.set_connected(true);
        tracing::info!(backend = %backend.name, endpoint = %stream.address, bind = stream.bind, "subscribed to KV events");
        let opened = now_ms();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                msg = sub.recv() => {
                    let msg = msg?;
                    self.handle(store, backend, msg, replay).await;
                }
                _ = tick.tick() => {
                    let now = now_ms();
                    store.purge_pending(now);
                    let gpu_blocks = backend
                        .state()
                        .metrics
                        .as_ref()
                        .and_then(|(m, _)| m.num_gpu_blocks);
                    store.set_gpu_blocks(gpu_blocks);
                    if store.status(now) == Status::Silent
                        && now.saturating_sub(opened) > self.cfg.quiet_ms
                    {
                        tracing::info!(backend = %backend.name, "KV-event stream silent; re-opening it");
                        return Ok(());
                    }
                }
            }
        }
    }

    async fn handle(
        &self,
        store: &BlockStore,
        backend: &Backend,
        msg: ZmqMessage,
        replay: Option<&Endpoint>,
    ) {
        let frames = msg.into_vec();
        let parts: Vec<&[u8]> = frames.iter().map(|b| &b[..]).collect();
        let Some((seq, payload)) = self.frame(store, &parts) else {
            return;
        };
        match store.check_seq(seq) {
            SeqCheck::InOrder => {}
            SeqCheck::Duplicate => return,
            SeqCheck::Restart => {
                tracing::info!(backend = %backend.name, seq, "KV-event sequence went back: engine restarted; clearing");
                metrics::counter!(t::KV_EVENT_RESETS).increment(1);
                store.restarted();
                if seq != 0 {
                    self.fill_gap(store, backend, replay, 0, seq).await;
                }
            }
            SeqCheck::Gap { from } => {
                self.fill_gap(store, backend, replay, from, seq).await;
            }
        }
        self.apply(store, seq, payload);
    }

    /// (seq, payload) of a well-formed message, counted as an error otherwise.
    fn frame<'a>(&self, store: &BlockStore, parts: &[&'a [u8]]) -> Option<(u64, &'a [u8])> {
        match split_frames(parts) {
            Ok((_, seq, payload)) if payload.len() <= self.cfg.max_message_bytes => {
                Some((seq, payload))
            }
            Ok(_) => {
                store.note_error();
                metrics::counter!(t::KV_EVENT_ERRORS, "kind" => "too_large").increment(1);
                None
            }
            Err(_) => {
                store.note_error();
                metrics::counter!(t::KV_EVENT_ERRORS, "kind" => "frames").increment(1);
                None
            }
        }
    }

    fn apply(&self, store: &BlockStore, seq: u64, payload: &[u8]) {
        match decode_payload(seq, payload) {
            Ok(batch) => {
                store.apply(seq, &batch.events, now_ms());
                metrics::counter!(t::KV_EVENT_MESSAGES).increment(1);
            }
            Err(e) => {
                tracing::debug!(seq, error = %e, "undecodable KV-event message");
                store.note_error();
                metrics::counter!(t::KV_EVENT_ERRORS, "kind" => "decode").increment(1);
            }
        }
    }

    /// Messages `from..until` were lost: replay them, or mark the store unsure.
    async fn fill_gap(
        &self,
        store: &BlockStore,
        backend: &Backend,
        replay: Option<&Endpoint>,
        from: u64,
        until: u64,
    ) {
        metrics::counter!(t::KV_EVENT_GAPS).increment(1);
        store.note_gap();
        let Some(replay) = replay else {
            tracing::info!(backend = %backend.name, from, until, "KV events lost and no replay endpoint: unsure until the cache turns over");
            store.mark_unsure();
            return;
        };
        let timeout = Duration::from_millis(self.cfg.replay_timeout_ms);
        let filled = tokio::time::timeout(timeout, self.replay(store, replay, from, until)).await;
        if !matches!(filled, Ok(Ok(true))) {
            tracing::info!(backend = %backend.name, from, until, "KV-event replay could not fill the gap: unsure until the cache turns over");
            store.mark_unsure();
        }
    }

    /// Ask the replay socket for `from..`; apply what it sends below `until`. True when every
    /// message of the gap was applied in order.
    async fn replay(
        &self,
        store: &BlockStore,
        endpoint: &Endpoint,
        from: u64,
        until: u64,
    ) -> Result<bool, zeromq::ZmqError> {
        let mut dealer = DealerSocket::new();
        dealer.connect(&endpoint.address).await?;
        let mut request = ZmqMessage::from(Bytes::new());
        request.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
        dealer.send(request).await?;
        let mut next = from;
        loop {
            let msg = dealer.recv().await?;
            let frames = msg.into_vec();
            let parts: Vec<&[u8]> = frames.iter().map(|b| &b[..]).collect();
            let Some((seq, payload)) = self.frame(store, &parts) else {
                continue;
            };
            if seq == END_OF_REPLAY {
                return Ok(next >= until);
            }
            if seq < next {
                continue;
            }
            if seq > next {
                return Ok(false);
            }
            if seq >= until {
                return Ok(true);
            }
            self.apply(store, seq, payload);
            next = seq.saturating_add(1);
            if next >= until {
                return Ok(true);
            }
        }
    }
}

/// `GET /kv_event_sources` on the backend: its stream and replay endpoints.
async fn fetch_sources(backend: &Backend) -> Result<(Endpoint, Option<Endpoint>), String> {
    let timeout = Duration::from_secs(5);
    let host = HeaderValue::from_str(backend.authority.as_str()).map_err(|e| e.to_string())?;
    let mut request = Request::new(Full::new(Bytes::new()));
    *request.uri_mut() = Uri::from_static("/kv_event_sources");
    request.headers_mut().insert(http::header::HOST, host);
    if let Some(auth) = &backend.authorization {
        request
            .headers_mut()
            .insert(http::header::AUTHORIZATION, auth.clone());
    }
    let exchange = async {
        let mut conn = backend.connector.connect(timeout).await?;
        conn.fetch(request, 64 * 1024).await
    };
    let (status, body) = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| "timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    if !status.is_success() {
        return Err(format!("/kv_event_sources answered {status}"));
    }
    let host = backend.authority.host();
    parse_sources(&body, host)
}

/// Set `inferlb_kv_streams{state}`: members by stream status (called when metrics render).
pub fn count_streams(pool: &Pool) {
    let now = now_ms();
    let mut counts = [0u32; Status::ALL.len()];
    for b in pool.backends().iter() {
        // `Status::ALL` lists the statuses in declaration order.
        if let Some(n) = counts.get_mut(b.kv().status(now) as usize) {
            *n = n.saturating_add(1);
        }
    }
    for (status, n) in Status::ALL.iter().zip(counts) {
        metrics::gauge!(t::KV_STREAMS, "state" => status.name()).set(f64::from(n));
    }
}
