//! Upstream `critest` (cri-tools) against vessel: locating the tools and their stand-in
//! images, serving the images, running critest, and checking its JSON report against a
//! committed list of expected outcomes.
//!
//! The list (`critest/upstream/<mode>.expected`) has one line per spec that may not pass:
//!
//! ```text
//! fail | <full spec name> | <why>
//! skip | <full spec name> | <why>
//! ```
//!
//! Every spec not listed must pass. A listed spec must end as listed: one that passes (or
//! otherwise ends differently) fails the check, so the list only shrinks.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where `shared/cri-tools` is: `VESSEL_CRI_TOOLS_SRC`, or `../shared/cri-tools` beside the
/// repository (how CI checks it out).
pub fn shared_dir() -> Option<PathBuf> {
    if let Ok(d) = std::env::var("VESSEL_CRI_TOOLS_SRC") {
        return Some(PathBuf::from(d));
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent()?;
    let d = repo.parent()?.join("shared/cri-tools");
    d.join("build.sh").exists().then_some(d)
}

fn last_line_of(cmd: &mut Command) -> Result<PathBuf, String> {
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{cmd:?} failed: {}", out.status));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .map(|l| PathBuf::from(l.trim()))
        .ok_or_else(|| format!("{cmd:?} printed nothing"))
}

/// The directory holding `critest` and `crictl` (`VESSEL_CRI_TOOLS_BIN`, or built and cached
/// by `shared/cri-tools/build.sh`: `scripts/test.sh` builds them before the tests start).
pub fn tools_bin(shared: &Path) -> Result<PathBuf, String> {
    if let Ok(d) = std::env::var("VESSEL_CRI_TOOLS_BIN") {
        return Ok(PathBuf::from(d));
    }
    last_line_of(Command::new("bash").arg(shared.join("build.sh")))
}

/// The stand-in images' directory (`VESSEL_CRI_TOOLS_IMAGES`, or `images/build.sh`).
pub fn images_dir(shared: &Path) -> Result<PathBuf, String> {
    if let Ok(d) = std::env::var("VESSEL_CRI_TOOLS_IMAGES") {
        return Ok(PathBuf::from(d));
    }
    last_line_of(Command::new("bash").arg(shared.join("images/build.sh")))
}

/// The registry hosts critest's images name; each gets the stand-in registry as its mirror.
pub const IMAGE_HOSTS: &[&str] = &[
    "registry.k8s.io",
    "k8s.gcr.io",
    "gcr.io",
    "public.ecr.aws",
    "docker.io",
];

/// `registry.py` serving the stand-in images on 127.0.0.1. Dropping it stops it.
pub struct StandInRegistry {
    child: Child,
    pub port: u16,
}

impl StandInRegistry {
    /// Started on a free port. Ready when `GET /v2/` there is answered by a registry, not
    /// when anything accepts a connection: registry.py that lost its port to another test's
    /// listener between the probe and its bind exits, and the port then belongs to that one
    /// (a vesseld's streaming server answered a pull with 404 once). Then it is started again
    /// on another port.
    pub fn start(shared: &Path, images: &Path) -> Result<StandInRegistry, String> {
        let mut last = String::new();
        for _ in 0..5 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(|e| e.to_string())?
                .port();
            let child = Command::new("python3")
                .arg(shared.join("images/registry.py"))
                .arg(images.join("registry"))
                .arg(port.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| format!("starting registry.py: {e}"))?;
            let mut r = StandInRegistry { child, port };
            let start = Instant::now();
            loop {
                if let Ok(Some(s)) = r.child.try_wait() {
                    last = format!("registry.py on port {port} exited with {s}");
                    break;
                }
                if answers_as_registry(port) {
                    return Ok(r);
                }
                if start.elapsed() > Duration::from_secs(20) {
                    return Err(format!("registry.py did not answer on {port} within 20 s"));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Err(last)
    }

    /// vesseld's `[images.registries]` tables sending every critest image host here.
    pub fn mirrors_toml(&self) -> String {
        mirrors_toml(self.port)
    }
}

/// Whether `GET /v2/` on 127.0.0.1:`port` is answered 200 by a distribution registry.
fn answers_as_registry(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /v2/ HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut head = Vec::new();
    let _ = s.take(4096).read_to_end(&mut head);
    let head = String::from_utf8_lossy(&head);
    (head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"))
        && head
            .to_ascii_lowercase()
            .contains("docker-distribution-api-version: registry/2.0")
}

/// vesseld's `[images.registries]` tables sending every critest image host to a registry on
/// 127.0.0.1:`port`.
pub fn mirrors_toml(port: u16) -> String {
    IMAGE_HOSTS
        .iter()
        .map(|h| {
            format!(
                "[images.registries.\"{h}\"]\nmirrors = [\"http://127.0.0.1:{port}\"]\nmirrors_only = true\ninsecure = true\n"
            )
        })
        .collect()
}

/// The images of an OCI layout (`images/build.sh`'s `oci/`): each single-platform manifest of
/// `index.json` with the name in its `io.containerd.image.name` annotation, and its blobs.
pub fn oci_layout_images(
    dir: &Path,
) -> Result<Vec<(String, vessel_images::testimages::BuiltImage)>, String> {
    use vessel_images::testimages::{Blob, BuiltImage};
    let read = |p: PathBuf| std::fs::read(&p).map_err(|e| format!("{}: {e}", p.display()));
    let json = |data: &[u8], what: &str| -> Result<serde_json::Value, String> {
        serde_json::from_slice(data).map_err(|e| format!("{what}: {e}"))
    };
    let blob = |desc: &serde_json::Value| -> Result<Blob, String> {
        let digest = desc["digest"].as_str().unwrap_or_default();
        let hex = digest
            .strip_prefix("sha256:")
            .ok_or_else(|| format!("unsupported digest {digest:?}"))?;
        let data = read(dir.join("blobs/sha256").join(hex))?;
        Ok(Blob::new(
            desc["mediaType"].as_str().unwrap_or_default(),
            data,
        ))
    };
    let index = json(&read(dir.join("index.json"))?, "index.json")?;
    let mut out = Vec::new();
    for m in index["manifests"].as_array().into_iter().flatten() {
        let Some(name) = m["annotations"]["io.containerd.image.name"].as_str() else {
            continue;
        };
        let manifest = blob(m)?;
        let parsed = json(&manifest.data, name)?;
        let Some(layers) = parsed["layers"].as_array() else {
            continue; // an index: not a stand-in critest needs offline
        };
        let img = BuiltImage {
            config: blob(&parsed["config"])?,
            layers: layers.iter().map(&blob).collect::<Result<_, _>>()?,
            manifest,
            diff_ids: Vec::new(),
        };
        out.push((name.to_string(), img));
    }
    Ok(out)
}

/// Where critest's images come from: `registry.py` over the stand-in blob store, or (where
/// there is no Python, as in the nested VM harness's L1) a `docker-registry` on 127.0.0.1 into
/// which the stand-ins' OCI layout (`VESSEL_CRI_TOOLS_OCI`) was pushed.
pub enum StandIns {
    Py(StandInRegistry),
    Pushed(Box<crate::registry::Registry>),
}

impl StandIns {
    /// The registry's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        match self {
            StandIns::Py(r) => r.port,
            StandIns::Pushed(r) => r.port(),
        }
    }

    pub fn mirrors_toml(&self) -> String {
        match self {
            StandIns::Py(r) => r.mirrors_toml(),
            StandIns::Pushed(r) => mirrors_toml(r.port()),
        }
    }

    /// Starts a `docker-registry` and pushes every image of the OCI layout at `oci` into it,
    /// under its name without the registry host (as the mirrors ask for it).
    pub fn pushed(oci: &Path) -> Result<StandIns, String> {
        use vessel_images::push::{push_image, PushTarget};
        let images = oci_layout_images(oci)?;
        let reg = crate::registry::Registry::start(crate::registry::RegistryOptions::default())
            .map_err(|e| format!("docker-registry: {e}"))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        for (name, img) in &images {
            let rest = name.split_once('/').map(|(_, r)| r).unwrap_or(name);
            let (repo, tag) = rest.rsplit_once(':').unwrap_or((rest, "latest"));
            rt.block_on(push_image(
                &PushTarget::new(&reg.url(), repo),
                img,
                Some(tag),
            ))
            .map_err(|e| format!("pushing {name}: {e}"))?;
        }
        Ok(StandIns::Pushed(Box::new(reg)))
    }
}

impl Drop for StandInRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A vesseld running flat pods on a private CNI network, with every critest image host
/// mirrored to the stand-in registry, and the directory of upstream `critest` and `crictl`.
pub struct Fixture {
    pub bin: PathBuf,
    pub vesseld: crate::daemon::Vesseld,
    pub cni: crate::daemon::TestCni,
    pub registry: StandIns,
}

impl Fixture {
    /// Starts it for the test `name`, or prints `SKIP <name>: <reason>` and returns `None`
    /// when this machine cannot (not root, no `shared/cri-tools`). `vesseld` is the binary.
    pub fn start(name: &str, vesseld: &Path) -> Option<Fixture> {
        Self::start_with(name, vesseld, "[runtime]\ndefault_handler = \"flat\"\n")
    }

    /// As [`Fixture::start`], with `config` (TOML) at the head of vesseld's config. With
    /// `VESSEL_CRI_TOOLS_BIN` and `VESSEL_CRI_TOOLS_OCI` set, no `shared/cri-tools` is needed
    /// (the nested VM harness stages both).
    pub fn start_with(name: &str, vesseld: &Path, config: &str) -> Option<Fixture> {
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            println!("SKIP {name}: needs root (pods, mounts, cgroups)");
            return None;
        }
        let staged = std::env::var_os("VESSEL_CRI_TOOLS_OCI").map(PathBuf::from);
        let (bin, registry) = match (&staged, std::env::var_os("VESSEL_CRI_TOOLS_BIN")) {
            (Some(oci), Some(bin)) => (
                PathBuf::from(bin),
                StandIns::pushed(oci).expect("critest's stand-in images pushed to docker-registry"),
            ),
            _ => {
                let Some(shared) = shared_dir() else {
                    println!(
                        "SKIP {name}: ../shared/cri-tools not found (set VESSEL_CRI_TOOLS_SRC)"
                    );
                    return None;
                };
                let bin = tools_bin(&shared).expect("upstream critest and crictl");
                let images = images_dir(&shared).expect("critest's stand-in images");
                let registry = StandInRegistry::start(&shared, &images).expect("stand-in registry");
                (bin, StandIns::Py(registry))
            }
        };
        let cni = crate::daemon::TestCni::new().expect("CNI plugins");
        let vesseld = crate::daemon::Vesseld::start(
            vesseld,
            &format!("{config}{}{}", cni.config_toml(), registry.mirrors_toml()),
        )
        .expect("vesseld");
        Some(Fixture {
            bin,
            vesseld,
            cni,
            registry,
        })
    }

    /// The CRI endpoint, as critest and crictl take it.
    pub fn endpoint(&self) -> String {
        format!("unix://{}", self.vesseld.socket.display())
    }
}

/// How one spec ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    Pass,
    Fail,
    Skip,
}

impl Outcome {
    fn word(self) -> &'static str {
        match self {
            Outcome::Pass => "pass",
            Outcome::Fail => "fail",
            Outcome::Skip => "skip",
        }
    }
}

/// One spec of a ginkgo JSON report.
#[derive(Debug, Clone)]
pub struct SpecResult {
    pub name: String,
    pub outcome: Outcome,
    /// The failure message (first lines), for failures.
    pub message: String,
    pub seconds: f64,
}

/// The specs of a ginkgo v2 JSON report (`-ginkgo.json-report`): the full name is the
/// container texts and the leaf text joined by spaces, as `-ginkgo.focus` matches it.
pub fn parse_report(json: &str) -> Result<Vec<SpecResult>, String> {
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for suite in v.as_array().ok_or("report is not an array")? {
        for s in suite["SpecReports"].as_array().into_iter().flatten() {
            // Suite set-up nodes (BeforeSuite, ...) have no leaf of kind "It".
            if s["LeafNodeType"].as_str() != Some("It") {
                continue;
            }
            let mut parts: Vec<String> = s["ContainerHierarchyTexts"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t.as_str().map(str::to_string))
                .collect();
            parts.push(s["LeafNodeText"].as_str().unwrap_or_default().to_string());
            let outcome = match s["State"].as_str().unwrap_or_default() {
                "passed" => Outcome::Pass,
                "skipped" | "pending" => Outcome::Skip,
                _ => Outcome::Fail,
            };
            let message = s["Failure"]["Message"]
                .as_str()
                .unwrap_or_default()
                .lines()
                .take(6)
                .collect::<Vec<_>>()
                .join(" / ");
            out.push(SpecResult {
                name: parts.join(" "),
                outcome,
                message,
                seconds: s["RunTime"].as_f64().unwrap_or(0.0) / 1e9,
            });
        }
    }
    Ok(out)
}

/// An expected non-pass, with its reason.
#[derive(Debug, Clone)]
pub struct Expected {
    pub outcome: Outcome,
    pub reason: String,
}

/// Parses an expected-outcomes list (see the module doc).
pub fn parse_expected(text: &str) -> Result<BTreeMap<String, Expected>, String> {
    let mut m = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let f: Vec<&str> = line.splitn(3, " | ").collect();
        let outcome = match f.first().copied() {
            Some("fail") => Outcome::Fail,
            Some("skip") => Outcome::Skip,
            _ => {
                return Err(format!(
                    "line {}: starts with neither `fail |` nor `skip |`",
                    i + 1
                ))
            }
        };
        if f.len() != 3 || f[2].trim().is_empty() {
            return Err(format!("line {}: want `{} | <spec> | <why>`", i + 1, f[0]));
        }
        let name = f[1].trim().to_string();
        if m.insert(
            name.clone(),
            Expected {
                outcome,
                reason: f[2].trim().to_string(),
            },
        )
        .is_some()
        {
            return Err(format!("line {}: {name:?} listed twice", i + 1));
        }
    }
    Ok(m)
}

/// What a run came to against the list.
#[derive(Debug, Default)]
pub struct Verdict {
    pub passed: usize,
    pub failed: usize,
    pub skipped: usize,
    /// Specs that ended otherwise than the list says (not listed and not passing, or listed
    /// and ending differently), with what happened.
    pub unexpected: Vec<String>,
    /// Listed specs the run did not have at all (renamed upstream, or a typo).
    pub unknown: Vec<String>,
}

impl Verdict {
    pub fn ok(&self) -> bool {
        self.unexpected.is_empty() && self.unknown.is_empty()
    }
}

pub fn judge(specs: &[SpecResult], expected: &BTreeMap<String, Expected>) -> Verdict {
    let mut v = Verdict::default();
    for s in specs {
        match s.outcome {
            Outcome::Pass => v.passed += 1,
            Outcome::Fail => v.failed += 1,
            Outcome::Skip => v.skipped += 1,
        }
        let want = expected
            .get(&s.name)
            .map(|e| e.outcome)
            .unwrap_or(Outcome::Pass);
        if s.outcome != want {
            let hint = match (want, s.outcome) {
                (Outcome::Pass, _) => String::new(),
                (_, Outcome::Pass) => " (now passes: take it off the list)".into(),
                _ => format!(" (listed as {})", want.word()),
            };
            let msg = if s.message.is_empty() {
                String::new()
            } else {
                format!(": {}", s.message)
            };
            v.unexpected.push(format!(
                "{} {}{hint}{msg}",
                s.outcome.word().to_uppercase(),
                s.name
            ));
        }
    }
    for name in expected.keys() {
        if !specs.iter().any(|s| &s.name == name) {
            v.unknown.push(name.clone());
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stand-in registry is ready when a registry answers, not when any listener does
    /// (a vesseld's streaming server held its port once, and answered the pulls).
    #[test]
    fn only_a_registry_answers_as_one() {
        let serve = |reply: &'static str| {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let port = l.local_addr().unwrap().port();
            std::thread::spawn(move || {
                use std::io::{Read, Write};
                if let Ok((mut c, _)) = l.accept() {
                    let mut buf = [0u8; 1024];
                    let _ = c.read(&mut buf);
                    let _ = c.write_all(reply.as_bytes());
                }
            });
            port
        };
        let streaming = serve("HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n");
        assert!(!answers_as_registry(streaming));
        let other = serve("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
        assert!(!answers_as_registry(other));
        let registry = serve(
            "HTTP/1.0 200 OK\r\nDocker-Distribution-API-Version: registry/2.0\r\nContent-Length: 2\r\n\r\n{}",
        );
        assert!(answers_as_registry(registry));
    }

    const REPORT: &str = r#"[{"SpecReports":[
      {"LeafNodeType":"BeforeSuite","State":"passed"},
      {"LeafNodeType":"It","ContainerHierarchyTexts":["[k8s.io] Container","runtime should support"],
       "LeafNodeText":"starting container [Conformance]","State":"passed","RunTime":2000000000},
      {"LeafNodeType":"It","ContainerHierarchyTexts":["[k8s.io] Attach"],"LeafNodeText":"runs",
       "State":"failed","Failure":{"Message":"boom\nmore"}},
      {"LeafNodeType":"It","ContainerHierarchyTexts":["[k8s.io] AppArmor"],"LeafNodeText":"x",
       "State":"skipped"},
      {"LeafNodeType":"It","ContainerHierarchyTexts":["[k8s.io] Fixed"],"LeafNodeText":"y",
       "State":"passed"}
    ]}]"#;

    #[test]
    fn report_names_and_outcomes() {
        let specs = parse_report(REPORT).unwrap();
        assert_eq!(specs.len(), 4);
        assert_eq!(
            specs[0].name,
            "[k8s.io] Container runtime should support starting container [Conformance]"
        );
        assert_eq!(specs[0].seconds, 2.0);
        assert_eq!(specs[1].outcome, Outcome::Fail);
        assert_eq!(specs[1].message, "boom / more");
    }

    #[test]
    fn the_list_only_shrinks() {
        let specs = parse_report(REPORT).unwrap();
        let list = "# comment\n\
            fail | [k8s.io] Attach runs | not yet\n\
            skip | [k8s.io] AppArmor x | no AppArmor here\n\
            fail | [k8s.io] Fixed y | was broken\n\
            skip | [k8s.io] Gone z | renamed\n";
        let exp = parse_expected(list).unwrap();
        let v = judge(&specs, &exp);
        assert_eq!((v.passed, v.failed, v.skipped), (2, 1, 1));
        assert_eq!(v.unexpected.len(), 1, "{:?}", v.unexpected);
        assert!(v.unexpected[0].contains("now passes"));
        assert_eq!(v.unknown, ["[k8s.io] Gone z"]);
        assert!(!v.ok());
        assert!(parse_expected("maybe | x | y").is_err());
        assert!(parse_expected("fail | x |").is_err());
        assert!(parse_expected("fail | x | a\nfail | x | b").is_err());
    }
}
