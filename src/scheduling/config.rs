//! The scheduling section's plugin tables: `[[plugins]]` (instances: a type, a name and the
//! parameters handed to that type's factory, which checks them) and `[[scheduling_profiles]]`
//! (which instances a profile runs, scorers with weights). Both are checked by building them
//! ([`super::profile::build_active`]); errors name `plugins.NAME.parameters` or
//! `scheduling_profiles[i]...`. Kept apart from the registry and the profile builder so both
//! read it without importing each other.

use serde::Deserialize;

/// What building the scheduling profiles reads of the configuration: the plugin tables, the
/// active profile's name, the decision log's size and the per-backend in-flight limit. The
/// composer (`crate::config`) lends it, so the profile builder never names the whole file.
#[derive(Debug, Clone, Copy)]
pub struct ProfileInputs<'a> {
    pub plugins: &'a [PluginSpec],
    pub scheduling_profiles: &'a [ProfileSpec],
    /// `profile`: the active profile (default: the first).
    pub profile: Option<&'a str>,
    /// `pd.prefill_profile`: the profile of prefill steps (default: the active one).
    pub prefill_profile: Option<&'a str>,
    /// `admin.decisions`, `admin.decisions_always`.
    pub decisions: usize,
    pub decisions_always: bool,
    /// `limits.max_inflight_per_backend` (0: none).
    pub max_inflight_per_backend: u64,
}

/// A plugin instance: `type` picks the factory, `name` is how profiles refer to it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginSpec {
    #[serde(rename = "type")]
    pub kind: String,
    /// Defaults to the type name.
    #[serde(default)]
    pub name: Option<String>,
    /// Handed to the plugin's own factory, which rejects unknown keys.
    #[serde(default)]
    pub parameters: toml::Table,
}

impl PluginSpec {
    pub fn instance_name(&self) -> &str {
        self.name.as_deref().unwrap_or(&self.kind)
    }
}

/// A scheduling profile: the plugins it uses, scorers with weights.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileSpec {
    pub name: String,
    pub plugins: Vec<ProfilePluginRef>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfilePluginRef {
    pub plugin_ref: String,
    /// Only meaningful for scorers; defaults to 1.
    #[serde(default)]
    pub weight: Option<f64>,
}
