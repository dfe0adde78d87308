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

use bytes::Bytes;

use super::json_object::{self, Members};
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

/// `body` (a JSON object) without any top-level [`FIELD`] member. Keys are compared after
/// JSON unescaping, as the backend's parser compares them, so `"kv_transfer_param\u0073"` goes too.
fn without_field(body: &[u8]) -> Result<Vec<u8>, Error> {
    let Members(members) = Members::parse(body).map_err(|e| {
        Error::InvalidRequest(format!("the request body must be a JSON object: {e}"))
    })?;
    Ok(json_object::write(
        members
            .iter()
            .filter(|(key, _)| key != FIELD)
            .map(|(key, value)| (key.as_str(), value.get())),
    ))
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
