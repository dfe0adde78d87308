//! TLS client settings for `https://` backends: which roots are trusted, built once per CA file.
//!
//! Without a CA file the compiled-in Mozilla roots (`webpki-roots`) are trusted, not the host's
//! certificate store: inferlb then behaves the same in a scratch container, a distroless image
//! and on a developer's laptop, and a public managed endpoint verifies out of the box. A fleet
//! behind a private CA names it with `ca_file` (per backend, or `forward.ca_file` for all);
//! then only that file's certificates are trusted for those backends, so a certificate from a
//! public CA cannot stand in for one of the fleet's. The crypto provider is `ring` (see the
//! dependency note in `Cargo.toml`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::{ClientConfig, RootCertStore};

/// Why a TLS client configuration could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read CA certificates from {path}: {reason}")]
    CaFile { path: String, reason: String },
    #[error("{path} holds no CA certificate")]
    NoCertificate { path: String },
    #[error("TLS setup: {0}")]
    Rustls(#[from] rustls::Error),
}

/// Trusted roots for a CA file, or the built-in roots.
fn roots(ca_file: Option<&Path>) -> Result<RootCertStore, TlsError> {
    let Some(path) = ca_file else {
        return Ok(RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        });
    };
    let failed = |reason: String| TlsError::CaFile {
        path: path.display().to_string(),
        reason,
    };
    let mut store = RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(path).map_err(|e| failed(e.to_string()))? {
        let cert = cert.map_err(|e| failed(e.to_string()))?;
        store.add(cert).map_err(|e| failed(e.to_string()))?;
    }
    if store.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.display().to_string(),
        });
    }
    Ok(store)
}

/// A client configuration trusting `ca_file` (or the built-in roots), speaking HTTP/1.1.
pub fn client_config(ca_file: Option<&Path>) -> Result<Arc<ClientConfig>, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots(ca_file)?)
        .with_no_client_auth();
    // The connection pool speaks HTTP/1.1 only; say so, so a server that offers h2 does not pick it.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Client configurations by CA file, so backends sharing a CA share one configuration (and
/// the built-in roots are parsed once).
#[derive(Debug, Default)]
pub struct ClientConfigs {
    /// `forward.ca_file`: used by https backends without a `ca_file` of their own.
    default_ca: Option<PathBuf>,
    built: HashMap<Option<PathBuf>, Arc<ClientConfig>>,
}

impl ClientConfigs {
    pub fn new(default_ca: Option<PathBuf>) -> Self {
        ClientConfigs {
            default_ca,
            built: HashMap::new(),
        }
    }

    /// The configuration for a backend with `ca_file` (or none: the default CA, else the
    /// built-in roots).
    pub fn get(&mut self, ca_file: Option<&Path>) -> Result<Arc<ClientConfig>, TlsError> {
        let key = ca_file
            .map(Path::to_path_buf)
            .or_else(|| self.default_ca.clone());
        if let Some(config) = self.built.get(&key) {
            return Ok(Arc::clone(config));
        }
        let config = client_config(key.as_deref())?;
        self.built.insert(key, Arc::clone(&config));
        Ok(config)
    }
}
