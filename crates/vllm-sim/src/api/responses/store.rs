//! The Responses store (`--responses-store`): vLLM's `response_store`, `msg_store`,
//! `event_store` and `background_tasks`, kept together per response id.
//!
//! vLLM keeps every response for the life of the process. Here the store holds at most
//! `--responses-store-limit` ids and drops the oldest-inserted first (re-storing an id makes it
//! the newest), so a long benchmark cannot grow without bound; [`crate::Stats`]'s
//! `responses_stored` reports the count.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use axum::body::Bytes;
use tokio::sync::watch;
use tokio::task::AbortHandle;

use super::protocol::{ResponseObject, Status};
use crate::engine::Shared;
use crate::tokenizer::ChatMessage;

/// One stored response.
#[derive(Debug)]
pub struct Entry {
    pub response: ResponseObject,
    /// The request's whole message list (system messages included), for a later
    /// `previous_response_id`.
    pub messages: Arc<Vec<ChatMessage>>,
    /// A background stream's events (replayed by `GET ?stream=true`).
    pub events: Option<Arc<EventLog>>,
    /// A background request's task (cancel aborts it).
    pub task: Option<AbortHandle>,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<String, (u64, Entry)>,
    /// Insertion order: (generation, id); stale generations are skipped on eviction.
    order: VecDeque<(u64, String)>,
    next_gen: u64,
}

#[derive(Debug)]
pub struct Store {
    inner: Mutex<Inner>,
    limit: usize,
    shared: Arc<Shared>,
}

/// What a cancel found.
#[derive(Debug)]
pub enum Cancel {
    NotFound,
    /// Not queued or in progress.
    NotCancellable,
    Cancelled(Box<ResponseObject>),
}

impl Store {
    pub fn new(limit: usize, shared: Arc<Shared>) -> Self {
        Self {
            inner: Mutex::default(),
            limit: limit.max(1),
            shared,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stores `entry` under its response id (replacing any entry of that id), evicting the
    /// oldest beyond the limit.
    pub fn insert(&self, entry: Entry) {
        self.insert_with_task(entry, None::<fn() -> AbortHandle>);
    }

    /// [`Self::insert`], with the entry's background task started by `spawn` while the store
    /// is locked: a cancel can never see the entry without its task, and the task cannot
    /// finish before its entry exists.
    pub fn insert_with_task(&self, mut entry: Entry, spawn: Option<impl FnOnce() -> AbortHandle>) {
        let mut g = self.lock();
        let id = entry.response.id.clone();
        let gen = g.next_gen;
        g.next_gen += 1;
        entry.task = spawn.map(|f| f());
        g.entries.insert(id.clone(), (gen, entry));
        g.order.push_back((gen, id));
        while g.entries.len() > self.limit {
            let Some((gen, id)) = g.order.pop_front() else {
                break;
            };
            if g.entries.get(&id).is_some_and(|(g2, _)| *g2 == gen) {
                g.entries.remove(&id);
            }
        }
        // Stale order slots (ids re-stored since) would otherwise pile up.
        if g.order.len() > 2 * self.limit {
            let Inner { entries, order, .. } = &mut *g;
            order.retain(|(gen, id)| entries.get(id).is_some_and(|(g2, _)| g2 == gen));
        }
        let n = g.entries.len();
        drop(g);
        self.shared.set_responses_stored(n);
    }

    /// The stored object of `id`.
    pub fn response(&self, id: &str) -> Option<ResponseObject> {
        self.lock().entries.get(id).map(|(_, e)| e.response.clone())
    }

    /// The stored object of `id` and its event log, if it has one.
    pub fn response_and_events(&self, id: &str) -> Option<(ResponseObject, Option<Arc<EventLog>>)> {
        self.lock()
            .entries
            .get(id)
            .map(|(_, e)| (e.response.clone(), e.events.clone()))
    }

    /// What a `previous_response_id` brings: the stored messages and object.
    pub fn history(&self, id: &str) -> Option<(Arc<Vec<ChatMessage>>, ResponseObject)> {
        self.lock()
            .entries
            .get(id)
            .map(|(_, e)| (e.messages.clone(), e.response.clone()))
    }

    /// A background request finished: its final object replaces the stored one unless that
    /// was cancelled meanwhile (vLLM's rule); an evicted entry is stored again.
    pub fn finish(&self, response: ResponseObject, messages: Arc<Vec<ChatMessage>>) {
        let mut g = self.lock();
        if let Some((_, e)) = g.entries.get_mut(&response.id) {
            if e.response.status != Status::Cancelled {
                e.response = response;
                e.task = None;
            }
            return;
        }
        drop(g);
        self.insert(Entry {
            response,
            messages,
            events: None,
            task: None,
        });
    }

    /// vLLM's cancel: a queued or in-progress response becomes `cancelled` and its task is
    /// aborted (which aborts the engine request).
    pub fn cancel(&self, id: &str) -> Cancel {
        let mut g = self.lock();
        let Some((_, e)) = g.entries.get_mut(id) else {
            return Cancel::NotFound;
        };
        if !matches!(e.response.status, Status::Queued | Status::InProgress) {
            return Cancel::NotCancellable;
        }
        e.response.status = Status::Cancelled;
        if let Some(task) = e.task.take() {
            task.abort();
        }
        Cancel::Cancelled(Box::new(e.response.clone()))
    }

    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A background stream's events, kept after it ends (vLLM's `event_store` deque + signal):
/// index = sequence number.
#[derive(Debug)]
pub struct EventLog {
    frames: Mutex<LogInner>,
    /// Bumped after every append; readers wait on it.
    tick: watch::Sender<u64>,
}

#[derive(Debug, Default)]
struct LogInner {
    frames: Vec<Bytes>,
    /// Index of the `response.completed` frame, once appended.
    completed: Option<usize>,
}

impl Default for EventLog {
    fn default() -> Self {
        Self {
            frames: Mutex::default(),
            tick: watch::channel(0).0,
        }
    }
}

impl EventLog {
    fn lock(&self) -> MutexGuard<'_, LogInner> {
        self.frames.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends frames; `completed` marks the last one as `response.completed`.
    pub fn append(&self, frames: Vec<String>, completed: bool) {
        let mut g = self.lock();
        g.frames.extend(frames.into_iter().map(Bytes::from));
        if completed {
            g.completed = Some(g.frames.len().saturating_sub(1));
        }
        drop(g);
        self.tick.send_modify(|v| *v += 1);
    }

    /// The frames from index `from`, and whether they end with `response.completed` (then
    /// the reader is done: vLLM's generator returns after yielding it).
    fn read(&self, from: usize) -> (Vec<Bytes>, bool) {
        let g = self.lock();
        let end = match g.completed {
            Some(c) if c >= from => c + 1,
            _ => g.frames.len(),
        };
        let frames = g.frames.get(from..end).map(<[Bytes]>::to_vec);
        (
            frames.unwrap_or_default(),
            g.completed.is_some_and(|c| c >= from),
        )
    }

    /// A body stream of the events from index `from`, following live ones until it has sent
    /// `response.completed`. Like vLLM's it waits forever when that never comes (a cancelled
    /// stream, or `from` past the end): only the client's disconnect ends it then.
    pub fn follow(
        self: Arc<Self>,
        from: usize,
    ) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Send {
        let rx = self.tick.subscribe();
        futures_util::stream::unfold(
            (self, rx, from, false),
            |(log, mut rx, at, done)| async move {
                if done {
                    return None;
                }
                loop {
                    rx.mark_unchanged();
                    let (frames, done) = log.read(at);
                    if !frames.is_empty() {
                        let at = at + frames.len();
                        let body: Vec<u8> = frames.concat();
                        return Some((Ok(Bytes::from(body)), (log, rx, at, done)));
                    }
                    // The sender lives in `log`, so this only fails if it is dropped.
                    if rx.changed().await.is_err() {
                        return None;
                    }
                }
            },
        )
    }
}
