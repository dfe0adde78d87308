//! Client authentication and per-client rate limits for the OpenAI routes, and the admin token.
//!
//! Keys come from `auth.api_keys`, `auth.api_keys_file` (one per line) and the environment
//! variable named by `auth.api_keys_env` (comma-separated); authentication is on when any key
//! is configured. A presented key is compared with every configured key in time that does not
//! depend on where the bytes differ (`subtle`), and without stopping at the first match, so
//! timing tells an attacker nothing about the keys. Rate limits apply per key, or per client IP
//! when no keys are configured: `governor`'s GCRA limiter (a token bucket without a timer) for
//! requests per second and a cap on concurrent requests, both answered with 429 and
//! `Retry-After`.
//!
//! The gate also tags every request with its [`Tenant`] (the key, or the address when no keys
//! are configured) and the key's priority-class rules, for the capacity queue's fairness and
//! priority classes.
//!
//! Per-client state lives in a bounded `moka` cache (at most 100,000 clients, dropped after
//! 10 idle minutes), each entry holding its own direct `governor` limiter. governor's keyed
//! limiter would keep every key ever seen in its map until `retain_recent` is called; a flood of
//! client addresses must not grow the router's memory.
//!
//! It owns the `[auth]` section ([`AuthConfig`]: its defaults and checks).

use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::Arc;

use arc_swap::ArcSwap;
use std::time::Duration;

use axum::extract::{ConnectInfo, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use governor::clock::Clock as _;
use governor::{DefaultDirectRateLimiter, Quota};
use http::header::AUTHORIZATION;
use serde::Deserialize;
use subtle::ConstantTimeEq;
use tokio::sync::Semaphore;

use crate::scheduling::priority::PriorityConfig;

use crate::config_error::ConfigError;
use crate::error::Error;
use crate::scheduling::admission::hold;
use crate::scheduling::priority::ClassRule;

/// Who is asking: the index of their key, or their address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Client {
    Key(usize),
    Ip(IpAddr),
}

/// Who sent a request, as the gate identified it (a request extension).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tenant {
    /// XXH3 of the key, or of the client address when no keys are configured.
    pub id: u64,
    /// The key's own class rules (`[[priority.keys]]`), if it has any.
    pub classes: Option<ClassRule>,
}

struct ClientState {
    /// `None` when no request rate is configured.
    limiter: Option<DefaultDirectRateLimiter>,
    concurrent: Option<Arc<Semaphore>>,
}

pub struct Auth {
    keys: Vec<Box<[u8]>>,
    /// `[[priority.keys]]` rules, by key index.
    rules: Vec<Option<ClassRule>>,
    admin_token: Option<Box<[u8]>>,
    quota: Option<Quota>,
    max_concurrent: usize,
    clients: moka::sync::Cache<Client, Arc<ClientState>>,
}

/// Equality whose running time depends only on the lengths, not on the contents.
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.ct_eq(b).into()
}

/// The slowest configurable rate: one request per day. governor multiplies the period by the
/// burst in nanoseconds (unchecked), so both are bounded; `Config::validate` refuses values
/// beyond these, and the clamps here only keep a skipped validation from panicking.
pub const MIN_REQUESTS_PER_SECOND: f64 = 1.0 / 86_400.0;
pub const MAX_BURST: f64 = 100_000.0;

/// `rate` requests per second with bursts of `burst` (0 = the rate, at least 1); `None` when
/// `rate` is 0 (no limit).
fn quota(rate: f64, burst: f64) -> Option<Quota> {
    // NaN is refused by validation; here it counts as no limit, like 0.
    if rate.is_nan() || rate <= 0.0 {
        return None;
    }
    let period = Duration::try_from_secs_f64(1.0 / rate.max(MIN_REQUESTS_PER_SECOND))
        .unwrap_or(Duration::from_secs(86_400))
        .max(Duration::from_nanos(1));
    let burst = if burst > 0.0 { burst } else { rate };
    // In range by the clamp, so the cast neither saturates nor truncates more than `ceil` did.
    let burst =
        NonZeroU32::new(burst.ceil().clamp(1.0, MAX_BURST) as u32).unwrap_or(NonZeroU32::MIN);
    Quota::with_period(period).map(|q| q.allow_burst(burst))
}

fn bearer(req: &Request) -> Option<&[u8]> {
    let value = req.headers().get(AUTHORIZATION)?.as_bytes();
    let (scheme, token) = value.split_at(value.iter().position(|b| *b == b' ')?);
    scheme
        .eq_ignore_ascii_case(b"bearer")
        .then(|| token.trim_ascii())
}

impl Auth {
    pub fn from_config(cfg: &AuthConfig) -> Result<Self, ConfigError> {
        Self::with_priorities(cfg, &PriorityConfig::default())
    }

    /// Keys and limits from `cfg`, with the per-key class rules of `priority`.
    pub fn with_priorities(
        cfg: &AuthConfig,
        priority: &PriorityConfig,
    ) -> Result<Self, ConfigError> {
        let mut keys: Vec<String> = cfg.api_keys.clone();
        if let Some(path) = &cfg.api_keys_file {
            let text = std::fs::read_to_string(path).map_err(|e| {
                ConfigError::invalid("auth.api_keys_file", format!("{}: {e}", path.display()))
            })?;
            keys.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(str::to_owned),
            );
        }
        if let Some(var) = &cfg.api_keys_env {
            if let Ok(value) = std::env::var(var) {
                keys.extend(
                    value
                        .split(',')
                        .map(str::trim)
                        .filter(|k| !k.is_empty())
                        .map(str::to_owned),
                );
            }
        }
        if keys
            .iter()
            .any(|k| k.is_empty() || k.chars().any(char::is_whitespace))
        {
            return Err(ConfigError::invalid(
                "auth.api_keys",
                "keys must be non-empty and contain no spaces",
            ));
        }
        let mut rules = vec![None; keys.len()];
        for (i, rule) in priority.keys.iter().enumerate() {
            let Some(at) = keys.iter().position(|k| *k == rule.key) else {
                return Err(ConfigError::invalid(
                    format!("priority.keys[{i}].key"),
                    "is not one of the configured API keys",
                ));
            };
            let class = |name: &Option<String>, fallback: &str| {
                priority
                    .index(name.as_deref().unwrap_or(fallback))
                    .unwrap_or(0)
            };
            rules[at] = Some(ClassRule {
                default: class(&rule.default_class, &priority.default_class),
                max: class(&rule.max_class, &priority.max_class),
            });
        }
        Ok(Auth {
            rules,
            keys: keys
                .into_iter()
                .map(|k| k.into_bytes().into_boxed_slice())
                .collect(),
            admin_token: cfg
                .admin_token
                .as_ref()
                .map(|t| t.clone().into_bytes().into_boxed_slice()),
            quota: quota(cfg.requests_per_second, cfg.burst),
            max_concurrent: cfg.max_concurrent_per_key,
            clients: moka::sync::Cache::builder()
                .max_capacity(100_000)
                .time_to_idle(Duration::from_secs(600))
                .build(),
        })
    }

    pub fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    fn identify(&self, req: &Request, peer: Option<SocketAddr>) -> Result<Client, Error> {
        if self.keys.is_empty() {
            let ip = peer.map_or(IpAddr::from([0, 0, 0, 0]), |p| p.ip());
            return Ok(Client::Ip(ip));
        }
        let presented = bearer(req).ok_or(Error::Unauthorized)?;
        let mut found = None;
        for (i, key) in self.keys.iter().enumerate() {
            if ct_eq(presented, key) && found.is_none() {
                found = Some(i);
            }
        }
        found.map(Client::Key).ok_or(Error::Unauthorized)
    }

    fn tenant(&self, client: Client) -> Tenant {
        match client {
            Client::Key(i) => Tenant {
                id: self
                    .keys
                    .get(i)
                    .map_or(0, |k| xxhash_rust::xxh3::xxh3_64_with_seed(k, 1)),
                classes: self.rules.get(i).copied().flatten(),
            },
            Client::Ip(ip) => Tenant {
                // The address's octets (not its text: no allocation per request).
                id: match ip {
                    IpAddr::V4(v4) => xxhash_rust::xxh3::xxh3_64_with_seed(&v4.octets(), 2),
                    IpAddr::V6(v6) => xxhash_rust::xxh3::xxh3_64_with_seed(&v6.octets(), 2),
                },
                classes: None,
            },
        }
    }

    fn state(&self, client: Client) -> Arc<ClientState> {
        self.clients.get_with(client, || {
            Arc::new(ClientState {
                limiter: self.quota.map(DefaultDirectRateLimiter::direct),
                concurrent: (self.max_concurrent > 0)
                    .then(|| Arc::new(Semaphore::new(self.max_concurrent))),
            })
        })
    }

    /// Admit one request, or say how long until one would be admitted.
    fn take_token(&self, state: &ClientState) -> Result<(), Duration> {
        match &state.limiter {
            None => Ok(()),
            Some(limiter) => limiter
                .check()
                .map_err(|not_until| not_until.wait_time_from(limiter.clock().now())),
        }
    }

    fn limits_on(&self) -> bool {
        self.quota.is_some() || self.max_concurrent > 0
    }
}

/// Middleware for the OpenAI routes.
pub async fn client_gate(
    State(auth): State<Arc<ArcSwap<Auth>>>,
    req: Request,
    next: Next,
) -> Response {
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0);
    gate(&auth, req, peer, |mut req, tenant| {
        req.extensions_mut().insert(tenant);
        next.run(req)
    })
    .await
}

/// The client gate itself: identify the client (401 without a valid key; `peer` names it
/// when no keys are configured), apply its rate and concurrency limits (429), then run
/// `inner` with the client's [`Tenant`]. The middleware above (which puts the tenant in the
/// request's extensions for the handlers) and the front door's hot routes (which bypass the
/// router and hand it on directly: no extension map to allocate per request) both call it.
pub async fn gate<F, Fut>(
    auth: &ArcSwap<Auth>,
    req: Request,
    peer: Option<SocketAddr>,
    inner: F,
) -> Response
where
    F: FnOnce(Request, Tenant) -> Fut,
    Fut: std::future::Future<Output = Response>,
{
    // The keys and limits in effect now (a reload swaps them).
    let auth = auth.load_full();
    let client = match auth.identify(&req, peer) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let tenant = auth.tenant(client);
    if !auth.limits_on() {
        return inner(req, tenant).await;
    }
    let state = auth.state(client);
    if let Err(wait) = auth.take_token(&state) {
        return Error::TooManyRequests {
            reason: "rate limit exceeded".into(),
            retry_after_secs: wait.as_secs_f64().ceil().max(1.0) as u64,
        }
        .into_response();
    }
    let permit = match &state.concurrent {
        Some(sem) => match Arc::clone(sem).try_acquire_owned() {
            Ok(p) => Some(p),
            Err(_) => {
                return Error::TooManyRequests {
                    reason: format!("more than {} concurrent requests", auth.max_concurrent),
                    retry_after_secs: 1,
                }
                .into_response()
            }
        },
        None => None,
    };
    let response = inner(req, tenant).await;
    match permit {
        Some(permit) => hold(response, permit),
        None => response,
    }
}

/// Middleware for `/metrics` and `/admin/*`.
impl Auth {
    /// Is `presented` the configured admin token? False when none is configured.
    pub fn is_admin_token(&self, presented: &[u8]) -> bool {
        self.admin_token
            .as_ref()
            .is_some_and(|token| ct_eq(presented, token))
    }
}

pub async fn admin_gate(
    State(auth): State<Arc<ArcSwap<Auth>>>,
    req: Request,
    next: Next,
) -> Response {
    let auth = auth.load_full();
    if let Some(token) = &auth.admin_token {
        if !bearer(&req).is_some_and(|t| ct_eq(t, token)) {
            return Error::Unauthorized.into_response();
        }
    }
    next.run(req).await
}

/// `[auth]`: client authentication and per-key rate limits.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// Accepted bearer tokens. Authentication is on when any key is configured.
    pub api_keys: Vec<String>,
    /// A file with one key per line (`#` comments allowed).
    pub api_keys_file: Option<std::path::PathBuf>,
    /// Name of an environment variable holding comma-separated keys.
    pub api_keys_env: Option<String>,
    /// Bearer token required on `/metrics` and `/admin/*` (unset = open).
    pub admin_token: Option<String>,
    /// Sustained requests per second per key (0 = unlimited).
    pub requests_per_second: f64,
    /// Burst size per key (0 = same as `requests_per_second`, at least 1).
    pub burst: f64,
    /// Requests in flight per key (0 = unlimited).
    pub max_concurrent_per_key: usize,
}

impl AuthConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let rps = self.requests_per_second;
        if !(rps >= 0.0 && rps.is_finite()) {
            return Err(ConfigError::invalid(
                "auth.requests_per_second",
                "must be a number ≥ 0",
            ));
        }
        if rps > 0.0 && rps < MIN_REQUESTS_PER_SECOND {
            return Err(ConfigError::invalid(
                "auth.requests_per_second",
                "must be 0 (no limit) or at least one request per day (1/86400)",
            ));
        }
        if !(self.burst >= 0.0 && self.burst <= MAX_BURST) {
            return Err(ConfigError::invalid(
                "auth.burst",
                "must be a number within 0..=100000",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn ct_eq_table() {
        assert!(ct_eq(b"abc", b"abc"));
        assert!(!ct_eq(b"abc", b"abd"));
        assert!(!ct_eq(b"abc", b"abcd"));
        assert!(!ct_eq(b"", b"a"));
        assert!(ct_eq(b"", b""));
    }

    #[test]
    fn bucket_allows_burst_then_refills() {
        let auth = Auth::from_config(&AuthConfig {
            requests_per_second: 10.0,
            burst: 2.0,
            ..Default::default()
        })
        .unwrap();
        let s = auth.state(Client::Key(0));
        assert!(auth.take_token(&s).is_ok());
        assert!(auth.take_token(&s).is_ok());
        let wait = auth.take_token(&s).unwrap_err();
        assert!(wait <= Duration::from_millis(100), "{wait:?}");
        // The same quota on a clock the test moves: 200 ms later two requests are back (capped
        // at the burst).
        let clock = governor::clock::FakeRelativeClock::default();
        let limiter = governor::RateLimiter::direct_with_clock(auth.quota.unwrap(), clock.clone());
        assert!(limiter.check().is_ok());
        assert!(limiter.check().is_ok());
        assert!(limiter.check().is_err());
        clock.advance(Duration::from_millis(200));
        assert!(limiter.check().is_ok());
        assert!(limiter.check().is_ok());
        assert!(limiter.check().is_err());
    }

    #[test]
    fn quota_edges() {
        assert!(quota(0.0, 5.0).is_none(), "0 = unlimited");
        let q = quota(0.5, 0.0).unwrap();
        assert_eq!(
            q.burst_size().get(),
            1,
            "burst defaults to the rate, at least 1"
        );
        assert_eq!(q.replenish_interval(), Duration::from_secs(2));
        let q = quota(1e-12, 1e12).unwrap();
        assert_eq!(q.replenish_interval(), Duration::from_secs(86_400));
        assert_eq!(q.burst_size().get(), MAX_BURST as u32);
        assert!(quota(f64::MAX, 1.0).is_some());
    }

    #[test]
    fn keys_from_all_sources() {
        let dir = std::env::temp_dir().join(format!("inferlb-keys-{}", std::process::id()));
        std::fs::write(&dir, "# comment\nfile-key\n\n").unwrap();
        std::env::set_var("INFERLB_TEST_KEYS_X", "env-a, env-b");
        let auth = Auth::from_config(&AuthConfig {
            api_keys: vec!["inline".into()],
            api_keys_file: Some(dir.clone()),
            api_keys_env: Some("INFERLB_TEST_KEYS_X".into()),
            ..Default::default()
        })
        .unwrap();
        let keys: Vec<_> = auth
            .keys
            .iter()
            .map(|k| String::from_utf8_lossy(k).into_owned())
            .collect();
        assert_eq!(keys, vec!["inline", "file-key", "env-a", "env-b"]);
        let bad = Auth::from_config(&AuthConfig {
            api_keys: vec!["has space".into()],
            ..Default::default()
        });
        assert!(bad.is_err());
        let _ = std::fs::remove_file(dir);
    }
}
