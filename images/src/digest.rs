//! Content digests (`sha256:<hex>`), the identity of every blob in the store.

use sha2::{Digest as _, Sha256};
use std::fmt;
use std::str::FromStr;

/// A validated `sha256:<64 lowercase hex>` digest.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Digest(String);

/// Why a string is not a digest we accept.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid digest {input:?}: {reason}")]
pub struct DigestError {
    pub input: String,
    pub reason: &'static str,
}

impl Digest {
    /// The digest of `data`.
    pub fn of(data: &[u8]) -> Self {
        Digest(format!("sha256:{}", hex::encode(Sha256::digest(data))))
    }

    /// From a finished hasher.
    pub fn from_hasher(h: Sha256) -> Self {
        Digest(format!("sha256:{}", hex::encode(h.finalize())))
    }

    /// The full `sha256:<hex>` form.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The hex part, without the algorithm.
    pub fn hex(&self) -> &str {
        &self.0["sha256:".len()..]
    }

    /// The first 12 hex characters, for logs.
    pub fn short(&self) -> &str {
        &self.hex()[..12]
    }
}

impl FromStr for Digest {
    type Err = DigestError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| DigestError {
            input: s.to_string(),
            reason,
        };
        let hex = s
            .strip_prefix("sha256:")
            .ok_or_else(|| err("only sha256 digests are supported"))?;
        if hex.len() != 64 {
            return Err(err("sha256 hex part must be 64 characters"));
        }
        if !hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(err("hex part must be lowercase hexadecimal"));
        }
        Ok(Digest(s.to_string()))
    }
}

impl TryFrom<String> for Digest {
    type Error = DigestError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<Digest> for String {
    fn from(d: Digest) -> String {
        d.0
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A `Read`/`Write` adaptor that hashes everything passing through it.
pub struct Hashing<T> {
    inner: T,
    hasher: Sha256,
    count: u64,
}

impl<T> Hashing<T> {
    pub fn new(inner: T) -> Self {
        Hashing {
            inner,
            hasher: Sha256::new(),
            count: 0,
        }
    }

    /// Bytes seen so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The digest of everything seen, and the inner reader/writer.
    pub fn finish(self) -> (Digest, u64, T) {
        (Digest::from_hasher(self.hasher), self.count, self.inner)
    }

    pub fn get_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

impl<R: std::io::Read> std::io::Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }
}

impl<W: std::io::Write> std::io::Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        let d = Digest::of(b"hello");
        assert_eq!(
            d.as_str(),
            "sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
        );
        assert_eq!(d.as_str().parse::<Digest>().unwrap(), d);
        assert!("sha512:abcd".parse::<Digest>().is_err());
        assert!("sha256:ABCD".parse::<Digest>().is_err());
        assert!("sha256:../../etc/passwd".parse::<Digest>().is_err());
        let upper = format!("sha256:{}", "A".repeat(64));
        assert!(upper.parse::<Digest>().is_err());
    }

    #[test]
    fn hashing_reader_counts() {
        use std::io::Read;
        let mut r = Hashing::new(&b"hello"[..]);
        let mut s = String::new();
        r.read_to_string(&mut s).unwrap();
        let (d, n, _) = r.finish();
        assert_eq!(n, 5);
        assert_eq!(d, Digest::of(b"hello"));
    }
}
