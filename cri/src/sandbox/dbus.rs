//! A small D-Bus client: what the systemd cgroup driver needs and no more.
//!
//! It speaks the D-Bus wire protocol (SASL `EXTERNAL` authentication, then little-endian
//! messages) over a Unix socket, either systemd's private socket (a direct connection to the
//! manager, as `systemctl` uses as root) or the system bus (with its `Hello`). Calls are
//! synchronous on one connection; replies are matched by serial, and anything else that
//! arrives (signals) is skipped. Values are marshalled by [`Writer`] and read back by
//! [`Reader`], following the specification's alignment rules, for the types systemd's
//! `StartTransientUnit`, `StopUnit` and `ListUnitsByPatterns` take and give.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// Largest message accepted (the specification's limit is 128 MiB; systemd's replies here
/// are small).
const MAX_MESSAGE: usize = 64 << 20;

#[derive(Debug, thiserror::Error)]
pub enum DbusError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("authentication refused: {0}")]
    Auth(String),
    #[error("{name}: {message}")]
    Remote { name: String, message: String },
    #[error("malformed message: {0}")]
    Malformed(&'static str),
}

impl DbusError {
    /// The D-Bus error name of a remote error (`org.freedesktop.systemd1.NoSuchUnit`).
    pub fn name(&self) -> Option<&str> {
        match self {
            DbusError::Remote { name, .. } => Some(name),
            _ => None,
        }
    }
}

/// Builds a message body (or header), aligning each value as the specification says.
#[derive(Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    fn pad(&mut self, align: usize) {
        while !self.buf.len().is_multiple_of(align) {
            self.buf.push(0);
        }
    }
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub fn u32(&mut self, v: u32) {
        self.pad(4);
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn boolean(&mut self, v: bool) {
        self.u32(u32::from(v));
    }
    /// A string or an object path.
    pub fn str(&mut self, s: &str) {
        self.u32(u32::try_from(s.len()).unwrap_or(u32::MAX));
        self.buf.extend_from_slice(s.as_bytes());
        self.buf.push(0);
    }
    pub fn signature(&mut self, s: &str) {
        self.buf.push(u8::try_from(s.len()).unwrap_or(u8::MAX));
        self.buf.extend_from_slice(s.as_bytes());
        self.buf.push(0);
    }
    /// An array whose elements align to `align` (8 for structs), written by `f`.
    pub fn array(&mut self, align: usize, f: impl FnOnce(&mut Writer)) {
        self.pad(4);
        let at = self.buf.len();
        self.buf.extend_from_slice(&[0; 4]);
        self.pad(align);
        let start = self.buf.len();
        f(self);
        let n = u32::try_from(self.buf.len() - start).unwrap_or(u32::MAX);
        self.buf[at..at + 4].copy_from_slice(&n.to_le_bytes());
    }
    /// The start of a struct (or dict entry).
    pub fn structure(&mut self) {
        self.pad(8);
    }
    /// A variant holding `value`.
    pub fn variant(&mut self, value: &Value) {
        self.signature(value.signature());
        match value {
            Value::Str(s) => self.str(s),
            Value::Bool(b) => self.boolean(*b),
            Value::U32s(v) => self.array(4, |w| v.iter().for_each(|x| w.u32(*x))),
        }
    }
}

/// A property value (the `v` of `a(sv)`), of the types vessel sets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    Str(String),
    Bool(bool),
    U32s(Vec<u32>),
}

impl Value {
    fn signature(&self) -> &'static str {
        match self {
            Value::Str(_) => "s",
            Value::Bool(_) => "b",
            Value::U32s(_) => "au",
        }
    }
}

/// Reads values of a message (body or header) of either byte order.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    big_endian: bool,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], big_endian: bool) -> Reader<'a> {
        Reader {
            buf,
            pos: 0,
            big_endian,
        }
    }
    fn align(&mut self, a: usize) -> Result<(), DbusError> {
        let p = self.pos.div_ceil(a) * a;
        if p > self.buf.len() {
            return Err(DbusError::Malformed("padding past the end"));
        }
        self.pos = p;
        Ok(())
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], DbusError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or(DbusError::Malformed("value past the end"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    pub fn u8(&mut self) -> Result<u8, DbusError> {
        Ok(self.take(1)?[0])
    }
    pub fn u32(&mut self) -> Result<u32, DbusError> {
        self.align(4)?;
        let b: [u8; 4] = self
            .take(4)?
            .try_into()
            .map_err(|_| DbusError::Malformed("u32"))?;
        Ok(if self.big_endian {
            u32::from_be_bytes(b)
        } else {
            u32::from_le_bytes(b)
        })
    }
    /// A string or an object path.
    pub fn str(&mut self) -> Result<String, DbusError> {
        let n = self.u32()? as usize;
        self.text(n)
    }
    pub fn signature(&mut self) -> Result<String, DbusError> {
        let n = self.u8()? as usize;
        self.text(n)
    }
    /// `n` bytes of UTF-8 and their terminating NUL.
    fn text(&mut self, n: usize) -> Result<String, DbusError> {
        let s = self.take(n)?;
        if self.take(1)? != [0] {
            return Err(DbusError::Malformed("text without its NUL"));
        }
        String::from_utf8(s.to_vec()).map_err(|_| DbusError::Malformed("text not UTF-8"))
    }
    /// Reads an array whose elements align to `align`, calling `f` for each element.
    pub fn array(
        &mut self,
        align: usize,
        mut f: impl FnMut(&mut Reader<'a>) -> Result<(), DbusError>,
    ) -> Result<(), DbusError> {
        let n = self.u32()? as usize;
        self.align(align)?;
        let end = self
            .pos
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or(DbusError::Malformed("array past the end"))?;
        while self.pos < end {
            f(self)?;
        }
        if self.pos != end {
            return Err(DbusError::Malformed("array element past the array"));
        }
        Ok(())
    }
    pub fn structure(&mut self) -> Result<(), DbusError> {
        self.align(8)
    }
    /// Skips one value of single complete type `sig` (header fields of types we ignore).
    fn skip(&mut self, sig: &str) -> Result<(), DbusError> {
        match sig {
            "s" | "o" => self.str().map(drop),
            "g" => self.signature().map(drop),
            "u" | "i" | "b" => self.u32().map(drop),
            "y" => self.u8().map(drop),
            _ => Err(DbusError::Malformed("header field of an unexpected type")),
        }
    }
}

/// A received message: its type, serials, error name, signature and body.
#[derive(Debug)]
struct Message {
    kind: u8,
    reply_serial: Option<u32>,
    error_name: Option<String>,
    signature: String,
    big_endian: bool,
    body: Vec<u8>,
}

const METHOD_CALL: u8 = 1;
const METHOD_RETURN: u8 = 2;
const ERROR: u8 = 3;

/// One D-Bus connection.
pub struct Connection {
    stream: BufReader<UnixStream>,
    serial: u32,
}

impl Connection {
    /// Connects to the socket at `path` and authenticates as this process's uid; `bus`:
    /// it is a message bus (say `Hello` to it).
    pub fn connect(path: &Path, bus: bool, timeout: Duration) -> Result<Connection, DbusError> {
        let s = UnixStream::connect(path)?;
        s.set_read_timeout(Some(timeout))?;
        s.set_write_timeout(Some(timeout))?;
        let mut c = Connection {
            stream: BufReader::new(s),
            serial: 0,
        };
        // SAFETY: geteuid(2) has no preconditions.
        let uid = unsafe { libc::geteuid() }.to_string();
        let hex: String = uid.bytes().map(|b| format!("{b:02x}")).collect();
        // AUTH and BEGIN in one write, as sd-bus's own clients send them: systemd's private
        // socket drops a first message that arrives in the same read as a separate BEGIN.
        c.stream
            .get_mut()
            .write_all(format!("\0AUTH EXTERNAL {hex}\r\nBEGIN\r\n").as_bytes())?;
        let mut line = String::new();
        c.stream.read_line(&mut line)?;
        if !line.starts_with("OK ") {
            return Err(DbusError::Auth(line.trim().to_string()));
        }
        if bus {
            c.call(
                "org.freedesktop.DBus",
                "/org/freedesktop/DBus",
                "org.freedesktop.DBus",
                "Hello",
                "",
                &[],
            )?;
        }
        Ok(c)
    }

    /// Calls `member` and returns the reply's signature and body (little or big endian, as
    /// the flag says), or the remote error.
    pub fn call(
        &mut self,
        destination: &str,
        path: &str,
        interface: &str,
        member: &str,
        signature: &str,
        body: &[u8],
    ) -> Result<(String, Vec<u8>, bool), DbusError> {
        self.serial = self.serial.wrapping_add(1).max(1);
        let serial = self.serial;
        let mut h = Writer::default();
        h.buf.extend_from_slice(&[b'l', METHOD_CALL, 0, 1]);
        h.u32(u32::try_from(body.len()).map_err(|_| DbusError::Malformed("body too large"))?);
        h.u32(serial);
        h.array(8, |w| {
            let mut field = |code: u8, sig: &str, f: &dyn Fn(&mut Writer)| {
                w.structure();
                w.u8(code);
                w.signature(sig);
                f(w);
            };
            field(1, "o", &|w| w.str(path));
            field(2, "s", &|w| w.str(interface));
            field(3, "s", &|w| w.str(member));
            field(6, "s", &|w| w.str(destination));
            if !signature.is_empty() {
                field(8, "g", &|w| w.signature(signature));
            }
        });
        h.pad(8);
        h.buf.extend_from_slice(body);
        self.stream.get_mut().write_all(&h.buf)?;
        loop {
            let m = self.read_message()?;
            if m.reply_serial != Some(serial) {
                continue; // a signal, or a reply to nothing of ours
            }
            return match m.kind {
                METHOD_RETURN => Ok((m.signature, m.body, m.big_endian)),
                ERROR => {
                    let message = if m.signature.starts_with('s') {
                        Reader::new(&m.body, m.big_endian).str().unwrap_or_default()
                    } else {
                        String::new()
                    };
                    Err(DbusError::Remote {
                        name: m.error_name.unwrap_or_default(),
                        message,
                    })
                }
                _ => Err(DbusError::Malformed(
                    "a reply that is neither return nor error",
                )),
            };
        }
    }

    fn read_message(&mut self) -> Result<Message, DbusError> {
        let mut fixed = [0u8; 16];
        self.stream.read_exact(&mut fixed)?;
        let big_endian = match fixed[0] {
            b'l' => false,
            b'B' => true,
            _ => return Err(DbusError::Malformed("unknown byte order")),
        };
        let mut r = Reader::new(&fixed, big_endian);
        r.pos = 4;
        let body_len = r.u32()? as usize;
        let _serial = r.u32()?;
        let fields_len = r.u32()? as usize;
        let header_end = (16 + fields_len).div_ceil(8) * 8;
        let total = header_end
            .checked_add(body_len)
            .filter(|t| *t <= MAX_MESSAGE)
            .ok_or(DbusError::Malformed("message too large"))?;
        let mut buf = vec![0u8; total];
        buf[..16].copy_from_slice(&fixed);
        self.stream.read_exact(&mut buf[16..])?;
        let mut m = Message {
            kind: fixed[1],
            reply_serial: None,
            error_name: None,
            signature: String::new(),
            big_endian,
            body: buf[header_end..].to_vec(),
        };
        let mut r = Reader::new(&buf[..header_end], big_endian);
        r.pos = 12;
        r.array(8, |r| {
            r.structure()?;
            let code = r.u8()?;
            let sig = r.signature()?;
            match (code, sig.as_str()) {
                (4, "s") => m.error_name = Some(r.str()?),
                (5, "u") => m.reply_serial = Some(r.u32()?),
                (8, "g") => m.signature = r.signature()?,
                (_, s) => r.skip(s)?,
            }
            Ok(())
        })?;
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_align_and_read_back() {
        let mut w = Writer::default();
        w.str("unit.scope");
        w.array(8, |w| {
            for (k, v) in [
                ("Slice", Value::Str("a.slice".into())),
                ("Delegate", Value::Bool(true)),
                ("PIDs", Value::U32s(vec![7, 9])),
            ] {
                w.structure();
                w.str(k);
                w.variant(&v);
            }
        });
        // The string: 4 + 10 + 1 bytes; the array length at 16 (aligned to 4), its first
        // struct at 24 (aligned to 8).
        assert_eq!(&w.buf[..4], &10u32.to_le_bytes());
        assert_eq!(
            &w.buf[16..20],
            &u32::try_from(w.buf.len() - 24).unwrap().to_le_bytes()
        );
        let mut r = Reader::new(&w.buf, false);
        assert_eq!(r.str().unwrap(), "unit.scope");
        let mut got = Vec::new();
        r.array(8, |r| {
            r.structure()?;
            let k = r.str()?;
            let sig = r.signature()?;
            let v = match sig.as_str() {
                "s" => Value::Str(r.str()?),
                "b" => Value::Bool(r.u32()? != 0),
                "au" => {
                    let mut v = Vec::new();
                    r.array(4, |r| {
                        v.push(r.u32()?);
                        Ok(())
                    })?;
                    Value::U32s(v)
                }
                _ => panic!("{sig}"),
            };
            got.push((k, v));
            Ok(())
        })
        .unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(got[2], ("PIDs".to_string(), Value::U32s(vec![7, 9])));
    }

    #[test]
    fn truncated_input_is_an_error_not_a_panic() {
        let mut w = Writer::default();
        w.str("abcdef");
        w.array(8, |w| {
            w.structure();
            w.str("x");
        });
        for n in 0..w.buf.len() {
            let mut r = Reader::new(&w.buf[..n], false);
            let res = r.str().and_then(|_| {
                r.array(8, |r| {
                    r.structure()?;
                    r.str().map(drop)
                })
            });
            assert!(res.is_err(), "{n}");
        }
    }

    /// A peer that answers one call the way systemd's private socket does (sender
    /// `org.freedesktop.systemd1`, not a unique name) with an error, then a return.
    #[test]
    fn calls_match_replies_and_errors_by_serial() {
        let (_d, path) = crate::testing::temp_path("bus");
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut s = BufReader::new(s);
            let mut line = Vec::new();
            s.read_until(b'\n', &mut line).unwrap();
            assert!(line.starts_with(b"\0AUTH EXTERNAL "), "{line:?}");
            s.get_mut().write_all(b"OK 0123456789abcdef\r\n").unwrap();
            line.clear();
            s.read_until(b'\n', &mut line).unwrap();
            assert_eq!(line, b"BEGIN\r\n");
            let reply = |kind: u8, serial: u32, fields: &dyn Fn(&mut Writer), body: &[u8]| {
                let mut h = Writer::default();
                h.buf.extend_from_slice(&[b'l', kind, 0, 1]);
                h.u32(u32::try_from(body.len()).unwrap());
                h.u32(100 + serial);
                h.array(8, |w| {
                    w.structure();
                    w.u8(7);
                    w.signature("s");
                    w.str("org.freedesktop.systemd1");
                    w.structure();
                    w.u8(5);
                    w.signature("u");
                    w.u32(serial);
                    fields(w);
                });
                h.pad(8);
                h.buf.extend_from_slice(body);
                h.buf
            };
            let mut c = Connection {
                stream: s,
                serial: 0,
            };
            for serial in 1..=2u32 {
                let m = c.read_message().unwrap();
                assert_eq!(m.kind, METHOD_CALL);
                let mut body = Writer::default();
                let msg = if serial == 1 {
                    body.str("Unit vessel-x.scope not loaded.");
                    reply(
                        ERROR,
                        serial,
                        &|w| {
                            w.structure();
                            w.u8(4);
                            w.signature("s");
                            w.str("org.freedesktop.systemd1.NoSuchUnit");
                            w.structure();
                            w.u8(8);
                            w.signature("g");
                            w.signature("s");
                        },
                        &body.buf,
                    )
                } else {
                    // A signal first, then the reply.
                    let mut sig = reply(4, 99, &|_| {}, &[]);
                    body.str("/org/freedesktop/systemd1/job/7");
                    sig.extend(reply(
                        METHOD_RETURN,
                        serial,
                        &|w| {
                            w.structure();
                            w.u8(8);
                            w.signature("g");
                            w.signature("o");
                        },
                        &body.buf,
                    ));
                    sig
                };
                c.stream.get_mut().write_all(&msg).unwrap();
            }
        });
        let mut c = Connection::connect(&path, false, Duration::from_secs(5)).unwrap();
        let mut body = Writer::default();
        body.str("vessel-x.scope");
        body.str("replace");
        let e = c
            .call("d", "/p", "i", "StopUnit", "ss", &body.buf)
            .unwrap_err();
        assert_eq!(e.name(), Some("org.freedesktop.systemd1.NoSuchUnit"));
        assert!(e.to_string().contains("not loaded"), "{e}");
        let (sig, body, be) = c.call("d", "/p", "i", "StopUnit", "ss", &body.buf).unwrap();
        assert_eq!(sig, "o");
        assert_eq!(
            Reader::new(&body, be).str().unwrap(),
            "/org/freedesktop/systemd1/job/7"
        );
        server.join().unwrap();
    }
}
