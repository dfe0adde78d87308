#![allow(clippy::unwrap_used)]
use super::*;
use crate::kv_events::chain::prompt_chain;
use crate::kv_events::test_support::{go_live, removed, stored};

fn chain(tokens: std::ops::Range<u32>, bs: usize) -> Vec<u64> {
    let t: Vec<u32> = tokens.collect();
    let mut out = Vec::new();
    prompt_chain(&t, bs, None, None, 1000, &mut out);
    out
}

fn live() -> BlockStore {
    let s = BlockStore::default();
    go_live(&s, 1_000);
    s
}

#[test]
fn stored_chains_extend_through_parents_and_removals_apply() {
    let s = live();
    // Blocks 0-1 in one event, block 2 in a later one whose parent is block 1.
    s.apply(0, &[stored(&[10, 11], None, 0..8, 4)], 0);
    s.apply(1, &[stored(&[12], Some(11), 8..12, 4)], 0);
    let c = chain(0..16, 4);
    assert_eq!(s.matched(&c, 0), 3);
    assert_eq!(s.block_size(), 4);
    assert_eq!(s.blocks(), 3);
    s.apply(2, &[removed(&[11])], 0);
    assert_eq!(s.matched(&c, 0), 1, "consecutive from the start only");
    // A parent never seen: the blocks cannot be named (and are not claimed).
    s.apply(3, &[stored(&[99], Some(12345), 12..16, 4)], 0);
    assert_eq!(s.blocks(), 2);
    s.apply(4, &[Event::AllCleared], 0);
    assert_eq!((s.matched(&c, 0), s.blocks()), (0, 0));
}

#[test]
fn a_block_in_two_tiers_stays_until_both_drop_it() {
    let s = live();
    s.apply(0, &[stored(&[10], None, 0..4, 4)], 0);
    let Event::Stored(mut cpu) = stored(&[10], None, 0..4, 4) else {
        panic!()
    };
    cpu.medium = Medium::Cpu;
    s.apply(1, &[Event::Stored(cpu)], 0);
    let c = chain(0..4, 4);
    s.apply(2, &[removed(&[10])], 0);
    assert_eq!(s.matched(&c, 0), 1, "still in the CPU tier");
    s.apply(
        3,
        &[Event::Removed {
            block_hashes: vec![10],
            medium: Medium::Cpu,
        }],
        0,
    );
    assert_eq!(s.matched(&c, 0), 0);
}

#[test]
fn lora_blocks_match_only_that_adapters_chain() {
    let s = live();
    let Event::Stored(mut e) = stored(&[10], None, 0..4, 4) else {
        panic!()
    };
    e.lora_name = Some("ad".into());
    e.extra_keys = vec![vec!["ad".into()]]; // vLLM repeats the name among the extra keys
    s.apply(0, &[Event::Stored(e)], 0);
    let t: Vec<u32> = (0..4).collect();
    let mut with = Vec::new();
    prompt_chain(&t, 4, Some("ad"), None, 10, &mut with);
    assert_eq!(s.matched(&with, 0), 1);
    assert_eq!(s.matched(&chain(0..4, 4), 0), 0);
}

#[test]
fn capacity_follows_num_gpu_blocks_and_evicts_the_oldest() {
    let s = live();
    s.set_gpu_blocks(Some(8)); // 8 + 1/8 = 9 kept
    for i in 0..20u64 {
        let t = (i as u32 * 4)..(i as u32 * 4 + 4);
        s.apply(i, &[stored(&[100 + i], None, t, 4)], 0);
    }
    assert_eq!(s.blocks(), 9);
    assert_eq!(s.matched(&chain(0..4, 4), 0), 0, "oldest gone");
    assert_eq!(s.matched(&chain(76..80, 4), 0), 1, "newest kept");
    // Removals leave stale order entries; the order list stays bounded.
    for i in 20..5000u64 {
        let t = (i as u32 * 4)..(i as u32 * 4 + 4);
        s.apply(i, &[stored(&[100 + i], None, t, 4), removed(&[100 + i])], 0);
    }
    assert!(s.lock().order.len() <= 9 * 2 + 1024 + 1);
}

#[test]
fn sequence_gaps_and_restarts() {
    let s = live();
    assert_eq!(s.check_seq(0), SeqCheck::InOrder);
    s.apply(0, &[stored(&[10], None, 0..4, 4)], 0);
    assert_eq!(s.check_seq(1), SeqCheck::InOrder);
    assert_eq!(s.check_seq(0), SeqCheck::Duplicate);
    assert_eq!(s.check_seq(5), SeqCheck::Gap { from: 1 });
    s.apply(4, &[], 0);
    assert_eq!(s.check_seq(2), SeqCheck::Restart);
    s.restarted();
    assert_eq!(s.blocks(), 0);
    assert_eq!(s.check_seq(2), SeqCheck::Gap { from: 0 }, "a late join");
    // Unsure until the cache turned over once.
    s.set_gpu_blocks(Some(2));
    s.mark_unsure();
    assert_eq!(s.status(0), Status::Unsure);
    s.apply(2, &[stored(&[20], None, 0..4, 4)], 0);
    assert_eq!(s.status(0), Status::Unsure);
    s.apply(3, &[stored(&[21], None, 4..8, 4)], 0);
    assert_eq!(s.status(0), Status::Live);
    let fresh = BlockStore::default();
    assert_eq!(fresh.check_seq(7), SeqCheck::Gap { from: 0 });
    assert_eq!(fresh.status(0), Status::Off);
}

#[test]
fn in_flight_blocks_count_briefly_and_silence_is_noticed() {
    let s = live();
    let c = chain(0..8, 4);
    s.note_sent(&c, 0, 100, 50);
    assert_eq!(s.matched(&c, 120), 2, "in flight");
    assert_eq!(s.matched(&c, 151), 0, "expired");
    assert_eq!(s.status(1_000), Status::Live);
    assert_eq!(
        s.status(1_200),
        Status::Silent,
        "sent at 100, nothing heard for 1 s"
    );
    s.apply(0, &[], 1_200);
    assert_eq!(s.status(1_201), Status::Live, "events flow again");
    s.purge_pending(151);
    assert_eq!(s.pending_len.load(Ordering::Relaxed), 0);
    // A prompt the backend already holds expects nothing.
    s.note_sent(&c, 2, 2_000, 50);
    assert_eq!(s.status(9_000), Status::Live);
    s.turn_off();
    s.note_sent(&c, 0, 2_000, 50);
    assert_eq!((s.status(9_000), s.matched(&c, 2_000)), (Status::Off, 0));
}

#[test]
fn stores_share_the_fleet_index_and_a_dropped_store_leaves_nothing() {
    // Tokens no other test uses: the fleet index is shared by the whole process.
    let (a, b) = (live(), live());
    a.apply(0, &[stored(&[10, 11, 12], None, 5000..5012, 4)], 0);
    b.apply(0, &[stored(&[20], None, 5000..5004, 4)], 0);
    let c = chain(5000..5016, 4);
    // One decision asks both in turn: the second answer comes from the same walk.
    assert_eq!((a.matched(&c, 0), b.matched(&c, 0)), (3, 1));
    b.apply(1, &[stored(&[21, 22, 23], Some(20), 5004..5016, 4)], 0);
    assert_eq!(
        (a.matched(&c, 0), b.matched(&c, 0)),
        (3, 4),
        "a write is seen"
    );
    let slot = *a.slot.get().unwrap();
    drop(a);
    let guard = Guard::new();
    // Even if another test took the slot again, it cannot hold these blocks.
    assert!(
        c[..3].iter().all(|h| !fleet().holds(*h, slot, &guard)),
        "a dropped store's bits are cleared"
    );
    assert_eq!(b.matched(&c, 0), 4);
}

#[test]
fn every_status_is_listed_at_its_own_index() {
    for (i, status) in Status::ALL.iter().enumerate() {
        assert_eq!(*status as usize, i, "{status:?}");
    }
}
