//! Finding the backend that holds a response: the table first, then a bounded round of
//! `GET /v1/responses/{id}` to the backends that can answer (see the module above for the
//! rules).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures_util::stream::{self, StreamExt};
use tokio::sync::{OnceCell, Semaphore};

use super::{count, Directory, Outcome, ResponsesConfig};
use crate::endpoints::Backend;

/// What a lookup concluded.
#[derive(Debug, Clone)]
pub enum Found {
    Holder(Arc<Backend>),
    /// Every backend that may hold it said it does not.
    Absent,
    /// No holder found, and some backend could not answer (or none could be asked).
    Unresolved,
}

/// One backend's answer to "do you have this response?".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    Has,
    HasNot,
    /// Error, timeout, refusal, or an answer that says neither.
    Unknown,
}

pub struct Lookup {
    pub directory: Arc<Directory>,
    running: Semaphore,
    timeout: Duration,
    concurrency: usize,
    /// Lookups under way, by id: a call for an id already being looked up waits for that
    /// answer instead of asking the fleet again (a burst of one conversation's calls after a
    /// restart costs one round). Locked only on this slow path, briefly.
    under_way: UnderWay,
}

/// Lookups under way: id → the answer its first caller is finding.
type UnderWay = Mutex<HashMap<Arc<str>, Arc<OnceCell<Found>>>>;

/// One caller's interest in a lookup under way; the last one out removes it, whether the
/// lookup finished or every caller went away.
struct Interest<'a> {
    under_way: &'a UnderWay,
    id: &'a str,
    cell: Arc<OnceCell<Found>>,
}

impl Drop for Interest<'_> {
    fn drop(&mut self) {
        let mut map = self
            .under_way
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let ours = map.get(self.id).is_some_and(|c| Arc::ptr_eq(c, &self.cell));
        // The map's reference and this one: nobody else waits.
        if ours && Arc::strong_count(&self.cell) <= 2 {
            map.remove(self.id);
        }
    }
}

impl Lookup {
    pub fn new(cfg: &ResponsesConfig) -> Self {
        Lookup {
            directory: Arc::new(Directory::new(cfg)),
            running: Semaphore::new(cfg.max_lookups),
            timeout: Duration::from_millis(cfg.lookup_timeout_ms),
            concurrency: cfg.lookup_concurrency,
            under_way: Mutex::default(),
        }
    }

    /// The member of `members` holding `id`; `probe` asks one backend.
    pub async fn holder<P, F>(&self, id: &str, members: &[Arc<Backend>], probe: P) -> Found
    where
        P: Fn(Arc<Backend>) -> F,
        F: Future<Output = Probe>,
    {
        if let Some(name) = self.directory.holder(id) {
            if let Some(backend) = members.iter().find(|b| *b.name == *name) {
                count(Outcome::Known);
                return Found::Holder(Arc::clone(backend));
            }
            // It left the fleet (or came back under another name): ask around.
            self.directory.forget(id);
        }
        if self.directory.known_absent(id) {
            count(Outcome::NotFound);
            return Found::Absent;
        }
        let interest = {
            let mut map = self
                .under_way
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            Interest {
                under_way: &self.under_way,
                id,
                cell: Arc::clone(map.entry(Arc::from(id)).or_default()),
            }
        };
        let found = interest
            .cell
            .get_or_init(|| async {
                let started = Instant::now();
                let found = self.ask(id, members, probe).await;
                metrics::histogram!(crate::telemetry::RESPONSES_LOOKUP_DURATION)
                    .record(started.elapsed().as_secs_f64());
                match &found {
                    Found::Holder(b) => self.directory.learn(id, &b.name),
                    Found::Absent => self.directory.note_absent(id),
                    Found::Unresolved => {}
                }
                found
            })
            .await
            .clone();
        drop(interest);
        count(match &found {
            Found::Holder(_) => Outcome::Found,
            Found::Absent => Outcome::NotFound,
            Found::Unresolved => Outcome::Unresolved,
        });
        // A holder found for another caller's member list may not be in this one's.
        match found {
            Found::Holder(b) if !members.iter().any(|m| Arc::ptr_eq(m, &b)) => Found::Unresolved,
            found => found,
        }
    }

    async fn ask<P, F>(&self, id: &str, members: &[Arc<Backend>], probe: P) -> Found
    where
        P: Fn(Arc<Backend>) -> F,
        F: Future<Output = Probe>,
    {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let Ok(Ok(_permit)) = tokio::time::timeout_at(deadline, self.running.acquire()).await
        else {
            tracing::warn!(id, "response lookup: too many lookups at once");
            return Found::Unresolved;
        };
        // Responses are made only by backends that serve whole requests (never by a prefill
        // backend, see `crate::pd`). One that cannot answer now may be the holder: then nobody
        // can say the id is unknown.
        let (asked, silent): (Vec<Arc<Backend>>, Vec<Arc<Backend>>) = members
            .iter()
            .filter(|b| b.role.serves_whole_requests())
            .cloned()
            .partition(|b| b.answers());
        if asked.is_empty() {
            return Found::Unresolved;
        }
        let mut unknown = !silent.is_empty();
        let probe = &probe;
        let mut answers = stream::iter(asked)
            .map(|b| async move { (Arc::clone(&b), probe(b).await) })
            .buffer_unordered(self.concurrency);
        loop {
            match tokio::time::timeout_at(deadline, answers.next()).await {
                Err(_) => {
                    tracing::warn!(
                        id,
                        "response lookup timed out (responses.lookup_timeout_ms)"
                    );
                    return Found::Unresolved;
                }
                Ok(None) if unknown => return Found::Unresolved,
                Ok(None) => return Found::Absent,
                Ok(Some((backend, Probe::Has))) => return Found::Holder(backend),
                Ok(Some((_, Probe::HasNot))) => {}
                Ok(Some((backend, Probe::Unknown))) => {
                    tracing::debug!(id, backend = %backend.name, "response lookup: no answer");
                    unknown = true;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::endpoints::test_support::healthy_backends;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn lookup() -> Lookup {
        Lookup::new(&ResponsesConfig::default())
    }

    #[tokio::test]
    async fn the_holder_is_found_remembered_and_asked_once() {
        let l = lookup();
        let members = healthy_backends(4);
        let holder = members[2].name.clone();
        let asked = AtomicUsize::new(0);
        let probe = |b: Arc<Backend>| {
            asked.fetch_add(1, Ordering::Relaxed);
            let has = b.name == holder;
            async move {
                if has {
                    Probe::Has
                } else {
                    Probe::HasNot
                }
            }
        };
        let Found::Holder(b) = l.holder("resp_1", &members, probe).await else {
            panic!("not found");
        };
        assert_eq!(b.name, holder);
        let before = asked.load(Ordering::Relaxed);
        assert!(matches!(
            l.holder("resp_1", &members, probe).await,
            Found::Holder(b) if b.name == holder
        ));
        assert_eq!(asked.load(Ordering::Relaxed), before, "the table answered");
        // The holder left: asked again, and nobody has it now.
        let without: Vec<_> = members
            .iter()
            .filter(|b| b.name != holder)
            .cloned()
            .collect();
        assert!(matches!(
            l.holder("resp_1", &without, probe).await,
            Found::Absent
        ));
        assert_eq!(l.directory.holder("resp_1"), None);
    }

    #[tokio::test]
    async fn absent_is_remembered_and_unknown_answers_leave_it_open() {
        let l = lookup();
        let members = healthy_backends(3);
        let asked = AtomicUsize::new(0);
        let none = |_b: Arc<Backend>| {
            asked.fetch_add(1, Ordering::Relaxed);
            async { Probe::HasNot }
        };
        assert!(matches!(
            l.holder("resp_2", &members, none).await,
            Found::Absent
        ));
        assert!(matches!(
            l.holder("resp_2", &members, none).await,
            Found::Absent
        ));
        assert_eq!(
            asked.load(Ordering::Relaxed),
            3,
            "the second answer came from memory"
        );
        let first_fails = |b: Arc<Backend>| {
            let fails = b.id == members[0].id;
            async move {
                if fails {
                    Probe::Unknown
                } else {
                    Probe::HasNot
                }
            }
        };
        assert!(matches!(
            l.holder("resp_3", &members, first_fails).await,
            Found::Unresolved
        ));
        assert!(matches!(
            l.holder("resp_3", &[], none).await,
            Found::Unresolved
        ));
    }

    #[tokio::test]
    async fn a_member_that_cannot_answer_leaves_it_open_and_prefill_backends_are_not_asked() {
        let l = lookup();
        let members = healthy_backends(3);
        let mut down = (*members[0].state()).clone();
        down.healthy = false;
        members[0].publish(down);
        let none = |_b: Arc<Backend>| async { Probe::HasNot };
        assert!(matches!(
            l.holder("resp_5", &members, none).await,
            Found::Unresolved
        ));
        // A prefill backend makes no responses: not asked, and not waited for.
        let mut cfg = members[0].config.clone();
        cfg.role = Some("prefill".into());
        let prefill = Arc::new(
            Backend::new(
                9,
                &cfg,
                crate::endpoints::engine::EngineMetricNames::builtin("vllm").unwrap(),
                Arc::default(),
                &mut crate::forward::tls::ClientConfigs::default(),
            )
            .unwrap(),
        );
        let fleet = vec![prefill, Arc::clone(&members[1]), Arc::clone(&members[2])];
        let asked = AtomicUsize::new(0);
        let counted = |_b: Arc<Backend>| {
            asked.fetch_add(1, Ordering::Relaxed);
            async { Probe::HasNot }
        };
        assert!(matches!(
            l.holder("resp_6", &fleet, counted).await,
            Found::Absent
        ));
        assert_eq!(asked.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn concurrent_lookups_of_one_id_ask_the_fleet_once() {
        let l = lookup();
        let members = healthy_backends(3);
        let holder = members[1].name.clone();
        let asked = AtomicUsize::new(0);
        let probe = |b: Arc<Backend>| {
            asked.fetch_add(1, Ordering::Relaxed);
            let has = b.name == holder;
            async move {
                // Let the other callers arrive while this round is under way.
                for _ in 0..4 {
                    tokio::task::yield_now().await;
                }
                if has {
                    Probe::Has
                } else {
                    Probe::HasNot
                }
            }
        };
        let (a, b, c) = tokio::join!(
            l.holder("resp_7", &members, probe),
            l.holder("resp_7", &members, probe),
            l.holder("resp_7", &members, probe),
        );
        for found in [a, b, c] {
            assert!(matches!(found, Found::Holder(b) if b.name == holder));
        }
        assert!(
            asked.load(Ordering::Relaxed) <= 3,
            "one round: {}",
            asked.load(Ordering::Relaxed)
        );
        assert!(l.under_way.lock().unwrap().is_empty());
        // Callers that all go away leave nothing behind either.
        let never = |_b: Arc<Backend>| std::future::pending::<Probe>();
        let gone = tokio::time::timeout(
            Duration::from_millis(1),
            l.holder("resp_8", &members, never),
        );
        assert!(gone.await.is_err());
        assert!(l.under_way.lock().unwrap().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_fleet_is_unresolved_at_the_deadline() {
        let l = lookup();
        let members = healthy_backends(2);
        let never = |_b: Arc<Backend>| std::future::pending::<Probe>();
        assert!(matches!(
            l.holder("resp_4", &members, never).await,
            Found::Unresolved
        ));
    }
}
