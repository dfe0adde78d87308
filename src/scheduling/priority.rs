//! Priority classes: which class a request waits in, from its header and its API key's rules.
//!
//! Classes are the names of `priority.classes`, highest first; a request is tagged with the
//! class's index (0 = highest). It asks with the `priority.header` (a class name); it gets
//! `default` when it asks for none or for a name that is not a class, and never a class above
//! its ceiling (`max_class`, per API key or global), so a client cannot promote itself. The
//! capacity queue ([`crate::endpoints::capacity`]) serves higher classes first and sheds lower
//! ones first.
//!
//! It owns the `[priority]` section ([`PriorityConfig`]: its defaults and checks).

use std::collections::BTreeMap;

use http::HeaderValue;
use serde::Deserialize;

use crate::config_error::ConfigError;
use crate::endpoints::capacity::MAX_PRIORITY_CLASSES;

/// The priority classes one API key may use (indices into `priority.classes`, 0 = highest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassRule {
    pub default: u8,
    /// The highest class (smallest index) the key may ask for.
    pub max: u8,
}

impl ClassRule {
    /// The global rule of `cfg` (for clients without a key rule of their own).
    pub fn global(cfg: &PriorityConfig) -> Self {
        ClassRule {
            default: cfg.index(&cfg.default_class).unwrap_or(0),
            max: cfg.index(&cfg.max_class).unwrap_or(0),
        }
    }
}

/// The class of a request that asked for `asked` under `rule`.
pub fn class_of(cfg: &PriorityConfig, asked: Option<&HeaderValue>, rule: ClassRule) -> u8 {
    let wanted = asked
        .and_then(|v| v.to_str().ok())
        .and_then(|name| cfg.index(name.trim()))
        .unwrap_or(rule.default);
    // A larger index is a lower class: the ceiling is the smallest index allowed.
    wanted.max(rule.max)
}

/// `[priority]`: classes of requests waiting for a backend slot, highest first. A request asks
/// for a class with the `header`; it gets at most its `max_class` (per API key, else the
/// global one) and `default_class` when it asks for none or for an unknown name.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PriorityConfig {
    pub header: String,
    /// Class names, highest priority first (1..=8, `[a-z0-9_-]`, at most 32 bytes each).
    pub classes: Vec<String>,
    pub default_class: String,
    /// The highest class a request may ask for.
    pub max_class: String,
    /// Per-class queue timeouts (ms) replacing `limits.queue_timeout_ms`.
    pub queue_timeout_ms: BTreeMap<String, u64>,
    /// Per-API-key default and ceiling.
    pub keys: Vec<KeyPriority>,
}

impl Default for PriorityConfig {
    fn default() -> Self {
        PriorityConfig {
            header: "x-inferlb-priority".into(),
            classes: vec!["interactive".into(), "standard".into(), "batch".into()],
            default_class: "standard".into(),
            max_class: "standard".into(),
            queue_timeout_ms: BTreeMap::new(),
            keys: Vec::new(),
        }
    }
}

/// `[[priority.keys]]`: the class rules of one API key (one of `auth.api_keys` or the files).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KeyPriority {
    pub key: String,
    /// Defaults to `priority.default_class`.
    #[serde(default)]
    pub default_class: Option<String>,
    /// Defaults to `priority.max_class`.
    #[serde(default)]
    pub max_class: Option<String>,
}

impl PriorityConfig {
    /// The index (0 = highest) of class `name`.
    pub fn index(&self, name: &str) -> Option<u8> {
        self.classes
            .iter()
            .position(|c| c == name)
            .and_then(|i| u8::try_from(i).ok())
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let n = self.classes.len();
        if n == 0 || n > MAX_PRIORITY_CLASSES {
            return Err(ConfigError::invalid(
                "priority.classes",
                format!("needs 1..={MAX_PRIORITY_CLASSES} classes"),
            ));
        }
        for (i, c) in self.classes.iter().enumerate() {
            let ok = !c.is_empty()
                && c.len() <= 32
                && c.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-'
                });
            if !ok {
                return Err(ConfigError::invalid(
                    format!("priority.classes[{i}]"),
                    format!("`{c}`: class names are 1..=32 of [a-z0-9_-]"),
                ));
            }
            if self.classes[..i].contains(c) {
                return Err(ConfigError::invalid(
                    format!("priority.classes[{i}]"),
                    format!("`{c}` is listed twice"),
                ));
            }
        }
        let known = |field: String, name: &str| {
            if self.index(name).is_some() {
                Ok(())
            } else {
                Err(ConfigError::invalid(
                    field,
                    format!(
                        "unknown class `{name}` (classes: {})",
                        self.classes.join(", ")
                    ),
                ))
            }
        };
        known("priority.default_class".into(), &self.default_class)?;
        known("priority.max_class".into(), &self.max_class)?;
        for (name, ms) in &self.queue_timeout_ms {
            known(format!("priority.queue_timeout_ms.{name}"), name)?;
            if *ms == 0 {
                return Err(ConfigError::invalid(
                    format!("priority.queue_timeout_ms.{name}"),
                    "must be greater than 0",
                ));
            }
        }
        for (i, k) in self.keys.iter().enumerate() {
            if let Some(c) = &k.default_class {
                known(format!("priority.keys[{i}].default_class"), c)?;
            }
            if let Some(c) = &k.max_class {
                known(format!("priority.keys[{i}].max_class"), c)?;
            }
        }
        if http::HeaderName::from_bytes(self.header.as_bytes()).is_err() {
            return Err(ConfigError::invalid(
                "priority.header",
                format!("`{}` is not a valid header name", self.header),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn asked_class_is_capped_by_the_ceiling_and_defaults_apply() {
        let cfg = PriorityConfig::default(); // interactive, standard, batch; default = max = standard
        let global = ClassRule::global(&cfg);
        assert_eq!(global, ClassRule { default: 1, max: 1 });
        let h = |s: &'static str| HeaderValue::from_static(s);
        assert_eq!(class_of(&cfg, None, global), 1);
        assert_eq!(
            class_of(&cfg, Some(&h("batch")), global),
            2,
            "demotion is free"
        );
        assert_eq!(
            class_of(&cfg, Some(&h("interactive")), global),
            1,
            "no self-promotion"
        );
        assert_eq!(
            class_of(&cfg, Some(&h("gold")), global),
            1,
            "unknown → default"
        );
        let vip = ClassRule { default: 1, max: 0 };
        assert_eq!(class_of(&cfg, Some(&h("interactive")), vip), 0);
        assert_eq!(class_of(&cfg, None, vip), 1);
        let batch_key = ClassRule { default: 2, max: 2 };
        assert_eq!(class_of(&cfg, Some(&h("interactive")), batch_key), 2);
    }

    #[test]
    fn priority_classes_are_checked_and_named() {
        let parse = |text: &str| toml::from_str::<PriorityConfig>(text).unwrap();
        let c = PriorityConfig::default();
        c.validate().unwrap();
        assert_eq!(c.index("interactive"), Some(0));
        assert_eq!(c.index("batch"), Some(2));
        for (text, field) in [
            ("classes = []\n", "priority.classes"),
            (
                "classes = [\"a\", \"a\"]\ndefault_class = \"a\"\nmax_class = \"a\"\n",
                "priority.classes[1]",
            ),
            ("classes = [\"Has Space\"]\n", "priority.classes[0]"),
            ("default_class = \"gold\"\n", "priority.default_class"),
            ("max_class = \"gold\"\n", "priority.max_class"),
            (
                "[queue_timeout_ms]\ngold = 5\n",
                "priority.queue_timeout_ms.gold",
            ),
            (
                "[queue_timeout_ms]\nbatch = 0\n",
                "priority.queue_timeout_ms.batch",
            ),
            (
                "[[keys]]\nkey = \"k\"\nmax_class = \"gold\"\n",
                "priority.keys[0].max_class",
            ),
            ("header = \"bad header\"\n", "priority.header"),
        ] {
            let err = parse(text).validate().unwrap_err().to_string();
            assert!(err.contains(field), "{text}: {err}");
        }
        let err = toml::from_str::<PriorityConfig>("levels = 3\n").unwrap_err();
        assert!(err.to_string().contains("levels"), "{err}");
    }
}
