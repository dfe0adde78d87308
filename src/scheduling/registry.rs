//! The plugin registry: type name → factory. Every built-in plugin is registered in
//! [`build`], and nowhere else; adding a plugin means one module and one line here.

use std::sync::Arc;

use super::framework::{Filter, Picker, Plugin, Scorer};
use super::plugins::filter::{
    capacity::CapacityFilter, healthy::HealthyFilter, model::ModelFilter,
    saturation::SaturationFilter,
};
use super::plugins::picker::{
    max_score::MaxScorePicker, random::RandomPicker, round_robin::RoundRobinPicker,
    weighted_random::WeightedRandomPicker,
};
use super::plugins::scorer::{
    inflight::InflightScorer, kv_cache_utilization::KvCacheUtilizationScorer,
    prefix_cache::PrefixCacheScorer, queue::QueueScorer,
};
use crate::config::{ConfigError, PluginSpec};

/// A built plugin, by role.
#[derive(Clone)]
pub enum PluginInstance {
    Filter(Arc<dyn Filter>),
    Scorer(Arc<dyn Scorer>),
    Picker(Arc<dyn Picker>),
}

impl PluginInstance {
    pub fn as_plugin(&self) -> Arc<dyn Plugin> {
        match self {
            PluginInstance::Filter(p) => p.clone(),
            PluginInstance::Scorer(p) => p.clone(),
            PluginInstance::Picker(p) => p.clone(),
        }
    }
}

/// Every type name the registry knows.
pub const TYPES: &[&str] = &[
    HealthyFilter::TYPE,
    ModelFilter::TYPE,
    SaturationFilter::TYPE,
    CapacityFilter::TYPE,
    KvCacheUtilizationScorer::TYPE,
    QueueScorer::TYPE,
    InflightScorer::TYPE,
    PrefixCacheScorer::TYPE,
    MaxScorePicker::TYPE,
    RandomPicker::TYPE,
    WeightedRandomPicker::TYPE,
    RoundRobinPicker::TYPE,
];

/// Build one plugin instance from its config entry.
pub fn build(spec: &PluginSpec) -> Result<PluginInstance, ConfigError> {
    let name = spec.instance_name();
    let no_parameters = || {
        if spec.parameters.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::invalid(
                format!("plugins.{name}.parameters"),
                format!("`{}` takes no parameters", spec.kind),
            ))
        }
    };
    let table = &spec.parameters;
    Ok(match spec.kind.as_str() {
        HealthyFilter::TYPE => {
            no_parameters().map(|_| PluginInstance::Filter(Arc::new(HealthyFilter::new(name))))?
        }
        ModelFilter::TYPE => {
            no_parameters().map(|_| PluginInstance::Filter(Arc::new(ModelFilter::new(name))))?
        }
        SaturationFilter::TYPE => {
            PluginInstance::Filter(Arc::new(SaturationFilter::from_parameters(name, table)?))
        }
        KvCacheUtilizationScorer::TYPE => no_parameters()
            .map(|_| PluginInstance::Scorer(Arc::new(KvCacheUtilizationScorer::new(name))))?,
        QueueScorer::TYPE => {
            no_parameters().map(|_| PluginInstance::Scorer(Arc::new(QueueScorer::new(name))))?
        }
        InflightScorer::TYPE => {
            no_parameters().map(|_| PluginInstance::Scorer(Arc::new(InflightScorer::new(name))))?
        }
        PrefixCacheScorer::TYPE => {
            PluginInstance::Scorer(Arc::new(PrefixCacheScorer::from_parameters(name, table)?))
        }
        MaxScorePicker::TYPE => {
            no_parameters().map(|_| PluginInstance::Picker(Arc::new(MaxScorePicker::new(name))))?
        }
        RandomPicker::TYPE => {
            no_parameters().map(|_| PluginInstance::Picker(Arc::new(RandomPicker::new(name))))?
        }
        WeightedRandomPicker::TYPE => no_parameters()
            .map(|_| PluginInstance::Picker(Arc::new(WeightedRandomPicker::new(name))))?,
        RoundRobinPicker::TYPE => no_parameters()
            .map(|_| PluginInstance::Picker(Arc::new(RoundRobinPicker::new(name))))?,
        other => {
            return Err(ConfigError::invalid(
                format!("plugins.{name}.type"),
                format!(
                    "unknown plugin type `{other}` (known: {})",
                    TYPES.join(", ")
                ),
            ))
        }
    })
}
