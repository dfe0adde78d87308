//! Client authentication and per-client rate limits for the OpenAI routes, and the admin token.
//!
//! Keys come from `auth.api_keys`, `auth.api_keys_file` (one per line) and the environment
//! variable named by `auth.api_keys_env` (comma-separated); authentication is on when any key
//! is configured. A presented key is compared with every configured key in time that does not
//! depend on where the bytes differ, and without stopping at the first match, so timing tells
//! an attacker nothing about the keys. Rate limits apply per key, or per client IP when no keys
//! are configured: a token bucket for requests per second and a cap on concurrent requests,
//! both answered with 429 and `Retry-After`.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::header::AUTHORIZATION;
use tokio::sync::Semaphore;

use crate::config::{AuthConfig, ConfigError};
use crate::error::Error;
use crate::scheduling::admission::hold;

/// Who is asking: the index of their key, or their address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Client {
    Key(usize),
    Ip(IpAddr),
}

/// Token bucket: `rate` tokens per second up to `burst`.
struct Bucket {
    tokens: f64,
    last: Instant,
}

struct ClientState {
    bucket: Mutex<Bucket>,
    concurrent: Option<Arc<Semaphore>>,
}

pub struct Auth {
    keys: Vec<Box<[u8]>>,
    admin_token: Option<Box<[u8]>>,
    rate: f64,
    burst: f64,
    max_concurrent: usize,
    clients: moka::sync::Cache<Client, Arc<ClientState>>,
}

/// Equality whose running time depends only on the lengths, not on the contents.
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= u64::from(x ^ y);
    }
    diff == 0
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
        Ok(Auth {
            keys: keys
                .into_iter()
                .map(|k| k.into_bytes().into_boxed_slice())
                .collect(),
            admin_token: cfg
                .admin_token
                .as_ref()
                .map(|t| t.clone().into_bytes().into_boxed_slice()),
            rate: cfg.requests_per_second,
            burst: if cfg.burst > 0.0 {
                cfg.burst
            } else {
                cfg.requests_per_second.max(1.0)
            },
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

    fn identify(&self, req: &Request) -> Result<Client, Error> {
        if self.keys.is_empty() {
            let ip = req
                .extensions()
                .get::<ConnectInfo<SocketAddr>>()
                .map_or(IpAddr::from([0, 0, 0, 0]), |c| c.0.ip());
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

    fn state(&self, client: Client) -> Arc<ClientState> {
        self.clients.get_with(client, || {
            Arc::new(ClientState {
                bucket: Mutex::new(Bucket {
                    tokens: self.burst,
                    last: Instant::now(),
                }),
                concurrent: (self.max_concurrent > 0)
                    .then(|| Arc::new(Semaphore::new(self.max_concurrent))),
            })
        })
    }

    /// Take one token, or say how long until one is available.
    fn take_token(&self, state: &ClientState) -> Result<(), Duration> {
        if self.rate <= 0.0 {
            return Ok(());
        }
        let mut b = state.bucket.lock().unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        b.tokens =
            (b.tokens + now.duration_since(b.last).as_secs_f64() * self.rate).min(self.burst);
        b.last = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - b.tokens) / self.rate))
        }
    }

    fn limits_on(&self) -> bool {
        self.rate > 0.0 || self.max_concurrent > 0
    }
}

/// Middleware for the OpenAI routes.
pub async fn client_gate(State(auth): State<Arc<Auth>>, req: Request, next: Next) -> Response {
    if !auth.enabled() && !auth.limits_on() {
        return next.run(req).await;
    }
    let client = match auth.identify(&req) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    if !auth.limits_on() {
        return next.run(req).await;
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
    let response = next.run(req).await;
    match permit {
        Some(permit) => hold(response, permit),
        None => response,
    }
}

/// Middleware for `/metrics` and `/admin/*`.
pub async fn admin_gate(State(auth): State<Arc<Auth>>, req: Request, next: Next) -> Response {
    if let Some(token) = &auth.admin_token {
        if !bearer(&req).is_some_and(|t| ct_eq(t, token)) {
            return Error::Unauthorized.into_response();
        }
    }
    next.run(req).await
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
        // Pretend 200 ms passed: two tokens back (capped at the burst).
        s.bucket.lock().unwrap().last -= Duration::from_millis(200);
        assert!(auth.take_token(&s).is_ok());
        assert!(auth.take_token(&s).is_ok());
        assert!(auth.take_token(&s).is_err());
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
