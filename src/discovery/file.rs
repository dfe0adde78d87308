//! `file` discovery: backends listed in a file, re-read when it changes.
//!
//! `.toml`: `[[backends]]` tables exactly as in `config.toml`; `.json`: a list of the same
//! objects (`[{"url": "http://10.0.0.5:8000"}, …]`). The file's modification time and size
//! are checked every `poll_interval_ms` (a cheap `stat`, no watcher thread or inotify limits);
//! a file that cannot be read or parsed is reported and the last good set stays.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use serde::Deserialize;

use super::{DesiredBackend, Discovery, DiscoveryError, NextSet};
use crate::config_error::ConfigError;
use crate::discovery::{BackendDefaults, FileDiscoveryConfig};
use crate::endpoints::config::check_role;
use crate::endpoints::BackendConfig;

/// Largest backend file read.
const MAX_FILE_BYTES: u64 = 16 << 20;

pub struct FileDiscovery {
    path: PathBuf,
    interval: Duration,
    defaults: BackendDefaults,
    /// (modified, length) of the last version read; `None` before the first read.
    seen: Option<(Option<SystemTime>, u64)>,
    first: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TomlFile {
    #[serde(default)]
    backends: Vec<Entry>,
}

/// One entry: a backend config whose unset fields take the discovery defaults.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    url: String,
    #[serde(default)]
    engine: Option<String>,
    #[serde(default)]
    api_key: Option<String>,
    #[serde(default)]
    models: Option<Vec<String>>,
    #[serde(default)]
    ca_file: Option<PathBuf>,
    #[serde(default)]
    kv_events: Option<String>,
    #[serde(default)]
    kv_events_replay: Option<String>,
    #[serde(default)]
    role: Option<String>,
}

impl Entry {
    fn into_backend(self, d: &BackendDefaults) -> BackendConfig {
        BackendConfig {
            url: self.url,
            engine: self.engine.unwrap_or_else(|| d.engine.clone()),
            api_key: self.api_key.or_else(|| d.api_key.clone()),
            models: self.models.or_else(|| d.models.clone()),
            ca_file: self.ca_file.or_else(|| d.ca_file.clone()),
            kv_events: self.kv_events,
            kv_events_replay: self.kv_events_replay,
            role: self.role.or_else(|| d.role.clone()),
        }
    }
}

/// Parse a backend file's text; `json` picks the format.
pub fn parse(text: &str, json: bool, d: &BackendDefaults) -> Result<Vec<DesiredBackend>, String> {
    let entries: Vec<Entry> = if json {
        serde_json::from_str(text).map_err(|e| e.to_string())?
    } else {
        toml::from_str::<TomlFile>(text)
            .map_err(|e| e.message().to_owned())?
            .backends
    };
    for (i, e) in entries.iter().enumerate() {
        check_role(e.role.as_deref(), format!("backends[{i}].role")).map_err(|e| e.to_string())?;
    }
    Ok(entries
        .into_iter()
        .map(|e| {
            let mut b = DesiredBackend::new(e.into_backend(d));
            b.labels.insert("file_entry".into(), b.config.url.clone());
            b
        })
        .collect())
}

impl FileDiscovery {
    pub fn new(cfg: &FileDiscoveryConfig, defaults: &BackendDefaults) -> Result<Self, ConfigError> {
        let path = cfg.path.clone().ok_or_else(|| {
            ConfigError::invalid(
                "discovery.file.path",
                "the file discovery source needs a path",
            )
        })?;
        if cfg.poll_interval_ms == 0 {
            return Err(ConfigError::invalid(
                "discovery.file.poll_interval_ms",
                "must be greater than 0",
            ));
        }
        Ok(FileDiscovery {
            path,
            interval: Duration::from_millis(cfg.poll_interval_ms),
            defaults: defaults.clone(),
            seen: None,
            first: true,
        })
    }

    fn error(&self, message: String) -> DiscoveryError {
        DiscoveryError {
            source_name: "file",
            message: format!("{}: {message}", self.path.display()),
        }
    }

    async fn read(&mut self) -> Result<Option<Vec<DesiredBackend>>, DiscoveryError> {
        let meta = tokio::fs::metadata(&self.path)
            .await
            .map_err(|e| self.error(e.to_string()))?;
        let stamp = (meta.modified().ok(), meta.len());
        if self.seen == Some(stamp) {
            return Ok(None);
        }
        // Remember the version even if it fails to parse: one report per bad version.
        self.seen = Some(stamp);
        if meta.len() > MAX_FILE_BYTES {
            return Err(self.error(format!("larger than {MAX_FILE_BYTES} bytes")));
        }
        let text = tokio::fs::read_to_string(&self.path)
            .await
            .map_err(|e| self.error(e.to_string()))?;
        let json = self
            .path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"));
        parse(&text, json, &self.defaults)
            .map(Some)
            .map_err(|e| self.error(e))
    }
}

impl Discovery for FileDiscovery {
    fn source(&self) -> &'static str {
        "file"
    }

    fn next(&mut self) -> NextSet<'_> {
        Box::pin(async move {
            loop {
                if !self.first {
                    tokio::time::sleep(self.interval).await;
                }
                self.first = false;
                if let Some(set) = self.read().await? {
                    return Ok(set);
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn toml_and_json_with_defaults() {
        let d = BackendDefaults {
            api_key: Some("k".into()),
            ..BackendDefaults::default()
        };
        let t = parse(
            "[[backends]]\nurl = \"http://a:1\"\n[[backends]]\nurl = \"http://b:1\"\nengine = \"sglang\"\napi_key = \"own\"\n",
            false,
            &d,
        )
        .unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].config.api_key.as_deref(), Some("k"));
        assert_eq!(t[1].config.engine, "sglang");
        assert_eq!(t[1].config.api_key.as_deref(), Some("own"));
        let j = parse(r#"[{"url":"http://a:1","models":["m"]}]"#, true, &d).unwrap();
        assert_eq!(j[0].config.models, Some(vec!["m".to_owned()]));
        assert!(
            parse("[[backends]]\nurl = \"http://a:1\"\nbogus = 1\n", false, &d)
                .unwrap_err()
                .contains("bogus")
        );
        assert!(parse("[{\"uri\":\"x\"}]", true, &d).is_err());
        assert!(parse("", false, &d).unwrap().is_empty());
    }

    #[test]
    fn entries_carry_a_role_or_the_default_one() {
        let d = BackendDefaults {
            role: Some("decode".into()),
            ..BackendDefaults::default()
        };
        let j = parse(
            r#"[{"url":"http://a:1","role":"prefill"},{"url":"http://b:1"}]"#,
            true,
            &d,
        )
        .unwrap();
        assert_eq!(j[0].config.role(), crate::endpoints::BackendRole::Prefill);
        assert_eq!(j[1].config.role(), crate::endpoints::BackendRole::Decode);
        let err = parse(
            r#"[{"url":"http://a:1"},{"url":"http://b:1","role":"p"}]"#,
            true,
            &d,
        )
        .unwrap_err();
        assert!(err.contains("backends[1].role"), "{err}");
    }

    #[tokio::test]
    async fn a_changed_file_is_read_again_and_a_broken_one_reported() {
        let dir = std::env::temp_dir().join(format!("inferlb-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("backends.json");
        std::fs::write(&path, r#"[{"url":"http://a:1"}]"#).unwrap();
        let cfg = FileDiscoveryConfig {
            path: Some(path.clone()),
            poll_interval_ms: 1,
        };
        let mut f = FileDiscovery::new(&cfg, &BackendDefaults::default()).unwrap();
        assert_eq!(f.next().await.unwrap().len(), 1);
        assert!(f.read().await.unwrap().is_none(), "unchanged: nothing new");
        std::fs::write(&path, r#"[{"url":"http://a:1"},{"url":"http://b:1"}]"#).unwrap();
        assert_eq!(f.read().await.unwrap().unwrap().len(), 2);
        std::fs::write(&path, r#"[{"url":"#).unwrap();
        assert!(f.read().await.is_err());
        assert!(
            f.read().await.unwrap().is_none(),
            "reported once per version"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
