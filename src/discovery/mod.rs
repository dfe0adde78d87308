//! Discovery: where the backend set comes from, and how it is kept up to date.
//!
//! A [`Discovery`] source yields the *desired* set of backends — the whole set each time, the
//! way pingora's `ServiceDiscovery` does — and [`run`] hands every new set to
//! [`Pool::reconcile`](crate::endpoints::Pool::reconcile), the one place that diffs it against
//! the current members and starts or stops per-backend work. Sources:
//!
//! * `static` — `[[backends]]` / `--backend`, fixed until a config reload;
//! * `file` — a TOML (`[[backends]]`) or JSON (a list of the same objects) file, re-read when it
//!   changes; a file that does not parse keeps the last good set;
//! * `dns` — a name re-resolved every interval (a headless Service), one backend per address;
//! * `kubernetes` — Pods by namespace and label selector, or the Pods an `InferencePool`
//!   selects, followed with the API server's list + watch.
//!
//! A source never blocks the request path: it runs in its own task and only swaps in a new
//! membership snapshot.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::watch;

use crate::config_error::ConfigError;
use crate::endpoints::BackendConfig;
use crate::endpoints::Pool;
use crate::telemetry as t;

/// One backend a source wants in the pool.
#[derive(Debug, Clone, PartialEq)]
pub struct DesiredBackend {
    /// Its URL, credentials, engine and (optionally) fixed models.
    pub config: BackendConfig,
    /// Where it came from, e.g. `pod=vllm-0`, `namespace=prod` (shown in the admin view).
    pub labels: BTreeMap<String, String>,
}

impl DesiredBackend {
    pub fn new(config: BackendConfig) -> Self {
        DesiredBackend {
            config,
            labels: BTreeMap::new(),
        }
    }
}

/// Why a source could not produce a set this time (the last good set stays).
#[derive(Debug, thiserror::Error)]
#[error("{source_name} discovery: {message}")]
pub struct DiscoveryError {
    pub source_name: &'static str,
    pub message: String,
}

pub type NextSet<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<DesiredBackend>, DiscoveryError>> + Send + 'a>>;

/// A source of the desired backend set.
pub trait Discovery: Send + 'static {
    /// `"static"`, `"file"`, `"dns"`, `"kubernetes"`: for logs, metrics and the admin view.
    fn source(&self) -> &'static str;
    /// Wait until the desired set may have changed and return it whole. The first call
    /// returns the initial set as soon as it is known.
    fn next(&mut self) -> NextSet<'_>;
}

/// Follow `source` until `stop` turns true, reconciling the pool with every set it yields.
/// An error is logged and counted (`inferlb_discovery_errors_total{source}`); the pool keeps
/// its last good membership.
pub async fn run(mut source: Box<dyn Discovery>, pool: Arc<Pool>, mut stop: watch::Receiver<bool>) {
    let name = source.source();
    loop {
        let next = tokio::select! {
            next = source.next() => next,
            _ = stop.changed() => return,
        };
        match next {
            Ok(set) => {
                let change = pool.reconcile(name, set);
                if !change.is_empty() {
                    tracing::info!(
                        source = name,
                        added = change.added,
                        removed = change.removed,
                        updated = change.updated,
                        "backend set changed"
                    );
                }
            }
            Err(e) => {
                metrics::counter!(t::DISCOVERY_ERRORS, "source" => name).increment(1);
                tracing::warn!(error = %e, "discovery failed; keeping the last good backend set");
            }
        }
        if *stop.borrow() {
            return;
        }
    }
}

/// The source `config` asks for, or `None` for `static` (the pool already holds the
/// `[[backends]]`, and only a reload changes them).
pub fn from_config(config: &DiscoveryConfig) -> Result<Option<Box<dyn Discovery>>, ConfigError> {
    let d = config;
    Ok(match d.source {
        DiscoverySource::Static => None,
        DiscoverySource::File => Some(Box::new(file::FileDiscovery::new(
            &d.file,
            &d.backend_defaults,
        )?)),
        DiscoverySource::Dns => Some(Box::new(dns::DnsDiscovery::new(
            &d.dns,
            &d.backend_defaults,
        )?)),
        DiscoverySource::Kubernetes => Some(Box::new(kubernetes::KubernetesDiscovery::new(
            &d.kubernetes,
            &d.backend_defaults,
        )?)),
    })
}

pub mod config;
pub mod dns;
pub mod file;
pub mod kubernetes;

pub use config::{
    BackendDefaults, DiscoveryConfig, DiscoverySource, DnsDiscoveryConfig, FileDiscoveryConfig,
    KubernetesDiscoveryConfig, PortRef,
};
