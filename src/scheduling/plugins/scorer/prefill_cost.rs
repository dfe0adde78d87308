//! `prefill-cost-scorer`: prefers the backend where this request's first token comes soonest,
//! judged in one unit — prompt tokens still to prefill there — instead of a weighted sum of a
//! cache score and a load score.
//!
//! For candidate `i`, with `P` the request's prompt tokens and `held_i` the tokens of its
//! prefix that `i` caches (consecutive full blocks from the start: from `i`'s KV events when
//! its stream is live, else from the approximate index, exactly as the `prefix-cache-scorer`
//! judges them, see [`super::prefix_cache`]):
//!
//! ```text
//! cost_i  = max(0, P − held_i)                      this request's own prefill there
//!         + pending_i                               prefill this router sent there, before its first token
//!         + decode_weight · decoding_i              prompt tokens of its requests past the first token
//! score_i = (min_j cost_j + smoothing) / (cost_i + smoothing)
//! ```
//!
//! `pending_i` and `decoding_i` are the router's own counters ([`crate::endpoints::sent_work`]):
//! each request sent adds its uncached estimate to `pending` until the first byte of its
//! response, then its whole prompt to `decoding` until it ends. They are fresh at every
//! decision, unlike the engine's queue metrics. The cheapest candidate scores 1, one twice as
//! expensive about ½ (`smoothing` tokens keep tiny differences from mattering when every cost
//! is small); all equal → 1 for everyone.
//!
//! A hot prefix therefore stays on its holder while the holder's queue of prefills is shorter
//! than the prefix, and spills to a second backend (which pays the prefill once) when the queue
//! grows past it; it comes back as the queue drains. A request with no prompt text is placed
//! by `pending` and `decoding` alone.
//!
//! The prefix scorer may also name a hot prefix's new replica for a decision (its hot-prefix
//! replication, which balances by traffic share rather than by queue): that candidate's
//! `held_i` is then the holders' (it is priced as a holder, so the split can happen while no
//! queue has formed), while the prefill it is charged and shows P/D is what it really holds
//! ([`Held::cached_tokens`]).
//!
//! Parameters: `decode_weight` (default 0.05: in vLLM a decoding sequence's context costs far
//! less per step than a prefilled token, but it holds KV blocks) and `smoothing` (default 256
//! tokens).
//!
//! `held_i` comes from the profile's `prefix-cache-scorer` when it has one (the first, in
//! profile order): this scorer reads that scorer's answer for the decision from the request's
//! [`CycleState`] — one prompt hashed, one match against the KV events and the index per
//! decision, each pick recorded once in one index. Only a profile without a prefix-cache
//! scorer gives this scorer a matcher of its own (with its own approximate index), so it can
//! replace the prefix and load scorers there. No setting chooses between the two; the
//! `prefix` parameter still accepted says:
//!
//! * a table (or nothing): the parameters of that own matcher (those of the
//!   `prefix-cache-scorer`, same defaults), used only in a profile without one (a start-up
//!   warning says when a non-empty table goes unused);
//! * a plugin name (`prefix = "prefix-cache-scorer"`): read that instance's answer rather than
//!   the first one's; the profile must include it.

use std::borrow::Cow;
use std::sync::{Arc, OnceLock};

use serde::Deserialize;

use crate::config_error::ConfigError;
use crate::endpoints::{Backend, Candidate};
use crate::prompt::RequestView;
use crate::scheduling::framework::{
    CycleState, Link, Plugin, PluginInstance, PromptWork, Scorer, Signal,
};
use crate::scheduling::plugins::scorer::prefix_cache::{Held, PrefixCacheScorer};
use crate::scheduling::plugins::{identity, parameters};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Params {
    decode_weight: f64,
    smoothing: f64,
    prefix: PrefixParam,
}

/// `prefix`: a matcher of the scorer's own (its parameters) or another plugin's (its name).
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "`prefix`: a plugin name, or a table of prefix-cache-scorer parameters"
)]
enum PrefixParam {
    Shared(String),
    Own(toml::Table),
}

impl Default for Params {
    fn default() -> Self {
        Params {
            decode_weight: 0.05,
            smoothing: 256.0,
            prefix: PrefixParam::Own(toml::Table::new()),
        }
    }
}

/// Per request: this scorer's uncached estimate per candidate of the last scoring.
struct Estimates {
    prompt: u64,
    uncached: Vec<(usize, u64)>,
}

pub struct PrefillCostScorer {
    name: Arc<str>,
    decode_weight: f64,
    smoothing: f64,
    /// The matcher of its own, used while no prefix-cache scorer is linked (`None` when
    /// `prefix` names one); it keeps its scratch under `"<name>.prefix"`.
    own: Option<PrefixCacheScorer>,
    /// `prefix` was a non-empty table: its parameters, unused once linked, deserve a warning.
    own_parameters: bool,
    /// The instance `prefix` names, if it names one.
    named: Option<String>,
    /// The profile's prefix-cache scorer, handed over once by [`Plugin::link`] when the
    /// profile is built (a reload that rebuilds it, or would link another, rebuilds this one).
    shared: OnceLock<Arc<dyn Scorer>>,
}

impl PrefillCostScorer {
    pub const TYPE: &'static str = "prefill-cost-scorer";

    pub fn from_parameters(name: &str, table: &toml::Table) -> Result<Self, ConfigError> {
        let params: Params = parameters(name, table)?;
        let field = format!("plugins.{name}.parameters");
        if !(params.decode_weight >= 0.0 && params.decode_weight.is_finite()) {
            return Err(ConfigError::invalid(field, "decode_weight must be ≥ 0"));
        }
        if !(params.smoothing > 0.0 && params.smoothing.is_finite()) {
            return Err(ConfigError::invalid(field, "smoothing must be > 0"));
        }
        let (own, own_parameters, named) = match params.prefix {
            PrefixParam::Own(table) => (
                Some(PrefixCacheScorer::from_parameters(
                    &format!("{name}.prefix"),
                    &table,
                )?),
                !table.is_empty(),
                None,
            ),
            PrefixParam::Shared(target) => (None, false, Some(target)),
        };
        Ok(PrefillCostScorer {
            name: name.into(),
            decode_weight: params.decode_weight,
            smoothing: params.smoothing,
            own,
            own_parameters,
            named,
            shared: OnceLock::new(),
        })
    }

    /// The linked prefix-cache scorer, if the profile builder linked one.
    fn source(&self) -> Option<&PrefixCacheScorer> {
        self.shared.get()?.as_any().downcast_ref()
    }

    /// Run `f` with the prefix matcher in use: the linked one, or the scorer's own (`None`
    /// only for a scorer naming an instance that the profile builder has not linked yet).
    pub fn with_prefix<R>(&self, f: impl FnOnce(&PrefixCacheScorer) -> R) -> Option<R> {
        self.source().or(self.own.as_ref()).map(f)
    }

    /// The matcher of the scorer's own while it is the one in use (hooks run only on that
    /// one: a linked matcher gets them from its plugin).
    pub fn own_matcher(&self) -> Option<&PrefixCacheScorer> {
        match self.shared.get() {
            Some(_) => None,
            None => self.own.as_ref(),
        }
    }

    /// The matcher of the scorer's own, whether in use or not (for tests and probes).
    pub fn unused_own_matcher(&self) -> Option<&PrefixCacheScorer> {
        self.own.as_ref()
    }
}

impl Plugin for PrefillCostScorer {
    identity!();

    fn after_pick(&self, request: &RequestView, state: &CycleState, backend: &Backend) {
        if let Some(own) = self.own_matcher() {
            own.after_pick(request, state, backend);
        }
    }

    fn prompt_work(
        &self,
        request: &RequestView,
        state: &CycleState,
        backend: &Backend,
    ) -> Option<PromptWork> {
        let (prompt, uncached) = match state.get::<Estimates>(&self.name) {
            Some(e) => (
                e.prompt,
                e.uncached
                    .iter()
                    .find(|(id, _)| *id == backend.id)
                    .map_or(e.prompt, |(_, u)| *u),
            ),
            // Handed a slot while it waited without being scored: assume nothing cached.
            None => {
                let prompt = self
                    .with_prefix(|p| p.prompt_tokens(request))
                    .unwrap_or(0.0)
                    .ceil() as u64;
                (prompt, prompt)
            }
        };
        Some(PromptWork { uncached, prompt })
    }

    fn backend_removed(&self, backend: &Backend) {
        if let Some(own) = self.own_matcher() {
            own.backend_removed(backend);
        }
    }

    fn refresh_metrics(&self) {
        if let Some(own) = self.own_matcher() {
            own.refresh_metrics();
        }
    }

    fn link_target(&self) -> Option<Link<'_>> {
        Some(match &self.named {
            Some(name) => Link::Named {
                param: "prefix",
                name,
            },
            None => Link::FirstOfType(PrefixCacheScorer::TYPE),
        })
    }

    fn link(&self, target: &PluginInstance) -> Result<(), String> {
        let scorer = match target {
            PluginInstance::Scorer(s)
                if s.as_any().downcast_ref::<PrefixCacheScorer>().is_some() =>
            {
                s
            }
            other => {
                return Err(format!(
                    "`{}` is not a `{}` instance",
                    other.as_plugin().name(),
                    PrefixCacheScorer::TYPE
                ))
            }
        };
        self.shared
            .set(Arc::clone(scorer))
            .map_err(|_| format!("already linked to `{}`", self.linked().unwrap_or("?")))?;
        if self.own_parameters {
            tracing::warn!(
                scorer = %self.name,
                source = %scorer.name(),
                "the `prefix` parameters of this prefill-cost-scorer are unused: the profile's \
                 prefix-cache-scorer supplies its prefix matches"
            );
        }
        Ok(())
    }

    fn linked(&self) -> Option<&str> {
        self.shared.get().map(|s| s.name())
    }
}

impl Scorer for PrefillCostScorer {
    fn consumes(&self) -> &'static [Signal] {
        // A shared matcher's plugin declares its own.
        self.own_matcher().map_or(&[], |own| own.consumes())
    }

    fn score(
        &self,
        request: &RequestView,
        state: &mut CycleState,
        candidates: &[Candidate<'_>],
        scores: &mut [f64],
    ) {
        let (held, prompt) = match self.source().or(self.own.as_ref()) {
            Some(p) => (p.held(request, state, candidates), p.prompt_tokens(request)),
            None => (Cow::Owned(vec![Held::default(); candidates.len()]), 0.0),
        };
        let mut uncached = Vec::with_capacity(candidates.len());
        let mut min = f64::INFINITY;
        for ((slot, c), h) in scores.iter_mut().zip(candidates).zip(held.iter()) {
            let own = (prompt - h.tokens).max(0.0);
            let work = c.backend.work();
            let cost = own
                + work.prefill_tokens() as f64
                + self.decode_weight * work.decode_tokens() as f64;
            *slot = cost;
            min = min.min(cost);
            // A hot prefix's new replica is scored as the holders are, but charged (and shown
            // to P/D) the prefill it really has to do.
            let real = (prompt - h.cached_tokens()).max(0.0);
            uncached.push((c.backend.id, real.ceil() as u64));
        }
        drop(held);
        for slot in scores.iter_mut() {
            *slot = (min + self.smoothing) / (*slot + self.smoothing);
        }
        state.put(
            &self.name,
            Estimates {
                prompt: prompt.ceil() as u64,
                uncached,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::endpoints::sent_work::Charge;
    use crate::endpoints::test_support::backends;
    use crate::prompt::Operation;

    fn scorer(params: &str) -> PrefillCostScorer {
        PrefillCostScorer::from_parameters("pc", &toml::from_str(params).unwrap()).unwrap()
    }

    /// A completion whose prompt is `chars` characters (4 per token by default).
    fn view(chars: usize) -> RequestView {
        let body = format!(r#"{{"model":"m","prompt":"{}"}}"#, "a".repeat(chars));
        RequestView::parse(Operation::Completions, body.as_bytes()).unwrap()
    }

    fn run(s: &PrefillCostScorer, view: &RequestView, b: &[Arc<Backend>]) -> Vec<f64> {
        let c: Vec<_> = b
            .iter()
            .map(|b| Candidate::with_metrics(b, None, 0))
            .collect();
        let mut scores = vec![0.0; c.len()];
        s.score(view, &mut CycleState::default(), &c, &mut scores);
        scores
    }

    #[test]
    fn an_idle_fleet_without_cache_ties() {
        let b = backends(3);
        assert_eq!(run(&scorer(""), &view(4_000), &b), vec![1.0, 1.0, 1.0]);
    }

    #[test]
    fn cost_counts_own_prefill_pending_prefill_and_weighted_decode() {
        let b = backends(3);
        let s = scorer("decode_weight = 0.5\nsmoothing = 100.0");
        // 4,000 characters: 1,000 tokens, nothing cached anywhere.
        let _pending = Charge::new(&b[1], 400, 400); // b1: 1,000 + 400
        let mut decoding = Charge::new(&b[2], 0, 1_000);
        decoding.first_token(); // b2: 1,000 + 0.5 × 1,000
        let got = run(&s, &view(4_000), &b);
        let want = [1_100.0 / 1_100.0, 1_100.0 / 1_500.0, 1_100.0 / 1_600.0];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{got:?}");
        }
    }

    #[test]
    fn a_cached_prefix_wins_until_its_holders_queue_is_longer_than_the_prefix() {
        let b = backends(2);
        let s = scorer("decode_weight = 0.0\nsmoothing = 1.0\n[prefix]\nblock_size = 64");
        let prompt = view(6_400); // 100 blocks of 64 chars = 1,600 tokens
        let mut state = CycleState::default();
        let c: Vec<_> = b
            .iter()
            .map(|b| Candidate::with_metrics(b, None, 0))
            .collect();
        let mut scores = vec![0.0; 2];
        s.score(&prompt, &mut state, &c, &mut scores);
        s.after_pick(&prompt, &state, &b[0]); // b0 now holds all 100 blocks
        let work = s.prompt_work(&prompt, &state, &b[0]).unwrap();
        assert_eq!(
            work,
            PromptWork {
                uncached: 1_600,
                prompt: 1_600
            }
        );

        let again = view(6_400);
        let mut state = CycleState::default();
        s.score(&again, &mut state, &c, &mut scores);
        assert_eq!(scores[0], 1.0);
        assert!((scores[1] - 1.0 / 1_601.0).abs() < 1e-12, "{scores:?}");
        assert_eq!(
            s.prompt_work(&again, &state, &b[0]).unwrap(),
            PromptWork {
                uncached: 0,
                prompt: 1_600
            }
        );
        assert_eq!(
            s.prompt_work(&again, &state, &b[1]).unwrap().uncached,
            1_600
        );

        // The holder's queue reaches the prefix's length: the other backend ties, then wins.
        let queued = Charge::new(&b[0], 1_600, 1_600);
        s.score(&again, &mut CycleState::default(), &c, &mut scores);
        assert_eq!(scores, vec![1.0, 1.0]);
        let _more = Charge::new(&b[0], 1, 1);
        s.score(&again, &mut CycleState::default(), &c, &mut scores);
        assert!(scores[1] > scores[0], "{scores:?}");
        // …and comes back when the queue drains.
        drop(queued);
        drop(_more);
        s.score(&again, &mut CycleState::default(), &c, &mut scores);
        assert!(scores[0] > scores[1], "{scores:?}");
    }

    #[test]
    fn a_request_without_prompt_text_is_placed_by_load() {
        let b = backends(2);
        let s = scorer("smoothing = 10.0");
        let mut view = view(400);
        view.routing_text = None;
        view.tokens = None;
        let _pending = Charge::new(&b[0], 90, 90);
        assert_eq!(run(&s, &view, &b), vec![10.0 / 100.0, 1.0]);
        let mut state = CycleState::default();
        assert_eq!(
            s.prompt_work(&view, &state, &b[0]).unwrap(),
            PromptWork {
                uncached: 0,
                prompt: 0
            }
        );
        let c = [Candidate::with_metrics(&b[0], None, 0)];
        s.score(&view, &mut state, &c, &mut [0.0]);
        // A backend that was not scored (membership changed since) counts the whole prompt.
        assert_eq!(s.prompt_work(&view, &state, &b[1]).unwrap().uncached, 0);
    }

    #[test]
    fn bad_parameters_are_refused_naming_the_field() {
        for bad in [
            "decode_weight = -1.0",
            "smoothing = 0.0",
            "unknown = 1",
            "[prefix]\nblock_size = 0",
        ] {
            let table = toml::from_str(bad).unwrap();
            let err = PrefillCostScorer::from_parameters("pc", &table)
                .err()
                .unwrap()
                .to_string();
            assert!(err.contains("plugins.pc"), "{bad}: {err}");
        }
        let err = PrefillCostScorer::from_parameters("pc", &toml::from_str("prefix = 5").unwrap())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("`prefix`: a plugin name"), "{err}");
    }
}
