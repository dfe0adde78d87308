//! The /metrics page: parses as Prometheus text, has every vLLM series with the right type
//! and labels, and follows the engine (counters, histograms, info gauges, optional series).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{
    completion, fast, get_response, ids_body, parse_prometheus, post, start, start_with_client,
};
use vllm_sim::{LoraModule, SimConfig};

const REQUIRED: &[(&str, &str)] = &[
    ("vllm:num_requests_running", "gauge"),
    ("vllm:num_requests_waiting", "gauge"),
    ("vllm:kv_cache_usage_perc", "gauge"),
    ("vllm:prefix_cache_queries_total", "counter"),
    ("vllm:prefix_cache_hits_total", "counter"),
    ("vllm:num_preemptions_total", "counter"),
    ("vllm:prompt_tokens_total", "counter"),
    ("vllm:generation_tokens_total", "counter"),
    ("vllm:request_success_total", "counter"),
    ("vllm:time_to_first_token_seconds", "histogram"),
    ("vllm:e2e_request_latency_seconds", "histogram"),
    ("vllm:request_queue_time_seconds", "histogram"),
    ("vllm:inter_token_latency_seconds", "histogram"),
    ("vllm:cache_config_info", "gauge"),
];

#[tokio::test]
async fn page_parses_and_has_every_series_with_its_type_and_labels() {
    let sim = start(fast()).await;
    for _ in 0..2 {
        let r = completion(&sim, &ids_body(40, 0, 5, false)).await;
        assert_eq!(r.status(), 200);
    }
    let r = get_response(&format!("{}/metrics", sim.url())).await;
    assert_eq!(
        r.headers()["content-type"],
        "text/plain; version=0.0.4; charset=utf-8"
    );
    let page = parse_prometheus(&r.text().await.unwrap()).unwrap();
    for (name, kind) in REQUIRED {
        assert_eq!(
            page.types.get(*name).map(String::as_str),
            Some(*kind),
            "{name}"
        );
    }
    // Every counter has its _created gauge, as prometheus_client writes them.
    for (name, kind) in &page.types {
        if kind == "counter" {
            let created = format!("{}_created", name.trim_end_matches("_total"));
            assert_eq!(
                page.types.get(&created).map(String::as_str),
                Some("gauge"),
                "{created}"
            );
        }
    }
    let model = vllm_sim::config::DEFAULT_MODEL;
    for s in &page.samples {
        // Each sample belongs to a typed family (histogram parts by their base name).
        let family = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|suf| {
                s.name
                    .strip_suffix(suf)
                    .filter(|b| page.types.get(*b).is_some_and(|k| k == "histogram"))
            })
            .unwrap_or(&s.name);
        assert!(page.types.contains_key(family), "untyped sample {}", s.name);
        assert_eq!(
            s.labels.get("model_name").map(String::as_str),
            Some(model),
            "{}",
            s.name
        );
        if !s.name.starts_with("vllm:admission_rejections") {
            assert_eq!(
                s.labels.get("engine").map(String::as_str),
                Some("0"),
                "{}",
                s.name
            );
        }
        if s.name.ends_with("_bucket") {
            assert!(s.labels.contains_key("le"), "{}", s.name);
        }
    }
    // Values follow the engine: two requests of 40 prompt tokens and 5 output tokens.
    assert_eq!(page.value("vllm:prompt_tokens_total"), 80.0);
    assert_eq!(page.value("vllm:generation_tokens_total"), 10.0);
    assert_eq!(page.value("vllm:prefix_cache_queries_total"), 80.0);
    assert_eq!(page.value("vllm:prefix_cache_hits_total"), 32.0);
    assert_eq!(
        page.get(
            "vllm:request_success_total",
            &[("finished_reason", "length")]
        ),
        Some(2.0)
    );
    assert_eq!(
        page.get("vllm:request_success_total", &[("finished_reason", "stop")]),
        Some(0.0)
    );
    assert_eq!(page.value("vllm:time_to_first_token_seconds_count"), 2.0);
    assert_eq!(page.value("vllm:inter_token_latency_seconds_count"), 8.0);
    assert_eq!(
        page.get("vllm:e2e_request_latency_seconds_bucket", &[("le", "+Inf")]),
        Some(2.0)
    );
    // The real page's TTFT buckets.
    assert!(page
        .get(
            "vllm:time_to_first_token_seconds_bucket",
            &[("le", "0.001")]
        )
        .is_some());
    assert!(page
        .get(
            "vllm:time_to_first_token_seconds_bucket",
            &[("le", "2560.0")]
        )
        .is_some());
    let info = |k: &str| {
        page.samples
            .iter()
            .find(|s| s.name == "vllm:cache_config_info")
            .unwrap()
            .labels[k]
            .clone()
    };
    assert_eq!(info("block_size"), "16");
    assert_eq!(info("num_gpu_blocks"), "2048");
    assert_eq!(info("enable_prefix_caching"), "True");
    assert_eq!(info("kv_cache_size_tokens"), "32768");
    assert!(
        !page.types.contains_key("vllm:gpu_cache_usage_perc"),
        "only behind the flag"
    );
    assert!(
        !page.types.contains_key("vllm:lora_requests_info"),
        "only with LoRA"
    );
    // Histograms are cumulative.
    let buckets: Vec<f64> = page
        .samples
        .iter()
        .filter(|s| s.name == "vllm:inter_token_latency_seconds_bucket")
        .map(|s| s.value)
        .collect();
    assert!(buckets.windows(2).all(|w| w[0] <= w[1]));
}

#[tokio::test]
async fn optional_series_gpu_cache_usage_and_lora_info() {
    let cfg = SimConfig {
        gpu_cache_usage_metric: true,
        served_model_name: vec!["base".into()],
        lora_modules: vec![
            LoraModule {
                name: "sql".into(),
                path: "/l/sql".into(),
                base_model_name: None,
            },
            LoraModule {
                name: "chat".into(),
                path: "/l/chat".into(),
                base_model_name: None,
            },
        ],
        max_loras: 2,
        time_scale: 1.0,
        ..SimConfig::default()
    };
    let (sim, c) = start_with_client(cfg).await;
    let url = sim.url();
    let mut body = ids_body(50, 1, 1000, true);
    body["model"] = "sql".into();
    let r = post(&format!("{url}/v1/completions"), &body).await;
    let mut stream = r.bytes_stream();
    common::first_events(&mut stream, 1).await;
    let page = common::scrape(&c, &url).await;
    assert_eq!(page.types["vllm:gpu_cache_usage_perc"], "gauge");
    let usage = page.value("vllm:gpu_cache_usage_perc");
    assert!(usage > 0.0 && usage == page.value("vllm:kv_cache_usage_perc"));
    let lora = page
        .samples
        .iter()
        .find(|s| s.name == "vllm:lora_requests_info")
        .expect("lora info");
    assert_eq!(page.types["vllm:lora_requests_info"], "gauge");
    assert_eq!(lora.labels["running_lora_adapters"], "sql");
    assert_eq!(lora.labels["waiting_lora_adapters"], "");
    assert_eq!(lora.labels["max_lora"], "2");
    assert!(lora.value > 1.7e9, "value is a Unix timestamp");
    drop(stream);
    let (_, ok) = sim
        .wait_for_stats(std::time::Duration::from_secs(10), |s| s.running == 0)
        .await;
    assert!(ok);
    let page = common::scrape(&c, &url).await;
    let lora = page
        .samples
        .iter()
        .find(|s| s.name == "vllm:lora_requests_info")
        .unwrap();
    assert_eq!(lora.labels["running_lora_adapters"], "");
}

#[test]
fn the_parser_rejects_garbage() {
    assert!(parse_prometheus("<html>not metrics</html>").is_err());
    assert!(parse_prometheus("vllm:x{engine=\"0\" 1.0").is_err());
    assert!(parse_prometheus("# TYPE a counter\na_total 1.0\n").is_ok());
}
