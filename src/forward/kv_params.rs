//! A client's own `kv_transfer_params` is taken out of the body before it reaches a backend,
//! unless the operator trusts every caller (`forward.allow_client_kv_transfer_params`).
//!
//! Why: vLLM reads this top-level field from any API client. With the NIXL connector, a decode
//! engine given `do_remote_prefill` and a `remote_host`/`remote_port` connects to that address
//! and reads KV blocks from it, so a client could make a backend open connections to a host of
//! its choosing and answer from foreign KV; `do_remote_decode` makes a backend hold the
//! prompt's blocks for the transfer lease. Only the router may set the field (for the prefill
//! and decode legs it sends itself).
//!
//! Cost: the prompt parser notes whether the top-level key is present while it reads the body
//! once ([`crate::prompt::RequestView::kv_transfer_params`]); a body without it is forwarded
//! as the same bytes. A body with it is split into its top-level members (each value kept as
//! raw JSON text, not parsed), every member named `kv_transfer_params` is dropped, and the
//! others are written back in their order, byte for byte. The body is bounded by
//! `max_body_bytes`, so this is at most one more linear pass.

use std::fmt;

use bytes::Bytes;
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

use crate::error::Error;
use crate::telemetry as t;

/// The field vLLM reads for disaggregated prefill/decode.
pub const FIELD: &str = "kv_transfer_params";

/// The body to forward: `body` itself unless it has the field (`present`, from the prompt
/// parser) and `allow` is off; then the body without the field, counted in
/// `inferlb_kv_transfer_params_stripped_total`.
pub fn client_body(body: Bytes, present: bool, allow: bool) -> Result<Bytes, Error> {
    if !present || allow {
        return Ok(body);
    }
    let stripped = without_field(&body)?;
    metrics::counter!(t::KV_TRANSFER_PARAMS_STRIPPED).increment(1);
    Ok(Bytes::from(stripped))
}

/// The top-level members of a JSON object, values unparsed.
struct Members<'a>(Vec<(String, &'a RawValue)>);

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

/// `body` (a JSON object) without any top-level [`FIELD`] member. Keys are compared after
/// JSON unescaping, as the backend's parser compares them, so `"kv_transfer_param\u0073"` goes too.
fn without_field(body: &[u8]) -> Result<Vec<u8>, Error> {
    let Members(members) = serde_json::from_slice(body).map_err(|e| {
        Error::InvalidRequest(format!("the request body must be a JSON object: {e}"))
    })?;
    let mut out = Vec::with_capacity(body.len());
    out.push(b'{');
    let mut first = true;
    for (key, value) in members.iter().filter(|(key, _)| key != FIELD) {
        if !first {
            out.push(b',');
        }
        first = false;
        serde_json::to_writer(&mut out, key).map_err(|e| Error::Internal(e.to_string()))?;
        out.push(b':');
        out.extend_from_slice(value.get().as_bytes());
    }
    out.push(b'}');
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn strip(body: &str) -> String {
        String::from_utf8(without_field(body.as_bytes()).unwrap()).unwrap()
    }

    #[test]
    fn drops_the_field_and_keeps_the_rest_byte_for_byte() {
        assert_eq!(
            strip(
                r#"{"model":"m", "kv_transfer_params":{"remote_host":"10.0.0.1"},"seed":123456789012345678901234567890,"x":[1, 2]}"#
            ),
            r#"{"model":"m","seed":123456789012345678901234567890,"x":[1, 2]}"#
        );
        assert_eq!(strip(r#"{"kv_transfer_params":null}"#), "{}");
        // Escaped spellings of the key and repeats are all removed.
        assert_eq!(
            strip(r#"{"kv_transfer_param\u0073":1,"a":"\u00e9","kv_transfer_params":2}"#),
            r#"{"a":"\u00e9"}"#
        );
    }

    #[test]
    fn a_body_without_the_flag_is_the_same_bytes() {
        let body = Bytes::from_static(br#"{"kv_transfer_params":1}"#);
        let same = client_body(body.clone(), false, false).unwrap();
        assert_eq!(same.as_ptr(), body.as_ptr());
        let allowed = client_body(body.clone(), true, true).unwrap();
        assert_eq!(allowed.as_ptr(), body.as_ptr());
        assert_eq!(&client_body(body, true, false).unwrap()[..], b"{}");
    }

    #[test]
    fn a_body_that_is_not_an_object_is_refused() {
        assert!(without_field(b"[1,2]").is_err());
    }
}
