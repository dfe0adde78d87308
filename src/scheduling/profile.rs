//! A scheduling profile: filters, then weighted scorers, then a picker.
//!
//! `total(c) = Σ weightᵢ × clamp(scoreᵢ(c), 0, 1)` is computed here and only here. Profiles
//! are built from the EndpointPickerConfig-shaped `plugins` / `scheduling_profiles` tables;
//! the health, model and role filters are always applied first, whether a profile names them
//! or not, because no weighting may send a request to a dead backend, one without the model,
//! or a prefill-only one.

use std::collections::HashMap;
use std::sync::Arc;

#[path = "decisions.rs"]
pub mod decisions;

use super::config::{PluginSpec, ProfileInputs, ProfilePluginRef, ProfileSpec};
use super::framework::{
    CycleState, Filter, Link, Picker, Plugin, PluginInstance, Rejection, Scorer,
};
use super::plugins::filter::{
    capacity::CapacityFilter, healthy::HealthyFilter, model::ModelFilter, pinned::PinnedFilter,
    role::RoleFilter, saturation::SaturationFilter,
};
use super::plugins::picker::max_score::MaxScorePicker;
use super::plugins::scorer::{
    kv_cache_utilization::KvCacheUtilizationScorer, prefill_cost::PrefillCostScorer,
    prefix_cache::PrefixCacheScorer,
};
use super::registry::build;
use crate::config_error::ConfigError;
use crate::endpoints::engine::EngineMetricNames;
use crate::endpoints::Candidate;
use crate::prompt::{RequestView, RoleScope};

/// The profile used when the config defines none, tuned with `loadgen compare` (see
/// `bench/results/tuning-*.md` and `bench/results/scheduling-2026-12-01.md`): a saturation
/// filter that takes a backend with more than 16 waiting requests out of the running (unless
/// all are), then prefix affinity 2, prefill cost 1, KV-cache utilisation 1. The prefill-cost
/// scorer replaced the router's in-flight count on 2026-12-01: in one unit (prompt tokens to
/// prefill) it weighs this request's uncached prompt against the prefill already queued on
/// each backend, so a hot prefix spills to a second backend once its holder's queue outgrows
/// it; medians of three runs beat the in-flight scorer on shared-prefix (uniform and Zipf),
/// unique and multi-turn workloads. The queue scorer is left out: its min–max normalisation
/// turns a difference of one or two waiting requests into a full-range swing, which under
/// load kept pulling requests away from the backend holding their prefix (TTFT p90 3–10×
/// worse on the shared-prefix benchmark); the filter keeps the queue's useful part — a backend
/// with a long queue stops attracting its prefixes. KV utilisation stays as the
/// backend-reported signal that other routers' traffic also shows up in.
pub const DEFAULT_PROFILE: &[(&str, Option<f64>)] = &[
    (SaturationFilter::TYPE, None),
    (PrefixCacheScorer::TYPE, Some(2.0)),
    (PrefillCostScorer::TYPE, Some(1.0)),
    (KvCacheUtilizationScorer::TYPE, Some(1.0)),
    (MaxScorePicker::TYPE, None),
];

/// The profile's choice.
pub struct Decision {
    /// Index into the candidates passed to [`Profile::run`].
    pub index: usize,
}

pub struct Profile {
    pub name: String,
    filters: Vec<Arc<dyn Filter>>,
    scorers: Vec<(Arc<dyn Scorer>, f64)>,
    picker: Arc<dyn Picker>,
    /// Every plugin of the profile, for lifecycle hooks.
    plugins: Vec<PluginInstance>,
    /// The smallest per-backend in-flight limit among the filters (see [`Filter::capacity`]).
    slot_limit: Option<u64>,
    /// Every declared plugin instance with the spec it was built from, for reuse on reload.
    built: HashMap<String, (PluginSpec, PluginInstance)>,
    /// Recent decisions, for `/admin/decisions` and the explain header.
    decisions: Arc<decisions::DecisionLog>,
    /// The profile that schedules prefill steps of disaggregated requests (`pd.prefill_profile`),
    /// when it is another one; `None`: this profile schedules them too.
    prefill: Option<Arc<Profile>>,
}

impl Profile {
    /// Filter `candidates` in place, score, and pick. When a filter leaves nobody, its
    /// [`Rejection`] says why. `state` is the request's, kept across its decisions.
    pub fn run(
        &self,
        request: &RequestView,
        state: &mut CycleState,
        candidates: &mut Vec<Candidate<'_>>,
    ) -> Result<Decision, Rejection> {
        if candidates.is_empty() {
            return Err(Rejection::Unavailable);
        }
        state.begin_decision();
        for filter in &self.filters {
            filter.filter(request, candidates);
            if candidates.is_empty() {
                return Err(filter.when_empty());
            }
        }
        let mut totals = vec![0.0; candidates.len()];
        let mut scratch = vec![0.0; candidates.len()];
        let debug = tracing::enabled!(tracing::Level::DEBUG);
        let recording = self.decisions.recording();
        let keep = debug || recording || decisions::want_explanation();
        let mut trace: Vec<Vec<f64>> = Vec::new();
        for (scorer, weight) in &self.scorers {
            scorer.score(request, state, candidates, &mut scratch);
            for (total, score) in totals.iter_mut().zip(&scratch) {
                let s = if score.is_finite() {
                    score.clamp(0.0, 1.0)
                } else {
                    0.0
                };
                *total += weight * s;
            }
            if keep {
                trace.push(scratch.clone());
            }
        }
        let index = self
            .picker
            .pick(candidates, &totals)
            .ok_or(Rejection::Unavailable)?;
        decisions::note_pick();
        if keep {
            let scorers: Vec<(&str, f64)> =
                self.scorers.iter().map(|(s, w)| (s.name(), *w)).collect();
            self.decisions.record(
                recording, &self.name, request, candidates, &scorers, &trace, &totals, index,
            );
        }
        if debug {
            for (i, c) in candidates.iter().enumerate() {
                let parts: Vec<String> = self
                    .scorers
                    .iter()
                    .zip(&trace)
                    .map(|((n, _), s)| format!("{}={:.3}", n.name(), s[i]))
                    .collect();
                tracing::debug!(
                    profile = %self.name,
                    backend = %c.backend.name,
                    total = totals[i],
                    picked = i == index,
                    scores = %parts.join(" "),
                    "candidate"
                );
            }
        }
        Ok(Decision { index })
    }

    /// The candidates every filter but the capacity ones keeps: where a request that found
    /// everyone at capacity may wait for a slot.
    pub fn uncapped<'a>(
        &self,
        request: &RequestView,
        candidates: &mut Vec<Candidate<'a>>,
    ) -> Vec<Arc<crate::endpoints::Backend>> {
        for filter in self.filters.iter().filter(|f| f.capacity().is_none()) {
            filter.filter(request, candidates);
        }
        candidates.iter().map(|c| Arc::clone(c.backend)).collect()
    }

    /// The per-backend in-flight limit slots are reserved under.
    pub fn slot_limit(&self) -> Option<u64> {
        self.slot_limit
    }

    /// The ring of recent decisions (shared by every profile built from one config).
    pub fn decisions(&self) -> &Arc<decisions::DecisionLog> {
        &self.decisions
    }

    /// Every plugin the profile lists, in its order, for lifecycle hooks.
    pub fn plugins(&self) -> impl Iterator<Item = &dyn Plugin> + '_ {
        self.plugins.iter().map(PluginInstance::as_plugin)
    }

    /// The profile for `request`: the prefill companion for a prefill step when there is one,
    /// else this one.
    pub fn for_request(&self, request: &RequestView) -> &Profile {
        match &self.prefill {
            Some(prefill) if request.roles == RoleScope::PrefillStep => prefill,
            _ => self,
        }
    }

    /// The prefill companion's name, when the prefill steps use another profile.
    pub fn prefill_profile(&self) -> Option<&str> {
        self.prefill.as_deref().map(|p| p.name.as_str())
    }

    /// This profile's plugins and its prefill companion's (a plugin both use comes twice), for
    /// the hooks every instance must see (a backend leaving, metrics refresh).
    pub fn every_plugin(&self) -> impl Iterator<Item = &dyn Plugin> + '_ {
        self.plugins()
            .chain(self.prefill.iter().flat_map(|p| p.plugins()))
    }

    /// Signals a scorer reads that a backend's engine does not report, as start-up warnings.
    /// For every scorer signal that an engine among `engines` (each backend's engine name and
    /// its metric names, `None` when unknown) does not report, a warning.
    pub fn missing_signals(&self, engines: &[(&str, Option<EngineMetricNames>)]) -> Vec<String> {
        let mut out = Vec::new();
        for (scorer, _) in &self.scorers {
            for signal in scorer.consumes() {
                let mut engines: Vec<&str> = engines
                    .iter()
                    .filter(|(_, names)| names.as_ref().is_some_and(|n| !signal.reported_by(n)))
                    .map(|(engine, _)| *engine)
                    .collect();
                engines.sort_unstable();
                engines.dedup();
                for engine in engines {
                    out.push(format!(
                        "scorer `{}` reads `{}`, which engine `{engine}` does not report: its \
                         backends score as unknown there",
                        scorer.name(),
                        signal.name()
                    ));
                }
            }
        }
        out
    }

    /// Describe the profile for the start-up log.
    pub fn describe(&self) -> String {
        let mut parts: Vec<String> = self.filters.iter().map(|f| f.name().to_owned()).collect();
        parts.extend(
            self.scorers
                .iter()
                .map(|(s, w)| format!("{}×{w}", s.name())),
        );
        parts.push(self.picker.name().to_owned());
        let mut out = format!("{}: {}", self.name, parts.join(" → "));
        if let Some(prefill) = &self.prefill {
            out.push_str("; prefill steps: ");
            out.push_str(&prefill.describe());
        }
        out
    }
}

/// Parameters of a default-profile plugin the config does not declare.
fn default_parameters(kind: &str) -> toml::Table {
    let mut table = toml::Table::new();
    if kind == SaturationFilter::TYPE {
        // Queue length only: under cache pressure KV usage is high everywhere, and the KV
        // scorer already weighs it.
        table.insert("max_waiting".into(), toml::Value::Float(16.0));
        table.insert("max_kv_usage".into(), toml::Value::Float(1.0));
    }
    table
}

/// The instance each plugin works through in the profile in effect (see
/// [`Plugin::link_target`]): a named one wherever the plugin is, the first of a type only for
/// the plugins of `active` (the others are built for validation alone).
fn link_targets(
    instances: &HashMap<String, PluginInstance>,
    active: Option<&ProfileSpec>,
) -> HashMap<String, String> {
    let refs: Vec<&str> = active.map_or_else(Vec::new, |p| {
        p.plugins.iter().map(|r| r.plugin_ref.as_str()).collect()
    });
    let type_of = |name: &str| instances.get(name).map(|i| i.as_plugin().type_name());
    instances
        .iter()
        .filter_map(|(name, instance)| {
            let plugin = instance.as_plugin();
            let link = plugin.link_target()?;
            if matches!(link, Link::FirstOfType(_)) && !refs.contains(&name.as_str()) {
                return None;
            }
            let target = link.resolve(refs.iter().copied(), type_of)?;
            Some((name.clone(), target))
        })
        .collect()
}

/// Hand every freshly built plugin that works through another instance that instance (see
/// [`Plugin::link_target`]). A reused instance is never re-linked: it belongs to the profile
/// in effect, and this build may still be refused. So a reused plugin whose target was
/// rebuilt, or changes, is rebuilt too (it keeps no state of its own while linked) before
/// this runs.
fn link_all(
    instances: &HashMap<String, PluginInstance>,
    targets: &HashMap<String, String>,
    reused: &std::collections::HashSet<String>,
    field_of: impl Fn(&str) -> String,
) -> Result<(), ConfigError> {
    let mut names: Vec<&String> = targets.keys().filter(|n| !reused.contains(*n)).collect();
    names.sort_unstable();
    for name in names {
        let plugin = instances[name].as_plugin();
        let target = &targets[name];
        let param = match plugin.link_target() {
            Some(Link::Named { param, .. }) => param,
            _ => "",
        };
        let field = if param.is_empty() {
            field_of(name)
        } else {
            format!("{}.{param}", field_of(name))
        };
        let Some(instance) = instances.get(target) else {
            return Err(ConfigError::invalid(
                field,
                format!("no plugin named `{target}` in [[plugins]]"),
            ));
        };
        plugin
            .link(instance)
            .map_err(|why| ConfigError::invalid(field, why))?;
    }
    Ok(())
}

/// Build the active profile (and validate all the others) from the config.
pub fn build_active(config: ProfileInputs<'_>) -> Result<Arc<Profile>, ConfigError> {
    build_active_reusing(config, None)
}

/// Like [`build_active`], reusing the plugin instances of `previous` whose name, type and
/// parameters are unchanged — a reload that only changes weights or limits keeps the prefix
/// index and every other plugin's state.
pub fn build_active_reusing(
    config: ProfileInputs<'_>,
    previous: Option<&Profile>,
) -> Result<Arc<Profile>, ConfigError> {
    let mut specs: HashMap<String, PluginSpec> = HashMap::new();
    let mut instances: HashMap<String, PluginInstance> = HashMap::new();
    let mut reused = std::collections::HashSet::new();
    let mut reuse_or_build = |spec: &PluginSpec| -> Result<PluginInstance, ConfigError> {
        match previous.and_then(|p| p.built.get(spec.instance_name())) {
            Some((old, instance)) if old == spec => {
                reused.insert(spec.instance_name().to_owned());
                Ok(instance.clone())
            }
            _ => build(spec),
        }
    };
    for (i, spec) in config.plugins.iter().enumerate() {
        let name = spec.instance_name().to_owned();
        if instances.contains_key(&name) {
            return Err(ConfigError::invalid(
                format!("plugins[{i}].name"),
                format!("duplicate plugin name `{name}`"),
            ));
        }
        instances.insert(name.clone(), reuse_or_build(spec)?);
        specs.insert(name, spec.clone());
    }
    let declared: HashMap<String, usize> = config
        .plugins
        .iter()
        .enumerate()
        .map(|(i, spec)| (spec.instance_name().to_owned(), i))
        .collect();
    let profiles: Vec<ProfileSpec> = if config.scheduling_profiles.is_empty() {
        // The default profile may use plugins the file does not declare: create them with defaults.
        for (kind, _) in DEFAULT_PROFILE {
            if !instances.contains_key(*kind) {
                let spec = PluginSpec {
                    kind: (*kind).to_owned(),
                    name: None,
                    parameters: default_parameters(kind),
                };
                instances.insert((*kind).to_owned(), reuse_or_build(&spec)?);
                specs.insert((*kind).to_owned(), spec);
            }
        }
        vec![ProfileSpec {
            name: "default".into(),
            plugins: DEFAULT_PROFILE
                .iter()
                .map(|(kind, weight)| ProfilePluginRef {
                    plugin_ref: (*kind).to_owned(),
                    weight: *weight,
                })
                .collect(),
        }]
    } else {
        config.scheduling_profiles.to_vec()
    };
    let wanted = config
        .profile
        .map_or_else(|| profiles[0].name.clone(), str::to_owned);
    let targets = link_targets(&instances, profiles.iter().find(|p| p.name == wanted));
    // A kept plugin linked to an instance this build replaces, or that would now be linked to
    // another instance (or to none), is replaced as well.
    let mut relink: Vec<String> = reused
        .iter()
        .filter(|name| {
            let target = targets.get(*name);
            target.is_some_and(|t| !reused.contains(t))
                || instances[*name].as_plugin().linked() != target.map(String::as_str)
        })
        .cloned()
        .collect();
    relink.sort_unstable();
    for name in relink {
        reused.remove(&name);
        instances.insert(name.clone(), build(&specs[&name])?);
    }
    let field_of = |name: &str| match declared.get(name) {
        Some(i) => format!("plugins[{i}].parameters"),
        None => format!("default profile's `{name}` parameters"),
    };
    link_all(&instances, &targets, &reused, field_of)?;
    if config.scheduling_profiles.is_empty() {
        // The default profile holds only its own plugins: a declared default plugin linked to
        // another instance is an error in that plugin's parameters, not in a profile the file
        // does not have.
        for (kind, _) in DEFAULT_PROFILE {
            let plugin = instances[*kind].as_plugin();
            if let Some(Link::Named {
                param,
                name: target,
            }) = plugin.link_target()
            {
                if !DEFAULT_PROFILE.iter().any(|(k, _)| *k == target) {
                    return Err(ConfigError::invalid(
                        format!("{}.{param}", field_of(kind)),
                        format!(
                            "the default profile uses the plugins named after their types; \
                             `{target}` is not one of them"
                        ),
                    ));
                }
            }
        }
    }
    let mut active = None;
    let mut prefill = None;
    let prefill_wanted = config.prefill_profile.filter(|name| *name != wanted);
    let mut seen = std::collections::HashSet::new();
    // A reload keeps the ring (the status page and `/admin/decisions` hold it).
    let log = previous.map_or_else(
        || {
            Arc::new(decisions::DecisionLog::new(
                config.decisions,
                config.decisions_always,
            ))
        },
        |p| Arc::clone(&p.decisions),
    );
    for (pi, spec) in profiles.iter().enumerate() {
        if !seen.insert(spec.name.clone()) {
            return Err(ConfigError::invalid(
                format!("scheduling_profiles[{pi}].name"),
                format!("duplicate profile name `{}`", spec.name),
            ));
        }
        let mut profile = build_profile(pi, spec, &instances, config.max_inflight_per_backend)?;
        profile.decisions = Arc::clone(&log);
        if spec.name == wanted {
            profile.built = specs
                .iter()
                .filter_map(|(name, spec)| {
                    instances
                        .get(name)
                        .map(|i| (name.clone(), (spec.clone(), i.clone())))
                })
                .collect();
            active = Some(profile);
        } else if Some(spec.name.as_str()) == prefill_wanted {
            prefill = Some(Arc::new(profile));
        }
    }
    let names = || {
        let names: Vec<_> = profiles.iter().map(|p| p.name.as_str()).collect();
        names.join(", ")
    };
    if let (Some(name), None) = (prefill_wanted, &prefill) {
        return Err(ConfigError::invalid(
            "pd.prefill_profile",
            format!("no scheduling profile named `{name}` (have: {})", names()),
        ));
    }
    let mut active = active.ok_or_else(|| {
        ConfigError::invalid(
            "profile",
            format!("no scheduling profile named `{wanted}` (have: {})", names()),
        )
    })?;
    active.prefill = prefill;
    Ok(Arc::new(active))
}

fn build_profile(
    pi: usize,
    spec: &ProfileSpec,
    instances: &HashMap<String, PluginInstance>,
    max_inflight_per_backend: u64,
) -> Result<Profile, ConfigError> {
    let mut filters: Vec<Arc<dyn Filter>> = Vec::new();
    let mut scorers = Vec::new();
    let mut picker: Option<Arc<dyn Picker>> = None;
    let mut plugins: Vec<PluginInstance> = Vec::new();
    for (j, r) in spec.plugins.iter().enumerate() {
        let field = format!("scheduling_profiles[{pi}].plugins[{j}]");
        let instance = instances.get(&r.plugin_ref).ok_or_else(|| {
            ConfigError::invalid(
                format!("{field}.plugin_ref"),
                format!("no plugin named `{}` in [[plugins]]", r.plugin_ref),
            )
        })?;
        if !matches!(instance, PluginInstance::Scorer(_)) && r.weight.is_some() {
            return Err(ConfigError::invalid(
                format!("{field}.weight"),
                "only scorers take a weight",
            ));
        }
        plugins.push(instance.clone());
        match instance {
            PluginInstance::Filter(f) => filters.push(f.clone()),
            PluginInstance::Scorer(s) => {
                let weight = r.weight.unwrap_or(1.0);
                if !(weight.is_finite() && weight >= 0.0) {
                    return Err(ConfigError::invalid(
                        format!("{field}.weight"),
                        "must be a finite number ≥ 0",
                    ));
                }
                scorers.push((s.clone(), weight));
            }
            PluginInstance::Picker(p) => {
                if picker.replace(p.clone()).is_some() {
                    return Err(ConfigError::invalid(
                        field,
                        "a profile has at most one picker",
                    ));
                }
            }
        }
    }
    // Health, model, role and pinning are not optional: prepend them unless the profile already has
    // them.
    let has = |t: &str| filters.iter().any(|f| f.type_name() == t);
    let mut mandatory: Vec<Arc<dyn Filter>> = Vec::new();
    if !has(HealthyFilter::TYPE) {
        mandatory.push(Arc::new(HealthyFilter::new(HealthyFilter::TYPE)));
    }
    if !has(ModelFilter::TYPE) {
        mandatory.push(Arc::new(ModelFilter::new(ModelFilter::TYPE)));
    }
    if !has(RoleFilter::TYPE) {
        mandatory.push(Arc::new(RoleFilter::new(RoleFilter::TYPE)));
    }
    if !has(PinnedFilter::TYPE) {
        mandatory.push(Arc::new(PinnedFilter::new(PinnedFilter::TYPE)));
    }
    mandatory.extend(filters);
    // The hard per-backend limit comes last, so "everyone is full" can be told apart from
    // "nobody is eligible" (the scheduler queues in the first case, fails in the second).
    if max_inflight_per_backend > 0
        && !mandatory
            .iter()
            .any(|f| f.type_name() == CapacityFilter::TYPE)
    {
        mandatory.push(Arc::new(CapacityFilter::new(
            CapacityFilter::TYPE,
            max_inflight_per_backend,
        )));
    }
    // A plugin working through another instance needs that instance's hooks (it records
    // the picks) in the same profile.
    for plugin in plugins.iter().map(PluginInstance::as_plugin) {
        if let Some(Link::Named { name: target, .. }) = plugin.link_target() {
            if !plugins.iter().any(|p| p.as_plugin().name() == target) {
                return Err(ConfigError::invalid(
                    format!("scheduling_profiles[{pi}].plugins"),
                    format!(
                        "`{}` works through `{target}`, which this profile does not include",
                        plugin.name()
                    ),
                ));
            }
        }
    }
    let slot_limit = mandatory.iter().filter_map(|f| f.capacity()).min();
    Ok(Profile {
        name: spec.name.clone(),
        slot_limit,
        built: HashMap::new(),
        filters: mandatory,
        scorers,
        picker: picker.unwrap_or_else(|| Arc::new(MaxScorePicker::new(MaxScorePicker::TYPE))),
        plugins,
        decisions: Arc::new(decisions::DecisionLog::new(0, false)),
        prefill: None,
    })
}

#[cfg(test)]
#[path = "profile_tests.rs"]
mod tests;
