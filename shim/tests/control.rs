//! The control socket and the log listener on the host, without KVM: a fake disk-slot
//! backend (and a real, unattached virtio-blk slot), real Unix sockets, the `ctl` client.

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vessel_shim::control::{Client, DiskSlots, Server, Slots};
use vessel_shim::logs::{self, LogRouter, SocketPath};
use vessel_vmm::vm::{Control, Outcome};

#[derive(Default)]
struct FakeDisks {
    calls: Mutex<Vec<String>>,
}

impl DiskSlots for FakeDisks {
    fn attach(
        &self,
        slot: usize,
        path: &Path,
        file: Option<std::fs::File>,
        ro: bool,
        serial: &str,
    ) -> Result<(), String> {
        if slot >= 2 {
            return Err(format!("no spare disk slot {slot} (the VM has 2)"));
        }
        if let Some(f) = file {
            let len = f.metadata().unwrap().len();
            self.calls
                .lock()
                .unwrap()
                .push(format!("attach {slot} fd of {len} bytes {ro} {serial}"));
            return Ok(());
        }
        if !path.exists() {
            return Err(format!("disk image {}: not found", path.display()));
        }
        self.calls
            .lock()
            .unwrap()
            .push(format!("attach {slot} {} {ro} {serial}", path.display()));
        Ok(())
    }
    fn detach(&self, slot: usize) -> Result<(), String> {
        if slot >= 2 {
            return Err(format!("no spare disk slot {slot} (the VM has 2)"));
        }
        self.calls.lock().unwrap().push(format!("detach {slot}"));
        Ok(())
    }
}

struct Fixture {
    dir: tempfile::TempDir,
    ctl: PathBuf,
    log_sock: PathBuf,
    disks: Arc<FakeDisks>,
    run: Arc<Control>,
    _guards: Vec<SocketPath>,
}

fn start() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let ctl = dir.path().join("control.sock");
    let log_sock = dir.path().join("vsock.sock_1025");
    let router = Arc::new(LogRouter::default());
    let disks = Arc::new(FakeDisks::default());
    let (l, g1) = logs::bind_private(&log_sock).unwrap();
    logs::serve(l, router.clone(), None).unwrap();
    let (l, g2) = logs::bind_private(&ctl).unwrap();
    let run = Arc::new(Control::default());
    Arc::new(Server {
        disks: disks.clone(),
        logs: router,
        run: Some(run.clone()),
    })
    .serve(l)
    .unwrap();
    Fixture {
        dir,
        ctl,
        log_sock,
        disks,
        run,
        _guards: vec![g1, g2],
    }
}

fn ok(v: &Value) -> bool {
    v["ok"] == json!(true)
}

fn wait_for(path: &Path, want: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let got = std::fs::read_to_string(path).unwrap_or_default();
        if got == want || Instant::now() > deadline {
            return got;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn open_append(p: &Path) -> std::fs::File {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(p)
        .unwrap()
}

#[test]
fn requests_answers_and_errors_on_one_connection() {
    let f = start();
    let mode = std::fs::metadata(&f.ctl).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let mut c = Client::connect(&f.ctl).unwrap();
    let a = c.request(&json!({"op":"ping"}), None).unwrap();
    assert!(ok(&a) && a["pid"] == json!(std::process::id()), "{a}");
    let img = f.dir.path().join("layer.img");
    std::fs::write(&img, [0u8; 512]).unwrap();
    let a = c
        .request(
            &json!({"op":"attach_disk","slot":1,"path":img,"read_only":true,"serial":"l1"}),
            None,
        )
        .unwrap();
    assert!(ok(&a), "{a}");
    let a = c
        .request(&json!({"op":"attach_disk","slot":5,"path":img}), None)
        .unwrap();
    assert!(
        !ok(&a) && a["error"].as_str().unwrap().contains("slot 5"),
        "{a}"
    );
    let a = c
        .request(
            &json!({"op":"attach_disk","slot":0,"path":"/nonexistent.img"}),
            None,
        )
        .unwrap();
    assert!(!ok(&a) && a["error"].as_str().unwrap().contains("/nonexistent.img"));
    // The image as a descriptor sent with the request: the path only names it.
    let image = std::fs::File::open(&img).unwrap();
    let a = c
        .request(
            &json!({"op":"attach_disk","slot":0,"path":"/not/here.img","read_only":true}),
            Some(image.as_fd()),
        )
        .unwrap();
    assert!(ok(&a), "{a}");
    assert!(ok(&c
        .request(&json!({"op":"detach_disk","slot":1}), None)
        .unwrap()));
    assert_eq!(
        *f.disks.calls.lock().unwrap(),
        vec![
            format!("attach 1 {} true l1", img.display()),
            "attach 0 fd of 512 bytes true ".to_string(),
            "detach 1".into()
        ]
    );
    // Malformed requests get an error answer and the connection goes on.
    for bad in [
        &b"{not json\n"[..],
        b"{\"op\":\"reboot\"}\n",
        b"{\"op\":\"detach_disk\",\"slot\":0,\"extra\":1}\n",
        b"{\"op\":\"detach_disk\"}\n",
        b"{\"op\":\"set_log\",\"id\":\"c\"}\n",
    ] {
        c.send_line(bad, None).unwrap();
        let a = c.read_answer().unwrap();
        assert!(!ok(&a), "{}: {a}", String::from_utf8_lossy(bad));
    }
    // Pipelined: two requests in one write, two answers in order.
    c.send_line(
        b"{\"op\":\"ping\"}\n{\"op\":\"drop_log\",\"id\":\"x\"}\n",
        None,
    )
    .unwrap();
    assert!(c.read_answer().unwrap()["pid"].is_number());
    assert_eq!(c.read_answer().unwrap(), json!({"ok":true,"known":false}));
}

#[test]
fn concurrent_connections() {
    let f = start();
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let p = f.ctl.clone();
            std::thread::spawn(move || {
                let mut c = Client::connect(&p).unwrap();
                for _ in 0..50 {
                    assert!(ok(&c.request(&json!({"op":"ping"}), None).unwrap()));
                }
            })
        })
        .collect();
    // A connection that sends half a line and stalls blocks nobody.
    let mut stalled = UnixStream::connect(&f.ctl).unwrap();
    stalled.write_all(b"{\"op\":").unwrap();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn logs_follow_set_log_and_reopen() {
    let f = start();
    let mut c = Client::connect(&f.ctl).unwrap();
    let a_log = f.dir.path().join("a.log");
    let b_log = f.dir.path().join("b.log");
    // Lines that come before set_log are held.
    let mut g = UnixStream::connect(&f.log_sock).unwrap();
    g.write_all(b"ctr-1\n2024-01-01T00:00:00Z stdout F early\n")
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let a = open_append(&a_log);
    let ans = c
        .request(&json!({"op":"set_log","id":"ctr-1"}), Some(a.as_fd()))
        .unwrap();
    assert!(ok(&ans), "{ans}");
    drop(a);
    g.write_all(b"2024-01-01T00:00:01Z stdout P one ").unwrap();
    g.write_all(b"half\n2024-01-01T00:00:02Z stderr F two\n")
        .unwrap();
    let want_a = "2024-01-01T00:00:00Z stdout F early\n\
                  2024-01-01T00:00:01Z stdout P one half\n\
                  2024-01-01T00:00:02Z stderr F two\n";
    assert_eq!(wait_for(&a_log, want_a), want_a);
    // Reopen: the log file was rotated; later lines go to the new fd.
    let b = open_append(&b_log);
    assert!(ok(&c
        .request(&json!({"op":"set_log","id":"ctr-1"}), Some(b.as_fd()))
        .unwrap()));
    g.write_all(b"2024-01-01T00:00:03Z stdout F three\n")
        .unwrap();
    assert_eq!(
        wait_for(&b_log, "2024-01-01T00:00:03Z stdout F three\n"),
        "2024-01-01T00:00:03Z stdout F three\n"
    );
    assert_eq!(std::fs::read_to_string(&a_log).unwrap(), want_a);
    // A second container on its own connection; its lines do not mix with the first's.
    let c_log = f.dir.path().join("c.log");
    let cf = open_append(&c_log);
    assert!(ok(&c
        .request(&json!({"op":"set_log","id":"ctr-2"}), Some(cf.as_fd()))
        .unwrap()));
    let mut g2 = UnixStream::connect(&f.log_sock).unwrap();
    g2.write_all(b"ctr-2\nx stdout F other\n").unwrap();
    assert_eq!(wait_for(&c_log, "x stdout F other\n"), "x stdout F other\n");
    assert_eq!(
        c.request(&json!({"op":"drop_log","id":"ctr-2"}), None)
            .unwrap(),
        json!({"ok":true,"known":true})
    );
}

#[test]
fn real_slot_backend_leaves_a_slot_alone_on_a_bad_path() {
    let dev = vessel_vmm::virtio::block::Block::empty();
    let slot = dev.slot();
    let s = Server {
        disks: Arc::new(Slots(vec![slot.clone()])),
        logs: Arc::new(LogRouter::default()),
        run: None,
    };
    let d = tempfile::tempdir().unwrap();
    let img = d.path().join("x.img");
    std::fs::write(&img, vec![7u8; 4096]).unwrap();
    let a = s.handle(
        format!(
            r#"{{"op":"attach_disk","slot":0,"path":"{}","serial":"x"}}"#,
            img.display()
        )
        .as_bytes(),
        None,
    );
    assert!(ok(&a), "{a}");
    assert_eq!(slot.info(), (8, "x".into()));
    let a = s.handle(
        br#"{"op":"attach_disk","slot":0,"path":"/nonexistent"}"#,
        None,
    );
    assert!(!ok(&a));
    assert_eq!(slot.info(), (8, "x".into()));
    // By descriptor: the path names it only; a read-write disk needs a writable one.
    let small = d.path().join("y.img");
    std::fs::write(&small, vec![7u8; 1024]).unwrap();
    let req = br#"{"op":"attach_disk","slot":0,"path":"/not/here","serial":"y"}"#;
    let a = s.handle(req, Some(std::fs::File::open(&small).unwrap().into()));
    assert!(
        !ok(&a) && a["error"].as_str().unwrap().contains("/not/here"),
        "{a}"
    );
    assert_eq!(slot.info(), (8, "x".into()));
    let rw = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&small)
        .unwrap();
    assert!(ok(&s.handle(req, Some(rw.into()))));
    assert_eq!(slot.info(), (2, "y".into()));
    let a = s.handle(br#"{"op":"detach_disk","slot":1}"#, None);
    assert!(!ok(&a) && a["error"].as_str().unwrap().contains("slot 1"));
    assert!(ok(&s.handle(br#"{"op":"detach_disk","slot":0}"#, None)));
    assert_eq!(slot.info(), (0, String::new()));
}

#[test]
fn ctl_command() {
    let f = start();
    let shim = env!("CARGO_BIN_EXE_vessel-shim");
    let out = Command::new(shim)
        .args(["ctl", "--socket"])
        .arg(&f.ctl)
        .arg(r#"{"op":"ping"}"#)
        .output()
        .unwrap();
    assert!(out.status.success());
    let a: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(ok(&a));
    let log = f.dir.path().join("ctl.log");
    let out = Command::new(shim)
        .args(["ctl", "--socket"])
        .arg(&f.ctl)
        .arg(r#"{"op":"set_log","id":"k"}"#)
        .arg("--fd-file")
        .arg(&log)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let mut g = UnixStream::connect(&f.log_sock).unwrap();
    g.write_all(b"k\nhello\n").unwrap();
    assert_eq!(wait_for(&log, "hello\n"), "hello\n");
    // An error answer: printed, exit status 1.
    let out = Command::new(shim)
        .args(["ctl", "--socket"])
        .arg(&f.ctl)
        .arg(r#"{"op":"detach_disk","slot":9}"#)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"ok\":false"));
    // No shim there: a clear error.
    let out = Command::new(shim)
        .args(["ctl", "--socket"])
        .arg(f.dir.path().join("none.sock"))
        .arg(r#"{"op":"ping"}"#)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("none.sock"));
}

#[test]
fn sockets_are_removed_with_their_guards_and_stale_ones_replaced() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("s.sock");
    drop(std::os::unix::net::UnixListener::bind(&p).unwrap()); // stale
    let (l, g) = logs::bind_private(&p).unwrap();
    // A live one is not replaced.
    assert!(logs::bind_private(&p).is_err());
    drop(l);
    drop(g);
    assert!(!p.exists());
}

/// vesseld's typed requests are the documented wire form, and typed answers read back.
#[test]
fn typed_requests_and_replies() {
    use vessel_shim::control::{Reply, Request};
    let r = Request::AttachDisk {
        slot: 2,
        path: "/l.erofs".into(),
        read_only: true,
        serial: "abc".into(),
    };
    assert_eq!(
        serde_json::to_value(&r).unwrap(),
        json!({"op":"attach_disk","slot":2,"path":"/l.erofs","read_only":true,"serial":"abc"})
    );
    assert_eq!(
        serde_json::to_value(Request::SetLog { id: "c".into() }).unwrap(),
        json!({"op":"set_log","id":"c"})
    );
    let f = start();
    let mut c = Client::connect(&f.ctl).unwrap();
    let a = c.call(&Request::Ping, None).unwrap();
    assert!(a.ok && a.pid == Some(std::process::id()), "{a:?}");
    let a = c
        .call(&Request::DropLog { id: "none".into() }, None)
        .unwrap();
    assert_eq!(
        a,
        Reply {
            ok: true,
            known: Some(false),
            ..Default::default()
        }
    );
    let a = c.call(&Request::DetachDisk { slot: 99 }, None).unwrap();
    assert!(
        !a.ok && a.error.as_deref().unwrap_or("").contains("99"),
        "{a:?}"
    );
}

/// A spec vesseld writes with the shim's types reads back as the same spec.
#[test]
fn typed_spec_round_trips() {
    let v = json!({
        "kernel": "/k", "mem_mib": 128, "vcpus": 1,
        "vsock": {"guest_cid": 3, "uds_path": "/d/v.sock"},
        "control_socket": "/d/ctl.sock", "log_port": 1025, "spare_disks": 2,
    });
    let spec = vessel_shim::Spec::from_value(v).unwrap();
    let again = vessel_shim::Spec::from_value(spec.to_value().unwrap()).unwrap();
    assert_eq!(again.shim.log_port, Some(1025));
    assert_eq!(again.vm.spare_disks, 2);
    assert_eq!(
        again.log_socket(),
        Some(std::path::PathBuf::from("/d/v.sock_1025"))
    );
}

/// A `wait_event` request's answer.
fn wait_event(c: &mut Client, name: &str, timeout_ms: u64) -> Value {
    c.request(
        &json!({"op":"wait_event","name":name,"timeout_ms":timeout_ms}),
        None,
    )
    .unwrap()
}

#[test]
fn wait_event_answers_when_the_guest_reports_it() {
    let f = start();
    // Other requests are answered on their own connections meanwhile.
    let mut c = Client::connect(&f.ctl).unwrap();
    let run = f.run.clone();
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        run.event("agent-serving".into(), Instant::now());
    });
    let started = Instant::now();
    let waiting = {
        let ctl = f.ctl.clone();
        std::thread::spawn(move || {
            wait_event(&mut Client::connect(&ctl).unwrap(), "agent-serving", 10000)
        })
    };
    assert!(ok(&c.request(&json!({"op":"ping"}), None).unwrap()));
    let a = waiting.join().unwrap();
    assert!(ok(&a), "{a}");
    assert!(started.elapsed() < Duration::from_secs(5));
    // The answer says when each of the guest's events came, before it.
    let ev = &a["events"][0];
    assert_eq!(ev["name"], "agent-serving", "{a}");
    assert!(
        ev["ago_us"].as_u64().is_some_and(|us| us < 5_000_000),
        "{a}"
    );
    t.join().unwrap();
    // Seen already: at once; another name times out, and names the event.
    let a = wait_event(&mut c, "agent-serving", 0);
    assert!(ok(&a), "{a}");
    let a = wait_event(&mut c, "never", 30);
    let e = a["error"].as_str().unwrap_or_default();
    assert!(
        !ok(&a) && e.contains("\"never\"") && e.contains("in time"),
        "{a}"
    );
    // A guest that ended will not report it.
    f.run.finish(Outcome::Panic);
    let a = wait_event(&mut c, "never", 10000);
    let e = a["error"].as_str().unwrap_or_default();
    assert!(!ok(&a) && e.contains("ended"), "{a}");
}

#[test]
fn wait_event_without_a_vm_is_refused() {
    let s = Server {
        disks: Arc::new(FakeDisks::default()),
        logs: Arc::new(LogRouter::default()),
        run: None,
    };
    let a = s.handle(br#"{"op":"wait_event","name":"x","timeout_ms":10}"#, None);
    assert!(
        !ok(&a) && a["error"].as_str().unwrap().contains("no VM"),
        "{a}"
    );
}
