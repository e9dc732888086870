//! SPDY/3.1 framing (draft-mbelshe-httpbis-spdy-00 / the SPDY/3.1 draft): the frames that
//! Kubernetes' streaming protocols use, with zlib-compressed header blocks (one zlib context
//! per direction per connection, primed with the SPDY/3 dictionary).
//!
//! Pure codec: no I/O, so both vesseld's streaming server and the critest client use it
//! (a crate of its own, nested in `cri/`). Every length read from the peer is checked;
//! malformed input is an error, never a panic.

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};

/// The SPDY version spoken.
pub const VERSION: u16 = 3;
/// Largest frame payload accepted (the wire allows 16 MiB; nobody sends more than 64 KiB).
pub const MAX_FRAME: usize = 1 << 20;
/// Largest decompressed header block accepted.
pub const MAX_HEADER_BLOCK: usize = 256 << 10;
/// Largest number of header pairs accepted in one block.
const MAX_HEADER_PAIRS: usize = 1024;

pub const FLAG_FIN: u8 = 0x01;
pub const FLAG_UNIDIRECTIONAL: u8 = 0x02;

pub const TYPE_SYN_STREAM: u16 = 1;
pub const TYPE_SYN_REPLY: u16 = 2;
pub const TYPE_RST_STREAM: u16 = 3;
pub const TYPE_SETTINGS: u16 = 4;
pub const TYPE_PING: u16 = 6;
pub const TYPE_GOAWAY: u16 = 7;
pub const TYPE_HEADERS: u16 = 8;
pub const TYPE_WINDOW_UPDATE: u16 = 9;

/// RST_STREAM status codes used here.
pub const RST_PROTOCOL_ERROR: u32 = 1;
pub const RST_REFUSED_STREAM: u32 = 3;
pub const RST_CANCEL: u32 = 5;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SpdyError {
    #[error("SPDY: unsupported version {0} (want 3)")]
    Version(u16),
    #[error("SPDY: frame of {0} bytes exceeds the {MAX_FRAME}-byte limit")]
    TooLarge(usize),
    #[error("SPDY: malformed {what} frame: {why}")]
    Malformed { what: &'static str, why: String },
    #[error("SPDY: header block: {0}")]
    Headers(String),
}

fn malformed(what: &'static str, why: impl Into<String>) -> SpdyError {
    SpdyError::Malformed {
        what,
        why: why.into(),
    }
}

pub type Headers = Vec<(String, String)>;

/// Looks a header up by name (names are lower case on the wire).
pub fn header<'a>(h: &'a Headers, name: &str) -> Option<&'a str> {
    h.iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Data {
        stream_id: u32,
        flags: u8,
        data: Vec<u8>,
    },
    SynStream {
        stream_id: u32,
        associated: u32,
        priority: u8,
        flags: u8,
        headers: Headers,
    },
    SynReply {
        stream_id: u32,
        flags: u8,
        headers: Headers,
    },
    RstStream {
        stream_id: u32,
        status: u32,
    },
    /// Settings are read and ignored (the payload is kept for completeness).
    Settings {
        flags: u8,
        payload: Vec<u8>,
    },
    Ping(u32),
    GoAway {
        last_stream_id: u32,
        status: u32,
    },
    Headers {
        stream_id: u32,
        flags: u8,
        headers: Headers,
    },
    WindowUpdate {
        stream_id: u32,
        delta: u32,
    },
    /// A control frame type this codec does not know; skipped.
    Unknown {
        kind: u16,
    },
}

/// The SPDY/3 header compression dictionary (SPDY/3 draft, section 2.6.10.1): length-prefixed
/// common header names and values, then a run of common strings.
pub fn dictionary() -> Vec<u8> {
    const WORDS: &[&str] = &[
        "options",
        "head",
        "post",
        "put",
        "delete",
        "trace",
        "accept",
        "accept-charset",
        "accept-encoding",
        "accept-language",
        "accept-ranges",
        "age",
        "allow",
        "authorization",
        "cache-control",
        "connection",
        "content-base",
        "content-encoding",
        "content-language",
        "content-length",
        "content-location",
        "content-md5",
        "content-range",
        "content-type",
        "date",
        "etag",
        "expect",
        "expires",
        "from",
        "host",
        "if-match",
        "if-modified-since",
        "if-none-match",
        "if-range",
        "if-unmodified-since",
        "last-modified",
        "location",
        "max-forwards",
        "pragma",
        "proxy-authenticate",
        "proxy-authorization",
        "range",
        "referer",
        "retry-after",
        "server",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "user-agent",
        "vary",
        "via",
        "warning",
        "www-authenticate",
        "method",
        "get",
        "status",
        "200 OK",
        "version",
        "HTTP/1.1",
        "url",
        "public",
        "set-cookie",
        "keep-alive",
        "origin",
    ];
    const TAIL: &str = concat!(
        "100101201202205206300302303304305306307402405406407408409410411412413414415416417502504505",
        "203 Non-Authoritative Information204 No Content301 Moved Permanently400 Bad Request401 Unauthorized",
        "403 Forbidden404 Not Found500 Internal Server Error501 Not Implemented503 Service Unavailable",
        "Jan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec 00:00:00 Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMT",
        "chunked,text/html,image/png,image/jpg,image/gif,application/xml,application/xhtml+xml,text/plain,",
        "text/javascript,publicprivatemax-age=gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0."
    );
    let mut d = Vec::with_capacity(1500);
    for w in WORDS {
        // The words are the short constants above (the longest is 19 bytes).
        #[allow(clippy::cast_possible_truncation)]
        d.extend_from_slice(&(w.len() as u32).to_be_bytes());
        d.extend_from_slice(w.as_bytes());
    }
    d.extend_from_slice(TAIL.as_bytes());
    d
}

/// One connection's two zlib contexts and its frame reader/writer.
pub struct Codec {
    inflate: Decompress,
    deflate: Compress,
    dict: Vec<u8>,
}

impl Default for Codec {
    fn default() -> Self {
        Self::new()
    }
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// `n` as a frame's 24-bit length field, if it fits.
fn len24(n: usize) -> Option<u32> {
    u32::try_from(n).ok().filter(|&n| n <= 0x00ff_ffff)
}

impl Codec {
    pub fn new() -> Codec {
        let dict = dictionary();
        let mut deflate = Compress::new(Compression::default(), true);
        // A fresh zlib stream always accepts a dictionary; an error here would be a zlib bug,
        // and the peer would then fail to inflate our headers (reported there).
        if let Err(e) = deflate.set_dictionary(&dict) {
            tracing::error!(error = %e, "SPDY: cannot set the deflate dictionary");
        }
        Codec {
            inflate: Decompress::new(true),
            deflate,
            dict,
        }
    }

    /// Takes one frame off the front of `buf`, if a whole one is there.
    pub fn decode(&mut self, buf: &mut Vec<u8>) -> Result<Option<Frame>, SpdyError> {
        if buf.len() < 8 {
            return Ok(None);
        }
        let w0 = be32(&buf[0..4]);
        let flags = buf[4];
        let len = (be32(&buf[4..8]) & 0x00ff_ffff) as usize;
        if len > MAX_FRAME {
            return Err(SpdyError::TooLarge(len));
        }
        let control = w0 & 0x8000_0000 != 0;
        if control {
            let version = ((w0 >> 16) & 0x7fff) as u16;
            if version != VERSION {
                return Err(SpdyError::Version(version));
            }
        }
        if buf.len() < 8 + len {
            return Ok(None);
        }
        let payload: Vec<u8> = buf[8..8 + len].to_vec();
        buf.drain(..8 + len);
        if !control {
            return Ok(Some(Frame::Data {
                stream_id: w0 & 0x7fff_ffff,
                flags,
                data: payload,
            }));
        }
        let kind = (w0 & 0xffff) as u16;
        let p = &payload[..];
        let need = |what: &'static str, n: usize| -> Result<(), SpdyError> {
            if p.len() < n {
                Err(malformed(what, format!("{} bytes, need {n}", p.len())))
            } else {
                Ok(())
            }
        };
        Ok(Some(match kind {
            TYPE_SYN_STREAM => {
                need("SYN_STREAM", 10)?;
                Frame::SynStream {
                    stream_id: be32(&p[0..4]) & 0x7fff_ffff,
                    associated: be32(&p[4..8]) & 0x7fff_ffff,
                    priority: p[8] >> 5,
                    flags,
                    headers: self.read_headers(&p[10..])?,
                }
            }
            TYPE_SYN_REPLY => {
                need("SYN_REPLY", 4)?;
                Frame::SynReply {
                    stream_id: be32(&p[0..4]) & 0x7fff_ffff,
                    flags,
                    headers: self.read_headers(&p[4..])?,
                }
            }
            TYPE_HEADERS => {
                need("HEADERS", 4)?;
                Frame::Headers {
                    stream_id: be32(&p[0..4]) & 0x7fff_ffff,
                    flags,
                    headers: self.read_headers(&p[4..])?,
                }
            }
            TYPE_RST_STREAM => {
                need("RST_STREAM", 8)?;
                Frame::RstStream {
                    stream_id: be32(&p[0..4]) & 0x7fff_ffff,
                    status: be32(&p[4..8]),
                }
            }
            TYPE_SETTINGS => Frame::Settings {
                flags,
                payload: payload.clone(),
            },
            TYPE_PING => {
                need("PING", 4)?;
                Frame::Ping(be32(&p[0..4]))
            }
            TYPE_GOAWAY => {
                need("GOAWAY", 4)?;
                Frame::GoAway {
                    last_stream_id: be32(&p[0..4]) & 0x7fff_ffff,
                    status: if p.len() >= 8 { be32(&p[4..8]) } else { 0 },
                }
            }
            TYPE_WINDOW_UPDATE => {
                need("WINDOW_UPDATE", 8)?;
                Frame::WindowUpdate {
                    stream_id: be32(&p[0..4]) & 0x7fff_ffff,
                    delta: be32(&p[4..8]) & 0x7fff_ffff,
                }
            }
            kind => Frame::Unknown { kind },
        }))
    }

    fn inflate(&mut self, block: &[u8]) -> Result<Vec<u8>, SpdyError> {
        let mut out = Vec::with_capacity(block.len() * 4 + 64);
        let mut input = block;
        loop {
            if out.len() >= MAX_HEADER_BLOCK {
                return Err(SpdyError::Headers(format!(
                    "decompressed block exceeds {MAX_HEADER_BLOCK} bytes"
                )));
            }
            out.reserve(4096);
            let before_in = self.inflate.total_in();
            let before_out = out.len();
            match self
                .inflate
                .decompress_vec(input, &mut out, FlushDecompress::Sync)
            {
                Ok(Status::StreamEnd) => break,
                Ok(_) => {}
                Err(e) if e.needs_dictionary().is_some() => {
                    // zlib consumed at most `input.len()` bytes, a usize.
                    #[allow(clippy::cast_possible_truncation)]
                    let consumed = (self.inflate.total_in() - before_in) as usize;
                    input = &input[consumed.min(input.len())..];
                    self.inflate
                        .set_dictionary(&self.dict)
                        .map_err(|e| SpdyError::Headers(format!("dictionary: {e}")))?;
                    continue;
                }
                Err(e) => return Err(SpdyError::Headers(e.to_string())),
            }
            // zlib consumed at most `input.len()` bytes, a usize.
            #[allow(clippy::cast_possible_truncation)]
            let consumed = (self.inflate.total_in() - before_in) as usize;
            input = &input[consumed.min(input.len())..];
            if input.is_empty() && out.len() < out.capacity() {
                break;
            }
            if consumed == 0 && out.len() == before_out {
                break;
            }
        }
        Ok(out)
    }

    fn read_headers(&mut self, block: &[u8]) -> Result<Headers, SpdyError> {
        let raw = self.inflate(block)?;
        let bad = |why: &str| SpdyError::Headers(why.to_string());
        let mut r = &raw[..];
        let mut take = |n: usize| -> Result<&[u8], SpdyError> {
            if r.len() < n {
                return Err(bad("truncated"));
            }
            let (a, b) = r.split_at(n);
            r = b;
            Ok(a)
        };
        let count = be32(take(4)?) as usize;
        if count > MAX_HEADER_PAIRS {
            return Err(bad("too many header pairs"));
        }
        let mut h = Vec::with_capacity(count);
        for _ in 0..count {
            let nl = be32(take(4)?) as usize;
            let name = String::from_utf8_lossy(take(nl)?).to_ascii_lowercase();
            let vl = be32(take(4)?) as usize;
            let value = String::from_utf8_lossy(take(vl)?).into_owned();
            if name.is_empty() {
                return Err(bad("empty header name"));
            }
            // Several values of one name are NUL-separated; keep them as separate pairs.
            for v in value.split('\0') {
                h.push((name.clone(), v.to_string()));
            }
        }
        Ok(h)
    }

    /// The compressed header block for `h`; `None` (logged) when a count or length does not
    /// fit its 32-bit field. Checked before compressing, so the connection's deflate context
    /// stays in step with the peer's.
    fn write_headers(&mut self, h: &Headers) -> Option<Vec<u8>> {
        let len32 = |n: usize| match u32::try_from(n) {
            Ok(n) => Some(n.to_be_bytes()),
            Err(_) => {
                tracing::error!(
                    len = n,
                    "SPDY: header block field over 4 GiB; frame not sent"
                );
                None
            }
        };
        let mut raw = Vec::new();
        raw.extend_from_slice(&len32(h.len())?);
        for (k, v) in h {
            let k = k.to_ascii_lowercase();
            raw.extend_from_slice(&len32(k.len())?);
            raw.extend_from_slice(k.as_bytes());
            raw.extend_from_slice(&len32(v.len())?);
            raw.extend_from_slice(v.as_bytes());
        }
        let mut out = Vec::with_capacity(raw.len() + 64);
        let mut input = &raw[..];
        loop {
            out.reserve(raw.len() + 64);
            let before = self.deflate.total_in();
            if let Err(e) = self
                .deflate
                .compress_vec(input, &mut out, FlushCompress::Sync)
            {
                tracing::error!(error = %e, "SPDY: header compression failed");
                break;
            }
            // zlib consumed at most `input.len()` bytes, a usize.
            #[allow(clippy::cast_possible_truncation)]
            let used = (self.deflate.total_in() - before) as usize;
            input = &input[used.min(input.len())..];
            if input.is_empty() && out.len() < out.capacity() {
                break;
            }
        }
        Some(out)
    }

    /// Appends the wire form of `f` to `out`. A frame whose payload does not fit the 24-bit
    /// length field (16 MiB - 1; callers send data in far smaller chunks) is not written, with
    /// an error logged: writing it would corrupt the connection.
    pub fn encode(&mut self, f: &Frame, out: &mut Vec<u8>) {
        let control = |out: &mut Vec<u8>, kind: u16, flags: u8, payload: &[u8]| {
            let Some(len) = len24(payload.len()) else {
                tracing::error!(
                    kind,
                    len = payload.len(),
                    "SPDY: control frame too large; not sent"
                );
                return;
            };
            out.extend_from_slice(
                &(0x8000_0000u32 | (VERSION as u32) << 16 | kind as u32).to_be_bytes(),
            );
            out.extend_from_slice(&((flags as u32) << 24 | len).to_be_bytes());
            out.extend_from_slice(payload);
        };
        match f {
            Frame::Data {
                stream_id,
                flags,
                data,
            } => {
                let Some(len) = len24(data.len()) else {
                    tracing::error!(len = data.len(), "SPDY: data frame too large; not sent");
                    return;
                };
                out.extend_from_slice(&(stream_id & 0x7fff_ffff).to_be_bytes());
                out.extend_from_slice(&((*flags as u32) << 24 | len).to_be_bytes());
                out.extend_from_slice(data);
            }
            Frame::SynStream {
                stream_id,
                associated,
                priority,
                flags,
                headers,
            } => {
                let mut p = Vec::new();
                p.extend_from_slice(&stream_id.to_be_bytes());
                p.extend_from_slice(&associated.to_be_bytes());
                p.push(priority << 5);
                p.push(0);
                let Some(block) = self.write_headers(headers) else {
                    return;
                };
                p.extend(block);
                control(out, TYPE_SYN_STREAM, *flags, &p);
            }
            // The same layout, two frame types.
            Frame::SynReply {
                stream_id,
                flags,
                headers,
            }
            | Frame::Headers {
                stream_id,
                flags,
                headers,
            } => {
                let ty = if matches!(f, Frame::SynReply { .. }) {
                    TYPE_SYN_REPLY
                } else {
                    TYPE_HEADERS
                };
                let mut p = stream_id.to_be_bytes().to_vec();
                let Some(block) = self.write_headers(headers) else {
                    return;
                };
                p.extend(block);
                control(out, ty, *flags, &p);
            }
            Frame::RstStream { stream_id, status } => {
                let mut p = stream_id.to_be_bytes().to_vec();
                p.extend_from_slice(&status.to_be_bytes());
                control(out, TYPE_RST_STREAM, 0, &p);
            }
            Frame::Settings { flags, payload } => control(out, TYPE_SETTINGS, *flags, payload),
            Frame::Ping(id) => control(out, TYPE_PING, 0, &id.to_be_bytes()),
            Frame::GoAway {
                last_stream_id,
                status,
            } => {
                let mut p = last_stream_id.to_be_bytes().to_vec();
                p.extend_from_slice(&status.to_be_bytes());
                control(out, TYPE_GOAWAY, 0, &p);
            }
            Frame::WindowUpdate { stream_id, delta } => {
                let mut p = stream_id.to_be_bytes().to_vec();
                p.extend_from_slice(&delta.to_be_bytes());
                control(out, TYPE_WINDOW_UPDATE, 0, &p);
            }
            Frame::Unknown { .. } => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(frames: &[Frame]) {
        let mut tx = Codec::new();
        let mut rx = Codec::new();
        let mut wire = Vec::new();
        for f in frames {
            tx.encode(f, &mut wire);
        }
        // Byte by byte: partial frames wait for more.
        let mut buf = Vec::new();
        let mut got = Vec::new();
        for b in wire {
            buf.push(b);
            while let Some(f) = rx.decode(&mut buf).unwrap() {
                got.push(f);
            }
        }
        assert!(buf.is_empty());
        assert_eq!(got, frames);
    }

    #[test]
    fn dictionary_is_the_spdy3_one() {
        let d = dictionary();
        assert_eq!(d.len(), 1423);
        assert!(d.starts_with(b"\0\0\0\x07options\0\0\0\x04head"));
        assert!(d.ends_with(b"utf-,*,enq=0."));
    }

    #[test]
    fn frames_roundtrip_with_shared_compression_context() {
        let h = |v: &str| vec![("streamtype".to_string(), v.to_string())];
        roundtrip(&[
            Frame::SynStream {
                stream_id: 1,
                associated: 0,
                priority: 0,
                flags: 0,
                headers: h("error"),
            },
            Frame::SynStream {
                stream_id: 3,
                associated: 0,
                priority: 0,
                flags: FLAG_FIN,
                headers: vec![
                    ("streamtype".into(), "stdout".into()),
                    ("port".into(), "80".into()),
                ],
            },
            Frame::SynReply {
                stream_id: 1,
                flags: 0,
                headers: vec![],
            },
            Frame::Data {
                stream_id: 3,
                flags: FLAG_FIN,
                data: b"hello".to_vec(),
            },
            Frame::Ping(7),
            Frame::WindowUpdate {
                stream_id: 3,
                delta: 100,
            },
            Frame::RstStream {
                stream_id: 3,
                status: RST_CANCEL,
            },
            Frame::GoAway {
                last_stream_id: 3,
                status: 0,
            },
            Frame::Headers {
                stream_id: 1,
                flags: 0,
                headers: h("x"),
            },
        ]);
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        let mut c = Codec::new();
        // Bad version.
        let mut b = vec![0x80, 2, 0, 1, 0, 0, 0, 0];
        assert_eq!(c.decode(&mut b), Err(SpdyError::Version(2)));
        // Huge length.
        let mut b = vec![0x80, 3, 0, 1, 0, 0xff, 0xff, 0xff];
        assert!(matches!(c.decode(&mut b), Err(SpdyError::TooLarge(_))));
        // Truncated control payloads.
        for kind in [1u8, 2, 3, 6, 7, 8, 9] {
            let mut c = Codec::new();
            let mut b = vec![0x80, 3, 0, kind, 0, 0, 0, 2, 0, 0];
            assert!(c.decode(&mut b).is_err(), "type {kind}");
        }
        // Garbage header block.
        let mut c = Codec::new();
        let mut b = vec![
            0x80, 3, 0, 1, 0, 0, 0, 14, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4,
        ];
        assert!(c.decode(&mut b).is_err());
        // Incomplete: waits.
        let mut c = Codec::new();
        let mut b = vec![0, 0, 0, 1, 0, 0, 0, 9, 1, 2];
        assert_eq!(c.decode(&mut b), Ok(None));
        // Random bytes never panic.
        let mut seed = 0x1234_5678u32;
        for _ in 0..2000 {
            let mut c = Codec::new();
            let n = (seed % 64) as usize;
            let mut b: Vec<u8> = (0..n)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 17;
                    seed ^= seed << 5;
                    // The low byte of the xorshift state.
                    seed.to_le_bytes()[0]
                })
                .collect();
            if n > 1 && seed & 1 == 0 {
                b[0] = 0x80;
                b[1] = 3;
            }
            while let Ok(Some(_)) = c.decode(&mut b) {}
        }
    }

    #[test]
    fn frame_too_large_for_the_length_field_is_not_written() {
        let mut c = Codec::new();
        let mut out = Vec::new();
        let data = vec![0u8; 1 << 24];
        c.encode(
            &Frame::Data {
                stream_id: 1,
                flags: FLAG_FIN,
                data,
            },
            &mut out,
        );
        assert!(out.is_empty());
        assert_eq!(len24(0x00ff_ffff), Some(0x00ff_ffff));
    }

    #[test]
    fn header_block_with_huge_counts_is_refused() {
        // A valid compressed block whose pair count is absurd.
        let mut tx = Codec::new();
        let mut raw = Vec::new();
        raw.extend_from_slice(&u32::MAX.to_be_bytes());
        let mut z = Vec::with_capacity(256);
        tx.deflate
            .compress_vec(&raw, &mut z, FlushCompress::Sync)
            .unwrap();
        let mut p = vec![0, 0, 0, 1];
        p.extend(z);
        let len = u8::try_from(p.len()).expect("a one-byte length");
        let mut b = vec![0x80, 3, 0, 2, 0, 0, 0, len];
        b.extend(p);
        let mut rx = Codec::new();
        assert!(rx.decode(&mut b).is_err());
    }
}
