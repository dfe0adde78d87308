//! Decoding vLLM's KV-event messages (vLLM 0.32's encoding and the older positional one).
//!
//! A message is three ZeroMQ frames: `topic`, `seq` (u64 big-endian) and a msgpack `payload`,
//! the array `[ts, events, data_parallel_rank?]`. Each event is either a map tagged by `"type"`
//! (vLLM 0.32: `BlockStored`, `BlockRemoved`, `AllBlocksCleared`; fields equal to their default
//! are left out, unknown keys are skipped) or, from older versions, a positional array whose
//! first element is the tag. Block hashes are unsigned integers (read as u64; negative ones,
//! from encoders that wrote i64, keep their bits) or raw digest bytes (folded to 64 bits with
//! XXH3, which is all a map key needs).
//!
//! The decoder reads a byte slice in place. Every length it reads is checked against the bytes
//! that remain before anything is allocated (a msgpack element takes at least one byte), nesting
//! is limited to [`MAX_DEPTH`], and strings kept are capped at [`MAX_NAME`] bytes, so a hostile or
//! broken publisher can make a message fail to decode but never make the router allocate more
//! than the size of the message it sent.

use rmp::Marker;
use xxhash_rust::xxh3::xxh3_64;

/// Deepest nesting of arrays and maps skipped or read.
pub const MAX_DEPTH: u32 = 16;
/// Longest LoRA name, medium or extra key kept (longer ones are an error).
pub const MAX_NAME: usize = 512;
/// Extra-key strings kept per block (vLLM puts the cache salt and multimodal hashes there).
pub const MAX_EXTRA: usize = 8;

/// Why a message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("message truncated")]
    Truncated,
    #[error("unexpected msgpack type for {0}")]
    Unexpected(&'static str),
    #[error("nesting deeper than {MAX_DEPTH}")]
    TooDeep,
    #[error("{0} longer than allowed")]
    TooLong(&'static str),
    #[error("expected 2 or 3 frames (topic, seq, payload), got {0}")]
    Frames(usize),
    #[error("sequence frame is not 8 bytes")]
    Seq,
}

/// Where a block lives. vLLM names GPU and CPU tiers; anything else is folded into `Other`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Medium {
    #[default]
    Gpu,
    Cpu,
    Other,
}

impl Medium {
    fn from_name(name: &str) -> Self {
        if name.eq_ignore_ascii_case("gpu") {
            Medium::Gpu
        } else if name.eq_ignore_ascii_case("cpu") {
            Medium::Cpu
        } else {
            Medium::Other
        }
    }

    pub fn index(self) -> usize {
        match self {
            Medium::Gpu => 0,
            Medium::Cpu => 1,
            Medium::Other => 2,
        }
    }
}

/// `BlockStored`: one chain of full blocks.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Stored {
    /// vLLM's hash of each block, in chain order.
    pub block_hashes: Vec<u64>,
    /// vLLM's hash of the block before the first; `None`: the chain starts the prompt.
    pub parent: Option<u64>,
    /// `block_size` token ids per block.
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_name: Option<String>,
    pub medium: Medium,
    /// Per block: the strings among its extra keys (cache salt, multimodal hashes); empty when
    /// the event has none.
    pub extra_keys: Vec<Vec<String>>,
}

/// One cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Stored(Stored),
    Removed {
        block_hashes: Vec<u64>,
        medium: Medium,
    },
    AllCleared,
    /// A tag this decoder does not know (newer vLLM): skipped.
    Unknown,
}

/// One published message.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub seq: u64,
    pub events: Vec<Event>,
    pub dp_rank: Option<u64>,
}

/// The sequence number vLLM's replay socket sends to end a replay (-1 as i64).
pub const END_OF_REPLAY: u64 = u64::MAX;

/// Split a multipart message into (topic, seq, payload). The last two frames are always seq and
/// payload. A live message is `[topic, seq, payload]`; a replay answer, as a DEALER receives it
/// from vLLM 0.32's ROUTER, is `[b"", topic, seq, payload]` (the empty delimiter first; so is
/// the end marker, whose topic frame is empty); `[b"", seq, payload]` and `[seq, payload]` are
/// accepted too.
pub fn split_frames<'a>(frames: &[&'a [u8]]) -> Result<(&'a [u8], u64, &'a [u8]), WireError> {
    let n = frames.len();
    if !(2..=4).contains(&n) || (n == 4 && !frames[0].is_empty()) {
        return Err(WireError::Frames(n));
    }
    let topic = if n >= 3 { frames[n - 3] } else { &[][..] };
    let seq: [u8; 8] = frames[n - 2].try_into().map_err(|_| WireError::Seq)?;
    Ok((topic, u64::from_be_bytes(seq), frames[n - 1]))
}

/// Decode one message's payload.
pub fn decode_payload(seq: u64, payload: &[u8]) -> Result<Batch, WireError> {
    let mut c = Cursor::new(payload);
    let n = c.array_len()?;
    if n < 2 {
        return Err(WireError::Unexpected("payload"));
    }
    c.skip(0)?; // timestamp
    let count = c.array_len()?;
    let mut events = Vec::with_capacity(count);
    for _ in 0..count {
        events.push(c.event()?);
    }
    let mut dp_rank = None;
    for i in 2..n {
        if i == 2 && !c.peek_nil() {
            dp_rank = Some(c.uint("data_parallel_rank")?);
        } else {
            c.skip(0)?;
        }
    }
    Ok(Batch {
        seq,
        events,
        dp_rank,
    })
}

/// A hash read from the wire.
fn hash_of_bytes(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

/// A marker the fast token loop reads: a positive fixint, u8 (`0xcc`), u16 (`0xcd`) or u32
/// (`0xce`).
#[inline(always)]
fn is_token_marker(m: u64) -> bool {
    // `|`, not `||`: no branch on data.
    (m < 0x80) | (m.wrapping_sub(0xcc) < 3)
}

/// Bytes taken by a token id whose marker is `m` (valid for [`is_token_marker`]): 1 for a
/// fixint, else `1 + 2^(m & 3)`, i.e. 2, 3 or 5, computed without a branch or a table load.
#[inline(always)]
fn token_len(m: u64) -> u64 {
    1 + ((m >> 7) << (m & 3))
}

/// The id whose marker is the top byte of `w` (big-endian: the id's bytes follow it).
#[inline(always)]
fn token_value(w: u64, m: u64) -> u32 {
    // Encoding 0 fixint (the marker itself), 1 u8, 2 u16, 3 u32.
    const SHIFT: [u8; 4] = [56, 48, 40, 24];
    const MASK: [u64; 4] = [0xff, 0xff, 0xffff, 0xffff_ffff];
    let kind = ((m >> 7) * ((m & 3) + 1)) as usize & 3;
    ((w >> SHIFT[kind]) & MASK[kind]) as u32
}

/// The id that starts the big-endian word `w`: its top 8 bytes (for [`token_value`]), its
/// marker and its length in bytes (both meaningful only when [`is_token_marker`] holds).
#[inline(always)]
fn token_at(w: u128) -> (u64, u64, u64) {
    let head = (w >> 64) as u64;
    let m = head >> 56;
    (head, m, token_len(m))
}

struct Cursor<'a> {
    buf: &'a [u8],
}

enum Int {
    U(u64),
    I(i64),
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Cursor { buf }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.buf.len() < n {
            return Err(WireError::Truncated);
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    fn be(&mut self, n: usize) -> Result<u64, WireError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    }

    fn marker(&mut self) -> Result<Marker, WireError> {
        let b = *self.buf.first().ok_or(WireError::Truncated)?;
        self.buf = &self.buf[1..];
        Ok(Marker::from_u8(b))
    }

    fn peek_nil(&self) -> bool {
        self.buf.first() == Some(&0xc0)
    }

    /// A length that must fit in what is left, each element taking at least `min` bytes.
    fn bounded(&self, len: u64, min: usize) -> Result<usize, WireError> {
        let len = usize::try_from(len).map_err(|_| WireError::Truncated)?;
        if len.saturating_mul(min) > self.buf.len() {
            return Err(WireError::Truncated);
        }
        Ok(len)
    }

    fn array_len_of(&mut self, m: Marker) -> Result<Option<usize>, WireError> {
        let len = match m {
            Marker::FixArray(n) => u64::from(n),
            Marker::Array16 => self.be(2)?,
            Marker::Array32 => self.be(4)?,
            _ => return Ok(None),
        };
        self.bounded(len, 1).map(Some)
    }

    fn map_len_of(&mut self, m: Marker) -> Result<Option<usize>, WireError> {
        let len = match m {
            Marker::FixMap(n) => u64::from(n),
            Marker::Map16 => self.be(2)?,
            Marker::Map32 => self.be(4)?,
            _ => return Ok(None),
        };
        self.bounded(len, 2).map(Some)
    }

    fn array_len(&mut self) -> Result<usize, WireError> {
        let m = self.marker()?;
        self.array_len_of(m)?.ok_or(WireError::Unexpected("array"))
    }

    fn int_of(&mut self, m: Marker) -> Result<Option<Int>, WireError> {
        Ok(Some(match m {
            Marker::FixPos(n) => Int::U(u64::from(n)),
            Marker::FixNeg(n) => Int::I(i64::from(n)),
            Marker::U8 => Int::U(self.be(1)?),
            Marker::U16 => Int::U(self.be(2)?),
            Marker::U32 => Int::U(self.be(4)?),
            Marker::U64 => Int::U(self.be(8)?),
            Marker::I8 => Int::I(i64::from(self.be(1)? as u8 as i8)),
            Marker::I16 => Int::I(i64::from(self.be(2)? as u16 as i16)),
            Marker::I32 => Int::I(i64::from(self.be(4)? as u32 as i32)),
            Marker::I64 => Int::I(self.be(8)? as i64),
            _ => return Ok(None),
        }))
    }

    fn uint(&mut self, what: &'static str) -> Result<u64, WireError> {
        let m = self.marker()?;
        match self.int_of(m)? {
            Some(Int::U(n)) => Ok(n),
            Some(Int::I(n)) if n >= 0 => Ok(n as u64),
            _ => Err(WireError::Unexpected(what)),
        }
    }

    fn bytes_of(&mut self, m: Marker) -> Result<Option<&'a [u8]>, WireError> {
        let len = match m {
            Marker::FixStr(n) => u64::from(n),
            Marker::Str8 | Marker::Bin8 => self.be(1)?,
            Marker::Str16 | Marker::Bin16 => self.be(2)?,
            Marker::Str32 | Marker::Bin32 => self.be(4)?,
            _ => return Ok(None),
        };
        let len = self.bounded(len, 1)?;
        self.take(len).map(Some)
    }

    fn str_of(&mut self, m: Marker, what: &'static str) -> Result<Option<&'a str>, WireError> {
        if !matches!(
            m,
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32
        ) {
            return Ok(None);
        }
        let bytes = self.bytes_of(m)?.ok_or(WireError::Unexpected(what))?;
        std::str::from_utf8(bytes)
            .map(Some)
            .map_err(|_| WireError::Unexpected(what))
    }

    fn str(&mut self, what: &'static str) -> Result<&'a str, WireError> {
        let m = self.marker()?;
        self.str_of(m, what)?.ok_or(WireError::Unexpected(what))
    }

    /// A string that is kept: nil → `None`, capped length.
    fn name(&mut self, what: &'static str) -> Result<Option<String>, WireError> {
        if self.peek_nil() {
            self.buf = &self.buf[1..];
            return Ok(None);
        }
        let s = self.str(what)?;
        if s.len() > MAX_NAME {
            return Err(WireError::TooLong(what));
        }
        Ok(Some(s.to_owned()))
    }

    fn hash(&mut self) -> Result<u64, WireError> {
        let m = self.marker()?;
        if let Some(int) = self.int_of(m)? {
            return Ok(match int {
                Int::U(n) => n,
                Int::I(n) => n as u64,
            });
        }
        match self.bytes_of(m)? {
            Some(bytes) => Ok(hash_of_bytes(bytes)),
            None => Err(WireError::Unexpected("block hash")),
        }
    }

    fn hashes(&mut self) -> Result<Vec<u64>, WireError> {
        let n = self.array_len()?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.hash()?);
        }
        Ok(out)
    }

    fn tokens(&mut self) -> Result<Vec<u32>, WireError> {
        let n = self.array_len()?;
        let mut out = Vec::with_capacity(n);
        // The hot loop of ingest. Token ids are positive fixints, u8, u16 or u32 (vocabularies
        // are far below 2^32). Read one at a time, the next id's position waits on this id's
        // marker (a load, a length, an add: ~15 cycles an id). So four cases, cheapest first:
        // - a run of eight u16 ids (a 32k vocabulary's text is nearly all u16) is checked and
        //   read at a fixed 3-byte stride, eight independent loads with no chain;
        // - otherwise three ids come from one 16-byte load, the later markers found by
        //   shifting the word, not by loading again; lengths and values are computed without
        //   a branch on the encoding (mixed at random in a 128k vocabulary). Three, not two:
        //   +7 % blocks/s on the 128k stream (medians of 3 interleaved criterion runs);
        // - otherwise two ids from one load, then one id, the same branch-free way.
        //   (Gating the run on its first two markers being u16 cost 27 % on the 128k stream:
        //   a branch on data the predictor cannot learn.)
        // Anything else (and the last few bytes) goes through the general integer reader.
        let mut buf = self.buf;
        let mut left = n;
        while left > 0 {
            if left >= 8 {
                if let Some(run) = buf.first_chunk::<24>() {
                    // One compare of the eight markers gathered into a word: a branch per
                    // marker would be mispredicted on a mixed stream.
                    let markers = u64::from_le_bytes(std::array::from_fn(|k| run[3 * k]));
                    if markers == 0xcdcd_cdcd_cdcd_cdcd {
                        // An array then one copy: `extend` over the map was an out-of-line
                        // call per run (13 % of ingest on the real capture).
                        let ids: [u32; 8] = std::array::from_fn(|k| {
                            u32::from(u16::from_be_bytes([run[3 * k + 1], run[3 * k + 2]]))
                        });
                        out.extend_from_slice(&ids);
                        buf = &buf[24..];
                        left -= 8;
                        continue;
                    }
                }
            }
            if left >= 3 {
                // Three ids from one 16-byte load: each takes at most 5 bytes, so the third
                // marker and its 4 bytes sit inside the word whatever the first two are.
                if let Some(word) = buf.first_chunk::<16>() {
                    let w = u128::from_be_bytes(*word);
                    let (first, m1, l1) = token_at(w);
                    let w = w << (8 * l1);
                    let (second, m2, l2) = token_at(w);
                    let (third, m3, l3) = token_at(w << (8 * l2));
                    if is_token_marker(m1) & is_token_marker(m2) & is_token_marker(m3) {
                        out.extend_from_slice(&[
                            token_value(first, m1),
                            token_value(second, m2),
                            token_value(third, m3),
                        ]);
                        buf = &buf[(l1 + l2 + l3) as usize..];
                        left -= 3;
                        continue;
                    }
                }
            }
            if left >= 2 {
                if let Some(word) = buf.first_chunk::<16>() {
                    let w = u128::from_be_bytes(*word);
                    let (first, m1, l1) = token_at(w);
                    let (second, m2, l2) = token_at(w << (8 * l1));
                    if is_token_marker(m1) & is_token_marker(m2) {
                        out.push(token_value(first, m1));
                        out.push(token_value(second, m2));
                        buf = &buf[(l1 + l2) as usize..];
                        left -= 2;
                        continue;
                    }
                }
            }
            let Some(word) = buf.first_chunk::<8>() else {
                break;
            };
            let w = u64::from_be_bytes(*word);
            let m = w >> 56;
            if !is_token_marker(m) {
                break;
            }
            out.push(token_value(w, m));
            buf = &buf[token_len(m) as usize..];
            left -= 1;
        }
        self.buf = buf;
        for _ in 0..left {
            let id = u32::try_from(self.uint("token id")?)
                .map_err(|_| WireError::Unexpected("token id"))?;
            out.push(id);
        }
        Ok(out)
    }

    fn medium(&mut self) -> Result<Medium, WireError> {
        if self.peek_nil() {
            self.buf = &self.buf[1..];
            return Ok(Medium::Gpu);
        }
        let m = self.str("medium")?;
        if m.len() > MAX_NAME {
            return Err(WireError::TooLong("medium"));
        }
        Ok(Medium::from_name(m))
    }

    /// A map key or tag: a msgpack string, compared as bytes (no UTF-8 check: only known
    /// ASCII names are acted on).
    fn key(&mut self, what: &'static str) -> Result<&'a [u8], WireError> {
        let m = self.marker()?;
        if !matches!(
            m,
            Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32
        ) {
            return Err(WireError::Unexpected(what));
        }
        self.bytes_of(m)?.ok_or(WireError::Unexpected(what))
    }

    /// `extra_keys`: nil, or an array with per block nil or an array of keys. Strings (at any
    /// depth up to the limit) are kept, at most [`MAX_EXTRA`] per block.
    fn extra_keys(&mut self) -> Result<Vec<Vec<String>>, WireError> {
        if self.peek_nil() {
            self.buf = &self.buf[1..];
            return Ok(Vec::new());
        }
        let n = self.array_len()?;
        // vLLM sends one nil per block when there are no keys: allocate only once a block has
        // some.
        let mut out: Vec<Vec<String>> = Vec::new();
        for i in 0..n {
            if self.peek_nil() {
                self.buf = &self.buf[1..];
                continue;
            }
            let mut keys = Vec::new();
            self.collect_strings(1, &mut keys)?;
            if !keys.is_empty() {
                if out.is_empty() {
                    out.reserve_exact(n);
                }
                out.resize_with(i, Vec::new);
                out.push(keys);
            }
        }
        if !out.is_empty() {
            out.resize_with(n, Vec::new);
        }
        Ok(out)
    }

    fn collect_strings(&mut self, depth: u32, out: &mut Vec<String>) -> Result<(), WireError> {
        if depth > MAX_DEPTH {
            return Err(WireError::TooDeep);
        }
        let m = self.marker()?;
        if let Some(s) = self.str_of(m, "extra key")? {
            if s.len() > MAX_NAME || out.len() >= MAX_EXTRA {
                return Err(WireError::TooLong("extra keys"));
            }
            out.push(s.to_owned());
            return Ok(());
        }
        if let Some(n) = self.array_len_of(m)? {
            for _ in 0..n {
                self.collect_strings(depth + 1, out)?;
            }
            return Ok(());
        }
        self.skip_after(m, depth)
    }

    fn skip(&mut self, depth: u32) -> Result<(), WireError> {
        let m = self.marker()?;
        self.skip_after(m, depth)
    }

    fn skip_after(&mut self, m: Marker, depth: u32) -> Result<(), WireError> {
        if depth > MAX_DEPTH {
            return Err(WireError::TooDeep);
        }
        let fixed = match m {
            Marker::Null | Marker::True | Marker::False | Marker::FixPos(_) | Marker::FixNeg(_) => {
                0
            }
            Marker::U8 | Marker::I8 => 1,
            Marker::U16 | Marker::I16 => 2,
            Marker::U32 | Marker::I32 | Marker::F32 => 4,
            Marker::U64 | Marker::I64 | Marker::F64 => 8,
            Marker::FixExt1 => 2,
            Marker::FixExt2 => 3,
            Marker::FixExt4 => 5,
            Marker::FixExt8 => 9,
            Marker::FixExt16 => 17,
            Marker::Ext8 | Marker::Ext16 | Marker::Ext32 => {
                let n = match m {
                    Marker::Ext8 => self.be(1)?,
                    Marker::Ext16 => self.be(2)?,
                    _ => self.be(4)?,
                };
                let n = self.bounded(n, 1)?;
                n.checked_add(1).ok_or(WireError::Truncated)?
            }
            Marker::Reserved => return Err(WireError::Unexpected("reserved marker")),
            _ => {
                if self.bytes_of(m)?.is_some() {
                    return Ok(());
                }
                if let Some(n) = self.array_len_of(m)? {
                    for _ in 0..n {
                        self.skip(depth + 1)?;
                    }
                    return Ok(());
                }
                if let Some(n) = self.map_len_of(m)? {
                    for _ in 0..n {
                        self.skip(depth + 1)?;
                        self.skip(depth + 1)?;
                    }
                    return Ok(());
                }
                return Err(WireError::Unexpected("value"));
            }
        };
        self.take(fixed).map(|_| ())
    }

    fn event(&mut self) -> Result<Event, WireError> {
        let m = self.marker()?;
        if let Some(n) = self.map_len_of(m)? {
            return self.tagged(n);
        }
        if let Some(n) = self.array_len_of(m)? {
            return self.positional(n);
        }
        Err(WireError::Unexpected("event"))
    }

    /// vLLM 0.32: a map with a `"type"` key (first, as msgspec writes it, but any order works).
    fn tagged(&mut self, n: usize) -> Result<Event, WireError> {
        let mut kind: Option<&[u8]> = None;
        let mut stored = Stored::default();
        let mut hashes = Vec::new();
        let mut medium = Medium::Gpu;
        for _ in 0..n {
            let key = self.key("event key")?;
            match key {
                b"type" => kind = Some(self.key("event type")?),
                b"block_hashes" => hashes = self.hashes()?,
                b"parent_block_hash" => {
                    stored.parent = if self.peek_nil() {
                        self.buf = &self.buf[1..];
                        None
                    } else {
                        Some(self.hash()?)
                    }
                }
                b"token_ids" => stored.token_ids = self.tokens()?,
                b"block_size" => {
                    stored.block_size = u32::try_from(self.uint("block_size")?)
                        .map_err(|_| WireError::Unexpected("block_size"))?
                }
                b"lora_name" => stored.lora_name = self.name("lora_name")?,
                b"medium" => medium = self.medium()?,
                b"extra_keys" => stored.extra_keys = self.extra_keys()?,
                _ => self.skip(1)?,
            }
        }
        Ok(match kind {
            Some(b"BlockStored") => {
                stored.block_hashes = hashes;
                stored.medium = medium;
                Event::Stored(stored)
            }
            Some(b"BlockRemoved") => Event::Removed {
                block_hashes: hashes,
                medium,
            },
            Some(b"AllBlocksCleared") => Event::AllCleared,
            Some(_) => Event::Unknown,
            None => return Err(WireError::Unexpected("event without type")),
        })
    }

    /// Older vLLM: `[tag, fields...]` in declaration order, trailing defaults left out.
    /// BlockStored: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
    /// lora_name, extra_keys, ...; BlockRemoved: block_hashes, medium, ...
    fn positional(&mut self, n: usize) -> Result<Event, WireError> {
        if n == 0 {
            return Err(WireError::Unexpected("empty event"));
        }
        let tag = self.str("event type")?;
        let rest = n - 1;
        let event = match tag {
            "BlockStored" => {
                let mut s = Stored::default();
                for i in 0..rest {
                    match i {
                        0 => s.block_hashes = self.hashes()?,
                        1 => {
                            s.parent = if self.peek_nil() {
                                self.buf = &self.buf[1..];
                                None
                            } else {
                                Some(self.hash()?)
                            }
                        }
                        2 => s.token_ids = self.tokens()?,
                        3 => {
                            s.block_size = u32::try_from(self.uint("block_size")?)
                                .map_err(|_| WireError::Unexpected("block_size"))?
                        }
                        5 => s.medium = self.medium()?,
                        6 => s.lora_name = self.name("lora_name")?,
                        7 => s.extra_keys = self.extra_keys()?,
                        _ => self.skip(1)?,
                    }
                }
                Event::Stored(s)
            }
            "BlockRemoved" => {
                let (mut block_hashes, mut medium) = (Vec::new(), Medium::Gpu);
                for i in 0..rest {
                    match i {
                        0 => block_hashes = self.hashes()?,
                        1 => medium = self.medium()?,
                        _ => self.skip(1)?,
                    }
                }
                Event::Removed {
                    block_hashes,
                    medium,
                }
            }
            other => {
                for _ in 0..rest {
                    self.skip(1)?;
                }
                if other == "AllBlocksCleared" {
                    Event::AllCleared
                } else {
                    Event::Unknown
                }
            }
        };
        Ok(event)
    }
}

/// Encoding, for tests, benches and in-test publishers: vLLM 0.32's form.
pub mod encode {
    use super::{Event, Medium, Stored};
    use rmp::encode as e;

    fn medium_name(m: Medium) -> &'static str {
        match m {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Other => "DISK",
        }
    }

    /// `[ts, [events...]]` as vLLM 0.32 writes it (maps tagged by `"type"`).
    pub fn payload(ts: f64, events: &[Event]) -> Vec<u8> {
        let mut out = Vec::new();
        // Writing into a Vec cannot fail.
        let _ = e::write_array_len(&mut out, 2);
        let _ = e::write_f64(&mut out, ts);
        let _ = e::write_array_len(&mut out, events.len() as u32);
        for ev in events {
            match ev {
                Event::Stored(s) => stored(&mut out, s),
                Event::Removed {
                    block_hashes,
                    medium,
                } => {
                    let _ = e::write_map_len(&mut out, 3);
                    let _ = e::write_str(&mut out, "type");
                    let _ = e::write_str(&mut out, "BlockRemoved");
                    let _ = e::write_str(&mut out, "block_hashes");
                    let _ = e::write_array_len(&mut out, block_hashes.len() as u32);
                    for h in block_hashes {
                        let _ = e::write_uint(&mut out, *h);
                    }
                    let _ = e::write_str(&mut out, "medium");
                    let _ = e::write_str(&mut out, medium_name(*medium));
                }
                Event::AllCleared | Event::Unknown => {
                    let _ = e::write_map_len(&mut out, 1);
                    let _ = e::write_str(&mut out, "type");
                    let _ = e::write_str(&mut out, "AllBlocksCleared");
                }
            }
        }
        out
    }

    fn stored(out: &mut Vec<u8>, s: &Stored) {
        let _ = e::write_map_len(out, 7);
        let _ = e::write_str(out, "type");
        let _ = e::write_str(out, "BlockStored");
        let _ = e::write_str(out, "block_hashes");
        let _ = e::write_array_len(out, s.block_hashes.len() as u32);
        for h in &s.block_hashes {
            let _ = e::write_uint(out, *h);
        }
        let _ = e::write_str(out, "parent_block_hash");
        match s.parent {
            Some(p) => {
                let _ = e::write_uint(out, p);
            }
            None => {
                let _ = e::write_nil(out);
            }
        }
        let _ = e::write_str(out, "token_ids");
        let _ = e::write_array_len(out, s.token_ids.len() as u32);
        for t in &s.token_ids {
            let _ = e::write_uint(out, u64::from(*t));
        }
        let _ = e::write_str(out, "block_size");
        let _ = e::write_uint(out, u64::from(s.block_size));
        let _ = e::write_str(out, "medium");
        let _ = e::write_str(out, medium_name(s.medium));
        let _ = e::write_str(out, "lora_name");
        match &s.lora_name {
            Some(n) => {
                let _ = e::write_str(out, n);
            }
            None => {
                let _ = e::write_nil(out);
            }
        }
    }
}

#[cfg(test)]
mod tests;
