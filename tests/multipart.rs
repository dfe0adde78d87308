//! `multipart/form-data` requests (audio transcription): routed by their `model` form field to
//! a backend serving it, with the body forwarded byte for byte.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::Ordering;

use common::*;

const BOUNDARY: &str = "----inferlbTestBoundary7MA4YWxkTrZu0gW";

/// A transcription form: a binary "audio" file first (bytes that look like JSON nested deeper
/// than the router's JSON depth limit, CRLFs and a boundary prefix included), then the `model`
/// field when given, then another field.
fn transcription_form(model: Option<&str>) -> Vec<u8> {
    let mut audio: Vec<u8> = (0..=255u8).cycle().take(4096).collect();
    audio.extend_from_slice(&[b'['; 100]);
    audio.extend_from_slice(b"{{{{\r\n--not-the-boundary\r\n\x00\xff");
    let mut body = Vec::new();
    body.extend_from_slice(
        format!(
            "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"clip.wav\"\r\nContent-Type: audio/wav\r\n\r\n"
        )
        .as_bytes(),
    );
    body.extend_from_slice(&audio);
    if let Some(model) = model {
        body.extend_from_slice(
            format!(
                "\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}"
            )
            .as_bytes(),
        );
    }
    body.extend_from_slice(
        format!("\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"response_format\"\r\n\r\njson\r\n--{BOUNDARY}--\r\n")
            .as_bytes(),
    );
    body
}

async fn transcribe(
    router: &TestRouter,
    body: Vec<u8>,
    content_type: &str,
) -> (u16, Option<String>) {
    let resp = client()
        .post(router.url("/v1/audio/transcriptions"))
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .unwrap();
    let backend = resp
        .headers()
        .get("x-inferlb-backend")
        .map(|v| v.to_str().unwrap().to_owned());
    (resp.status().as_u16(), backend)
}

#[tokio::test]
async fn multipart_is_routed_by_its_model_field_and_forwarded_untouched() {
    let a = FakeBackend::start("a", &["whisper-a"]).await;
    let b = FakeBackend::start("b", &["whisper-b"]).await;
    let router = start_router(config(&[&a, &b])).await;
    let content_type = format!("multipart/form-data; boundary={BOUNDARY}");

    // Several rounds, so that load-based picking cannot pass this by luck (2^-8).
    for _ in 0..4 {
        for (model, fake, other) in [("whisper-b", &b, &a), ("whisper-a", &a, &b)] {
            let body = transcription_form(Some(model));
            let before = other.state.completions.load(Ordering::Relaxed);
            let (status, served_by) = transcribe(&router, body.clone(), &content_type).await;
            assert_eq!(status, 200, "{model}");
            assert_eq!(served_by.as_deref(), Some(fake.url().as_str()), "{model}");
            let received = fake.state.last_body.lock().unwrap().clone().unwrap();
            assert_eq!(received.as_ref(), body.as_slice(), "the exact bytes arrive");
            let headers = fake.state.last_headers.lock().unwrap().clone().unwrap();
            assert_eq!(headers["content-type"], content_type.as_str());
            assert_eq!(other.state.completions.load(Ordering::Relaxed), before);
        }
    }

    // Without a model field: any backend serving models takes it.
    let (status, served_by) = transcribe(&router, transcription_form(None), &content_type).await;
    assert_eq!(status, 200);
    assert!(served_by.is_some());

    // A model nobody serves is the usual 404; a multipart type without a boundary is a 400.
    let (status, _) = transcribe(&router, transcription_form(Some("nope")), &content_type).await;
    assert_eq!(status, 404);
    let (status, _) = transcribe(
        &router,
        transcription_form(Some("whisper-a")),
        "multipart/form-data",
    )
    .await;
    assert_eq!(status, 400);
    router.shutdown().await;
}
