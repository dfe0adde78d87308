//! A small, zero-copy reader of the Prometheus text exposition format (version 0.0.4).
//!
//! It yields one [`Sample`] per series line — metric name, the raw label block and the value —
//! and skips comments, `# HELP` and `# TYPE` lines. Label values are unescaped only when a
//! caller asks for one. We need a handful of series out of pages of a few hundred lines every
//! 50 ms per backend, so the reader borrows from the page and allocates nothing per line.

use std::borrow::Cow;

/// A line that does not follow the exposition format.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {reason}")]
pub struct ParseError {
    pub line: usize,
    pub reason: &'static str,
}

/// One series value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    /// The text between `{` and `}`, still escaped; empty when the series has no labels.
    labels: &'a str,
    pub value: f64,
}

impl<'a> Sample<'a> {
    /// The value of label `key`, unescaped.
    pub fn label(&self, key: &str) -> Option<Cow<'a, str>> {
        self.labels().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// All labels in order.
    pub fn labels(&self) -> impl Iterator<Item = (&'a str, Cow<'a, str>)> {
        LabelIter { rest: self.labels }
    }
}

struct LabelIter<'a> {
    rest: &'a str,
}

impl<'a> Iterator for LabelIter<'a> {
    type Item = (&'a str, Cow<'a, str>);

    fn next(&mut self) -> Option<Self::Item> {
        let rest = self.rest.trim_start_matches([',', ' ', '\t']);
        let eq = rest.find('=')?;
        let key = rest[..eq].trim();
        let after = rest[eq + 1..].trim_start();
        let body = after.strip_prefix('"')?;
        let end = closing_quote(body)?;
        let raw = &body[..end];
        self.rest = &body[end + 1..];
        let value = if raw.contains('\\') {
            Cow::Owned(unescape(raw))
        } else {
            Cow::Borrowed(raw)
        };
        Some((key, value))
    }
}

/// Index of the first unescaped `"` in `s`.
fn closing_quote(s: &str) -> Option<usize> {
    let bytes = s.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'"' => return Some(i),
            _ => i += 1,
        }
    }
    None
}

fn unescape(raw: &str) -> String {
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some('n') => out.push('\n'),
                Some(other) => out.push(other),
                None => out.push('\\'),
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn parse_value(token: &str) -> Option<f64> {
    match token {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => token.parse().ok(),
    }
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

fn parse_line(line: &str, number: usize) -> Result<Sample<'_>, ParseError> {
    let err = |reason| ParseError {
        line: number,
        reason,
    };
    let name_end = line.find(|c: char| !is_name_char(c)).unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        return Err(err("expected a metric name"));
    }
    let mut rest = &line[name_end..];
    let mut labels = "";
    if let Some(inner) = rest.strip_prefix('{') {
        // Find the closing brace outside quoted label values.
        let bytes = inner.as_bytes();
        let mut i = 0;
        let mut close = None;
        while i < bytes.len() {
            match bytes[i] {
                b'"' => {
                    let end =
                        closing_quote(&inner[i + 1..]).ok_or(err("unterminated label value"))?;
                    i += end + 2;
                }
                b'}' => {
                    close = Some(i);
                    break;
                }
                _ => i += 1,
            }
        }
        let close = close.ok_or(err("missing `}`"))?;
        labels = &inner[..close];
        rest = &inner[close + 1..];
    }
    let mut tokens = rest.split_ascii_whitespace();
    let value = tokens.next().ok_or(err("missing value"))?;
    let value = parse_value(value).ok_or(err("value is not a number"))?;
    if let Some(ts) = tokens.next() {
        ts.parse::<i64>()
            .map_err(|_| err("timestamp is not an integer"))?;
    }
    if tokens.next().is_some() {
        return Err(err("trailing text after timestamp"));
    }
    Ok(Sample {
        name,
        labels,
        value,
    })
}

/// Every sample of a page, in order; a malformed line yields an error and reading goes on.
pub fn samples(page: &str) -> impl Iterator<Item = Result<Sample<'_>, ParseError>> {
    page.lines().enumerate().filter_map(|(i, line)| {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            None
        } else {
            Some(parse_line(line, i + 1))
        }
    })
}

/// The samples of the series `wanted` accepts by name. After `# TYPE family …` for a family
/// nobody wants, the reader jumps straight to the next comment line with one vectorised search
/// — on a vLLM page most lines are histogram buckets nobody here reads. Other lines are skipped
/// after reading only their name, but a line that does not even start with a metric name is
/// still an error, so a page of HTML or binary garbage is rejected as with [`samples`].
pub fn samples_where<'a, F: Fn(&str) -> bool>(page: &'a str, wanted: F) -> SamplesWhere<'a, F> {
    SamplesWhere {
        page,
        pos: 0,
        wanted,
    }
}

/// The iterator of [`samples_where`].
pub struct SamplesWhere<'a, F> {
    page: &'a str,
    pos: usize,
    wanted: F,
}

impl<'a, F> SamplesWhere<'a, F> {
    /// 1-based number of the line starting at byte `at` (counted only for errors).
    fn line_number(&self, at: usize) -> usize {
        memchr::memchr_iter(b'\n', &self.page.as_bytes()[..at]).count() + 1
    }

    /// Move to the start of the next line that begins with `#` (or the end of the page).
    fn skip_to_comment(&mut self) {
        let from = self.pos.saturating_sub(1);
        self.pos = memchr::memmem::find(&self.page.as_bytes()[from..], b"\n#")
            .map_or(self.page.len(), |i| from + i + 1);
    }
}

impl<'a, F: Fn(&str) -> bool> Iterator for SamplesWhere<'a, F> {
    type Item = Result<Sample<'a>, ParseError>;

    fn next(&mut self) -> Option<Self::Item> {
        while self.pos < self.page.len() {
            let start = self.pos;
            let rest = &self.page[start..];
            let len = memchr::memchr(b'\n', rest.as_bytes()).unwrap_or(rest.len());
            self.pos = start + len + 1;
            let line = rest[..len].strip_suffix('\r').unwrap_or(&rest[..len]);
            if let Some(comment) = line.strip_prefix('#') {
                if let Some(family) = comment
                    .strip_prefix(" TYPE ")
                    .and_then(|r| r.split_ascii_whitespace().next())
                {
                    if !((self.wanted)(family) || family_has_wanted_total(family, &self.wanted)) {
                        self.skip_to_comment();
                    }
                }
                continue;
            }
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let name_end = line
                .bytes()
                .position(|b| !(b.is_ascii_alphanumeric() || b == b'_' || b == b':'))
                .unwrap_or(line.len());
            // Name bytes are ASCII, so `name_end` is a char boundary.
            let name = &line[..name_end];
            if name.is_empty() || name.as_bytes()[0].is_ascii_digit() {
                return Some(Err(ParseError {
                    line: self.line_number(start),
                    reason: "expected a metric name",
                }));
            }
            if (self.wanted)(name) {
                return Some(parse_line(line, 0).map_err(|e| ParseError {
                    line: self.line_number(start),
                    ..e
                }));
            }
        }
        None
    }
}

/// A counter family `x` is exposed as `x_total`: the family is wanted when that series is.
fn family_has_wanted_total(family: &str, wanted: &impl Fn(&str) -> bool) -> bool {
    let mut name = String::with_capacity(family.len() + 6);
    name.push_str(family);
    name.push_str("_total");
    wanted(&name)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn samples_where_skips_unwanted_but_rejects_garbage() {
        let page = "a 1\nb{x=\"1\"} 2\nc{broken 3\n";
        let got: Vec<_> = samples_where(page, |n| n == "b").collect();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].as_ref().unwrap().value, 2.0);
        let bad: Vec<_> = samples_where("<html>\n", |_| false).collect();
        assert!(bad[0].is_err());
        let real: Vec<_> = samples_where(REAL, |n| n == "vllm:num_requests_running").collect();
        assert_eq!(real.len(), 1);
        // Counter families are announced without `_total`; their series must still be found.
        let hits: Vec<_> = samples_where(REAL, |n| n == "vllm:prefix_cache_hits_total").collect();
        assert_eq!(hits.len(), 1);
        assert_eq!(hits[0].as_ref().unwrap().value, 768.0);
        let skipped = "# TYPE h histogram\nh_bucket{le=\"1\"} 1\nh_sum 2\n# TYPE g gauge\ng 5\n";
        let got: Vec<_> = samples_where(skipped, |n| n == "g")
            .map(|s| s.unwrap().value)
            .collect();
        assert_eq!(got, vec![5.0]);
        // Errors name their line; CRLF pages read like LF ones.
        let page =
            "# TYPE h histogram\r\nh_bucket 1\r\nh_sum 2\r\n# TYPE g gauge\r\ng 5\r\nbad{ 1\r\n";
        let got: Vec<_> = samples_where(page, |n| n == "g" || n == "bad").collect();
        assert_eq!(got[0].as_ref().unwrap().value, 5.0);
        assert_eq!(got[1].as_ref().unwrap_err().line, 6);
        assert_eq!(got.len(), 2);
    }

    const REAL: &str = include_str!("../../tests/fixtures/vllm-0.32-cpu.txt");

    #[test]
    fn parses_every_line_of_real_vllm_page() {
        let all: Vec<_> = samples(REAL).collect();
        assert!(all.len() > 300);
        for s in &all {
            assert!(s.is_ok(), "{s:?}");
        }
        let waiting = all
            .iter()
            .flatten()
            .find(|s| s.name == "vllm:num_requests_waiting")
            .unwrap();
        assert_eq!(waiting.label("engine").as_deref(), Some("0"));
        assert!(waiting.label("model_name").is_some());
    }

    #[test]
    fn labels_with_escapes_and_commas() {
        let s = parse_line(r#"m{a="x,y",b="q\"uo\\te\n",c=""} 1.5 1700000000"#, 1).unwrap();
        assert_eq!(s.name, "m");
        assert_eq!(s.value, 1.5);
        assert_eq!(s.label("a").as_deref(), Some("x,y"));
        assert_eq!(s.label("b").as_deref(), Some("q\"uo\\te\n"));
        assert_eq!(s.label("c").as_deref(), Some(""));
        assert_eq!(s.label("d"), None);
    }

    #[test]
    fn special_values() {
        assert!(parse_line("m NaN", 1).unwrap().value.is_nan());
        assert_eq!(parse_line("m +Inf", 1).unwrap().value, f64::INFINITY);
        assert_eq!(parse_line("m -Inf", 1).unwrap().value, f64::NEG_INFINITY);
        assert_eq!(parse_line("m 1e3", 1).unwrap().value, 1000.0);
        assert_eq!(
            parse_line("m{le=\"+Inf\"} 4", 1)
                .unwrap()
                .label("le")
                .as_deref(),
            Some("+Inf")
        );
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let cases = [
            "{a=\"b\"} 1",
            "m{a=\"b} 1",
            "m{a=\"b\" 1",
            "m",
            "m abc",
            "m 1 notatime",
            "m 1 2 3",
            "1abc 2",
            "m{a=\"\\",
            "\u{0}\u{ff}",
        ];
        for case in cases {
            assert!(parse_line(case, 7).is_err(), "{case:?}");
        }
        let page = "# HELP x\nok 1\nbroken{\nok2 2\n";
        let results: Vec<_> = samples(page).collect();
        assert_eq!(results.len(), 3);
        assert!(results[0].is_ok() && results[1].is_err() && results[2].is_ok());
        assert_eq!(results[1].as_ref().unwrap_err().line, 3);
    }

    #[test]
    fn comments_and_blank_lines_are_skipped() {
        assert_eq!(samples("\n# TYPE m gauge\n   \n").count(), 0);
    }
}
