//! The plugin registry: one table of (type name, role, factory) rows. The list of known types
//! and the builder both read [`REGISTRY`], so they cannot drift apart; adding a plugin means
//! one module and one row here.

use std::sync::Arc;

use super::framework::{PluginInstance, Role};
use super::plugins::filter::{
    capacity::CapacityFilter, healthy::HealthyFilter, model::ModelFilter, pinned::PinnedFilter,
    role::RoleFilter, saturation::SaturationFilter,
};
use super::plugins::picker::{
    max_score::MaxScorePicker, random::RandomPicker, round_robin::RoundRobinPicker,
    weighted_random::WeightedRandomPicker,
};
use super::plugins::scorer::{
    inflight::InflightScorer, kv_cache_utilization::KvCacheUtilizationScorer,
    lora_affinity::LoraAffinityScorer, prefill_cost::PrefillCostScorer,
    prefix_cache::PrefixCacheScorer, queue::QueueScorer, session_affinity::SessionAffinityScorer,
};
use crate::config_error::ConfigError;
use crate::scheduling::config::PluginSpec;

/// Builds one instance from its name and `parameters` table.
pub type Factory = fn(&str, &toml::Table) -> Result<PluginInstance, ConfigError>;

/// One registered plugin type.
pub struct Registration {
    pub type_name: &'static str,
    pub role: Role,
    pub factory: Factory,
    /// A valid `parameters` table (TOML), for docs and for the test that builds every row.
    pub example: &'static str,
}

/// Refuse a non-empty `parameters` table for a plugin that takes none.
fn no_parameters(name: &str, kind: &str, table: &toml::Table) -> Result<(), ConfigError> {
    if table.is_empty() {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            format!("plugins.{name}.parameters"),
            format!("`{kind}` takes no parameters"),
        ))
    }
}

/// A row for a plugin with a `new(name)` constructor and no parameters.
macro_rules! plain {
    ($ty:ty, $role:ident) => {
        Registration {
            type_name: <$ty>::TYPE,
            role: Role::$role,
            factory: |name, table| {
                no_parameters(name, <$ty>::TYPE, table)?;
                Ok(PluginInstance::$role(Arc::new(<$ty>::new(name))))
            },
            example: "",
        }
    };
}

/// A row for a plugin with `from_parameters(name, table)`.
macro_rules! with_parameters {
    ($ty:ty, $role:ident, $example:expr) => {
        Registration {
            type_name: <$ty>::TYPE,
            role: Role::$role,
            factory: |name, table| {
                Ok(PluginInstance::$role(Arc::new(<$ty>::from_parameters(
                    name, table,
                )?)))
            },
            example: $example,
        }
    };
}

/// Every built-in plugin, one row each.
pub const REGISTRY: &[Registration] = &[
    plain!(HealthyFilter, Filter),
    plain!(ModelFilter, Filter),
    plain!(RoleFilter, Filter),
    plain!(PinnedFilter, Filter),
    with_parameters!(SaturationFilter, Filter, "max_waiting = 8.0"),
    with_parameters!(CapacityFilter, Filter, "max_inflight = 4"),
    plain!(KvCacheUtilizationScorer, Scorer),
    plain!(QueueScorer, Scorer),
    plain!(InflightScorer, Scorer),
    with_parameters!(PrefixCacheScorer, Scorer, "block_size = 32"),
    with_parameters!(SessionAffinityScorer, Scorer, "load_factor = 1.5"),
    with_parameters!(
        PrefillCostScorer,
        Scorer,
        "decode_weight = 0.1\nprefix = { block_size = 32 }"
    ),
    plain!(LoraAffinityScorer, Scorer),
    plain!(MaxScorePicker, Picker),
    plain!(RandomPicker, Picker),
    plain!(WeightedRandomPicker, Picker),
    plain!(RoundRobinPicker, Picker),
];

/// Every type name the registry knows, in table order.
pub fn types() -> impl Iterator<Item = &'static str> {
    REGISTRY.iter().map(|r| r.type_name)
}

/// Build one plugin instance from its config entry.
pub fn build(spec: &PluginSpec) -> Result<PluginInstance, ConfigError> {
    let name = spec.instance_name();
    let Some(row) = REGISTRY.iter().find(|r| r.type_name == spec.kind) else {
        return Err(ConfigError::invalid(
            format!("plugins.{name}.type"),
            format!(
                "unknown plugin type `{}` (known: {})",
                spec.kind,
                types().collect::<Vec<_>>().join(", ")
            ),
        ));
    };
    (row.factory)(name, &spec.parameters)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::config::Config;
    use crate::scheduling::framework::{Plugin, Scorer};

    /// Every row builds from a config file that declares it and uses it in a profile, with the
    /// role the row claims; a type listed but not buildable (the old `capacity-filter` defect)
    /// fails here.
    #[test]
    fn every_registered_type_builds_from_config() {
        for row in REGISTRY {
            let weight = if row.role == Role::Scorer {
                "weight = 1.0"
            } else {
                ""
            };
            let text = format!(
                "backends = [{{ url = \"http://127.0.0.1:9\" }}]\n\
                 [[plugins]]\ntype = \"{t}\"\nname = \"under-test\"\n\
                 [plugins.parameters]\n{example}\n\
                 [[scheduling_profiles]]\nname = \"p\"\n\
                 [[scheduling_profiles.plugins]]\nplugin_ref = \"under-test\"\n{weight}\n",
                t = row.type_name,
                example = row.example,
            );
            let config: Config = toml::from_str(&text)
                .unwrap_or_else(|e| panic!("{}: config does not parse: {e}", row.type_name));
            let instance = build(&config.plugins[0])
                .unwrap_or_else(|e| panic!("{}: does not build: {e}", row.type_name));
            assert_eq!(instance.role(), row.role, "{}", row.type_name);
            assert_eq!(instance.as_plugin().type_name(), row.type_name);
            assert_eq!(instance.as_plugin().name(), "under-test");
            crate::scheduling::profile::build_active(config.scheduling())
                .unwrap_or_else(|e| panic!("{}: profile does not build: {e}", row.type_name));
        }
    }

    #[test]
    fn type_names_are_unique_and_unknown_types_are_named() {
        let mut names: Vec<_> = types().collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), REGISTRY.len());
        let spec: PluginSpec = toml::from_str("type = \"no-such-thing\"").unwrap();
        let err = build(&spec).err().unwrap().to_string();
        assert!(
            err.contains("no-such-thing") && err.contains("capacity-filter"),
            "{err}"
        );
    }

    /// A plugin answering every [`Plugin`] method in its own way, to see each one reached
    /// through the instance's plugin view (a hand-written forwarder once left a hook out, so
    /// every plugin got the default no-op instead).
    struct EveryHook(std::sync::Mutex<Vec<&'static str>>);

    impl EveryHook {
        fn saw(&self, hook: &'static str) {
            self.0.lock().unwrap().push(hook);
        }
    }

    impl Plugin for EveryHook {
        fn type_name(&self) -> &'static str {
            "every-hook"
        }
        fn name(&self) -> &str {
            "probe"
        }
        fn after_pick(
            &self,
            _: &crate::prompt::RequestView,
            _: &super::super::framework::CycleState,
            _: &crate::endpoints::Backend,
        ) {
            self.saw("after_pick");
        }
        fn prompt_work(
            &self,
            _: &crate::prompt::RequestView,
            _: &super::super::framework::CycleState,
            _: &crate::endpoints::Backend,
        ) -> Option<super::super::framework::PromptWork> {
            self.saw("prompt_work");
            Some(super::super::framework::PromptWork {
                uncached: 1,
                prompt: 2,
            })
        }
        fn backend_removed(&self, _: &crate::endpoints::Backend) {
            self.saw("backend_removed");
        }
        fn refresh_metrics(&self) {
            self.saw("refresh_metrics");
        }
        fn link_target(&self) -> Option<super::super::framework::Link<'_>> {
            self.saw("link_target");
            Some(super::super::framework::Link::FirstOfType("x"))
        }
        fn link(&self, _: &PluginInstance) -> Result<(), String> {
            self.saw("link");
            Err("no".into())
        }
        fn linked(&self) -> Option<&str> {
            self.saw("linked");
            Some("y")
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    impl Scorer for EveryHook {
        fn score(
            &self,
            _: &crate::prompt::RequestView,
            _: &mut super::super::framework::CycleState,
            _: &[crate::endpoints::Candidate<'_>],
            _: &mut [f64],
        ) {
        }
    }

    #[test]
    fn the_plugin_view_reaches_every_hook() {
        let probe = Arc::new(EveryHook(std::sync::Mutex::default()));
        let instance = PluginInstance::Scorer(probe.clone());
        let plugin = instance.as_plugin();
        let b = crate::endpoints::test_support::backends(1);
        let view = crate::prompt::RequestView::parse(
            crate::prompt::Operation::Completions,
            br#"{"prompt":"x"}"#,
        )
        .unwrap();
        let state = super::super::framework::CycleState::default();
        assert_eq!(plugin.type_name(), "every-hook");
        assert_eq!(plugin.name(), "probe");
        plugin.after_pick(&view, &state, &b[0]);
        assert!(plugin.prompt_work(&view, &state, &b[0]).is_some());
        plugin.backend_removed(&b[0]);
        plugin.refresh_metrics();
        assert!(plugin.link_target().is_some());
        assert!(plugin.link(&instance).is_err());
        assert_eq!(plugin.linked(), Some("y"));
        assert!(plugin.as_any().downcast_ref::<EveryHook>().is_some());
        assert_eq!(
            *probe.0.lock().unwrap(),
            [
                "after_pick",
                "prompt_work",
                "backend_removed",
                "refresh_metrics",
                "link_target",
                "link",
                "linked"
            ]
        );
    }

    #[test]
    fn plain_plugins_refuse_parameters() {
        let spec: PluginSpec =
            toml::from_str("type = \"queue-scorer\"\n[parameters]\nx = 1").unwrap();
        assert!(build(&spec).is_err());
    }
}
