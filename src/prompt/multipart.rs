//! `multipart/form-data` bodies (`/v1/audio/transcriptions`, `/v1/audio/translations`): the
//! `model` form field is found by a bounded scan of the body, which is forwarded untouched.
//!
//! A small scanner rather than `multer`: the body is already in memory (read once, bounded by
//! `max_body_bytes`) and only one short field is wanted, where `multer` is a streaming parser
//! that would copy each part into its own buffers and bring its own dependencies (`encoding_rs`,
//! `mime`, `spin`, `httparse`). The scan looks at no more than [`MAX_PARTS`] parts, part heads of
//! at most [`MAX_HEAD`] bytes, and takes a value of at most [`MAX_MODEL`] bytes; part contents
//! (the audio) are skipped with `memchr`'s substring search for the next boundary, never
//! copied. Anything it cannot read leaves the model unknown: the request is then routed to any
//! backend, and the backend judges the body.

use memchr::memmem;

use crate::error::Error;
use crate::prompt::fields::invalid_param;

/// Parts looked at before giving up on finding `model`.
pub const MAX_PARTS: usize = 64;
/// Longest part head (its own headers) read.
pub const MAX_HEAD: usize = 8 * 1024;
/// Longest `model` value taken.
pub const MAX_MODEL: usize = 1024;

/// The boundary of a `multipart/form-data` content type; `Ok(None)` when the body is not
/// multipart form data, an error when it claims to be but names no usable boundary.
pub fn boundary(content_type: Option<&str>) -> Result<Option<&str>, Error> {
    let Some(content_type) = content_type else {
        return Ok(None);
    };
    let mut params = content_type.split(';');
    let essence = params.next().unwrap_or_default().trim();
    if !essence.eq_ignore_ascii_case("multipart/form-data") {
        return Ok(None);
    }
    let boundary = params
        .filter_map(|p| p.split_once('='))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("boundary"))
        .map(|(_, v)| {
            let v = v.trim();
            v.strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .unwrap_or(v)
        });
    match boundary {
        // RFC 2046 §5.1.1: 1 to 70 characters.
        Some(b) if (1..=70).contains(&b.len()) => Ok(Some(b)),
        _ => Err(invalid_param(
            "content-type",
            "a multipart/form-data body needs a boundary of 1 to 70 characters",
        )),
    }
}

/// The form field name of a part head (`Content-Disposition: form-data; name="model"`).
fn field_name(head: &[u8]) -> Option<&[u8]> {
    head.split(|b| *b == b'\n').find_map(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let colon = line.iter().position(|b| *b == b':')?;
        let (name, value) = line.split_at(colon);
        if !name
            .trim_ascii()
            .eq_ignore_ascii_case(b"content-disposition")
        {
            return None;
        }
        value[1..].split(|b| *b == b';').skip(1).find_map(|param| {
            let eq = param.iter().position(|b| *b == b'=')?;
            let (key, v) = param.split_at(eq);
            if !key.trim_ascii().eq_ignore_ascii_case(b"name") {
                return None;
            }
            let v = v[1..].trim_ascii();
            Some(
                v.strip_prefix(b"\"")
                    .and_then(|v| v.strip_suffix(b"\""))
                    .unwrap_or(v),
            )
        })
    })
}

/// The value of the `model` field of a multipart body with `boundary`, when a bounded scan
/// finds it.
pub fn model_field(body: &[u8], boundary: &str) -> Option<String> {
    let mut delimiter = Vec::with_capacity(boundary.len() + 4);
    delimiter.extend_from_slice(b"\r\n--");
    delimiter.extend_from_slice(boundary.as_bytes());
    let next = memmem::Finder::new(&delimiter);
    // The first delimiter may open the body without the CRLF before it.
    let first = &delimiter[2..];
    let mut at = if body.starts_with(first) {
        first.len()
    } else {
        next.find(body)? + delimiter.len()
    };
    for _ in 0..MAX_PARTS {
        let rest = body.get(at..)?;
        // `--` after a delimiter closes the body.
        if rest.starts_with(b"--") {
            return None;
        }
        let rest = rest.strip_prefix(b"\r\n")?;
        let head_len = memmem::find(&rest[..rest.len().min(MAX_HEAD)], b"\r\n\r\n")?;
        let head = &rest[..head_len];
        let content = &rest[head_len + 4..];
        let end = next.find(content)?;
        if field_name(head) == Some(b"model".as_slice()) {
            let value = &content[..end];
            if value.len() > MAX_MODEL {
                return None;
            }
            return std::str::from_utf8(value)
                .ok()
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty());
        }
        // Past this part: its offset within `body`, plus its content and the delimiter.
        at = at
            .checked_add(2 + head_len + 4)?
            .checked_add(end)?
            .checked_add(delimiter.len())?;
    }
    None
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn form(boundary: &str, parts: &[(&str, &[u8])]) -> Vec<u8> {
        let mut out = Vec::new();
        for (head, content) in parts {
            out.extend_from_slice(format!("--{boundary}\r\n{head}\r\n\r\n").as_bytes());
            out.extend_from_slice(content);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
        out
    }

    #[test]
    fn boundary_from_content_type() {
        assert_eq!(boundary(None).unwrap(), None);
        assert_eq!(boundary(Some("application/json")).unwrap(), None);
        assert_eq!(
            boundary(Some("multipart/form-data; boundary=abc")).unwrap(),
            Some("abc")
        );
        assert_eq!(
            boundary(Some("Multipart/Form-Data; charset=utf-8; BOUNDARY=\"a b\"")).unwrap(),
            Some("a b")
        );
        assert!(boundary(Some("multipart/form-data")).is_err());
        assert!(boundary(Some("multipart/form-data; boundary=")).is_err());
        assert!(boundary(Some(&format!(
            "multipart/form-data; boundary={}",
            "x".repeat(71)
        )))
        .is_err());
    }

    #[test]
    fn model_after_a_binary_file_part() {
        let audio: Vec<u8> = (0..=255u8).cycle().take(5000).chain(*b"\r\n--x").collect();
        let body = form(
            "XyZ",
            &[
                (
                    "Content-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav",
                    &audio,
                ),
                ("content-disposition: form-data; name=model", b"whisper-1"),
                ("Content-Disposition: form-data; name=\"language\"", b"en"),
            ],
        );
        assert_eq!(model_field(&body, "XyZ").as_deref(), Some("whisper-1"));
    }

    #[test]
    fn model_not_found_or_unreadable() {
        let filename_only = form(
            "b",
            &[(
                "Content-Disposition: form-data; filename=\"model\"; name=\"file\"",
                b"model",
            )],
        );
        assert_eq!(model_field(&filename_only, "b"), None);
        let long = vec![b'm'; MAX_MODEL + 1];
        let too_long = form(
            "b",
            &[("Content-Disposition: form-data; name=\"model\"", &long)],
        );
        assert_eq!(model_field(&too_long, "b"), None);
        let many: Vec<(&str, &[u8])> = (0..MAX_PARTS)
            .map(|_| {
                (
                    "Content-Disposition: form-data; name=\"x\"",
                    b"1".as_slice(),
                )
            })
            .chain([(
                "Content-Disposition: form-data; name=\"model\"",
                b"m".as_slice(),
            )])
            .collect();
        assert_eq!(model_field(&form("b", &many), "b"), None, "past MAX_PARTS");
        assert_eq!(model_field(b"garbage", "b"), None);
        assert_eq!(model_field(b"--b\r\nno end of head", "b"), None);
        assert_eq!(model_field(b"--b\r\n\r\n\r\nunterminated", "b"), None);
        assert_eq!(model_field(b"--b--\r\n", "b"), None);
        // With a preamble before the first delimiter.
        let mut body = b"preamble".to_vec();
        body.extend_from_slice(b"\r\n");
        body.extend(form(
            "b",
            &[("Content-Disposition: form-data; name=\"model\"", b"m")],
        ));
        assert_eq!(model_field(&body, "b").as_deref(), Some("m"));
    }
}
