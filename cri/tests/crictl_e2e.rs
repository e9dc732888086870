//! Upstream `crictl` (cri-tools v1.36.0, built offline from `../shared/cri-tools`) against a
//! live vesseld with flat pods on a private bridge CNI network: every verb that maps to a CRI
//! call vessel serves, the way an operator types them, checking exit codes and output.
//!
//! Prints `SKIP crictl_every_verb: <reason>` when not root or without `shared/cri-tools`.

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};
use vessel_critest::upstream;

/// The vesseld this test crate was built with.
const VESSELD: &str = env!("CARGO_BIN_EXE_vesseld");

const IMAGE: &str = "registry.k8s.io/e2e-test-images/busybox:1.29-2";

struct Crictl {
    bin: PathBuf,
    config: PathBuf,
}

impl Crictl {
    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.bin);
        c.arg("--config").arg(&self.config).args(args);
        c
    }

    fn output(&self, args: &[&str], stdin: Option<&[u8]>) -> Output {
        let mut c = self.cmd(args);
        c.stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        let mut child = c.spawn().expect("running crictl");
        if let Some(data) = stdin {
            let mut w = child.stdin.take().unwrap();
            w.write_all(data).unwrap();
        }
        child.wait_with_output().unwrap()
    }

    /// Runs a verb that must succeed; returns its stdout.
    fn ok(&self, args: &[&str]) -> String {
        self.ok_in(args, None)
    }

    fn ok_in(&self, args: &[&str], stdin: Option<&[u8]>) -> String {
        let o = self.output(args, stdin);
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(
            o.status.success(),
            "crictl {args:?}: {}\nstdout: {out}\nstderr: {}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
        out
    }

    fn json(&self, args: &[&str]) -> serde_json::Value {
        let out = self.ok(args);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("crictl {args:?}: {e}: {out}"))
    }
}

fn write(dir: &Path, name: &str, v: serde_json::Value) -> String {
    let p = dir.join(name);
    std::fs::write(&p, v.to_string()).unwrap();
    p.display().to_string()
}

/// Waits until `f` holds, up to `limit`.
fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    false
}

#[test]
fn crictl_every_verb() {
    let Some(f) = upstream::Fixture::start("crictl_every_verb", VESSELD.as_ref()) else {
        return;
    };
    let (bin, v, cni) = (&f.bin, &f.vesseld, &f.cni);
    let work = tempfile::tempdir().unwrap();
    let ep = f.endpoint();
    let config = work.path().join("crictl.yaml");
    std::fs::write(
        &config,
        format!("runtime-endpoint: {ep}\nimage-endpoint: {ep}\ntimeout: 60\n"),
    )
    .unwrap();
    let c = Crictl {
        bin: bin.join("crictl"),
        config,
    };
    let logs = work.path().join("logs");

    // Runtime.
    let out = c.ok(&["version"]);
    assert!(out.contains("RuntimeName:  vessel"), "{out}");
    assert!(out.contains("RuntimeApiVersion:  v1"), "{out}");
    let info = c.json(&["info"]);
    let conds = info["status"]["conditions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for t in ["RuntimeReady", "NetworkReady"] {
        assert!(
            conds.iter().any(|x| x["type"] == t && x["status"] == true),
            "{t} in {info}"
        );
    }
    let rc = c.ok(&["runtime-config"]);
    assert!(rc.to_lowercase().contains("cgroupfs"), "{rc}");

    // Images.
    let out = c.ok(&["pull", IMAGE]);
    assert!(out.contains("Image is up to date for sha256:"), "{out}");
    let out = c.ok(&["images"]);
    assert!(
        out.contains("registry.k8s.io/e2e-test-images/busybox"),
        "{out}"
    );
    let ids = c.ok(&["images", "-q"]);
    assert_eq!(ids.lines().count(), 1, "{ids}");
    // The ID as the `crictl images` table prints it (13 digits) names the image too, as
    // with containerd: `crictl inspecti` and `crictl rmi` take it.
    let id = ids.trim().to_string();
    let short = id
        .strip_prefix("sha256:")
        .map(|h| h[..13].to_string())
        .unwrap_or_default();
    assert!(out.contains(&short), "{out}");
    let img = c.json(&["inspecti", &short]);
    assert_eq!(img["status"]["id"], id.as_str(), "{img}");
    let img = c.json(&["inspecti", IMAGE]);
    assert!(
        img["status"]["id"]
            .as_str()
            .unwrap_or_default()
            .starts_with("sha256:"),
        "{img}"
    );
    let fs = c.json(&["imagefsinfo"]);
    assert!(
        fs["status"]["imageFilesystems"][0]["usedBytes"]["value"].is_string(),
        "{fs}"
    );

    // A pod, as crictl users write them (no hostname).
    let pod_json = write(
        work.path(),
        "pod.json",
        serde_json::json!({
            "metadata": {"name": "crictl-pod", "namespace": "default", "uid": "crictl-uid"},
            "log_directory": logs.display().to_string(),
            "linux": {}
        }),
    );
    let pod = c.ok(&["runp", &pod_json]).trim().to_string();
    assert_eq!(pod.len(), 64, "{pod}");
    let out = c.ok(&["pods"]);
    assert!(out.contains("crictl-pod") && out.contains("Ready"), "{out}");
    let p = c.json(&["inspectp", &pod]);
    assert_eq!(p["status"]["state"], "SANDBOX_READY", "{p}");
    let ip = p["status"]["network"]["ip"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        ip.starts_with(&format!("{}.", cni.prefix)),
        "pod IP {ip:?}: {p}"
    );

    // A web server for exec, logs, stats, port-forward.
    let web = write(
        work.path(),
        "web.json",
        serde_json::json!({
            "metadata": {"name": "web"},
            "image": {"image": IMAGE},
            "command": ["sh", "-c", "mkdir -p /www && echo pong > /www/index.html && echo started && exec httpd -f -p 8080 -h /www"],
            "log_path": "web.log"
        }),
    );
    // `crictl events` follows every container's lifecycle from here to the web server's rm.
    let mut events = c
        .cmd(&[
            "events",
            "-o",
            "go-template",
            "--template",
            "{{.containerId}} {{.containerEventType}}",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("crictl events");
    std::thread::sleep(Duration::from_millis(500));
    let ctr = c.ok(&["create", &pod, &web, &pod_json]).trim().to_string();
    let out = c.ok(&["ps", "-a"]);
    assert!(out.contains("web") && out.contains("Created"), "{out}");
    c.ok(&["start", &ctr]);
    let out = c.ok(&["ps"]);
    assert!(out.contains("web") && out.contains("Running"), "{out}");
    let s = c.json(&["inspect", &ctr]);
    assert_eq!(s["status"]["state"], "CONTAINER_RUNNING", "{s}");

    // exec: plain, with stdin, with a terminal (script(1) gives crictl one), over SPDY and
    // WebSocket (crictl --transport).
    for t in ["spdy", "websocket"] {
        fn exec<'a>(t: &'a str, args: &[&'a str]) -> Vec<&'a str> {
            [&["exec", "-r", t][..], args].concat()
        }
        assert_eq!(c.ok(&exec(t, &[&ctr, "echo", "hi"])).trim(), "hi", "{t}");
        assert_eq!(
            c.ok_in(&exec(t, &["-i", &ctr, "cat"]), Some(b"through stdin")),
            "through stdin",
            "{t}"
        );
        let o = c.output(&exec(t, &[&ctr, "sh", "-c", "exit 3"]), None);
        // crictl itself exits 1 and names the command's code.
        assert!(
            !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("exit code 3"),
            "{t}: {o:?}"
        );
        let cmdline = format!(
            "{} --config {} exec -r {t} -it {ctr} sh -c 'test -t 0 && echo is-a-tty'",
            c.bin.display(),
            c.config.display()
        );
        let o = Command::new("script")
            .args(["-qec", &cmdline, "/dev/null"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(
            o.status.success() && String::from_utf8_lossy(&o.stdout).contains("is-a-tty"),
            "exec -it over {t}: {o:?}"
        );
    }
    // The web server's writable layer is the container filesystem's usage, on the image
    // store's filesystem (the same mountpoint: kubelet sees no split image filesystem).
    let fs = c.json(&["imagefsinfo"]);
    let cfs = &fs["status"]["containerFilesystems"][0];
    assert_eq!(
        cfs["fsId"]["mountpoint"], fs["status"]["imageFilesystems"][0]["fsId"]["mountpoint"],
        "{fs}"
    );
    let used: u64 = cfs["usedBytes"]["value"]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(used > 0, "container filesystem usage: {fs}");
    // logs, logs -f.
    assert!(
        eventually(Duration::from_secs(10), || c
            .ok(&["logs", &ctr])
            .contains("started")),
        "logs"
    );
    let mut follow = c
        .cmd(&["logs", "-f", &ctr])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut first = [0u8; 8];
    follow
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut first)
        .unwrap();
    assert_eq!(&first, b"started\n");
    let _ = follow.kill();
    let _ = follow.wait();

    // stats (crictl's statsp table leaves out pods without usage: checked with a container).
    let out = c.ok(&["statsp", "--id", &pod]);
    assert!(out.contains("crictl-pod"), "{out}");
    let st = c.json(&["stats", "-o", "json", "--id", &ctr]);
    assert_eq!(st["stats"][0]["attributes"]["id"], ctr.as_str(), "{st}");
    assert!(
        st["stats"][0]["memory"]["workingSetBytes"]["value"].is_string(),
        "{st}"
    );

    // checkpoint: CRIU dumps the running container into the archive crictl names; it runs on.
    let exported = match vessel_critest::daemon::criu_unusable() {
        Some(why) => {
            println!("SKIP crictl_every_verb (checkpoint, restore): {why}");
            None
        }
        None => {
            let export = work.path().join("export/ctr.tar");
            let export = export.to_str().unwrap();
            let out = c.ok(&["checkpoint", "--export", export, &ctr]);
            assert!(out.contains(&ctr), "{out}");
            let size = std::fs::metadata(export).map(|m| m.len()).unwrap_or(0);
            assert!(size > 0, "no archive at {export}");
            let s = c.json(&["inspect", &ctr]);
            assert_eq!(s["status"]["state"], "CONTAINER_RUNNING", "{s}");
            Some(export.to_string())
        }
    };

    // CRI metrics (kubelet's /metrics/cadvisor from the runtime).
    let out = c.ok(&["metricdescs"]);
    assert!(out.contains("container_cpu_usage_seconds_total"), "{out}");
    let out = c.ok(&["metricsp"]);
    assert!(
        out.contains(&pod) && out.contains("container_memory_working_set_bytes"),
        "{out}"
    );

    // port-forward: a local port to the pod's 8080, over SPDY and SPDY tunnelled in WebSocket.
    for t in ["spdy", "websocket"] {
        let local = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut pf = c
            .cmd(&["port-forward", "-r", t, &pod, &format!("{local}:8080")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut body = String::new();
        let got = eventually(Duration::from_secs(20), || {
            let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", local)) else {
                return false;
            };
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let _ = s.write_all(b"GET /index.html HTTP/1.0\r\n\r\n");
            body.clear();
            let _ = s.read_to_string(&mut body);
            body.contains("pong")
        });
        let _ = pf.kill();
        let _ = pf.wait();
        assert!(got, "port-forward over {t}: {body:?}");
    }

    // update.
    c.ok(&["update", "--memory", "200000000", &ctr]);
    let s = c.json(&["inspect", &ctr]);
    assert_eq!(
        s["status"]["resources"]["linux"]["memoryLimitInBytes"], "200000000",
        "{s}"
    );

    // attach: a shell created with stdin and stdin_once.
    let shell = write(
        work.path(),
        "shell.json",
        serde_json::json!({
            "metadata": {"name": "shell"},
            "image": {"image": IMAGE},
            "command": ["sh"],
            "stdin": true,
            "stdin_once": true,
            "log_path": "shell.log"
        }),
    );
    for t in ["spdy", "websocket"] {
        let sh = c
            .ok(&["create", &pod, &shell, &pod_json])
            .trim()
            .to_string();
        c.ok(&["start", &sh]);
        let out = c.ok_in(&["attach", "-r", t, "-i", &sh], Some(b"echo attached\n"));
        assert!(out.contains("attached"), "attach over {t}: {out:?}");
        assert!(
            eventually(Duration::from_secs(20), || {
                c.json(&["inspect", &sh])["status"]["state"] == "CONTAINER_EXITED"
            }),
            "stdin_once: the shell did not exit after attach over {t} closed its stdin"
        );
        c.ok(&["rm", &sh]);
    }

    // run: pod + container in one go.
    let run_ctr = write(
        work.path(),
        "run.json",
        serde_json::json!({
            "metadata": {"name": "run-once"},
            "image": {"image": IMAGE},
            "command": ["sh", "-c", "echo ran"],
            "log_path": "run.log"
        }),
    );
    let run_pod = write(
        work.path(),
        "run-pod.json",
        serde_json::json!({
            "metadata": {"name": "crictl-run", "namespace": "default", "uid": "crictl-run-uid"},
            "log_directory": logs.join("run").display().to_string(),
            "linux": {}
        }),
    );
    let ran = c.ok(&["run", &run_ctr, &run_pod]).trim().to_string();
    assert!(
        eventually(Duration::from_secs(20), || c
            .ok(&["logs", &ran])
            .contains("ran")),
        "run"
    );

    // Tear down, verb by verb.
    c.ok(&["stop", &ctr]);
    let s = c.json(&["inspect", &ctr]);
    assert_eq!(s["status"]["state"], "CONTAINER_EXITED", "{s}");
    c.ok(&["rm", &ctr]);
    let o = c.output(&["inspect", &ctr], None);
    assert!(!o.status.success(), "inspect of a removed container: {o:?}");
    std::thread::sleep(Duration::from_millis(500));
    let _ = events.kill();
    let out = events.wait_with_output().unwrap();
    let lines = String::from_utf8_lossy(&out.stdout);
    let web_events: Vec<&str> = lines
        .lines()
        .filter_map(|l| l.strip_prefix(&format!("{ctr} ")))
        .collect();
    assert_eq!(
        web_events,
        [
            "CONTAINER_CREATED_EVENT",
            "CONTAINER_STARTED_EVENT",
            "CONTAINER_STOPPED_EVENT",
            "CONTAINER_DELETED_EVENT"
        ],
        "crictl events: {lines}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // restore: the checkpoint taken above, as a new container in the pod (`crictl create`
    // with the archive as the image, as with CRI-O): the web server, restored with its
    // listening socket and the page it wrote, serves again.
    if let Some(export) = &exported {
        let restored = write(
            work.path(),
            "restored.json",
            serde_json::json!({
                "metadata": {"name": "web-restored"},
                "image": {"image": export},
                "log_path": "web-restored.log"
            }),
        );
        let r = c
            .ok(&["create", &pod, &restored, &pod_json])
            .trim()
            .to_string();
        c.ok(&["start", &r]);
        let s = c.json(&["inspect", &r]);
        assert_eq!(s["status"]["state"], "CONTAINER_RUNNING", "{s}");
        let out = c.ok(&["exec", &r, "wget", "-qO-", "http://127.0.0.1:8080/"]);
        assert!(out.contains("pong"), "the restored web server: {out:?}");
        c.ok(&["rm", "-f", &r]);
    }
    c.ok(&["stopp", &pod]);
    let p = c.json(&["inspectp", &pod]);
    assert_eq!(p["status"]["state"], "SANDBOX_NOTREADY", "{p}");
    c.ok(&["rmp", &pod]);
    c.ok(&["rmp", "-f", "-a"]);
    assert_eq!(c.ok(&["pods", "-q"]).trim(), "");
    assert_eq!(c.ok(&["ps", "-a", "-q"]).trim(), "");
    c.ok(&["rmi", &short]);
    assert_eq!(c.ok(&["images", "-q"]).trim(), "");
    c.ok(&["pull", IMAGE]);
    let out = c.ok(&["rmi", "--prune"]);
    assert!(out.contains("Deleted"), "rmi --prune: {out}");
    assert_eq!(c.ok(&["images", "-q"]).trim(), "");

    let m = vessel_critest::daemon::mounts_under(v.dir.path());
    assert!(m.is_empty(), "mounts left: {m:?}");
    assert!(cni.allocated_ips().is_empty(), "{:?}", cni.allocated_ips());
    println!("crictl_every_verb: version info runtime-config pull images inspecti imagefsinfo runp pods inspectp statsp create ps start inspect exec (-i, -it) logs (-f) stats port-forward update attach run stop rm stopp rmp rmi (--prune): all as expected");
}
