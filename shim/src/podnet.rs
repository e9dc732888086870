//! A VM pod on its pod network: the shim creates a tap in the pod's network namespace, and the
//! tap is joined to the pod's CNI interface (`eth0`) with tc: everything arriving on `eth0` is
//! redirected to the tap's egress (into the guest), and everything the guest sends out of the
//! tap to `eth0`'s egress. Any CNI plugin works unmodified: the interface keeps its addresses
//! and routes for CNI's own use, and the guest's eth0 gets its MAC and MTU, so that the network
//! sees one endpoint. Either the shim does it all at start, CNI having run ([`plug`]), or, as
//! vesseld does, the shim makes the tap and boots while CNI runs, and vesseld then joins the
//! two ([`connect`]) and has the guest agent set eth0's MAC and MTU (`deferred`). The tap is
//! not persistent: it goes when the shim's last fd closes, so a killed shim leaves no tap; the
//! filters on `eth0` go with the veth at CNI DEL.
//!
//! tc is spoken over rtnetlink directly (an ingress qdisc on each side and a u32 filter that
//! matches everything, with a mirred egress-redirect action), as `tc qdisc add dev X ingress;
//! tc filter add dev X ingress protocol all u32 match u8 0 0 action mirred egress redirect dev
//! Y` would (Kata's "tcfilter" model).

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use vessel_agent::netlink::{Msg, Socket, NLM_F_CREATE, NLM_F_EXCL};

/// Where the pod's network is: the spec's `pod_net`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PodNet {
    /// The pod's network namespace (a pinned nsfs file).
    pub netns: PathBuf,
    /// The interface CNI created in it.
    #[serde(default = "default_peer")]
    pub peer: String,
    /// The tap's name in that namespace.
    #[serde(default = "default_tap")]
    pub tap: String,
    /// The shim makes the tap only, and boots: vesseld runs CNI meanwhile, then connects the
    /// tap to `peer` itself ([`connect`]), and the guest agent gives the guest's eth0 the
    /// peer's MAC and MTU. Without it the peer must exist when the shim starts.
    #[serde(default)]
    pub deferred: bool,
}

fn default_peer() -> String {
    "eth0".into()
}

/// The tap's name where the spec names none (vesseld names this one).
pub const DEFAULT_TAP: &str = "vessel-tap0";

fn default_tap() -> String {
    DEFAULT_TAP.into()
}

/// The guest's side, ready for a virtio-net device.
#[derive(Debug)]
pub struct Plugged {
    /// The tap's queues: one, or one per queue pair of a multiqueue device.
    pub taps: Vec<OwnedFd>,
    /// The CNI interface's MAC and MTU, for the guest's eth0 (none when deferred).
    pub peer: Option<Peer>,
}

/// What the guest's eth0 takes from the CNI interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    pub mac: [u8; 6],
    pub mtu: u16,
}

impl Peer {
    pub fn mac_string(&self) -> String {
        let m = self.mac;
        format!(
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PodNetError {
    #[error("pod network namespace {path}: {source}")]
    Netns {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("interface {name} in the pod network namespace: {source}")]
    Interface {
        name: String,
        source: std::io::Error,
    },
    #[error("tap {name}: {detail}")]
    Tap { name: String, detail: String },
    #[error("tc {op}: {source}")]
    Tc { op: String, source: std::io::Error },
}

/// Creates the tap in `net.netns`, with `queues` queues (`IFF_MULTI_QUEUE` for more than
/// one), and connects it to `net.peer` unless `net.deferred`. Runs on a thread of its own that
/// joins the namespace; the rest of the shim stays where it is.
pub fn plug(net: &PodNet, queues: usize) -> Result<Plugged, PodNetError> {
    let net = net.clone();
    in_netns_thread(move || {
        enter_netns(&net.netns)?;
        let ctl = ifctl_socket().map_err(iface(&net.tap))?;
        let taps = vessel_vmm::virtio::net::create_tap_queues(&net.tap, queues).map_err(|e| {
            PodNetError::Tap {
                name: net.tap.clone(),
                detail: e.to_string(),
            }
        })?;
        set_up(&ctl, &net.tap).map_err(iface(&net.tap))?;
        let peer = if net.deferred {
            None
        } else {
            Some(connect_here(&net)?)
        };
        Ok(Plugged {
            taps: taps.into_iter().map(OwnedFd::from).collect(),
            peer,
        })
    })
}

/// Connects the tap a deferred [`plug`] made (it must exist) to `net.peer`: the tap takes the
/// peer's MTU, and tc redirects each one's ingress to the other's egress. Answers the peer's
/// MAC and MTU, for the guest's eth0. Runs on a thread of its own that joins the namespace.
pub fn connect(net: &PodNet) -> Result<Peer, PodNetError> {
    let net = net.clone();
    in_netns_thread(move || {
        enter_netns(&net.netns)?;
        connect_here(&net)
    })
}

fn in_netns_thread<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, PodNetError> + Send + 'static,
) -> Result<T, PodNetError> {
    let t = std::thread::Builder::new()
        .name("pod-net".into())
        .spawn(f)
        .map_err(|source| PodNetError::Tap {
            name: String::new(),
            detail: format!("thread: {source}"),
        })?;
    t.join().unwrap_or_else(|_| {
        Err(PodNetError::Tap {
            name: String::new(),
            detail: "the set-up thread panicked".into(),
        })
    })
}

fn iface(name: &str) -> impl FnOnce(std::io::Error) -> PodNetError {
    let name = name.to_string();
    move |source| PodNetError::Interface { name, source }
}

/// [`connect`], on a thread already in the pod's namespace.
fn connect_here(net: &PodNet) -> Result<Peer, PodNetError> {
    let ctl = ifctl_socket().map_err(iface(&net.peer))?;
    let peer = index_of(&net.peer).map_err(iface(&net.peer))?;
    let mac = hwaddr(&ctl, &net.peer).map_err(iface(&net.peer))?;
    let mtu = get_mtu(&ctl, &net.peer).map_err(iface(&net.peer))?;
    set_mtu(&ctl, &net.tap, mtu).map_err(iface(&net.tap))?;
    let tap_index = index_of(&net.tap).map_err(iface(&net.tap))?;
    let nl = Socket::open().map_err(|source| PodNetError::Tc {
        op: "netlink socket".into(),
        source,
    })?;
    for (from, from_name, to, to_name) in [
        (peer, &net.peer, tap_index, &net.tap),
        (tap_index, &net.tap, peer, &net.peer),
    ] {
        let op = |what: &str| {
            let op = format!("{what} on {from_name}");
            move |source| PodNetError::Tc { op, source }
        };
        // A filter left by an earlier shim of this pod would redirect to a dead tap: start
        // from a clean ingress.
        nl.request(&del_ingress_qdisc(from))
            .or_else(ignore_missing)
            .map_err(op("delete ingress qdisc"))?;
        nl.request(&add_ingress_qdisc(from))
            .map_err(op("add ingress qdisc"))?;
        nl.request(&add_redirect(from, to))
            .map_err(op(&format!("add u32 redirect to {to_name}")))?;
    }
    Ok(Peer { mac, mtu })
}

fn ignore_missing(e: std::io::Error) -> std::io::Result<()> {
    match e.raw_os_error() {
        Some(libc::ENOENT) | Some(libc::EINVAL) => Ok(()),
        _ => Err(e),
    }
}

fn enter_netns(path: &Path) -> Result<(), PodNetError> {
    let err = |source| PodNetError::Netns {
        path: path.to_path_buf(),
        source,
    };
    let f = File::open(path).map_err(err)?;
    // SAFETY: setns(2) on an open namespace fd; it changes only this thread's namespace.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(err(std::io::Error::last_os_error()));
    }
    Ok(())
}

fn ifctl_socket() -> std::io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments; the fd is owned at once.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn index_of(name: &str) -> std::io::Result<i32> {
    let c = CString::new(name).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: if_nametoindex reads a NUL-terminated string that outlives the call.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        return Err(std::io::Error::last_os_error());
    }
    i32::try_from(i).map_err(|_| std::io::ErrorKind::InvalidData.into())
}

/// A `struct ifreq` (40 bytes): the name, then the union this request uses.
fn ifreq(name: &str) -> std::io::Result<[u8; 40]> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("bad interface name {name:?}"),
        ));
    }
    let mut r = [0u8; 40];
    r[..name.len()].copy_from_slice(name.as_bytes());
    Ok(r)
}

fn ioctl(sock: &OwnedFd, req: libc::c_ulong, ifr: &mut [u8; 40]) -> std::io::Result<()> {
    // SAFETY: the SIOC* requests used here read and write a struct ifreq, which `ifr` is
    // (40 bytes, initialised) for the duration of the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), req as _, ifr.as_mut_ptr()) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn hwaddr(sock: &OwnedFd, name: &str) -> std::io::Result<[u8; 6]> {
    let mut r = ifreq(name)?;
    ioctl(sock, libc::SIOCGIFHWADDR, &mut r)?;
    // ifr_hwaddr: a sockaddr (family, then the address bytes).
    let mut mac = [0u8; 6];
    mac.copy_from_slice(&r[18..24]);
    Ok(mac)
}

fn get_mtu(sock: &OwnedFd, name: &str) -> std::io::Result<u16> {
    let mut r = ifreq(name)?;
    ioctl(sock, libc::SIOCGIFMTU, &mut r)?;
    let mtu = i32::from_ne_bytes([r[16], r[17], r[18], r[19]]);
    u16::try_from(mtu).map_err(|_| std::io::ErrorKind::InvalidData.into())
}

fn set_mtu(sock: &OwnedFd, name: &str, mtu: u16) -> std::io::Result<()> {
    let mut r = ifreq(name)?;
    r[16..20].copy_from_slice(&i32::from(mtu).to_ne_bytes());
    ioctl(sock, libc::SIOCSIFMTU, &mut r)
}

fn set_up(sock: &OwnedFd, name: &str) -> std::io::Result<()> {
    let mut r = ifreq(name)?;
    ioctl(sock, libc::SIOCGIFFLAGS, &mut r)?;
    let flags = i16::from_ne_bytes([r[16], r[17]]);
    // IFF_UP is 1: it fits the short flags.
    #[allow(clippy::cast_possible_truncation)]
    let up = flags | libc::IFF_UP as i16;
    r[16..18].copy_from_slice(&up.to_ne_bytes());
    ioctl(sock, libc::SIOCSIFFLAGS, &mut r)
}

// ---------- rtnetlink tc messages ----------

const TC_H_INGRESS: u32 = 0xffff_fff1;
/// The ingress qdisc's handle, `ffff:`; its filters' parent.
const INGRESS_HANDLE: u32 = 0xffff_0000;
const TCA_KIND: u16 = 1;
const TCA_OPTIONS: u16 = 2;
const TCA_U32_SEL: u16 = 5;
const TCA_U32_ACT: u16 = 7;
const TC_U32_TERMINAL: u8 = 1;
const TCA_ACT_KIND: u16 = 1;
const TCA_ACT_OPTIONS: u16 = 2;
const TCA_MIRRED_PARMS: u16 = 2;
const TC_ACT_STOLEN: i32 = 4;
const TCA_EGRESS_REDIR: i32 = 1;
/// ETH_P_ALL in network byte order, as `tcm_info`'s protocol half wants it.
const ETH_P_ALL_BE: u32 = 0x0300;

/// A `struct tcmsg`: family (AF_UNSPEC), 3 pad bytes, ifindex, handle, parent, info.
fn tcmsg(ifindex: i32, handle: u32, parent: u32, info: u32) -> Vec<u8> {
    let mut t = vec![0u8; 4];
    t.extend_from_slice(&ifindex.to_ne_bytes());
    t.extend_from_slice(&handle.to_ne_bytes());
    t.extend_from_slice(&parent.to_ne_bytes());
    t.extend_from_slice(&info.to_ne_bytes());
    t
}

fn add_ingress_qdisc(ifindex: i32) -> Vec<u8> {
    let flags = NLM_F_CREATE | NLM_F_EXCL;
    Msg::new(
        libc::RTM_NEWQDISC,
        flags,
        &tcmsg(ifindex, INGRESS_HANDLE, TC_H_INGRESS, 0),
    )
    .attr(TCA_KIND, b"ingress\0")
    .finish()
}

fn del_ingress_qdisc(ifindex: i32) -> Vec<u8> {
    Msg::new(
        libc::RTM_DELQDISC,
        0,
        &tcmsg(ifindex, INGRESS_HANDLE, TC_H_INGRESS, 0),
    )
    .finish()
}

/// `protocol all u32 match u8 0 0 action mirred egress redirect dev <to>` on `from`'s
/// ingress, priority 1: a u32 filter with one key that matches every frame (cls_u32 is in
/// more kernels than cls_matchall).
fn add_redirect(from: i32, to: i32) -> Vec<u8> {
    let flags = NLM_F_CREATE | NLM_F_EXCL;
    // struct tc_mirred: index, capab, action, refcnt, bindcnt (tc_gen), eaction, ifindex.
    let mut parms = Vec::with_capacity(28);
    for v in [0i32, 0, TC_ACT_STOLEN, 0, 0, TCA_EGRESS_REDIR, to] {
        parms.extend_from_slice(&v.to_ne_bytes());
    }
    let info = (1 << 16) | ETH_P_ALL_BE;
    Msg::new(
        libc::RTM_NEWTFILTER,
        flags,
        &tcmsg(from, 0, INGRESS_HANDLE, info),
    )
    .attr(TCA_KIND, b"u32\0")
    .begin(TCA_OPTIONS)
    .attr(TCA_U32_SEL, &match_everything())
    .begin(TCA_U32_ACT)
    .begin(1) // the first action of the list
    .attr(TCA_ACT_KIND, b"mirred\0")
    .begin(TCA_ACT_OPTIONS)
    .attr(TCA_MIRRED_PARMS, &parms)
    .end()
    .end()
    .end()
    .end()
    .finish()
}

/// A `struct tc_u32_sel` (flags, offshift, nkeys, pad, offmask, off, offoff, hoff, hmask)
/// with one `struct tc_u32_key` (mask, val, off, offmask) whose mask is 0: every frame matches.
fn match_everything() -> [u8; 32] {
    let mut sel = [0u8; 32];
    sel[0] = TC_U32_TERMINAL;
    sel[2] = 1;
    sel
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_redirect_filter_is_laid_out_as_tc_sends_it() {
        let m = add_redirect(7, 9);
        assert_eq!(
            u32::from_ne_bytes(m[..4].try_into().unwrap()) as usize,
            m.len()
        );
        assert_eq!(
            u16::from_ne_bytes(m[4..6].try_into().unwrap()),
            libc::RTM_NEWTFILTER
        );
        // tcmsg after the 16-byte header: ifindex 7, parent ffff:, prio 1 protocol all.
        assert_eq!(i32::from_ne_bytes(m[20..24].try_into().unwrap()), 7);
        assert_eq!(
            u32::from_ne_bytes(m[28..32].try_into().unwrap()),
            INGRESS_HANDLE
        );
        assert_eq!(
            u32::from_ne_bytes(m[32..36].try_into().unwrap()),
            0x0001_0300
        );
        let tail = &m[36..];
        assert_eq!(&tail[4..8], b"u32\0");
        // The mirred parameters end with eaction = egress redirect and ifindex 9.
        let parms_end = m.len();
        assert_eq!(
            i32::from_ne_bytes(m[parms_end - 8..parms_end - 4].try_into().unwrap()),
            1
        );
        assert_eq!(
            i32::from_ne_bytes(m[parms_end - 4..].try_into().unwrap()),
            9
        );
        assert_eq!(m.len() % 4, 0);
    }

    #[test]
    fn spec_defaults() {
        let n: PodNet = serde_json::from_str(r#"{"netns": "/run/vessel/netns/p"}"#).unwrap();
        assert_eq!((n.peer.as_str(), n.tap.as_str()), ("eth0", "vessel-tap0"));
        assert!(!n.deferred);
        assert!(serde_json::from_str::<PodNet>(r#"{"netns": "/x", "bogus": 1}"#).is_err());
    }
}
