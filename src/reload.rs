//! Hot reload: put a new configuration in effect without a restart.
//!
//! What is replaced in place, for the requests that start after the swap (requests already
//! running finish under the settings they started with; no connection is dropped):
//! the scheduling profiles, plugin parameters and weights (plugin instances whose name, type
//! and parameters are unchanged are kept, with their state — the prefix index survives a
//! weight change), the per-backend and router-wide limits and the queue, retries and the retry
//! budget, outlier detection, authentication keys and per-client limits, body and message
//! limits, whether client `kv_transfer_params` pass, and the static `[[backends]]` (those that
//! stay keep their in-flight counts, health and prefix records). What needs a restart, and is reported when it differs: the listener
//! addresses, the discovery source, the poller's timing, logging, and connection-level
//! settings (timeouts, pools, TLS roots of the forwarder).
//!
//! An invalid configuration is refused whole, with a message naming the field, and the old
//! one keeps running. Outcomes are counted in `inferlb_config_reloads_total{result}`.

use std::sync::Arc;

use crate::config::Config;

use crate::discovery::DiscoverySource;

use crate::config_error::ConfigError;
use crate::discovery::DesiredBackend;
use crate::forward::Forwarder;
use crate::front_door::auth::Auth;
use crate::front_door::AppState;
use crate::scheduling::profile::build_active_reusing;
use crate::scheduling::{Scheduler, SchedulerLayer};
use crate::telemetry as t;

/// The swappable parts of a running router.
pub struct Live {
    /// The whole configuration in effect (what the next reload is compared with).
    pub config: arc_swap::ArcSwap<Config>,
    pub state: Arc<AppState>,
    pub scheduler: Arc<Scheduler>,
    pub layer: SchedulerLayer,
    pub forwarder: Forwarder,
}

impl Live {
    /// Validate `next` and, if it is valid, put it in effect; otherwise keep the running one.
    pub fn apply(&self, next: Config) {
        match self.try_apply(next) {
            Ok(notes) => {
                metrics::counter!(t::CONFIG_RELOADS, "result" => "ok").increment(1);
                tracing::info!(profile = %self.scheduler.profile().describe(), "configuration reloaded");
                for note in notes {
                    tracing::warn!("reload: {note}");
                }
            }
            Err(e) => {
                metrics::counter!(t::CONFIG_RELOADS, "result" => "error").increment(1);
                tracing::error!(error = %e, "configuration reload refused; the previous configuration stays in effect");
            }
        }
    }

    fn try_apply(&self, next: Config) -> Result<Vec<String>, ConfigError> {
        next.validate()?;
        let old = self.config.load_full();
        let profile = build_active_reusing(next.scheduling(), Some(&self.scheduler.profile()))?;
        let auth = Auth::with_priorities(&next.auth, &next.priority)?;
        // Everything is valid: swap.
        self.scheduler.set_profile(profile);
        self.state.auth.store(Arc::new(auth));
        self.layer.reload(
            &next.forward,
            &next.limits,
            &next.outlier_detection,
            &next.priority,
            &next.pd,
        );
        self.forwarder.set_outlier(&next.outlier_detection);
        if next.discovery.source == DiscoverySource::Static {
            let desired = next
                .backends
                .iter()
                .cloned()
                .map(DesiredBackend::new)
                .collect();
            let change = self.state.pool.reconcile("static", desired);
            if !change.is_empty() {
                tracing::info!(
                    added = change.added,
                    removed = change.removed,
                    updated = change.updated,
                    "static backends changed"
                );
            }
        }
        let notes = restart_only(&old, &next);
        self.state.config.store(Arc::new(next.front_door()));
        self.config.store(Arc::new(next));
        Ok(notes)
    }
}

/// Settings that differ between `old` and `next` but only take effect on a restart.
fn restart_only(old: &Config, next: &Config) -> Vec<String> {
    let mut notes = Vec::new();
    let mut differs = |field: &str, same: bool| {
        if !same {
            notes.push(format!("`{field}` changed; it takes effect on restart"));
        }
    };
    differs("listen", old.listen == next.listen);
    differs("admin_listen", old.admin_listen == next.admin_listen);
    differs(
        "discovery.source",
        old.discovery.source == next.discovery.source,
    );
    differs(
        "poller.interval_ms",
        old.poller.interval_ms == next.poller.interval_ms,
    );
    differs("log_level", old.log_level == next.log_level);
    differs(
        "forward.response_timeout_ms",
        old.forward.response_timeout_ms == next.forward.response_timeout_ms,
    );
    differs("kv_events", old.kv_events == next.kv_events);
    differs("server.workers", old.server.workers == next.server.workers);
    notes
}
