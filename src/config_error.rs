//! [`ConfigError`]: what every configuration section reports, and the only thing they share.
//!
//! It lives in a leaf module of its own, importing nothing from the crate, so that each module
//! can own its section of the configuration (struct, defaults, `validate`) and report a bad
//! field without importing [`crate::config`], which composes those sections: the arrows run
//! from `config` to the sections and from every section to here, never back. It is not in
//! [`crate::error`] because that module is the HTTP edge (statuses and OpenAI error bodies,
//! on axum), and a configuration error is reported at start or on a reload, never as a
//! response.
//!
//! `field` is the key's full path in `config.toml` (`discovery.kubernetes.namespace`,
//! `backends[2].url`, `plugins.NAME.parameters`), or the command-line flag that set it
//! (`--discovery`), so the message points at the line to fix.

/// A configuration problem found at start or on a reload.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("invalid config {path}: {message}")]
    Parse { path: String, message: String },
    #[error("invalid config: `{field}`: {message}")]
    Invalid { field: String, message: String },
}

impl ConfigError {
    /// The value at `field` (its full path) is wrong because of `message`.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }
}
