//! The guest's pod network: the interfaces vesseld names (virtio-net, joined on the host to
//! the pod's CNI interface) come up with their addresses, then the routes are added. Over
//! rtnetlink ([`crate::netlink`]); IPv6 addresses skip duplicate address detection, since the
//! address is the CNI interface's and already unique on the network.

use std::ffi::CString;
use std::net::IpAddr;

use crate::error::AgentError;
use crate::netlink::{Msg, Socket, NLM_F_CREATE, NLM_F_REPLACE};
use crate::proto::{GuestInterface, GuestRoute};

const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const IFA_F_NODAD: u8 = 0x02;
const RTA_DST: u16 = 1;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const RT_TABLE_MAIN: u8 = 254;
const RTPROT_BOOT: u8 = 3;
const RT_SCOPE_UNIVERSE: u8 = 0;
const RT_SCOPE_LINK: u8 = 253;
const RTN_UNICAST: u8 = 1;

/// An address with its prefix length, from `a.b.c.d/n` or `x::y/n`.
pub fn parse_cidr(s: &str) -> Result<(IpAddr, u8), AgentError> {
    let bad = || AgentError::InvalidArgument(format!("bad CIDR {s:?}"));
    let (a, n) = s.split_once('/').ok_or_else(bad)?;
    let addr: IpAddr = a.parse().map_err(|_| bad())?;
    let n: u8 = n.parse().map_err(|_| bad())?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    if n > max {
        return Err(bad());
    }
    Ok((addr, n))
}

fn family(a: &IpAddr) -> u8 {
    // AF_INET (2) and AF_INET6 (10) fit a byte.
    #[allow(clippy::cast_possible_truncation)]
    match a {
        IpAddr::V4(_) => libc::AF_INET as u8,
        IpAddr::V6(_) => libc::AF_INET6 as u8,
    }
}

fn octets(a: &IpAddr) -> Vec<u8> {
    match a {
        IpAddr::V4(v) => v.octets().to_vec(),
        IpAddr::V6(v) => v.octets().to_vec(),
    }
}

fn index_of(name: &str) -> Result<u32, AgentError> {
    let c = CString::new(name)
        .map_err(|_| AgentError::InvalidArgument(format!("bad interface name {name:?}")))?;
    // SAFETY: if_nametoindex reads a NUL-terminated string that outlives the call.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        return Err(AgentError::FailedPrecondition(format!(
            "the guest has no interface {name:?}: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(i)
}

/// `RTM_NEWADDR` for `addr/prefix` on interface `index`.
pub fn new_address(index: u32, addr: &IpAddr, prefix: u8) -> Vec<u8> {
    let flags = if addr.is_ipv6() { IFA_F_NODAD } else { 0 };
    // struct ifaddrmsg: family, prefixlen, flags, scope, index.
    let mut fixed = vec![family(addr), prefix, flags, RT_SCOPE_UNIVERSE];
    fixed.extend_from_slice(&index.to_ne_bytes());
    let o = octets(addr);
    Msg::new(libc::RTM_NEWADDR, NLM_F_CREATE | NLM_F_REPLACE, &fixed)
        .attr(IFA_LOCAL, &o)
        .attr(IFA_ADDRESS, &o)
        .finish()
}

const IFLA_ADDRESS: u16 = 1;
const IFLA_MTU: u16 = 4;

/// `RTM_NEWLINK` (set) for interface `index`: its MAC and/or MTU (`None`: left as is).
pub fn set_link(index: u32, mac: Option<[u8; 6]>, mtu: Option<u32>) -> Vec<u8> {
    // struct ifinfomsg: family, pad, type (u16), index (i32), flags, change.
    let mut fixed = vec![0u8; 4];
    fixed.extend_from_slice(&index.to_ne_bytes());
    fixed.extend_from_slice(&[0u8; 8]);
    let mut m = Msg::new(libc::RTM_NEWLINK, 0, &fixed);
    if let Some(mac) = mac {
        m = m.attr(IFLA_ADDRESS, &mac);
    }
    if let Some(mtu) = mtu {
        m = m.attr(IFLA_MTU, &mtu.to_ne_bytes());
    }
    m.finish()
}

/// "aa:bb:cc:dd:ee:ff" as bytes.
fn parse_mac(s: &str) -> Result<[u8; 6], AgentError> {
    let bad = || AgentError::InvalidArgument(format!("bad MAC address {s:?}"));
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut mac {
        let p = parts.next().filter(|p| p.len() == 2).ok_or_else(bad)?;
        *b = u8::from_str_radix(p, 16).map_err(|_| bad())?;
    }
    if parts.next().is_some() {
        return Err(bad());
    }
    Ok(mac)
}

/// `RTM_NEWROUTE` for `dst/len` via `gateway` (or on-link) out of interface `index`.
pub fn new_route(index: u32, dst: &IpAddr, len: u8, gateway: Option<&IpAddr>) -> Vec<u8> {
    let scope = if gateway.is_some() {
        RT_SCOPE_UNIVERSE
    } else {
        RT_SCOPE_LINK
    };
    // struct rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags (u32).
    let mut fixed = vec![
        family(dst),
        len,
        0,
        0,
        RT_TABLE_MAIN,
        RTPROT_BOOT,
        scope,
        RTN_UNICAST,
    ];
    fixed.extend_from_slice(&0u32.to_ne_bytes());
    let mut m = Msg::new(libc::RTM_NEWROUTE, NLM_F_CREATE | NLM_F_REPLACE, &fixed);
    if len > 0 {
        m = m.attr(RTA_DST, &octets(dst));
    }
    if let Some(g) = gateway {
        m = m.attr(RTA_GATEWAY, &octets(g));
    }
    m.attr(RTA_OIF, &index.to_ne_bytes()).finish()
}

/// `RTM_NEWLINK` moving interface `index` into the network namespace open as `ns_fd`.
pub fn move_link(index: u32, ns_fd: i32) -> Vec<u8> {
    // struct ifinfomsg: family, pad, type (u16), index (i32), flags (u32), change (u32).
    // AF_UNSPEC is 0.
    let mut fixed = vec![0u8, 0, 0, 0];
    fixed.extend_from_slice(&index.to_ne_bytes());
    fixed.extend_from_slice(&0u32.to_ne_bytes());
    fixed.extend_from_slice(&0u32.to_ne_bytes());
    Msg::new(libc::RTM_NEWLINK, 0, &fixed)
        .attr(libc::IFLA_NET_NS_FD, &ns_fd.to_ne_bytes())
        .finish()
}

/// The device interfaces (a NIC, not loopback nor a per-namespace fallback tunnel like
/// `sit0`, which cannot leave its namespace) of this thread's network namespace, by name,
/// with their indexes (read from `sys_class_net`, the namespace's `/sys/class/net`).
pub fn device_links(sys_class_net: &std::path::Path) -> std::io::Result<Vec<(String, u32)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(sys_class_net)?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !e.path().join("device").exists() {
            continue;
        }
        let index = std::fs::read_to_string(e.path().join("ifindex"))?
            .trim()
            .parse::<u32>()
            .map_err(|err| std::io::Error::other(format!("{name}/ifindex: {err}")))?;
        out.push((name, index));
    }
    Ok(out)
}

/// Checks every address, route and gateway before anything is changed.
pub fn validate(interfaces: &[GuestInterface], routes: &[GuestRoute]) -> Result<(), AgentError> {
    for a in interfaces.iter().flat_map(|i| &i.addresses) {
        parse_cidr(a)?;
    }
    for i in interfaces.iter().filter(|i| !i.mac.is_empty()) {
        parse_mac(&i.mac)?;
    }
    for r in routes {
        gateway_of(r)?;
    }
    Ok(())
}

/// A route's destination and gateway (`None`: on-link), of one address family.
fn gateway_of(r: &GuestRoute) -> Result<((IpAddr, u8), Option<IpAddr>), AgentError> {
    let (dst, len) = parse_cidr(&r.destination)?;
    if r.gateway.is_empty() {
        return Ok(((dst, len), None));
    }
    let g: IpAddr = r
        .gateway
        .parse()
        .map_err(|_| AgentError::InvalidArgument(format!("bad gateway {:?}", r.gateway)))?;
    if g.is_ipv4() != dst.is_ipv4() {
        return Err(AgentError::InvalidArgument(format!(
            "route to {} via {}: mixed address families",
            r.destination, r.gateway
        )));
    }
    Ok(((dst, len), Some(g)))
}

/// Brings `interfaces` up with their addresses, then adds `routes` in order.
pub fn configure(interfaces: &[GuestInterface], routes: &[GuestRoute]) -> Result<(), AgentError> {
    if interfaces.is_empty() && routes.is_empty() {
        return Ok(());
    }
    let nl = Socket::open().map_err(|e| AgentError::internal("netlink socket", e))?;
    for i in interfaces {
        let index = index_of(&i.name)?;
        let mac = Some(i.mac.as_str())
            .filter(|m| !m.is_empty())
            .map(parse_mac)
            .transpose()?;
        let mtu = Some(i.mtu).filter(|m| *m != 0);
        if mac.is_some() || mtu.is_some() {
            nl.request(&set_link(index, mac, mtu)).map_err(|e| {
                AgentError::internal(
                    format!("setting {}'s MAC {:?} and MTU {}", i.name, i.mac, i.mtu),
                    e,
                )
            })?;
        }
        crate::flat::link_up(&i.name)
            .map_err(|e| AgentError::internal(format!("bringing up {}", i.name), e))?;
        for a in &i.addresses {
            let (addr, prefix) = parse_cidr(a)?;
            nl.request(&new_address(index, &addr, prefix))
                .map_err(|e| AgentError::internal(format!("adding {a} to {}", i.name), e))?;
        }
        tracing::info!(interface = %i.name, addresses = ?i.addresses, "interface configured");
    }
    for r in routes {
        let index = index_of(&r.interface)?;
        let ((dst, len), gw) = gateway_of(r)?;
        nl.request(&new_route(index, &dst, len, gw.as_ref()))
            .map_err(|e| {
                AgentError::internal(
                    format!(
                        "adding route {} via {:?} dev {}",
                        r.destination, r.gateway, r.interface
                    ),
                    e,
                )
            })?;
    }
    if !routes.is_empty() {
        tracing::info!(routes = routes.len(), "routes added");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    /// In a network namespace of its own (a thread's), on a veth `eth0`: addresses, the
    /// on-link route to a gateway outside the prefix, the default route, as `ip` shows them.
    #[test]
    fn a_link_message_carries_the_mac_and_mtu() {
        let m = set_link(7, Some([2, 0x42, 0xa, 0x59, 0, 5]), Some(1400));
        assert_eq!(
            u32::from_ne_bytes(m[..4].try_into().unwrap()) as usize,
            m.len()
        );
        assert_eq!(
            u16::from_ne_bytes(m[4..6].try_into().unwrap()),
            libc::RTM_NEWLINK
        );
        // struct ifinfomsg after the 16-byte header: family, pad, type, then index 7.
        assert_eq!(&m[16..20], &[0, 0, 0, 0]);
        assert_eq!(i32::from_ne_bytes(m[20..24].try_into().unwrap()), 7);
        assert_eq!(&m[24..32], &[0u8; 8]);
        // IFLA_ADDRESS (6 bytes, padded to 8), then IFLA_MTU.
        assert_eq!(u16::from_ne_bytes(m[32..34].try_into().unwrap()), 10);
        assert_eq!(
            u16::from_ne_bytes(m[34..36].try_into().unwrap()),
            IFLA_ADDRESS
        );
        assert_eq!(&m[36..42], &[2, 0x42, 0xa, 0x59, 0, 5]);
        assert_eq!(u16::from_ne_bytes(m[46..48].try_into().unwrap()), IFLA_MTU);
        assert_eq!(u32::from_ne_bytes(m[48..52].try_into().unwrap()), 1400);
        assert_eq!(m.len(), 52);
        // Neither: an empty request (nothing to change).
        assert_eq!(set_link(7, None, None).len(), 32);
    }

    #[test]
    fn configures_a_real_interface() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 || Command::new("ip").arg("-V").output().is_err() {
            println!("SKIP configures_a_real_interface: needs root and iproute2");
            return;
        }
        let out = std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            // Children forked from this thread start in its namespace.
            let ok = Command::new("ip")
                .args([
                    "link", "add", "eth0", "type", "veth", "peer", "name", "peer0",
                ])
                .status()
                .unwrap();
            assert!(ok.success());
            let up = Command::new("ip")
                .args(["link", "set", "peer0", "up"])
                .status();
            assert!(up.unwrap().success());
            let iface = GuestInterface {
                name: "eth0".into(),
                addresses: vec!["10.89.0.5/32".into(), "fd00:89::5/64".into()],
                mac: "02:42:0a:59:00:05".into(),
                mtu: 1400,
            };
            let route = |d: &str, g: &str| GuestRoute {
                destination: d.into(),
                gateway: g.into(),
                interface: "eth0".into(),
            };
            let routes = [
                route("169.254.1.1/32", ""),
                route("0.0.0.0/0", "169.254.1.1"),
                route("::/0", "fd00:89::1"),
            ];
            configure(&[iface], &routes).unwrap();
            // Twice is fine (a retried ConfigureSandbox).
            configure(&[], &routes).unwrap();
            let show = |args: &[&str]| {
                let o = Command::new("ip").args(args).output().unwrap();
                String::from_utf8_lossy(&o.stdout).into_owned()
            };
            (
                show(&["addr", "show", "eth0"]),
                show(&["route", "show"]),
                show(&["-6", "route", "show"]),
            )
        })
        .join()
        .unwrap();
        let (addrs, v4, v6) = out;
        assert!(addrs.contains("inet 10.89.0.5/32"), "{addrs}");
        // The MAC and MTU the request gave, set before the interface came up.
        assert!(addrs.contains("mtu 1400"), "{addrs}");
        assert!(addrs.contains("link/ether 02:42:0a:59:00:05"), "{addrs}");
        assert!(
            addrs.contains("inet6 fd00:89::5/64 scope global nodad"),
            "{addrs}"
        );
        assert!(v4.contains("default via 169.254.1.1 dev eth0"), "{v4}");
        assert!(v4.contains("169.254.1.1 dev eth0"), "{v4}");
        assert!(v6.contains("default via fd00:89::1 dev eth0"), "{v6}");
        let bad = GuestRoute {
            destination: "0.0.0.0/0".into(),
            gateway: "fd00::1".into(),
            interface: "eth0".into(),
        };
        assert!(validate(&[], &[bad]).is_err());
        let mac = |m: &str| GuestInterface {
            name: "eth0".into(),
            mac: m.into(),
            ..Default::default()
        };
        assert!(validate(&[mac("02:42:0a:59:00:05")], &[]).is_ok());
        for m in [
            "02:42:0a:59:00",
            "02:42:0a:59:00:05:06",
            "zz:42:0a:59:00:05",
            "2:42:0a:59:00:05",
        ] {
            assert!(validate(&[mac(m)], &[]).is_err(), "{m}");
        }
    }

    #[test]
    fn cidrs_parse_and_bad_ones_are_refused() {
        assert_eq!(
            parse_cidr("10.88.0.5/16").unwrap(),
            ("10.88.0.5".parse().unwrap(), 16)
        );
        assert_eq!(parse_cidr("fd00::5/64").unwrap().1, 64);
        for bad in ["10.88.0.5", "10.88.0.5/33", "x/8", "fd00::/129", ""] {
            assert!(parse_cidr(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn messages_carry_the_address_and_route() {
        let a: IpAddr = "10.88.0.5".parse().unwrap();
        let m = new_address(3, &a, 16);
        // ifaddrmsg after the 16-byte header, then IFA_LOCAL and IFA_ADDRESS.
        assert_eq!(&m[16..20], &[2, 16, 0, 0]);
        assert_eq!(u32::from_ne_bytes(m[20..24].try_into().unwrap()), 3);
        assert_eq!(&m[28..32], &[10, 88, 0, 5]);
        let v6: IpAddr = "fd00::5".parse().unwrap();
        assert_eq!(new_address(3, &v6, 64)[18], IFA_F_NODAD);

        let any: IpAddr = "0.0.0.0".parse().unwrap();
        let gw: IpAddr = "10.88.0.1".parse().unwrap();
        let r = new_route(3, &any, 0, Some(&gw));
        // rtmsg: family, dst_len 0, ..., scope universe; no RTA_DST for a default route.
        assert_eq!(
            r[16..24],
            [2, 0, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, 0, RTN_UNICAST]
        );
        assert_eq!(
            u16::from_ne_bytes(r[30..32].try_into().unwrap()),
            RTA_GATEWAY
        );
        let link = new_route(3, &gw, 32, None);
        assert_eq!(link[22], RT_SCOPE_LINK);
        assert_eq!(
            u16::from_ne_bytes(link[30..32].try_into().unwrap()),
            RTA_DST
        );
    }
}
