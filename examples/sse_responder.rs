//! An instant streaming backend for `bench/overhead.sh`: answers every request with an
//! OpenAI-shaped Server-Sent-Events stream of `CHUNKS` events (default 100) and `data: [DONE]`,
//! each event its own chunk of the chunked body, produced as fast as the client reads. No
//! model, no queue, no metrics: it must not be what limits the benchmark.
//!
//! `cargo run --release --example sse_responder -- 127.0.0.1:PORT [CHUNKS]`
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;

use bytes::Bytes;
use futures_util::stream;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

const EVENT: &[u8] = b"data: {\"id\":\"cmpl-bench\",\"object\":\"chat.completion.chunk\",\"model\":\"bench\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"tok \"},\"finish_reason\":null}]}\n\n";
const DONE: &[u8] = b"data: [DONE]\n\n";
/// What the router's poller reads: an idle vLLM's load gauges and cache geometry.
const METRICS: &str = "vllm:num_requests_running{engine=\"0\",model_name=\"bench\"} 0.0\n\
vllm:num_requests_waiting{engine=\"0\",model_name=\"bench\"} 0.0\n\
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"bench\"} 0.0\n\
vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"4096\"} 1.0\n";
const MODELS: &str =
    r#"{"object":"list","data":[{"id":"bench","object":"model","owned_by":"bench"}]}"#;

fn main() {
    let mut args = std::env::args().skip(1);
    let addr: std::net::SocketAddr = args
        .next()
        .unwrap_or_else(|| "127.0.0.1:0".into())
        .parse()
        .expect("address");
    let chunks: usize = args.next().map_or(100, |s| s.parse().expect("chunks"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.expect("bind");
        println!("{}", listener.local_addr().expect("addr"));
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let _ = tcp.set_nodelay(true);
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |req: Request<Incoming>| async move {
                        let fixed = match req.uri().path() {
                            "/metrics" | "/metrics/" => {
                                Some(("text/plain; version=0.0.4", METRICS))
                            }
                            "/v1/models" => Some(("application/json", MODELS)),
                            "/health" => Some(("text/plain", "")),
                            _ => None,
                        };
                        // Read (and drop) the request body first, as a real server does.
                        let _ = req.into_body().collect().await;
                        if let Some((kind, text)) = fixed {
                            let frame = Ok::<_, Infallible>(Frame::data(Bytes::from_static(
                                text.as_bytes(),
                            )));
                            let body = StreamBody::new(stream::iter(vec![frame])).boxed();
                            return Ok::<_, Infallible>(
                                Response::builder()
                                    .header("content-type", kind)
                                    .body(body)
                                    .expect("response"),
                            );
                        }
                        let events = (0..=chunks).map(move |i| {
                            let data = if i == chunks { DONE } else { EVENT };
                            Ok::<_, Infallible>(Frame::data(Bytes::from_static(data)))
                        });
                        let body = StreamBody::new(stream::iter(events)).boxed();
                        Ok::<_, Infallible>(
                            Response::builder()
                                .header("content-type", "text/event-stream")
                                .header("cache-control", "no-cache")
                                .body(body)
                                .expect("response"),
                        )
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tcp), service)
                    .await;
            });
        }
    });
}
