//! A real `docker-registry` (distribution v2) process for tests.
//!
//! [`Registry::start`] makes a temp dir with the storage root, config and log, picks a free
//! port on 127.0.0.1, runs `docker-registry serve config.yml` and waits until `GET /v2/`
//! answers. Dropping the [`Registry`] kills the process and removes the temp dir.
//!
//! Modes ([`RegistryOptions`]):
//! - plain HTTP, anonymous (the default);
//! - `htpasswd`: Basic auth with a bcrypt htpasswd file (distribution 2.8 serves it over plain
//!   HTTP too);
//! - `tls`: HTTPS with a leaf certificate for `127.0.0.1`, `::1` and `localhost`, issued by a
//!   throw-away CA ([`Registry::ca_pem`]);
//! - `token_auth`: the registry's own `auth: token` with a small token server run in-process
//!   on 127.0.0.1 (JWTs signed ES256, the signing certificate in the `x5c` header and in the
//!   registry's `rootcertbundle`). With `htpasswd` too, the token server wants those
//!   credentials; without, it hands anonymous tokens for whatever scope is asked.
//!
//! The binary is `docker-registry` from `PATH`, or `$VESSEL_DOCKER_REGISTRY`.

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use vessel_images::digest::Digest;

/// The registry's `auth.token.service` and the token `aud`.
pub const TOKEN_SERVICE: &str = "vessel-test-registry";
/// The token `iss`.
pub const TOKEN_ISSUER: &str = "vessel-test-token-issuer";

const READY_TIMEOUT: Duration = Duration::from_secs(10);
const START_ATTEMPTS: usize = 5;

/// How to run the registry. `Default` is plain HTTP, anonymous.
#[derive(Debug, Clone, Default)]
pub struct RegistryOptions {
    /// Username and password: Basic auth (or, with `token_auth`, the token server's).
    pub htpasswd: Option<(String, String)>,
    /// Serve HTTPS.
    pub tls: bool,
    /// Bearer-token auth through an in-process token server.
    pub token_auth: bool,
}

/// A running registry. Drop kills it and removes its files.
pub struct Registry {
    child: Child,
    port: u16,
    tls: bool,
    ca_pem: Option<String>,
    root: PathBuf,
    log_path: PathBuf,
    token_server: Option<TokenServer>,
    // Last: removed after the process is gone.
    dir: tempfile::TempDir,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("url", &self.url())
            .field("pid", &self.child.id())
            .field("root", &self.root)
            .field("token_realm", &self.token_realm())
            .finish()
    }
}

impl Registry {
    /// Starts a registry and waits (up to 10 s) until `GET /v2/` answers 200 or 401.
    pub fn start(opts: RegistryOptions) -> std::io::Result<Registry> {
        let bin = std::env::var_os("VESSEL_DOCKER_REGISTRY")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("docker-registry"));
        let dir = tempfile::Builder::new()
            .prefix("vessel-registry-")
            .tempdir()?;
        let root = dir.path().join("data");
        std::fs::create_dir_all(&root)?;
        let log_path = dir.path().join("registry.log");

        let mut auth_yaml = String::new();
        if let (Some((user, pass)), false) = (&opts.htpasswd, opts.token_auth) {
            if user.contains(':') || user.contains('\n') {
                return Err(invalid_input(
                    "htpasswd user must not contain ':' or newlines",
                ));
            }
            let hash = bcrypt::hash(pass, 5).map_err(|e| other(format!("bcrypt: {e}")))?;
            let path = dir.path().join("htpasswd");
            std::fs::write(&path, format!("{user}:{hash}\n"))?;
            let _ = writeln!(
                auth_yaml,
                "auth:\n  htpasswd:\n    realm: vessel-test\n    path: {}",
                yaml_str(path.display())
            );
        }

        let token_server = if opts.token_auth {
            let signer = TokenSigner::generate()?;
            let bundle = dir.path().join("token-ca.pem");
            std::fs::write(&bundle, &signer.cert_pem)?;
            let server = TokenServer::start(signer, opts.htpasswd.clone())?;
            let _ = writeln!(
                auth_yaml,
                "auth:\n  token:\n    realm: {}\n    service: {TOKEN_SERVICE}\n    issuer: {TOKEN_ISSUER}\n    rootcertbundle: {}",
                yaml_str(server.realm()),
                yaml_str(bundle.display())
            );
            Some(server)
        } else {
            None
        };

        let mut tls_yaml = String::new();
        let mut ca_pem = None;
        if opts.tls {
            let certs =
                tls_certs().map_err(|e| other(format!("generating TLS certificates: {e}")))?;
            let cert_path = dir.path().join("tls-cert.pem");
            let key_path = dir.path().join("tls-key.pem");
            std::fs::write(&cert_path, format!("{}{}", certs.leaf_pem, certs.ca_pem))?;
            std::fs::write(&key_path, &certs.leaf_key_pem)?;
            let _ = writeln!(
                tls_yaml,
                "  tls:\n    certificate: {}\n    key: {}",
                yaml_str(cert_path.display()),
                yaml_str(key_path.display())
            );
            ca_pem = Some(certs.ca_pem);
        }

        let mut last_err = None;
        for _ in 0..START_ATTEMPTS {
            let port = free_port()?;
            let config = format!(
                "version: 0.1\n\
                 log:\n  level: info\n  formatter: text\n  accesslog:\n    disabled: false\n\
                 storage:\n  filesystem:\n    rootdirectory: {root}\n  delete:\n    enabled: true\n  maintenance:\n    uploadpurging:\n      enabled: false\n\
                 http:\n  addr: 127.0.0.1:{port}\n  secret: vessel-test-registry-secret\n  headers:\n    X-Content-Type-Options: [nosniff]\n{tls_yaml}\
                 {auth_yaml}\
                 health:\n  storagedriver:\n    enabled: false\n",
                root = yaml_str(root.display()),
            );
            let config_path = dir.path().join("config.yml");
            std::fs::write(&config_path, config)?;
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log_path)?;
            let mut cmd = Command::new(&bin);
            cmd.arg("serve")
                .arg(&config_path)
                .current_dir(dir.path())
                .stdin(Stdio::null())
                .stdout(Stdio::from(log.try_clone()?))
                .stderr(Stdio::from(log));
            // The test environment must not reconfigure the registry behind our back.
            for (k, _) in std::env::vars_os() {
                if k.to_string_lossy().starts_with("REGISTRY_") {
                    cmd.env_remove(k);
                }
            }
            let mut child = cmd.spawn().map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!(
                        "starting {} (apt-get install docker-registry, or set VESSEL_DOCKER_REGISTRY): {e}",
                        bin.display()
                    ),
                )
            })?;
            let scheme = if opts.tls { "https" } else { "http" };
            match wait_ready(
                &mut child,
                &format!("{scheme}://127.0.0.1:{port}/v2/"),
                opts.tls,
            ) {
                Ok(()) => {
                    return Ok(Registry {
                        child,
                        port,
                        tls: opts.tls,
                        ca_pem,
                        root,
                        log_path,
                        token_server,
                        dir,
                    });
                }
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    let tail = tail(&log_path, 60);
                    let raced = tail.contains("address already in use");
                    last_err = Some(other(format!(
                        "registry on port {port} did not become ready: {e}\n--- registry log ---\n{tail}"
                    )));
                    if !raced {
                        break;
                    }
                    // Another process took the port between our probe and the registry's bind.
                    std::fs::write(&log_path, b"")?;
                }
            }
        }
        Err(last_err.unwrap_or_else(|| other("registry did not start".to_string())))
    }

    /// `127.0.0.1:PORT`.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `http://127.0.0.1:PORT` or `https://...`.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.host())
    }

    /// The PEM of the CA that issued the registry's certificate (TLS mode).
    pub fn ca_pem(&self) -> Option<String> {
        self.ca_pem.clone()
    }

    /// The token server's realm URL (token mode).
    pub fn token_realm(&self) -> Option<String> {
        self.token_server.as_ref().map(TokenServer::realm)
    }

    /// How many tokens the token server has issued (token mode; 0 otherwise).
    pub fn tokens_issued(&self) -> u64 {
        self.token_server
            .as_ref()
            .map_or(0, |t| t.shared.issued.load(Ordering::Relaxed))
    }

    /// The temp dir holding config, log, certificates and storage (removed on drop).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The storage root directory (`rootdirectory`).
    pub fn storage_root(&self) -> &Path {
        &self.root
    }

    /// Where the registry keeps a blob's bytes; overwrite it to serve corrupt content.
    pub fn blob_path(&self, d: &Digest) -> PathBuf {
        let hex = d.hex();
        self.root
            .join("docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }

    /// Successful (2xx) `GET /v2/<name>/blobs/<digest>` requests in the access log so far.
    /// The registry writes a line after the response, so callers may want
    /// [`Registry::wait_blob_get_count`].
    pub fn blob_get_count(&self, d: &Digest) -> usize {
        let log = std::fs::read(&self.log_path).unwrap_or_default();
        count_blob_gets(&String::from_utf8_lossy(&log), d)
    }

    /// Polls [`Registry::blob_get_count`] until it reaches `at_least` or `timeout` passes;
    /// returns the last count.
    pub fn wait_blob_get_count(&self, d: &Digest, at_least: usize, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        loop {
            let n = self.blob_get_count(d);
            if n >= at_least || Instant::now() >= deadline {
                return n;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The last lines of the registry's log (stdout and stderr).
    pub fn log_tail(&self) -> String {
        tail(&self.log_path, 60)
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // token_server and the temp dir drop after this.
    }
}

fn other(msg: String) -> std::io::Error {
    std::io::Error::other(msg)
}

fn invalid_input(msg: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, msg.to_string())
}

/// A double-quoted YAML scalar.
fn yaml_str(v: impl std::fmt::Display) -> String {
    let s = v.to_string();
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// Polls `GET /v2/` until it answers 200 or 401, the process exits, or 10 s pass.
fn wait_ready(child: &mut Child, url: &str, tls: bool) -> Result<(), String> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("registry exited with {status}"));
        }
        let res = probe(url, tls);
        if let Ok(200 | 401) = res {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(match res {
                Ok(code) => format!("GET {url} answered {code}"),
                Err(e) => format!("GET {url}: {e}"),
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn free_port() -> std::io::Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

fn tail(path: &Path, lines: usize) -> String {
    let data = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&data);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// One `GET /v2/` with a short timeout, in a thread of its own so that it works from inside
/// or outside a tokio runtime. Returns the status code.
fn probe(url: &str, tls: bool) -> Result<u16, String> {
    let url = url.to_string();
    let handle = std::thread::spawn(move || -> Result<u16, String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        rt.block_on(async {
            let client = reqwest::Client::builder()
                .danger_accept_invalid_certs(tls)
                .timeout(Duration::from_secs(2))
                .build()
                .map_err(|e| e.to_string())?;
            let resp = client
                .get(&url)
                .send()
                .await
                .map_err(|e| format!("{e:?}"))?;
            Ok(resp.status().as_u16())
        })
    });
    handle
        .join()
        .unwrap_or_else(|_| Err("probe thread panicked".to_string()))
}

/// Counts access-log lines (gorilla combined format, as distribution writes them):
/// `127.0.0.1 - user [date] "GET /v2/<name>/blobs/<digest> HTTP/1.1" 200 123 "ref" "ua"`.
fn count_blob_gets(log: &str, d: &Digest) -> usize {
    let suffix = format!("/blobs/{d}");
    log.lines()
        .filter_map(parse_access_line)
        .filter(|(method, path, status)| {
            let path = path.split('?').next().unwrap_or("");
            *method == "GET"
                && path.starts_with("/v2/")
                && path.ends_with(&suffix)
                && (200..300).contains(status)
        })
        .count()
}

/// `(method, path, status)` from one combined-log-format line, or `None` for other lines
/// (the registry's own `time=... level=... msg=...` lines).
fn parse_access_line(line: &str) -> Option<(&str, &str, u16)> {
    // The request is the first quoted string after the `[date]`.
    let after_date = &line[line.find("] \"")? + 3..];
    let end = after_date.find('"')?;
    let request = &after_date[..end];
    let mut parts = request.split(' ');
    let method = parts.next()?;
    let path = parts.next()?;
    let proto = parts.next()?;
    if !proto.starts_with("HTTP/") || parts.next().is_some() {
        return None;
    }
    let rest = after_date[end + 1..].trim_start();
    let status: u16 = rest.split(' ').next()?.parse().ok()?;
    Some((method, path, status))
}

struct TlsCerts {
    ca_pem: String,
    leaf_pem: String,
    leaf_key_pem: String,
}

fn tls_certs() -> Result<TlsCerts, rcgen::Error> {
    use rcgen::{
        BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose,
        IsCa, KeyPair, KeyUsagePurpose,
    };
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name = DistinguishedName::new();
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "vessel test registry CA");
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca = ca_params.self_signed(&ca_key)?;

    let leaf_key = KeyPair::generate()?;
    let mut leaf_params = CertificateParams::new(vec![
        "127.0.0.1".to_string(),
        "::1".to_string(),
        "localhost".to_string(),
    ])?;
    leaf_params.distinguished_name = DistinguishedName::new();
    leaf_params
        .distinguished_name
        .push(DnType::CommonName, "vessel test registry");
    leaf_params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    leaf_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let leaf = leaf_params.signed_by(&leaf_key, &ca, &ca_key)?;
    Ok(TlsCerts {
        ca_pem: ca.pem(),
        leaf_pem: leaf.pem(),
        leaf_key_pem: leaf_key.serialize_pem(),
    })
}

// ---------------------------------------------------------------------------------------------
// Token server

/// Signs registry JWTs: ES256 with a P-256 key generated by rcgen, whose self-signed
/// certificate goes into the registry's `rootcertbundle` and the JWT `x5c` header.
struct TokenSigner {
    cert_pem: String,
    cert_der_b64: String,
    key: p256::SigningKey,
}

impl TokenSigner {
    fn generate() -> std::io::Result<TokenSigner> {
        use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair};
        let err = |e: rcgen::Error| other(format!("generating the token signing key: {e}"));
        let key_pair = KeyPair::generate().map_err(err)?; // ECDSA P-256, SHA-256
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, "vessel test token signer");
        let cert = params.self_signed(&key_pair).map_err(err)?;
        // rcgen cannot sign arbitrary bytes; take the private scalar out of its PKCS#8
        // document and sign with the small P-256 implementation below (checked against the
        // public key rcgen reports).
        let key =
            p256::SigningKey::from_pkcs8(&key_pair.serialize_der(), key_pair.public_key_raw())
                .map_err(|e| other(format!("token signing key: {e}")))?;
        Ok(TokenSigner {
            cert_pem: cert.pem(),
            cert_der_b64: base64::engine::general_purpose::STANDARD.encode(cert.der()),
            key,
        })
    }

    fn sign_jwt(&self, claims: &serde_json::Value) -> String {
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let header = serde_json::json!({
            "typ": "JWT",
            "alg": "ES256",
            "x5c": [self.cert_der_b64],
        });
        let signing_input = format!(
            "{}.{}",
            b64.encode(header.to_string()),
            b64.encode(claims.to_string())
        );
        let sig = self.key.sign(signing_input.as_bytes());
        format!("{signing_input}.{}", b64.encode(sig))
    }
}

struct TokenShared {
    signer: TokenSigner,
    credentials: Option<(String, String)>,
    stop: AtomicBool,
    issued: AtomicU64,
}

struct TokenServer {
    addr: std::net::SocketAddr,
    shared: Arc<TokenShared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TokenServer {
    fn start(
        signer: TokenSigner,
        credentials: Option<(String, String)>,
    ) -> std::io::Result<TokenServer> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(TokenShared {
            signer,
            credentials,
            stop: AtomicBool::new(false),
            issued: AtomicU64::new(0),
        });
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("vessel-token-server".to_string())
            .spawn(move || {
                for conn in listener.incoming() {
                    if s.stop.load(Ordering::SeqCst) {
                        break;
                    }
                    if let Ok(conn) = conn {
                        let _ = serve_token_conn(&s, conn);
                    }
                }
            })?;
        Ok(TokenServer {
            addr,
            shared,
            thread: Some(thread),
        })
    }

    fn realm(&self) -> String {
        format!("http://{}/token", self.addr)
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve_token_conn(s: &TokenShared, conn: TcpStream) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    conn.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut request_line = String::new();
    reader.by_ref().take(8192).read_line(&mut request_line)?;
    let mut authorization = None;
    let mut header_bytes = 0usize;
    loop {
        let mut line = String::new();
        let n = reader.by_ref().take(8192).read_line(&mut line)?;
        header_bytes += n;
        if n == 0 || line == "\r\n" || line == "\n" || header_bytes > 64 * 1024 {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            if k.trim().eq_ignore_ascii_case("authorization") {
                authorization = Some(v.trim().to_string());
            }
        }
    }
    let mut w = conn;
    let mut parts = request_line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let Ok(url) = reqwest::Url::parse(&format!("http://token.invalid{target}")) else {
        return respond(&mut w, "400 Bad Request", &[], "bad request target\n");
    };
    if method != "GET" || url.path() != "/token" {
        return respond(&mut w, "404 Not Found", &[], "not found\n");
    }

    let subject = match &s.credentials {
        None => String::new(),
        Some((user, pass)) => {
            let given = authorization
                .as_deref()
                .and_then(|a| {
                    a.strip_prefix("Basic ")
                        .or_else(|| a.strip_prefix("basic "))
                })
                .and_then(|b| {
                    base64::engine::general_purpose::STANDARD
                        .decode(b.trim())
                        .ok()
                })
                .and_then(|b| String::from_utf8(b).ok());
            if given.as_deref() != Some(&format!("{user}:{pass}")) {
                return respond(
                    &mut w,
                    "401 Unauthorized",
                    &["WWW-Authenticate: Basic realm=\"vessel-test-token\""],
                    "{\"details\":\"invalid username or password\"}\n",
                );
            }
            user.clone()
        }
    };

    let mut service = None;
    let mut access = Vec::new();
    for (k, v) in url.query_pairs() {
        match k.as_ref() {
            "service" => service = Some(v.to_string()),
            "scope" => {
                for scope in v.split(' ').filter(|x| !x.is_empty()) {
                    // type:name:actions; a name may hold a port, so split the ends.
                    let Some((rest, actions)) = scope.rsplit_once(':') else {
                        continue;
                    };
                    let Some((typ, name)) = rest.split_once(':') else {
                        continue;
                    };
                    let actions: Vec<&str> = actions.split(',').filter(|a| !a.is_empty()).collect();
                    access.push(serde_json::json!({"type": typ, "name": name, "actions": actions}));
                }
            }
            _ => {}
        }
    }
    if service.as_deref().is_some_and(|sv| sv != TOKEN_SERVICE) {
        return respond(
            &mut w,
            "400 Bad Request",
            &[],
            "{\"details\":\"unknown service\"}\n",
        );
    }

    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let n = s.issued.fetch_add(1, Ordering::Relaxed) + 1;
    let claims = serde_json::json!({
        "iss": TOKEN_ISSUER,
        "sub": subject,
        "aud": TOKEN_SERVICE,
        "exp": now + 3600,
        "nbf": now.saturating_sub(60),
        "iat": now,
        "jti": format!("vessel-{now}-{n}"),
        "access": access,
    });
    let token = s.signer.sign_jwt(&claims);
    let body = serde_json::json!({
        "token": token,
        "access_token": token,
        "expires_in": 3600,
    })
    .to_string();
    respond(&mut w, "200 OK", &["Content-Type: application/json"], &body)
}

fn respond(w: &mut TcpStream, status: &str, headers: &[&str], body: &str) -> std::io::Result<()> {
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for h in headers {
        out.push_str(h);
        out.push_str("\r\n");
    }
    out.push_str("\r\n");
    out.push_str(body);
    w.write_all(out.as_bytes())?;
    w.flush()
}

/// Just enough P-256 ECDSA (SHA-256) to sign test JWTs. Not constant time: test use only.
mod p256 {
    use sha2::{Digest as _, Sha256};

    /// 256-bit number, little-endian 64-bit limbs.
    type U256 = [u64; 4];

    const P: U256 = be([
        0xFFFFFFFF00000001,
        0x0000000000000000,
        0x00000000FFFFFFFF,
        0xFFFFFFFFFFFFFFFF,
    ]);
    const N: U256 = be([
        0xFFFFFFFF00000000,
        0xFFFFFFFFFFFFFFFF,
        0xBCE6FAADA7179E84,
        0xF3B9CAC2FC632551,
    ]);
    #[cfg(test)]
    const B: U256 = be([
        0x5AC635D8AA3A93E7,
        0xB3EBBD55769886BC,
        0x651D06B0CC53B0F6,
        0x3BCE3C3E27D2604B,
    ]);
    const GX: U256 = be([
        0x6B17D1F2E12C4247,
        0xF8BCE6E563A440F2,
        0x77037D812DEB33A0,
        0xF4A13945D898C296,
    ]);
    const GY: U256 = be([
        0x4FE342E2FE1A7F9B,
        0x8EE7EB4A7C0F9E16,
        0x2BCE33576B315ECE,
        0xCBB6406837BF51F5,
    ]);

    const fn be(w: [u64; 4]) -> U256 {
        [w[3], w[2], w[1], w[0]]
    }

    fn from_be_bytes(b: &[u8; 32]) -> U256 {
        let mut out = [0u64; 4];
        for (i, limb) in out.iter_mut().enumerate() {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[32 - 8 * (i + 1)..32 - 8 * i]);
            *limb = u64::from_be_bytes(w);
        }
        out
    }

    fn to_be_bytes(a: &U256) -> [u8; 32] {
        let mut out = [0u8; 32];
        for i in 0..4 {
            out[32 - 8 * (i + 1)..32 - 8 * i].copy_from_slice(&a[i].to_be_bytes());
        }
        out
    }

    fn is_zero(a: &U256) -> bool {
        a.iter().all(|&l| l == 0)
    }

    fn geq(a: &U256, b: &U256) -> bool {
        for i in (0..4).rev() {
            if a[i] != b[i] {
                return a[i] > b[i];
            }
        }
        true
    }

    fn add_raw(a: &U256, b: &U256) -> (U256, bool) {
        let mut out = [0u64; 4];
        let mut carry = false;
        for i in 0..4 {
            let (s1, c1) = a[i].overflowing_add(b[i]);
            let (s2, c2) = s1.overflowing_add(u64::from(carry));
            out[i] = s2;
            carry = c1 || c2;
        }
        (out, carry)
    }

    fn sub_raw(a: &U256, b: &U256) -> (U256, bool) {
        let mut out = [0u64; 4];
        let mut borrow = false;
        for i in 0..4 {
            let (d1, b1) = a[i].overflowing_sub(b[i]);
            let (d2, b2) = d1.overflowing_sub(u64::from(borrow));
            out[i] = d2;
            borrow = b1 || b2;
        }
        (out, borrow)
    }

    /// Arithmetic modulo an odd 256-bit modulus, in Montgomery form (R = 2^256).
    struct Field {
        m: U256,
        m_inv_neg: u64,
        r2: U256,
    }

    impl Field {
        fn new(m: U256) -> Field {
            // -m^-1 mod 2^64 by Newton iteration.
            let mut inv: u64 = 1;
            for _ in 0..6 {
                inv = inv.wrapping_mul(2u64.wrapping_sub(m[0].wrapping_mul(inv)));
            }
            let mut f = Field {
                m,
                m_inv_neg: inv.wrapping_neg(),
                r2: [0; 4],
            };
            // R^2 mod m: double 1 512 times.
            let mut x: U256 = [1, 0, 0, 0];
            for _ in 0..512 {
                x = f.add(&x, &x);
            }
            f.r2 = x;
            f
        }

        fn add(&self, a: &U256, b: &U256) -> U256 {
            let (s, carry) = add_raw(a, b);
            if carry || geq(&s, &self.m) {
                sub_raw(&s, &self.m).0
            } else {
                s
            }
        }

        fn sub(&self, a: &U256, b: &U256) -> U256 {
            let (d, borrow) = sub_raw(a, b);
            if borrow {
                add_raw(&d, &self.m).0
            } else {
                d
            }
        }

        /// a * b * R^-1 mod m (CIOS).
        fn mul(&self, a: &U256, b: &U256) -> U256 {
            let mut t = [0u64; 6];
            for &bi in b.iter() {
                let mut c: u128 = 0;
                for j in 0..4 {
                    let v = u128::from(t[j]) + u128::from(a[j]) * u128::from(bi) + c;
                    t[j] = v as u64;
                    c = v >> 64;
                }
                let v = u128::from(t[4]) + c;
                t[4] = v as u64;
                t[5] = (v >> 64) as u64;

                let q = t[0].wrapping_mul(self.m_inv_neg);
                let v = u128::from(t[0]) + u128::from(q) * u128::from(self.m[0]);
                let mut c = v >> 64;
                for j in 1..4 {
                    let v = u128::from(t[j]) + u128::from(q) * u128::from(self.m[j]) + c;
                    t[j - 1] = v as u64;
                    c = v >> 64;
                }
                let v = u128::from(t[4]) + c;
                t[3] = v as u64;
                t[4] = t[5] + (v >> 64) as u64;
            }
            let r = [t[0], t[1], t[2], t[3]];
            if t[4] != 0 || geq(&r, &self.m) {
                sub_raw(&r, &self.m).0
            } else {
                r
            }
        }

        fn mont(&self, a: &U256) -> U256 {
            let mut a = *a;
            while geq(&a, &self.m) {
                a = sub_raw(&a, &self.m).0;
            }
            self.mul(&a, &self.r2)
        }

        fn demont(&self, a: &U256) -> U256 {
            self.mul(a, &[1, 0, 0, 0])
        }

        fn one(&self) -> U256 {
            self.mont(&[1, 0, 0, 0])
        }

        /// Inverse of a Montgomery-form value (Fermat: a^(m-2)).
        fn inv(&self, a: &U256) -> U256 {
            let e = sub_raw(&self.m, &[2, 0, 0, 0]).0;
            let mut r = self.one();
            for i in (0..256).rev() {
                r = self.mul(&r, &r);
                if (e[i / 64] >> (i % 64)) & 1 == 1 {
                    r = self.mul(&r, a);
                }
            }
            r
        }
    }

    /// Jacobian point over the base field, coordinates in Montgomery form; Z = 0 is infinity.
    #[derive(Clone, Copy)]
    struct Point {
        x: U256,
        y: U256,
        z: U256,
    }

    struct Curve {
        fp: Field,
        fn_: Field,
        g: Point,
    }

    impl Curve {
        fn new() -> Curve {
            let fp = Field::new(P);
            let g = Point {
                x: fp.mont(&GX),
                y: fp.mont(&GY),
                z: fp.one(),
            };
            Curve {
                fn_: Field::new(N),
                fp,
                g,
            }
        }

        fn double(&self, p: &Point) -> Point {
            let f = &self.fp;
            if is_zero(&p.z) || is_zero(&p.y) {
                return Point {
                    x: f.one(),
                    y: f.one(),
                    z: [0; 4],
                };
            }
            // dbl-2001-b (a = -3).
            let delta = f.mul(&p.z, &p.z);
            let gamma = f.mul(&p.y, &p.y);
            let beta = f.mul(&p.x, &gamma);
            let t = f.mul(&f.sub(&p.x, &delta), &f.add(&p.x, &delta));
            let alpha = f.add(&f.add(&t, &t), &t);
            let beta2 = f.add(&beta, &beta);
            let beta4 = f.add(&beta2, &beta2);
            let beta8 = f.add(&beta4, &beta4);
            let x3 = f.sub(&f.mul(&alpha, &alpha), &beta8);
            let yz = f.add(&p.y, &p.z);
            let z3 = f.sub(&f.sub(&f.mul(&yz, &yz), &gamma), &delta);
            let g2 = f.mul(&gamma, &gamma);
            let g2_2 = f.add(&g2, &g2);
            let g2_4 = f.add(&g2_2, &g2_2);
            let g2_8 = f.add(&g2_4, &g2_4);
            let y3 = f.sub(&f.mul(&alpha, &f.sub(&beta4, &x3)), &g2_8);
            Point {
                x: x3,
                y: y3,
                z: z3,
            }
        }

        fn add(&self, p: &Point, q: &Point) -> Point {
            let f = &self.fp;
            if is_zero(&p.z) {
                return *q;
            }
            if is_zero(&q.z) {
                return *p;
            }
            // add-2007-bl.
            let z1z1 = f.mul(&p.z, &p.z);
            let z2z2 = f.mul(&q.z, &q.z);
            let u1 = f.mul(&p.x, &z2z2);
            let u2 = f.mul(&q.x, &z1z1);
            let s1 = f.mul(&f.mul(&p.y, &q.z), &z2z2);
            let s2 = f.mul(&f.mul(&q.y, &p.z), &z1z1);
            let h = f.sub(&u2, &u1);
            let r_half = f.sub(&s2, &s1);
            if is_zero(&h) {
                return if is_zero(&r_half) {
                    self.double(p)
                } else {
                    Point {
                        x: f.one(),
                        y: f.one(),
                        z: [0; 4],
                    }
                };
            }
            let h2 = f.add(&h, &h);
            let i = f.mul(&h2, &h2);
            let j = f.mul(&h, &i);
            let r = f.add(&r_half, &r_half);
            let v = f.mul(&u1, &i);
            let x3 = f.sub(&f.sub(&f.mul(&r, &r), &j), &f.add(&v, &v));
            let s1j = f.mul(&s1, &j);
            let y3 = f.sub(&f.mul(&r, &f.sub(&v, &x3)), &f.add(&s1j, &s1j));
            let zs = f.add(&p.z, &q.z);
            let z3 = f.mul(&f.sub(&f.sub(&f.mul(&zs, &zs), &z1z1), &z2z2), &h);
            Point {
                x: x3,
                y: y3,
                z: z3,
            }
        }

        fn mul(&self, k: &U256, p: &Point) -> Point {
            let mut acc = Point {
                x: self.fp.one(),
                y: self.fp.one(),
                z: [0; 4],
            };
            for i in (0..256).rev() {
                acc = self.double(&acc);
                if (k[i / 64] >> (i % 64)) & 1 == 1 {
                    acc = self.add(&acc, p);
                }
            }
            acc
        }

        /// Affine (x, y), plain integers; `None` for infinity.
        fn affine(&self, p: &Point) -> Option<(U256, U256)> {
            if is_zero(&p.z) {
                return None;
            }
            let f = &self.fp;
            let zi = f.inv(&p.z);
            let zi2 = f.mul(&zi, &zi);
            let x = f.mul(&p.x, &zi2);
            let y = f.mul(&p.y, &f.mul(&zi2, &zi));
            Some((f.demont(&x), f.demont(&y)))
        }

        #[cfg(test)]
        fn on_curve(&self, x: &U256, y: &U256) -> bool {
            let f = &self.fp;
            let (xm, ym) = (f.mont(x), f.mont(y));
            let lhs = f.mul(&ym, &ym);
            let x3 = f.mul(&f.mul(&xm, &xm), &xm);
            let three_x = f.add(&f.add(&xm, &xm), &xm);
            let rhs = f.add(&f.sub(&x3, &three_x), &f.mont(&B));
            lhs == rhs
        }
    }

    pub struct SigningKey {
        d: U256,
        curve: Curve,
    }

    impl SigningKey {
        /// From a PKCS#8 P-256 private key document (as rcgen/ring write it), checked against
        /// the uncompressed public point `04 || x || y`.
        pub fn from_pkcs8(der: &[u8], public_raw: &[u8]) -> Result<SigningKey, String> {
            // ECPrivateKey: SEQUENCE { INTEGER 1, OCTET STRING (32) privateKey, ... }
            let marker = [0x02, 0x01, 0x01, 0x04, 0x20];
            let at = der
                .windows(marker.len())
                .position(|w| w == marker)
                .ok_or("no P-256 private key in the PKCS#8 document")?;
            let raw: &[u8; 32] = der
                .get(at + marker.len()..at + marker.len() + 32)
                .and_then(|s| s.try_into().ok())
                .ok_or("truncated private key")?;
            let key = SigningKey::from_scalar(raw)?;
            if key.public_raw() != public_raw {
                return Err("derived public key does not match the key pair".to_string());
            }
            Ok(key)
        }

        pub fn from_scalar(raw: &[u8; 32]) -> Result<SigningKey, String> {
            let d = from_be_bytes(raw);
            if is_zero(&d) || geq(&d, &N) {
                return Err("private scalar out of range".to_string());
            }
            Ok(SigningKey {
                d,
                curve: Curve::new(),
            })
        }

        /// `04 || x || y`.
        pub fn public_raw(&self) -> Vec<u8> {
            let mut out = vec![4u8];
            if let Some((x, y)) = self.curve.affine(&self.curve.mul(&self.d, &self.curve.g)) {
                out.extend_from_slice(&to_be_bytes(&x));
                out.extend_from_slice(&to_be_bytes(&y));
            }
            out
        }

        /// ECDSA over SHA-256(msg); JWS form `r || s` (64 bytes). The nonce is derived from
        /// the key and the message hash (deterministic, as in RFC 6979's spirit).
        pub fn sign(&self, msg: &[u8]) -> Vec<u8> {
            let c = &self.curve;
            let fnn = &c.fn_;
            let hash: [u8; 32] = Sha256::digest(msg).into();
            let z = fnn.mont(&from_be_bytes(&hash));
            let d = fnn.mont(&self.d);
            for counter in 0u32.. {
                let mut h = Sha256::new();
                h.update(b"vessel-test-ecdsa-nonce");
                h.update(to_be_bytes(&self.d));
                h.update(hash);
                h.update(counter.to_be_bytes());
                let k_raw = from_be_bytes(&h.finalize().into());
                if is_zero(&k_raw) || geq(&k_raw, &N) {
                    continue;
                }
                let Some((rx, _)) = c.affine(&c.mul(&k_raw, &c.g)) else {
                    continue;
                };
                let r = fnn.demont(&fnn.mont(&rx)); // rx mod n
                if is_zero(&r) {
                    continue;
                }
                let k = fnn.mont(&k_raw);
                let rm = fnn.mont(&r);
                let s = fnn.mul(&fnn.inv(&k), &fnn.add(&z, &fnn.mul(&rm, &d)));
                let s = fnn.demont(&s);
                if is_zero(&s) {
                    continue;
                }
                let mut out = Vec::with_capacity(64);
                out.extend_from_slice(&to_be_bytes(&r));
                out.extend_from_slice(&to_be_bytes(&s));
                return out;
            }
            unreachable!("a nonce is found long before the counter wraps")
        }
    }

    /// Verifies an `r || s` signature against `04 || x || y` (for the tests).
    #[cfg(test)]
    pub fn verify(public_raw: &[u8], msg: &[u8], sig: &[u8]) -> bool {
        let c = Curve::new();
        let fnn = &c.fn_;
        if public_raw.len() != 65 || public_raw[0] != 4 || sig.len() != 64 {
            return false;
        }
        let x = from_be_bytes(public_raw[1..33].try_into().unwrap());
        let y = from_be_bytes(public_raw[33..].try_into().unwrap());
        if !c.on_curve(&x, &y) {
            return false;
        }
        let r = from_be_bytes(sig[..32].try_into().unwrap());
        let s = from_be_bytes(sig[32..].try_into().unwrap());
        if is_zero(&r) || is_zero(&s) || geq(&r, &N) || geq(&s, &N) {
            return false;
        }
        let hash: [u8; 32] = Sha256::digest(msg).into();
        let z = fnn.mont(&from_be_bytes(&hash));
        let w = fnn.inv(&fnn.mont(&s));
        let u1 = fnn.demont(&fnn.mul(&z, &w));
        let u2 = fnn.demont(&fnn.mul(&fnn.mont(&r), &w));
        let q = Point {
            x: c.fp.mont(&x),
            y: c.fp.mont(&y),
            z: c.fp.one(),
        };
        let sum = c.add(&c.mul(&u1, &c.g), &c.mul(&u2, &q));
        match c.affine(&sum) {
            Some((rx, _)) => fnn.demont(&fnn.mont(&rx)) == r,
            None => false,
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn generator_is_on_curve_and_has_order_n() {
            let c = Curve::new();
            assert!(c.on_curve(&GX, &GY));
            // n * G = infinity, (n - 1) * G = -G.
            assert!(c.affine(&c.mul(&N, &c.g)).is_none());
            let nm1 = sub_raw(&N, &[1, 0, 0, 0]).0;
            let (x, y) = c.affine(&c.mul(&nm1, &c.g)).unwrap();
            assert_eq!(x, GX);
            assert_eq!(y, sub_raw(&P, &GY).0);
        }

        #[test]
        fn known_public_key() {
            // d = 1 gives G; d = 2 gives the doubling of G (a published test vector).
            let mut one = [0u8; 32];
            one[31] = 1;
            let k = SigningKey::from_scalar(&one).unwrap();
            assert_eq!(&k.public_raw()[1..33], &to_be_bytes(&GX));
            let mut two = [0u8; 32];
            two[31] = 2;
            let k = SigningKey::from_scalar(&two).unwrap();
            assert_eq!(
                hex::encode(&k.public_raw()[1..33]),
                "7cf27b188d034f7e8a52380304b51ac3c08969e277f21b35a60b48fc47669978"
            );
        }

        #[test]
        fn signs_and_verifies_with_rcgen_key() {
            let kp = rcgen::KeyPair::generate().unwrap();
            let key = SigningKey::from_pkcs8(&kp.serialize_der(), kp.public_key_raw()).unwrap();
            let sig = key.sign(b"hello");
            assert_eq!(sig.len(), 64);
            assert!(verify(kp.public_key_raw(), b"hello", &sig));
            assert!(!verify(kp.public_key_raw(), b"hellO", &sig));
            let mut bad = sig.clone();
            bad[40] ^= 1;
            assert!(!verify(kp.public_key_raw(), b"hello", &bad));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vessel_images::push::{push_artifact, PushError, PushTarget};
    use vessel_images::testimages::{busybox_image, multiarch_index, Artifact, Compression};

    fn target(reg: &Registry) -> PushTarget {
        PushTarget {
            base_url: reg.url(),
            repository: "library/busybox".to_string(),
            basic_auth: None,
            insecure_tls: false,
        }
    }

    fn creds() -> Option<(String, String)> {
        Some(("vessel".to_string(), "s3cret".to_string()))
    }

    async fn get(url: &str, auth: Option<&str>, accept: &str, insecure: bool) -> (u16, Vec<u8>) {
        let client = reqwest::Client::builder()
            .danger_accept_invalid_certs(insecure)
            .build()
            .unwrap();
        let mut rb = client.get(url).header("Accept", accept);
        if let Some(a) = auth {
            rb = rb.header("Authorization", a);
        }
        let resp = rb.send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.bytes().await.unwrap().to_vec())
    }

    #[test]
    fn parses_access_log_lines() {
        let d = Digest::of(b"x");
        let log = format!(
            "127.0.0.1 - - [09/May/2026:10:00:00 +0000] \"GET /v2/library/busybox/blobs/{d} HTTP/1.1\" 200 5 \"\" \"ua\"\n\
             127.0.0.1 - vessel [09/May/2026:10:00:00 +0000] \"GET /v2/a/b/c/blobs/{d}?x=1 HTTP/1.1\" 206 5 \"\" \"ua (x) \\\"q\\\"\"\n\
             127.0.0.1 - - [09/May/2026:10:00:00 +0000] \"HEAD /v2/library/busybox/blobs/{d} HTTP/1.1\" 200 0 \"\" \"ua\"\n\
             127.0.0.1 - - [09/May/2026:10:00:00 +0000] \"GET /v2/library/busybox/blobs/{d} HTTP/1.1\" 404 5 \"\" \"ua\"\n\
             127.0.0.1 - - [09/May/2026:10:00:00 +0000] \"GET /v2/library/busybox/blobs/{d}x HTTP/1.1\" 200 5 \"\" \"ua\"\n\
             time=\"2026-05-09T10:00:00Z\" level=info msg=\"response completed\" http.request.method=GET http.request.uri=\"/v2/library/busybox/blobs/{d}\" http.response.status=200\n\
             127.0.0.1 - - [09/May/2026:10:00:00 +0000] \"GET /v2/library/busybox/blobs/{d} HTTP/1.1\n\
             garbage ] \"\n"
        );
        assert_eq!(count_blob_gets(&log, &d), 2);
        assert_eq!(count_blob_gets(&log, &Digest::of(b"y")), 0);
    }

    #[test]
    fn token_jwt_verifies() {
        let signer = TokenSigner::generate().unwrap();
        let jwt = signer.sign_jwt(&serde_json::json!({"iss": TOKEN_ISSUER}));
        let parts: Vec<&str> = jwt.split('.').collect();
        assert_eq!(parts.len(), 3);
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let header: serde_json::Value =
            serde_json::from_slice(&b64.decode(parts[0]).unwrap()).unwrap();
        assert_eq!(header["alg"], "ES256");
        assert_eq!(header["x5c"][0], signer.cert_der_b64.as_str());
        let sig = b64.decode(parts[2]).unwrap();
        let input = format!("{}.{}", parts[0], parts[1]);
        assert!(p256::verify(
            &signer.key.public_raw(),
            input.as_bytes(),
            &sig
        ));
    }

    #[tokio::test]
    async fn plain_registry_push_and_get() {
        let reg = Registry::start(RegistryOptions::default()).unwrap();
        assert!(reg.url().starts_with("http://127.0.0.1:"));
        let img = busybox_image(Compression::Gzip);
        let art = Artifact::Image(img.clone());
        let d = push_artifact(&target(&reg), &art, Some("latest"))
            .await
            .unwrap();
        assert_eq!(d, img.manifest_digest());
        // Pushing again skips existing blobs and succeeds.
        push_artifact(&target(&reg), &art, Some("latest"))
            .await
            .unwrap();

        let (status, body) = get(
            &format!("{}/v2/library/busybox/manifests/latest", reg.url()),
            None,
            vessel_images::oci::MT_OCI_MANIFEST,
            false,
        )
        .await;
        assert_eq!(status, 200);
        assert_eq!(Digest::of(&body), img.manifest_digest());

        let layer = img.layers[0].digest();
        assert!(reg.blob_path(&layer).is_file());
        assert_eq!(reg.blob_get_count(&layer), 0);
        let url = format!("{}/v2/library/busybox/blobs/{layer}", reg.url());
        let (status, body) = get(&url, None, "*/*", false).await;
        assert_eq!(status, 200);
        assert_eq!(Digest::of(&body), layer);
        assert_eq!(
            reg.wait_blob_get_count(&layer, 1, Duration::from_secs(5)),
            1
        );

        // Corrupt the stored blob: the registry serves the new bytes.
        std::fs::write(reg.blob_path(&layer), b"corrupt").unwrap();
        let (_, body) = get(&url, None, "*/*", false).await;
        assert_eq!(body, b"corrupt");
        assert_eq!(
            reg.wait_blob_get_count(&layer, 2, Duration::from_secs(5)),
            2
        );

        // Multi-arch index with an attestation entry.
        let ix = multiarch_index();
        let mut t = target(&reg);
        t.repository = "vessel/multi".to_string();
        let d = push_artifact(&t, &ix, Some("v1")).await.unwrap();
        let (status, body) = get(
            &format!("{}/v2/vessel/multi/manifests/v1", reg.url()),
            None,
            vessel_images::oci::MANIFEST_ACCEPT,
            false,
        )
        .await;
        assert_eq!(status, 200);
        assert_eq!(Digest::of(&body), d);

        let dir = reg.dir().to_path_buf();
        drop(reg);
        assert!(!dir.exists());
    }

    #[tokio::test]
    async fn htpasswd_registry_wants_credentials() {
        let reg = Registry::start(RegistryOptions {
            htpasswd: creds(),
            ..Default::default()
        })
        .unwrap();
        let art = Artifact::Image(busybox_image(Compression::Gzip));
        let err = push_artifact(&target(&reg), &art, Some("latest"))
            .await
            .unwrap_err();
        assert_eq!(err.status(), Some(401), "{err}");

        let mut t = target(&reg);
        t.basic_auth = Some(("vessel".to_string(), "wrong".to_string()));
        let err = push_artifact(&t, &art, Some("latest")).await.unwrap_err();
        assert_eq!(err.status(), Some(401), "{err}");

        t.basic_auth = creds();
        push_artifact(&t, &art, Some("latest")).await.unwrap();
    }

    #[tokio::test]
    async fn tls_registry() {
        let reg = Registry::start(RegistryOptions {
            tls: true,
            ..Default::default()
        })
        .unwrap();
        assert!(reg.url().starts_with("https://127.0.0.1:"));
        let art = Artifact::Image(busybox_image(Compression::Zstd));
        // Without trusting the CA the push fails.
        let err = push_artifact(&target(&reg), &art, Some("latest"))
            .await
            .unwrap_err();
        assert!(matches!(err, PushError::Transport { .. }), "{err}");
        let mut t = target(&reg);
        t.insecure_tls = true;
        push_artifact(&t, &art, Some("latest")).await.unwrap();

        // The CA verifies the registry's certificate for 127.0.0.1 and localhost.
        let ca = reqwest::Certificate::from_pem(reg.ca_pem().unwrap().as_bytes()).unwrap();
        let client = reqwest::Client::builder()
            .add_root_certificate(ca)
            .build()
            .unwrap();
        for host in ["127.0.0.1", "localhost"] {
            let url = format!(
                "https://{host}:{}/v2/library/busybox/manifests/latest",
                reg.port()
            );
            let resp = client
                .get(&url)
                .header("Accept", vessel_images::oci::MT_OCI_MANIFEST)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200, "{url}");
        }
    }

    #[tokio::test]
    async fn token_registry_anonymous() {
        let reg = Registry::start(RegistryOptions {
            token_auth: true,
            ..Default::default()
        })
        .unwrap();
        // The registry itself answers 401 with a Bearer challenge.
        let (status, _) = get(&format!("{}/v2/", reg.url()), None, "*/*", false).await;
        assert_eq!(status, 401);
        let art = Artifact::Image(busybox_image(Compression::Gzip));
        let d = push_artifact(&target(&reg), &art, Some("latest"))
            .await
            .unwrap();
        assert!(reg.tokens_issued() > 0);
        // A bare GET without a token is refused...
        let url = format!("{}/v2/library/busybox/manifests/{d}", reg.url());
        let (status, _) = get(&url, None, vessel_images::oci::MT_OCI_MANIFEST, false).await;
        assert_eq!(status, 401);
        // ...and a token fetched from the realm opens it.
        let realm = reg.token_realm().unwrap();
        let (status, body) = get(
            &format!("{realm}?service={TOKEN_SERVICE}&scope=repository:library/busybox:pull"),
            None,
            "*/*",
            false,
        )
        .await;
        assert_eq!(status, 200);
        let tok: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let bearer = format!("Bearer {}", tok["token"].as_str().unwrap());
        let (status, body) = get(
            &url,
            Some(&bearer),
            vessel_images::oci::MT_OCI_MANIFEST,
            false,
        )
        .await;
        assert_eq!(status, 200, "{}", reg.log_tail());
        assert_eq!(Digest::of(&body), d);
        // The registry checks the signature: a tampered token is refused.
        let mut forged = bearer.into_bytes();
        let last = forged.len() - 3;
        forged[last] = if forged[last] == b'A' { b'B' } else { b'A' };
        let forged = String::from_utf8(forged).unwrap();
        let (status, _) = get(
            &url,
            Some(&forged),
            vessel_images::oci::MT_OCI_MANIFEST,
            false,
        )
        .await;
        assert_eq!(status, 401);
    }

    #[tokio::test]
    async fn token_registry_with_credentials_and_tls() {
        let reg = Registry::start(RegistryOptions {
            token_auth: true,
            htpasswd: creds(),
            tls: true,
        })
        .unwrap();
        let art = Artifact::Image(busybox_image(Compression::Gzip));
        let mut t = target(&reg);
        t.insecure_tls = true;
        let err = push_artifact(&t, &art, Some("latest")).await.unwrap_err();
        assert!(matches!(err, PushError::Token { .. }), "{err}");
        assert!(
            err.to_string().contains("invalid username or password"),
            "{err}"
        );
        t.basic_auth = creds();
        push_artifact(&t, &art, Some("latest")).await.unwrap();
    }
}
