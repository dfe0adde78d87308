//! Pod → endpoint rules, the InferencePool spec, and the event → set bookkeeping.
#![allow(clippy::unwrap_used)]

use super::*;
use serde_json::json;

/// A ready, running Pod `name` at `ip` with a container port `http` = 8000.
fn pod(name: &str, ip: &str) -> serde_json::Value {
    json!({
        "metadata": {"name": name, "namespace": "prod", "resourceVersion": "1"},
        "spec": {"containers": [{"name": "vllm", "ports": [
            {"name": "metrics", "containerPort": 9090},
            {"name": "http", "containerPort": 8000}
        ]}]},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "PodScheduled", "status": "True"},
                                  {"type": "Ready", "status": "True"}]}
    })
}

fn parse(v: serde_json::Value) -> Pod {
    serde_json::from_value(v).unwrap()
}

fn num(n: u16) -> PortRef {
    PortRef::Number(n)
}

#[test]
fn the_role_label_sets_the_role_and_an_unknown_value_excludes_the_pod() {
    let d = BackendDefaults::default();
    let with = |value: Option<&str>| {
        let mut v = pod("vllm-0", "10.1.2.3");
        if let Some(value) = value {
            v["metadata"]["labels"] = json!({"llm-d.ai/role": value, "app": "vllm"});
        }
        parse(v)
    };
    let role =
        |p: &Pod| backend_of(p, &num(8000), None, &d, "llm-d.ai/role").map(|b| b.config.role());
    assert_eq!(role(&with(None)), Ok(BackendRole::Both));
    assert_eq!(role(&with(Some("prefill"))), Ok(BackendRole::Prefill));
    assert_eq!(role(&with(Some("decode"))), Ok(BackendRole::Decode));
    assert_eq!(role(&with(Some("both"))), Ok(BackendRole::Both));
    assert_eq!(
        role(&with(Some("encode"))),
        Err(NotAnEndpoint::UnknownRole("encode".into()))
    );
    // Another label key: the label is absent, so the defaults' role.
    let decode = BackendDefaults {
        role: Some("decode".into()),
        ..BackendDefaults::default()
    };
    let b = backend_of(&with(Some("prefill")), &num(8000), None, &decode, "role").unwrap();
    assert_eq!(b.config.role(), BackendRole::Decode);
}

#[test]
fn a_ready_running_pod_is_an_endpoint() {
    let p = parse(pod("vllm-0", "10.1.2.3"));
    assert_eq!(
        endpoint_of(&p, &num(8000)),
        Ok(("10.1.2.3".parse().unwrap(), 8000))
    );
    let b = backend_of(
        &p,
        &num(8000),
        None,
        &BackendDefaults::default(),
        "llm-d.ai/role",
    )
    .unwrap();
    assert_eq!(b.config.url, "http://10.1.2.3:8000");
    assert_eq!(b.labels["pod"], "vllm-0");
    assert_eq!(b.labels["namespace"], "prod");
    assert!(!b.labels.contains_key("inference_pool"));
    let b = backend_of(
        &p,
        &num(8000),
        Some("pool"),
        &BackendDefaults::default(),
        "llm-d.ai/role",
    )
    .unwrap();
    assert_eq!(b.labels["inference_pool"], "pool");
}

#[test]
fn not_ready_pods_do_not_count() {
    let mut v = pod("vllm-0", "10.1.2.3");
    v["status"]["conditions"][1]["status"] = json!("False");
    assert_eq!(
        endpoint_of(&parse(v.clone()), &num(1)),
        Err(NotAnEndpoint::NotReady)
    );
    v["status"]["conditions"] = json!([]);
    assert_eq!(
        endpoint_of(&parse(v), &num(1)),
        Err(NotAnEndpoint::NotReady)
    );
}

#[test]
fn pods_not_running_do_not_count() {
    let mut v = pod("vllm-0", "10.1.2.3");
    v["status"]["phase"] = json!("Pending");
    assert_eq!(
        endpoint_of(&parse(v.clone()), &num(1)),
        Err(NotAnEndpoint::NotRunning)
    );
    v["status"] = serde_json::Value::Null;
    assert_eq!(
        endpoint_of(&parse(v), &num(1)),
        Err(NotAnEndpoint::NotRunning)
    );
}

#[test]
fn terminating_pods_leave_even_while_ready() {
    let mut v = pod("vllm-0", "10.1.2.3");
    v["metadata"]["deletionTimestamp"] = json!("2026-12-01T10:00:00Z");
    assert_eq!(
        endpoint_of(&parse(v), &num(1)),
        Err(NotAnEndpoint::Terminating)
    );
}

#[test]
fn pods_without_an_ip_do_not_count() {
    let mut v = pod("vllm-0", "");
    assert_eq!(
        endpoint_of(&parse(v.clone()), &num(1)),
        Err(NotAnEndpoint::NoPodIp)
    );
    v["status"].as_object_mut().unwrap().remove("podIP");
    assert_eq!(endpoint_of(&parse(v), &num(1)), Err(NotAnEndpoint::NoPodIp));
    let garbage = parse(pod("vllm-0", "not-an-ip"));
    assert_eq!(endpoint_of(&garbage, &num(1)), Err(NotAnEndpoint::Invalid));
}

#[test]
fn a_port_by_name_is_looked_up_in_the_containers() {
    let p = parse(pod("vllm-0", "10.1.2.3"));
    assert_eq!(
        endpoint_of(&p, &PortRef::Name("http".into())).unwrap().1,
        8000
    );
    assert_eq!(
        endpoint_of(&p, &PortRef::Name("metrics".into())).unwrap().1,
        9090
    );
    assert_eq!(
        endpoint_of(&p, &PortRef::Name("grpc".into())),
        Err(NotAnEndpoint::NoSuchPort("grpc".into()))
    );
    let mut v = pod("vllm-0", "10.1.2.3");
    v["spec"]["containers"][0]["ports"][1]["containerPort"] = json!(70000);
    assert_eq!(
        endpoint_of(&parse(v), &PortRef::Name("http".into())),
        Err(NotAnEndpoint::Invalid)
    );
}

#[test]
fn an_ipv6_pod_ip_is_bracketed_in_the_url() {
    let p = parse(pod("vllm-0", "fd00::1:2"));
    let b = backend_of(
        &p,
        &num(8000),
        None,
        &BackendDefaults::default(),
        "llm-d.ai/role",
    )
    .unwrap();
    assert_eq!(b.config.url, "http://[fd00::1:2]:8000");
}

#[test]
fn an_inference_pool_gives_selector_and_first_target_port() {
    let spec = json!({"selector": {"matchLabels": {"app": "vllm", "tier": "a"}},
                      "targetPorts": [{"number": 8000}, {"number": 8001}],
                      "endpointPickerRef": {"name": "epp"}});
    assert_eq!(pool_target(&spec), Ok(("app=vllm,tier=a".into(), 8000)));
    let no_labels = json!({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]});
    assert!(pool_target(&no_labels).is_err());
    let no_port = json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": []});
    assert!(pool_target(&no_port).is_err());
    let bad_port = json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 0}]});
    assert!(pool_target(&bad_port).is_err());
    assert!(pool_target(&serde_json::Value::Null).is_err());
}

fn source() -> KubernetesDiscovery {
    let cfg = KubernetesDiscoveryConfig {
        label_selector: Some("app=vllm".into()),
        ..Default::default()
    };
    KubernetesDiscovery::new(&cfg, &BackendDefaults::default()).unwrap()
}

fn urls(set: &[DesiredBackend]) -> Vec<&str> {
    set.iter().map(|b| b.config.url.as_str()).collect()
}

#[test]
fn events_keep_the_set_and_a_relist_replaces_it_whole() {
    let mut s = source();
    assert_eq!(s.apply(Event::Init).unwrap(), None);
    assert_eq!(
        s.apply(Event::InitApply(parse(pod("a", "10.0.0.1"))))
            .unwrap(),
        None
    );
    assert_eq!(
        s.apply(Event::InitApply(parse(pod("b", "10.0.0.2"))))
            .unwrap(),
        None
    );
    let set = s.apply(Event::InitDone).unwrap().unwrap();
    assert_eq!(urls(&set), ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]);
    // The same pod again (a status update that changes nothing): no new set.
    assert_eq!(
        s.apply(Event::Apply(parse(pod("a", "10.0.0.1")))).unwrap(),
        None
    );
    // Turning unready: it leaves.
    let mut unready = pod("a", "10.0.0.1");
    unready["status"]["conditions"][1]["status"] = json!("False");
    let set = s.apply(Event::Apply(parse(unready))).unwrap().unwrap();
    assert_eq!(urls(&set), ["http://10.0.0.2:8000"]);
    let set = s
        .apply(Event::Delete(parse(pod("b", "10.0.0.2"))))
        .unwrap()
        .unwrap();
    assert!(set.is_empty());
    // A re-list: only what it lists survives, and nothing shows before InitDone.
    s.apply(Event::Apply(parse(pod("c", "10.0.0.3")))).unwrap();
    assert_eq!(s.apply(Event::Init).unwrap(), None);
    assert_eq!(
        s.apply(Event::InitApply(parse(pod("d", "10.0.0.4"))))
            .unwrap(),
        None
    );
    let set = s.apply(Event::InitDone).unwrap().unwrap();
    assert_eq!(urls(&set), ["http://10.0.0.4:8000"]);
}

#[test]
fn config_needs_a_selector_or_a_pool_not_both() {
    let d = BackendDefaults::default();
    let none = KubernetesDiscoveryConfig::default();
    assert!(KubernetesDiscovery::new(&none, &d).is_err());
    let both = KubernetesDiscoveryConfig {
        label_selector: Some("a=b".into()),
        inference_pool: Some("p".into()),
        ..Default::default()
    };
    assert!(KubernetesDiscovery::new(&both, &d).is_err());
    let pool = KubernetesDiscoveryConfig {
        inference_pool: Some("p".into()),
        ..Default::default()
    };
    assert!(KubernetesDiscovery::new(&pool, &d).is_ok());
}

/// Counts the warnings logged while it is the subscriber.
struct Warnings(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warnings {
    fn on_event(&self, e: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if *e.metadata().level() == tracing::Level::WARN {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

#[test]
fn a_pod_whose_role_turns_unknown_leaves_and_is_warned_about_once() {
    use tracing_subscriber::layer::SubscriberExt;
    let warnings = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let subscriber = tracing_subscriber::registry().with(Warnings(warnings.clone()));
    let _guard = tracing::subscriber::set_default(subscriber);
    let warned = || warnings.load(std::sync::atomic::Ordering::Relaxed);
    let mut s = source();
    let labelled = |role: &str| {
        let mut v = pod("a", "10.0.0.1");
        v["metadata"]["labels"] = json!({"app": "vllm", "llm-d.ai/role": role});
        parse(v)
    };
    s.apply(Event::Init).unwrap();
    s.apply(Event::InitApply(labelled("decode"))).unwrap();
    let set = s.apply(Event::InitDone).unwrap().unwrap();
    assert_eq!(set[0].config.role(), BackendRole::Decode);
    let set = s.apply(Event::Apply(labelled("encode"))).unwrap().unwrap();
    assert!(set.is_empty());
    assert_eq!(s.apply(Event::Apply(labelled("encode"))).unwrap(), None);
    assert_eq!(warned(), 1, "one warning per pod name");
    s.apply(Event::Delete(labelled("encode"))).unwrap();
    s.apply(Event::Apply(labelled("encode"))).unwrap();
    assert_eq!(
        warned(),
        2,
        "a pod deleted and created again is warned about again"
    );
}
