//! systemd's readiness protocol (sd_notify(3)) without libsystemd: one datagram to the
//! socket in `$NOTIFY_SOCKET` (a path, or `@name` in the abstract namespace). With the unit's
//! `Type=notify`, systemd holds `systemctl start vessel` (and units ordered after it, such as
//! kubelet) until vesseld answers on its CRI socket.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixDatagram;

/// Sends `state` (e.g. `READY=1`) to the service manager, if vesseld runs under one.
/// Returns whether a manager was told.
pub fn notify(state: &str) -> bool {
    let Some(socket) = std::env::var_os("NOTIFY_SOCKET") else {
        return false;
    };
    match notify_to(&socket, state) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(socket = ?socket, error = %e, "cannot notify the service manager");
            false
        }
    }
}

/// Sends `state` to the notify socket `socket`.
pub fn notify_to(socket: &OsStr, state: &str) -> std::io::Result<()> {
    let sock = UnixDatagram::unbound()?;
    let bytes = socket.as_bytes();
    let sent = match bytes.strip_prefix(b"@") {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            sock.send_to_addr(state.as_bytes(), &addr)?
        }
        None => sock.send_to(state.as_bytes(), socket)?,
    };
    if sent != state.len() {
        return Err(std::io::Error::other("notify message cut short"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_and_an_abstract_socket_get_the_message() {
        let (_d, p) = crate::testing::temp_path("notify");
        let rx = UnixDatagram::bind(&p).unwrap();
        notify_to(p.as_os_str(), "READY=1\nSTATUS=serving").unwrap();
        let mut buf = [0u8; 64];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=serving");

        use std::os::linux::net::SocketAddrExt;
        let name = format!("vessel-notify-test-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let rx = UnixDatagram::bind_addr(&addr).unwrap();
        notify_to(OsStr::new(&format!("@{name}")), "STOPPING=1").unwrap();
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");

        assert!(notify_to(OsStr::new("/nonexistent/notify"), "READY=1").is_err());
    }
}
