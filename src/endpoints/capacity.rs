//! In-flight slots: the router's own count of requests on each backend, taken when a request
//! is picked (not when it is sent), and the queue of requests waiting for a slot.
//!
//! A [`Slot`] is one unit of a backend's in-flight count, reserved atomically under the
//! profile's per-backend limit, so concurrent decisions cannot all squeeze past it. Dropping
//! the slot frees it — and when requests are waiting, hands it straight to one waiter that may
//! use that backend: one freed slot wakes exactly one waiter, which then needs no new
//! decision.
//!
//! Which waiter: the highest priority class first; within a class, round-robin across
//! tenants (the tenant whose last hand-off in that class is oldest goes first, and a tenant
//! that had nothing waiting counts as never served), so one tenant's flood cannot starve
//! another's trickle; within a tenant, oldest first. When the router's queue is full an
//! arrival may shed one waiter to take its place: the lowest class below the arrival's, else,
//! in the same class, a waiter of a tenant with at least two more waiting than the
//! arrival's tenant (the heaviest tenant's newest request). A waiter registers *and then* checks for a free slot under the queue's lock,
//! and a release decrements *before* it looks for waiters, so no free slot is missed between
//! the two.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

use super::Backend;

/// The most priority classes a config may define (each is a metric label value):
/// the capacity queue keeps one waiting count per class.
pub const MAX_PRIORITY_CLASSES: usize = 8;

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
    /// Priority class, 0 = highest.
    class: u8,
    tenant: u64,
    /// Arrival order.
    seq: u64,
    tx: Mutex<Option<oneshot::Sender<Handed>>>,
}

/// What a waiter is sent.
enum Handed {
    Slot(Slot),
    /// Pushed out of the queue to make room for a request of a higher class (or of a tenant
    /// with fewer requests waiting).
    Shed,
}

/// How one request's wait ended.
pub enum Outcome {
    /// A slot was handed over.
    Slot(Slot),
    /// Shed from the queue for a more deserving request: answer 429.
    Shed,
    /// The queue went away.
    Closed,
}

/// Who a request is, for the queue: its class and its tenant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rank {
    /// 0 = highest; at most [`MAX_PRIORITY_CLASSES`] − 1 (clamped).
    pub class: u8,
    pub tenant: u64,
}

/// Per (class, tenant): requests waiting and when the tenant was last served in that class.
#[derive(Default)]
struct TenantState {
    waiting: usize,
    last_served: u64,
}

#[derive(Default)]
struct Queue {
    /// Arrival order.
    waiters: Vec<Arc<Waiter>>,
    /// Only tenants with a request waiting have an entry (so at most one per waiter).
    tenants: HashMap<(u8, u64), TenantState>,
    next_seq: u64,
    /// Bumped at each hand-off; a tenant's `last_served` is the value it got.
    served: u64,
}

impl Queue {
    fn remove(&mut self, pos: usize) -> Arc<Waiter> {
        let w = self.waiters.remove(pos);
        let key = (w.class, w.tenant);
        if let Some(t) = self.tenants.get_mut(&key) {
            t.waiting = t.waiting.saturating_sub(1);
            if t.waiting == 0 {
                self.tenants.remove(&key);
            }
        }
        w
    }

    fn waiting_of(&self, class: u8, tenant: u64) -> usize {
        self.tenants.get(&(class, tenant)).map_or(0, |t| t.waiting)
    }

    /// The waiter to serve next among those that may use `backend`: the highest class; within
    /// it the tenant served longest ago (round-robin across tenants; a tenant that had nothing
    /// waiting comes first); within the tenant the oldest request.
    fn next_for(&self, backend: usize) -> Option<usize> {
        self.waiters
            .iter()
            .enumerate()
            .filter(|(_, w)| w.eligible.contains(&backend))
            .min_by_key(|(_, w)| {
                let served = self
                    .tenants
                    .get(&(w.class, w.tenant))
                    .map_or(0, |t| t.last_served);
                (w.class, served, w.seq)
            })
            .map(|(i, _)| i)
    }

    /// The waiter to shed for an arrival of `rank`: the lowest class below it, else one of the
    /// same class whose tenant has at least two more requests waiting than the arrival's;
    /// among those the tenant with the most waiting, then the newest request.
    fn shed_for(&self, rank: Rank) -> Option<usize> {
        let mine = self.waiting_of(rank.class, rank.tenant);
        self.waiters
            .iter()
            .enumerate()
            .filter(|(_, w)| {
                w.class > rank.class
                    || (w.class == rank.class
                        && self.waiting_of(w.class, w.tenant) > mine.saturating_add(1))
            })
            .max_by_key(|(_, w)| (w.class, self.waiting_of(w.class, w.tenant), w.seq))
            .map(|(i, _)| i)
    }
}

/// Requests waiting for a slot. Shared by the backends of a pool.
#[derive(Default)]
pub struct Waiters {
    count: AtomicUsize,
    /// Waiting per class, for the per-class gauge.
    by_class: [AtomicUsize; MAX_PRIORITY_CLASSES],
    queue: Mutex<Queue>,
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
    rx: oneshot::Receiver<Handed>,
}

impl Wait {
    /// How the wait ended: a slot, shed, or the queue went away.
    pub async fn slot(&mut self) -> Outcome {
        match (&mut self.rx).await {
            Ok(Handed::Slot(slot)) => Outcome::Slot(slot),
            Ok(Handed::Shed) => Outcome::Shed,
            Err(_) => Outcome::Closed,
        }
    }
}

impl Drop for Wait {
    fn drop(&mut self) {
        let mut queue = self.waiters.lock();
        if let Some(pos) = queue.waiters.iter().position(|w| Arc::ptr_eq(w, &self.me)) {
            queue.remove(pos);
            self.waiters.left(self.me.class);
        }
        drop(queue);
        // A slot handed over but never taken (the wait timed out at that moment): free it.
        self.rx.close();
        if let Ok(Handed::Slot(slot)) = self.rx.try_recv() {
            drop(slot);
        }
    }
}

fn class_index(class: u8) -> usize {
    usize::from(class).min(MAX_PRIORITY_CLASSES - 1)
}

impl Waiters {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A waiter of `class` left the queue (served, shed, or gone).
    fn left(&self, class: u8) {
        self.count.fetch_sub(1, Ordering::SeqCst);
        self.by_class[class_index(class)].fetch_sub(1, Ordering::Relaxed);
    }

    /// Requests waiting now.
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Requests of `class` waiting now.
    pub fn len_of(&self, class: u8) -> usize {
        self.by_class[class_index(class)].load(Ordering::Relaxed)
    }

    /// Queue for a slot on any of `eligible` (all at `limit` when the decision was made).
    pub fn register(
        self: &Arc<Self>,
        eligible: &[Arc<Backend>],
        limit: Option<u64>,
        rank: Rank,
    ) -> Registration {
        let class = class_index(rank.class) as u8;
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
        self.by_class[usize::from(class)].fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let seq = queue.next_seq;
        queue.next_seq = seq.wrapping_add(1);
        let me = Arc::new(Waiter {
            eligible: eligible.iter().map(|b| b.id).collect(),
            limit,
            class,
            tenant: rank.tenant,
            seq,
            tx: Mutex::new(Some(tx)),
        });
        queue.waiters.push(Arc::clone(&me));
        queue
            .tenants
            .entry((class, rank.tenant))
            .or_default()
            .waiting += 1;
        Registration::Waiting(Wait {
            waiters: Arc::clone(self),
            me,
            rx,
        })
    }

    /// Make room for an arrival of `rank` by shedding one waiter that deserves its place less
    /// (see [`Queue::shed_for`]). Returns the shed waiter's class, `None` if nobody qualifies.
    pub fn shed_for(&self, rank: Rank) -> Option<u8> {
        let rank = Rank {
            class: class_index(rank.class) as u8,
            ..rank
        };
        let mut queue = self.lock();
        loop {
            let pos = queue.shed_for(rank)?;
            let waiter = queue.remove(pos);
            self.left(waiter.class);
            let tx = waiter
                .tx
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            // A waiter already gone does not make room: try the next.
            if tx.is_some_and(|tx| tx.send(Handed::Shed).is_ok()) {
                return Some(waiter.class);
            }
        }
    }

    /// `backend` just freed a slot: give it to exactly one waiter that may use it, chosen by
    /// [`Queue::next_for`].
    fn hand_off(&self, backend: &Arc<Backend>) {
        if self.count.load(Ordering::SeqCst) == 0 {
            return;
        }
        if !backend.schedulable() {
            return;
        }
        let mut queue = self.lock();
        while let Some(pos) = queue.next_for(backend.id) {
            let Some(slot) = Slot::try_reserve(backend, queue.waiters[pos].limit) else {
                // A new request took the slot first; the waiter gets the next one.
                return;
            };
            let waiter = queue.remove(pos);
            self.left(waiter.class);
            let tx = waiter
                .tx
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            match tx.map(|tx| tx.send(Handed::Slot(slot))) {
                Some(Ok(())) => {
                    queue.served = queue.served.wrapping_add(1);
                    let served = queue.served;
                    // The tenant's entry is gone when this was its last waiter; a tenant that
                    // returns later counts as not served recently.
                    if let Some(t) = queue.tenants.get_mut(&(waiter.class, waiter.tenant)) {
                        t.last_served = served;
                    }
                    return;
                }
                // The waiter is gone: take the slot back and try the next one.
                Some(Err(Handed::Slot(slot))) => {
                    slot.disarm();
                }
                Some(Err(Handed::Shed)) | None => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::endpoints::test_support::healthy_backends;

    async fn handed(wait: &mut Wait) -> Slot {
        match wait.slot().await {
            Outcome::Slot(slot) => slot,
            Outcome::Shed => panic!("shed"),
            Outcome::Closed => panic!("closed"),
        }
    }

    fn queued(waiters: &Arc<Waiters>, on: &Arc<Backend>, class: u8, tenant: u64) -> Wait {
        match waiters.register(&[Arc::clone(on)], Some(1), Rank { class, tenant }) {
            Registration::Waiting(w) => w,
            Registration::Retry => panic!("the backend is full"),
        }
    }

    /// Has this wait been handed something yet (without waiting)?
    fn ready(wait: &mut Wait) -> Option<Outcome> {
        use std::future::Future;
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let fut = std::pin::pin!(wait.slot());
        match fut.poll(&mut cx) {
            std::task::Poll::Ready(o) => Some(o),
            std::task::Poll::Pending => None,
        }
    }

    #[tokio::test]
    async fn higher_classes_are_served_first_one_waiter_per_slot() {
        let fleet = healthy_backends(1);
        let b = &fleet[0];
        let waiters = Arc::clone(b.waiters());
        let held = Slot::try_reserve(b, Some(1)).unwrap();
        let mut low = queued(&waiters, b, 2, 1);
        let mut mid = queued(&waiters, b, 1, 1);
        let mut high = queued(&waiters, b, 0, 1);
        assert_eq!(
            (waiters.len_of(0), waiters.len_of(1), waiters.len_of(2)),
            (1, 1, 1)
        );
        drop(held);
        let slot = handed(&mut high).await;
        assert!(
            ready(&mut mid).is_none() && ready(&mut low).is_none(),
            "one slot, one waiter"
        );
        drop(slot);
        let slot = handed(&mut mid).await;
        assert!(ready(&mut low).is_none());
        drop(slot);
        let slot = handed(&mut low).await;
        assert_eq!(b.inflight(), 1);
        assert_eq!(waiters.len(), 0);
        drop(slot);
        assert_eq!(b.inflight(), 0);
    }

    #[tokio::test]
    async fn tenants_take_turns_within_a_class() {
        let fleet = healthy_backends(1);
        let b = &fleet[0];
        let waiters = Arc::clone(b.waiters());
        let mut held = Slot::try_reserve(b, Some(1)).unwrap();
        let mut flood: std::collections::VecDeque<Wait> =
            (0..5).map(|_| queued(&waiters, b, 1, 7)).collect();
        let mut light = queued(&waiters, b, 1, 9);
        // The flood's oldest first (both tenants unserved, it arrived first), then the light
        // tenant, although four more of the flood are older.
        drop(held);
        held = handed(&mut flood[0]).await;
        flood.pop_front();
        assert!(ready(&mut light).is_none());
        drop(held);
        held = handed(&mut light).await;
        for w in &mut flood {
            assert!(ready(w).is_none(), "the light tenant's turn");
        }
        // The rest of the flood in its own order.
        for _ in 0..4 {
            drop(held);
            held = handed(&mut flood[0]).await;
            flood.pop_front();
        }
        drop(held);
        assert_eq!(waiters.len(), 0);
        assert_eq!(b.inflight(), 0);
    }

    #[tokio::test]
    async fn shedding_takes_the_lowest_class_then_the_heaviest_tenant() {
        let fleet = healthy_backends(1);
        let b = &fleet[0];
        let waiters = Arc::clone(b.waiters());
        let _held = Slot::try_reserve(b, Some(1)).unwrap();
        let mut batch_old = queued(&waiters, b, 2, 1);
        let mut batch_new = queued(&waiters, b, 2, 1);
        let mut standard = queued(&waiters, b, 1, 1);
        let arrival = |class, tenant| Rank { class, tenant };
        assert_eq!(waiters.shed_for(arrival(0, 5)), Some(2));
        assert!(
            matches!(ready(&mut batch_new), Some(Outcome::Shed)),
            "newest of the lowest"
        );
        assert!(ready(&mut batch_old).is_none());
        assert_eq!(waiters.shed_for(arrival(1, 5)), Some(2));
        assert!(matches!(ready(&mut batch_old), Some(Outcome::Shed)));
        // Nothing below standard is left, and tenant 1 has just one waiting: nobody is shed
        // for a standard arrival, nor for a batch one.
        assert_eq!(waiters.shed_for(arrival(1, 5)), None);
        assert_eq!(waiters.shed_for(arrival(2, 5)), None);
        assert!(ready(&mut standard).is_none());
        // A flood of tenant 1 in standard: a light tenant's arrival sheds the flood's newest.
        let mut flood: Vec<Wait> = (0..3).map(|_| queued(&waiters, b, 1, 1)).collect();
        assert_eq!(waiters.shed_for(arrival(1, 5)), Some(1));
        assert!(matches!(ready(&mut flood[2]), Some(Outcome::Shed)));
        assert!(ready(&mut flood[0]).is_none() && ready(&mut standard).is_none());
        // The flood's own arrivals never shed its own requests.
        assert_eq!(waiters.shed_for(arrival(1, 1)), None);
        assert_eq!(waiters.len(), 3);
        drop(flood);
        drop(standard);
        assert_eq!(waiters.len(), 0);
        assert_eq!((waiters.len_of(1), waiters.len_of(2)), (0, 0));
    }

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
        let Registration::Waiting(mut first) =
            waiters.register(&[Arc::clone(b)], Some(1), Rank::default())
        else {
            panic!("b is full")
        };
        let Registration::Waiting(mut second) =
            waiters.register(&[Arc::clone(a), Arc::clone(b)], Some(1), Rank::default())
        else {
            panic!("both are full")
        };
        let Registration::Waiting(mut third) =
            waiters.register(&[Arc::clone(a), Arc::clone(b)], Some(1), Rank::default())
        else {
            panic!("both are full")
        };
        assert_eq!(waiters.len(), 3);
        // a's slot: the first waiter cannot use a, the second can.
        drop(held_a);
        let got = handed(&mut second).await;
        assert_eq!(got.backend().id, a.id);
        assert_eq!(a.inflight(), 1, "handed over, not freed");
        assert_eq!(waiters.len(), 2);
        // b's slot goes to the first waiter (oldest), not the third.
        drop(held_b);
        let got_b = handed(&mut first).await;
        assert_eq!(got_b.backend().id, b.id);
        assert_eq!(waiters.len(), 1);
        // Freeing b again serves the third waiter: one waiter per freed slot.
        drop(got_b);
        assert_eq!(handed(&mut third).await.backend().id, b.id);
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
            waiters.register(&fleet, Some(1), Rank::default()),
            Registration::Retry
        ));
        assert_eq!(waiters.len(), 0);
    }
}
