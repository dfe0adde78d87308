//! Routers under test: inferlb as a subprocess (or in-process, for tests) with a generated
//! config, or any external router command; readiness waits and orderly stops.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

/// A policy to compare: how the router is started.
#[derive(Debug, Clone)]
pub enum Policy {
    /// inferlb with this TOML fragment merged into the generated config (empty = default).
    /// `bin`, when set, is this policy's own inferlb binary (an older build, for an A/B of
    /// two builds in one run); it is always started as a subprocess, whatever the launcher.
    Inferlb {
        name: String,
        fragment: String,
        bin: Option<PathBuf>,
    },
    /// An arbitrary command with `{port}`, `{workers}` (space-separated backend URLs) and
    /// `{metrics_port}` (another free port, for a router's own Prometheus listener).
    Command { name: String, command: String },
}

impl Policy {
    pub fn name(&self) -> &str {
        match self {
            Policy::Inferlb { name, .. } | Policy::Command { name, .. } => name,
        }
    }
}

fn profile(name: &str, plugins: &[(&str, Option<f64>)]) -> String {
    let mut s = String::new();
    for (ty, _) in plugins {
        s.push_str(&format!("[[plugins]]\ntype = \"{ty}\"\n\n"));
    }
    let refs: Vec<String> = plugins
        .iter()
        .map(|(ty, w)| match w {
            Some(w) => format!("  {{ plugin_ref = \"{ty}\", weight = {w} }},"),
            None => format!("  {{ plugin_ref = \"{ty}\" }},"),
        })
        .collect();
    s.push_str(&format!(
        "[[scheduling_profiles]]\nname = \"{name}\"\nplugins = [\n{}\n]\n",
        refs.join("\n")
    ));
    s
}

/// The built-in policies by name.
pub fn builtin(name: &str) -> Option<Policy> {
    let fragment = match name {
        "random" => profile(name, &[("random-picker", None)]),
        "round-robin" => profile(name, &[("round-robin-picker", None)]),
        "load-only" => profile(
            name,
            &[
                ("queue-scorer", Some(2.0)),
                ("kv-cache-utilization-scorer", Some(2.0)),
                ("inflight-scorer", Some(1.0)),
                ("max-score-picker", None),
            ],
        ),
        "prefix-only" => profile(
            name,
            &[
                ("prefix-cache-scorer", Some(1.0)),
                ("max-score-picker", None),
            ],
        ),
        "default" => String::new(),
        _ => return None,
    };
    Some(Policy::Inferlb {
        name: name.into(),
        fragment,
        bin: None,
    })
}

pub const BUILTIN_POLICIES: &[&str] = &[
    "random",
    "round-robin",
    "load-only",
    "prefix-only",
    "default",
];

#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("policy fragment {name}: {message}")]
    Fragment { name: String, message: String },
    #[error("cannot start {name}: {source}")]
    Spawn {
        name: String,
        source: std::io::Error,
    },
    #[error("{name} exited before it was ready ({status}); log: {log}")]
    Exited {
        name: String,
        status: String,
        log: String,
    },
    #[error("{name} not ready after {secs} s; log: {log}")]
    NotReady {
        name: String,
        secs: u64,
        log: String,
    },
    #[error("in-process router {name}: {message}")]
    InProcess { name: String, message: String },
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// The inferlb config for `workers` on `port`, with `fragment` (plugins, profiles, any other
/// field) merged over the generated base.
pub fn inferlb_config(
    workers: &[String],
    roles: &[&str],
    port: u16,
    fragment: &str,
    name: &str,
) -> Result<String, RouterError> {
    let mut base = toml::Table::new();
    base.insert("listen".into(), format!("127.0.0.1:{port}").into());
    base.insert("log_level".into(), "warn".into());
    let mut poller = toml::Table::new();
    poller.insert("interval_ms".into(), 50.into());
    base.insert("poller".into(), poller.into());
    let backends: Vec<toml::Value> = workers
        .iter()
        .enumerate()
        .map(|(i, u)| {
            let mut t = toml::Table::new();
            t.insert("url".into(), u.clone().into());
            if let Some(role) = roles.get(i).filter(|r| **r != "both") {
                t.insert("role".into(), (*role).into());
            }
            t.into()
        })
        .collect();
    base.insert("backends".into(), backends.into());
    let extra: toml::Table = toml::from_str(fragment).map_err(|e| RouterError::Fragment {
        name: name.into(),
        message: e.to_string(),
    })?;
    for (k, v) in extra {
        match (base.get_mut(&k), v) {
            // Tables (poller, forward) merge key by key so a fragment can tune one field.
            (Some(toml::Value::Table(b)), toml::Value::Table(v)) => b.extend(v),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
    toml::to_string(&base).map_err(|e| RouterError::Fragment {
        name: name.into(),
        message: e.to_string(),
    })
}

/// A free loopback port (bound, read, released: a small race the readiness wait catches).
pub fn free_port() -> std::io::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// Starts a router in-process from its config text; returns its base URL and a stopper.
pub type InProcessStart = Arc<
    dyn Fn(String) -> Pin<Box<dyn Future<Output = Result<InProcessRouter, String>> + Send>>
        + Send
        + Sync,
>;

pub struct InProcessRouter {
    pub url: String,
    pub stop: Pin<Box<dyn Future<Output = ()> + Send>>,
}

/// How inferlb policies are launched.
#[derive(Clone)]
pub enum Launcher {
    Binary(PathBuf),
    InProcess(InProcessStart),
}

/// A router that is up.
pub struct RunningRouter {
    pub name: String,
    pub url: String,
    child: Option<Child>,
    stop: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

/// Starts `policy` in front of `workers` and waits (≤ `ready_timeout`) until it is ready;
/// subprocess output goes to `log_dir/router-NAME.log`.
pub async fn start(
    policy: &Policy,
    launcher: &Launcher,
    workers: &[String],
    roles: &[&str],
    log_dir: &Path,
    ready_timeout: Duration,
) -> Result<RunningRouter, RouterError> {
    let name = policy.name().to_owned();
    let log_path = log_dir.join(format!("router-{}.log", sanitize(&name)));
    match (policy, launcher) {
        (
            Policy::Inferlb {
                fragment,
                bin: None,
                ..
            },
            Launcher::InProcess(start),
        ) => {
            let text = inferlb_config(workers, roles, 0, fragment, &name)?;
            let r = start(text)
                .await
                .map_err(|message| RouterError::InProcess {
                    name: name.clone(),
                    message,
                })?;
            let mut router = RunningRouter {
                name,
                url: r.url,
                child: None,
                stop: Some(r.stop),
            };
            wait_ready(&mut router, &["/ready"], ready_timeout, &log_path).await?;
            Ok(router)
        }
        (
            Policy::Inferlb {
                fragment,
                bin: Some(bin),
                ..
            },
            _,
        )
        | (
            Policy::Inferlb {
                fragment,
                bin: None,
                ..
            },
            Launcher::Binary(bin),
        ) => {
            let port = free_port()?;
            let text = inferlb_config(workers, roles, port, fragment, &name)?;
            let cfg_path = log_dir.join(format!("inferlb-{}.toml", sanitize(&name)));
            std::fs::write(&cfg_path, text)?;
            let mut cmd = Command::new(bin);
            cmd.arg("--config").arg(&cfg_path);
            spawn(name, cmd, port, &["/ready"], &log_path, ready_timeout).await
        }
        (Policy::Command { command, .. }, _) => {
            let port = free_port()?;
            let line = command
                .replace("{port}", &port.to_string())
                .replace("{metrics_port}", &free_port()?.to_string())
                .replace("{workers}", &workers.join(" "));
            let _ = std::fs::write(
                log_dir.join(format!("router-{}.cmd", sanitize(&name))),
                &line,
            );
            let mut cmd = Command::new("sh");
            // exec: the router itself becomes the child, so SIGTERM reaches it.
            cmd.arg("-c").arg(format!("exec {line}"));
            spawn(
                name,
                cmd,
                port,
                &["/health", "/v1/models"],
                &log_path,
                ready_timeout,
            )
            .await
        }
    }
}

fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

async fn spawn(
    name: String,
    mut cmd: Command,
    port: u16,
    probes: &[&str],
    log_path: &Path,
    ready_timeout: Duration,
) -> Result<RunningRouter, RouterError> {
    let log = std::fs::File::create(log_path)?;
    let log_err = log.try_clone()?;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log_err))
        .kill_on_drop(true);
    let child = cmd.spawn().map_err(|source| RouterError::Spawn {
        name: name.clone(),
        source,
    })?;
    let mut router = RunningRouter {
        name,
        url: format!("http://127.0.0.1:{port}"),
        child: Some(child),
        stop: None,
    };
    if let Err(e) = wait_ready(&mut router, probes, ready_timeout, log_path).await {
        router.stop().await;
        return Err(e);
    }
    Ok(router)
}

/// Last lines of a log file, for error messages.
fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    let from = lines.len().saturating_sub(8);
    format!("{} …{}", path.display(), lines[from..].join(" | "))
}

/// Polls the probes every 100 ms until one answers 200 (bounded by `timeout`), failing
/// early if the subprocess exits.
async fn wait_ready(
    router: &mut RunningRouter,
    probes: &[&str],
    timeout: Duration,
    log_path: &Path,
) -> Result<(), RouterError> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(2))
        .build()
        .map_err(|e| RouterError::InProcess {
            name: router.name.clone(),
            message: e.to_string(),
        })?;
    let until = Instant::now() + timeout;
    while Instant::now() < until {
        if let Some(child) = router.child.as_mut() {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(RouterError::Exited {
                    name: router.name.clone(),
                    status: status.to_string(),
                    log: tail(log_path),
                });
            }
        }
        for p in probes {
            let ok = client
                .get(format!("{}{p}", router.url))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(RouterError::NotReady {
        name: router.name.clone(),
        secs: timeout.as_secs(),
        log: tail(log_path),
    })
}

impl RunningRouter {
    /// Keep the router's own `/metrics` page (what it counted during the run: prefix
    /// returns, thrash, replicas…) as `log_dir/router-NAME.metrics`, if it serves one; a
    /// router without it, or one that does not answer within 5 s, leaves no file.
    pub async fn save_metrics(&self, log_dir: &Path) {
        let Ok(client) = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
        else {
            return;
        };
        let Ok(resp) = client.get(format!("{}/metrics", self.url)).send().await else {
            return;
        };
        if !resp.status().is_success() {
            return;
        }
        if let Ok(text) = resp.text().await {
            let path = log_dir.join(format!("router-{}.metrics", sanitize(&self.name)));
            let _ = std::fs::write(path, text);
        }
    }

    /// SIGTERM, then SIGKILL if the process has not exited within 10 s.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            stop.await;
        }
        if let Some(mut child) = self.child.take() {
            if let Some(pid) = child.id() {
                // std has no SIGTERM and unsafe code is forbidden: ask kill(1).
                let _ = Command::new("kill")
                    .arg("-TERM")
                    .arg(pid.to_string())
                    .status()
                    .await;
            }
            if tokio::time::timeout(Duration::from_secs(10), child.wait())
                .await
                .is_err()
            {
                let _ = child.kill().await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn config_merges_fragments() {
        let workers = vec![
            "http://127.0.0.1:1".to_string(),
            "http://127.0.0.1:2".into(),
        ];
        for name in BUILTIN_POLICIES {
            let Some(Policy::Inferlb { fragment, .. }) = builtin(name) else {
                panic!("{name}")
            };
            let text = inferlb_config(&workers, &[], 9, &fragment, name).unwrap();
            let t: toml::Table = toml::from_str(&text).unwrap();
            assert_eq!(t["listen"].as_str(), Some("127.0.0.1:9"));
            assert_eq!(t["backends"].as_array().unwrap().len(), 2);
            assert_eq!(t.contains_key("scheduling_profiles"), *name != "default");
        }
        let text =
            inferlb_config(&workers, &[], 9, "[poller]\nstale_after_ms = 300\n", "x").unwrap();
        let t: toml::Table = toml::from_str(&text).unwrap();
        assert_eq!(t["poller"]["interval_ms"].as_integer(), Some(50));
        assert_eq!(t["poller"]["stale_after_ms"].as_integer(), Some(300));
        assert!(inferlb_config(&workers, &[], 9, "not toml [", "x").is_err());
    }

    /// A policy with its own binary is started from that binary, even where the run's other
    /// inferlb policies are in-process: a missing one fails to spawn, naming the policy.
    #[tokio::test]
    async fn a_policy_with_its_own_binary_is_spawned_from_it() {
        let dir = std::env::temp_dir().join(format!("loadgen-own-bin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let policy = Policy::Inferlb {
            name: "old".into(),
            fragment: String::new(),
            bin: Some(dir.join("no-such-inferlb")),
        };
        let never: InProcessStart =
            Arc::new(|_| Box::pin(async { Err("in-process launcher used".to_string()) }));
        let workers = ["http://127.0.0.1:1".to_string()];
        let err = start(
            &policy,
            &Launcher::InProcess(never),
            &workers,
            &[],
            &dir,
            Duration::from_secs(1),
        )
        .await
        .err()
        .unwrap();
        assert!(
            matches!(&err, RouterError::Spawn { name, .. } if name == "old"),
            "{err}"
        );
        assert!(dir.join("inferlb-old.toml").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
