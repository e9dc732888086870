//! The pod-network plumbing of a VM pod on this host's kernel: a network namespace with a veth
//! (as CNI leaves it), the shim's tap and tc redirects, and Ethernet frames both ways. Needs
//! root and iproute2; otherwise prints `SKIP podnet: <reason>`.

// An integration test crate: the whole file is the test module.
#![allow(clippy::tests_outside_test_module)]

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use vessel_shim::podnet::{connect, plug, PodNet};
use vessel_vmm::virtio::net::NET_HDR_LEN;

const ETHERTYPE: u16 = 0x88b5; // IEEE local experimental

fn ip(args: &[&str]) -> String {
    let out = Command::new("ip").args(args).output().expect("running ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A namespace with one end of a veth (`eth0`, MTU 1400) in it, removed on drop.
struct Pod {
    ns: String,
    host_if: String,
}

impl Drop for Pod {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .status();
    }
}

fn frame(src: [u8; 6], payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0xff; 6];
    f.extend_from_slice(&src);
    f.extend_from_slice(&ETHERTYPE.to_be_bytes());
    f.extend_from_slice(payload);
    f.resize(f.len().max(60), 0);
    f
}

// Constants that fit their C fields (ETH_P_ALL, AF_PACKET, a sockaddr_ll size).
#[allow(clippy::cast_possible_truncation)]
fn packet_socket(ifname: &str) -> OwnedFd {
    let proto = u16::to_be(libc::ETH_P_ALL as u16);
    // SAFETY: socket(2) with constant arguments; the fd is owned at once.
    let fd = unsafe {
        OwnedFd::from_raw_fd(libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_NONBLOCK,
            i32::from(proto),
        ))
    };
    let name = std::ffi::CString::new(ifname).unwrap();
    // SAFETY: a NUL-terminated name that outlives the call.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    assert_ne!(index, 0, "no interface {ifname}");
    // SAFETY: sockaddr_ll is plain data; zeroed is a valid value.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = proto;
    sll.sll_ifindex = i32::try_from(index).unwrap();
    // SAFETY: bind(2) reads a sockaddr_ll of the given size.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            std::ptr::addr_of!(sll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    assert_eq!(
        r,
        0,
        "bind packet socket: {}",
        std::io::Error::last_os_error()
    );
    fd
}

/// Reads frames from `fds` (after a `skip`-byte header) until one has our ethertype and
/// `payload`, or 5 s pass.
fn expect_frame(fds: &[OwnedFd], skip: usize, payload: &[u8]) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut buf = [0u8; 2048];
    while Instant::now() < deadline {
        let mut got_any = false;
        for fd in fds {
            // SAFETY: read(2) writes at most buf.len() bytes into buf.
            let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                continue;
            }
            got_any = true;
            let Some(f) = buf[..usize::try_from(n).unwrap()].get(skip..) else {
                continue;
            };
            if f.len() >= 14 && f[12..14] == ETHERTYPE.to_be_bytes() && f[14..].starts_with(payload)
            {
                return true;
            }
        }
        if !got_any {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    false
}

fn write_all(fd: &OwnedFd, data: &[u8]) {
    // SAFETY: write(2) reads data.len() bytes of data.
    let n = unsafe { libc::write(fd.as_raw_fd(), data.as_ptr().cast(), data.len()) };
    assert_eq!(
        usize::try_from(n).ok(),
        Some(data.len()),
        "write: {}",
        std::io::Error::last_os_error()
    );
}

/// Guest -> network: a frame written to tap queue `queue` (after its all-zero virtio-net
/// header) leaves through the veth (`host`). Network -> guest: a frame arriving on eth0 is
/// read from one of `taps`, after its header.
fn frames_both_ways(taps: &[OwnedFd], queue: usize, host: &OwnedFd) {
    let out_tag = format!("from-queue-{queue}");
    let mut out = vec![0u8; NET_HDR_LEN];
    out.extend(frame([2, 0, 0, 0, 0, 1], out_tag.as_bytes()));
    write_all(&taps[queue], &out);
    assert!(
        expect_frame(std::slice::from_ref(host), 0, out_tag.as_bytes()),
        "a frame written to tap queue {queue} did not reach the veth"
    );
    let in_tag = format!("to-the-guest-{}", taps.len());
    write_all(host, &frame([2, 0, 0, 0, 0, 2], in_tag.as_bytes()));
    assert!(
        expect_frame(taps, NET_HDR_LEN, in_tag.as_bytes()),
        "the network's frame reached none of the {} tap queues",
        taps.len()
    );
}

#[test]
fn podnet() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("SKIP podnet: needs root (network namespaces, taps, tc)");
        return;
    }
    if Command::new("ip").arg("-V").output().is_err() {
        println!("SKIP podnet: no iproute2 `ip` to build the test network");
        return;
    }
    let id = std::process::id() % 100_000;
    let pod = Pod {
        ns: format!("vessel-podnet-{id}"),
        host_if: format!("vpn{id}"),
    };
    ip(&["netns", "add", &pod.ns]);
    ip(&[
        "link",
        "add",
        &pod.host_if,
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        &pod.ns,
    ]);
    ip(&["link", "set", &pod.host_if, "up"]);
    ip(&["-n", &pod.ns, "link", "set", "eth0", "mtu", "1400", "up"]);
    let shown = ip(&["-n", &pod.ns, "link", "show", "eth0"]);
    let mac = shown
        .split_whitespace()
        .skip_while(|w| *w != "link/ether")
        .nth(1)
        .unwrap()
        .to_string();

    let net = PodNet {
        netns: PathBuf::from(format!("/run/netns/{}", pod.ns)),
        peer: "eth0".into(),
        tap: "vessel-tap0".into(),
        deferred: false,
    };
    let plugged = plug(&net, 1).expect("plugging the tap");
    assert_eq!(plugged.taps.len(), 1);
    let peer = plugged.peer.expect("the peer, when not deferred");
    assert_eq!(peer.mtu, 1400);
    assert_eq!(peer.mac_string(), mac);
    let filters = Command::new("ip")
        .args([
            "netns", "exec", &pod.ns, "tc", "filter", "show", "dev", "eth0", "ingress",
        ])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    assert!(
        filters.is_empty() || filters.contains("vessel-tap0"),
        "eth0's ingress filter: {filters}"
    );

    let host = packet_socket(&pod.host_if);
    frames_both_ways(&plugged.taps, 0, &host);

    // Plugging again (a new shim for the same pod, here with two vCPUs: a multiqueue tap)
    // replaces the filters; both queues carry frames; closing the tap removes it.
    drop(plugged);
    let again = plug(&net, 2).expect("plugging a second time, with two queues");
    assert_eq!(again.taps.len(), 2);
    frames_both_ways(&again.taps, 1, &host);
    drop(again);
    let links = ip(&["-n", &pod.ns, "link", "show"]);
    assert!(
        !links.contains("vessel-tap0"),
        "the tap outlived its fd: {links}"
    );

    // Deferred (vesseld runs CNI while the guest boots): the tap first, not yet connected;
    // connect then gives it the peer's MTU and the redirects, and answers the peer's MAC.
    let deferred = PodNet {
        deferred: true,
        ..net.clone()
    };
    let tap_only = plug(&deferred, 1).expect("a deferred plug");
    assert!(tap_only.peer.is_none());
    let shown = ip(&["-n", &pod.ns, "link", "show", "vessel-tap0"]);
    assert!(shown.contains(",UP"), "{shown}");
    let peer = connect(&deferred).expect("connecting the tap");
    assert_eq!((peer.mac_string(), peer.mtu), (mac.clone(), 1400));
    let shown = ip(&["-n", &pod.ns, "link", "show", "vessel-tap0"]);
    assert!(shown.contains("mtu 1400"), "{shown}");
    frames_both_ways(&tap_only.taps, 0, &host);
    drop(tap_only);
    // A tap that is gone cannot be connected: a clear error, not a panic.
    let e = connect(&deferred).expect_err("connecting a tap that is gone");
    assert!(e.to_string().contains("vessel-tap0"), "{e}");
}
