//! Image references, normalised the way kubelet and containerd do:
//! `busybox` is `docker.io/library/busybox:latest`, `quay.io/x/y@sha256:...` keeps its digest.

use crate::digest::Digest;
use std::fmt;

pub const DEFAULT_DOMAIN: &str = "docker.io";
pub const DEFAULT_TAG: &str = "latest";

/// A fully qualified image reference.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Reference {
    /// Registry host with optional port: `docker.io`, `127.0.0.1:5000`.
    pub domain: String,
    /// Repository path inside the registry: `library/busybox`.
    pub path: String,
    /// The tag, if any. A reference without tag or digest gets `latest`.
    pub tag: Option<String>,
    /// The digest, if any; it wins over the tag for pulls.
    pub digest: Option<Digest>,
}

/// Why a string is not an image reference.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid image reference {input:?}: {reason}")]
pub struct ReferenceError {
    pub input: String,
    pub reason: String,
}

fn is_path_component(s: &str) -> bool {
    // [a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*
    if s.is_empty() {
        return false;
    }
    let b = s.as_bytes();
    let alnum = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    if !alnum(b[0]) || !alnum(b[b.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if alnum(b[i]) {
            i += 1;
            continue;
        }
        // a separator run: ".", "_", "__" or "-+"
        let start = i;
        while i < b.len() && !alnum(b[i]) {
            i += 1;
        }
        let sep = &s[start..i];
        let ok = sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|c| c == b'-');
        if !ok {
            return false;
        }
    }
    true
}

fn is_domain(s: &str) -> bool {
    // host[:port], host made of dns labels or an IPv6 literal in brackets
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        match rest.split_once(']') {
            Some((h, p)) => (h, p.strip_prefix(':')),
            None => return false,
        }
    } else {
        match s.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (s, None),
        }
    };
    if let Some(p) = port {
        if p.is_empty() || !p.bytes().all(|c| c.is_ascii_digit()) || p.len() > 5 {
            return false;
        }
    }
    if host.is_empty() {
        return false;
    }
    if s.starts_with('[') {
        return host.bytes().all(|c| c.is_ascii_hexdigit() || c == b':');
    }
    host.split('.').all(|label| {
        !label.is_empty()
            && label
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'-')
            && !label.starts_with('-')
            && !label.ends_with('-')
    })
}

fn is_tag(s: &str) -> bool {
    // [\w][\w.-]{0,127}
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 128
        && (b[0].is_ascii_alphanumeric() || b[0] == b'_')
        && b.iter()
            .all(|&c| c.is_ascii_alphanumeric() || c == b'_' || c == b'.' || c == b'-')
}

impl Reference {
    /// Parses and normalises a reference as kubelet sends it.
    pub fn parse(input: &str) -> Result<Reference, ReferenceError> {
        let err = |reason: &str| ReferenceError {
            input: input.to_string(),
            reason: reason.to_string(),
        };
        let s = input.trim();
        if s.is_empty() {
            return Err(err("reference is empty"));
        }
        if s.len() > 4096 {
            return Err(err("reference is too long"));
        }
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => (
                r,
                Some(
                    d.parse::<Digest>()
                        .map_err(|e| err(&format!("bad digest: {}", e.reason)))?,
                ),
            ),
            None => (s, None),
        };
        // The tag is after the last ':' that follows the last '/'.
        let last_slash = rest.rfind('/').map(|i| i + 1).unwrap_or(0);
        let (name, tag) = match rest[last_slash..].rfind(':') {
            Some(i) => {
                let t = &rest[last_slash + i + 1..];
                if !is_tag(t) {
                    return Err(err(&format!("invalid tag {t:?}")));
                }
                (&rest[..last_slash + i], Some(t.to_string()))
            }
            None => (rest, None),
        };
        if name.is_empty() {
            return Err(err("repository name is empty"));
        }
        let (domain, path) = match name.split_once('/') {
            Some((first, remainder))
                if first.contains('.') || first.contains(':') || first == "localhost" =>
            {
                if first.bytes().any(|c| c.is_ascii_uppercase()) && !is_domain(first) {
                    return Err(err("invalid registry host"));
                }
                (first.to_string(), remainder.to_string())
            }
            _ => (DEFAULT_DOMAIN.to_string(), name.to_string()),
        };
        if !is_domain(&domain) {
            return Err(err(&format!("invalid registry host {domain:?}")));
        }
        let domain = if domain == "index.docker.io" || domain == "registry-1.docker.io" {
            DEFAULT_DOMAIN.to_string()
        } else {
            domain
        };
        let path = if domain == DEFAULT_DOMAIN && !path.contains('/') {
            format!("library/{path}")
        } else {
            path
        };
        if path.bytes().any(|c| c.is_ascii_uppercase()) {
            return Err(err("repository name must be lowercase"));
        }
        if !path.split('/').all(is_path_component) {
            return Err(err(&format!("invalid repository name {path:?}")));
        }
        if domain.len() + 1 + path.len() > 255 {
            return Err(err("repository name is longer than 255 characters"));
        }
        let tag = match (&tag, &digest) {
            (None, None) => Some(DEFAULT_TAG.to_string()),
            _ => tag,
        };
        Ok(Reference {
            domain,
            path,
            tag,
            digest,
        })
    }

    /// `docker.io/library/busybox`
    pub fn repository(&self) -> String {
        format!("{}/{}", self.domain, self.path)
    }

    /// `docker.io/library/busybox:latest`, when the reference has a tag.
    pub fn repo_tag(&self) -> Option<String> {
        self.tag
            .as_ref()
            .map(|t| format!("{}:{}", self.repository(), t))
    }

    /// `docker.io/library/busybox@sha256:...` for the given digest.
    pub fn repo_digest(&self, d: &Digest) -> String {
        format!("{}@{}", self.repository(), d)
    }

    /// What to ask the registry for: the digest if there is one, else the tag.
    pub fn manifest_ref(&self) -> String {
        match (&self.digest, &self.tag) {
            (Some(d), _) => d.to_string(),
            (None, Some(t)) => t.clone(),
            (None, None) => DEFAULT_TAG.to_string(),
        }
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.repository())?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(s: &str) -> String {
        Reference::parse(s).unwrap().to_string()
    }

    #[test]
    fn normalises_like_containerd() {
        assert_eq!(norm("busybox"), "docker.io/library/busybox:latest");
        assert_eq!(norm("busybox:1.36"), "docker.io/library/busybox:1.36");
        assert_eq!(norm("library/busybox"), "docker.io/library/busybox:latest");
        assert_eq!(norm("user/app"), "docker.io/user/app:latest");
        assert_eq!(
            norm("docker.io/busybox"),
            "docker.io/library/busybox:latest"
        );
        assert_eq!(
            norm("index.docker.io/busybox"),
            "docker.io/library/busybox:latest"
        );
        assert_eq!(norm("quay.io/a/b/c:v1"), "quay.io/a/b/c:v1");
        assert_eq!(norm("localhost/app"), "localhost/app:latest");
        assert_eq!(norm("127.0.0.1:5000/app:v2"), "127.0.0.1:5000/app:v2");
        assert_eq!(norm("localhost:5000/a/b"), "localhost:5000/a/b:latest");
        let d = format!("sha256:{}", "a".repeat(64));
        assert_eq!(
            norm(&format!("busybox@{d}")),
            format!("docker.io/library/busybox@{d}")
        );
        assert_eq!(
            norm(&format!("busybox:1@{d}")),
            format!("docker.io/library/busybox:1@{d}")
        );
        let r = Reference::parse(&format!("busybox:1@{d}")).unwrap();
        assert_eq!(r.manifest_ref(), d);
        assert_eq!(
            Reference::parse("busybox").unwrap().manifest_ref(),
            "latest"
        );
        assert_eq!(
            Reference::parse("a.b/c").unwrap().repo_tag().unwrap(),
            "a.b/c:latest"
        );
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "",
            "Busybox",
            "busybox:",
            "busybox:-x",
            "busybox@sha256:xyz",
            "a//b",
            "/busybox",
            "busybox/",
            "quay.io/",
            "a b",
            "foo..bar/baz",
            "bad host:12x/app",
            "x@md5:abcd",
        ] {
            assert!(Reference::parse(bad).is_err(), "{bad:?} should be rejected");
        }
    }
}
