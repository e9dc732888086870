//! Pushing test artifacts to a registry over the OCI distribution API.
//!
//! Used by tests and benches to fill a real registry. Blobs are checked with `HEAD` and, when
//! missing, uploaded monolithically (`POST .../blobs/uploads/` then `PUT <location>?digest=`);
//! then manifests are put by digest, an index after the manifests it references, and finally
//! the top manifest or index by tag. A `401` is answered once per request: `Basic` challenges
//! with the configured credentials, `Bearer` challenges with a token fetched from the realm.

pub use crate::challenge::{parse_challenges, Challenge};
use crate::digest::Digest;
use crate::testimages::{Artifact, Blob, BuiltImage};
use base64::Engine as _;
use bytes::Bytes;
use reqwest::header::{
    HeaderMap, HeaderValue, AUTHORIZATION, CONTENT_TYPE, LOCATION, WWW_AUTHENTICATE,
};
use reqwest::{Method, StatusCode, Url};

/// Where to push.
#[derive(Debug, Clone, Default)]
pub struct PushTarget {
    /// `http://127.0.0.1:5000` or `https://...`, without `/v2`.
    pub base_url: String,
    /// e.g. `library/busybox`.
    pub repository: String,
    /// Username and password, for `Basic` challenges and token requests.
    pub basic_auth: Option<(String, String)>,
    /// Accept any server certificate (self-signed test registries).
    pub insecure_tls: bool,
    /// A client certificate and its key, in one PEM, for registries that want mutual TLS.
    pub client_identity_pem: Option<String>,
}

impl PushTarget {
    /// An anonymous target.
    pub fn new(base_url: &str, repository: &str) -> PushTarget {
        PushTarget {
            base_url: base_url.to_string(),
            repository: repository.to_string(),
            basic_auth: None,
            insecure_tls: false,
            client_identity_pem: None,
        }
    }
}

/// Why a push failed. Registry answers keep their status and body.
#[derive(Debug, thiserror::Error)]
pub enum PushError {
    #[error("building the HTTP client: {0}")]
    Client(#[source] reqwest::Error),
    #[error("invalid URL {url:?}: {reason}")]
    Url { url: String, reason: String },
    #[error("{method} {url}: {source}")]
    Transport {
        method: String,
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{method} {url}: registry answered {status}: {body}")]
    Status {
        method: String,
        url: String,
        status: u16,
        body: String,
    },
    #[error("{method} {url}: authentication failed: {reason}")]
    Auth {
        method: String,
        url: String,
        reason: String,
    },
    #[error("token request {url}: {reason}")]
    Token { url: String, reason: String },
    #[error("{method} {url}: {reason}")]
    Protocol {
        method: String,
        url: String,
        reason: String,
    },
}

impl PushError {
    /// The HTTP status of a registry (or token server) answer that failed the push, if any.
    pub fn status(&self) -> Option<u16> {
        match self {
            PushError::Status { status, .. } => Some(*status),
            PushError::Auth { .. } => Some(401),
            _ => None,
        }
    }
}

/// Pushes every blob and manifest of `artifact` to `t`, then tags the top manifest or index
/// with `tag` when given. Returns the top digest.
pub async fn push_artifact(
    t: &PushTarget,
    artifact: &Artifact,
    tag: Option<&str>,
) -> Result<Digest, PushError> {
    let mut s = Session::new(t)?;
    for img in artifact.images() {
        s.push_image_content(img).await?;
    }
    let top = artifact.top();
    if let Artifact::Index { index, .. } = artifact {
        s.put_manifest(index, index.digest().as_str()).await?;
    }
    if let Some(tag) = tag {
        s.put_manifest(top, tag).await?;
    }
    Ok(top.digest())
}

/// Pushes one image (blobs, manifest by digest, then `tag`).
pub async fn push_image(
    t: &PushTarget,
    img: &BuiltImage,
    tag: Option<&str>,
) -> Result<Digest, PushError> {
    let mut s = Session::new(t)?;
    s.push_image_content(img).await?;
    if let Some(tag) = tag {
        s.put_manifest(&img.manifest, tag).await?;
    }
    Ok(img.manifest_digest())
}

/// Pushes one blob (skipped when the registry has it). Returns whether it was uploaded.
pub async fn push_blob(t: &PushTarget, blob: &Blob) -> Result<bool, PushError> {
    Session::new(t)?.push_blob(blob).await
}

struct Session<'a> {
    t: &'a PushTarget,
    client: reqwest::Client,
    base: Url,
    /// The `Authorization` value that last worked (or was last obtained).
    auth: Option<HeaderValue>,
}

impl<'a> Session<'a> {
    fn new(t: &'a PushTarget) -> Result<Session<'a>, PushError> {
        let mut b = reqwest::Client::builder()
            .danger_accept_invalid_certs(t.insecure_tls)
            .user_agent(concat!("vessel-testpush/", env!("CARGO_PKG_VERSION")));
        if let Some(pem) = &t.client_identity_pem {
            b = b.identity(reqwest::Identity::from_pem(pem.as_bytes()).map_err(PushError::Client)?);
        }
        let client = b.build().map_err(PushError::Client)?;
        let trimmed = t.base_url.trim_end_matches('/');
        let base = Url::parse(&format!("{trimmed}/")).map_err(|e| PushError::Url {
            url: t.base_url.clone(),
            reason: e.to_string(),
        })?;
        if base.scheme() != "http" && base.scheme() != "https" {
            return Err(PushError::Url {
                url: t.base_url.clone(),
                reason: "scheme must be http or https".to_string(),
            });
        }
        if t.repository.is_empty() || t.repository.starts_with('/') || t.repository.ends_with('/') {
            return Err(PushError::Url {
                url: t.base_url.clone(),
                reason: format!("invalid repository name {:?}", t.repository),
            });
        }
        Ok(Session {
            t,
            client,
            base,
            auth: None,
        })
    }

    fn url(&self, rest: &str) -> Result<Url, PushError> {
        let s = format!("v2/{}/{rest}", self.t.repository);
        self.base.join(&s).map_err(|e| PushError::Url {
            url: format!("{}{s}", self.base),
            reason: e.to_string(),
        })
    }

    async fn push_image_content(&mut self, img: &BuiltImage) -> Result<(), PushError> {
        for blob in img.blobs() {
            self.push_blob(blob).await?;
        }
        self.put_manifest(&img.manifest, img.manifest_digest().as_str())
            .await
    }

    async fn push_blob(&mut self, blob: &Blob) -> Result<bool, PushError> {
        let digest = blob.digest();
        let url = self.url(&format!("blobs/{digest}"))?;
        let resp = self
            .send(Method::HEAD, url.clone(), HeaderMap::new(), None)
            .await?;
        match resp.status() {
            StatusCode::OK => return Ok(false),
            StatusCode::NOT_FOUND => {}
            _ => return Err(status_error(Method::HEAD, &url, resp).await),
        }

        let url = self.url("blobs/uploads/")?;
        let resp = self
            .send(
                Method::POST,
                url.clone(),
                HeaderMap::new(),
                Some(Bytes::new()),
            )
            .await?;
        if resp.status() != StatusCode::ACCEPTED {
            return Err(status_error(Method::POST, &url, resp).await);
        }
        let location = resp
            .headers()
            .get(LOCATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| PushError::Protocol {
                method: "POST".to_string(),
                url: url.to_string(),
                reason: "upload started (202) without a Location header".to_string(),
            })?
            .to_string();
        // A relative Location resolves against the URL it answered.
        let mut put = url.join(&location).map_err(|e| PushError::Url {
            url: location.clone(),
            reason: e.to_string(),
        })?;
        put.query_pairs_mut().append_pair("digest", digest.as_str());

        let mut headers = HeaderMap::new();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/octet-stream"),
        );
        let resp = self
            .send(
                Method::PUT,
                put.clone(),
                headers,
                Some(Bytes::from(blob.data.clone())),
            )
            .await?;
        if resp.status() != StatusCode::CREATED {
            return Err(status_error(Method::PUT, &put, resp).await);
        }
        check_digest_header(&resp, &digest, &put)?;
        Ok(true)
    }

    async fn put_manifest(&mut self, manifest: &Blob, reference: &str) -> Result<(), PushError> {
        let url = self.url(&format!("manifests/{reference}"))?;
        let mut headers = HeaderMap::new();
        let ct = HeaderValue::from_str(&manifest.media_type).map_err(|_| PushError::Protocol {
            method: "PUT".to_string(),
            url: url.to_string(),
            reason: format!(
                "media type {:?} is not a valid header value",
                manifest.media_type
            ),
        })?;
        headers.insert(CONTENT_TYPE, ct);
        let resp = self
            .send(
                Method::PUT,
                url.clone(),
                headers,
                Some(Bytes::from(manifest.data.clone())),
            )
            .await?;
        if resp.status() != StatusCode::CREATED {
            return Err(status_error(Method::PUT, &url, resp).await);
        }
        check_digest_header(&resp, &manifest.digest(), &url)
    }

    /// Sends a request, answering one `401` challenge by (re)authenticating and retrying.
    async fn send(
        &mut self,
        method: Method,
        url: Url,
        headers: HeaderMap,
        body: Option<Bytes>,
    ) -> Result<reqwest::Response, PushError> {
        let mut retried = false;
        loop {
            let mut rb = self
                .client
                .request(method.clone(), url.clone())
                .headers(headers.clone());
            if let Some(a) = &self.auth {
                rb = rb.header(AUTHORIZATION, a.clone());
            }
            if let Some(b) = &body {
                rb = rb.body(b.clone());
            }
            let resp = rb.send().await.map_err(|e| PushError::Transport {
                method: method.to_string(),
                url: url.to_string(),
                source: e,
            })?;
            if resp.status() != StatusCode::UNAUTHORIZED || retried {
                return Ok(resp);
            }
            retried = true;
            let challenges: Vec<String> = resp
                .headers()
                .get_all(WWW_AUTHENTICATE)
                .iter()
                .filter_map(|v| v.to_str().ok().map(str::to_string))
                .collect();
            let body_text = read_body(resp).await;
            let new_auth = self
                .authenticate(&challenges)
                .await
                .map_err(|reason| match reason {
                    AuthFailure::Token(e) => e,
                    AuthFailure::Other(reason) => PushError::Auth {
                        method: method.to_string(),
                        url: url.to_string(),
                        reason: format!("{reason}; registry said: {body_text}"),
                    },
                })?;
            if self.auth.as_ref() == Some(&new_auth) {
                // Same credentials again would get the same answer.
                return Err(PushError::Auth {
                    method: method.to_string(),
                    url: url.to_string(),
                    reason: format!("credentials rejected; registry said: {body_text}"),
                });
            }
            self.auth = Some(new_auth);
        }
    }

    async fn authenticate(&self, challenges: &[String]) -> Result<HeaderValue, AuthFailure> {
        let parsed: Vec<Challenge> = challenges
            .iter()
            .flat_map(|c| parse_challenges(c))
            .collect();
        if parsed.is_empty() {
            return Err(AuthFailure::Other(
                "401 without a usable WWW-Authenticate challenge".to_string(),
            ));
        }
        if let Some(b) = parsed
            .iter()
            .find(|c| c.scheme.eq_ignore_ascii_case("bearer"))
        {
            return self.fetch_token(b).await;
        }
        if parsed
            .iter()
            .any(|c| c.scheme.eq_ignore_ascii_case("basic"))
        {
            let Some((user, pass)) = &self.t.basic_auth else {
                return Err(AuthFailure::Other(
                    "registry wants Basic credentials and none were given".to_string(),
                ));
            };
            return Ok(basic_header(user, pass));
        }
        Err(AuthFailure::Other(format!(
            "unsupported authentication scheme(s): {}",
            challenges.join(" | ")
        )))
    }

    async fn fetch_token(&self, c: &Challenge) -> Result<HeaderValue, AuthFailure> {
        let realm = c
            .param("realm")
            .ok_or_else(|| AuthFailure::Other("Bearer challenge without a realm".to_string()))?;
        let token_err = |url: &str, reason: String| {
            AuthFailure::Token(PushError::Token {
                url: url.to_string(),
                reason,
            })
        };
        let mut url =
            Url::parse(realm).map_err(|e| token_err(realm, format!("invalid realm: {e}")))?;
        {
            let mut q = url.query_pairs_mut();
            if let Some(service) = c.param("service") {
                q.append_pair("service", service);
            }
            if let Some(scope) = c.param("scope") {
                for s in scope.split(' ').filter(|s| !s.is_empty()) {
                    q.append_pair("scope", s);
                }
            }
        }
        let mut rb = self.client.get(url.clone());
        if let Some((user, pass)) = &self.t.basic_auth {
            rb = rb.basic_auth(user, Some(pass));
        }
        let resp = rb
            .send()
            .await
            .map_err(|e| token_err(url.as_str(), e.to_string()))?;
        let status = resp.status();
        let body = read_body(resp).await;
        if !status.is_success() {
            return Err(token_err(
                url.as_str(),
                format!("answered {status}: {body}"),
            ));
        }
        #[derive(serde::Deserialize)]
        struct TokenResponse {
            token: Option<String>,
            access_token: Option<String>,
        }
        let tr: TokenResponse = serde_json::from_str(&body)
            .map_err(|e| token_err(url.as_str(), format!("invalid JSON ({e}): {body}")))?;
        let token = tr
            .token
            .filter(|t| !t.is_empty())
            .or(tr.access_token.filter(|t| !t.is_empty()))
            .ok_or_else(|| token_err(url.as_str(), format!("no token in answer: {body}")))?;
        HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| {
            token_err(
                url.as_str(),
                "token is not a valid header value".to_string(),
            )
        })
    }
}

enum AuthFailure {
    Token(PushError),
    Other(String),
}

fn basic_header(user: &str, pass: &str) -> HeaderValue {
    let enc = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}"));
    // Base64 output is always a valid header value.
    HeaderValue::from_str(&format!("Basic {enc}")).unwrap_or(HeaderValue::from_static("Basic"))
}

async fn read_body(resp: reqwest::Response) -> String {
    match resp.text().await {
        Ok(t) => {
            let t = t.trim();
            if t.len() > 4096 {
                let mut end = 4096;
                while !t.is_char_boundary(end) {
                    end -= 1;
                }
                format!("{}...", &t[..end])
            } else if t.is_empty() {
                "(empty body)".to_string()
            } else {
                t.to_string()
            }
        }
        Err(e) => format!("(body unreadable: {e})"),
    }
}

async fn status_error(method: Method, url: &Url, resp: reqwest::Response) -> PushError {
    let status = resp.status().as_u16();
    PushError::Status {
        method: method.to_string(),
        url: url.to_string(),
        status,
        body: read_body(resp).await,
    }
}

fn check_digest_header(
    resp: &reqwest::Response,
    want: &Digest,
    url: &Url,
) -> Result<(), PushError> {
    if let Some(got) = resp
        .headers()
        .get("docker-content-digest")
        .and_then(|v| v.to_str().ok())
    {
        if got != want.as_str() {
            return Err(PushError::Protocol {
                method: "PUT".to_string(),
                url: url.to_string(),
                reason: format!("registry stored digest {got}, expected {want}"),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_targets() {
        let t = PushTarget::new("ftp://x", "a/b");
        assert!(matches!(Session::new(&t), Err(PushError::Url { .. })));
        let t = PushTarget::new("http://127.0.0.1:5000/", "");
        assert!(matches!(Session::new(&t), Err(PushError::Url { .. })));
        let t = PushTarget::new("http://127.0.0.1:5000/", "library/busybox");
        let s = Session::new(&t).unwrap();
        assert_eq!(
            s.url("blobs/uploads/").unwrap().as_str(),
            "http://127.0.0.1:5000/v2/library/busybox/blobs/uploads/"
        );
    }

    #[tokio::test]
    async fn unreachable_registry_is_a_transport_error() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        let t = PushTarget::new(&format!("http://127.0.0.1:{port}"), "x/y");
        let img = crate::testimages::escape_image(crate::testimages::EscapeKind::DotDot);
        let err = push_image(&t, &img, Some("t")).await.unwrap_err();
        assert!(matches!(err, PushError::Transport { .. }), "{err}");
    }
}
