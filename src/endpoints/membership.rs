//! Membership: diff a desired backend set against the pool's members and swap in the result.
//!
//! [`Pool::reconcile`] is the one place membership changes. A backend is known by its base
//! URL; one whose configuration is unchanged stays as it is — its in-flight count, health,
//! ejection state and prefix-index records survive — while a new URL gets a fresh backend.
//! A backend that leaves is marked draining at once (no new request picks it: it is no longer
//! a member and `schedulable()` is false for slot hand-offs), its running requests and streams
//! finish on the `Arc`s they hold, and the removal hooks drop its per-backend state (prefix
//! index records, idle connections). Its slot id returns to the free list only when the last
//! reference to it is gone, so a newcomer never inherits a table row that is still in use;
//! every backend also starts its cache epochs in a range of its own, so records about a
//! departed backend can never match a newcomer in the same slot.
//!
//! The work per change is proportional to the set handed in (one hash lookup per desired
//! backend) plus what changed, never a rebuild of per-backend tables.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use super::{parse_base_url, Backend, Origin, Pool};
use crate::discovery::DesiredBackend;

/// Free slot ids, lowest first, so bit-mask words stay dense.
#[derive(Debug, Default)]
pub struct SlotIds {
    inner: Mutex<(BinaryHeap<Reverse<usize>>, usize)>,
}

impl SlotIds {
    fn take(&self) -> usize {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(Reverse(id)) = inner.0.pop() {
            return id;
        }
        let id = inner.1;
        inner.1 = inner.1.saturating_add(1);
        id
    }

    pub(super) fn release(&self, id: usize) {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.0.push(Reverse(id));
    }

    /// Ids handed out and not yet returned.
    pub fn in_use(&self) -> usize {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.1.saturating_sub(inner.0.len())
    }
}

/// What one reconciliation did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Change {
    pub added: usize,
    pub removed: usize,
    /// Same URL, new configuration: replaced by a fresh backend.
    pub updated: usize,
    /// Desired entries that could not be used (bad URL, unknown engine, duplicate).
    pub skipped: usize,
}

impl Change {
    pub fn is_empty(&self) -> bool {
        self.added == 0 && self.removed == 0 && self.updated == 0
    }
}

impl Pool {
    /// Make the members `desired` (from discovery `source`): keep the unchanged, add the new,
    /// drain the gone. Never blocks a request: readers keep the snapshot they hold.
    pub fn reconcile(&self, source: &'static str, desired: Vec<DesiredBackend>) -> Change {
        let _one_at_a_time = self
            .reconciling
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let current = self.members.load_full();
        let mut by_name: HashMap<&str, &Arc<Backend>> =
            current.iter().map(|b| (b.name.as_str(), b)).collect();
        // Most of a desired set is unchanged: find those by their URL as written, without
        // parsing it (a parse per entry per change dominated at 1,000 backends).
        let by_url: HashMap<&str, &Arc<Backend>> =
            current.iter().map(|b| (b.config.url.as_str(), b)).collect();
        let mut change = Change::default();
        let mut next: Vec<Arc<Backend>> = Vec::with_capacity(desired.len());
        let mut kept: HashSet<String> = HashSet::with_capacity(desired.len());
        let mut removed: Vec<Arc<Backend>> = Vec::new();
        for d in desired {
            if let Some(existing) = by_url.get(d.config.url.as_str()) {
                if existing.config == d.config && by_name.remove(existing.name.as_str()).is_some() {
                    next.push(Arc::clone(existing));
                    kept.insert(existing.name.clone());
                    continue;
                }
            }
            let name = match parse_base_url(&d.config.url) {
                Ok((scheme, authority)) => format!("{scheme}://{authority}"),
                Err(e) => {
                    tracing::warn!(source, error = %e, "skipping a discovered backend");
                    change.skipped += 1;
                    continue;
                }
            };
            if kept.contains(&name) {
                change.skipped += 1;
                continue;
            }
            let replacing = match by_name.remove(name.as_str()) {
                Some(existing) if existing.config == d.config => {
                    next.push(Arc::clone(existing));
                    kept.insert(name);
                    continue;
                }
                Some(existing) => {
                    removed.push(Arc::clone(existing));
                    true
                }
                None => false,
            };
            match self.build(source, d) {
                Some(b) => {
                    next.push(b);
                    kept.insert(name);
                    if replacing {
                        change.updated += 1;
                    } else {
                        change.added += 1;
                    }
                }
                None => {
                    change.skipped += 1;
                    if replacing {
                        change.removed += 1;
                    }
                }
            }
        }
        change.removed += by_name.len();
        removed.extend(by_name.into_values().map(Arc::clone));
        if change.is_empty() {
            return change;
        }
        // Keep the old order for those that stay (stable admin view), newcomers last.
        let order: HashMap<usize, usize> = current
            .iter()
            .enumerate()
            .map(|(i, b)| (b.uid, i))
            .collect();
        next.sort_by_key(|b| order.get(&b.uid).copied().unwrap_or(usize::MAX));
        self.members.store(Arc::new(next));
        for gone in &removed {
            gone.draining.store(true, Ordering::Release);
            tracing::info!(backend = %gone.name, source = gone.origin.source, "backend left the pool; draining");
            let hooks: Vec<_> = self
                .hooks
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            for hook in hooks {
                hook(gone);
            }
        }
        self.generation.send_modify(|g| *g = g.wrapping_add(1));
        change
    }

    fn build(&self, source: &'static str, d: DesiredBackend) -> Option<Arc<Backend>> {
        let Some(engine) = self.engine(&d.config.engine) else {
            tracing::warn!(source, url = %d.config.url, engine = %d.config.engine, "skipping a discovered backend: unknown engine");
            return None;
        };
        let id = self.slots.take();
        let built = {
            let mut tls = self.tls.lock().unwrap_or_else(PoisonError::into_inner);
            Backend::new(id, &d.config, engine, Arc::clone(&self.waiters), &mut tls)
        };
        match built {
            Ok(mut b) => {
                b.origin = Origin {
                    source,
                    labels: d.labels,
                    joined_at: SystemTime::now(),
                };
                b.release = Some(Arc::clone(&self.slots));
                tracing::info!(backend = %b.name, source, id, "backend joined the pool");
                Some(Arc::new(b))
            }
            Err(e) => {
                self.slots.release(id);
                tracing::warn!(source, error = %e, "skipping a discovered backend");
                None
            }
        }
    }

    /// Slot ids in use (members plus departed backends still referenced).
    pub fn slots_in_use(&self) -> usize {
        self.slots.in_use()
    }
}

/// Labels for the admin view.
pub fn labels_json(labels: &BTreeMap<String, String>) -> serde_json::Value {
    serde_json::Value::Object(
        labels
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::endpoints::BackendConfig;

    fn desired(urls: &[&str]) -> Vec<DesiredBackend> {
        urls.iter()
            .map(|u| DesiredBackend::new(BackendConfig::from_url(*u)))
            .collect()
    }

    fn pool() -> Pool {
        Pool::new(std::time::Duration::from_secs(1), Default::default(), None)
    }

    fn ids(p: &Pool) -> Vec<(String, usize)> {
        p.backends()
            .iter()
            .map(|b| (b.name.clone(), b.id))
            .collect()
    }

    #[test]
    fn unchanged_backends_keep_their_identity_and_state() {
        let p = pool();
        let c = p.reconcile("file", desired(&["http://a:1", "http://b:1"]));
        assert_eq!((c.added, c.removed), (2, 0));
        let a = Arc::clone(&p.backends()[0]);
        a.passive().record_success();
        assert!(p
            .reconcile("file", desired(&["http://a:1", "http://b:1"]))
            .is_empty());
        assert!(
            Arc::ptr_eq(&a, &p.backends()[0]),
            "same backend object kept"
        );
        let c = p.reconcile("file", desired(&["http://b:1", "http://a:1", "http://c:1"]));
        assert_eq!((c.added, c.removed, c.updated), (1, 0, 0));
        assert_eq!(
            ids(&p),
            vec![
                ("http://a:1".into(), 0),
                ("http://b:1".into(), 1),
                ("http://c:1".into(), 2)
            ]
        );
    }

    #[test]
    fn slot_ids_are_reused_only_after_the_last_reference_goes() {
        let p = pool();
        p.reconcile("file", desired(&["http://a:1", "http://b:1"]));
        let held_a = Arc::clone(&p.backends()[0]);
        let c = p.reconcile("file", desired(&["http://b:1"]));
        assert_eq!(c.removed, 1);
        assert!(held_a.is_draining());
        // a's slot 0 is still referenced (a running request): the newcomer gets slot 2.
        p.reconcile("file", desired(&["http://b:1", "http://c:1"]));
        assert_eq!(ids(&p)[1], ("http://c:1".into(), 2));
        assert_eq!(p.slots_in_use(), 3);
        drop(held_a);
        assert_eq!(p.slots_in_use(), 2);
        p.reconcile("file", desired(&["http://b:1", "http://c:1", "http://d:1"]));
        assert_eq!(ids(&p)[2], ("http://d:1".into(), 0), "freed slot 0 reused");
    }

    #[test]
    fn a_changed_configuration_replaces_and_bad_entries_are_skipped() {
        let p = pool();
        let hits = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&hits);
        p.on_removed(Arc::new(move |b: &Backend| {
            seen.lock().unwrap().push(b.name.clone())
        }));
        p.reconcile("file", desired(&["http://a:1"]));
        let old = Arc::clone(&p.backends()[0]);
        let mut keyed = desired(&["http://a:1", "not a url", "http://a:1"]);
        keyed[0].config.api_key = Some("k".into());
        let c = p.reconcile("file", keyed);
        assert_eq!((c.added, c.removed, c.updated, c.skipped), (0, 0, 1, 2));
        assert!(old.is_draining());
        assert!(!Arc::ptr_eq(&old, &p.backends()[0]));
        assert_eq!(*hits.lock().unwrap(), vec!["http://a:1".to_owned()]);
        let mut bad_engine = desired(&["http://a:1"]);
        bad_engine[0].config.engine = "nope".into();
        let c = p.reconcile("file", bad_engine);
        assert_eq!((c.skipped, c.removed), (1, 1));
        assert!(p.backends().is_empty());
    }

    #[test]
    fn newcomers_start_in_their_own_epoch_range() {
        let p = pool();
        p.reconcile("file", desired(&["http://a:1"]));
        let first = p.backends()[0].state().epoch;
        p.reconcile("file", desired(&[]));
        p.reconcile("file", desired(&["http://a:1"]));
        assert_ne!(p.backends()[0].state().epoch, first);
    }
}
