//! Finding the backend that holds a response: the table first, then a bounded round of
//! `GET /v1/responses/{id}` to the schedulable backends (see the module above for the rules).

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::{self, StreamExt};
use tokio::sync::Semaphore;

use super::{count, Directory, Outcome, ResponsesConfig};
use crate::endpoints::Backend;

/// What a lookup concluded.
#[derive(Debug)]
pub enum Found {
    Holder(Arc<Backend>),
    /// Every schedulable backend said it does not have it.
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
}

impl Lookup {
    pub fn new(cfg: &ResponsesConfig) -> Self {
        Lookup {
            directory: Arc::new(Directory::new(cfg)),
            running: Semaphore::new(cfg.max_lookups),
            timeout: Duration::from_millis(cfg.lookup_timeout_ms),
            concurrency: cfg.lookup_concurrency,
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
        let started = Instant::now();
        let found = self.ask(id, members, probe).await;
        metrics::histogram!(crate::telemetry::RESPONSES_LOOKUP_DURATION)
            .record(started.elapsed().as_secs_f64());
        match &found {
            Found::Holder(b) => {
                self.directory.learn(id, &b.name);
                count(Outcome::Found);
            }
            Found::Absent => {
                self.directory.note_absent(id);
                count(Outcome::NotFound);
            }
            Found::Unresolved => count(Outcome::Unresolved),
        }
        found
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
