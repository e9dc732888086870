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
//!   throw-away CA ([`Registry::ca_pem`]); with `mtls`, the registry also wants a client
//!   certificate from that CA (`http.tls.clientcas`), and issues one for the test;
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
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, KeyPair as _, ECDSA_P256_SHA256_FIXED_SIGNING};
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
    /// With `tls`: want a client certificate issued by the registry's CA (mutual TLS);
    /// [`Registry::client_cert_pem`] and [`Registry::client_key_pem`] are one.
    pub mtls: bool,
    /// Bearer-token auth through an in-process token server.
    pub token_auth: bool,
}

/// A running registry. Drop kills it and removes its files.
pub struct Registry {
    child: Child,
    port: u16,
    tls: bool,
    ca_pem: Option<String>,
    /// A client certificate and key the registry accepts (mTLS mode).
    client: Option<(String, String)>,
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
        let mut client = None;
        if opts.mtls && !opts.tls {
            return Err(invalid_input("mtls needs tls"));
        }
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
            if opts.mtls {
                let ca_path = dir.path().join("client-ca.pem");
                std::fs::write(&ca_path, &certs.ca_pem)?;
                let _ = writeln!(
                    tls_yaml,
                    "    clientcas:\n      - {}",
                    yaml_str(ca_path.display())
                );
                client = Some((certs.client_pem, certs.client_key_pem));
            }
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
            let identity = client.as_ref().map(|(c, k)| format!("{c}{k}"));
            match wait_ready(
                &mut child,
                &format!("{scheme}://127.0.0.1:{port}/v2/"),
                opts.tls,
                identity.as_deref(),
            ) {
                Ok(()) => {
                    return Ok(Registry {
                        child,
                        port,
                        tls: opts.tls,
                        ca_pem,
                        client,
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

    /// A client certificate (PEM) the registry accepts (mTLS mode).
    pub fn client_cert_pem(&self) -> Option<String> {
        self.client.as_ref().map(|c| c.0.clone())
    }

    /// The key (PEM) of [`Registry::client_cert_pem`].
    pub fn client_key_pem(&self) -> Option<String> {
        self.client.as_ref().map(|c| c.1.clone())
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
fn wait_ready(
    child: &mut Child,
    url: &str,
    tls: bool,
    identity: Option<&str>,
) -> Result<(), String> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("registry exited with {status}"));
        }
        let res = probe(url, tls, identity);
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
fn probe(url: &str, tls: bool, identity: Option<&str>) -> Result<u16, String> {
    let url = url.to_string();
    let identity = identity.map(str::to_string);
    let handle = std::thread::spawn(move || -> Result<u16, String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        rt.block_on(async {
            let mut b = reqwest::Client::builder()
                .danger_accept_invalid_certs(tls)
                .timeout(Duration::from_secs(2));
            if let Some(pem) = &identity {
                b = b.identity(
                    reqwest::Identity::from_pem(pem.as_bytes()).map_err(|e| e.to_string())?,
                );
            }
            let client = b.build().map_err(|e| e.to_string())?;
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
    client_pem: String,
    client_key_pem: String,
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

    let client_key = KeyPair::generate()?;
    let mut client_params = CertificateParams::new(Vec::<String>::new())?;
    client_params.distinguished_name = DistinguishedName::new();
    client_params
        .distinguished_name
        .push(DnType::CommonName, "vessel test node");
    client_params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    client_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let client = client_params.signed_by(&client_key, &ca, &ca_key)?;
    Ok(TlsCerts {
        ca_pem: ca.pem(),
        leaf_pem: leaf.pem(),
        leaf_key_pem: leaf_key.serialize_pem(),
        client_pem: client.pem(),
        client_key_pem: client_key.serialize_pem(),
    })
}

// ---------------------------------------------------------------------------------------------
// Token server

/// Signs registry JWTs: ES256 with a P-256 key generated by rcgen, whose self-signed
/// certificate goes into the registry's `rootcertbundle` and the JWT `x5c` header. The
/// signature itself is ring's ECDSA P-256/SHA-256 in the fixed `r || s` form JWS wants.
struct TokenSigner {
    cert_pem: String,
    cert_der_b64: String,
    key: EcdsaKeyPair,
    rng: SystemRandom,
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
        // rcgen cannot sign arbitrary bytes; ring signs with the same PKCS#8 key.
        let rng = SystemRandom::new();
        let key = EcdsaKeyPair::from_pkcs8(
            &ECDSA_P256_SHA256_FIXED_SIGNING,
            &key_pair.serialize_der(),
            &rng,
        )
        .map_err(|e| other(format!("token signing key: {e}")))?;
        if key.public_key().as_ref() != key_pair.public_key_raw() {
            return Err(other(
                "token signing key: ring's public key differs from the certificate's".to_string(),
            ));
        }
        Ok(TokenSigner {
            cert_pem: cert.pem(),
            cert_der_b64: base64::engine::general_purpose::STANDARD.encode(cert.der()),
            key,
            rng,
        })
    }

    fn sign_jwt(&self, claims: &serde_json::Value) -> std::io::Result<String> {
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
        let sig = self
            .key
            .sign(&self.rng, signing_input.as_bytes())
            .map_err(|_| other("signing the token failed".to_string()))?;
        Ok(format!("{signing_input}.{}", b64.encode(sig.as_ref())))
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
    let token = match s.signer.sign_jwt(&claims) {
        Ok(t) => t,
        Err(e) => {
            return respond(
                &mut w,
                "500 Internal Server Error",
                &[],
                &format!("{}\n", serde_json::json!({"details": e.to_string()})),
            )
        }
    };
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
            client_identity_pem: None,
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
        use ring::signature::{UnparsedPublicKey, ECDSA_P256_SHA256_FIXED};
        let signer = TokenSigner::generate().unwrap();
        let jwt = signer
            .sign_jwt(&serde_json::json!({"iss": TOKEN_ISSUER}))
            .unwrap();
        let parts: Vec<&str> = jwt.split('.').collect();
        assert_eq!(parts.len(), 3);
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let header: serde_json::Value =
            serde_json::from_slice(&b64.decode(parts[0]).unwrap()).unwrap();
        assert_eq!(header["alg"], "ES256");
        assert_eq!(header["x5c"][0], signer.cert_der_b64.as_str());
        // The x5c certificate carries the signing key's public point.
        let public = signer.key.public_key().as_ref().to_vec();
        let cert_der = base64::engine::general_purpose::STANDARD
            .decode(signer.cert_der_b64.as_str())
            .unwrap();
        assert!(cert_der.windows(public.len()).any(|w| w == public));
        // JWS ES256: fixed-size r || s, verifiable with the public key; tampering breaks it.
        let sig = b64.decode(parts[2]).unwrap();
        assert_eq!(sig.len(), 64);
        let input = format!("{}.{}", parts[0], parts[1]);
        let verifier = UnparsedPublicKey::new(&ECDSA_P256_SHA256_FIXED, &public);
        verifier.verify(input.as_bytes(), &sig).unwrap();
        let mut tampered_input = input.clone().into_bytes();
        tampered_input[0] ^= 1;
        assert!(verifier.verify(&tampered_input, &sig).is_err());
        let mut tampered_sig = sig.clone();
        tampered_sig[40] ^= 1;
        assert!(verifier.verify(input.as_bytes(), &tampered_sig).is_err());
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
            ..Default::default()
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
