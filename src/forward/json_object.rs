//! A request body's top-level JSON object as its members in order, each value kept as the raw
//! JSON text it was sent as (not parsed into numbers or maps), and written back the same way.
//! Used where the router edits one top-level field of a client's body and must leave every
//! other byte alone: a `serde_json::Map` round trip would sort the keys and round big numbers.

use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

/// The members of a JSON object, keys unescaped, values unparsed. Repeated keys are kept.
pub struct Members<'a>(pub Vec<(String, &'a RawValue)>);

impl<'a> Members<'a> {
    /// Split `body`, which must be one JSON object.
    pub fn parse(body: &'a [u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(body)
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Members<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Members<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members<'a>, A::Error> {
                let mut members = Vec::new();
                while let Some((key, value)) = map.next_entry::<String, &'a RawValue>()? {
                    members.push((key, value));
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

/// A JSON object of `members` (key, raw JSON value), in order. Each value must already be
/// valid JSON text; keys are escaped as JSON strings.
pub fn write<'m>(members: impl IntoIterator<Item = (&'m str, &'m str)>) -> Vec<u8> {
    // Sized once (a body can be megabytes): the members are borrowed text, so listing them
    // first costs a pointer pair each. Keys may grow when escaped; that is rare and small.
    let members: Vec<(&str, &str)> = members.into_iter().collect();
    let size = members.iter().fold(2usize, |n, (k, v)| {
        n.saturating_add(k.len())
            .saturating_add(v.len())
            .saturating_add(4)
    });
    let mut out = Vec::with_capacity(size);
    out.push(b'{');
    for (i, (key, value)) in members.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_key(&mut out, key);
        out.push(b':');
        out.extend_from_slice(value.as_bytes());
    }
    out.push(b'}');
    out
}

/// A key as a JSON string (serde_json's escaping; writing into a `Vec` cannot fail).
fn write_key(out: &mut Vec<u8>, key: &str) {
    let _ = serde_json::to_writer(&mut *out, key);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn members_round_trip_byte_for_byte() {
        let body = br#"{"b":1, "a":[1, 2],"n":123456789012345678901234567890,"b":"x"}"#;
        let Members(m) = Members::parse(body).unwrap();
        let keys: Vec<&str> = m.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["b", "a", "n", "b"]);
        let out = write(m.iter().map(|(k, v)| (k.as_str(), v.get())));
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"b":1,"a":[1, 2],"n":123456789012345678901234567890,"b":"x"}"#
        );
    }

    #[test]
    fn keys_are_escaped_as_json_strings() {
        let out = write([("q\"\\\n\u{e9}", "1")]);
        let back: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(back["q\"\\\n\u{e9}"], 1);
        assert!(Members::parse(b"[1]").is_err());
        assert!(Members::parse(b"{\"a\":").is_err());
    }
}
