//! Seeded workloads (shared-prefix, multi-turn, unique) and their maximum achievable hit rate.
//!
//! A workload is a lazily generated sequence of *sessions*: session `i` is always the same
//! text for the same seed, so every policy of a comparison sees identical requests. A session
//! is one request for `shared-prefix` and `unique`, and `turns` requests for `multi-turn`.

use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use serde::Serialize;
use vllm_sim::tokenizer::{self, ChatMessage};

use crate::text;

/// How the bound turns prompts into token ids: the simulator's stand-in tokenizer, or the real
/// Hugging Face tokenizer the simulators were started with (`--sim-tokenizer`).
#[derive(Clone, Default)]
pub enum Tokens {
    #[default]
    StandIn,
    Hf(Arc<hf_tokenize::HfTokenizer>),
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Tokens::StandIn => "StandIn",
            Tokens::Hf(_) => "Hf",
        })
    }
}

impl Tokens {
    /// The token ids of `messages` rendered with the chat template.
    pub fn chat(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Vec<u32> {
        match self {
            Tokens::StandIn => {
                tokenizer::tokenize(&tokenizer::render_chat(messages, add_generation_prompt))
            }
            Tokens::Hf(t) => {
                let messages: Vec<serde_json::Value> = messages
                    .iter()
                    .map(|m| serde_json::json!({ "role": m.role, "content": m.content }))
                    .collect();
                let body = serde_json::json!({
                    "messages": messages,
                    "add_generation_prompt": add_generation_prompt,
                });
                t.chat_ids(body.to_string().as_bytes()).unwrap_or_default()
            }
        }
    }
}

/// Which shape of traffic, with its sizes in simulator tokens.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum WorkloadSpec {
    /// `groups` × `prompts`: each group shares a system prompt of `system_tokens`; each prompt
    /// adds a question of `question_tokens`. `zipf` = 0 sends every prompt in turn (a seeded
    /// shuffle); `zipf` > 0 draws groups with popularity ∝ 1/rank^zipf.
    SharedPrefix {
        groups: u64,
        prompts: u64,
        system_tokens: usize,
        question_tokens: usize,
        output_tokens: u32,
        zipf: f64,
    },
    /// `conversations` of `turns`: system prompt, then user messages of `user_tokens`; every
    /// turn re-sends the history including the assistant's actual answers.
    MultiTurn {
        conversations: u64,
        turns: u32,
        system_tokens: usize,
        user_tokens: usize,
        output_tokens: u32,
    },
    /// Prompts of `prompt_tokens` that share nothing but the chat template. With
    /// `prompt_tokens_max` (`output_tokens_max`) above it, each session's prompt (output)
    /// length is drawn uniformly from `prompt_tokens..=prompt_tokens_max` (from the seed);
    /// 0: fixed.
    Unique {
        prompt_tokens: usize,
        output_tokens: u32,
        prompt_tokens_max: usize,
        output_tokens_max: u32,
    },
}

/// One session: what to send, turn by turn.
#[derive(Debug, Clone, PartialEq)]
pub struct Session {
    pub id: u64,
    /// The prefix group (shared-prefix), conversation (multi-turn) or the id itself (unique).
    pub group: u64,
    pub system: Option<String>,
    /// One user message per turn.
    pub users: Vec<String>,
    pub output_tokens: u32,
}

impl Session {
    /// The chat messages of turn `turn`, given the answers of the previous turns.
    pub fn messages(&self, turn: usize, answers: &[String]) -> Vec<ChatMessage> {
        let mut m = Vec::with_capacity(2 * turn + 2);
        if let Some(s) = &self.system {
            m.push(msg("system", s));
        }
        for (k, user) in self.users.iter().enumerate().take(turn + 1) {
            m.push(msg("user", user));
            if k < turn {
                m.push(msg("assistant", answers.get(k).map_or("", String::as_str)));
            }
        }
        m
    }

    pub fn turns(&self) -> usize {
        self.users.len()
    }
}

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage {
        role: role.into(),
        content: content.into(),
    }
}

/// A workload ready to produce sessions.
#[derive(Debug, Clone)]
pub struct Workload {
    pub spec: WorkloadSpec,
    pub seed: u64,
    /// shared-prefix: the groups' system prompts, generated once (they are reused).
    systems: Vec<String>,
    /// shared-prefix, uniform popularity: the (group, prompt) order of one pass.
    order: Vec<(u64, u64)>,
    /// shared-prefix, Zipf popularity: cumulative probabilities of the groups.
    zipf_cdf: Vec<f64>,
}

/// Salts keep the RNG streams of different purposes apart for one seed.
const SALT_SYSTEM: u64 = 0x5157_0000;
const SALT_QUESTION: u64 = 0x9e37_79b9_7f4a_7c15;
const SALT_PICK: u64 = 0xc2b2_ae3d_27d4_eb4f;

impl Workload {
    pub fn new(spec: WorkloadSpec, seed: u64) -> Self {
        let mut w = Workload {
            spec,
            seed,
            systems: Vec::new(),
            order: Vec::new(),
            zipf_cdf: Vec::new(),
        };
        if let WorkloadSpec::SharedPrefix {
            groups,
            prompts,
            system_tokens,
            zipf,
            ..
        } = w.spec
        {
            w.systems = (0..groups)
                .map(|g| {
                    let mut rng = fastrand::Rng::with_seed(seed ^ SALT_SYSTEM ^ g);
                    text::tagged_text(&mut rng, system_tokens, &text::tag(g, seed))
                })
                .collect();
            if zipf > 0.0 {
                let weights: Vec<f64> = (1..=groups).map(|r| (r as f64).powf(-zipf)).collect();
                let total: f64 = weights.iter().sum();
                let mut acc = 0.0;
                w.zipf_cdf = weights
                    .iter()
                    .map(|x| {
                        acc += x / total;
                        acc
                    })
                    .collect();
            } else {
                w.order = (0..groups)
                    .flat_map(|g| (0..prompts).map(move |p| (g, p)))
                    .collect();
                fastrand::Rng::with_seed(seed ^ SALT_PICK).shuffle(&mut w.order);
            }
        }
        w
    }

    /// Sessions available (`None`: unbounded, generated on demand).
    pub fn session_limit(&self) -> Option<u64> {
        match self.spec {
            WorkloadSpec::MultiTurn { conversations, .. } => Some(conversations),
            _ => None,
        }
    }

    /// Requests in one natural pass: every prompt once, or every turn of every conversation.
    pub fn natural_requests(&self) -> Option<u64> {
        match self.spec {
            WorkloadSpec::SharedPrefix {
                groups, prompts, ..
            } => Some(groups * prompts),
            WorkloadSpec::MultiTurn {
                conversations,
                turns,
                ..
            } => Some(conversations * u64::from(turns)),
            WorkloadSpec::Unique { .. } => None,
        }
    }

    /// Tokens the workload wants cached at once: every group's prefix, or every whole
    /// conversation; for `unique` nothing is reusable, so 0.
    pub fn prefix_tokens(&self) -> usize {
        match self.spec {
            WorkloadSpec::SharedPrefix {
                groups,
                system_tokens,
                ..
            } => groups as usize * system_tokens,
            WorkloadSpec::MultiTurn {
                conversations,
                turns,
                system_tokens,
                user_tokens,
                output_tokens,
            } => {
                conversations as usize
                    * (system_tokens + turns as usize * (user_tokens + output_tokens as usize))
            }
            WorkloadSpec::Unique { .. } => 0,
        }
    }

    pub fn output_tokens(&self) -> u32 {
        match self.spec {
            WorkloadSpec::SharedPrefix { output_tokens, .. }
            | WorkloadSpec::MultiTurn { output_tokens, .. }
            | WorkloadSpec::Unique { output_tokens, .. } => output_tokens,
        }
    }

    /// Session `id` (deterministic for the seed).
    pub fn session(&self, id: u64) -> Session {
        let seed = self.seed;
        match self.spec {
            WorkloadSpec::SharedPrefix {
                groups,
                prompts,
                question_tokens,
                output_tokens,
                ..
            } => {
                let (g, p) = if self.order.is_empty() {
                    let mut rng = fastrand::Rng::with_seed(seed ^ SALT_PICK ^ id);
                    let u = rng.f64();
                    let g = self.zipf_cdf.partition_point(|&c| c < u) as u64;
                    (g.min(groups.saturating_sub(1)), rng.u64(..prompts.max(1)))
                } else {
                    self.order[(id % self.order.len() as u64) as usize]
                };
                let mut rng = fastrand::Rng::with_seed(seed ^ SALT_QUESTION ^ (g << 20) ^ p);
                let question = text::tagged_text(&mut rng, question_tokens, &text::tag(p, g));
                Session {
                    id,
                    group: g,
                    system: self.systems.get(g as usize).cloned(),
                    users: vec![question],
                    output_tokens,
                }
            }
            WorkloadSpec::MultiTurn {
                turns,
                system_tokens,
                user_tokens,
                output_tokens,
                ..
            } => {
                let mut rng = fastrand::Rng::with_seed(seed ^ SALT_SYSTEM ^ id);
                let system = text::tagged_text(&mut rng, system_tokens, &text::tag(id, seed));
                let users = (0..turns)
                    .map(|t| text::tagged_text(&mut rng, user_tokens, &text::tag(u64::from(t), id)))
                    .collect();
                Session {
                    id,
                    group: id,
                    system: Some(system),
                    users,
                    output_tokens,
                }
            }
            WorkloadSpec::Unique {
                prompt_tokens,
                output_tokens,
                prompt_tokens_max,
                output_tokens_max,
            } => {
                let mut rng = fastrand::Rng::with_seed(seed ^ SALT_QUESTION ^ id);
                let prompt = rng.usize(prompt_tokens..=prompt_tokens_max.max(prompt_tokens));
                let output = rng.u32(output_tokens..=output_tokens_max.max(output_tokens));
                Session {
                    id,
                    group: id,
                    system: None,
                    users: vec![text::tagged_text(&mut rng, prompt, &text::tag(id, seed))],
                    output_tokens: output,
                }
            }
        }
    }
}

/// The best hit rates a router could reach on the requests sent (see [`max_hit`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct HitBound {
    pub prompt_tokens: u64,
    /// The bound: one cache of unlimited size that keeps every prompt and answer, so a
    /// repeated prompt hits entirely. No routing over any number of finite caches can hit
    /// more (each backend's cache holds a subset of what was ever computed), as long as every
    /// request is counted once. `hit/max` in the tables divides by this.
    pub max_hit_tokens: u64,
    /// Shared prefixes only: each group's prefix (or conversation's history) misses once,
    /// every later request hits it in full blocks. Not a bound when whole prompts repeat
    /// (≤ `max_hit_tokens`; equal for multi-turn and unique); shown for reference.
    pub prefix_only_hit_tokens: u64,
}

impl HitBound {
    pub fn rate(&self) -> f64 {
        ratio(self.max_hit_tokens, self.prompt_tokens)
    }

    pub fn prefix_only_rate(&self) -> f64 {
        ratio(self.prefix_only_hit_tokens, self.prompt_tokens)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Maximum achievable prefix-cache hits for the requests `(session, turn)` in send order.
///
/// Formula: replay the requests through a cache with vLLM's rules — prompt = the chat
/// template rendered and tokenised as the simulator does; a request reuses at most its
/// leading *full* blocks of `block_size` tokens, and never its last prompt token
/// (`⌊(len − 1)/block_size⌋` blocks). What the cache keeps after a request:
///
/// * `max_hit_tokens` (the bound the tables use): every prompt and answer (all generated
///   tokens but the last, whose KV is never computed), so repeats of a whole prompt hit too.
/// * `prefix_only_hit_tokens`: only the *shareable prefix* — for shared-prefix the group's
///   rendered system prompt, for multi-turn the whole prompt plus the generated tokens, for
///   unique nothing. So each group's prefix misses exactly once, and Σ hits = Σ_groups
///   (n_g − 1) × ⌊prefix_g / block_size⌋ × block_size, n_g being the group's request count.
///
/// Answers are taken to be the simulator's deterministic filler text (what it returns under
/// `ignore_eos`).
pub fn max_hit(workload: &Workload, requests: &[(u64, u32)], block_size: usize) -> HitBound {
    max_hit_with(&Tokens::StandIn, workload, requests, block_size)
}

/// [`max_hit`] with prompts tokenized by `tok`. With a real tokenizer the answers' tokens are
/// not known (the simulator's filler text tokenizes differently), so answer blocks are left out
/// of the caches: exact for shared-prefix and unique, a lower bound for multi-turn.
pub fn max_hit_with(
    tok: &Tokens,
    workload: &Workload,
    requests: &[(u64, u32)],
    block_size: usize,
) -> HitBound {
    let bs = block_size.max(1);
    let mut shared: HashSet<u64> = HashSet::new();
    let mut unlimited: HashSet<u64> = HashSet::new();
    let mut bound = HitBound::default();
    let mut last: Option<(u64, Session)> = None;
    for &(id, turn) in requests {
        let session = match &last {
            Some((lid, s)) if *lid == id => s.clone(),
            _ => workload.session(id),
        };
        let answers: Vec<String> = (0..turn)
            .map(|_| tokenizer::filler_text(session.output_tokens))
            .collect();
        let mut tokens = tok.chat(&session.messages(turn as usize, &answers), true);
        let prompt_len = tokens.len();
        bound.prompt_tokens += prompt_len as u64;
        let hashes = chain_hashes(&tokens, bs);
        let reusable = prompt_len.saturating_sub(1) / bs;
        let hits = |cache: &HashSet<u64>| {
            let n = hashes
                .iter()
                .take(reusable)
                .take_while(|h| cache.contains(h));
            (n.count() * bs) as u64
        };
        bound.prefix_only_hit_tokens += hits(&shared);
        bound.max_hit_tokens += hits(&unlimited);
        let out = session.output_tokens;
        if matches!(tok, Tokens::StandIn) {
            tokens.extend((0..out.saturating_sub(1)).map(tokenizer::filler_id));
        }
        let all = chain_hashes(&tokens, bs);
        let shareable_blocks = match workload.spec {
            WorkloadSpec::MultiTurn { .. } => all.len(),
            WorkloadSpec::Unique { .. } => 0,
            WorkloadSpec::SharedPrefix { .. } => {
                // The system message alone ends in a "\n" piece that the full prompt glues to
                // the next word, so the shared tokens stop one short of that rendering.
                let system = session.system.as_deref().unwrap_or_default();
                tok.chat(&[msg("system", system)], false)
                    .len()
                    .saturating_sub(1)
                    / bs
            }
        };
        shared.extend(all.iter().take(shareable_blocks).copied());
        unlimited.extend(all);
        last = Some((id, session));
    }
    bound
}

/// Hash of each full block, chained with the previous block's hash (as vLLM does).
fn chain_hashes(tokens: &[u32], bs: usize) -> Vec<u64> {
    let mut prev = 0u64;
    tokens
        .chunks_exact(bs)
        .map(|block| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            prev.hash(&mut h);
            block.hash(&mut h);
            prev = h.finish();
            prev
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn shared(zipf: f64) -> Workload {
        Workload::new(
            WorkloadSpec::SharedPrefix {
                groups: 4,
                prompts: 3,
                system_tokens: 100,
                question_tokens: 20,
                output_tokens: 5,
                zipf,
            },
            9,
        )
    }

    #[test]
    fn shared_prefix_is_reproducible_and_groups_differ_from_the_start() {
        let a = shared(0.0);
        let b = shared(0.0);
        for i in 0..12 {
            assert_eq!(a.session(i), b.session(i));
        }
        // One pass covers every (group, prompt) once.
        let mut seen: HashSet<(u64, String)> = HashSet::new();
        for i in 0..12 {
            let s = a.session(i);
            seen.insert((s.group, s.users[0].clone()));
        }
        assert_eq!(seen.len(), 12);
        let firsts: HashSet<String> = a.systems.iter().map(|s| s[..4].to_string()).collect();
        assert_eq!(
            firsts.len(),
            4,
            "system prompts share their first characters"
        );
        let n = tokenizer::tokenize(&a.systems[0]).len();
        assert!((100..=101).contains(&n), "{n}");
        let z = shared(1.2);
        let groups: Vec<u64> = (0..200).map(|i| z.session(i).group).collect();
        let top = groups.iter().filter(|&&g| g == 0).count();
        let last = groups.iter().filter(|&&g| g == 3).count();
        assert!(top > last, "zipf: rank 1 {top} vs rank 4 {last}");
    }

    #[test]
    fn bound_counts_one_miss_per_group_in_full_blocks() {
        let w = shared(0.0);
        let reqs: Vec<(u64, u32)> = (0..12).map(|i| (i, 0)).collect();
        let b = max_hit(&w, &reqs, 16);
        // Each group: 3 requests, 2 of them hit the shared prefix rounded down to blocks.
        let s0 = w.session(0);
        let shared_chars = format!("<|system|>\n{}\n<|user|>\n", s0.system.clone().unwrap());
        let shared_tokens = tokenizer::tokenize(&shared_chars).len();
        let expect = 4 * 2 * (shared_tokens / 16 * 16) as u64;
        assert!(
            b.prefix_only_hit_tokens >= expect - 4 * 2 * 16 && b.prefix_only_hit_tokens <= expect,
            "{} vs {expect}",
            b.prefix_only_hit_tokens
        );
        assert!(
            b.prefix_only_rate() > 0.4 && b.prefix_only_rate() < 0.67,
            "{}",
            b.prefix_only_rate()
        );
        // One pass sends each prompt once: the bound is the shared prefixes.
        assert_eq!(b.max_hit_tokens, b.prefix_only_hit_tokens);
        // A second pass repeats every prompt: the whole prompts hit, beyond the prefixes.
        let twice: Vec<(u64, u32)> = (0..24).map(|i| (i, 0)).collect();
        let b2 = max_hit(&w, &twice, 16);
        assert!(b2.rate() > b2.prefix_only_rate() + 0.1, "{b2:?}");
        // Two passes: 5 of each group's 6 requests hit its prefix, against 2 of 3 before.
        assert_eq!(b2.prefix_only_hit_tokens * 2, b.prefix_only_hit_tokens * 5);
        let u = Workload::new(
            WorkloadSpec::Unique {
                prompt_tokens: 64,
                output_tokens: 4,
                prompt_tokens_max: 0,
                output_tokens_max: 0,
            },
            1,
        );
        let ur: Vec<(u64, u32)> = (0..10).map(|i| (i, 0)).collect();
        assert_eq!(max_hit(&u, &ur, 16).max_hit_tokens, 0);
    }

    #[test]
    fn multi_turn_resends_history_and_hits_it() {
        let w = Workload::new(
            WorkloadSpec::MultiTurn {
                conversations: 2,
                turns: 3,
                system_tokens: 40,
                user_tokens: 10,
                output_tokens: 8,
            },
            3,
        );
        let s = w.session(1);
        let answers = vec!["a1".to_string(), "a2".to_string()];
        let m = s.messages(2, &answers);
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(
            roles,
            ["system", "user", "assistant", "user", "assistant", "user"]
        );
        assert_eq!(m[2].content, "a1");
        let reqs = [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)];
        let b = max_hit(&w, &reqs, 16);
        assert!(b.rate() > 0.5, "{}", b.rate());
    }
}
