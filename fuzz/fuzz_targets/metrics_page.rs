//! Fuzz the Prometheus text reader and metric extraction with arbitrary pages: no panic, and
//! extracted usage always within 0..=1.
#![no_main]

use inferlb::endpoints::engine::{extract, EngineMetricNames};
use inferlb::endpoints::prometheus::samples;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(page) = std::str::from_utf8(data) else {
        return;
    };
    for sample in samples(page).flatten() {
        for (k, v) in sample.labels() {
            let _ = (k.len(), v.len());
        }
    }
    for engine in ["vllm", "sglang"] {
        let names = EngineMetricNames::builtin(engine).unwrap_or_default();
        if let Ok(m) = extract(page, &names) {
            if let Some(kv) = m.kv_usage {
                assert!((0.0..=1.0).contains(&kv));
            }
        }
    }
});
