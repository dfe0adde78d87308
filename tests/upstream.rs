//! The router's side of backend connections, through the real HTTP surface: streams that are
//! alive are never cut by the idle timer, empty answers settle cleanly, and keep-alive
//! connections the backend closes are replaced without counting as failures.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::watch;

/// The values of series `name` with label `backend="<backend>"`, summed over their other
/// labels (0 when absent). Filtering by backend keeps tests in one process (which share one
/// metrics recorder) out of each other's counts.
fn series_sum(metrics: &str, name: &str, backend: &str) -> f64 {
    let label = format!("backend=\"{backend}\"");
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
async fn a_stream_that_keeps_talking_outlives_the_idle_timeout() {
    let b = FakeBackend::start("a", &["m"]).await;
    // 25 chunks 100 ms apart: 2.5 s of stream against a 1 s idle limit. A gap would have to
    // stretch to 10× its length on a loaded machine to trip the limit, while the whole stream
    // outlives the limit more than twice (checked below), so a timer that is not re-armed
    // while frames flow cuts it.
    b.state.drip_chunks.store(25, Ordering::Relaxed);
    b.state.drip_ms.store(100, Ordering::Relaxed);
    let mut cfg = config(&[&b]);
    cfg.forward.stream_idle_timeout_ms = 1000;
    let router = start_router(cfg).await;
    let started = std::time::Instant::now();
    let resp = open_stream(&router).await;
    assert_eq!(resp.status(), 200);
    let text = tokio::time::timeout(Duration::from_secs(30), resp.text())
        .await
        .unwrap()
        .unwrap();
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "the stream must outlive the idle limit twice: {:?}",
        started.elapsed()
    );
    assert!(!text.contains("error"), "{text}");
    assert!(text.contains("{\"drip\":24}"), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    router.shutdown().await;
}

#[tokio::test]
async fn an_empty_answer_is_not_counted_as_abandoned() {
    let b = FakeBackend::start("a", &["m"]).await;
    b.state.completion_status.store(204, Ordering::Relaxed);
    let router = start_router(config(&[&b])).await;
    for _ in 0..3 {
        let (status, served, _) = chat(&router, "m", "x").await;
        assert_eq!(status, 204);
        assert_eq!(served.unwrap(), b.url());
    }
    let m = metrics_text(&router).await;
    let url = b.url();
    assert_eq!(
        series_sum(&m, "inferlb_client_disconnects_total", &url),
        0.0,
        "{m}"
    );
    assert_eq!(
        series_sum(&m, "inferlb_requests_total", &url) as u64,
        3,
        "{m}"
    );
    router.shutdown().await;
}

/// A keep-alive backend that closes every idle connection when told to, without a word (no
/// `Connection: close`), as servers do when their keep-alive timeout passes: the client's
/// pooled connections go stale.
struct ClosingBackend {
    url: String,
    completions: Arc<AtomicU64>,
    /// Bumped to make every connection open at that moment close once it is idle.
    close: watch::Sender<u64>,
    /// Connections accepted so far, and closed so far.
    opened: Arc<AtomicU64>,
    closed: watch::Receiver<u64>,
}

impl ClosingBackend {
    /// Close every connection open now and wait until they are all closed (newer ones, such
    /// as the poller reconnecting, stay open).
    async fn close_idle(&self) {
        let target = self.opened.load(Ordering::SeqCst);
        self.close.send_modify(|g| *g += 1);
        let mut closed = self.closed.clone();
        tokio::time::timeout(Duration::from_secs(10), closed.wait_for(|n| *n >= target))
            .await
            .expect("connections did not close")
            .unwrap();
    }
}

/// Read one request (head and Content-Length body) from `socket`, keeping extra bytes in
/// `buf`; `None` when the peer closed.
async fn read_request(socket: &mut tokio::net::TcpStream, buf: &mut Vec<u8>) -> Option<String> {
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..i]).into_owned();
            let length = head
                .to_ascii_lowercase()
                .lines()
                .find_map(|l| l.strip_prefix("content-length:").map(str::to_owned))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            while buf.len() < i + 4 + length {
                match socket.read(&mut chunk).await {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
            buf.drain(..i + 4 + length);
            return Some(head);
        }
        match socket.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

async fn closing_backend() -> ClosingBackend {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let completions = Arc::new(AtomicU64::new(0));
    let (close, _) = watch::channel(0u64);
    let (closed_tx, closed) = watch::channel(0u64);
    let closed_tx = Arc::new(closed_tx);
    let opened = Arc::new(AtomicU64::new(0));
    let backend = ClosingBackend {
        url,
        completions: Arc::clone(&completions),
        close: close.clone(),
        opened: Arc::clone(&opened),
        closed,
    };
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            let (seen, closed_tx) = (Arc::clone(&completions), Arc::clone(&closed_tx));
            let mut close = close.subscribe();
            close.mark_unchanged();
            opened.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                // Like a server's keep-alive timer, which starts after a response: a connection
                // that has not answered anything yet is not closed (the close is noticed after
                // its first answer). Closing a brand-new connection with a request on it would
                // fail the client's one reconnect too, which no real server does.
                let mut served = 0u64;
                loop {
                    let head = tokio::select! {
                        head = read_request(&mut socket, &mut buf) => head,
                        _ = close.changed(), if served > 0 => None,
                    };
                    let Some(head) = head else { break };
                    served += 1;
                    let body = if head.starts_with("GET /metrics") {
                        "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n".to_owned()
                    } else if head.starts_with("GET /v1/models") {
                        r#"{"object":"list","data":[{"id":"m","object":"model"}]}"#.to_owned()
                    } else {
                        seen.fetch_add(1, Ordering::Relaxed);
                        r#"{"object":"chat.completion","ok":true}"#.to_owned()
                    };
                    let response = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if socket.write_all(response.as_bytes()).await.is_err() {
                        break;
                    }
                }
                drop(socket);
                closed_tx.send_modify(|n| *n += 1);
            });
        }
    });
    backend
}

#[tokio::test]
async fn connections_the_backend_closed_are_replaced_without_failures() {
    let backend = closing_backend().await;
    let url = backend.url.clone();
    let mut cfg = inferlb::config::Config::default();
    cfg.poller.interval_ms = 20;
    cfg.backends = vec![inferlb::config::BackendConfig::from_url(url.clone())];
    // One attempt only: a stale connection must be handled below the retry layer.
    cfg.forward.max_attempts = 1;
    let router = start_router(cfg).await;
    for i in 0..20 {
        let (status, _, body) = chat(&router, "m", &format!("q{i}")).await;
        assert_eq!(status, 200, "request {i}: {body}");
        assert_eq!(body["ok"], true);
        // Every connection inferlb keeps (requests' and the poller's) is now stale.
        backend.close_idle().await;
    }
    assert_eq!(backend.completions.load(Ordering::Relaxed), 20);
    let m = metrics_text(&router).await;
    assert_eq!(
        series_sum(&m, "inferlb_requests_total", &url) as u64,
        20,
        "{m}"
    );
    assert_eq!(
        series_sum(&m, "inferlb_upstream_attempt_failures_total", &url),
        0.0,
        "{m}"
    );
    assert_eq!(
        series_sum(&m, "inferlb_backend_scrape_errors_total", &url),
        0.0,
        "{m}"
    );
    router.shutdown().await;
}

#[tokio::test]
async fn keep_alive_connections_to_a_backend_are_reused() {
    // The same backend as above, never told to close: every answer leaves its connection
    // open, so the router should open a handful (the poller's, one per request worker: two
    // workers, whatever the machine's cores) and carry every request on them, not one
    // connection per request.
    let backend = closing_backend().await;
    let mut cfg = inferlb::config::Config {
        backends: vec![inferlb::config::BackendConfig::from_url(
            backend.url.clone(),
        )],
        ..Default::default()
    };
    cfg.server.workers = inferlb::workers::Workers::Count(2);
    let router = start_router(cfg).await;
    for i in 0..30 {
        let (status, _, body) = chat(&router, "m", &format!("q{i}")).await;
        assert_eq!(status, 200, "request {i}: {body}");
    }
    assert_eq!(backend.completions.load(Ordering::Relaxed), 30);
    let opened = backend.opened.load(Ordering::SeqCst);
    assert!(opened <= 4, "{opened} connections opened for 30 requests");
    router.shutdown().await;
}

/// A backend recording the metrics paths it is asked for; `filtered` decides whether it serves
/// `/metrics/` (honouring `name[]`, as vLLM's exposition app does) or only `/metrics`.
async fn recording_backend(filtered: bool) -> (String, Arc<std::sync::Mutex<Vec<String>>>) {
    use axum::extract::{RawQuery, State};
    use axum::routing::get;
    type Seen = Arc<std::sync::Mutex<Vec<String>>>;
    let page = "vllm:num_requests_waiting 2\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.25\nhttp_requests_total 99\n";
    let seen: Seen = Arc::default();
    let whole = move |State(seen): State<Seen>| async move {
        seen.lock().unwrap().push("/metrics".into());
        page
    };
    let mut app = axum::Router::new().route("/metrics", get(whole)).route(
        "/v1/models",
        get(|| async { r#"{"object":"list","data":[{"id":"m","object":"model"}]}"# }),
    );
    if filtered {
        let part = move |State(seen): State<Seen>, RawQuery(q): RawQuery| async move {
            seen.lock()
                .unwrap()
                .push(format!("/metrics/?{}", q.unwrap_or_default()));
            page.lines()
                .filter(|l| !l.starts_with("http_"))
                .map(|l| format!("{l}\n"))
                .collect::<String>()
        };
        app = app.route("/metrics/", get(part));
    }
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = app.with_state(Arc::clone(&seen));
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, seen)
}

#[tokio::test]
async fn scrapes_ask_for_only_the_series_read_and_fall_back_to_the_whole_page() {
    let (filtering, seen_f) = recording_backend(true).await;
    let (plain, seen_p) = recording_backend(false).await;
    let mut cfg = inferlb::config::Config::default();
    cfg.poller.interval_ms = 20;
    cfg.backends = vec![
        inferlb::config::BackendConfig::from_url(filtering.clone()),
        inferlb::config::BackendConfig::from_url(plain.clone()),
    ];
    let router = start_router(cfg).await;
    // Both are admitted with their metrics read.
    until_backends_json(&router, |v| {
        v["backends"].as_array().is_some_and(|bs| {
            bs.len() == 2
                && bs
                    .iter()
                    .all(|b| b["healthy"] == true && b["metrics"]["waiting"] == 2.0)
        })
    })
    .await;
    let f = seen_f.lock().unwrap().clone();
    assert!(!f.is_empty(), "{f:?}");
    assert!(
        f.iter()
            .all(|p| p.starts_with("/metrics/?name%5B%5D=vllm%3Anum_requests_waiting")),
        "{f:?}"
    );
    let p = seen_p.lock().unwrap().clone();
    // Its metrics (checked above) came from the whole page.
    assert!(p.iter().any(|x| x == "/metrics"), "{p:?}");
    let m = metrics_text(&router).await;
    assert_eq!(
        series_sum(&m, "inferlb_backend_scrape_errors_total", &plain),
        0.0,
        "{m}"
    );
    assert_eq!(
        series_sum(&m, "inferlb_backend_scrape_errors_total", &filtering),
        0.0,
        "{m}"
    );
    router.shutdown().await;
}
