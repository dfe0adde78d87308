//! `kubernetes` discovery: the ready Pods of a label selector (or of an `InferencePool`),
//! followed with the API server's list + watch through kube's runtime watcher.
//!
//! The watcher owns the protocol — list (paged), watch from the list's resourceVersion,
//! bookmarks, resume after a broken watch from the last seen version, a full re-list after
//! a `410 Gone` event inside a watch stream, and back-off between failed attempts — so this
//! file only keeps a map
//! `pod name → endpoint` from its events and yields the whole set after each change (after
//! `InitDone` for a (re-)list, so a re-list never shows a half-listed fleet). One thing the
//! watcher does not do is re-list when the watch *request* is answered `410` (the version was
//! compacted while the watch was down): it retries the watch at the same version forever. So
//! any `410` here, whatever its shape, drops the watcher and starts a new one, which lists.
//!
//! A Pod is an endpoint when it is `Running`, has a pod IP, its `Ready` condition is `True`,
//! it has no `deletionTimestamp` (a terminating Pod leaves the set, so it drains) and its
//! `role_label` (default `llm-d.ai/role`), if it has one, is `prefill`, `decode` or `both`.
//! With `inference_pool`, the pool (`inference.networking.k8s.io/v1`) is read once when the
//! source starts: its `spec.selector.matchLabels` select the Pods and its first
//! `spec.targetPorts[].number` is the port. A changed pool is picked up by a restart (or a
//! config reload that restarts discovery).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use futures_util::stream::BoxStream;
use futures_util::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;

use super::{DesiredBackend, Discovery, DiscoveryError, NextSet};
use crate::config_error::ConfigError;
use crate::discovery::{BackendDefaults, KubernetesDiscoveryConfig, PortRef};
use crate::endpoints::BackendRole;

const SOURCE: &str = "kubernetes";

/// At most this many Pods are tracked; more are ignored and reported (a selector that
/// matches a whole cluster must not grow the router without bound).
pub const MAX_PODS: usize = 100_000;

/// At most this many ready events are folded into one set.
const MAX_BURST: usize = 10_000;

/// Why a Pod is not an endpoint (for the unit tests and debug logs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotAnEndpoint {
    NotRunning,
    NoPodIp,
    NotReady,
    Terminating,
    /// The named container port is on none of the Pod's containers.
    NoSuchPort(String),
    /// Neither a valid IP nor a port in 1..=65535.
    Invalid,
    /// Its role label has a value other than `prefill`, `decode` or `both`.
    UnknownRole(String),
}

/// The `(ip, port)` a Pod serves on, or why it does not count.
pub fn endpoint_of(pod: &Pod, port: &PortRef) -> Result<(IpAddr, u16), NotAnEndpoint> {
    if pod.metadata.deletion_timestamp.is_some() {
        return Err(NotAnEndpoint::Terminating);
    }
    let status = pod.status.as_ref().ok_or(NotAnEndpoint::NotRunning)?;
    if status.phase.as_deref() != Some("Running") {
        return Err(NotAnEndpoint::NotRunning);
    }
    let ip = status
        .pod_ip
        .as_deref()
        .filter(|ip| !ip.is_empty())
        .ok_or(NotAnEndpoint::NoPodIp)?;
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready {
        return Err(NotAnEndpoint::NotReady);
    }
    let ip: IpAddr = ip.parse().map_err(|_| NotAnEndpoint::Invalid)?;
    let port = match port {
        PortRef::Number(n) => *n,
        PortRef::Name(name) => {
            let found = pod
                .spec
                .iter()
                .flat_map(|s| s.containers.iter())
                .flat_map(|c| c.ports.iter().flatten())
                .find(|p| p.name.as_deref() == Some(name.as_str()))
                .ok_or_else(|| NotAnEndpoint::NoSuchPort(name.clone()))?;
            u16::try_from(found.container_port).map_err(|_| NotAnEndpoint::Invalid)?
        }
    };
    if port == 0 {
        return Err(NotAnEndpoint::Invalid);
    }
    Ok((ip, port))
}

/// The role a Pod's `role_label` names: `None` without the label (the defaults' role then
/// applies, `both` unless configured), an error for a value that is no role.
pub fn role_of(pod: &Pod, role_label: &str) -> Result<Option<BackendRole>, NotAnEndpoint> {
    match pod.metadata.labels.as_ref().and_then(|l| l.get(role_label)) {
        None => Ok(None),
        Some(value) => BackendRole::parse(value)
            .map(Some)
            .ok_or_else(|| NotAnEndpoint::UnknownRole(value.clone())),
    }
}

/// The desired backend for a Pod, labelled `pod`, `namespace` (and `inference_pool`), with
/// the role its `role_label` names.
pub fn backend_of(
    pod: &Pod,
    port: &PortRef,
    pool: Option<&str>,
    defaults: &BackendDefaults,
    role_label: &str,
) -> Result<DesiredBackend, NotAnEndpoint> {
    let (ip, port) = endpoint_of(pod, port)?;
    let role = role_of(pod, role_label)?;
    let mut b = DesiredBackend::new(defaults.backend(&ip.to_string(), port));
    if let Some(role) = role {
        b.config.role = Some(role.as_str().to_owned());
    }
    if let Some(name) = &pod.metadata.name {
        b.labels.insert("pod".into(), name.clone());
    }
    if let Some(ns) = &pod.metadata.namespace {
        b.labels.insert("namespace".into(), ns.clone());
    }
    if let Some(pool) = pool {
        b.labels.insert("inference_pool".into(), pool.to_owned());
    }
    Ok(b)
}

/// The parts of an `InferencePool`'s spec this source reads.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct PoolSpec {
    selector: PoolSelector,
    #[serde(default)]
    target_ports: Vec<PoolPort>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct PoolSelector {
    #[serde(default)]
    match_labels: BTreeMap<String, String>,
}

#[derive(Debug, serde::Deserialize)]
struct PoolPort {
    number: i64,
}

/// `(label selector, port)` of an `InferencePool` object's `spec`.
pub fn pool_target(spec: &serde_json::Value) -> Result<(String, u16), String> {
    let spec = PoolSpec::deserialize_from(spec)?;
    if spec.selector.match_labels.is_empty() {
        return Err("spec.selector.matchLabels is empty (it would select every Pod)".into());
    }
    let selector = spec
        .selector
        .match_labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let port = spec
        .target_ports
        .first()
        .ok_or("spec.targetPorts is empty")?
        .number;
    let port = u16::try_from(port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| format!("spec.targetPorts[0].number {port} is not a port"))?;
    Ok((selector, port))
}

impl PoolSpec {
    fn deserialize_from(v: &serde_json::Value) -> Result<Self, String> {
        serde::Deserialize::deserialize(v).map_err(|e| format!("spec: {e}"))
    }
}

fn inference_pool_resource() -> ApiResource {
    ApiResource {
        group: "inference.networking.k8s.io".into(),
        version: "v1".into(),
        api_version: "inference.networking.k8s.io/v1".into(),
        kind: "InferencePool".into(),
        plural: "inferencepools".into(),
    }
}

/// Whether the watcher's error is the API server's `410 Gone` (`Expired`: the resourceVersion
/// is too old), in any of the shapes it comes in: the status of the watch request, an `ERROR`
/// event in the stream, or a bare `Status` line in the stream.
fn is_gone(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::WatchError(status) => status.code == 410,
        watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status))
        | watcher::Error::InitialListFailed(kube::Error::Api(status)) => status.code == 410,
        _ => false,
    }
}

fn err(message: impl std::fmt::Display) -> DiscoveryError {
    DiscoveryError {
        source_name: SOURCE,
        message: message.to_string(),
    }
}

/// Client configuration: the `kubeconfig` file when given; else in-cluster (service account)
/// when `KUBERNETES_SERVICE_HOST` is set; else `KUBECONFIG` / `~/.kube/config`.
async fn client_config(path: Option<&std::path::Path>) -> Result<kube::Config, DiscoveryError> {
    use kube::config::{KubeConfigOptions, Kubeconfig};
    let opts = KubeConfigOptions::default();
    if let Some(path) = path {
        let kc =
            Kubeconfig::read_from(path).map_err(|e| err(format!("{}: {e}", path.display())))?;
        return kube::Config::from_custom_kubeconfig(kc, &opts)
            .await
            .map_err(|e| err(format!("{}: {e}", path.display())));
    }
    if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
        if let Ok(c) = kube::Config::incluster() {
            return Ok(c);
        }
    }
    kube::Config::infer().await.map_err(err)
}

type PodEvents = BoxStream<'static, Result<Event<Pod>, watcher::Error>>;

pub struct KubernetesDiscovery {
    cfg: KubernetesDiscoveryConfig,
    defaults: BackendDefaults,
    /// Set once the client is built (and, with a pool, the pool read).
    events: Option<PodEvents>,
    /// The port actually used (the pool's target port in pool mode).
    port: PortRef,
    /// Endpoints by pod name, as last seen.
    pods: BTreeMap<String, DesiredBackend>,
    /// Endpoints of a (re-)list in progress, swapped in at `InitDone`.
    listing: Option<BTreeMap<String, DesiredBackend>>,
    /// Failed start-up attempts in a row (paces the retries).
    failures: u32,
    /// The cap was hit and reported for the current list (report once per list).
    over_cap: bool,
    /// An error met while folding a burst of events, reported on the next call.
    pending: Option<DiscoveryError>,
    /// Pods already warned about for an unknown role value (once per pod name).
    warned_role: std::collections::HashSet<String>,
}

impl KubernetesDiscovery {
    pub fn new(
        cfg: &KubernetesDiscoveryConfig,
        defaults: &BackendDefaults,
    ) -> Result<Self, ConfigError> {
        if cfg.namespace.is_empty() {
            return Err(ConfigError::invalid(
                "discovery.kubernetes.namespace",
                "must not be empty",
            ));
        }
        let selector = cfg.label_selector.as_deref().unwrap_or("");
        match (&cfg.inference_pool, selector.is_empty()) {
            (Some(p), _) if p.is_empty() => {
                return Err(ConfigError::invalid(
                    "discovery.kubernetes.inference_pool",
                    "must not be empty",
                ))
            }
            (Some(_), false) => {
                return Err(ConfigError::invalid(
                    "discovery.kubernetes",
                    "set label_selector or inference_pool, not both",
                ))
            }
            (None, true) => {
                return Err(ConfigError::invalid(
                    "discovery.kubernetes.label_selector",
                    "the kubernetes source needs a label_selector (or an inference_pool)",
                ))
            }
            _ => {}
        }
        if cfg.role_label.is_empty() {
            return Err(ConfigError::invalid(
                "discovery.kubernetes.role_label",
                "must not be empty",
            ));
        }
        match &cfg.port {
            PortRef::Number(0) => {
                return Err(ConfigError::invalid(
                    "discovery.kubernetes.port",
                    "must be greater than 0",
                ))
            }
            PortRef::Name(n) if n.is_empty() => {
                return Err(ConfigError::invalid(
                    "discovery.kubernetes.port",
                    "a port name must not be empty",
                ))
            }
            _ => {}
        }
        Ok(KubernetesDiscovery {
            cfg: cfg.clone(),
            defaults: defaults.clone(),
            events: None,
            port: cfg.port.clone(),
            pods: BTreeMap::new(),
            listing: None,
            failures: 0,
            over_cap: false,
            pending: None,
            warned_role: Default::default(),
        })
    }

    /// Build the client (and read the pool) and start the Pod watcher.
    async fn start(&mut self) -> Result<PodEvents, DiscoveryError> {
        let config = client_config(self.cfg.kubeconfig.as_deref()).await?;
        let client = kube::Client::try_from(config).map_err(err)?;
        let ns = self.cfg.namespace.as_str();
        let selector = match &self.cfg.inference_pool {
            Some(name) => {
                let api: Api<DynamicObject> =
                    Api::namespaced_with(client.clone(), ns, &inference_pool_resource());
                let pool = api
                    .get(name)
                    .await
                    .map_err(|e| err(format!("InferencePool {ns}/{name}: {e}")))?;
                let spec = pool.data.get("spec").unwrap_or(&serde_json::Value::Null);
                let (selector, port) = pool_target(spec)
                    .map_err(|e| err(format!("InferencePool {ns}/{name}: {e}")))?;
                self.port = PortRef::Number(port);
                selector
            }
            None => self.cfg.label_selector.clone().unwrap_or_default(),
        };
        let pods: Api<Pod> = Api::namespaced(client, ns);
        let wc = watcher::Config::default().labels(&selector);
        tracing::info!(namespace = ns, selector, "watching pods");
        Ok(watcher::watcher(pods, wc).default_backoff().boxed())
    }

    fn backend(&mut self, pod: &Pod) -> Option<DesiredBackend> {
        match backend_of(
            pod,
            &self.port,
            self.cfg.inference_pool.as_deref(),
            &self.defaults,
            &self.cfg.role_label,
        ) {
            Ok(b) => Some(b),
            Err(NotAnEndpoint::UnknownRole(value)) => {
                let name = pod.metadata.name.clone().unwrap_or_default();
                if self.warned_role.len() >= MAX_PODS {
                    self.warned_role.clear();
                }
                if self.warned_role.insert(name.clone()) {
                    tracing::warn!(
                        pod = %name,
                        label = %self.cfg.role_label,
                        value = %value,
                        "pod is not an endpoint: its role label must be prefill, decode or both"
                    );
                }
                None
            }
            Err(why) => {
                tracing::debug!(pod = ?pod.metadata.name, ?why, "pod is not an endpoint");
                None
            }
        }
    }

    /// Apply one watcher event; `Some(set)` when the desired set changed (or a list ended).
    fn apply(&mut self, event: Event<Pod>) -> Result<Option<Vec<DesiredBackend>>, DiscoveryError> {
        match event {
            Event::Init => {
                self.listing = Some(BTreeMap::new());
                self.over_cap = false;
                Ok(None)
            }
            Event::InitApply(pod) => {
                let (Some(name), Some(b)) = (pod.metadata.name.clone(), self.backend(&pod)) else {
                    return Ok(None);
                };
                let listing = self.listing.get_or_insert_with(BTreeMap::new);
                if listing.len() >= MAX_PODS && !listing.contains_key(&name) {
                    return self.cap_hit();
                }
                listing.insert(name, b);
                Ok(None)
            }
            Event::InitDone => {
                if let Some(listed) = self.listing.take() {
                    self.pods = listed;
                }
                Ok(Some(self.set()))
            }
            Event::Apply(pod) => {
                let Some(name) = pod.metadata.name.clone() else {
                    return Ok(None);
                };
                let new = self.backend(&pod);
                let changed = match new {
                    Some(b) => {
                        if self.pods.len() >= MAX_PODS && !self.pods.contains_key(&name) {
                            return self.cap_hit();
                        }
                        self.pods.insert(name, b.clone()) != Some(b)
                    }
                    None => self.pods.remove(&name).is_some(),
                };
                Ok(changed.then(|| self.set()))
            }
            Event::Delete(pod) => {
                if let Some(name) = &pod.metadata.name {
                    self.warned_role.remove(name);
                }
                let removed = pod
                    .metadata
                    .name
                    .as_ref()
                    .is_some_and(|n| self.pods.remove(n).is_some());
                Ok(removed.then(|| self.set()))
            }
        }
    }

    fn cap_hit(&mut self) -> Result<Option<Vec<DesiredBackend>>, DiscoveryError> {
        if std::mem::replace(&mut self.over_cap, true) {
            return Ok(None);
        }
        Err(err(format!(
            "more than {MAX_PODS} ready pods; the rest are ignored"
        )))
    }

    /// Apply the events that are ready now (at most [`MAX_BURST`]), without waiting. An error
    /// among them is kept for the next call, after this set is handed over.
    fn drain_ready(&mut self) {
        for _ in 0..MAX_BURST {
            let Some(events) = self.events.as_mut() else {
                return;
            };
            match events.next().now_or_never() {
                Some(Some(Ok(event))) => {
                    if let Err(e) = self.apply(event) {
                        self.pending = Some(e);
                        return;
                    }
                }
                Some(Some(Err(e))) => {
                    self.pending = Some(err(e));
                    return;
                }
                Some(None) => {
                    self.events = None;
                    return;
                }
                None => return,
            }
        }
    }

    fn set(&self) -> Vec<DesiredBackend> {
        self.pods.values().cloned().collect()
    }
}

impl Discovery for KubernetesDiscovery {
    fn source(&self) -> &'static str {
        SOURCE
    }

    fn next(&mut self) -> NextSet<'_> {
        Box::pin(async move {
            if let Some(e) = self.pending.take() {
                return Err(e);
            }
            loop {
                let Some(events) = self.events.as_mut() else {
                    if self.failures > 0 {
                        // Pace start-up retries: 0.5 s doubling to 30 s.
                        let exp = self.failures.min(6);
                        let ms = 500u64.saturating_mul(1u64 << exp).min(30_000);
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                    }
                    match self.start().await {
                        Ok(events) => {
                            self.failures = 0;
                            self.events = Some(events);
                            continue;
                        }
                        Err(e) => {
                            self.failures = self.failures.saturating_add(1);
                            return Err(e);
                        }
                    }
                };
                match events.next().await {
                    Some(Ok(event)) => {
                        if self.apply(event)?.is_some() {
                            // Fold the events already waiting (a burst: a scaled Deployment,
                            // a node drained) into this set: one reconcile, not one per pod.
                            self.drain_ready();
                            if self.listing.is_none() {
                                return Ok(self.set());
                            }
                        }
                    }
                    // 410 Gone at the start of a watch (an HTTP status) or inside a stream:
                    // the resourceVersion this source holds is compacted away, and only a new
                    // list can tell which Pods came and went in the gap. kube's watcher
                    // re-lists on the in-stream event but retries a watch whose start failed
                    // at the same version, forever; so drop the watcher and start a new one,
                    // which lists first. Paced like a failed start (a server that answers
                    // every watch with 410 is not hammered).
                    Some(Err(e)) if is_gone(&e) => {
                        self.events = None;
                        self.failures = self.failures.saturating_add(1);
                        return Err(err(format!("{e}; listing the pods again")));
                    }
                    // The watcher recovers on the next poll, after its back-off.
                    Some(Err(e)) => return Err(err(e)),
                    None => {
                        self.events = None;
                        return Err(err("the pod watcher ended; restarting it"));
                    }
                }
            }
        })
    }
}

#[cfg(test)]
mod tests;
