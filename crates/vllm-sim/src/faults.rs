//! Faults: failures a router must survive, switchable at run time.
//!
//! The same settings are reachable three ways: CLI flags (initial values), the [`Faults`]
//! handle (`SimHandle::faults()` in tests) and `POST /sim/faults` with a JSON patch (scripts).
//!
//! | fault | effect |
//! | --- | --- |
//! | `fail_rate` | that fraction of completion requests gets HTTP 500 (OpenAI error JSON) |
//! | `metrics_delay_ms` | `/metrics` answers only after this many wall-clock ms |
//! | `metrics_hang` | `/metrics` never answers |
//! | `metrics_garbage` | `/metrics` answers 200 with text that is not Prometheus exposition |
//! | `first_token_stall_ms` | the first token of every response is held back this long |
//! | `cut_stream_after` | a response body ends abruptly after N tokens (no `[DONE]`, broken chunked encoding); the request is aborted in the engine |
//! | `refuse_after` | when the N-th completion request arrives the listener is closed (new connections are refused); a later request on a kept-alive connection drops every open connection |
//! | `refuse_connections` | `true`: close the listener and drop every open connection now; `false`: re-bind the same port (and re-arm `refuse_after`) |
//! | `kv_events_drop_rate` | that fraction of KV-event batches is not sent (a sequence gap; the batch stays in the replay buffer) |
//! | `kv_events_stall` | `true`: publish no KV events (they wait, up to `hwm`, and go out in order on `false`); with `kv_events_stall_for_ms`, resume by itself after that long |
//! | `kv_events_restart` | `true`: the engine restarts — running requests are preempted, the prefix cache is wiped, the event sockets are re-opened and the sequence starts again at 0 with `AllBlocksCleared` |
//! | `kv_prefill_fail` | P/D prefill legs (`do_remote_decode`) die after computing: `"error"` answers 500, `"drop"` breaks the connection; either way no blocks stay held; `"none"` ends it |
//! | `kv_pull_refuse` | this server's `POST /kv_transfer/pull` refuses every pull (503); its held blocks stay until their lease ends |
//! | `kv_pull_fail` | this server's decode legs fail their pull without reaching the prefill server (a broken transfer); the held blocks there stay until their lease ends |
//!
//! Wall-clock fault durations are not divided by `--time-scale`: they exercise the router's
//! own timeouts, which run on the real clock.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};
use tokio::sync::watch;

const OFF: u64 = u64::MAX;

/// Runtime fault switches of one simulator (cheap to clone; all clones share state).
#[derive(Debug, Clone)]
pub struct Faults {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    fail_rate_bits: AtomicU64,
    metrics_delay_ms: AtomicU64,
    metrics_hang: AtomicBool,
    metrics_garbage: AtomicBool,
    first_token_stall_ms: AtomicU64,
    cut_stream_after: AtomicU64,
    refuse_after: AtomicU64,
    requests: AtomicU64,
    /// Desired listener state: true = refuse connections.
    refuse: watch::Sender<bool>,
    /// Bumped to drop every open connection.
    kill: watch::Sender<u64>,
    /// Actual listener state, published by the accept loop.
    listening: watch::Sender<bool>,
    kv_drop_rate_bits: AtomicU64,
    /// True while the KV-event stream is stalled.
    kv_stall: watch::Sender<bool>,
    /// Bumped by every stall, so a timed resume does not end a later stall.
    kv_stall_gen: AtomicU64,
    /// A [`PrefillFail`] as its discriminant.
    kv_prefill_fail: AtomicU8,
    kv_pull_refuse: AtomicBool,
    kv_pull_fail: AtomicBool,
}

/// How a P/D prefill leg dies (the `kv_prefill_fail` fault).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrefillFail {
    /// No fault.
    #[default]
    None,
    /// HTTP 500 after the prefill ran.
    Error,
    /// The connection breaks after the prefill ran (the process died).
    Drop,
}

/// A snapshot of all fault settings (what `GET /sim/faults` returns).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FaultSnapshot {
    pub fail_rate: f64,
    pub metrics_delay_ms: u64,
    pub metrics_hang: bool,
    pub metrics_garbage: bool,
    pub first_token_stall_ms: u64,
    pub cut_stream_after: Option<u64>,
    pub refuse_after: Option<u64>,
    pub refuse_connections: bool,
    pub listening: bool,
    pub requests_seen: u64,
    pub kv_events_drop_rate: f64,
    pub kv_events_stalled: bool,
    pub kv_prefill_fail: PrefillFail,
    pub kv_pull_refuse: bool,
    pub kv_pull_fail: bool,
}

/// A partial update (`POST /sim/faults`): absent fields stay as they are; `null` clears
/// `cut_stream_after` / `refuse_after`; `reset: true` first clears everything.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultPatch {
    #[serde(default)]
    pub reset: bool,
    pub fail_rate: Option<f64>,
    pub metrics_delay_ms: Option<u64>,
    pub metrics_hang: Option<bool>,
    pub metrics_garbage: Option<bool>,
    pub first_token_stall_ms: Option<u64>,
    #[serde(default, deserialize_with = "present")]
    pub cut_stream_after: Option<Option<u64>>,
    #[serde(default, deserialize_with = "present")]
    pub refuse_after: Option<Option<u64>>,
    pub refuse_connections: Option<bool>,
    /// With `refuse_connections: true`: re-bind automatically after this many ms.
    pub refuse_for_ms: Option<u64>,
    pub kv_events_drop_rate: Option<f64>,
    pub kv_events_stall: Option<bool>,
    /// With `kv_events_stall: true`: resume automatically after this many ms.
    pub kv_events_stall_for_ms: Option<u64>,
    /// Restart the engine (applied by the HTTP layer, which reaches the engine; see module doc).
    #[serde(default)]
    pub kv_events_restart: bool,
    pub kv_prefill_fail: Option<PrefillFail>,
    pub kv_pull_refuse: Option<bool>,
    pub kv_pull_fail: Option<bool>,
}

/// Distinguishes a field given as `null` (Some(None)) from an absent one (None).
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// What a completion request may do, given `refuse_after`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    Serve,
    /// Past the limit: the connection is being dropped.
    Refuse,
}

impl Default for Faults {
    fn default() -> Self {
        Self::new()
    }
}

fn opt(v: Option<u64>) -> u64 {
    v.unwrap_or(OFF)
}

fn unopt(v: u64) -> Option<u64> {
    (v != OFF).then_some(v)
}

fn clamp_rate(rate: f64) -> f64 {
    if rate.is_nan() {
        0.0
    } else {
        rate.clamp(0.0, 1.0)
    }
}

impl Faults {
    /// No faults.
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Inner {
                fail_rate_bits: AtomicU64::new(0f64.to_bits()),
                metrics_delay_ms: AtomicU64::new(0),
                metrics_hang: AtomicBool::new(false),
                metrics_garbage: AtomicBool::new(false),
                first_token_stall_ms: AtomicU64::new(0),
                cut_stream_after: AtomicU64::new(OFF),
                refuse_after: AtomicU64::new(OFF),
                requests: AtomicU64::new(0),
                refuse: watch::channel(false).0,
                kill: watch::channel(0).0,
                listening: watch::channel(false).0,
                kv_drop_rate_bits: AtomicU64::new(0f64.to_bits()),
                kv_stall: watch::channel(false).0,
                kv_stall_gen: AtomicU64::new(0),
                kv_prefill_fail: AtomicU8::new(PrefillFail::None as u8),
                kv_pull_refuse: AtomicBool::new(false),
                kv_pull_fail: AtomicBool::new(false),
            }),
        }
    }

    /// Fraction (clamped to 0–1) of completion requests answered with 500.
    pub fn set_fail_rate(&self, rate: f64) {
        self.inner
            .fail_rate_bits
            .store(clamp_rate(rate).to_bits(), Ordering::Relaxed);
    }
    pub fn set_metrics_delay(&self, d: Duration) {
        self.inner
            .metrics_delay_ms
            .store(d.as_millis() as u64, Ordering::Relaxed);
    }
    pub fn set_metrics_hang(&self, on: bool) {
        self.inner.metrics_hang.store(on, Ordering::Relaxed);
    }
    pub fn set_metrics_garbage(&self, on: bool) {
        self.inner.metrics_garbage.store(on, Ordering::Relaxed);
    }
    pub fn set_first_token_stall(&self, d: Duration) {
        self.inner
            .first_token_stall_ms
            .store(d.as_millis() as u64, Ordering::Relaxed);
    }
    /// End response bodies abruptly after `n` tokens (None: never).
    pub fn set_cut_stream_after(&self, n: Option<u64>) {
        self.inner.cut_stream_after.store(opt(n), Ordering::Relaxed);
    }
    /// Close the listener when the `n`-th completion request (counted from now) arrives.
    pub fn set_refuse_after(&self, n: Option<u64>) {
        self.inner.requests.store(0, Ordering::Relaxed);
        self.inner.refuse_after.store(opt(n), Ordering::Relaxed);
    }

    /// Fraction (clamped to 0–1) of KV-event batches not sent.
    pub fn set_kv_drop_rate(&self, rate: f64) {
        self.inner
            .kv_drop_rate_bits
            .store(clamp_rate(rate).to_bits(), Ordering::Relaxed);
    }

    /// Stops KV-event publishing; with `for_`, it resumes by itself after that long.
    pub fn stall_kv_events(&self, for_: Option<Duration>) {
        let gen = self.inner.kv_stall_gen.fetch_add(1, Ordering::Relaxed) + 1;
        self.inner.kv_stall.send_replace(true);
        if let Some(d) = for_ {
            let me = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(d).await;
                if me.inner.kv_stall_gen.load(Ordering::Relaxed) == gen {
                    me.resume_kv_events();
                }
            });
        }
    }

    /// Ends a KV-event stall: held-back batches go out in order.
    pub fn resume_kv_events(&self) {
        self.inner.kv_stall_gen.fetch_add(1, Ordering::Relaxed);
        self.inner.kv_stall.send_replace(false);
    }

    /// How P/D prefill legs die (see module doc).
    pub fn set_kv_prefill_fail(&self, how: PrefillFail) {
        self.inner
            .kv_prefill_fail
            .store(how as u8, Ordering::Relaxed);
    }
    /// This server refuses every pull of its held blocks.
    pub fn set_kv_pull_refuse(&self, on: bool) {
        self.inner.kv_pull_refuse.store(on, Ordering::Relaxed);
    }
    /// This server's decode legs fail their pulls.
    pub fn set_kv_pull_fail(&self, on: bool) {
        self.inner.kv_pull_fail.store(on, Ordering::Relaxed);
    }
    pub(crate) fn kv_prefill_fail(&self) -> PrefillFail {
        match self.inner.kv_prefill_fail.load(Ordering::Relaxed) {
            x if x == PrefillFail::Error as u8 => PrefillFail::Error,
            x if x == PrefillFail::Drop as u8 => PrefillFail::Drop,
            _ => PrefillFail::None,
        }
    }
    pub(crate) fn kv_pull_refuse(&self) -> bool {
        self.inner.kv_pull_refuse.load(Ordering::Relaxed)
    }
    pub(crate) fn kv_pull_fail(&self) -> bool {
        self.inner.kv_pull_fail.load(Ordering::Relaxed)
    }

    /// Closes the listener (connects are refused) and drops every open connection.
    pub fn refuse_connections(&self) {
        // Refusal first, kill second: the accept loop relies on this order (server.rs).
        self.inner.refuse.send_replace(true);
        self.inner.kill.send_modify(|k| *k += 1);
    }

    /// Re-binds the listener on the same address and re-arms `refuse_after`.
    pub fn accept_connections(&self) {
        self.inner.requests.store(0, Ordering::Relaxed);
        self.inner.refuse.send_replace(false);
    }

    /// Whether the listener is currently bound.
    pub fn is_listening(&self) -> bool {
        *self.inner.listening.borrow()
    }

    /// Waits until the accept loop has applied the state (`true`: bound and accepting).
    pub async fn wait_listening(&self, listening: bool) {
        let mut rx = self.inner.listening.subscribe();
        // Err only if the sender is dropped, which cannot happen while `self` lives.
        let _ = rx.wait_for(|l| *l == listening).await;
    }

    /// All settings now.
    pub fn snapshot(&self) -> FaultSnapshot {
        let i = &self.inner;
        FaultSnapshot {
            fail_rate: self.fail_rate(),
            metrics_delay_ms: i.metrics_delay_ms.load(Ordering::Relaxed),
            metrics_hang: i.metrics_hang.load(Ordering::Relaxed),
            metrics_garbage: i.metrics_garbage.load(Ordering::Relaxed),
            first_token_stall_ms: i.first_token_stall_ms.load(Ordering::Relaxed),
            cut_stream_after: unopt(i.cut_stream_after.load(Ordering::Relaxed)),
            refuse_after: unopt(i.refuse_after.load(Ordering::Relaxed)),
            refuse_connections: *i.refuse.borrow(),
            listening: self.is_listening(),
            requests_seen: i.requests.load(Ordering::Relaxed),
            kv_events_drop_rate: self.kv_drop_rate(),
            kv_events_stalled: *i.kv_stall.borrow(),
            kv_prefill_fail: self.kv_prefill_fail(),
            kv_pull_refuse: self.kv_pull_refuse(),
            kv_pull_fail: self.kv_pull_fail(),
        }
    }

    /// Applies a patch (see [`FaultPatch`]).
    pub fn apply(&self, p: &FaultPatch) {
        if p.reset {
            self.set_fail_rate(0.0);
            self.set_metrics_delay(Duration::ZERO);
            self.set_metrics_hang(false);
            self.set_metrics_garbage(false);
            self.set_first_token_stall(Duration::ZERO);
            self.set_cut_stream_after(None);
            self.set_refuse_after(None);
            self.set_kv_drop_rate(0.0);
            self.resume_kv_events();
            self.set_kv_prefill_fail(PrefillFail::None);
            self.set_kv_pull_refuse(false);
            self.set_kv_pull_fail(false);
        }
        if let Some(how) = p.kv_prefill_fail {
            self.set_kv_prefill_fail(how);
        }
        if let Some(on) = p.kv_pull_refuse {
            self.set_kv_pull_refuse(on);
        }
        if let Some(on) = p.kv_pull_fail {
            self.set_kv_pull_fail(on);
        }
        if let Some(r) = p.fail_rate {
            self.set_fail_rate(r);
        }
        if let Some(ms) = p.metrics_delay_ms {
            self.set_metrics_delay(Duration::from_millis(ms));
        }
        if let Some(on) = p.metrics_hang {
            self.set_metrics_hang(on);
        }
        if let Some(on) = p.metrics_garbage {
            self.set_metrics_garbage(on);
        }
        if let Some(ms) = p.first_token_stall_ms {
            self.set_first_token_stall(Duration::from_millis(ms));
        }
        if let Some(n) = p.cut_stream_after {
            self.set_cut_stream_after(n);
        }
        if let Some(n) = p.refuse_after {
            self.set_refuse_after(n);
        }
        if let Some(r) = p.kv_events_drop_rate {
            self.set_kv_drop_rate(r);
        }
        match p.kv_events_stall {
            Some(true) => self.stall_kv_events(p.kv_events_stall_for_ms.map(Duration::from_millis)),
            Some(false) => self.resume_kv_events(),
            None => {}
        }
        match p.refuse_connections {
            Some(true) => {
                self.refuse_connections();
                if let Some(ms) = p.refuse_for_ms {
                    let me = self.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                        me.accept_connections();
                    });
                }
            }
            Some(false) => self.accept_connections(),
            None => {}
        }
    }

    pub(crate) fn fail_rate(&self) -> f64 {
        f64::from_bits(self.inner.fail_rate_bits.load(Ordering::Relaxed))
    }

    /// Draws whether this request fails.
    pub(crate) fn should_fail(&self) -> bool {
        let r = self.fail_rate();
        r > 0.0 && fastrand::f64() < r
    }

    pub(crate) fn kv_drop_rate(&self) -> f64 {
        f64::from_bits(self.inner.kv_drop_rate_bits.load(Ordering::Relaxed))
    }

    /// Draws whether this KV-event batch is dropped.
    pub(crate) fn kv_should_drop(&self) -> bool {
        let r = self.kv_drop_rate();
        r > 0.0 && fastrand::f64() < r
    }

    pub(crate) fn kv_stall_watch(&self) -> watch::Receiver<bool> {
        self.inner.kv_stall.subscribe()
    }

    pub(crate) fn metrics_delay(&self) -> Duration {
        Duration::from_millis(self.inner.metrics_delay_ms.load(Ordering::Relaxed))
    }
    pub(crate) fn metrics_hang(&self) -> bool {
        self.inner.metrics_hang.load(Ordering::Relaxed)
    }
    pub(crate) fn metrics_garbage(&self) -> bool {
        self.inner.metrics_garbage.load(Ordering::Relaxed)
    }
    pub(crate) fn first_token_stall(&self) -> Duration {
        Duration::from_millis(self.inner.first_token_stall_ms.load(Ordering::Relaxed))
    }
    pub(crate) fn cut_stream_after(&self) -> Option<u64> {
        unopt(self.inner.cut_stream_after.load(Ordering::Relaxed))
    }

    /// Counts a completion request against `refuse_after` (see module doc).
    pub(crate) fn admit_request(&self) -> Admission {
        let limit = self.inner.refuse_after.load(Ordering::Relaxed);
        let n = self.inner.requests.fetch_add(1, Ordering::Relaxed) + 1;
        if limit == OFF || n < limit {
            return Admission::Serve;
        }
        if n == limit {
            // Serve this one, but accept no new connection after it.
            self.inner.refuse.send_replace(true);
            return Admission::Serve;
        }
        self.refuse_connections();
        Admission::Refuse
    }

    pub(crate) fn refuse_watch(&self) -> watch::Receiver<bool> {
        self.inner.refuse.subscribe()
    }
    pub(crate) fn kill_watch(&self) -> watch::Receiver<u64> {
        self.inner.kill.subscribe()
    }
    pub(crate) fn set_listening(&self, on: bool) {
        self.inner.listening.send_replace(on);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn patch_parses_and_applies() {
        let f = Faults::new();
        let p: FaultPatch = serde_json::from_str(
            r#"{"fail_rate":0.25,"metrics_hang":true,"cut_stream_after":3,"first_token_stall_ms":50}"#,
        )
        .unwrap();
        f.apply(&p);
        let s = f.snapshot();
        assert_eq!(s.fail_rate, 0.25);
        assert!(s.metrics_hang);
        assert_eq!(s.cut_stream_after, Some(3));
        assert_eq!(f.first_token_stall(), Duration::from_millis(50));
        let clear: FaultPatch = serde_json::from_str(r#"{"cut_stream_after":null}"#).unwrap();
        f.apply(&clear);
        assert_eq!(f.snapshot().cut_stream_after, None);
        assert!(f.snapshot().metrics_hang, "absent fields are untouched");
        f.apply(&FaultPatch {
            reset: true,
            ..FaultPatch::default()
        });
        assert!(!f.snapshot().metrics_hang);
        assert!(serde_json::from_str::<FaultPatch>(r#"{"nonsense":1}"#).is_err());
    }

    #[test]
    fn fail_rate_extremes() {
        let f = Faults::new();
        assert!(!(0..100).any(|_| f.should_fail()));
        f.set_fail_rate(1.0);
        assert!((0..100).all(|_| f.should_fail()));
        f.set_fail_rate(7.0);
        assert_eq!(f.fail_rate(), 1.0, "clamped");
    }

    #[test]
    fn refuse_after_counts_requests() {
        let f = Faults::new();
        f.set_refuse_after(Some(2));
        assert_eq!(f.admit_request(), Admission::Serve);
        assert!(!*f.refuse_watch().borrow());
        assert_eq!(f.admit_request(), Admission::Serve);
        assert!(
            *f.refuse_watch().borrow(),
            "listener closes at the N-th request"
        );
        assert_eq!(f.admit_request(), Admission::Refuse);
        f.accept_connections();
        assert!(!*f.refuse_watch().borrow());
        assert_eq!(f.admit_request(), Admission::Serve, "re-armed");
    }

    #[tokio::test(start_paused = true)]
    async fn kv_stall_resumes_by_itself_unless_stalled_again() {
        let f = Faults::new();
        let p: FaultPatch = serde_json::from_str(
            r#"{"kv_events_stall":true,"kv_events_stall_for_ms":100,"kv_events_drop_rate":0.5}"#,
        )
        .unwrap();
        f.apply(&p);
        assert!(f.snapshot().kv_events_stalled);
        assert_eq!(f.snapshot().kv_events_drop_rate, 0.5);
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert!(!f.snapshot().kv_events_stalled, "resumed after 100 ms");
        f.stall_kv_events(Some(Duration::from_millis(100)));
        tokio::time::sleep(Duration::from_millis(50)).await;
        f.stall_kv_events(None);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            f.snapshot().kv_events_stalled,
            "the first timer does not end the second stall"
        );
        f.apply(&FaultPatch {
            reset: true,
            ..FaultPatch::default()
        });
        assert!(!f.snapshot().kv_events_stalled);
        assert_eq!(f.kv_drop_rate(), 0.0);
        f.set_kv_drop_rate(1.0);
        assert!((0..50).all(|_| f.kv_should_drop()));
        let restart: FaultPatch = serde_json::from_str(r#"{"kv_events_restart":true}"#).unwrap();
        assert!(restart.kv_events_restart);
    }

    #[test]
    fn pd_faults_patch_and_reset() {
        let f = Faults::new();
        let p: FaultPatch = serde_json::from_str(
            r#"{"kv_prefill_fail":"drop","kv_pull_refuse":true,"kv_pull_fail":true}"#,
        )
        .unwrap();
        f.apply(&p);
        let s = f.snapshot();
        assert_eq!(s.kv_prefill_fail, PrefillFail::Drop);
        assert!(s.kv_pull_refuse && s.kv_pull_fail);
        f.apply(&serde_json::from_str(r#"{"kv_prefill_fail":"error"}"#).unwrap());
        assert_eq!(f.kv_prefill_fail(), PrefillFail::Error);
        f.apply(&FaultPatch {
            reset: true,
            ..FaultPatch::default()
        });
        let s = f.snapshot();
        assert_eq!(s.kv_prefill_fail, PrefillFail::None);
        assert!(!s.kv_pull_refuse && !s.kv_pull_fail);
        assert!(serde_json::from_str::<FaultPatch>(r#"{"kv_prefill_fail":"sometimes"}"#).is_err());
    }
}
