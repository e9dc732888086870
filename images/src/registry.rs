//! Pulls over the OCI distribution API.
//!
//! Endpoints for a registry host are its configured mirrors, in order, then the host itself
//! (`registry-1.docker.io` for `docker.io`); see [`crate::hosts`]. A tag is resolved by the
//! first endpoint with the `resolve` capability that knows it; the manifests and blobs it
//! names are fetched, each on its own, from the first endpoint with `pull` that has them, so a
//! mirror that lacks an image or fails falls through to the next.
//! Authentication follows the registry's `WWW-Authenticate` challenge: Basic, or Bearer tokens
//! from the realm it names (anonymous, with username/password, with an identity token, or a
//! registry token given directly). Every blob is verified against its digest and size before
//! it enters the store; concurrent pulls share one download per blob.

use crate::challenge::{parse_challenges, Challenge};
use crate::digest::Digest;
use crate::error::{ImageError, Result};
use crate::hosts::{self, Endpoint, RegistryConfig, Tls};
use crate::oci::{self, Descriptor, ImageConfig, Index, Manifest, Platform};
use crate::reference::Reference;
use crate::store::{ImageRecord, ImageStore};
use base64::Engine as _;
use futures::StreamExt as _;
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Largest manifest or index we accept (registries cap them at 4 MiB too).
const MAX_MANIFEST: usize = 4 << 20;
/// Largest image config we accept.
const MAX_CONFIG: usize = 16 << 20;

/// Pull settings.
#[derive(Debug, Clone)]
pub struct PullConfig {
    pub platform: Platform,
    pub registries: BTreeMap<String, RegistryConfig>,
    /// The node's docker `config.json`, read at each pull for endpoints that kubelet sent no
    /// credentials for.
    pub auth_file: Option<PathBuf>,
    pub max_concurrent_downloads: usize,
    pub connect_timeout: Duration,
    /// How long a registry may send nothing (no response, no body bytes) before the pull
    /// fails; `None`: no limit.
    pub progress_timeout: Option<Duration>,
}

impl Default for PullConfig {
    fn default() -> Self {
        PullConfig {
            platform: Platform::parse("linux/amd64").expect("static platform"),
            registries: BTreeMap::new(),
            auth_file: None,
            max_concurrent_downloads: 3,
            connect_timeout: Duration::from_secs(10),
            progress_timeout: Some(Duration::from_secs(300)),
        }
    }
}

/// Credentials for a pull, as CRI's `AuthConfig` carries them.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    pub username: String,
    pub password: String,
    /// An OAuth2 refresh token, exchanged at the token realm.
    pub identity_token: String,
    /// A bearer token to send as is.
    pub registry_token: String,
    /// The registry these are for (CRI's `server_address`); empty: every endpoint.
    pub server_address: String,
}

impl Credentials {
    /// From CRI fields; `auth` is base64 `user:password` and fills in missing user/password.
    pub fn from_cri(
        username: &str,
        password: &str,
        auth: &str,
        identity_token: &str,
        registry_token: &str,
    ) -> Credentials {
        let mut c = Credentials {
            username: username.to_string(),
            password: password.to_string(),
            identity_token: identity_token.to_string(),
            registry_token: registry_token.to_string(),
            server_address: String::new(),
        };
        if c.username.is_empty() && !auth.is_empty() {
            if let Ok(raw) = base64::engine::general_purpose::STANDARD.decode(auth.trim()) {
                if let Ok(s) = String::from_utf8(raw) {
                    if let Some((u, p)) = s.split_once(':') {
                        c.username = u.to_string();
                        c.password = p.to_string();
                    }
                }
            }
        }
        c
    }

    fn has_basic(&self) -> bool {
        !self.username.is_empty()
    }

    fn is_empty(&self) -> bool {
        self.username.is_empty() && self.identity_token.is_empty() && self.registry_token.is_empty()
    }
}

#[derive(Debug, Clone)]
enum Auth {
    None,
    Basic(String),
    Bearer(String),
}

fn registry_error_message(body: &[u8]) -> String {
    #[derive(Deserialize)]
    struct Errs {
        errors: Vec<Err1>,
    }
    #[derive(Deserialize)]
    struct Err1 {
        #[serde(default)]
        code: String,
        #[serde(default)]
        message: String,
    }
    if let Ok(e) = serde_json::from_slice::<Errs>(body) {
        let parts: Vec<String> = e
            .errors
            .iter()
            .map(|e| match (e.code.is_empty(), e.message.is_empty()) {
                (false, false) => format!("{}: {}", e.code, e.message),
                (false, true) => e.code.clone(),
                _ => e.message.clone(),
            })
            .collect();
        if !parts.is_empty() {
            return parts.join("; ");
        }
    }
    let s = String::from_utf8_lossy(body);
    let s = s.trim();
    if s.is_empty() {
        "(no message)".to_string()
    } else {
        s.chars().take(512).collect()
    }
}

/// What one pull did, for logs and tests.
#[derive(Debug, Clone)]
pub struct PullReport {
    pub image: ImageRecord,
    pub bytes_downloaded: u64,
    pub layers_downloaded: usize,
    pub elapsed: Duration,
}

/// When each file of a TLS setting was last changed (`None`: unreadable).
type FileStamps = Vec<Option<std::time::SystemTime>>;

/// The pull engine: endpoints, auth, HTTP clients and the store.
pub struct Puller {
    store: Arc<ImageStore>,
    config: PullConfig,
    /// Per-registry settings: `config.registries` at start, replaced by
    /// [`Puller::set_registries`] (vesseld's SIGHUP).
    registries: std::sync::RwLock<BTreeMap<String, RegistryConfig>>,
    /// The node's auth file, replaced by [`Puller::set_auth_file`].
    auth_file: std::sync::RwLock<Option<PathBuf>>,
    /// The auth file as last parsed, with the path, modification time and length it was
    /// parsed from: read again only when one of them changes.
    auth_cache: Mutex<Option<AuthCache>>,
    /// One client per TLS setting, rebuilt when one of its files changes (rotation).
    clients: Mutex<HashMap<Tls, (FileStamps, reqwest::Client)>>,
    /// Bearer tokens by [`token_key`]: per endpoint, scope and credentials, so that a pull
    /// never uses a token that other credentials (or a pull with none) were given.
    tokens: Mutex<HashMap<TokenKey, (String, Instant)>>,
    /// Endpoints that answered over HTTP when HTTPS failed, so later pulls go straight there.
    plain_http: Mutex<HashMap<String, bool>>,
    ref_locks: crate::store::KeyedLocks,
    downloads: tokio::sync::Semaphore,
}

/// A cached bearer token's key: the endpoint, the scope, and a digest of the credentials the
/// token server was shown (none is credentials too: an anonymous token).
type TokenKey = (String, String, String);

fn token_key(ep: &Endpoint, scope: &str, creds: &Credentials) -> TokenKey {
    let shown = [
        creds.username.as_str(),
        creds.password.as_str(),
        creds.identity_token.as_str(),
    ]
    .join("\0");
    (
        ep.api.clone(),
        scope.to_string(),
        Digest::of(shown.as_bytes()).hex().to_string(),
    )
}

/// A parsed auth file and what it was parsed from.
struct AuthCache {
    path: PathBuf,
    /// Modification time and length; `None`: the file was missing.
    stamp: Option<(Option<std::time::SystemTime>, u64)>,
    file: hosts::AuthFile,
}

impl Puller {
    pub fn new(store: Arc<ImageStore>, config: PullConfig) -> Puller {
        let n = config.max_concurrent_downloads.max(1);
        Puller {
            store,
            registries: std::sync::RwLock::new(config.registries.clone()),
            auth_file: std::sync::RwLock::new(config.auth_file.clone()),
            auth_cache: Mutex::new(None),
            config,
            clients: Mutex::new(HashMap::new()),
            tokens: Mutex::new(HashMap::new()),
            plain_http: Mutex::new(HashMap::new()),
            ref_locks: Default::default(),
            downloads: tokio::sync::Semaphore::new(n),
        }
    }

    pub fn store(&self) -> &Arc<ImageStore> {
        &self.store
    }

    pub fn config(&self) -> &PullConfig {
        &self.config
    }

    /// `f`, or `None` when it makes no progress within the progress timeout.
    async fn progress<T>(&self, f: impl std::future::Future<Output = T>) -> Option<T> {
        match self.config.progress_timeout {
            Some(t) => tokio::time::timeout(t, f).await.ok(),
            None => Some(f.await),
        }
    }

    /// Replaces the per-registry settings (mirrors, TLS, auth) for pulls from now on; pulls
    /// under way keep the endpoints they chose. HTTP clients are rebuilt as needed.
    pub fn set_registries(&self, registries: BTreeMap<String, RegistryConfig>) {
        *self.registries.write().unwrap_or_else(|p| p.into_inner()) = registries;
        self.clients
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.plain_http
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// The per-registry settings in use.
    pub fn registries(&self) -> BTreeMap<String, RegistryConfig> {
        self.registries
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Replaces the node's auth file for pulls from now on (vesseld's SIGHUP).
    pub fn set_auth_file(&self, path: Option<PathBuf>) {
        *self.auth_file.write().unwrap_or_else(|p| p.into_inner()) = path;
    }

    fn client(&self, tls: &Tls) -> Result<reqwest::Client> {
        let stamps: FileStamps = tls
            .files()
            .map(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
            .collect();
        let mut m = self.clients.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((s, c)) = m.get(tls) {
            if *s == stamps {
                return Ok(c.clone());
            }
        }
        let file_err = |op: &'static str, path: &std::path::Path| {
            let path = path.to_path_buf();
            move |e: reqwest::Error| ImageError::Io {
                op,
                path,
                source: std::io::Error::other(error_chain(&e)),
            }
        };
        let mut b = reqwest::Client::builder()
            .connect_timeout(self.config.connect_timeout)
            .user_agent(concat!("vessel/", env!("CARGO_PKG_VERSION")))
            .pool_idle_timeout(Duration::from_secs(30))
            .danger_accept_invalid_certs(tls.skip_verify);
        // Every read (headers or body, of manifests, tokens and blobs alike) gives up after
        // the progress timeout; blob downloads hit their own (`progress`, a second earlier),
        // which names the config key.
        if let Some(t) = self.config.progress_timeout {
            b = b.read_timeout(t + Duration::from_secs(1));
        }
        if let Some(ca) = &tls.ca_file {
            let pem = std::fs::read(ca).map_err(ImageError::io("read CA file", ca))?;
            for cert in reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(file_err("parse CA file", ca))?
            {
                b = b.add_root_certificate(cert);
            }
        }
        if let Some(cert) = &tls.client_cert {
            let mut pem =
                std::fs::read(cert).map_err(ImageError::io("read client certificate", cert))?;
            if let Some(key) = &tls.client_key {
                pem.push(b'\n');
                pem.extend(std::fs::read(key).map_err(ImageError::io("read client key", key))?);
            }
            let id = reqwest::Identity::from_pem(&pem)
                .map_err(file_err("parse client certificate and key", cert))?;
            b = b.identity(id);
        }
        let c = b
            .build()
            .map_err(file_err("build HTTP client", &PathBuf::new()))?;
        m.insert(tls.clone(), (stamps, c.clone()));
        Ok(c)
    }

    fn endpoints(&self, r: &Reference) -> Vec<Endpoint> {
        let registries = self.registries.read().unwrap_or_else(|p| p.into_inner());
        hosts::endpoints(&registries, r, |h| self.known_plain(h))
    }

    /// Whether registry `host` answered over plain HTTP before.
    fn known_plain(&self, host: &str) -> bool {
        self.plain_http
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(host)
            .copied()
            .unwrap_or(false)
    }

    /// The credentials `ep` gets: kubelet's where they apply to it, else the node's auth
    /// file's entry for its host, else none.
    fn creds_for(&self, ep: &Endpoint, cri: &Credentials) -> Credentials {
        if !cri.is_empty() && hosts::cri_creds_apply(cri, ep) {
            return cri.clone();
        }
        let file = self
            .auth_file
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(file) = file else {
            return Credentials::default();
        };
        let stamp = std::fs::metadata(&file)
            .ok()
            .map(|m| (m.modified().ok(), m.len()));
        let mut cache = self.auth_cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = cache
            .as_ref()
            .filter(|c| c.path == file && c.stamp == stamp)
        {
            return c.file.lookup(&ep.host).unwrap_or_default();
        }
        match hosts::AuthFile::load(&file) {
            Ok(f) => {
                let f = f.unwrap_or_default();
                let creds = f.lookup(&ep.host).unwrap_or_default();
                *cache = Some(AuthCache {
                    path: file,
                    stamp,
                    file: f,
                });
                creds
            }
            Err(e) => {
                tracing::warn!(file = %file.display(), error = %e, "auth file unreadable; pulling without its credentials");
                Credentials::default()
            }
        }
    }

    fn auth_for(&self, ep: &Endpoint, scope: &str, creds: &Credentials) -> Auth {
        if !creds.registry_token.is_empty() {
            return Auth::Bearer(creds.registry_token.clone());
        }
        let t = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((tok, exp)) = t.get(&token_key(ep, scope, creds)) {
            if Instant::now() < *exp {
                return Auth::Bearer(tok.clone());
            }
        }
        Auth::None
    }

    async fn fetch_token(
        &self,
        client: &reqwest::Client,
        ep: &Endpoint,
        ch: &Challenge,
        scope: &str,
        creds: &Credentials,
        reference: &Reference,
    ) -> Result<String> {
        let realm =
            ch.param("realm")
                .map(str::to_string)
                .ok_or_else(|| ImageError::Unauthorized {
                    reference: reference.to_string(),
                    registry: ep.name.clone(),
                    message: "bearer challenge without realm".into(),
                })?;
        let service = ch.param("service").unwrap_or_default().to_string();
        let scope_q = ch
            .param("scope")
            .map_or_else(|| scope.to_string(), str::to_string);
        let transport = |e: reqwest::Error| ImageError::Transport {
            reference: reference.to_string(),
            registry: realm.clone(),
            message: e.to_string(),
        };
        let resp = if !creds.identity_token.is_empty() {
            let form = [
                ("grant_type", "refresh_token"),
                ("refresh_token", creds.identity_token.as_str()),
                ("service", service.as_str()),
                ("scope", scope_q.as_str()),
                ("client_id", "vessel"),
            ];
            let body = form
                .iter()
                .map(|(k, v)| format!("{k}={}", urlencode(v)))
                .collect::<Vec<_>>()
                .join("&");
            client
                .post(&realm)
                .header("content-type", "application/x-www-form-urlencoded")
                .body(body)
                .send()
                .await
                .map_err(transport)?
        } else {
            let mut q: Vec<(&str, &str)> = Vec::new();
            if !service.is_empty() {
                q.push(("service", &service));
            }
            q.push(("scope", &scope_q));
            let url = format!(
                "{realm}{}{}",
                if realm.contains('?') { "&" } else { "?" },
                q.iter()
                    .map(|(k, v)| format!("{k}={}", urlencode(v)))
                    .collect::<Vec<_>>()
                    .join("&")
            );
            let mut rb = client.get(url);
            if creds.has_basic() {
                rb = rb.basic_auth(&creds.username, Some(&creds.password));
            }
            rb.send().await.map_err(transport)?
        };
        let status = resp.status();
        let body = resp.bytes().await.map_err(transport)?;
        if !status.is_success() {
            return Err(ImageError::Unauthorized {
                reference: reference.to_string(),
                registry: ep.name.clone(),
                message: format!(
                    "token server {realm} answered {}: {}",
                    status.as_u16(),
                    registry_error_message(&body)
                ),
            });
        }
        #[derive(Deserialize)]
        struct Tok {
            #[serde(default)]
            token: String,
            #[serde(default)]
            access_token: String,
            #[serde(default)]
            expires_in: Option<u64>,
        }
        let t: Tok = serde_json::from_slice(&body).map_err(|e| ImageError::Unauthorized {
            reference: reference.to_string(),
            registry: ep.name.clone(),
            message: format!("token server {realm} sent an unreadable answer: {e}"),
        })?;
        let tok = if !t.token.is_empty() {
            t.token
        } else {
            t.access_token
        };
        if tok.is_empty() {
            return Err(ImageError::Unauthorized {
                reference: reference.to_string(),
                registry: ep.name.clone(),
                message: format!("token server {realm} sent no token"),
            });
        }
        let life = Duration::from_secs(t.expires_in.unwrap_or(60).clamp(10, 3600));
        let now = Instant::now();
        let mut tokens = self.tokens.lock().unwrap_or_else(|p| p.into_inner());
        // Expired ones go: keys carry the credentials, which rotate (registry credential
        // helpers), so the map would only grow.
        tokens.retain(|_, (_, until)| *until > now);
        tokens.insert(
            token_key(ep, scope, creds),
            (tok.clone(), now + life - Duration::from_secs(5)),
        );
        drop(tokens);
        Ok(tok)
    }

    /// GET with the registry's auth dance. Returns the response of a non-401 answer.
    async fn get(
        &self,
        ep: &Endpoint,
        path: &str,
        accept: Option<&str>,
        r: &Reference,
        creds: &Credentials,
    ) -> Result<reqwest::Response> {
        let client = self.client(&ep.tls)?;
        let creds = &self.creds_for(ep, creds);
        let scope = format!("repository:{}:pull", r.path);
        let url = ep.url(path);
        let mut auth = self.auth_for(ep, &scope, creds);
        for attempt in 0..2 {
            let mut rb = client.get(&url);
            for (k, v) in &ep.headers {
                rb = rb.header(k, v);
            }
            if let Some(a) = accept {
                rb = rb.header("accept", a);
            }
            rb = match &auth {
                Auth::None => rb,
                Auth::Basic(h) | Auth::Bearer(h) if h.is_empty() => rb,
                Auth::Basic(h) => rb.header("authorization", format!("Basic {h}")),
                Auth::Bearer(t) => rb.bearer_auth(t),
            };
            let resp = rb.send().await.map_err(|e| ImageError::Transport {
                reference: r.to_string(),
                registry: ep.name.clone(),
                message: error_chain(&e),
            })?;
            if resp.status() != reqwest::StatusCode::UNAUTHORIZED {
                return Ok(resp);
            }
            let challenge = resp
                .headers()
                .get_all("www-authenticate")
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(parse_challenges)
                .find(|c| {
                    c.scheme.eq_ignore_ascii_case("bearer")
                        || c.scheme.eq_ignore_ascii_case("basic")
                });
            let body = resp.bytes().await.unwrap_or_default();
            let denied = |message: String| ImageError::Unauthorized {
                reference: r.to_string(),
                registry: ep.name.clone(),
                message,
            };
            if attempt == 1 {
                return Err(denied(registry_error_message(&body)));
            }
            auth = match challenge {
                Some(c) if c.scheme.eq_ignore_ascii_case("basic") => {
                    if !creds.has_basic() {
                        return Err(denied(format!(
                            "credentials required: {}",
                            registry_error_message(&body)
                        )));
                    }
                    Auth::Basic(hosts::basic(&creds.username, &creds.password))
                }
                Some(c) => Auth::Bearer(self.fetch_token(&client, ep, &c, &scope, creds, r).await?),
                None => return Err(denied(registry_error_message(&body))),
            };
        }
        unreachable!("the loop returns on its second attempt")
    }

    /// Fetches a manifest or index by tag or digest; verifies it when asked by digest.
    async fn fetch_manifest(
        &self,
        ep: &Endpoint,
        r: &Reference,
        what: &str,
        creds: &Credentials,
    ) -> Result<(Vec<u8>, String, Digest)> {
        let resp = self
            .get(
                ep,
                &format!("/{}/manifests/{}", r.path, what),
                Some(oci::MANIFEST_ACCEPT),
                r,
                creds,
            )
            .await?;
        let status = resp.status();
        let ctype = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = read_limited(resp, MAX_MANIFEST, r, &ep.name).await?;
        if !status.is_success() {
            return Err(ImageError::Registry {
                reference: r.to_string(),
                registry: ep.name.clone(),
                status: status.as_u16(),
                message: registry_error_message(&body),
            });
        }
        let digest = Digest::of(&body);
        if let Ok(want) = what.parse::<Digest>() {
            if want != digest {
                return Err(ImageError::DigestMismatch {
                    what: format!("manifest of {r}"),
                    expected: want,
                    actual: digest,
                });
            }
        }
        let mt = oci::sniff_media_type(ctype.as_deref(), &body).ok_or_else(|| {
            ImageError::UnsupportedMediaType {
                reference: r.to_string(),
                media_type: ctype.clone().unwrap_or_default(),
            }
        })?;
        Ok((body, mt, digest))
    }

    /// Downloads a blob into the store unless present; shared between concurrent pulls.
    async fn fetch_blob(
        &self,
        ep: &Endpoint,
        r: &Reference,
        desc: &Descriptor,
        creds: &Credentials,
        what: &str,
    ) -> Result<u64> {
        let _g = self.store.blob_locks.lock(desc.digest.as_str()).await;
        if self.store.has_blob(&desc.digest) {
            return Ok(0);
        }
        let _permit = self
            .downloads
            .acquire()
            .await
            .map_err(|_| ImageError::Transport {
                reference: r.to_string(),
                registry: ep.name.clone(),
                message: "puller shut down".into(),
            })?;
        let stalled = |what_waited: &str| {
            ImageError::Transport {
            reference: r.to_string(),
            registry: ep.name.clone(),
            message: format!(
                "{what} {}: no progress for {:?} while waiting for {what_waited} (images.pull_progress_timeout_secs)",
                desc.digest,
                self.config.progress_timeout.unwrap_or_default()
            ),
        }
        };
        let resp = self
            .progress(self.get(
                ep,
                &format!("/{}/blobs/{}", r.path, desc.digest),
                None,
                r,
                creds,
            ))
            .await
            .ok_or_else(|| stalled("the response"))??;
        let status = resp.status();
        if !status.is_success() {
            let body = resp.bytes().await.unwrap_or_default();
            return Err(ImageError::Registry {
                reference: r.to_string(),
                registry: ep.name.clone(),
                status: status.as_u16(),
                message: format!("{what} {}: {}", desc.digest, registry_error_message(&body)),
            });
        }
        let mut w = self.store.blob_writer()?;
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = self
            .progress(stream.next())
            .await
            .ok_or_else(|| stalled("data"))?
        {
            let chunk = chunk.map_err(|e| ImageError::Transport {
                reference: r.to_string(),
                registry: ep.name.clone(),
                message: format!("reading {what} {}: {}", desc.digest, error_chain(&e)),
            })?;
            w.write_chunk(&chunk)?;
            if w.written() > desc.size {
                return Err(ImageError::SizeMismatch {
                    what: format!("{what} {}", desc.digest),
                    expected: desc.size,
                    actual: w.written(),
                });
            }
        }
        let n = w.written();
        let d = desc.digest.clone();
        let size = desc.size;
        let label = format!("{what} {} of {r}", desc.digest.short());
        tokio::task::spawn_blocking(move || w.commit(&label, &d, Some(size)))
            .await
            .map_err(|e| {
                ImageError::io("commit blob", PathBuf::new())(std::io::Error::other(e))
            })??;
        self.store
            .stats
            .blobs_committed
            .fetch_add(1, Ordering::Relaxed);
        Ok(n)
    }

    /// Pulls `reference`, resolving indexes to the configured platform, and records the image.
    pub async fn pull(&self, reference: &str, creds: &Credentials) -> Result<PullReport> {
        let r = Reference::parse(reference)?;
        // Concurrent pulls of one reference run one after the other; the second finds every
        // blob in place and downloads nothing.
        let _g = self.ref_locks.lock(&r.to_string()).await;
        let start = Instant::now();
        tracing::info!(image = %r, "pull: start");
        let res = self.pull_endpoints(&r, creds, start).await;
        if res.is_err() {
            // Nothing half-pulled stays: blobs of a failed pull that no image uses go.
            let store = self.store.clone();
            let _ = tokio::task::spawn_blocking(move || store.gc()).await;
        }
        res
    }

    async fn pull_endpoints(
        &self,
        r: &Reference,
        creds: &Credentials,
        start: Instant,
    ) -> Result<PullReport> {
        let eps = self.endpoints(r);
        // A tag needs an endpoint that may resolve it; a digest only one that may pull.
        let by_digest = r.digest.is_some();
        let resolvers: Vec<Endpoint> = eps
            .iter()
            .filter(|e| e.pull && (by_digest || e.resolve))
            .cloned()
            .collect();
        let pullers: Vec<Endpoint> = eps.into_iter().filter(|e| e.pull).collect();
        let what = r.manifest_ref();
        let top = self
            .first_ok(&resolvers, r, "manifest", |ep| {
                self.fetch_manifest(ep, r, &what, creds)
            })
            .await?;
        self.pull_from(&pullers, r, creds, start, top).await
    }

    /// `f` on each endpoint in turn until one succeeds. A failure another endpoint may not
    /// have (no connection, an error answer, access denied) moves on to the next; of the
    /// failures, the most telling is returned: an answer beats a connection that failed.
    async fn first_ok<'a, T, Fut>(
        &self,
        eps: &'a [Endpoint],
        r: &Reference,
        what: &str,
        f: impl Fn(&'a Endpoint) -> Fut,
    ) -> Result<T>
    where
        Fut: std::future::Future<Output = Result<T>>,
    {
        let mut last_err: Option<ImageError> = None;
        for ep in eps {
            if ep.plain_alt && self.known_plain(&ep.host) {
                continue;
            }
            match f(ep).await {
                Ok(v) => {
                    if ep.plain_fallback {
                        self.plain_http
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .insert(ep.host.clone(), true);
                    }
                    return Ok(v);
                }
                Err(e) => {
                    let answered = matches!(
                        e,
                        ImageError::Registry { .. } | ImageError::Unauthorized { .. }
                    );
                    if !answered && !matches!(e, ImageError::Transport { .. }) {
                        return Err(e);
                    }
                    if ep.plain_alt && !answered {
                        // Routine for a registry that serves plain HTTP.
                        tracing::debug!(image = %r, endpoint = %ep.api, what, error = %e, "pull: HTTPS failed; trying plain HTTP");
                    } else {
                        tracing::warn!(image = %r, endpoint = %ep.name, what, error = %e, "pull: endpoint failed");
                    }
                    let keep_last = !answered
                        && matches!(
                            last_err,
                            Some(ImageError::Registry { .. } | ImageError::Unauthorized { .. })
                        );
                    if !keep_last {
                        last_err = Some(e);
                    }
                }
            }
        }
        Err(last_err.unwrap_or_else(|| ImageError::Transport {
            reference: r.to_string(),
            registry: r.domain.clone(),
            message: format!(
                "no endpoint may serve the {what}: check the mirrors' capabilities and mirrors_only"
            ),
        }))
    }

    async fn pull_from(
        &self,
        eps: &[Endpoint],
        r: &Reference,
        creds: &Credentials,
        start: Instant,
        (body, mt, top_digest): (Vec<u8>, String, Digest),
    ) -> Result<PullReport> {
        let mut docs: Vec<(Vec<u8>, Digest)> = Vec::new();
        let from_index = oci::is_index(&mt);
        let (manifest_body, manifest_desc) = if from_index {
            let index: Index = serde_json::from_slice(&body).map_err(|e| ImageError::BadImage {
                reference: r.to_string(),
                reason: format!("unreadable index: {e}"),
            })?;
            let chosen = index.choose(&self.config.platform, &r.to_string())?.clone();
            docs.push((body, top_digest.clone()));
            let (mbody, mmt, mdigest) = self
                .first_ok(eps, r, "manifest", |ep| {
                    self.fetch_manifest(ep, r, chosen.digest.as_str(), creds)
                })
                .await?;
            if !oci::is_manifest(&mmt) {
                return Err(ImageError::UnsupportedMediaType {
                    reference: r.to_string(),
                    media_type: mmt,
                });
            }
            let desc = Descriptor {
                media_type: mmt,
                digest: mdigest,
                size: mbody.len() as u64,
                platform: chosen.platform.clone(),
                annotations: Default::default(),
                urls: vec![],
            };
            (mbody, desc)
        } else if oci::is_manifest(&mt) {
            let desc = Descriptor::new(&mt, &body);
            (body, desc)
        } else {
            return Err(ImageError::UnsupportedMediaType {
                reference: r.to_string(),
                media_type: mt,
            });
        };
        let manifest: Manifest =
            serde_json::from_slice(&manifest_body).map_err(|e| ImageError::BadImage {
                reference: r.to_string(),
                reason: format!("unreadable manifest: {e}"),
            })?;
        for l in &manifest.layers {
            if !oci::is_layer(&l.media_type) {
                return Err(ImageError::UnsupportedMediaType {
                    reference: r.to_string(),
                    media_type: l.media_type.clone(),
                });
            }
        }
        // Compared as u64: the size comes from the registry and may not fit a usize.
        if manifest.config.size > MAX_CONFIG as u64 {
            return Err(ImageError::BadImage {
                reference: r.to_string(),
                reason: format!("config of {} bytes is too large", manifest.config.size),
            });
        }
        // Keep everything this pull touches from a concurrent GC (RemoveImage of another image).
        let mut keys: Vec<String> = vec![
            manifest.config.digest.hex().to_string(),
            manifest_desc.digest.hex().to_string(),
            top_digest.hex().to_string(),
        ];
        keys.extend(manifest.layers.iter().map(|l| l.digest.hex().to_string()));
        let _pins = self.store.pin(keys);
        // Config first: it holds the diff IDs that say whether layers are already unpacked.
        let mut downloaded = self
            .first_ok(eps, r, "config", |ep| {
                self.fetch_blob(ep, r, &manifest.config, creds, "config")
            })
            .await?;
        let store = self.store.clone();
        let cfg_digest = manifest.config.digest.clone();
        let config_bytes = tokio::task::spawn_blocking(move || store.read_blob(&cfg_digest))
            .await
            .map_err(|e| {
                ImageError::io("read config", PathBuf::new())(std::io::Error::other(e))
            })??;
        let config: ImageConfig =
            serde_json::from_slice(&config_bytes).map_err(|e| ImageError::BadImage {
                reference: r.to_string(),
                reason: format!("unreadable image config: {e}"),
            })?;
        if from_index {
            config.check_index_entry(&manifest_desc, &self.config.platform, &r.to_string())?;
        }
        let _layer_pins = self
            .store
            .pin(config.rootfs.diff_ids.iter().map(|d| d.hex().to_string()));
        if config.rootfs.diff_ids.len() != manifest.layers.len() {
            return Err(ImageError::BadImage {
                reference: r.to_string(),
                reason: format!(
                    "manifest has {} layers but config lists {} diff IDs",
                    manifest.layers.len(),
                    config.rootfs.diff_ids.len()
                ),
            });
        }
        let total: u64 = manifest.layers.iter().map(|l| l.size).sum();
        tracing::info!(image = %r, layers = manifest.layers.len(), bytes = total, "pull: fetching layers");

        // Layers: download (shared per blob) and unpack (shared per diff ID), concurrently;
        // what they write together is bounded (`images.max_image_bytes`).
        let written = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut jobs = Vec::new();
        for (i, (desc, diff_id)) in manifest
            .layers
            .iter()
            .zip(&config.rootfs.diff_ids)
            .enumerate()
        {
            let lowers: Vec<PathBuf> = config.rootfs.diff_ids[..i]
                .iter()
                .rev()
                .map(|d| self.store.layer_path(d))
                .collect();
            jobs.push(self.fetch_layer(
                eps,
                r,
                desc,
                diff_id,
                (lowers, written.clone()),
                creds,
                i,
                manifest.layers.len(),
            ));
        }
        let mut layers_downloaded = 0;
        for res in futures::future::join_all(jobs).await {
            let n = res?;
            if n > 0 {
                layers_downloaded += 1;
            }
            downloaded += n;
        }

        // Documents last, once everything they point to is in place.
        let store = self.store.clone();
        let manifest_digest = manifest_desc.digest.clone();
        let mb = manifest_body.clone();
        tokio::task::spawn_blocking(move || -> Result<()> {
            store.put_blob("manifest", &mb, Some(&manifest_digest))?;
            for (b, d) in &docs {
                store.put_blob("index", b, Some(d))?;
            }
            Ok(())
        })
        .await
        .map_err(|e| {
            ImageError::io("store manifest", PathBuf::new())(std::io::Error::other(e))
        })??;

        let rec = ImageRecord::new(
            manifest_desc,
            &manifest,
            &config,
            // A reference with a digest names no tag, whatever tag it also has (kubelet's
            // pinned `name:tag@digest`): as containerd's normalisation keeps only the
            // digest, and the registry's tag may point elsewhere by now.
            r.repo_tag()
                .filter(|_| r.digest.is_none())
                .into_iter()
                .collect(),
            vec![r.repo_digest(&top_digest)],
        );
        let store = self.store.clone();
        let rec = tokio::task::spawn_blocking(move || store.commit_image(rec))
            .await
            .map_err(|e| {
                ImageError::io("record image", PathBuf::new())(std::io::Error::other(e))
            })??;
        let elapsed = start.elapsed();
        tracing::info!(
            image = %r,
            id = %rec.id,
            bytes_downloaded = downloaded,
            layers_downloaded,
            // Saturating: a log field.
            ms = u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
            "pull: done"
        );
        Ok(PullReport {
            image: rec,
            bytes_downloaded: downloaded,
            layers_downloaded,
            elapsed,
        })
    }

    #[allow(clippy::too_many_arguments)]
    async fn fetch_layer(
        &self,
        eps: &[Endpoint],
        r: &Reference,
        desc: &Descriptor,
        diff_id: &Digest,
        (lowers, written): (Vec<PathBuf>, Arc<std::sync::atomic::AtomicU64>),
        creds: &Credentials,
        i: usize,
        n: usize,
    ) -> Result<u64> {
        let _g = self.store.layer_locks.lock(diff_id.as_str()).await;
        if self.store.has_layer(diff_id) {
            tracing::debug!(image = %r, layer = %diff_id.short(), "pull: layer already unpacked");
            return Ok(0);
        }
        let bytes = self
            .first_ok(eps, r, "layer", |ep| {
                self.fetch_blob(ep, r, desc, creds, "layer")
            })
            .await?;
        let store = self.store.clone();
        let blob = desc.digest.clone();
        let d = diff_id.clone();
        let t = Instant::now();
        let res = tokio::task::spawn_blocking(move || {
            store.unpack_layer_blob(&blob, &d, lowers, Some(written))
        })
        .await
        .map_err(|e| ImageError::io("unpack layer", PathBuf::new())(std::io::Error::other(e)))?;
        if let Err(e) = res {
            // A blob that does not unpack (bad diff ID, path escape) is not worth keeping.
            let p = self.store.blob_path(&desc.digest);
            let _ = std::fs::remove_file(&p);
            return Err(e);
        }
        tracing::info!(
            image = %r,
            layer = format!("{}/{}", i + 1, n),
            digest = %desc.digest.short(),
            bytes,
            // Saturating: a log field.
            unpack_ms = u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX),
            "pull: layer ready"
        );
        Ok(bytes)
    }
}

async fn read_limited(
    resp: reqwest::Response,
    limit: usize,
    r: &Reference,
    registry: &str,
) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut s = resp.bytes_stream();
    while let Some(c) = s.next().await {
        let c = c.map_err(|e| ImageError::Transport {
            reference: r.to_string(),
            registry: registry.to_string(),
            message: error_chain(&e),
        })?;
        if out.len() + c.len() > limit {
            return Err(ImageError::BadImage {
                reference: r.to_string(),
                reason: format!("{registry} sent a manifest larger than {limit} bytes"),
            });
        }
        out.extend_from_slice(&c);
    }
    Ok(out)
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let cs = c.to_string();
        if !s.contains(&cs) {
            s.push_str(": ");
            s.push_str(&cs);
        }
        cur = c.source();
    }
    s
}

fn urlencode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_errors_keep_message() {
        let m = registry_error_message(
            br#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown","detail":{}}]}"#,
        );
        assert_eq!(m, "MANIFEST_UNKNOWN: manifest unknown");
        assert_eq!(registry_error_message(b"  plain text "), "plain text");
    }

    #[test]
    fn credentials_from_auth_field() {
        let auth = base64::engine::general_purpose::STANDARD.encode("bob:s3:cret");
        let c = Credentials::from_cri("", "", &auth, "", "");
        assert_eq!(c.username, "bob");
        assert_eq!(c.password, "s3:cret");
    }
}
