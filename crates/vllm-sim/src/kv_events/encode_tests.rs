//! The encoder against the real capture of vLLM 0.32 (`tests/fixtures/vllm-kv-events/`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use rmpv::Value;

use super::*;

const CAPTURE: &[u8] =
    include_bytes!("../../tests/fixtures/vllm-kv-events/vllm-0.32-cpu-frames.msgpack");

/// The capture: `[[topic, seq, payload], ...]`, all three raw bytes.
fn capture() -> Vec<[Vec<u8>; 3]> {
    let v = rmpv::decode::read_value(&mut &CAPTURE[..]).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let f = m.as_array().unwrap();
            assert_eq!(f.len(), 3);
            let b = |i: usize| f[i].as_slice().expect("frames are bytes").to_vec();
            [b(0), b(1), b(2)]
        })
        .collect()
}

fn decode(payload: &[u8]) -> Value {
    let mut rd = payload;
    let v = rmpv::decode::read_value(&mut rd).unwrap();
    assert!(rd.is_empty(), "one value per payload");
    v
}

/// The type structure of a value: maps keep their keys in order, arrays list the distinct
/// shapes of their elements.
fn shape(v: &Value) -> String {
    match v {
        Value::Nil => "nil".into(),
        Value::Boolean(_) => "bool".into(),
        Value::Integer(i) if i.is_u64() => "uint".into(),
        Value::Integer(_) => "int".into(),
        Value::F32(_) => "f32".into(),
        Value::F64(_) => "f64".into(),
        Value::String(_) => "str".into(),
        Value::Binary(_) => "bin".into(),
        Value::Array(a) => {
            let mut s: Vec<String> = a.iter().map(shape).collect();
            s.dedup();
            format!("[{}]", s.join("|"))
        }
        Value::Map(m) => {
            let kv: Vec<String> = m
                .iter()
                .map(|(k, v)| format!("{}:{}", k.as_str().unwrap_or("?"), shape(v)))
                .collect();
            format!("{{{}}}", kv.join(","))
        }
        Value::Ext(..) => "ext".into(),
    }
}

fn field<'a>(m: &'a Value, key: &str) -> &'a Value {
    m.as_map()
        .unwrap()
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no {key}"))
}

/// Rebuilds our event type from a decoded vLLM event.
fn to_event(e: &Value) -> KvEvent {
    let u64s = |v: &Value| -> Vec<u64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    match field(e, "type").as_str().unwrap() {
        "BlockStored" => KvEvent::BlockStored {
            block_hashes: u64s(field(e, "block_hashes")),
            parent_block_hash: field(e, "parent_block_hash").as_u64(),
            token_ids: u64s(field(e, "token_ids"))
                .into_iter()
                .map(|t| t as u32)
                .collect(),
            lora: None,
            cache_salt: None,
        },
        "BlockRemoved" => {
            let h = u64s(field(e, "block_hashes"));
            assert_eq!(h.len(), 1, "vLLM sends one BlockRemoved per block");
            KvEvent::BlockRemoved { block_hash: h[0] }
        }
        "AllBlocksCleared" => KvEvent::AllBlocksCleared,
        t => panic!("unexpected {t}"),
    }
}

fn encoder() -> Encoder {
    Encoder {
        block_size: 128,
        loras: vec!["sql".into()],
    }
}

#[test]
fn every_captured_payload_re_encodes_byte_for_byte() {
    let frames = capture();
    assert_eq!(frames.len(), 28);
    let enc = encoder();
    let mut stored = 0;
    let mut removed = 0;
    for [topic, seq, payload] in &frames {
        assert_eq!(topic, b"kv@127.0.0.1:18102@tiny-llama");
        assert_eq!(seq.len(), 8, "seq is a u64, big-endian");
        let v = decode(payload);
        let p = v.as_array().unwrap();
        let ts = p[0].as_f64().unwrap();
        let events: Vec<KvEvent> = p[1].as_array().unwrap().iter().map(to_event).collect();
        stored += events
            .iter()
            .filter(|e| matches!(e, KvEvent::BlockStored { .. }))
            .count();
        removed += events
            .iter()
            .filter(|e| matches!(e, KvEvent::BlockRemoved { .. }))
            .count();
        let ours = enc.encode_batch(ts, &events).unwrap();
        assert_eq!(shape(&decode(&ours)), shape(&v));
        assert_eq!(
            ours,
            *payload,
            "seq {:?}",
            u64::from_be_bytes(seq[..].try_into().unwrap())
        );
    }
    assert!(
        stored >= 28 && removed > 0,
        "{stored} stored, {removed} removed"
    );
}

#[test]
fn frames_are_topic_seq_payload() {
    let f = frames("kv@x", 13, vec![0x90]);
    assert_eq!(&f[0][..], b"kv@x");
    assert_eq!(&f[1][..], 13u64.to_be_bytes());
    assert_eq!(&f[2][..], [0x90]);
    // Same framing as the capture's first message.
    let cap = &capture()[0];
    let f = frames("kv@127.0.0.1:18102@tiny-llama", 13, cap[2].clone());
    assert_eq!([f[0].to_vec(), f[1].to_vec(), f[2].to_vec()], *cap);
}

#[test]
fn lora_blocks_carry_the_adapter() {
    let enc = encoder();
    let ev = KvEvent::BlockStored {
        block_hashes: vec![u64::MAX, 7],
        parent_block_hash: Some(9),
        token_ids: (0..256).collect(),
        lora: Some(0),
        cache_salt: None,
    };
    let v = decode(&enc.encode_batch(1.5, &[ev]).unwrap());
    let e = &v.as_array().unwrap()[1].as_array().unwrap()[0];
    assert_eq!(field(e, "lora_id").as_u64(), Some(1));
    assert_eq!(field(e, "lora_name").as_str(), Some("sql"));
    assert_eq!(field(e, "parent_block_hash").as_u64(), Some(9));
    assert_eq!(
        field(e, "block_hashes").as_array().unwrap()[0].as_u64(),
        Some(u64::MAX)
    );
    assert_eq!(shape(field(e, "extra_keys")), "[[str]]");
    assert_eq!(field(e, "block_size").as_u64(), Some(128));
    // An adapter index without a name (cannot happen in the engine) is written as the base model.
    let ev = KvEvent::BlockStored {
        block_hashes: vec![1],
        parent_block_hash: None,
        token_ids: vec![0; 128],
        lora: Some(5),
        cache_salt: None,
    };
    let v = decode(&enc.encode_batch(1.5, &[ev]).unwrap());
    let e = &v.as_array().unwrap()[1].as_array().unwrap()[0];
    assert!(field(e, "lora_id").is_nil() && field(e, "lora_name").is_nil());
}

#[test]
fn cache_salt_goes_into_the_first_blocks_extra_keys() {
    let enc = encoder();
    let stored = |lora, salt: &str| KvEvent::BlockStored {
        block_hashes: vec![1, 2],
        parent_block_hash: None,
        token_ids: vec![0; 256],
        lora,
        cache_salt: Some(salt.into()),
    };
    let keys = |ev: KvEvent| {
        let v = decode(&enc.encode_batch(1.0, &[ev]).unwrap());
        field(
            &v.as_array().unwrap()[1].as_array().unwrap()[0],
            "extra_keys",
        )
        .to_string()
    };
    assert_eq!(keys(stored(None, "s1")), r#"[["s1"], nil]"#);
    assert_eq!(keys(stored(Some(0), "s1")), r#"[["sql", "s1"], ["sql"]]"#);
}

#[test]
fn cleared_is_a_bare_tagged_map() {
    let v = decode(
        &encoder()
            .encode_batch(2.0, &[KvEvent::AllBlocksCleared])
            .unwrap(),
    );
    assert_eq!(shape(&v), "[f64|[{type:str}]|uint]");
    assert_eq!(
        field(&v.as_array().unwrap()[1].as_array().unwrap()[0], "type").as_str(),
        Some("AllBlocksCleared")
    );
}
