#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::*;

const CAPTURE: &[u8] = include_bytes!("../../../tests/fixtures/vllm-0.32-cpu-frames.msgpack");
const TWIN: &str = include_str!("../../../tests/fixtures/vllm-0.32-cpu-frames.json");

/// The capture's messages: (topic, seq frame, payload frame).
pub(crate) fn capture() -> Vec<(Vec<u8>, Vec<u8>, Vec<u8>)> {
    let mut c = Cursor::new(CAPTURE);
    let n = c.array_len().unwrap();
    (0..n)
        .map(|_| {
            assert_eq!(c.array_len().unwrap(), 3);
            let mut part = || {
                let m = c.marker().unwrap();
                c.bytes_of(m).unwrap().unwrap().to_vec()
            };
            (part(), part(), part())
        })
        .collect()
}

#[test]
fn every_frame_of_the_real_capture_decodes_as_its_twin_says() {
    let twin: Vec<serde_json::Value> = serde_json::from_str(TWIN).unwrap();
    let messages = capture();
    assert_eq!(messages.len(), 28);
    assert_eq!(messages.len(), twin.len());
    let (mut stored, mut removed) = (0, 0);
    for ((topic, seq, payload), want) in messages.iter().zip(&twin) {
        let (t, s, p) = split_frames(&[topic, seq, payload]).unwrap();
        assert_eq!(t, want["topic"].as_str().unwrap().as_bytes());
        assert_eq!(s, want["seq"].as_u64().unwrap());
        let batch = decode_payload(s, p).unwrap();
        let events = want["payload"][1].as_array().unwrap();
        assert_eq!(batch.events.len(), events.len());
        for (got, want) in batch.events.iter().zip(events) {
            let hashes: Vec<u64> = want["block_hashes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| h.as_u64().unwrap())
                .collect();
            match (got, want["type"].as_str().unwrap()) {
                (Event::Stored(s), "BlockStored") => {
                    stored += 1;
                    assert_eq!(s.block_hashes, hashes);
                    assert_eq!(s.parent, want["parent_block_hash"].as_u64());
                    let tokens: Vec<u32> = want["token_ids"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|t| t.as_u64().unwrap() as u32)
                        .collect();
                    assert_eq!(s.token_ids, tokens);
                    assert_eq!(s.block_size, 128);
                    assert_eq!(s.medium, Medium::Gpu);
                    assert_eq!(s.lora_name, None);
                    assert!(s.extra_keys.is_empty(), "all-nil extra keys fold to none");
                }
                (
                    Event::Removed {
                        block_hashes,
                        medium,
                    },
                    "BlockRemoved",
                ) => {
                    removed += 1;
                    assert_eq!(*block_hashes, hashes);
                    assert_eq!(*medium, Medium::Gpu);
                }
                (got, want) => panic!("{got:?} decoded for a {want}"),
            }
        }
    }
    assert_eq!((stored, removed), (28, 105));
    // Some of vLLM's hashes exceed i64::MAX: read as u64.
    assert!(twin
        .iter()
        .any(|m| m["payload"][1]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["block_hashes"]
                .as_array()
                .unwrap()
                .iter()
                .any(|h| h.as_u64().unwrap() > i64::MAX as u64))));
}

#[test]
fn truncated_frames_fail_without_panicking_or_allocating_from_lengths() {
    for (_, _, payload) in capture().iter().take(3) {
        for cut in 0..payload.len() {
            assert!(decode_payload(0, &payload[..cut]).is_err(), "cut at {cut}");
        }
    }
    // An array header claiming 4 billion elements in a 6-byte message.
    let lying = [0x92, 0xcb, 0xdd, 0xff, 0xff, 0xff, 0xff];
    assert_eq!(decode_payload(0, &lying), Err(WireError::Truncated));
    let lying = [0x92, 0x00, 0x91, 0xdf, 0xff, 0xff, 0xff, 0xff];
    assert_eq!(decode_payload(0, &lying), Err(WireError::Truncated));
    // Nesting bombs stop at the depth limit.
    let mut deep = vec![0x92, 0x00, 0x91, 0x82, 0xa4];
    deep.extend_from_slice(b"type");
    deep.extend_from_slice(&[0xa3]);
    deep.extend_from_slice(b"Foo");
    deep.extend_from_slice(&[0xa1, b'x']);
    deep.extend(std::iter::repeat_n(0x91, 64));
    deep.push(0x00);
    assert_eq!(decode_payload(0, &deep), Err(WireError::TooDeep));
}

#[test]
fn legacy_positional_events_and_every_hash_type_decode() {
    use rmp::encode as e;
    let mut p = Vec::new();
    e::write_array_len(&mut p, 3).unwrap();
    e::write_f64(&mut p, 1.5).unwrap();
    e::write_array_len(&mut p, 4).unwrap();
    // ["BlockStored", [u64, i64, bin], parent i64, tokens, block_size, lora_id, medium, lora_name]
    e::write_array_len(&mut p, 8).unwrap();
    e::write_str(&mut p, "BlockStored").unwrap();
    e::write_array_len(&mut p, 3).unwrap();
    e::write_uint(&mut p, u64::MAX - 1).unwrap();
    e::write_sint(&mut p, -2).unwrap();
    e::write_bin(&mut p, &[1, 2, 3, 4]).unwrap();
    e::write_sint(&mut p, -7).unwrap();
    e::write_array_len(&mut p, 6).unwrap();
    for t in [1u64, 200, 70_000, 5, 6, 7] {
        e::write_uint(&mut p, t).unwrap();
    }
    e::write_uint(&mut p, 2).unwrap();
    e::write_uint(&mut p, 3).unwrap();
    e::write_str(&mut p, "CPU").unwrap();
    e::write_str(&mut p, "my-adapter").unwrap();
    // ["BlockRemoved", [5]] (medium omitted: default)
    e::write_array_len(&mut p, 2).unwrap();
    e::write_str(&mut p, "BlockRemoved").unwrap();
    e::write_array_len(&mut p, 1).unwrap();
    e::write_uint(&mut p, 5).unwrap();
    e::write_array_len(&mut p, 1).unwrap();
    e::write_str(&mut p, "AllBlocksCleared").unwrap();
    // A newer event type with a field: skipped.
    e::write_array_len(&mut p, 2).unwrap();
    e::write_str(&mut p, "SomethingNew").unwrap();
    e::write_map_len(&mut p, 1).unwrap();
    e::write_str(&mut p, "k").unwrap();
    e::write_f32(&mut p, 1.0).unwrap();
    e::write_uint(&mut p, 1).unwrap(); // dp rank
    let batch = decode_payload(9, &p).unwrap();
    assert_eq!(batch.dp_rank, Some(1));
    assert_eq!(batch.seq, 9);
    let Event::Stored(s) = &batch.events[0] else {
        panic!("{:?}", batch.events[0])
    };
    assert_eq!(
        s.block_hashes,
        vec![u64::MAX - 1, (-2i64) as u64, xxh3_64(&[1, 2, 3, 4])]
    );
    assert_eq!(s.parent, Some((-7i64) as u64));
    assert_eq!(s.token_ids, vec![1, 200, 70_000, 5, 6, 7]);
    assert_eq!(s.block_size, 2);
    assert_eq!(s.medium, Medium::Cpu);
    assert_eq!(s.lora_name.as_deref(), Some("my-adapter"));
    assert_eq!(
        batch.events[1],
        Event::Removed {
            block_hashes: vec![5],
            medium: Medium::Gpu
        }
    );
    assert_eq!(batch.events[2], Event::AllCleared);
    assert_eq!(batch.events[3], Event::Unknown);
}

#[test]
fn tagged_maps_with_omitted_defaults_unknown_keys_and_extra_keys() {
    use rmp::encode as e;
    let mut p = Vec::new();
    e::write_array_len(&mut p, 2).unwrap();
    e::write_f64(&mut p, 0.0).unwrap();
    e::write_array_len(&mut p, 1).unwrap();
    e::write_map_len(&mut p, 6).unwrap();
    e::write_str(&mut p, "block_hashes").unwrap(); // before "type": order does not matter
    e::write_array_len(&mut p, 1).unwrap();
    e::write_bin(&mut p, &[9; 32]).unwrap();
    e::write_str(&mut p, "type").unwrap();
    e::write_str(&mut p, "BlockStored").unwrap();
    e::write_str(&mut p, "token_ids").unwrap();
    e::write_array_len(&mut p, 2).unwrap();
    e::write_uint(&mut p, 1).unwrap();
    e::write_uint(&mut p, 2).unwrap();
    e::write_str(&mut p, "block_size").unwrap();
    e::write_uint(&mut p, 2).unwrap();
    e::write_str(&mut p, "extra_keys").unwrap();
    e::write_array_len(&mut p, 1).unwrap();
    e::write_array_len(&mut p, 2).unwrap();
    e::write_str(&mut p, "salt-1").unwrap();
    e::write_uint(&mut p, 3).unwrap();
    e::write_str(&mut p, "future_field").unwrap();
    e::write_map_len(&mut p, 1).unwrap();
    e::write_str(&mut p, "a").unwrap();
    e::write_array_len(&mut p, 1).unwrap();
    e::write_nil(&mut p).unwrap();
    let batch = decode_payload(0, &p).unwrap();
    let Event::Stored(s) = &batch.events[0] else {
        panic!()
    };
    assert_eq!(s.block_hashes, vec![xxh3_64(&[9; 32])]);
    assert_eq!(s.parent, None);
    assert_eq!(s.medium, Medium::Gpu, "omitted medium is the GPU");
    assert_eq!(s.extra_keys, vec![vec!["salt-1".to_owned()]]);
}

#[test]
fn the_encoder_round_trips() {
    let events = vec![
        Event::Stored(Stored {
            block_hashes: vec![1, u64::MAX],
            parent: Some(7),
            token_ids: (0..8).collect(),
            block_size: 4,
            lora_name: Some("a".into()),
            medium: Medium::Gpu,
            extra_keys: Vec::new(),
        }),
        Event::Removed {
            block_hashes: vec![1],
            medium: Medium::Cpu,
        },
        Event::AllCleared,
    ];
    let batch = decode_payload(3, &encode::payload(2.0, &events)).unwrap();
    assert_eq!(batch.events, events);
}

#[test]
fn frames_split_live_and_replayed_messages() {
    let seq = 5u64.to_be_bytes();
    assert_eq!(
        split_frames(&[b"t", &seq, b"p"]).unwrap(),
        (&b"t"[..], 5, &b"p"[..])
    );
    assert_eq!(split_frames(&[&seq, b"p"]).unwrap().1, 5);
    assert_eq!(split_frames(&[b"p"]), Err(WireError::Frames(1)));
    assert_eq!(split_frames(&[b"t", b"123", b"p"]), Err(WireError::Seq));
    assert_eq!(
        split_frames(&[b"", &(-1i64).to_be_bytes(), b""]).unwrap().1,
        END_OF_REPLAY
    );
    // vLLM 0.32's replay answer, as a DEALER receives it: delimiter, topic, seq, payload
    // (seen on a real server: frames of 0, 29, 8 and 1539 bytes); its end marker likewise.
    assert_eq!(
        split_frames(&[b"", b"kv@h", &seq, b"p"]).unwrap(),
        (&b"kv@h"[..], 5, &b"p"[..])
    );
    assert_eq!(
        split_frames(&[b"", b"", &(-1i64).to_be_bytes(), b""])
            .unwrap()
            .1,
        END_OF_REPLAY
    );
    assert_eq!(
        split_frames(&[b"x", b"t", &seq, b"p"]),
        Err(WireError::Frames(4))
    );
    assert_eq!(
        split_frames(&[b"", b"", b"t", &seq, b"p"]),
        Err(WireError::Frames(5))
    );
}

/// The token loop's three paths (runs of eight u16s, pairs from one load, single ids) and the
/// general reader at the end agree with the ids written, for every mix of encodings: runs
/// broken at each position, all widths (fixint, u8, u16, u32, and u64 `0xcf`, which only the
/// general reader takes), lengths around the 8-, 16- and 24-byte windows.
#[test]
fn token_ids_decode_in_every_mix_of_encodings() {
    let widths: [fn(&mut fastrand::Rng) -> u64; 5] = [
        |r| r.u64(..0x80),
        |r| r.u64(0x80..0x100),
        |r| r.u64(0x100..0x1_0000),
        |r| r.u64(0x1_0000..0x1_0000_0000),
        |r| r.u64(..0x1_0000), // written below as u64 (0xcf)
    ];
    let mut rng = fastrand::Rng::with_seed(11);
    for case in 0..4_000 {
        let n = rng.usize(0..40);
        // Mostly u16 (the fast run), with other widths sprinkled in at random places.
        let odd = rng.usize(0..5);
        let ids: Vec<(u64, usize)> = (0..n)
            .map(|_| {
                let w = if rng.usize(0..8) == 0 {
                    rng.usize(0..5)
                } else {
                    [2, odd][rng.usize(0..2)]
                };
                (widths[w](&mut rng), w)
            })
            .collect();
        let mut p = Vec::new();
        rmp::encode::write_array_len(&mut p, n as u32).unwrap();
        for &(id, w) in &ids {
            if w == 4 {
                rmp::encode::write_u64(&mut p, id).unwrap();
            } else {
                rmp::encode::write_uint(&mut p, id).unwrap();
            }
        }
        // Whatever follows the array must be left for the next reader.
        let tail = rng.usize(0..20);
        p.extend(std::iter::repeat_n(0xc0, tail));
        let mut c = Cursor::new(&p);
        let got = c.tokens().unwrap();
        let want: Vec<u32> = ids.iter().map(|&(id, _)| id as u32).collect();
        assert_eq!(got, want, "case {case}: {ids:?}");
        assert_eq!(c.buf.len(), tail, "case {case}: bytes left");
    }
}

#[test]
fn a_token_id_that_is_not_a_u32_is_refused() {
    for bad in [
        |p: &mut Vec<u8>| rmp::encode::write_u64(p, 1 << 40).map(|_| ()),
        |p: &mut Vec<u8>| rmp::encode::write_sint(p, -1).map(|_| ()),
        |p: &mut Vec<u8>| rmp::encode::write_str(p, "x").map(|_| ()),
    ] {
        let mut p = Vec::new();
        rmp::encode::write_array_len(&mut p, 12).unwrap();
        for i in 0..11 {
            rmp::encode::write_uint(&mut p, 300 + i).unwrap();
        }
        bad(&mut p).unwrap();
        p.extend([0xcd, 1, 2, 0xcd, 1, 2, 0xcd, 1, 2]);
        assert!(Cursor::new(&p).tokens().is_err(), "{p:?}");
    }
}
