//! `WWW-Authenticate` challenges (RFC 7235), as registries and their token servers send
//! them: read by the pull client and the push client alike.

/// One authentication challenge from a `WWW-Authenticate` header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    pub scheme: String,
    pub params: Vec<(String, String)>,
}

impl Challenge {
    /// A parameter by (case-insensitive) name.
    pub fn param(&self, name: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Parses a `WWW-Authenticate` value: one or more `Scheme k=v, k="quoted, value"` challenges.
pub fn parse_challenges(header: &str) -> Vec<Challenge> {
    let mut out: Vec<Challenge> = Vec::new();
    let b = header.as_bytes();
    let mut i = 0;
    let skip_ws = |i: &mut usize| {
        while *i < b.len() && (b[*i] == b' ' || b[*i] == b'\t') {
            *i += 1;
        }
    };
    let token_end = |mut j: usize| {
        while j < b.len() && !matches!(b[j], b' ' | b'\t' | b',' | b'=') {
            j += 1;
        }
        j
    };
    while i < b.len() {
        skip_ws(&mut i);
        while i < b.len() && b[i] == b',' {
            i += 1;
            skip_ws(&mut i);
        }
        if i >= b.len() {
            break;
        }
        let start = i;
        let end = token_end(i);
        let word = &header[start..end];
        let mut j = end;
        skip_ws(&mut j);
        if j < b.len() && b[j] == b'=' && !out.is_empty() {
            // A parameter of the current challenge.
            j += 1;
            skip_ws(&mut j);
            let value = if j < b.len() && b[j] == b'"' {
                j += 1;
                let mut v = String::new();
                let mut chars = header[j..].char_indices();
                let mut consumed = header.len() - j;
                while let Some((k, ch)) = chars.next() {
                    match ch {
                        '\\' => {
                            if let Some((_, n)) = chars.next() {
                                v.push(n);
                            }
                        }
                        '"' => {
                            consumed = k + 1;
                            break;
                        }
                        c => v.push(c),
                    }
                }
                j += consumed;
                v
            } else {
                let e = {
                    let mut e = j;
                    while e < b.len() && b[e] != b',' && b[e] != b' ' && b[e] != b'\t' {
                        e += 1;
                    }
                    e
                };
                let v = header[j..e].to_string();
                j = e;
                v
            };
            if let Some(c) = out.last_mut() {
                c.params.push((word.to_string(), value));
            }
            i = j;
        } else if word.is_empty() {
            // Stray `=`: skip it.
            i = end + 1;
        } else {
            out.push(Challenge {
                scheme: word.to_string(),
                params: Vec::new(),
            });
            i = end;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_challenges() {
        let c = parse_challenges(
            r#"Bearer realm="http://127.0.0.1:1/token",service="reg",scope="repository:library/busybox:pull,push""#,
        );
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].scheme, "Bearer");
        assert_eq!(c[0].param("realm"), Some("http://127.0.0.1:1/token"));
        assert_eq!(c[0].param("service"), Some("reg"));
        assert_eq!(
            c[0].param("scope"),
            Some("repository:library/busybox:pull,push")
        );

        let c = parse_challenges(r#"Basic realm="vessel \"test\"", Bearer realm=x,service=y"#);
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].scheme, "Basic");
        assert_eq!(c[0].param("realm"), Some("vessel \"test\""));
        assert_eq!(c[1].param("realm"), Some("x"));
        assert_eq!(c[1].param("SERVICE"), Some("y"));

        assert!(parse_challenges("").is_empty());
        assert_eq!(parse_challenges("Basic")[0].scheme, "Basic");
        // Garbage does not panic.
        for g in [
            "=",
            "a=\"",
            "Basic realm=\"unterminated",
            ",,, =,=",
            "Bearer realm=\"é\\",
        ] {
            let _ = parse_challenges(g);
        }
    }

    #[test]
    fn parses_docker_hub_challenge() {
        let c = parse_challenges(
            r#"Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/busybox:pull""#,
        );
        assert!(c[0].scheme.eq_ignore_ascii_case("bearer"));
        assert_eq!(c[0].param("realm"), Some("https://auth.docker.io/token"));
        assert_eq!(c[0].param("service"), Some("registry.docker.io"));
        assert_eq!(c[0].param("scope"), Some("repository:library/busybox:pull"));
        let b = parse_challenges(r#"Basic realm="basic-realm""#);
        assert!(b[0].scheme.eq_ignore_ascii_case("basic"));
        assert_eq!(b[0].param("realm"), Some("basic-realm"));
    }
}
