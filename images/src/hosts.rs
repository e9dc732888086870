//! Per-registry settings and the endpoints a pull tries, at the level of containerd's
//! `hosts.toml`, in vessel's TOML:
//!
//! ```toml
//! [images.registries."docker.io"]
//! mirrors = ["https://mirror.example.com"]        # a URL, or a table:
//! [[images.registries."quay.io".mirrors]]
//! url = "https://pull-only.example.com/quay"
//! capabilities = ["pull"]                          # blobs and manifests by digest only
//! ca_file = "/etc/vessel/certs/mirror-ca.pem"
//! client_cert = "/etc/vessel/certs/client.pem"     # mTLS
//! client_key = "/etc/vessel/certs/client.key"
//! headers = { "X-Mirror-Token" = "abc" }
//! [images.registries."_default"]                   # hosts without a section
//! ca_file = "/etc/vessel/certs/corp-ca.pem"
//! ```
//!
//! A mirror without its own TLS settings uses its host section's. Credentials from kubelet go
//! to the endpoints whose host matches their `server_address` (to every endpoint when it is
//! empty, as containerd does); the node's auth file (docker `config.json`) fills in for
//! endpoints that get none.

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::reference::Reference;
use crate::registry::Credentials;

/// The section that applies to registry hosts without their own (containerd's `_default`).
pub const DEFAULT_SECTION: &str = "_default";

/// What an endpoint may be asked for (containerd's host capabilities).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Capability {
    /// Manifests by digest and blobs.
    Pull,
    /// Manifests by tag (turning a tag into a digest).
    Resolve,
    /// Accepted so that a `hosts.toml` carries over as is; vessel does not push.
    Push,
}

fn default_capabilities() -> Vec<Capability> {
    vec![Capability::Pull, Capability::Resolve]
}

fn is_default_capabilities(c: &[Capability]) -> bool {
    c == default_capabilities().as_slice()
}

/// TLS settings of a host section or a mirror. In a mirror, `None` takes the host's value.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MirrorConfig {
    /// `https://host[:port][/prefix]` or `http://...`; no scheme means HTTPS.
    pub url: String,
    /// What this mirror serves; default both `pull` and `resolve`.
    #[serde(
        default = "default_capabilities",
        skip_serializing_if = "is_default_capabilities"
    )]
    pub capabilities: Vec<Capability>,
    /// The URL is the API root itself: no `/v2` is added (containerd's `override_path`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub override_path: bool,
    /// Accept a TLS certificate that does not verify.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_verify: Option<bool>,
    /// Extra CA certificate (PEM) to trust.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// Client certificate (PEM, may hold its chain) for mutual TLS; with `client_key`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM); empty: the key is in `client_cert`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key: Option<PathBuf>,
    /// Headers sent with every request to this mirror (over the host section's).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
}

impl MirrorConfig {
    fn is_plain_url(&self) -> bool {
        *self
            == MirrorConfig {
                url: self.url.clone(),
                capabilities: default_capabilities(),
                ..Default::default()
            }
    }
}

impl From<&str> for MirrorConfig {
    fn from(url: &str) -> Self {
        MirrorConfig {
            url: url.to_string(),
            capabilities: default_capabilities(),
            ..Default::default()
        }
    }
}

/// A mirror is written as its URL or as a table; both read into [`MirrorConfig`] (a table's
/// errors keep their field names), and one with nothing but a URL is written back as a URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mirror(pub MirrorConfig);

impl From<&str> for Mirror {
    fn from(url: &str) -> Self {
        Mirror(url.into())
    }
}

impl std::ops::Deref for Mirror {
    type Target = MirrorConfig;
    fn deref(&self) -> &MirrorConfig {
        &self.0
    }
}

impl Serialize for Mirror {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0.is_plain_url() {
            s.serialize_str(&self.0.url)
        } else {
            self.0.serialize(s)
        }
    }
}

impl<'de> Deserialize<'de> for Mirror {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Mirror;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a mirror URL or a table with `url`")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Mirror, E> {
                Ok(v.into())
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, m: A) -> Result<Mirror, A::Error> {
                MirrorConfig::deserialize(serde::de::value::MapAccessDeserializer::new(m))
                    .map(Mirror)
            }
        }
        d.deserialize_any(V)
    }
}

/// Settings for one registry host (or [`DEFAULT_SECTION`]).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RegistryConfig {
    /// Endpoints tried before the registry itself, in order.
    #[serde(default)]
    pub mirrors: Vec<Mirror>,
    /// Shorthand for `skip_verify` and `plain_http` both.
    #[serde(default)]
    pub insecure: bool,
    /// Accept TLS certificates that do not verify, for this host and its mirrors.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub skip_verify: bool,
    /// Try the registry itself over plain HTTP when HTTPS fails (mirrors say their scheme).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub plain_http: bool,
    /// Extra CA certificate (PEM) to trust for this host and its mirrors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS with this host and its mirrors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_cert: Option<PathBuf>,
    /// Its private key (PEM); unset: the key is in `client_cert`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key: Option<PathBuf>,
    /// Headers sent with every request to this host and its mirrors.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// Do not fall back to the registry itself when every mirror failed.
    #[serde(default)]
    pub mirrors_only: bool,
}

impl RegistryConfig {
    /// What is wrong with this section, for config validation (`host` names it).
    pub fn validate(&self, host: &str) -> Result<(), String> {
        let files = |who: &str, cert: &Option<PathBuf>, key: &Option<PathBuf>| {
            if key.is_some() && cert.is_none() {
                return Err(format!(
                    "images.registries.{host:?}{who}: client_key without client_cert"
                ));
            }
            Ok(())
        };
        files("", &self.client_cert, &self.client_key)?;
        for (k, v) in &self.headers {
            header(k, v).map_err(|e| format!("images.registries.{host:?}: {e}"))?;
        }
        for m in &self.mirrors {
            let who = format!(" mirror {:?}", m.url);
            if m.url.trim().is_empty() {
                return Err(format!("images.registries.{host:?}: empty mirror"));
            }
            split_url(&m.url).ok_or_else(|| {
                format!("images.registries.{host:?}{who}: not a [http[s]://]host[:port][/path] URL")
            })?;
            if m.capabilities.is_empty() {
                return Err(format!(
                    "images.registries.{host:?}{who}: no capabilities; give pull and/or resolve"
                ));
            }
            files(&who, &m.client_cert, &m.client_key)?;
            for (k, v) in &m.headers {
                header(k, v).map_err(|e| format!("images.registries.{host:?}{who}: {e}"))?;
            }
        }
        Ok(())
    }
}

fn header(
    k: &str,
    v: &str,
) -> Result<(reqwest::header::HeaderName, reqwest::header::HeaderValue), String> {
    let name = reqwest::header::HeaderName::from_bytes(k.as_bytes())
        .map_err(|_| format!("header name {k:?} is not valid"))?;
    let value = reqwest::header::HeaderValue::from_str(v)
        .map_err(|_| format!("header {k:?}: value is not valid"))?;
    Ok((name, value))
}

/// `(scheme, host[:port], path)` of a mirror URL; no scheme means HTTPS.
fn split_url(u: &str) -> Option<(&str, &str, &str)> {
    let u = u.trim();
    let (scheme, rest) = match u.split_once("://") {
        Some((s, r)) if s == "http" || s == "https" => (s, r),
        Some(_) => return None,
        None => ("https", u),
    };
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    if host.is_empty() || host.contains(['?', '#', '@', ' ']) {
        return None;
    }
    Some((scheme, host, path.trim_end_matches('/')))
}

/// `host:port` to dial for a mirror URL, the port from the scheme when absent (doctor).
pub fn mirror_addr(url: &str) -> Option<String> {
    let (scheme, host, _) = split_url(url)?;
    let has_port = if host.starts_with('[') {
        host.contains("]:")
    } else {
        host.contains(':')
    };
    Some(if has_port {
        host.to_string()
    } else {
        format!("{host}:{}", if scheme == "http" { 80 } else { 443 })
    })
}

/// The TLS side of an endpoint: what its HTTP client is built from.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub(crate) struct Tls {
    pub skip_verify: bool,
    pub ca_file: Option<PathBuf>,
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
}

impl Tls {
    /// The files it reads, for noticing that one changed (certificate rotation).
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        [&self.ca_file, &self.client_cert, &self.client_key]
            .into_iter()
            .filter_map(|p| p.as_deref())
    }
}

/// One place a pull may fetch from.
#[derive(Debug, Clone)]
pub(crate) struct Endpoint {
    /// The API root, `https://host[:port][/prefix]/v2`, no trailing slash.
    pub api: String,
    /// `host[:port]`: what credentials and the auth file are matched against.
    pub host: String,
    /// For messages: the registry as the user knows it, or the mirror's URL.
    pub name: String,
    pub tls: Tls,
    pub headers: Vec<(reqwest::header::HeaderName, reqwest::header::HeaderValue)>,
    pub resolve: bool,
    pub pull: bool,
    /// Mirrors get `?ns=<registry>` on every request, as containerd sends, so that one
    /// pull-through cache can serve several registries.
    pub ns: Option<String>,
    /// The registry itself over plain HTTP, tried after HTTPS failed.
    pub plain_fallback: bool,
    /// The registry itself over HTTPS, with a plain-HTTP twin after it: skipped once the host
    /// is known to answer plain HTTP (within a pull too, object by object).
    pub plain_alt: bool,
}

impl Endpoint {
    /// The URL of `path` (`/<repo>/manifests/<ref>`, `/<repo>/blobs/<digest>`).
    pub fn url(&self, path: &str) -> String {
        match &self.ns {
            Some(ns) => format!("{}{path}?ns={ns}", self.api),
            None => format!("{}{path}", self.api),
        }
    }
}

fn is_loopback_host(host: &str) -> bool {
    let h = host
        .rsplit_once(':')
        .map(|(h, p)| {
            if p.bytes().all(|c| c.is_ascii_digit()) {
                h
            } else {
                host
            }
        })
        .unwrap_or(host);
    h == "localhost" || h.starts_with("127.") || h == "[::1]" || h == "::1"
}

fn headers(
    m: &BTreeMap<String, String>,
) -> Vec<(reqwest::header::HeaderName, reqwest::header::HeaderValue)> {
    // Validated at config load; a bad one here (a caller that skipped validation) is dropped.
    m.iter().filter_map(|(k, v)| header(k, v).ok()).collect()
}

/// The endpoints for `r`, in the order a pull tries them: the mirrors, then the registry
/// itself over HTTPS (and plain HTTP where allowed), unless `mirrors_only`. `plain_known`:
/// the registry answered over plain HTTP before, so HTTPS is not tried first.
pub(crate) fn endpoints(
    registries: &BTreeMap<String, RegistryConfig>,
    r: &Reference,
    plain_known: impl Fn(&str) -> bool,
) -> Vec<Endpoint> {
    let own = registries.get(&r.domain);
    let mut cfg = own
        .or_else(|| registries.get(DEFAULT_SECTION))
        .cloned()
        .unwrap_or_default();
    // Loopback registries without their own section are insecure, as in Docker.
    if own.is_none() && is_loopback_host(&r.domain) {
        cfg.insecure = true;
    }
    let skip_verify = cfg.skip_verify || cfg.insecure;
    let plain_http = cfg.plain_http || cfg.insecure;
    let host_tls = Tls {
        skip_verify,
        ca_file: cfg.ca_file.clone(),
        client_cert: cfg.client_cert.clone(),
        client_key: cfg.client_key.clone(),
    };
    let host_headers = headers(&cfg.headers);
    let mut v = Vec::new();
    for m in &cfg.mirrors {
        let Some((scheme, host, path)) = split_url(&m.url) else {
            continue;
        };
        let path = if m.override_path {
            path.to_string()
        } else {
            format!("{}/v2", path.strip_suffix("/v2").unwrap_or(path))
        };
        let mut hs = host_headers.clone();
        for (k, val) in headers(&m.headers) {
            hs.retain(|(hk, _)| *hk != k);
            hs.push((k, val));
        }
        v.push(Endpoint {
            api: format!("{scheme}://{host}{path}"),
            host: host.to_string(),
            name: m.url.trim().to_string(),
            tls: Tls {
                skip_verify: m.skip_verify.unwrap_or(skip_verify),
                ca_file: m.ca_file.clone().or_else(|| host_tls.ca_file.clone()),
                client_cert: m
                    .client_cert
                    .clone()
                    .or_else(|| host_tls.client_cert.clone()),
                client_key: if m.client_cert.is_some() {
                    m.client_key.clone()
                } else {
                    host_tls.client_key.clone()
                },
            },
            headers: hs,
            resolve: m.capabilities.contains(&Capability::Resolve),
            pull: m.capabilities.contains(&Capability::Pull),
            ns: Some(r.domain.clone()),
            plain_fallback: false,
            plain_alt: false,
        });
    }
    if !cfg.mirrors_only || cfg.mirrors.is_empty() {
        let host = if r.domain == "docker.io" {
            "registry-1.docker.io".to_string()
        } else {
            r.domain.clone()
        };
        let https = Endpoint {
            api: format!("https://{host}/v2"),
            host: host.clone(),
            name: r.domain.clone(),
            tls: host_tls,
            headers: host_headers,
            resolve: true,
            pull: true,
            ns: None,
            plain_fallback: false,
            plain_alt: plain_http,
        };
        let http = Endpoint {
            api: format!("http://{host}/v2"),
            plain_fallback: true,
            plain_alt: false,
            ..https.clone()
        };
        if plain_http && plain_known(&host) {
            v.push(http);
        } else {
            v.push(https);
            if plain_http {
                v.push(http);
            }
        }
    }
    v
}

/// The host part of a registry address as docker's `config.json` keys and CRI's
/// `server_address` write it (`https://index.docker.io/v1/`, `registry:5000`), with Docker
/// Hub's names mapped to the host pulls talk to.
fn normalize_host(addr: &str) -> String {
    let a = addr.trim();
    let a = a
        .strip_prefix("https://")
        .or_else(|| a.strip_prefix("http://"))
        .unwrap_or(a);
    let host = a.split('/').next().unwrap_or("").to_ascii_lowercase();
    match host.as_str() {
        "docker.io" | "index.docker.io" | "registry-1.docker.io" => "registry-1.docker.io".into(),
        _ => host,
    }
}

/// Whether kubelet's credentials go to `ep` (containerd's rule: all endpoints when they name
/// no server, else only a matching one).
pub(crate) fn cri_creds_apply(creds: &Credentials, ep: &Endpoint) -> bool {
    creds.server_address.is_empty()
        || normalize_host(&creds.server_address) == normalize_host(&ep.host)
}

/// A docker `config.json` (`auths.<host>`: `auth`, `username`/`password`, `identitytoken`,
/// `registrytoken`), parsed.
#[derive(Debug, Default)]
pub(crate) struct AuthFile {
    /// (normalized host, its credentials without a server address).
    auths: Vec<(String, Credentials)>,
}

impl AuthFile {
    /// Parses the file. A missing file is no error: the node simply has none.
    pub(crate) fn load(path: &Path) -> std::io::Result<Option<AuthFile>> {
        #[derive(Deserialize)]
        struct File {
            #[serde(default)]
            auths: BTreeMap<String, Entry>,
        }
        #[derive(Deserialize, Default)]
        #[serde(default)]
        struct Entry {
            auth: String,
            username: String,
            password: String,
            identitytoken: String,
            registrytoken: String,
        }
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let f: File = serde_json::from_slice(&bytes)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        let auths = f
            .auths
            .iter()
            .map(|(k, e)| {
                let c = Credentials::from_cri(
                    &e.username,
                    &e.password,
                    &e.auth,
                    &e.identitytoken,
                    &e.registrytoken,
                );
                (normalize_host(k), c)
            })
            .collect();
        Ok(Some(AuthFile { auths }))
    }

    /// The credentials for `host`, if the file has an entry for it.
    pub(crate) fn lookup(&self, host: &str) -> Option<Credentials> {
        let want = normalize_host(host);
        self.auths.iter().find(|(k, _)| *k == want).map(|(_, c)| {
            let mut c = c.clone();
            c.server_address = host.to_string();
            c
        })
    }
}

/// Credentials for `host` from the auth file at `path`.
#[cfg(test)]
pub(crate) fn auth_file_lookup(path: &Path, host: &str) -> std::io::Result<Option<Credentials>> {
    Ok(AuthFile::load(path)?.and_then(|f| f.lookup(host)))
}

/// The `Authorization: Basic` value of a user and password.
pub(crate) fn basic(user: &str, password: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(toml_text: &str) -> BTreeMap<String, RegistryConfig> {
        #[derive(Deserialize)]
        struct T {
            registries: BTreeMap<String, RegistryConfig>,
        }
        let t: T = toml::from_str(toml_text).unwrap();
        for (h, c) in &t.registries {
            c.validate(h).unwrap();
        }
        t.registries
    }

    fn bases(eps: &[Endpoint]) -> Vec<&str> {
        eps.iter().map(|e| e.api.as_str()).collect()
    }

    #[test]
    fn mirrors_as_urls_and_tables() {
        let h = hosts(
            r#"
[registries."docker.io"]
mirrors = ["mirror.local:5000/", "http://m2/v2", { url = "https://m3/base", override_path = true, capabilities = ["pull"] }]
headers = { "X-A" = "host" }
ca_file = "/ca.pem"
[[registries."quay.io".mirrors]]
url = "https://q1"
client_cert = "/c.pem"
headers = { "X-A" = "mirror" }
"#,
        );
        let eps = endpoints(&h, &Reference::parse("busybox").unwrap(), |_| false);
        assert_eq!(
            bases(&eps),
            [
                "https://mirror.local:5000/v2",
                "http://m2/v2",
                "https://m3/base",
                "https://registry-1.docker.io/v2"
            ]
        );
        assert!(eps[2].pull && !eps[2].resolve);
        assert!(eps[0].pull && eps[0].resolve);
        assert_eq!(eps[0].ns.as_deref(), Some("docker.io"));
        assert_eq!(eps[3].ns, None);
        assert_eq!(eps[0].tls.ca_file.as_deref(), Some(Path::new("/ca.pem")));
        assert_eq!(
            eps[0].url("/library/busybox/manifests/latest"),
            "https://mirror.local:5000/v2/library/busybox/manifests/latest?ns=docker.io"
        );
        assert_eq!(eps[3].headers[0].1, "host");

        let eps = endpoints(&h, &Reference::parse("quay.io/a/b").unwrap(), |_| false);
        assert_eq!(eps[0].headers.len(), 1);
        assert_eq!(eps[0].headers[0].1, "mirror");
        assert_eq!(eps[0].tls.client_cert.as_deref(), Some(Path::new("/c.pem")));
        assert_eq!(eps[1].tls.client_cert, None);

        // Written back: a URL-only mirror as a string, the others as tables.
        let out = toml::to_string(&h["docker.io"]).unwrap();
        assert!(out.contains("\"mirror.local:5000/\""), "{out}");
        assert!(out.contains("override_path = true"), "{out}");
        let back: RegistryConfig = toml::from_str(&out).unwrap();
        assert_eq!(back, h["docker.io"]);
    }

    #[test]
    fn loopback_default_section_and_plain_http() {
        let h = hosts(
            r#"
[registries."_default"]
ca_file = "/corp.pem"
[registries."r.local:5000"]
plain_http = true
[registries."s.local"]
skip_verify = true
"#,
        );
        let eps = endpoints(&h, &Reference::parse("127.0.0.1:5000/x").unwrap(), |_| {
            false
        });
        assert_eq!(
            bases(&eps),
            ["https://127.0.0.1:5000/v2", "http://127.0.0.1:5000/v2"]
        );
        assert!(eps[0].tls.skip_verify);
        assert_eq!(eps[0].tls.ca_file.as_deref(), Some(Path::new("/corp.pem")));
        let eps = endpoints(&h, &Reference::parse("other.io/x").unwrap(), |_| false);
        assert_eq!(bases(&eps), ["https://other.io/v2"]);
        assert_eq!(eps[0].tls.ca_file.as_deref(), Some(Path::new("/corp.pem")));
        // plain_http: HTTPS verified, then HTTP; once HTTP answered, HTTP only.
        let eps = endpoints(&h, &Reference::parse("r.local:5000/x").unwrap(), |_| false);
        assert_eq!(
            bases(&eps),
            ["https://r.local:5000/v2", "http://r.local:5000/v2"]
        );
        assert!(!eps[0].tls.skip_verify && eps[1].plain_fallback);
        assert!(eps[0].plain_alt && !eps[1].plain_alt);
        let eps = endpoints(&h, &Reference::parse("r.local:5000/x").unwrap(), |_| true);
        assert_eq!(bases(&eps), ["http://r.local:5000/v2"]);
        // skip_verify: HTTPS only, unverified.
        let eps = endpoints(&h, &Reference::parse("s.local/x").unwrap(), |_| false);
        assert_eq!(bases(&eps), ["https://s.local/v2"]);
        assert!(eps[0].tls.skip_verify && !eps[0].plain_alt);
    }

    #[test]
    fn bad_sections_are_named() {
        let bad = [
            (
                r#"mirrors = [{ url = "https://m", capabilitys = ["pull"] }]"#,
                "capabilitys",
            ),
            (
                r#"mirrors = [{ url = "https://m", capabilities = ["fetch"] }]"#,
                "fetch",
            ),
            (
                r#"mirrors = [{ url = "https://m", capabilities = [] }]"#,
                "no capabilities",
            ),
            (r#"mirrors = ["ftp://m"]"#, "not a"),
            (r#"client_key = "/k""#, "client_key without client_cert"),
            (r#"headers = { "bad header" = "v" }"#, "not valid"),
        ];
        for (text, want) in bad {
            let e = match toml::from_str::<RegistryConfig>(text) {
                Err(e) => e.to_string(),
                Ok(c) => c.validate("h").unwrap_err(),
            };
            assert!(e.contains(want), "{text}: {e}");
        }
    }

    #[test]
    fn auth_file_and_cri_credential_routing() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("config.json");
        assert!(auth_file_lookup(&p, "r:5000").unwrap().is_none());
        std::fs::write(
            &p,
            format!(
                r#"{{"auths": {{"https://index.docker.io/v1/": {{"auth": "{}"}},
                    "r:5000": {{"username": "u", "password": "p"}},
                    "tok.io": {{"identitytoken": "it"}}}}}}"#,
                basic("hub", "pw")
            ),
        )
        .unwrap();
        let hub = auth_file_lookup(&p, "registry-1.docker.io")
            .unwrap()
            .unwrap();
        assert_eq!(
            (hub.username.as_str(), hub.password.as_str()),
            ("hub", "pw")
        );
        let r = auth_file_lookup(&p, "r:5000").unwrap().unwrap();
        assert_eq!((r.username.as_str(), r.password.as_str()), ("u", "p"));
        assert_eq!(
            auth_file_lookup(&p, "tok.io")
                .unwrap()
                .unwrap()
                .identity_token,
            "it"
        );
        assert!(auth_file_lookup(&p, "r:5001").unwrap().is_none());
        std::fs::write(&p, "{not json").unwrap();
        assert!(auth_file_lookup(&p, "r:5000").is_err());

        let eps = endpoints(
            &hosts("[registries.\"docker.io\"]\nmirrors = [\"https://m\"]"),
            &Reference::parse("busybox").unwrap(),
            |_| false,
        );
        let mut c = Credentials::from_cri("u", "p", "", "", "");
        assert!(cri_creds_apply(&c, &eps[0]) && cri_creds_apply(&c, &eps[1]));
        c.server_address = "https://index.docker.io/v1/".into();
        assert!(!cri_creds_apply(&c, &eps[0]) && cri_creds_apply(&c, &eps[1]));
    }

    #[test]
    fn mirror_addresses() {
        assert_eq!(mirror_addr("https://m").as_deref(), Some("m:443"));
        assert_eq!(mirror_addr("http://m/x").as_deref(), Some("m:80"));
        assert_eq!(mirror_addr("m:5000/p").as_deref(), Some("m:5000"));
        assert_eq!(
            mirror_addr("https://[::1]:5000").as_deref(),
            Some("[::1]:5000")
        );
        assert_eq!(mirror_addr("https://[::1]").as_deref(), Some("[::1]:443"));
        assert_eq!(mirror_addr("ftp://m"), None);
        assert_eq!(mirror_addr("https:///x"), None);
    }
}
