//! Unit tests of the scheduler: admission, prefix hits, chunking, preemption, aborts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

struct Rig {
    s: Scheduler,
    rxs: Vec<mpsc::UnboundedReceiver<TokenEvent>>,
    next_id: u64,
}

impl Rig {
    fn new(block_size: usize, blocks: usize, max_seqs: usize, budget: usize) -> Self {
        let limits = Limits {
            block_size,
            max_num_seqs: max_seqs,
            max_num_batched_tokens: budget,
            max_loras: 1,
        };
        Self {
            s: Scheduler::new(limits, blocks),
            rxs: Vec::new(),
            next_id: 0,
        }
    }

    fn add(&mut self, tokens: Vec<u32>, max_tokens: u32) -> u64 {
        self.add_lora(tokens, max_tokens, None)
    }

    fn add_lora(&mut self, tokens: Vec<u32>, max_tokens: u32, lora: Option<u16>) -> u64 {
        let (tx, rx) = mpsc::unbounded_channel();
        self.rxs.push(rx);
        let id = self.next_id;
        self.next_id += 1;
        let seed = lora.map_or(0, |l| u64::from(l) + 1);
        let seq = Seq::new(id, tokens, max_tokens, seed, lora, tx, Instant::now());
        self.s.waiting.push_back(seq);
        id
    }

    fn step(&mut self) -> (ScheduleOutcome, Vec<Finished>) {
        let out = self.s.schedule(Instant::now());
        let left = self.s.apply(Instant::now(), |_| {});
        (out, left)
    }

    /// Steps until idle (bounded), returning the total prefix hits seen.
    fn drain(&mut self) -> u64 {
        let mut hits = 0;
        for _ in 0..10_000 {
            if self.s.is_idle() {
                return hits;
            }
            hits += self.step().0.prefix_hits;
        }
        panic!("scheduler did not drain");
    }
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 31 + salt).collect()
}

#[test]
fn same_prompt_twice_hits_full_blocks_only() {
    let mut r = Rig::new(16, 64, 8, 4096);
    r.add(prompt(40, 0), 2);
    assert_eq!(r.drain(), 0, "cold cache: no hits");
    r.add(prompt(40, 0), 2);
    let (out, _) = r.step();
    assert_eq!(out.prefix_queries, 40);
    assert_eq!(
        out.prefix_hits, 32,
        "two full blocks; the partial third is never cached"
    );
    assert_eq!(
        out.work.prefill_tokens, 8,
        "only the uncached tail is computed"
    );
}

#[test]
fn at_least_one_token_is_computed() {
    let mut r = Rig::new(16, 64, 8, 4096);
    r.add(prompt(32, 0), 1);
    r.drain();
    r.add(prompt(32, 0), 1);
    let (out, _) = r.step();
    assert_eq!(
        out.prefix_hits, 16,
        "exactly two blocks of prompt: only the first may hit"
    );
}

#[test]
fn different_prefix_misses() {
    let mut r = Rig::new(16, 64, 8, 4096);
    r.add(prompt(40, 0), 1);
    r.drain();
    r.add(prompt(40, 1), 1);
    assert_eq!(r.step().0.prefix_hits, 0);
}

#[test]
fn max_num_seqs_keeps_the_rest_waiting() {
    let mut r = Rig::new(16, 64, 2, 4096);
    for salt in 0..3 {
        r.add(prompt(10, salt), 5);
    }
    let (out, _) = r.step();
    assert_eq!(out.admitted, 2);
    assert_eq!(r.s.running.len(), 2);
    assert_eq!(r.s.waiting.len(), 1);
    r.drain();
}

#[test]
fn long_prompt_prefill_is_chunked_by_the_budget() {
    let mut r = Rig::new(16, 64, 8, 40);
    r.add(prompt(100, 0), 3);
    let chunks: Vec<u32> = (0..3).map(|_| r.step().0.work.prefill_tokens).collect();
    assert_eq!(chunks, [40, 40, 20]);
    assert!(
        r.rxs[0].try_recv().is_ok(),
        "first token after the last chunk"
    );
    let (out, _) = r.step();
    assert_eq!(out.work.prefill_tokens, 0, "then it decodes");
    assert_eq!(out.work.context_tokens, 100);
}

#[test]
fn kv_pressure_queues_then_preempts_and_everything_finishes() {
    // 6 blocks of 4 tokens. Each request needs 2 blocks for its prompt and grows to 5.
    let mut r = Rig::new(4, 6, 8, 4096);
    let a = r.add(prompt(6, 0), 14);
    let b = r.add(prompt(6, 1), 14);
    let c = r.add(prompt(6, 2), 14);
    let (out, _) = r.step();
    assert_eq!(out.admitted, 3);
    assert_eq!(r.s.pool.num_free(), 0);
    let mut preempted = 0;
    let mut finished = Vec::new();
    for _ in 0..1000 {
        if r.s.is_idle() {
            break;
        }
        let (out, left) = r.step();
        preempted += out.preempted;
        finished.extend(left.iter().map(|f| (f.seq.id, f.reason)));
    }
    assert!(preempted > 0, "growth beyond capacity must preempt");
    assert_eq!(finished.len(), 3);
    assert!(finished
        .iter()
        .all(|(_, reason)| *reason == Some(FinishReason::Length)));
    // The most recently admitted request is the first victim, so the oldest finishes first.
    assert_eq!(finished[0].0, a);
    assert!(finished.iter().any(|(id, _)| *id == b) && finished.iter().any(|(id, _)| *id == c));
    assert_eq!(r.s.pool.num_used(), 0, "all blocks returned");
    for rx in &mut r.rxs {
        let mut n = 0;
        while rx.try_recv().is_ok() {
            n += 1;
        }
        assert_eq!(
            n, 14,
            "every request got exactly max_tokens tokens despite preemption"
        );
    }
}

#[test]
fn head_of_line_waits_for_blocks() {
    // 4 blocks of 4 tokens: a 12-token prompt takes 3, the next needs 3 and must wait.
    let mut r = Rig::new(4, 4, 8, 4096);
    r.add(prompt(12, 0), 4);
    r.add(prompt(12, 1), 1);
    let (out, _) = r.step();
    assert_eq!(out.admitted, 1);
    assert_eq!(r.s.waiting.len(), 1);
    r.drain();
    assert_eq!(r.s.pool.num_used(), 0);
}

#[test]
fn abort_frees_blocks_at_once() {
    let mut r = Rig::new(16, 64, 8, 4096);
    let id = r.add(prompt(100, 0), 50);
    r.step();
    assert_eq!(r.s.pool.num_used(), 7);
    let seq = r.s.abort(id).expect("running");
    assert_eq!(seq.id, id);
    assert_eq!(r.s.pool.num_used(), 0);
    assert!(r.s.abort(id).is_none(), "second abort finds nothing");
    assert!(r.s.is_idle());
}

#[test]
fn closed_client_channel_ends_the_sequence() {
    let mut r = Rig::new(16, 64, 8, 4096);
    r.add(prompt(20, 0), 50);
    r.rxs.clear(); // the HTTP side dropped its receiver
    let (_, left) = r.step();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].reason, None);
    assert_eq!(r.s.pool.num_used(), 0);
}

#[test]
fn generated_blocks_are_cached_for_the_next_turn() {
    let mut r = Rig::new(4, 64, 8, 4096);
    let p = prompt(8, 0);
    r.add(p.clone(), 9);
    r.drain();
    // Next turn: the prompt plus the 9 generated tokens plus a new question.
    let mut next = p.clone();
    next.extend((0..9).map(filler_id));
    next.extend(prompt(5, 7));
    r.add(next, 1);
    let (out, _) = r.step();
    // 8 generated tokens had KV computed (the 9th was sampled last): 16 tokens = 4 blocks.
    assert_eq!(out.prefix_hits, 16);
}

#[test]
fn max_loras_skips_other_adapters_without_blocking_the_queue() {
    let mut r = Rig::new(16, 64, 8, 4096); // max_loras = 1
    let a = r.add_lora(prompt(10, 0), 3, Some(0));
    let b = r.add_lora(prompt(10, 1), 3, Some(1));
    let c = r.add_lora(prompt(10, 2), 3, Some(0));
    let d = r.add(prompt(10, 3), 3);
    let (out, _) = r.step();
    assert_eq!(out.admitted, 3);
    assert_eq!(out.lora_loads, 1, "a and c share adapter 0: one load");
    let running: Vec<u64> = r.s.running.iter().map(|s| s.id).collect();
    assert_eq!(
        running,
        [a, c, d],
        "the base model and the running adapter pass"
    );
    assert_eq!(
        r.s.waiting.front().map(|s| s.id),
        Some(b),
        "b keeps its place"
    );
    r.drain();
    assert_eq!(r.s.pool.num_used(), 0);
    assert_eq!(
        r.s.resident_loras,
        [1],
        "b's adapter evicted a's from the one slot"
    );
}

#[test]
fn re_admission_after_preemption_is_not_counted_as_a_prefix_query() {
    // 6 blocks of 4 tokens, three requests that outgrow them: some are preempted and come
    // back, finding their own full blocks still cached. Like vLLM 0.32, only first admissions
    // count in queries/hits: the queries are exactly the three prompts, once each.
    let mut r = Rig::new(4, 6, 8, 4096);
    for salt in 0..3 {
        r.add(prompt(6, salt), 14);
    }
    let (mut queries, mut hits, mut preempted) = (0, 0, 0);
    let (mut re_queries, mut re_hits) = (0, 0);
    for _ in 0..1000 {
        if r.s.is_idle() {
            break;
        }
        let (out, _) = r.step();
        queries += out.prefix_queries;
        hits += out.prefix_hits;
        preempted += out.preempted;
        re_queries += out.preempted_prefix_queries;
        re_hits += out.preempted_prefix_hits;
    }
    assert!(r.s.is_idle());
    assert!(preempted > 0, "the workload must preempt");
    assert_eq!(queries, 3 * 6, "each prompt queried once");
    assert_eq!(hits, 0, "three different prompts share nothing");
    assert!(
        re_queries > 0 && re_hits > 0,
        "re-admissions find their own blocks"
    );
}
