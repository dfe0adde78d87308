//! Shared helpers of the integration tests: simulator configs, starting a simulator, HTTP
//! requests that answer JSON, SSE reading, a tiny Prometheus text parser.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

pub mod kv;

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::StreamExt;
use serde_json::Value;
use vllm_sim::{SimConfig, SimHandle};

/// A fast simulator: 20× real time.
pub fn fast() -> SimConfig {
    SimConfig {
        time_scale: 20.0,
        ..SimConfig::default()
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

/// [`fast`], with a context of `max_model_len` tokens.
pub fn fast_with_len(max_model_len: usize) -> SimConfig {
    SimConfig {
        max_model_len,
        ..fast()
    }
}

/// A simulator in real time (streams and aborts that must take a while).
pub fn real_time() -> SimConfig {
    SimConfig {
        time_scale: 1.0,
        ..SimConfig::default()
    }
}

/// A simulator with `cfg`, listening on 127.0.0.1.
pub async fn start(cfg: SimConfig) -> SimHandle {
    vllm_sim::spawn(cfg).await.unwrap()
}

/// A [`fast`] simulator whose config `set` has changed (one fault flag, say).
pub async fn start_fast(set: impl FnOnce(&mut SimConfig)) -> SimHandle {
    let mut cfg = fast();
    set(&mut cfg);
    start(cfg).await
}

/// [`start`], and a [`client`] to talk to it.
pub async fn start_with_client(cfg: SimConfig) -> (SimHandle, reqwest::Client) {
    (start(cfg).await, client())
}

/// Sends `req`; the answer's body as JSON (whatever its status).
pub async fn json_of(req: reqwest::RequestBuilder) -> Value {
    req.send().await.unwrap().json().await.unwrap()
}

/// `GET url`; the response.
pub async fn get_response(url: &str) -> reqwest::Response {
    client().get(url).send().await.unwrap()
}

/// `GET url`; the answer's body as JSON.
pub async fn get_json(url: &str) -> Value {
    json_of(client().get(url)).await
}

/// `POST url` with the JSON `body`; the response.
pub async fn post(url: &str, body: &Value) -> reqwest::Response {
    client().post(url).json(body).send().await.unwrap()
}

/// `POST url` with the JSON `body`; the answer's body as JSON.
pub async fn post_json(url: &str, body: &Value) -> Value {
    json_of(client().post(url).json(body)).await
}

/// `POST /v1/completions` of `body` to `sim`; the response.
pub async fn completion(sim: &SimHandle, body: &Value) -> reqwest::Response {
    post(&format!("{}/v1/completions", sim.url()), body).await
}

/// A streaming [`completion`] of `body` whose first `n` events have arrived; the rest of it.
pub async fn stream_started(
    sim: &SimHandle,
    body: &Value,
    n: usize,
) -> impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin {
    let mut s = completion(sim, body).await.bytes_stream();
    assert_eq!(first_events(&mut s, n).await.len(), n);
    s
}

/// `POST {base}/sim/faults` with `body` (the simulator's or its admin port's URL).
pub async fn set_faults(base: &str, body: Value) -> reqwest::Response {
    post(&format!("{base}/sim/faults"), &body).await
}

/// A completion body with `n` prompt token ids (`salt` varies them) and `max_tokens`.
pub fn ids_body(n: usize, salt: u32, max_tokens: u32, stream: bool) -> Value {
    let ids: Vec<u32> = (0..n as u32).map(|i| (i * 7 + salt) % 30_000 + 2).collect();
    serde_json::json!({ "prompt": ids, "max_tokens": max_tokens, "stream": stream })
}

/// Reads a whole SSE body into its `data:` payloads (`[DONE]` included as a string).
pub async fn sse_events(resp: reqwest::Response) -> Vec<String> {
    let text = resp.text().await.unwrap();
    parse_sse(&text)
}

pub fn parse_sse(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .expect("every event is a data line")
                .to_string()
        })
        .collect()
}

/// Reads SSE events one body frame at a time until `n` events arrived (or the stream ends).
pub async fn first_events(
    stream: &mut (impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin),
    n: usize,
) -> Vec<String> {
    let mut buf = String::new();
    for _ in 0..10_000 {
        if parse_sse(&buf).len() >= n && buf.ends_with("\n\n") {
            break;
        }
        match stream.next().await {
            Some(Ok(b)) => buf.push_str(std::str::from_utf8(&b).unwrap()),
            _ => break,
        }
    }
    parse_sse(&buf)
}

/// One sample of a Prometheus text page.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// A parsed page: family name → type, and every sample.
#[derive(Debug, Default)]
pub struct Page {
    pub types: BTreeMap<String, String>,
    pub samples: Vec<Sample>,
}

/// Parses Prometheus text exposition (0.0.4), strictly enough to reject garbage.
pub fn parse_prometheus(text: &str) -> Result<Page, String> {
    let mut page = Page::default();
    for (no, line) in text.lines().enumerate() {
        let err = |m: &str| format!("line {}: {m}: {line:?}", no + 1);
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').ok_or_else(|| err("bad TYPE"))?;
            if !["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind) {
                return Err(err("unknown type"));
            }
            page.types.insert(name.to_string(), kind.to_string());
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').ok_or_else(|| err("no value"))?;
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse::<f64>().map_err(|_| err("bad value"))?,
        };
        let (name, labels) = match series.split_once('{') {
            None => (series, BTreeMap::new()),
            Some((name, rest)) => {
                let body = rest
                    .strip_suffix('}')
                    .ok_or_else(|| err("unclosed labels"))?;
                let mut labels = BTreeMap::new();
                let mut rest = body;
                while !rest.is_empty() {
                    let (k, after) = rest.split_once("=\"").ok_or_else(|| err("bad label"))?;
                    let end = after.find('"').ok_or_else(|| err("unterminated label"))?;
                    labels.insert(k.to_string(), after[..end].to_string());
                    rest = after[end + 1..].trim_start_matches(',');
                }
                (name, labels)
            }
        };
        let valid = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
        if name.is_empty() || !name.chars().all(valid) {
            return Err(err("bad metric name"));
        }
        page.samples.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    if page.samples.is_empty() {
        return Err("no samples".into());
    }
    Ok(page)
}

impl Page {
    /// The value of the sample `name` whose labels include all of `labels`.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.samples
            .iter()
            .find(|s| {
                s.name == name
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
    }

    pub fn value(&self, name: &str) -> f64 {
        self.get(name, &[])
            .unwrap_or_else(|| panic!("no sample {name}"))
    }
}

/// The text of `{url}/metrics`.
pub async fn metrics_text(client: &reqwest::Client, url: &str) -> String {
    let r = client.get(format!("{url}/metrics")).send().await.unwrap();
    r.text().await.unwrap()
}

pub async fn scrape(client: &reqwest::Client, url: &str) -> Page {
    parse_prometheus(&metrics_text(client, url).await).unwrap()
}
