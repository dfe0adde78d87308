//! P/D disaggregation: vLLM's NixlConnector request protocol, with a loopback HTTP side channel
//! standing in for NIXL.
//!
//! A generation request's `kv_transfer_params` asks for one leg or both:
//!
//! * **prefill leg** — `do_remote_decode` truthy: the request runs as usual, its blocks stay
//!   held when it finishes (see [`crate::engine`]) and the non-streaming answer carries, at top
//!   level, the params a decode server needs, in the shape of vLLM's current pull connector:
//!   `do_remote_prefill: true`, `do_remote_decode: false`, `remote_block_ids` (one list per
//!   KV-cache group: `[[…]]`), `remote_engine_id`, `remote_request_id`, `remote_host`,
//!   `remote_port`, `tp_size`, `dcp_size`, `pp_size`, `remote_num_tokens`,
//!   `remote_blocks_expiry_time: null`, `transfer_mode: "pull"`.
//! * **decode leg** — `do_remote_prefill` truthy and all of `remote_block_ids`,
//!   `remote_engine_id`, `remote_request_id`, `remote_host`, `remote_port` given: before the
//!   request enters the engine, it pulls the blocks with `POST /kv_transfer/pull` on
//!   `remote_host:remote_port` (the prefill simulator's own HTTP port), waits the transfer time
//!   `ceil(tokens / block_size) × block_size × --kv-bytes-per-token ÷ --kv-transfer-gbps`
//!   (divided by `--time-scale`), and enters with the pulled tokens counted as computed.
//!   Missing keys: vLLM's "invalid KVTransferParams" path — logged, prompt computed locally.
//!
//! A pull that fails (blocks never held, already pulled or expired; prefill server refusing or
//! unreachable) follows `--kv-load-failure-policy`: `fail` answers 500 (a stream: one
//! `data: {"error":…}` event, then `[DONE]`), `recompute` computes the prompt locally.
//!
//! The simulator only ever connects to loopback: a `remote_host` that is not `localhost` or a
//! loopback address is refused with 400 before any connection (vLLM itself would dial whatever
//! the request names). A leg the `--kv-role` does not take is a 400 too (vLLM's roles are
//! advisory; the simulator's are strict so that a misrouted leg shows in tests).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::error::{parse_json, ApiError};
use super::openai::KvTransferParams;
use super::AppState;
use crate::engine::PullRefused;
use crate::kv_cache::BlockId;

/// The side-channel route on every simulator's main port.
pub const PULL_PATH: &str = "/kv_transfer/pull";
/// How long a pull may take on the wire (vLLM's NIXL handshake waits 5 s for an answer).
const PULL_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest side-channel answer read.
const PULL_MAX_ANSWER: u64 = 64 << 10;
/// The keys a decode leg needs besides `do_remote_prefill` (vLLM's pull scheduler checks them).
const REMOTE_KEYS: [&str; 5] = [
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
];

/// What a request's `kv_transfer_params` asks of this server.
#[derive(Debug, Default)]
pub struct Intent {
    /// Prefill leg: hold the blocks for a pull.
    pub hold: bool,
    /// Decode leg: pull first (Err: the params name no usable peer; the pull fails).
    pub pull: Option<Result<Remote, String>>,
}

/// The prefill server a decode leg pulls from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Remote {
    pub addr: SocketAddr,
    pub engine_id: String,
    pub request_id: String,
    pub block_ids: Vec<BlockId>,
}

/// Python truthiness of a JSON value, as vLLM's `params.get(key)` tests it.
fn truthy(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) => n.as_f64().is_some_and(|x| x != 0.0),
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
    }
}

/// Reads `kv_transfer_params` against the role; a leg the role refuses, or a non-loopback
/// peer, is a 400.
pub fn intent(st: &AppState, params: Option<&KvTransferParams>) -> Result<Intent, ApiError> {
    let Some(params) = params else {
        return Ok(Intent::default());
    };
    let role = st.config.kv_role;
    let hold = truthy(params.get("do_remote_decode"));
    if hold && !role.prefills() {
        return Err(ApiError::bad_param(
            "vllm-sim --kv-role decode takes no prefill legs \
             (kv_transfer_params.do_remote_decode)",
            "kv_transfer_params",
        ));
    }
    if !truthy(params.get("do_remote_prefill")) {
        return Ok(Intent { hold, pull: None });
    }
    if !role.decodes() {
        return Err(ApiError::bad_param(
            "vllm-sim --kv-role prefill takes no decode legs \
             (kv_transfer_params.do_remote_prefill)",
            "kv_transfer_params",
        ));
    }
    if let Some(missing) = REMOTE_KEYS
        .iter()
        .find(|k| params.get(**k).is_none_or(Value::is_null))
    {
        tracing::warn!(
            missing,
            "invalid KVTransferParams: the prompt is computed locally"
        );
        return Ok(Intent { hold, pull: None });
    }
    let pull = remote(params)?;
    Ok(Intent {
        hold,
        pull: Some(pull),
    })
}

/// The peer of a decode leg whose keys are all present; Ok(Err) when a value is unusable
/// (the pull then fails, as a NIXL handshake to nowhere would).
fn remote(params: &KvTransferParams) -> Result<Result<Remote, String>, ApiError> {
    let host = match params.get("remote_host") {
        Some(Value::String(h)) => h.as_str(),
        _ => return Ok(Err("remote_host is not a string".into())),
    };
    let ip = if host.eq_ignore_ascii_case("localhost") {
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    } else {
        match host.parse::<IpAddr>() {
            Ok(ip) if ip.is_loopback() => ip,
            _ => {
                return Err(ApiError::bad_param(
                    format!("vllm-sim pulls KV only from loopback hosts, got remote_host={host:?}"),
                    "kv_transfer_params",
                ))
            }
        }
    };
    let Some(port) = params
        .get("remote_port")
        .and_then(Value::as_u64)
        .and_then(|p| u16::try_from(p).ok())
    else {
        return Ok(Err("remote_port is not a port number".into()));
    };
    let text = |k: &str| match params.get(k) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(format!("{k} is not a string")),
    };
    let (engine_id, request_id) = match (text("remote_engine_id"), text("remote_request_id")) {
        (Ok(e), Ok(r)) => (e, r),
        (Err(e), _) | (_, Err(e)) => return Ok(Err(e)),
    };
    let Some(block_ids) = params.get("remote_block_ids").and_then(flat_block_ids) else {
        return Ok(Err(
            "remote_block_ids is not a list of block ids (or of lists of them)".into(),
        ));
    };
    Ok(Ok(Remote {
        addr: SocketAddr::new(ip, port),
        engine_id,
        request_id,
        block_ids,
    }))
}

/// `[[0,1],[2]]` (current vLLM, one list per KV-cache group) or `[0,1,2]` (older) → ids.
fn flat_block_ids(v: &Value) -> Option<Vec<BlockId>> {
    let id = |x: &Value| x.as_u64().and_then(|n| BlockId::try_from(n).ok());
    let mut out = Vec::new();
    for item in v.as_array()? {
        match item {
            Value::Array(group) => {
                for x in group {
                    out.push(id(x)?);
                }
            }
            x => out.push(id(x)?),
        }
    }
    Some(out)
}

/// The params a prefill leg answers with (see module doc).
pub fn prefill_params(st: &AppState, key: &str, blocks: &[BlockId], tokens: usize) -> Value {
    let ip = st.addr.ip();
    let host = if ip.is_unspecified() {
        match ip {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
        }
    } else {
        ip
    };
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": [blocks],
        "remote_engine_id": st.kv_engine_id,
        "remote_request_id": key,
        "remote_host": host.to_string(),
        "remote_port": st.addr.port(),
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": tokens,
        "remote_blocks_expiry_time": null,
        "transfer_mode": "pull",
    })
}

/// Why a decode leg's pull failed.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("unusable kv_transfer_params: {0}")]
    Params(String),
    #[error("prefill server {0} unreachable: {1}")]
    Unreachable(SocketAddr, std::io::Error),
    #[error("prefill server {0} did not answer within {1:?}")]
    Timeout(SocketAddr, Duration),
    #[error("prefill server {addr} refused the pull ({status}): {message}")]
    Refused {
        addr: SocketAddr,
        status: u16,
        message: String,
    },
    #[error("KV transfer failed (kv_pull_fail fault)")]
    Fault,
}

/// Pulls a decode leg's blocks; answers how many tokens they hold.
pub async fn pull(st: &AppState, remote: Result<Remote, String>) -> Result<usize, PullError> {
    let r = remote.map_err(PullError::Params)?;
    if st.faults.kv_pull_fail() {
        return Err(PullError::Fault);
    }
    let body = json!({
        "remote_engine_id": r.engine_id,
        "remote_request_id": r.request_id,
        "remote_block_ids": r.block_ids,
    })
    .to_string();
    let (status, answer) = tokio::time::timeout(PULL_TIMEOUT, post(r.addr, body.as_bytes()))
        .await
        .map_err(|_| PullError::Timeout(r.addr, PULL_TIMEOUT))?
        .map_err(|e| PullError::Unreachable(r.addr, e))?;
    let v: Value = serde_json::from_slice(&answer).unwrap_or(Value::Null);
    if status != 200 {
        let message = v["error"]["message"]
            .as_str()
            .unwrap_or("no error message")
            .to_string();
        return Err(PullError::Refused {
            addr: r.addr,
            status,
            message,
        });
    }
    match v["num_tokens"]
        .as_u64()
        .and_then(|n| usize::try_from(n).ok())
    {
        Some(n) => Ok(n),
        None => Err(PullError::Refused {
            addr: r.addr,
            status,
            message: "answer without num_tokens".into(),
        }),
    }
}

/// One HTTP/1.1 POST of `body` to the side channel at `addr`, connection closed after: the
/// status and the answer's body.
async fn post(addr: SocketAddr, body: &[u8]) -> std::io::Result<(u16, Vec<u8>)> {
    let mut s = TcpStream::connect(addr).await?;
    let head = format!(
        "POST {PULL_PATH} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await?;
    s.write_all(body).await?;
    let mut buf = Vec::new();
    (&mut s).take(PULL_MAX_ANSWER).read_to_end(&mut buf).await?;
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "not an HTTP answer");
    let end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(bad)?;
    let head = std::str::from_utf8(&buf[..end]).map_err(|_| bad())?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(bad)?;
    Ok((status, buf[end + 4..].to_vec()))
}

/// What a decode server sends on the side channel.
#[derive(Debug, Deserialize)]
struct PullRequest {
    remote_engine_id: String,
    remote_request_id: String,
    #[serde(default)]
    remote_block_ids: Option<Vec<BlockId>>,
}

/// `POST /kv_transfer/pull`: hands the blocks held under `remote_request_id` over (and frees
/// them): `{"num_tokens": N}`; 404 when none are held (second pull, expired lease), 409 for
/// another engine's id or other block ids, 503 under the `kv_pull_refuse` fault.
pub async fn serve_pull(State(st): State<AppState>, body: Bytes) -> Response {
    let req: PullRequest = match parse_json(&body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let refuse = |status: StatusCode, message: String| {
        let body = json!({"error": {
            "message": message, "type": "KVTransferError", "param": null,
            "code": status.as_u16(),
        }});
        (status, Json(body)).into_response()
    };
    if st.faults.kv_pull_refuse() {
        return refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            "pulls refused (kv_pull_refuse fault)".into(),
        );
    }
    if req.remote_engine_id != st.kv_engine_id {
        return refuse(
            StatusCode::CONFLICT,
            format!(
                "this is engine {}, not {}",
                st.kv_engine_id, req.remote_engine_id
            ),
        );
    }
    match st
        .engine
        .pull(req.remote_request_id, req.remote_block_ids)
        .await
    {
        Ok(n) => Json(json!({ "num_tokens": n })).into_response(),
        Err(e @ PullRefused::NotHeld) => refuse(StatusCode::NOT_FOUND, e.to_string()),
        Err(e @ PullRefused::WrongBlocks) => refuse(StatusCode::CONFLICT, e.to_string()),
        Err(e @ PullRefused::Stopped) => refuse(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

/// A random UUID (version 4 layout), for `--kv-engine-id`'s default.
pub fn random_engine_id() -> String {
    let hex = format!("{:032x}", fastrand::u128(..));
    // Version nibble 4, variant bits 10xx (one of 8, 9, a, b).
    let variant = ["8", "9", "a", "b"][fastrand::usize(..4)];
    format!(
        "{}-{}-4{}-{variant}{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[13..16],
        &hex[17..20],
        &hex[20..32]
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn block_ids_nested_or_flat() {
        assert_eq!(flat_block_ids(&json!([[0, 1], [2]])), Some(vec![0, 1, 2]));
        assert_eq!(flat_block_ids(&json!([3, 4])), Some(vec![3, 4]));
        assert_eq!(flat_block_ids(&json!([[-1]])), None);
        assert_eq!(flat_block_ids(&json!("0")), None);
    }

    #[test]
    fn truthiness_is_pythons() {
        assert!(truthy(Some(&json!(true))));
        assert!(truthy(Some(&json!(1))));
        assert!(!truthy(Some(&json!(0))));
        assert!(!truthy(Some(&json!(""))));
        assert!(!truthy(Some(&Value::Null)));
        assert!(!truthy(None));
    }

    #[test]
    fn remote_refuses_non_loopback_and_reports_bad_values() {
        let p = |v: Value| v.as_object().unwrap().clone();
        let ok = p(json!({"remote_host": "localhost", "remote_port": 8100,
            "remote_engine_id": "e", "remote_request_id": "r", "remote_block_ids": [[1, 2]]}));
        let r = remote(&ok).unwrap().unwrap();
        assert_eq!(r.addr, "127.0.0.1:8100".parse().unwrap());
        assert_eq!(r.block_ids, [1, 2]);
        let mut far = ok.clone();
        far.insert("remote_host".into(), json!("10.0.0.7"));
        assert!(remote(&far).is_err(), "a non-loopback host is a 400");
        let mut name = ok.clone();
        name.insert("remote_host".into(), json!("prefill.example"));
        assert!(remote(&name).is_err(), "so is a name other than localhost");
        let mut port = ok.clone();
        port.insert("remote_port".into(), json!(70000));
        assert!(remote(&port).unwrap().is_err(), "a bad port fails the pull");
        let id = random_engine_id();
        assert_eq!(id.len(), 36);
        assert_eq!(&id[14..15], "4");
        assert!("89ab".contains(&id[19..20]), "{id}");
    }
}
