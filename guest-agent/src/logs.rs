//! Container logs in the CRI format: `<RFC3339Nano UTC> <stdout|stderr> <F|P> <content>\n`.
//!
//! A line longer than [`MAX_LINE`] is written as `P` (partial) records followed by a final `F`
//! record; an unterminated last line at EOF is written as `F`. Records go to a sink:
//! - a file opened in append mode, which can be reopened after kubelet renamed it
//!   ([`LogFile::reopen`]);
//! - a stream to the host (VM pods: a vsock connection to CID 2, see [`LogFile::vsock`]) that
//!   starts with the line `<container-id>\n`; the host owns the file, so reopening is a no-op.
//!
//! Output keeps flowing whether or not any client is connected: the pumps are agent tasks.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};

/// The longest content of one log record; longer lines are split.
pub const MAX_LINE: usize = 16 * 1024;

/// The send timeout of a log stream to the host over vsock: how long its writer waits in one
/// write before it says that the host is slow (it waits on; see [`stream_writer`]).
pub const STREAM_SEND_TIMEOUT: Duration = Duration::from_secs(5);

/// Which output stream a record came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    fn as_str(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// Formats one CRI record (with its trailing newline), timestamped now.
pub fn format_record(stream: Stream, partial: bool, content: &[u8]) -> Vec<u8> {
    let ts = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Nanos, true);
    let mut rec = Vec::with_capacity(ts.len() + content.len() + 12);
    rec.extend_from_slice(ts.as_bytes());
    rec.push(b' ');
    rec.extend_from_slice(stream.as_str().as_bytes());
    rec.extend_from_slice(if partial { b" P " } else { b" F " });
    rec.extend_from_slice(content);
    rec.push(b'\n');
    rec
}

/// Where a container's records go.
enum Sink {
    /// Output is discarded.
    Discard,
    /// A CRI log file on this machine.
    File { path: PathBuf, file: Option<File> },
    /// A stream to the host that owns the file (vsock), written by a thread of its own
    /// ([`stream_writer`]) from this queue; `None` once the stream broke.
    Stream {
        what: String,
        queue: Option<std::sync::mpsc::SyncSender<Vec<u8>>>,
    },
}

/// How many records may wait for a stream to the host: a host that is slow for a while
/// (its disk) holds them up to here, and only beyond does the output's pump wait.
const STREAM_QUEUE: usize = 256;

/// Sends the records of `queue` over `conn` in order, each whole, until the queue closes (the
/// container's log is dropped) or the stream breaks. A host that takes nothing for a send
/// timeout is waited for, not given up on: a record cut in two would garble its file, and
/// one dropped stream lost the rest of the container's log, where the host was only slow.
fn stream_writer(
    what: &str,
    mut conn: Box<dyn Write + Send>,
    queue: std::sync::mpsc::Receiver<Vec<u8>>,
) {
    for rec in queue {
        let mut off = 0;
        let mut waited = false;
        while off < rec.len() {
            match conn.write(&rec[off..]) {
                Ok(0) => {
                    tracing::warn!(to = %what, "the host closed the container's log stream; dropping the rest");
                    return;
                }
                Ok(n) => off += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    if !waited {
                        tracing::warn!(to = %what, "the host takes no log records; waiting for it");
                        waited = true;
                    }
                }
                Err(e) => {
                    tracing::warn!(to = %what, error = %e, "sending container log records; dropping the rest");
                    return;
                }
            }
        }
    }
}

/// Raw output chunks for one attached client, with the stream they came from.
pub type Tap = tokio::sync::mpsc::Receiver<(Stream, Vec<u8>)>;
type TapSender = tokio::sync::mpsc::Sender<(Stream, Vec<u8>)>;

/// How many chunks an attached client may fall behind before it is dropped: output never
/// waits for a client (the log and the container come first).
const TAP_DEPTH: usize = 1024;

/// A container's log shared by its output pumps, and the attached clients that also get
/// the raw output.
pub struct LogFile {
    sink: Mutex<Sink>,
    taps: Mutex<Vec<TapSender>>,
}

impl std::fmt::Debug for LogFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sink = self.sink.lock().unwrap_or_else(|e| e.into_inner());
        match &*sink {
            Sink::Discard => write!(f, "LogFile(discard)"),
            Sink::File { path, .. } => write!(f, "LogFile({})", path.display()),
            Sink::Stream { what, .. } => write!(f, "LogFile({what})"),
        }
    }
}

/// Opens the log file `path` for appending, creating it (mode 0640: kubelet reads logs as
/// root) and its missing parent directories (0755), and follows no symbolic link on the way:
/// a link anywhere in `path` is an error, so a log can never be redirected out of the log
/// directory kubelet named. The caller resolves that directory first (`vesseld` passes the
/// canonical log directory joined with a relative, `..`-free log path). Anything but a
/// regular file at `path` (a FIFO, a device) is refused too.
pub fn open_log_nofollow(path: &Path) -> io::Result<File> {
    use rustix::fs::{Mode, OFlags};
    use std::path::Component;
    let refuse = |why: &str| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("log path {}: {why}", path.display()),
        )
    };
    let comps: Vec<Component> = path.components().collect();
    let Some(Component::Normal(name)) = comps.last() else {
        return Err(refuse("does not name a file"));
    };
    let dir_flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let mut dir = rustix::fs::openat(rustix::fs::CWD, ".", dir_flags, Mode::empty())?;
    for c in &comps[..comps.len() - 1] {
        match c {
            Component::RootDir => {
                dir = rustix::fs::openat(rustix::fs::CWD, "/", dir_flags, Mode::empty())?;
            }
            Component::CurDir => {}
            Component::Normal(d) => {
                match rustix::fs::mkdirat(&dir, *d, Mode::from_raw_mode(0o755)) {
                    Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                    Err(e) => return Err(e.into()),
                }
                dir = rustix::fs::openat(&dir, *d, dir_flags, Mode::empty()).map_err(|e| {
                    if e == rustix::io::Errno::NOTDIR || e == rustix::io::Errno::LOOP {
                        refuse(&format!("{:?} is a symbolic link or not a directory", d))
                    } else {
                        e.into()
                    }
                })?;
            }
            Component::ParentDir | Component::Prefix(_) => {
                return Err(refuse("has a `..` component"));
            }
        }
    }
    // O_NONBLOCK: opening a FIFO planted at the path must not hang the caller.
    let fd = rustix::fs::openat(
        &dir,
        *name,
        OFlags::WRONLY
            | OFlags::APPEND
            | OFlags::CREATE
            | OFlags::NOFOLLOW
            | OFlags::NOCTTY
            | OFlags::NONBLOCK
            | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o640),
    )
    .map_err(|e| {
        if e == rustix::io::Errno::LOOP {
            refuse("is a symbolic link")
        } else if e == rustix::io::Errno::NXIO {
            refuse("is not a regular file")
        } else {
            e.into()
        }
    })?;
    let file = File::from(fd);
    if !file.metadata()?.file_type().is_file() {
        return Err(refuse("is not a regular file"));
    }
    let flags = rustix::fs::fcntl_getfl(&file)?;
    rustix::fs::fcntl_setfl(&file, flags - OFlags::NONBLOCK)?;
    Ok(file)
}

impl LogFile {
    fn with(sink: Sink) -> Arc<LogFile> {
        Arc::new(LogFile {
            sink: Mutex::new(sink),
            taps: Mutex::new(Vec::new()),
        })
    }

    /// A new attached client: it gets every chunk the container writes from now on.
    pub fn tap(&self) -> Tap {
        let (tx, rx) = tokio::sync::mpsc::channel(TAP_DEPTH);
        self.taps.lock().unwrap_or_else(|e| e.into_inner()).push(tx);
        rx
    }

    /// Hands a chunk of raw output to the attached clients; one that left or fell too far
    /// behind is dropped.
    fn feed_taps(&self, stream: Stream, data: &[u8]) {
        let mut taps = self.taps.lock().unwrap_or_else(|e| e.into_inner());
        if taps.is_empty() {
            return;
        }
        taps.retain(|t| match t.try_send((stream, data.to_vec())) {
            Ok(()) => true,
            Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => {
                tracing::warn!(?stream, "an attached client fell behind; detached");
                false
            }
            Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => false,
        });
    }

    /// Opens (creating it and its parent directories) `path`; an empty path discards output.
    pub fn open(path: &str) -> io::Result<Arc<LogFile>> {
        if path.is_empty() {
            return Ok(Self::with(Sink::Discard));
        }
        let path = PathBuf::from(path);
        let file = open_log_nofollow(&path)?;
        Ok(Self::with(Sink::File {
            path,
            file: Some(file),
        }))
    }

    /// Sends `id`'s records over `conn` (already connected): writes the header line `<id>\n`,
    /// then one complete record per write.
    pub fn stream(
        header: &str,
        what: impl Into<String>,
        mut conn: Box<dyn Write + Send>,
    ) -> io::Result<Arc<LogFile>> {
        conn.write_all(format!("{header}\n").as_bytes())?;
        let what = what.into();
        let (tx, rx) = std::sync::mpsc::sync_channel(STREAM_QUEUE);
        let name = what.clone();
        std::thread::Builder::new()
            .name("log-stream".into())
            .stack_size(128 << 10)
            .spawn(move || stream_writer(&name, conn, rx))?;
        Ok(Self::with(Sink::Stream {
            what,
            queue: Some(tx),
        }))
    }

    /// Connects to the host (CID 2) at vsock `port` and sends `id`'s records there, after
    /// the pod's `token` (if it has one) and the id.
    pub fn vsock(id: &str, port: u32, token: &str) -> io::Result<Arc<LogFile>> {
        let fd = crate::vsock::connect_blocking(crate::vsock::HOST_CID, port, STREAM_SEND_TIMEOUT)?;
        let header = if token.is_empty() {
            id.to_string()
        } else {
            format!("{token} {id}")
        };
        Self::stream(&header, format!("vsock:2:{port}"), Box::new(File::from(fd)))
    }

    /// Opens the file's path again (kubelet renamed the old one), then closes the old file;
    /// where the path cannot be opened the old file stays (kubelet renames it back), as
    /// containerd keeps it. A stream sink has nothing to reopen: the host reopens its file.
    pub fn reopen(&self) -> io::Result<()> {
        let mut guard = self.sink.lock().unwrap_or_else(|e| e.into_inner());
        if let Sink::File { path, file } = &mut *guard {
            let new = open_log_nofollow(path)?;
            *file = Some(new);
        }
        Ok(())
    }

    /// Writes one record as a single `write` so records of both streams never interleave.
    pub fn write_record(&self, stream: Stream, partial: bool, content: &[u8]) {
        let mut guard = self.sink.lock().unwrap_or_else(|e| e.into_inner());
        match &mut *guard {
            Sink::Discard => {}
            Sink::File { path, file } => {
                let Some(file) = file.as_mut() else { return };
                if let Err(e) = file.write_all(&format_record(stream, partial, content)) {
                    tracing::warn!(path = %path.display(), error = %e, "writing a container log record");
                }
            }
            Sink::Stream { what, queue } => {
                let Some(q) = queue.as_ref() else { return };
                // Waits only while the queue is full (the host took nothing for long).
                if q.send(format_record(stream, partial, content)).is_err() {
                    tracing::debug!(to = %what, "the log stream broke; records dropped");
                    *queue = None;
                }
            }
        }
    }
}

/// Splits a byte stream into CRI records.
#[derive(Debug, Default)]
pub struct LineSplitter {
    buf: Vec<u8>,
}

impl LineSplitter {
    /// Feeds `data`; calls `emit(partial, content)` for every complete record.
    pub fn push(&mut self, mut data: &[u8], emit: &mut impl FnMut(bool, &[u8])) {
        while !data.is_empty() {
            match data.iter().position(|&b| b == b'\n') {
                Some(nl) => {
                    let (line, rest) = (&data[..nl], &data[nl + 1..]);
                    self.append(line, emit);
                    // A line's end is "\n" or "\r\n" (a terminal's, with its default
                    // newline translation): neither is the record's, as containerd reads
                    // them. A buffer kept full is only emitted before more of its line, so
                    // a "\r" it ends with is still here when its "\n" comes.
                    if self.buf.last() == Some(&b'\r') {
                        self.buf.pop();
                    }
                    emit(false, &self.buf);
                    self.buf.clear();
                    data = rest;
                }
                None => {
                    self.append(data, emit);
                    data = &[];
                }
            }
        }
    }

    /// Appends bytes with no newline, emitting `P` records of `MAX_LINE` bytes as the
    /// buffer fills. A full buffer is kept (not emitted) until more data shows whether the
    /// line continues, so that a line of exactly `MAX_LINE` bytes is one `F` record.
    fn append(&mut self, mut data: &[u8], emit: &mut impl FnMut(bool, &[u8])) {
        while !data.is_empty() {
            if self.buf.len() == MAX_LINE {
                emit(true, &self.buf);
                self.buf.clear();
            }
            let take = (MAX_LINE - self.buf.len()).min(data.len());
            self.buf.extend_from_slice(&data[..take]);
            data = &data[take..];
        }
    }

    /// End of stream: an unterminated last line becomes an `F` record.
    pub fn finish(&mut self, emit: &mut impl FnMut(bool, &[u8])) {
        if !self.buf.is_empty() {
            emit(false, &self.buf);
            self.buf.clear();
        }
    }
}

/// Copies `reader` into `log` as records of `stream` until EOF (a pty's EIO counts as EOF).
pub async fn pump<R: AsyncRead + Unpin>(mut reader: R, stream: Stream, log: Arc<LogFile>) {
    let mut splitter = LineSplitter::default();
    let mut buf = vec![0u8; 32 * 1024];
    let mut emit = |partial: bool, content: &[u8]| log.write_record(stream, partial, content);
    loop {
        match reader.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => {
                log.feed_taps(stream, &buf[..n]);
                splitter.push(&buf[..n], &mut emit);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // EIO is how a pty master reports that the last slave fd closed.
                if e.raw_os_error() != Some(libc::EIO) {
                    tracing::warn!(error = %e, ?stream, "reading container output");
                }
                break;
            }
        }
    }
    splitter.finish(&mut emit);
}

/// How large a daemon's own log (the flat agent's `agent.log`, the shim's `shim.log`) grows
/// before it is rotated; one old file (`<path>.1`) is kept.
pub const OWN_LOG_MAX: u64 = 4 << 20;

/// Keeps this process's stderr, which vesseld pointed at `path`, bounded: every `every`, if
/// the file has grown past `max` bytes, it becomes `<path>.1` (replacing the old one) and
/// stderr a new, empty `path`. Everything written to stderr (tracing, panics, libraries'
/// prints) follows. A thread of its own; call it in the process that lives on (after forks).
pub fn bound_stderr(path: PathBuf, max: u64, every: Duration) -> io::Result<()> {
    std::thread::Builder::new()
        .name("log-rotate".into())
        .spawn(move || loop {
            std::thread::sleep(every);
            if let Err(e) = rotate_if_large(2, &path, max) {
                tracing::warn!(path = %path.display(), error = %e, "rotating the log");
            }
        })
        .map(|_| ())
}

/// If `fd` writes to the file at `path` and that file is larger than `max`: renames it to
/// `<path>.1`, creates `path` anew (0640) and makes `fd` point at it. Returns whether it did.
pub fn rotate_if_large(fd: std::os::fd::RawFd, path: &Path, max: u64) -> io::Result<bool> {
    use std::os::fd::{AsRawFd, BorrowedFd};
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    // SAFETY: the caller's fd stays open for the call; it is only borrowed to stat it.
    let target = unsafe { BorrowedFd::borrow_raw(fd) };
    let now = rustix::fs::fstat(target).map_err(io::Error::from)?;
    let on_disk = std::fs::metadata(path)?;
    if on_disk.ino() != now.st_ino || on_disk.dev() != now.st_dev {
        return Ok(false); // not ours (any more)
    }
    if on_disk.len() <= max {
        return Ok(false);
    }
    let mut old = path.as_os_str().to_owned();
    old.push(".1");
    std::fs::rename(path, &old)?;
    let fresh = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o640)
        .open(path)?;
    // SAFETY: dup2(2) on two open descriptors; `fd` now refers to the new file.
    if unsafe { libc::dup2(fresh.as_raw_fd(), fd) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_own_log_past_its_bound_is_rotated_and_the_fd_follows() {
        use std::os::fd::AsRawFd;
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("agent.log");
        let mut w = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap();
        w.write_all(&[b'x'; 100]).unwrap();
        assert!(!rotate_if_large(w.as_raw_fd(), &path, 1000).unwrap());
        w.write_all(&[b'y'; 1000]).unwrap();
        assert!(rotate_if_large(w.as_raw_fd(), &path, 1000).unwrap());
        assert_eq!(
            std::fs::metadata(d.path().join("agent.log.1"))
                .unwrap()
                .len(),
            1100
        );
        w.write_all(b"after\n").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "after\n");
        // A path that is no longer the fd's file is left alone.
        std::fs::rename(&path, d.path().join("moved")).unwrap();
        std::fs::write(&path, [0u8; 5000]).unwrap();
        assert!(!rotate_if_large(w.as_raw_fd(), &path, 1000).unwrap());
    }

    fn split(chunks: &[&[u8]]) -> Vec<(bool, Vec<u8>)> {
        let mut out = Vec::new();
        let mut s = LineSplitter::default();
        let mut emit = |p: bool, c: &[u8]| out.push((p, c.to_vec()));
        for c in chunks {
            s.push(c, &mut emit);
        }
        s.finish(&mut emit);
        out
    }

    #[test]
    fn lines_and_partials() {
        let out = split(&[b"hel", b"lo\nworld\n", b"tail"]);
        assert_eq!(
            out,
            vec![
                (false, b"hello".to_vec()),
                (false, b"world".to_vec()),
                (false, b"tail".to_vec())
            ]
        );
        let long = vec![b'x'; MAX_LINE * 2 + 5];
        let mut data = long.clone();
        data.push(b'\n');
        let out = split(&[&data[..100], &data[100..]]);
        assert_eq!(out.len(), 3);
        assert!(out[0].0 && out[1].0 && !out[2].0);
        assert_eq!(out[0].1.len(), MAX_LINE);
        assert_eq!(out[2].1.len(), 5);
        let exact = vec![b'y'; MAX_LINE];
        let out = split(&[&exact, b"\n"]);
        assert_eq!(out, vec![(false, exact.clone())]);
        let out = split(&[b"\n"]);
        assert_eq!(out, vec![(false, vec![])]);
    }

    /// A terminal writes "\r\n": the record is the line without it, also when the "\r"
    /// fills a record and the "\n" comes in the next chunk; a "\r" elsewhere stays.
    #[test]
    fn crlf_ends_a_line() {
        let out = split(&[b"one\r\ntwo\r", b"\nthree\rx\n\r\n", b"tail\r"]);
        let want: Vec<(bool, Vec<u8>)> = vec![
            (false, b"one".to_vec()),
            (false, b"two".to_vec()),
            (false, b"three\rx".to_vec()),
            (false, vec![]),
            (false, b"tail\r".to_vec()),
        ];
        assert_eq!(out, want);
        let mut full = vec![b'z'; MAX_LINE - 1];
        full.push(b'\r');
        let out = split(&[&full, b"\n"]);
        assert_eq!(out, vec![(false, vec![b'z'; MAX_LINE - 1])]);
        let out = split(&[&full, b"y\n"]);
        assert_eq!(out, vec![(true, full.clone()), (false, b"y".to_vec())]);
    }

    #[test]
    fn record_format() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a/b/c.log");
        let log = LogFile::open(path.to_str().unwrap()).unwrap();
        log.write_record(Stream::Stderr, true, b"abc");
        let text = std::fs::read_to_string(&path).unwrap();
        let mut parts = text.splitn(4, ' ');
        let ts = parts.next().unwrap();
        assert!(chrono::DateTime::parse_from_rfc3339(ts).is_ok(), "{ts}");
        assert!(ts.ends_with('Z'));
        assert_eq!(parts.next(), Some("stderr"));
        assert_eq!(parts.next(), Some("P"));
        assert_eq!(parts.next(), Some("abc\n"));
    }

    #[test]
    fn log_files_are_private_and_never_followed_through_links() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let f = open_log_nofollow(&dir.path().join("ctr/0.log")).unwrap();
        assert_eq!(f.metadata().unwrap().permissions().mode() & 0o777, 0o640);
        // A link as the file or as a directory on the way is refused, and nothing is
        // created where it points.
        std::os::unix::fs::symlink(outside.path().join("x.log"), dir.path().join("l.log")).unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join("d")).unwrap();
        for p in ["l.log", "d/x.log", "d/sub/x.log"] {
            let e = open_log_nofollow(&dir.path().join(p)).unwrap_err();
            assert!(e.to_string().contains("symbolic link"), "{p}: {e}");
        }
        assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
        let e = open_log_nofollow(&dir.path().join("a/../b.log")).unwrap_err();
        assert!(e.to_string().contains(".."), "{e}");
        // A FIFO planted at the path is refused without blocking.
        let fifo = dir.path().join("fifo.log");
        assert!(std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success());
        let e = open_log_nofollow(&fifo).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
    }

    /// A reopen that cannot open the path (kubelet put a link there, or it is gone) keeps
    /// writing to the file it had, which kubelet renames back.
    #[test]
    fn a_failed_reopen_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.log");
        let log = LogFile::open(path.to_str().unwrap()).unwrap();
        log.write_record(Stream::Stdout, false, b"one");
        let rotated = dir.path().join("c.log.1");
        std::fs::rename(&path, &rotated).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", &path).unwrap();
        assert!(log.reopen().is_err());
        log.write_record(Stream::Stdout, false, b"two");
        let kept = std::fs::read_to_string(&rotated).unwrap();
        assert!(
            kept.contains(" F one\n") && kept.contains(" F two\n"),
            "{kept}"
        );
    }

    #[test]
    fn stream_framing() {
        use std::io::{BufRead, BufReader};
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let log = LogFile::stream("ctr-1", "test", Box::new(a)).unwrap();
        log.write_record(Stream::Stdout, false, b"hello");
        log.write_record(Stream::Stderr, true, b"par");
        log.reopen().unwrap();
        drop(log);
        let lines: Vec<String> = BufReader::new(b).lines().map(|l| l.unwrap()).collect();
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert_eq!(lines[0], "ctr-1");
        let mut p = lines[1].splitn(4, ' ');
        assert!(chrono::DateTime::parse_from_rfc3339(p.next().unwrap()).is_ok());
        assert_eq!(p.collect::<Vec<_>>(), ["stdout", "F", "hello"]);
        assert!(lines[2].ends_with(" stderr P par"), "{}", lines[2]);
    }

    /// A host that takes nothing for longer than the send timeout is waited for: every
    /// record arrives, whole and in order (the stream was dropped at the first timeout, and
    /// the rest of the container's log with it).
    #[test]
    fn a_slow_host_gets_every_record() {
        use std::io::{BufRead, BufReader};
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        rustix::net::sockopt::set_socket_send_buffer_size(&a, 4096).unwrap();
        rustix::net::sockopt::set_socket_timeout(
            &a,
            rustix::net::sockopt::Timeout::Send,
            Some(Duration::from_millis(20)),
        )
        .unwrap();
        let log = LogFile::stream("c", "test", Box::new(a)).unwrap();
        let line = "x".repeat(1000);
        for i in 0..200 {
            log.write_record(Stream::Stdout, false, format!("{i} {line}").as_bytes());
        }
        // The writer meets its send timeout a few times before anything is read.
        std::thread::sleep(Duration::from_millis(300));
        drop(log);
        let lines: Vec<String> = BufReader::new(b).lines().map(|l| l.unwrap()).collect();
        assert_eq!(lines.len(), 201, "{} lines", lines.len());
        for (i, l) in lines[1..].iter().enumerate() {
            assert!(
                l.ends_with(&format!(" stdout F {i} {line}")),
                "record {i}: {l:.60}"
            );
        }
    }

    #[tokio::test]
    async fn pump_splits_long_lines_into_a_stream() {
        use std::io::Read;
        let (a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let log = LogFile::stream("c", "test", Box::new(a)).unwrap();
        let mut data = vec![b'z'; MAX_LINE + 3];
        data.extend_from_slice(b"\nend");
        pump(&data[..], Stream::Stdout, log).await;
        let mut text = String::new();
        b.read_to_string(&mut text).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4);
        assert_eq!(lines[0], "c");
        assert!(lines[1].contains(" stdout P ") && lines[1].ends_with(&"z".repeat(MAX_LINE)));
        assert!(lines[2].ends_with(" stdout F zzz"));
        assert!(lines[3].ends_with(" stdout F end"));
    }
}
