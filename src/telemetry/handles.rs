//! Metric handles resolved once per label set and kept, instead of per request.
//!
//! `metrics::counter!(NAME, "backend" => …, "model" => …, "code" => …)` builds a key (owned
//! label strings), hashes it and looks it up in the recorder's registry on every call: a few
//! allocations and a sharded-map lookup per metric per request. The per-request series here —
//! requests by (backend, model, code), upstream responses by (backend, code), duration and
//! time to first byte by (backend, model) — have few label sets, so each handle is resolved
//! the first time its label set is met and found again by a lookup with borrowed strings.
//! Series with no label or a fixed one (scheduling duration, prefix match ratio, precise
//! candidates) are resolved once for the process.
//!
//! Readers never wait: the table is an `arc-swap` snapshot, replaced (copy, insert, store)
//! under a mutex only by the first request of a new label set. The labels come from the
//! backend set (a backend's configured URL, a model some backend lists, an HTTP status), so
//! the number of sets is bounded by the fleet; the table still stops growing at
//! [`MAX_ENTRIES`] (a fleet churning through many backends), after which new label sets are
//! registered per call as before. Counter and histogram series outlive departed backends in
//! the exporter anyway, so keeping their handles changes nothing on `/metrics`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use arc_swap::ArcSwap;
use metrics::{Counter, Histogram};

use super::{
    KV_PRECISE_DECISIONS, PREFIX_MATCH_RATIO, REQUESTS_TOTAL, REQUEST_DURATION,
    SCHEDULING_DURATION, TIME_TO_FIRST_BYTE, UPSTREAM_RESPONSES,
};

/// Label sets kept per table.
pub const MAX_ENTRIES: usize = 16_384;

/// Hashed with foldhash, not SipHash: three string lookups per request each hashed a backend
/// URL and a model name with SipHash, about 2.6 % of the proxy's user time under load. The
/// keys are the fleet's own names (see above), not a client's choice, so flooding does not
/// apply.
type Map<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// `first → second → code → handle`; tables without a second label or a code use `""` / 0.
type Table<V> = Map<String, Map<String, Map<u16, V>>>;

struct Cache<V> {
    table: ArcSwap<Table<V>>,
    /// Serialises the (rare) inserts and counts the entries; readers do not take it.
    insert: Mutex<usize>,
    cap: usize,
}

impl<V: Clone> Cache<V> {
    fn new(cap: usize) -> Self {
        Cache {
            table: ArcSwap::from_pointee(Table::default()),
            insert: Mutex::new(0),
            cap,
        }
    }

    fn get(&self, first: &str, second: &str, code: u16, make: impl FnOnce() -> V) -> V {
        if let Some(v) = self
            .table
            .load()
            .get(first)
            .and_then(|m| m.get(second))
            .and_then(|m| m.get(&code))
        {
            return v.clone();
        }
        let mut entries = self.insert.lock().unwrap_or_else(PoisonError::into_inner);
        // Another request may have inserted it meanwhile.
        let current = self.table.load_full();
        if let Some(v) = current
            .get(first)
            .and_then(|m| m.get(second))
            .and_then(|m| m.get(&code))
        {
            return v.clone();
        }
        let value = make();
        if *entries >= self.cap {
            return value;
        }
        let mut next: Table<V> = (*current).clone();
        next.entry(first.to_owned())
            .or_default()
            .entry(second.to_owned())
            .or_default()
            .insert(code, value.clone());
        self.table.store(Arc::new(next));
        *entries = entries.saturating_add(1);
        value
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        *self.insert.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The per-request handles of one (backend, model).
#[derive(Clone)]
pub struct Latency {
    pub duration: Histogram,
    pub first_byte: Histogram,
}

struct Caches {
    requests: Cache<Counter>,
    upstream: Cache<Counter>,
    latency: Cache<Latency>,
}

fn caches() -> &'static Caches {
    static CACHES: OnceLock<Caches> = OnceLock::new();
    CACHES.get_or_init(|| Caches {
        requests: Cache::new(MAX_ENTRIES),
        upstream: Cache::new(MAX_ENTRIES),
        latency: Cache::new(MAX_ENTRIES),
    })
}

/// `inferlb_requests_total{backend, model, code}`.
pub fn requests_total(backend: &str, model: &str, code: http::StatusCode) -> Counter {
    caches().requests.get(backend, model, code.as_u16(), || {
        metrics::counter!(REQUESTS_TOTAL, "backend" => backend.to_owned(), "model" => model.to_owned(), "code" => code.as_str().to_owned())
    })
}

/// `inferlb_upstream_responses_total{backend, code}`.
pub fn upstream_responses(backend: &str, code: http::StatusCode) -> Counter {
    caches().upstream.get(backend, "", code.as_u16(), || {
        metrics::counter!(UPSTREAM_RESPONSES, "backend" => backend.to_owned(), "code" => code.as_str().to_owned())
    })
}

/// `inferlb_request_duration_seconds` and `inferlb_time_to_first_byte_seconds` of
/// {backend, model}.
pub fn latency(backend: &str, model: &str) -> Latency {
    caches().latency.get(backend, model, 0, || Latency {
        duration: metrics::histogram!(REQUEST_DURATION, "backend" => backend.to_owned(), "model" => model.to_owned()),
        first_byte: metrics::histogram!(TIME_TO_FIRST_BYTE, "backend" => backend.to_owned(), "model" => model.to_owned()),
    })
}

/// `inferlb_scheduling_duration_seconds` (one record per scheduling pass).
pub fn scheduling_duration() -> &'static Histogram {
    static H: OnceLock<Histogram> = OnceLock::new();
    H.get_or_init(|| metrics::histogram!(SCHEDULING_DURATION))
}

/// `inferlb_prefix_match_ratio` (one record per pick).
pub fn prefix_match_ratio() -> &'static Histogram {
    static H: OnceLock<Histogram> = OnceLock::new();
    H.get_or_init(|| metrics::histogram!(PREFIX_MATCH_RATIO))
}

/// `inferlb_prefix_precise_candidates_total{source}`: `precise` or `approximate`.
pub fn precise_candidates(precise: bool) -> &'static Counter {
    static PRECISE: OnceLock<Counter> = OnceLock::new();
    static APPROXIMATE: OnceLock<Counter> = OnceLock::new();
    if precise {
        PRECISE.get_or_init(|| metrics::counter!(KV_PRECISE_DECISIONS, "source" => "precise"))
    } else {
        APPROXIMATE
            .get_or_init(|| metrics::counter!(KV_PRECISE_DECISIONS, "source" => "approximate"))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_label_set_is_resolved_once_and_found_again() {
        let cache: Cache<u32> = Cache::new(MAX_ENTRIES);
        let mut made = 0;
        for _ in 0..3 {
            let v = cache.get("b1", "m", 200, || {
                made += 1;
                7
            });
            assert_eq!(v, 7);
        }
        assert_eq!(made, 1);
        // Each label differs: a new entry each.
        assert_eq!(cache.get("b1", "m", 500, || 8), 8);
        assert_eq!(cache.get("b1", "n", 200, || 9), 9);
        assert_eq!(cache.get("b2", "m", 200, || 10), 10);
        assert_eq!(cache.get("b1", "m", 200, || 0), 7);
        assert_eq!(cache.len(), 4);
    }

    #[test]
    fn the_table_stops_growing_at_its_cap() {
        const CAP: usize = 50;
        let cache: Cache<usize> = Cache::new(CAP);
        for i in 0..CAP + 10 {
            assert_eq!(cache.get(&i.to_string(), "", 0, || i), i);
        }
        assert_eq!(cache.len(), CAP);
        // Beyond the cap the value is still made and returned, just not kept.
        let mut made = 0;
        for _ in 0..2 {
            cache.get("late", "", 0, || {
                made += 1;
                1
            });
        }
        assert_eq!(made, 2);
    }
}
