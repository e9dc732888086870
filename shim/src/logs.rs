//! Container logs from the guest: the agent connects to a host vsock port (the shim listens on
//! `<vsock uds_path>_<port>`), writes `<container-id>\n`, then complete log lines. Each line
//! goes with one `write(2)` to the file descriptor registered for that id ([`LogRouter::set`],
//! from the control socket's `set_log`); lines of an id with no fd yet are held (up to
//! [`HELD_LIMIT`] bytes per id) and written when one arrives.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// Lines held per id while it has no fd.
pub const HELD_LIMIT: usize = 1 << 20;
/// The longest line accepted (bytes, newline included); a longer one is dropped.
pub const MAX_LINE: usize = 1 << 20;
/// At most this many ids without an fd have lines held (a guest cannot grow the shim
/// without bound by inventing ids).
pub const HELD_IDS: usize = 256;
/// The longest container id line.
const MAX_ID: usize = 256;

#[derive(Default)]
struct Held {
    lines: Vec<Vec<u8>>,
    bytes: usize,
    dropped: u64,
}

#[derive(Default)]
struct Inner {
    fds: HashMap<String, Arc<File>>,
    held: HashMap<String, Held>,
}

/// Where each container's log lines go.
#[derive(Default)]
pub struct LogRouter {
    inner: Mutex<Inner>,
}

fn write_line(id: &str, f: &File, line: &[u8]) {
    // One write(2) per line: with O_APPEND each line lands whole, even with other writers.
    let mut w = f;
    let rest = match w.write(line) {
        Ok(n) => &line[n..],
        // Nothing was written: try again, whole.
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => line,
        Err(e) => {
            tracing::warn!(id, "log write: {e}");
            return;
        }
    };
    if !rest.is_empty() {
        if let Err(e) = w.write_all(rest) {
            tracing::warn!(id, "log write: {e}");
        }
    }
}

impl LogRouter {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lines of `id` go to `fd` from now on (replacing an earlier fd: a log reopen); lines
    /// held for it are written first.
    pub fn set(&self, id: &str, fd: OwnedFd) {
        let f = Arc::new(File::from(fd));
        let mut g = self.lock();
        if let Some(h) = g.held.remove(id) {
            if h.dropped > 0 {
                tracing::warn!(
                    id,
                    dropped = h.dropped,
                    "log lines were dropped before set_log"
                );
            }
            for l in &h.lines {
                write_line(id, &f, l);
            }
        }
        if g.fds.insert(id.to_string(), f).is_some() {
            tracing::info!(id, "log fd replaced");
        }
    }

    /// Forgets the fd of `id` (and anything held for it); whether it had one.
    pub fn drop_log(&self, id: &str) -> bool {
        let mut g = self.lock();
        g.held.remove(id);
        g.fds.remove(id).is_some()
    }

    /// Writes one complete line (newline included) of `id`.
    pub fn line(&self, id: &str, line: &[u8]) {
        let f = {
            let mut g = self.lock();
            match g.fds.get(id) {
                Some(f) => f.clone(),
                None => {
                    if !g.held.contains_key(id) && g.held.len() >= HELD_IDS {
                        tracing::warn!(id, "lines held for {HELD_IDS} ids already: dropping");
                        return;
                    }
                    let h = g.held.entry(id.to_string()).or_default();
                    if h.bytes + line.len() > HELD_LIMIT {
                        if h.dropped == 0 {
                            tracing::warn!(
                                id,
                                "no log file registered and {HELD_LIMIT} bytes held: dropping lines"
                            );
                        }
                        h.dropped += 1;
                    } else {
                        h.bytes += line.len();
                        h.lines.push(line.to_vec());
                    }
                    return;
                }
            }
        };
        // Outside the lock: a slow file holds up only its own container. Lines of one id come
        // from one connection, in order; a concurrent set() writes the held lines first.
        write_line(id, &f, line);
    }

    /// Bytes held for `id` (for tests and diagnostics).
    pub fn held_bytes(&self, id: &str) -> usize {
        self.lock().held.get(id).map(|h| h.bytes).unwrap_or(0)
    }
}

/// Reads one guest log connection: the id line (`<token> <id>` where the pod has a `token`),
/// then lines until EOF. A connection without the token is refused before anything of it is
/// written anywhere.
pub fn serve_connection(
    router: &LogRouter,
    stream: impl Read,
    token: Option<&str>,
) -> std::io::Result<()> {
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    let mut r = BufReader::new(stream);
    let mut id = Vec::new();
    let limit = MAX_ID + token.map_or(0, |t| t.len() + 1);
    (&mut r).take(limit as u64 + 1).read_until(b'\n', &mut id)?;
    if id.last() != Some(&b'\n') {
        return Err(bad("no container id line"));
    }
    id.pop();
    if let Some(token) = token {
        let (given, rest) = match id.iter().position(|b| *b == b' ') {
            Some(i) => (&id[..i], id[i + 1..].to_vec()),
            None => (&id[..], Vec::new()),
        };
        if !same_secret(given, token.as_bytes()) {
            return Err(bad("a connection without the pod's log token: dropped"));
        }
        id = rest;
    }
    let id = String::from_utf8(id)
        .ok()
        .filter(|s| !s.is_empty())
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "bad container id"))?;
    tracing::debug!(%id, "log connection");
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = (&mut r)
            .take(MAX_LINE as u64)
            .read_until(b'\n', &mut line)?;
        if n == 0 {
            return Ok(());
        }
        if line.last() == Some(&b'\n') {
            router.line(&id, &line);
        } else if n == MAX_LINE {
            tracing::warn!(%id, "log line longer than {MAX_LINE} bytes: dropping it");
            // Skip the rest of that line.
            let mut rest = Vec::new();
            loop {
                rest.clear();
                let k = (&mut r)
                    .take(MAX_LINE as u64)
                    .read_until(b'\n', &mut rest)?;
                if k == 0 || rest.last() == Some(&b'\n') {
                    break;
                }
            }
        } else {
            tracing::debug!(%id, bytes = n, "log connection ended inside a line: dropped");
            return Ok(());
        }
    }
}

/// Compares secrets in time that does not depend on where they differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// A Unix socket path that is removed when this is dropped.
pub struct SocketPath(PathBuf);

impl SocketPath {
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for SocketPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Binds a Unix socket at `path` with mode 0600. A socket file no live process answers on
/// (what a killed shim leaves) is replaced; a live one is an error.
pub fn bind_private(path: &Path) -> std::io::Result<(UnixListener, SocketPath)> {
    if path.exists() && UnixStream::connect(path).is_err() {
        std::fs::remove_file(path)?;
    }
    // Bind with no permission for group and others from the start (umask), then chmod to be
    // explicit; the shim binds before it starts any thread that creates files.
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let l = UnixListener::bind(path);
    nix::sys::stat::umask(old);
    let l =
        l.map_err(|e| std::io::Error::new(e.kind(), format!("binding {}: {e}", path.display())))?;
    let guard = SocketPath(path.to_path_buf());
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok((l, guard))
}

/// The log listener: accepts guest connections on a thread, one thread per connection.
pub fn serve(
    listener: UnixListener,
    router: Arc<LogRouter>,
    token: Option<String>,
) -> std::io::Result<()> {
    let token: Option<Arc<str>> = token.map(Arc::from);
    std::thread::Builder::new()
        .name("log-accept".into())
        .spawn(move || {
            for s in listener.incoming() {
                match s {
                    Ok(s) => {
                        let router = router.clone();
                        let token = token.clone();
                        let spawned =
                            std::thread::Builder::new()
                                .name("log-conn".into())
                                .spawn(move || {
                                    if let Err(e) = serve_connection(&router, s, token.as_deref()) {
                                        tracing::warn!("log connection: {e}");
                                    }
                                });
                        if let Err(e) = spawned {
                            tracing::warn!("log connection thread: {e}");
                        }
                    }
                    Err(e) => {
                        tracing::warn!("log accept: {e}");
                        std::thread::sleep(std::time::Duration::from_millis(10));
                    }
                }
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::OpenOptions;

    fn open_log(p: &Path) -> OwnedFd {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .unwrap()
            .into()
    }

    #[test]
    fn lines_go_to_the_registered_fd_and_reopen_switches() {
        let d = tempfile::tempdir().unwrap();
        let r = LogRouter::default();
        r.line("c1", b"early 1\n");
        r.line("c1", b"early 2\n");
        assert_eq!(r.held_bytes("c1"), 16);
        r.set("c1", open_log(&d.path().join("a.log")));
        assert_eq!(r.held_bytes("c1"), 0);
        r.line("c1", b"third\n");
        r.set("c1", open_log(&d.path().join("b.log")));
        r.line("c1", b"fourth\n");
        assert_eq!(
            std::fs::read_to_string(d.path().join("a.log")).unwrap(),
            "early 1\nearly 2\nthird\n"
        );
        assert_eq!(
            std::fs::read_to_string(d.path().join("b.log")).unwrap(),
            "fourth\n"
        );
        assert!(r.drop_log("c1"));
        assert!(!r.drop_log("c1"));
        r.line("c1", b"held again\n");
        assert_eq!(r.held_bytes("c1"), 11);
    }

    #[test]
    fn held_lines_are_capped() {
        let r = LogRouter::default();
        let line = vec![b'x'; 1000];
        for _ in 0..2000 {
            r.line("c", &line);
        }
        assert!(r.held_bytes("c") <= HELD_LIMIT);
        assert!(r.held_bytes("c") >= HELD_LIMIT - 1000);
        for i in 0..HELD_IDS + 10 {
            r.line(&format!("id{i}"), b"x\n");
        }
        assert_eq!(r.held_bytes(&format!("id{}", HELD_IDS - 2)), 2);
        assert_eq!(r.held_bytes(&format!("id{}", HELD_IDS + 5)), 0);
    }

    #[test]
    fn connection_protocol() {
        let d = tempfile::tempdir().unwrap();
        let r = LogRouter::default();
        r.set("ctr", open_log(&d.path().join("c.log")));
        serve_connection(&r, &b"ctr\nl1\nl2\npartial"[..], None).unwrap();
        assert_eq!(
            std::fs::read_to_string(d.path().join("c.log")).unwrap(),
            "l1\nl2\n"
        );
        assert!(serve_connection(&r, &b"no newline"[..], None).is_err());
        assert!(serve_connection(&r, &b"\nx\n"[..], None).is_err());
        let long_id = format!("{}\n", "i".repeat(MAX_ID + 10));
        assert!(serve_connection(&r, long_id.as_bytes(), None).is_err());
    }

    #[test]
    fn a_connection_without_the_token_writes_nothing() {
        let d = tempfile::tempdir().unwrap();
        let r = LogRouter::default();
        r.set("ctr", open_log(&d.path().join("c.log")));
        let t = Some("s3cret");
        // The id alone, a wrong token, a token of another length: refused, nothing written
        // and nothing held.
        for bad in [
            &b"ctr\nforged\n"[..],
            b"s3creT ctr\nforged\n",
            b"s3cre ctr\nforged\n",
            b"s3cret\nforged\n",
        ] {
            assert!(
                serve_connection(&r, bad, t).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(serve_connection(&r, &b"s3cret other\nheld\n"[..], Some("x")).is_err());
        assert_eq!(r.held_bytes("other"), 0);
        assert_eq!(std::fs::read_to_string(d.path().join("c.log")).unwrap(), "");
        serve_connection(&r, &b"s3cret ctr\nreal\n"[..], t).unwrap();
        assert_eq!(
            std::fs::read_to_string(d.path().join("c.log")).unwrap(),
            "real\n"
        );
    }
}
