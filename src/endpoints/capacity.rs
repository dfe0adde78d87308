//! In-flight slots: the router's own count of requests on each backend, taken when a request
//! is picked (not when it is sent), and the FIFO of requests waiting for a slot.
//!
//! A [`Slot`] is one unit of a backend's in-flight count, reserved atomically under the
//! profile's per-backend limit, so concurrent decisions cannot all squeeze past it. Dropping
//! the slot frees it — and when requests are waiting, hands it straight to the oldest waiter
//! that may use that backend: one freed slot wakes one waiter, which then needs no new
//! decision. A waiter registers *and then* checks for a free slot under the queue's lock,
//! and a release decrements *before* it looks for waiters, so no free slot is missed between
//! the two.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

use super::Backend;

/// One reserved unit of a backend's in-flight count; freed on drop.
#[derive(Debug)]
pub struct Slot {
    backend: Option<Arc<Backend>>,
    /// This slot carries the probe request of a backend on probation.
    probe: bool,
}

impl Slot {
    /// Reserve a slot on `backend` if it has fewer than `limit` requests in flight (no limit:
    /// always).
    pub fn try_reserve(backend: &Arc<Backend>, limit: Option<u64>) -> Option<Slot> {
        backend.try_add_inflight(limit).then(|| Slot {
            backend: Some(Arc::clone(backend)),
            probe: false,
        })
    }

    pub fn backend(&self) -> &Arc<Backend> {
        // Only `disarm` takes the backend out, and it consumes the slot.
        self.backend.as_ref().unwrap_or_else(|| unreachable!())
    }

    /// Mark this slot as carrying the backend's probe request.
    pub fn set_probe(&mut self) {
        self.probe = true;
    }

    pub fn is_probe(&self) -> bool {
        self.probe
    }

    /// Give up the slot without handing it on (used while holding the waiters' lock).
    fn disarm(mut self) -> Arc<Backend> {
        let backend = self.backend.take().unwrap_or_else(|| unreachable!());
        if self.probe {
            backend.passive().release_probe();
        }
        backend.sub_inflight();
        backend
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(backend) = self.backend.take() {
            if self.probe {
                // No-op when the probe's outcome was recorded already.
                backend.passive().release_probe();
            }
            backend.sub_inflight();
            backend.waiters().hand_off(&backend);
        }
    }
}

/// A request waiting for a slot on any of `eligible`.
struct Waiter {
    eligible: Vec<usize>,
    limit: Option<u64>,
    tx: Mutex<Option<oneshot::Sender<Slot>>>,
}

/// Requests waiting for a slot, oldest first. Shared by the backends of a pool.
#[derive(Default)]
pub struct Waiters {
    count: AtomicUsize,
    queue: Mutex<VecDeque<Arc<Waiter>>>,
}

impl std::fmt::Debug for Waiters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiters")
            .field("count", &self.count.load(Ordering::Relaxed))
            .finish()
    }
}

/// The outcome of [`Waiters::register`].
pub enum Registration {
    /// A slot freed up before registration completed: decide again.
    Retry,
    /// Queued; await [`Wait::slot`].
    Waiting(Wait),
}

/// A place in the waiters' queue; dropping it leaves the queue.
pub struct Wait {
    waiters: Arc<Waiters>,
    me: Arc<Waiter>,
    rx: oneshot::Receiver<Slot>,
}

impl Wait {
    /// The slot handed to this waiter; `None` if the queue went away.
    pub async fn slot(&mut self) -> Option<Slot> {
        (&mut self.rx).await.ok()
    }
}

impl Drop for Wait {
    fn drop(&mut self) {
        let mut queue = self.waiters.lock();
        let before = queue.len();
        queue.retain(|w| !Arc::ptr_eq(w, &self.me));
        if queue.len() < before {
            self.waiters.count.fetch_sub(1, Ordering::SeqCst);
        }
        drop(queue);
        // A slot handed over but never taken (the wait timed out at that moment): free it.
        self.rx.close();
        if let Ok(slot) = self.rx.try_recv() {
            drop(slot);
        }
    }
}

impl Waiters {
    fn lock(&self) -> MutexGuard<'_, VecDeque<Arc<Waiter>>> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Requests waiting now.
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Queue for a slot on any of `eligible` (all at `limit` when the decision was made).
    pub fn register(
        self: &Arc<Self>,
        eligible: &[Arc<Backend>],
        limit: Option<u64>,
    ) -> Registration {
        self.count.fetch_add(1, Ordering::SeqCst);
        let mut queue = self.lock();
        // Checked after announcing ourselves (count) and under the lock: a release that
        // happened before is seen here, one that happens after finds us in the queue.
        let free = eligible
            .iter()
            .any(|b| limit.is_none_or(|l| b.inflight_seq() < l));
        if free {
            drop(queue);
            self.count.fetch_sub(1, Ordering::SeqCst);
            return Registration::Retry;
        }
        let (tx, rx) = oneshot::channel();
        let me = Arc::new(Waiter {
            eligible: eligible.iter().map(|b| b.id).collect(),
            limit,
            tx: Mutex::new(Some(tx)),
        });
        queue.push_back(Arc::clone(&me));
        Registration::Waiting(Wait {
            waiters: Arc::clone(self),
            me,
            rx,
        })
    }

    /// `backend` just freed a slot: give one to the oldest waiter that may use it.
    fn hand_off(&self, backend: &Arc<Backend>) {
        if self.count.load(Ordering::SeqCst) == 0 {
            return;
        }
        if !backend.schedulable() {
            return;
        }
        let mut queue = self.lock();
        while let Some(pos) = queue.iter().position(|w| w.eligible.contains(&backend.id)) {
            let Some(slot) = Slot::try_reserve(backend, queue[pos].limit) else {
                // A new request took the slot first; the waiter gets the next one.
                return;
            };
            let Some(waiter) = queue.remove(pos) else {
                return;
            };
            self.count.fetch_sub(1, Ordering::SeqCst);
            let tx = waiter
                .tx
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            match tx.map(|tx| tx.send(slot)) {
                Some(Ok(())) => return,
                // The waiter is gone: take the slot back and try the next one.
                Some(Err(slot)) => {
                    slot.disarm();
                }
                None => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::endpoints::test_support::healthy_backends;

    #[test]
    fn reserve_respects_the_limit_exactly() {
        let b = healthy_backends(1).remove(0);
        let slots: Vec<_> = (0..3)
            .map(|_| Slot::try_reserve(&b, Some(3)).unwrap())
            .collect();
        assert!(Slot::try_reserve(&b, Some(3)).is_none());
        assert_eq!(b.inflight(), 3);
        drop(slots);
        assert_eq!(b.inflight(), 0);
        assert!(Slot::try_reserve(&b, None).is_some());
    }

    #[test]
    fn concurrent_reservations_never_pass_the_limit() {
        let b = healthy_backends(1).remove(0);
        let taken = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..1000 {
                        if let Some(slot) = Slot::try_reserve(&b, Some(5)) {
                            assert!(b.inflight() <= 5);
                            taken.lock().unwrap().push(slot);
                        }
                    }
                });
            }
        });
        assert_eq!(taken.lock().unwrap().len(), 5);
    }

    #[tokio::test]
    async fn a_freed_slot_goes_to_the_oldest_eligible_waiter_only() {
        let fleet = healthy_backends(2);
        let (a, b) = (&fleet[0], &fleet[1]);
        let waiters = Arc::clone(a.waiters());
        let held_a = Slot::try_reserve(a, Some(1)).unwrap();
        let held_b = Slot::try_reserve(b, Some(1)).unwrap();
        let Registration::Waiting(mut first) = waiters.register(&[Arc::clone(b)], Some(1)) else {
            panic!("b is full")
        };
        let Registration::Waiting(mut second) =
            waiters.register(&[Arc::clone(a), Arc::clone(b)], Some(1))
        else {
            panic!("both are full")
        };
        let Registration::Waiting(mut third) =
            waiters.register(&[Arc::clone(a), Arc::clone(b)], Some(1))
        else {
            panic!("both are full")
        };
        assert_eq!(waiters.len(), 3);
        // a's slot: the first waiter cannot use a, the second can.
        drop(held_a);
        let got = second.slot().await.unwrap();
        assert_eq!(got.backend().id, a.id);
        assert_eq!(a.inflight(), 1, "handed over, not freed");
        assert_eq!(waiters.len(), 2);
        // b's slot goes to the first waiter (oldest), not the third.
        drop(held_b);
        let got_b = first.slot().await.unwrap();
        assert_eq!(got_b.backend().id, b.id);
        assert_eq!(waiters.len(), 1);
        // Freeing b again serves the third waiter: one waiter per freed slot.
        drop(got_b);
        assert_eq!(third.slot().await.unwrap().backend().id, b.id);
        assert_eq!(waiters.len(), 0);
        assert_eq!(b.inflight(), 0, "the third's slot was dropped at once");
        drop(got);
        assert_eq!(a.inflight(), 0);
    }

    #[test]
    fn registering_when_a_slot_is_free_says_retry() {
        let fleet = healthy_backends(1);
        let waiters = Arc::clone(fleet[0].waiters());
        assert!(matches!(
            waiters.register(&fleet, Some(1)),
            Registration::Retry
        ));
        assert_eq!(waiters.len(), 0);
    }
}
