//! Log lines formatted by hand, for the one line written per request (the access log).
//!
//! `tracing_subscriber::fmt` builds each line through field visitors, `fmt::Write` calls per
//! piece, ANSI styling and a calendar computation of the timestamp: at tens of thousands of
//! requests a second that was a tenth of the router's CPU (`perf`, see
//! `bench/results/overhead-2026-12-01-fast.md`, "Session 2"). A [`Line`] appends the same layout
//! straight into a byte buffer: integers through `itoa`, durations as milliseconds with three
//! decimals (microsecond resolution) from integer arithmetic, and the timestamp's
//! `YYYY-MM-DDTHH:MM:SS` part cached per thread for the current second.
//!
//! The layouts are those of the subscriber set up by [`super::init_logging`], so access lines
//! and other log lines look alike in one stream:
//!
//! * text: `2026-12-01T18:26:31.484093Z  INFO request key=value …` (ANSI-styled like the
//!   subscriber's when stdout is a terminal); values are written as they are, except control
//!   characters, which are escaped (`\n`, `\u{1b}`) so a value cannot start a line of its own;
//! * JSON: `{"timestamp":"…","level":"INFO","fields":{"message":"request",…},"target":"…"}`.

use std::cell::Cell;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How lines are laid out; set once by [`super::init_logging`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    Text,
    /// Text with the subscriber's ANSI styling (stdout is a terminal).
    TextAnsi,
    Json,
}

static STYLE: AtomicU8 = AtomicU8::new(0);

pub fn set_style(style: Style) {
    let v = match style {
        Style::Text => 0,
        Style::TextAnsi => 1,
        Style::Json => 2,
    };
    STYLE.store(v, Ordering::Relaxed);
}

pub fn style() -> Style {
    match STYLE.load(Ordering::Relaxed) {
        1 => Style::TextAnsi,
        2 => Style::Json,
        _ => Style::Text,
    }
}

/// One line being written into `buf`; [`Line::finish`] ends it with `\n`.
pub struct Line<'a> {
    buf: &'a mut Vec<u8>,
    style: Style,
    target: &'static str,
}

impl<'a> Line<'a> {
    /// Start a line at `level` (`"INFO"`, …) with its message, stamped with the current time.
    pub fn start(
        buf: &'a mut Vec<u8>,
        style: Style,
        level: &'static str,
        target: &'static str,
        message: &str,
    ) -> Self {
        Self::start_at(buf, style, SystemTime::now(), level, target, message)
    }

    fn start_at(
        buf: &'a mut Vec<u8>,
        style: Style,
        at: SystemTime,
        level: &'static str,
        target: &'static str,
        message: &str,
    ) -> Self {
        match style {
            Style::Json => {
                buf.extend_from_slice(b"{\"timestamp\":\"");
                timestamp(buf, at);
                buf.extend_from_slice(b"\",\"level\":\"");
                buf.extend_from_slice(level.as_bytes());
                buf.extend_from_slice(b"\",\"fields\":{\"message\":");
                json_string(buf, message);
            }
            Style::Text | Style::TextAnsi => {
                let ansi = style == Style::TextAnsi;
                if ansi {
                    buf.extend_from_slice(b"\x1b[2m");
                }
                timestamp(buf, at);
                if ansi {
                    buf.extend_from_slice(b"\x1b[0m \x1b[32m");
                } else {
                    buf.push(b' ');
                }
                // The subscriber right-aligns the level in five columns.
                for _ in level.len()..5 {
                    buf.push(b' ');
                }
                buf.extend_from_slice(level.as_bytes());
                if ansi {
                    buf.extend_from_slice(b"\x1b[0m");
                }
                buf.push(b' ');
                text_value(buf, message);
            }
        }
        Line { buf, style, target }
    }

    fn key(&mut self, key: &str) {
        match self.style {
            Style::Json => {
                self.buf.push(b',');
                json_string(self.buf, key);
                self.buf.push(b':');
            }
            Style::Text => {
                self.buf.push(b' ');
                self.buf.extend_from_slice(key.as_bytes());
                self.buf.push(b'=');
            }
            Style::TextAnsi => {
                self.buf.extend_from_slice(b" \x1b[3m");
                self.buf.extend_from_slice(key.as_bytes());
                self.buf.extend_from_slice(b"\x1b[0m\x1b[2m=\x1b[0m");
            }
        }
    }

    pub fn str(&mut self, key: &str, value: &str) -> &mut Self {
        self.key(key);
        match self.style {
            Style::Json => json_string(self.buf, value),
            Style::Text | Style::TextAnsi => text_value(self.buf, value),
        }
        self
    }

    pub fn u64(&mut self, key: &str, value: u64) -> &mut Self {
        self.key(key);
        self.buf
            .extend_from_slice(itoa::Buffer::new().format(value).as_bytes());
        self
    }

    pub fn bool(&mut self, key: &str, value: bool) -> &mut Self {
        self.key(key);
        self.buf
            .extend_from_slice(if value { b"true" } else { b"false" });
        self
    }

    /// A duration in milliseconds with three decimals (`12.345`), a JSON number.
    pub fn millis(&mut self, key: &str, value: Duration) -> &mut Self {
        self.key(key);
        let micros = value.as_micros();
        self.buf
            .extend_from_slice(itoa::Buffer::new().format(micros / 1000).as_bytes());
        self.buf.push(b'.');
        let frac = (micros % 1000) as u16; // < 1000
        self.buf.push(b'0' + (frac / 100) as u8);
        self.buf.push(b'0' + (frac / 10 % 10) as u8);
        self.buf.push(b'0' + (frac % 10) as u8);
        self
    }

    pub fn finish(self) {
        if self.style == Style::Json {
            self.buf.extend_from_slice(b"},\"target\":");
            json_string(self.buf, self.target);
            self.buf.push(b'}');
        }
        self.buf.push(b'\n');
    }
}

thread_local! {
    /// The second last formatted and its `YYYY-MM-DDTHH:MM:SS` text.
    static SECOND: Cell<(u64, [u8; 19])> = const { Cell::new((u64::MAX, [0; 19])) };
}

/// RFC 3339 UTC with microseconds, as the subscriber writes it: `2026-12-01T18:26:31.484093Z`.
fn timestamp(buf: &mut Vec<u8>, at: SystemTime) {
    let since = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (cached, mut text) = SECOND.get();
    if cached != secs {
        text = civil(secs);
        SECOND.set((secs, text));
    }
    buf.extend_from_slice(&text);
    buf.push(b'.');
    let micros = since.subsec_micros(); // < 1_000_000
    let mut digits = [b'0'; 6];
    let mut n = micros;
    for d in digits.iter_mut().rev() {
        *d = b'0' + (n % 10) as u8;
        n /= 10;
    }
    buf.extend_from_slice(&digits);
    buf.push(b'Z');
}

/// `YYYY-MM-DDTHH:MM:SS` of a Unix time (proleptic Gregorian calendar, UTC). The date comes
/// from the day count by the usual era arithmetic (400-year eras of 146,097 days, years
/// starting in March so the leap day is last).
fn civil(secs: u64) -> [u8; 19] {
    let days = secs / 86_400;
    let rem = secs % 86_400;
    let (hour, minute, second) = (rem / 3600, rem / 60 % 60, rem % 60);
    // Days since 0000-03-01; u64 cannot go below the epoch, so no negative eras.
    let z = days.saturating_add(719_468);
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = (yoe + era * 400 + u64::from(month <= 2)).min(9999);
    let mut out = *b"0000-00-00T00:00:00";
    let put = |out: &mut [u8; 19], at: usize, width: usize, mut v: u64| {
        for i in (at..at + width).rev() {
            out[i] = b'0' + (v % 10) as u8;
            v /= 10;
        }
    };
    put(&mut out, 0, 4, year);
    put(&mut out, 5, 2, month);
    put(&mut out, 8, 2, day);
    put(&mut out, 11, 2, hour);
    put(&mut out, 14, 2, minute);
    put(&mut out, 17, 2, second);
    out
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// `s` as a JSON string, quotes included.
fn json_string(buf: &mut Vec<u8>, s: &str) {
    buf.push(b'"');
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0..=0x1f | 0x7f => b"",
            _ => continue,
        };
        buf.extend_from_slice(&bytes[start..i]);
        if escape.is_empty() {
            buf.extend_from_slice(b"\\u00");
            buf.push(HEX[usize::from(b >> 4)]);
            buf.push(HEX[usize::from(b & 0xf)]);
        } else {
            buf.extend_from_slice(escape);
        }
        start = i + 1;
    }
    buf.extend_from_slice(&bytes[start..]);
    buf.push(b'"');
}

/// `s` as it is, control characters escaped (so a value cannot forge a line).
fn text_value(buf: &mut Vec<u8>, s: &str) {
    let bytes = s.as_bytes();
    // Nearly always nothing to escape: one check over the whole value, one copy. A fold
    // without an early exit, so the compiler checks many bytes per instruction (`all`'s
    // early exit kept it to one byte at a time).
    if !bytes
        .iter()
        .fold(false, |bad, &b| bad | (b < 0x20) | (b == 0x7f))
    {
        buf.extend_from_slice(bytes);
        return;
    }
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        if b >= 0x20 && b != 0x7f {
            continue;
        }
        buf.extend_from_slice(&bytes[start..i]);
        match b {
            b'\n' => buf.extend_from_slice(b"\\n"),
            b'\r' => buf.extend_from_slice(b"\\r"),
            b'\t' => buf.extend_from_slice(b"\\t"),
            _ => {
                buf.extend_from_slice(b"\\u{");
                buf.push(HEX[usize::from(b >> 4)]);
                buf.push(HEX[usize::from(b & 0xf)]);
                buf.push(b'}');
            }
        }
        start = i + 1;
    }
    buf.extend_from_slice(&bytes[start..]);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn at(secs: u64, micros: u32) -> SystemTime {
        UNIX_EPOCH + Duration::new(secs, micros * 1000)
    }

    #[test]
    fn calendar_dates_across_leap_years_and_centuries() {
        let cases = [
            (0, "1970-01-01T00:00:00"),
            (951_782_400, "2000-02-29T00:00:00"),
            (951_868_799, "2000-02-29T23:59:59"),
            (951_868_800, "2000-03-01T00:00:00"),
            (1_709_164_800, "2024-02-29T00:00:00"),
            (1_798_675_200, "2026-12-31T00:00:00"),
            (1_798_761_599, "2026-12-31T23:59:59"),
            (4_107_542_400, "2100-03-01T00:00:00"),
            (4_107_456_000, "2100-02-28T00:00:00"),
        ];
        for (secs, want) in cases {
            assert_eq!(std::str::from_utf8(&civil(secs)).unwrap(), want, "{secs}");
        }
    }

    #[test]
    fn json_lines_parse_back_with_every_field() {
        let mut buf = Vec::new();
        let mut line = Line::start_at(
            &mut buf,
            Style::Json,
            at(1_764_613_591, 4_093),
            "INFO",
            "inferlb::access",
            "request",
        );
        line.str("id", "a\"b\\c\n\u{1}é")
            .u64("status", 200)
            .millis("ms", Duration::from_micros(12_045))
            .millis("zero", Duration::ZERO)
            .bool("done", true);
        line.finish();
        assert_eq!(buf.last(), Some(&b'\n'));
        let v: serde_json::Value = serde_json::from_slice(&buf).unwrap();
        assert_eq!(v["timestamp"], "2025-12-01T18:26:31.004093Z");
        assert_eq!(v["level"], "INFO");
        assert_eq!(v["target"], "inferlb::access");
        let f = &v["fields"];
        assert_eq!(f["message"], "request");
        assert_eq!(f["id"], "a\"b\\c\n\u{1}é");
        assert_eq!(f["status"], 200);
        assert_eq!(f["ms"].as_f64().unwrap(), 12.045);
        assert_eq!(f["zero"].as_f64().unwrap(), 0.0);
        assert_eq!(f["done"], true);
    }

    #[test]
    fn text_lines_match_the_subscriber_layout_and_escape_control_characters() {
        let mut buf = Vec::new();
        let mut line = Line::start_at(
            &mut buf,
            Style::Text,
            at(1_764_613_591, 484_093),
            "INFO",
            "inferlb::access",
            "request",
        );
        line.str("request_id", "x\ny")
            .u64("status", 404)
            .millis("duration_ms", Duration::from_micros(1_500_001));
        line.finish();
        assert_eq!(
            std::str::from_utf8(&buf).unwrap(),
            "2025-12-01T18:26:31.484093Z  INFO request request_id=x\\ny status=404 duration_ms=1500.001\n"
        );
        let mut ansi = Vec::new();
        let mut line = Line::start_at(&mut ansi, Style::TextAnsi, at(0, 0), "INFO", "t", "m");
        line.u64("k", 1);
        line.finish();
        assert_eq!(
            std::str::from_utf8(&ansi).unwrap(),
            "\x1b[2m1970-01-01T00:00:00.000000Z\x1b[0m \x1b[32m INFO\x1b[0m m \x1b[3mk\x1b[0m\x1b[2m=\x1b[0m1\n"
        );
    }
}
