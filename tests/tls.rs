//! `https://` backends: requests and scrapes go through TLS, verified against the configured
//! CA, with SNI from the URL's host; a backend whose certificate that CA did not sign is kept
//! out and says why. Every certificate is made here, for this run, by a test CA.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use common::*;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A test certificate authority: its PEM, and what it needs to sign server certificates.
struct TestCa {
    pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl TestCa {
    fn new(name: &str) -> TestCa {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let cert = params.self_signed(&key).unwrap();
        TestCa {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// Write the CA certificate to a file of its own and return its path.
    fn write(&self, tag: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!(
            "inferlb-test-ca-{}-{tag}-{}.pem",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::write(&path, &self.pem).unwrap();
        path
    }

    /// A server configuration with a certificate for `localhost` and 127.0.0.1 signed by this CA.
    fn server_config(&self) -> Arc<rustls::ServerConfig> {
        let key = KeyPair::generate().unwrap();
        let params =
            CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let chain = vec![CertificateDer::from(cert.der().to_vec())];
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Arc::new(config)
    }
}

fn backend_json<'a>(v: &'a serde_json::Value, url: &str) -> &'a serde_json::Value {
    v["backends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["url"] == url)
        .expect("backend listed")
}

#[tokio::test]
async fn https_backend_is_scraped_and_serves_chat_through_tls() {
    let ca = TestCa::new("inferlb test CA");
    let backend = FakeBackend::start_tls("tls-a", &["m"], ca.server_config()).await;
    let mut cfg = config(&[&backend]);
    let ca_file = ca.write("good");
    cfg.forward.ca_file = Some(ca_file.clone());
    let router = start_router(cfg).await;

    // The scrape goes through the same TLS connect path: the backend turns healthy.
    until_backends_json(&router, |v| healthy(v, &backend.url())).await;
    let (status, served_by, body) = chat(&router, "m", "hello over TLS").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(served_by.as_deref(), Some(backend.url().as_str()));
    assert_eq!(body["served_by"], "tls-a");
    assert_eq!(
        backend.state.sni.lock().unwrap().as_deref(),
        Some("localhost"),
        "SNI carries the URL's host"
    );
    assert_eq!(backend.state.tls_failures.load(Ordering::Relaxed), 0);
    router.shutdown().await;
    let _ = std::fs::remove_file(ca_file);
}

#[tokio::test]
async fn backend_signed_by_another_ca_is_refused_and_reported() {
    let trusted = TestCa::new("inferlb trusted CA");
    let stranger = TestCa::new("someone else's CA");
    let good = FakeBackend::start_tls("tls-good", &["m"], trusted.server_config()).await;
    let bad = FakeBackend::start_tls("tls-bad", &["m"], stranger.server_config()).await;
    let mut cfg = config(&[&good, &bad]);
    let ca_file = trusted.write("trusted");
    // Per backend this time: each names the CA it must be signed by.
    for b in &mut cfg.backends {
        b.ca_file = Some(ca_file.clone());
    }
    let router = start_router(cfg).await;

    until_backends_json(&router, |v| {
        healthy(v, &good.url())
            && backend_json(v, &bad.url())["last_error"]
                .as_str()
                .is_some_and(|e| e.contains("certificate"))
    })
    .await;
    let view = admin_view(&router).await;
    let bad_view = backend_json(&view, &bad.url());
    assert_eq!(bad_view["healthy"], false, "{view}");
    assert!(
        bad_view["last_error"].as_str().unwrap().contains("TLS"),
        "{view}"
    );
    for i in 0..6 {
        let (status, served_by, _) = chat(&router, "m", &format!("q{i}")).await;
        assert_eq!(status, 200);
        assert_eq!(served_by.as_deref(), Some(good.url().as_str()));
    }
    assert_eq!(bad.state.completions.load(Ordering::Relaxed), 0);
    assert!(bad.state.tls_failures.load(Ordering::Relaxed) > 0);
    let page = metrics_text(&router).await;
    let line = format!(
        "inferlb_backend_scrape_errors_total{{backend=\"{}\",kind=\"tls\"}}",
        bad.url()
    );
    assert!(page.contains(&line), "no {line} in\n{page}");
    router.shutdown().await;
    let _ = std::fs::remove_file(ca_file);
}
