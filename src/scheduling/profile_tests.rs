//! Profile building (validation messages) and the weighted sum, with exact values.
#![allow(clippy::unwrap_used)]

use super::*;
use crate::endpoints::engine::LoadMetrics;
use crate::endpoints::test_support::{backends, load};
use crate::endpoints::Candidate;
use crate::prompt::Operation;
use crate::scheduling::framework::Rejection;

use crate::config::Config;

fn config(text: &str) -> Config {
    Config::from_toml(text, "t").unwrap()
}

/// The builders as the composer calls them, from a whole configuration.
fn build_active(c: &Config) -> Result<Arc<Profile>, ConfigError> {
    super::build_active(c.scheduling())
}

fn build_active_reusing(
    c: &Config,
    previous: Option<&Profile>,
) -> Result<Arc<Profile>, ConfigError> {
    super::build_active_reusing(c.scheduling(), previous)
}

fn err(text: &str) -> String {
    build_active(&config(text)).err().unwrap().to_string()
}

#[test]
fn default_profile_when_none_configured() {
    let p = build_active(&config("")).unwrap();
    assert_eq!(
        p.describe(),
        "default: healthy-filter → model-filter → role-filter → pinned-filter → saturation-filter → prefix-cache-scorer×2 → \
         prefill-cost-scorer×1 → kv-cache-utilization-scorer×1 → max-score-picker"
    );
}

#[test]
fn default_profile_uses_declared_parameters() {
    let p = build_active(&config(
        "[[plugins]]\ntype = \"prefix-cache-scorer\"\n[plugins.parameters]\nblock_size = 128\n",
    ))
    .unwrap();
    assert!(p.describe().contains("prefix-cache-scorer×2"));
}

#[test]
fn configured_profile_is_built() {
    let p = build_active(&config(
        r#"
        [[plugins]]
        type = "queue-scorer"
        name = "q"
        [[plugins]]
        type = "round-robin-picker"
        [[scheduling_profiles]]
        name = "rr"
        plugins = [{ plugin_ref = "q", weight = 2.5 }, { plugin_ref = "round-robin-picker" }]
        "#,
    ))
    .unwrap();
    assert_eq!(
        p.describe(),
        "rr: healthy-filter → model-filter → role-filter → pinned-filter → q×2.5 → round-robin-picker"
    );
}

#[test]
fn validation_names_the_field() {
    let cases = [
        ("[[plugins]]\ntype = \"nope\"\n", "plugins.nope.type"),
        (
            "[[plugins]]\ntype = \"queue-scorer\"\n[[plugins]]\ntype = \"queue-scorer\"\n",
            "plugins[1].name",
        ),
        (
            "[[scheduling_profiles]]\nname = \"a\"\nplugins = [{ plugin_ref = \"missing\", weight = 1 }]\n",
            "scheduling_profiles[0].plugins[0].plugin_ref",
        ),
        (
            "[[plugins]]\ntype = \"random-picker\"\n[[scheduling_profiles]]\nname = \"a\"\nplugins = [{ plugin_ref = \"random-picker\", weight = 1 }]\n",
            "scheduling_profiles[0].plugins[0].weight",
        ),
        (
            "[[plugins]]\ntype = \"queue-scorer\"\n[[scheduling_profiles]]\nname = \"a\"\nplugins = [{ plugin_ref = \"queue-scorer\", weight = -1 }]\n",
            "scheduling_profiles[0].plugins[0].weight",
        ),
        (
            "[[plugins]]\ntype = \"random-picker\"\n[[plugins]]\ntype = \"max-score-picker\"\n[[scheduling_profiles]]\nname = \"a\"\nplugins = [{ plugin_ref = \"random-picker\" }, { plugin_ref = \"max-score-picker\" }]\n",
            "at most one picker",
        ),
        (
            "profile = \"b\"\n[[plugins]]\ntype = \"queue-scorer\"\n[[scheduling_profiles]]\nname = \"a\"\nplugins = [{ plugin_ref = \"queue-scorer\" }]\n",
            "`profile`",
        ),
        (
            "[[plugins]]\ntype = \"queue-scorer\"\n[plugins.parameters]\nx = 1\n",
            "plugins.queue-scorer.parameters",
        ),
    ];
    for (text, needle) in cases {
        let e = err(text);
        assert!(e.contains(needle), "{text}\n→ {e}");
    }
}

#[test]
fn weighted_sum_clamps_and_picks_exact_winner() {
    // queue×2 + kv×1: backend 0: q=0 → 1, kv 0.9 → 0.1 ⇒ 2.1; backend 1: q=10 → 0, kv 0 → 1 ⇒ 1.0.
    let p = build_active(&config(
        r#"
        [[plugins]]
        type = "queue-scorer"
        [[plugins]]
        type = "kv-cache-utilization-scorer"
        [[scheduling_profiles]]
        name = "a"
        plugins = [{ plugin_ref = "queue-scorer", weight = 2 }, { plugin_ref = "kv-cache-utilization-scorer", weight = 1 }]
        "#,
    ))
    .unwrap();
    let b = backends(2);
    let view = RequestView::parse(Operation::Completions, br#"{"prompt":"x"}"#).unwrap();
    for _ in 0..20 {
        let mut c = vec![
            Candidate::with_metrics(&b[0], Some(load(Some(0.0), Some(0.9))), 0),
            Candidate::with_metrics(&b[1], Some(load(Some(10.0), Some(0.0))), 0),
        ];
        assert_eq!(
            p.run(&view, &mut CycleState::default(), &mut c)
                .ok()
                .unwrap()
                .index,
            0
        );
    }
}

#[test]
fn unhealthy_and_wrong_model_are_filtered() {
    let p = build_active(&config("")).unwrap();
    let b = backends(2);
    let view =
        RequestView::parse(Operation::Completions, br#"{"model":"m","prompt":"x"}"#).unwrap();
    // Candidate::with_metrics marks healthy but serves no models: the model filter empties the set.
    let mut c = vec![Candidate::with_metrics(
        &b[0],
        Some(LoadMetrics::default()),
        0,
    )];
    assert_eq!(
        p.run(&view, &mut CycleState::default(), &mut c).err(),
        Some(Rejection::ModelNotServed)
    );
    let mut state = (*b[1].state()).clone();
    state.healthy = false;
    let mut unhealthy = Candidate::with_metrics(&b[1], None, 0);
    unhealthy.state = std::sync::Arc::new(state);
    let mut c = vec![unhealthy];
    let any_model = RequestView::parse(Operation::Completions, br#"{"prompt":"x"}"#).unwrap();
    assert_eq!(
        p.run(&any_model, &mut CycleState::default(), &mut c).err(),
        Some(Rejection::Unavailable)
    );
}

/// A scorer that reads a signal some backend's engine does not report is reported at start-up,
/// naming the scorer, the signal and the engine; engines that report it raise nothing.
#[test]
fn scorers_reading_signals_an_engine_lacks_are_reported() {
    let c = config(
        r#"
        [[backends]]
        url = "http://127.0.0.1:1"
        [[backends]]
        url = "http://127.0.0.1:2"
        engine = "sglang"
        [[backends]]
        url = "http://127.0.0.1:3"
        engine = "mine"
        [engines.mine]
        kv_usage = ["my_kv"]
        [[plugins]]
        type = "queue-scorer"
        [[plugins]]
        type = "prefix-cache-scorer"
        [[plugins]]
        type = "kv-cache-utilization-scorer"
        [[scheduling_profiles]]
        name = "p"
        plugins = [{ plugin_ref = "queue-scorer" }, { plugin_ref = "prefix-cache-scorer" }, { plugin_ref = "kv-cache-utilization-scorer" }]
        "#,
    );
    let warnings = build_active(&c)
        .unwrap()
        .missing_signals(&c.backend_engines());
    assert_eq!(warnings.len(), 3, "{warnings:#?}");
    assert!(warnings
        .iter()
        .any(|w| w.contains("`queue-scorer` reads `waiting`") && w.contains("`mine`")));
    assert!(warnings.iter().any(
        |w| w.contains("`prefix-cache-scorer` reads `cache_config`") && w.contains("`sglang`")
    ));
    assert!(warnings
        .iter()
        .any(|w| w.contains("`prefix-cache-scorer` reads `cache_config`") && w.contains("`mine`")));
    let vllm_only = config("[[backends]]\nurl = \"http://127.0.0.1:1\"\n");
    assert!(build_active(&vllm_only)
        .unwrap()
        .missing_signals(&vllm_only.backend_engines())
        .is_empty());
}

/// A reload that only changes weights keeps every plugin instance (and so the prefix index);
/// a plugin whose parameters change is built anew.
#[test]
fn reload_reuses_unchanged_plugin_instances() {
    let text = |weight: u32, block: u32| {
        format!(
            "[[plugins]]\ntype = \"prefix-cache-scorer\"\n[plugins.parameters]\nblock_size = {block}\n\
             [[plugins]]\ntype = \"queue-scorer\"\n\
             [[scheduling_profiles]]\nname = \"p\"\n\
             plugins = [{{ plugin_ref = \"prefix-cache-scorer\", weight = {weight} }}, {{ plugin_ref = \"queue-scorer\" }}]\n"
        )
    };
    let first = build_active(&config(&text(1, 64))).unwrap();
    let same = build_active_reusing(&config(&text(3, 64)), Some(&first)).unwrap();
    let changed = build_active_reusing(&config(&text(3, 32)), Some(&first)).unwrap();
    // The scorer instance itself (not the plugin view, which wraps it).
    let prefix = |p: &Profile| {
        p.scorers
            .iter()
            .find(|(x, _)| x.type_name() == "prefix-cache-scorer")
            .map(|(x, _)| Arc::as_ptr(x) as *const ())
            .unwrap()
    };
    assert!(prefix(&first) == prefix(&same), "weights only: kept");
    assert!(
        prefix(&first) != prefix(&changed),
        "parameters changed: rebuilt"
    );
    assert!(same.describe().contains("prefix-cache-scorer×3"));
    let default = build_active(&config("")).unwrap();
    let again = build_active_reusing(&config(""), Some(&default)).unwrap();
    assert!(prefix(&default) == prefix(&again), "default profile too");
}

#[test]
fn a_shared_prefix_matcher_must_name_a_prefix_scorer_of_the_same_profile() {
    let pc = |prefix: &str, refs: &str| {
        format!(
            "[[plugins]]\ntype = \"prefix-cache-scorer\"\nname = \"px\"\n\
             [[plugins]]\ntype = \"queue-scorer\"\n\
             [[plugins]]\ntype = \"prefill-cost-scorer\"\n[plugins.parameters]\nprefix = \"{prefix}\"\n\
             [[scheduling_profiles]]\nname = \"p\"\nplugins = [{refs}]\n"
        )
    };
    let both = r#"{ plugin_ref = "px" }, { plugin_ref = "prefill-cost-scorer" }"#;
    assert!(build_active(&config(&pc("px", both))).is_ok());
    let e = err(&pc("nosuch", both));
    assert!(
        e.contains("plugins[2].parameters.prefix") && e.contains("no plugin named `nosuch`"),
        "{e}"
    );
    let e = err(&pc("queue-scorer", both));
    assert!(e.contains("is not a `prefix-cache-scorer`"), "{e}");
    let e = err(&pc("px", r#"{ plugin_ref = "prefill-cost-scorer" }"#));
    assert!(
        e.contains("scheduling_profiles[0].plugins") && e.contains("does not include"),
        "{e}"
    );
}

/// The matcher a profile's prefill-cost scorer works through, and that profile's own
/// prefix-cache scorer.
fn matchers(p: &Profile) -> (*const (), *const ()) {
    use crate::scheduling::plugins::scorer::prefill_cost::PrefillCostScorer;
    use crate::scheduling::plugins::scorer::prefix_cache::PrefixCacheScorer;
    let find = |ty: &str| p.plugins().find(|q| q.type_name() == ty).unwrap();
    let own = find(PrefixCacheScorer::TYPE);
    let own = own.as_any().downcast_ref::<PrefixCacheScorer>().unwrap();
    let cost = find(PrefillCostScorer::TYPE);
    let cost = cost.as_any().downcast_ref::<PrefillCostScorer>().unwrap();
    let linked = cost
        .with_prefix(|m| std::ptr::from_ref(m).cast::<()>())
        .unwrap();
    (linked, std::ptr::from_ref(own).cast())
}

#[test]
fn a_reload_that_rebuilds_the_matcher_links_a_new_scorer_to_it() {
    // The default profile: prefill-cost works through prefix-cache-scorer. A reload that
    // changes only the prefix scorer's parameters rebuilds it, and so the scorer linked to it.
    let first = build_active(&config("")).unwrap();
    let changed =
        "[[plugins]]\ntype = \"prefix-cache-scorer\"\n[plugins.parameters]\nblock_size = 32\n";
    let second = build_active_reusing(&config(changed), Some(&first)).unwrap();
    let (linked, own) = matchers(&second);
    assert_eq!(linked, own, "linked to the rebuilt matcher");
    let (linked, own) = matchers(&first);
    assert_eq!(linked, own, "the first profile still reads its own matcher");
    assert_ne!(matchers(&first).1, matchers(&second).1);
    // A reload changing nothing keeps both, still linked.
    let third = build_active_reusing(&config(changed), Some(&second)).unwrap();
    assert_eq!(matchers(&third), matchers(&second));
}

#[test]
fn a_refused_reload_leaves_the_running_profile_linked_as_it_was() {
    let first = build_active(&config("")).unwrap();
    let before = matchers(&first);
    // The prefix scorer's parameters change (it would be rebuilt), but the file also names a
    // profile that does not exist: the reload is refused.
    let refused = "profile = \"nosuch\"\n[[plugins]]\ntype = \"prefix-cache-scorer\"\n\
                   [plugins.parameters]\nblock_size = 32\n";
    assert!(build_active_reusing(&config(refused), Some(&first)).is_err());
    assert_eq!(matchers(&first), before);
    assert_eq!(before.0, before.1);
}

#[test]
fn a_default_profile_plugin_linked_outside_it_names_its_own_parameter() {
    let e = err(
        "[[plugins]]\ntype = \"prefix-cache-scorer\"\nname = \"px\"\n\
         [[plugins]]\ntype = \"prefill-cost-scorer\"\n[plugins.parameters]\nprefix = \"px\"\n",
    );
    assert!(
        e.contains("plugins[1].parameters.prefix") && e.contains("`px` is not one of them"),
        "{e}"
    );
}

/// The default profile's plugins declared in a file (as `bench/policies/default-prefill-cost.toml`
/// does): the prefill-cost scorer's `prefix` left at its default.
const DECLARED_DEFAULT: &str = r#"
[[plugins]]
type = "prefix-cache-scorer"
[[plugins]]
type = "prefill-cost-scorer"
[[plugins]]
type = "kv-cache-utilization-scorer"
[[scheduling_profiles]]
name = "declared"
plugins = [
  { plugin_ref = "prefill-cost-scorer", weight = 1 },
  { plugin_ref = "prefix-cache-scorer", weight = 2 },
  { plugin_ref = "kv-cache-utilization-scorer", weight = 1 },
]
"#;

/// A decision matches the prompt once, however many of the profile's scorers need the match:
/// the prefill-cost scorer takes the prefix-cache scorer's answer from the request's state
/// (listed before it or after), its own matcher never runs, and each pick is recorded in one
/// index. Before, the default profile matched twice per decision through one shared matcher,
/// and a profile declaring both scorers kept two matchers and two indexes.
#[test]
fn one_prefix_match_per_decision() {
    use crate::scheduling::plugins::scorer::prefill_cost::PrefillCostScorer;
    use crate::scheduling::plugins::scorer::prefix_cache::PrefixCacheScorer;
    for text in ["", DECLARED_DEFAULT] {
        let p = build_active(&config(text)).unwrap();
        let find = |ty: &str| p.plugins().find(|q| q.type_name() == ty).unwrap();
        let prefix = find(PrefixCacheScorer::TYPE);
        let prefix = prefix.as_any().downcast_ref::<PrefixCacheScorer>().unwrap();
        let cost = find(PrefillCostScorer::TYPE);
        let cost = cost.as_any().downcast_ref::<PrefillCostScorer>().unwrap();
        assert!(
            cost.own_matcher().is_none(),
            "{text}: linked, no matcher of its own"
        );
        let unused = cost.unused_own_matcher().unwrap();
        let b = backends(3);
        // 100 blocks of 64 characters.
        let body = format!(r#"{{"prompt":"{}"}}"#, "abcd".repeat(1_600));
        let view = RequestView::parse(Operation::Completions, body.as_bytes()).unwrap();
        let mut state = CycleState::default();
        for decision in 1..=2 {
            let mut c: Vec<_> = b
                .iter()
                .map(|b| Candidate::with_metrics(b, Some(load(Some(0.0), Some(0.0))), 0))
                .collect();
            let picked = p.run(&view, &mut state, &mut c).ok().unwrap().index;
            let picked = Arc::clone(c[picked].backend);
            for plugin in p.plugins() {
                plugin.after_pick(&view, &state, &picked);
            }
            assert_eq!(prefix.match_passes(&state), decision, "{text}");
            assert_eq!(unused.match_passes(&state), 0, "{text}");
        }
        assert!(prefix.index().blocks() >= 100, "{text}");
        assert_eq!(unused.index().blocks(), 0, "{text}");
    }
}

/// Without a prefix-cache scorer in the profile the prefill-cost scorer matches on its own,
/// once per decision, and records the picks in its own index; a reload that adds a prefix
/// scorer to the profile rebuilds it linked, one that takes it away rebuilds it on its own.
#[test]
fn a_prefill_cost_scorer_alone_matches_on_its_own() {
    use crate::scheduling::plugins::scorer::prefill_cost::PrefillCostScorer;
    let alone = "[[plugins]]\ntype = \"prefill-cost-scorer\"\n\
                 [[plugins]]\ntype = \"prefix-cache-scorer\"\n\
                 [[scheduling_profiles]]\nname = \"p\"\n\
                 plugins = [{ plugin_ref = \"prefill-cost-scorer\" }]\n";
    let both = alone.replace(
        "plugins = [{ plugin_ref = \"prefill-cost-scorer\" }]",
        "plugins = [{ plugin_ref = \"prefill-cost-scorer\" }, { plugin_ref = \"prefix-cache-scorer\" }]",
    );
    fn cost(p: &Profile) -> &dyn Plugin {
        p.plugins()
            .find(|q| q.type_name() == PrefillCostScorer::TYPE)
            .unwrap()
    }
    let p = build_active(&config(alone)).unwrap();
    let plugin = cost(&p);
    let scorer = plugin.as_any().downcast_ref::<PrefillCostScorer>().unwrap();
    let own = scorer.own_matcher().unwrap();
    let b = backends(2);
    let body = format!(r#"{{"prompt":"{}"}}"#, "abcd".repeat(1_600));
    let view = RequestView::parse(Operation::Completions, body.as_bytes()).unwrap();
    let mut state = CycleState::default();
    let mut c: Vec<_> = b
        .iter()
        .map(|b| Candidate::with_metrics(b, None, 0))
        .collect();
    let picked = p.run(&view, &mut state, &mut c).ok().unwrap().index;
    let picked = Arc::clone(c[picked].backend);
    for plugin in p.plugins() {
        plugin.after_pick(&view, &state, &picked);
    }
    assert_eq!(own.match_passes(&state), 1);
    assert_eq!(own.index().blocks(), 100);

    let linked = build_active_reusing(&config(&both), Some(&p)).unwrap();
    let plugin2 = cost(&linked);
    let scorer2 = plugin2
        .as_any()
        .downcast_ref::<PrefillCostScorer>()
        .unwrap();
    assert_eq!(plugin2.linked(), Some("prefix-cache-scorer"));
    assert!(scorer2.own_matcher().is_none());
    let again = build_active_reusing(&config(&both), Some(&linked)).unwrap();
    let ptr = |p: &dyn Plugin| std::ptr::from_ref(p.as_any()).cast::<()>();
    assert_eq!(ptr(cost(&again)), ptr(plugin2), "unchanged: kept");
    let back = build_active_reusing(&config(alone), Some(&again)).unwrap();
    let plugin3 = cost(&back);
    assert_eq!(plugin3.linked(), None);
    assert!(plugin3
        .as_any()
        .downcast_ref::<PrefillCostScorer>()
        .unwrap()
        .own_matcher()
        .is_some());
}

/// `[pd] prefill_profile` names the profile of prefill steps; the active profile keeps every
/// other decision, an unknown name is refused naming the field.
#[test]
fn a_prefill_profile_schedules_prefill_steps() {
    let text = r#"
        profile = "decode"
        [pd]
        prefill_profile = "prefill"
        [[plugins]]
        type = "queue-scorer"
        [[plugins]]
        type = "round-robin-picker"
        [[scheduling_profiles]]
        name = "decode"
        plugins = [{ plugin_ref = "queue-scorer" }]
        [[scheduling_profiles]]
        name = "prefill"
        plugins = [{ plugin_ref = "round-robin-picker" }]
    "#;
    let p = build_active(&config(text)).unwrap();
    assert_eq!(p.name, "decode");
    assert_eq!(p.prefill_profile(), Some("prefill"));
    assert!(
        p.describe().contains("; prefill steps: prefill: "),
        "{}",
        p.describe()
    );
    let mut view = RequestView::parse(Operation::Completions, br#"{"prompt":"x"}"#).unwrap();
    assert_eq!(p.for_request(&view).name, "decode");
    view.roles = crate::prompt::RoleScope::PrefillStep;
    assert_eq!(p.for_request(&view).name, "prefill");
    // Naming the active profile, or none, leaves one profile for both.
    let same = build_active(&config(&text.replace(
        "prefill_profile = \"prefill\"",
        "prefill_profile = \"decode\"",
    )))
    .unwrap();
    assert_eq!(same.prefill_profile(), None);
    assert_eq!(same.for_request(&view).name, "decode");
    let e = err(&text.replace("prefill_profile = \"prefill\"", "prefill_profile = \"pre\""));
    assert!(
        e.contains("pd.prefill_profile") && e.contains("no scheduling profile named `pre`"),
        "{e}"
    );
}
