//! The systemd cgroup driver's side of systemd: transient units over its D-Bus API.
//!
//! A pod's host process (the flat pod's agent, or the VM pod's shim) is put into a transient
//! scope unit, `vessel-pod-<id>.scope`, in the slice kubelet gives as the pod's cgroup parent
//! (`kubepods-burstable-pod<uid>.slice`), created with `StartTransientUnit` as runc's systemd
//! driver creates its scopes. The scope is delegated (`Delegate=yes`): the containers' cgroups
//! are vessel's to make beneath it, which is systemd's contract for container managers, and
//! works the same on cgroup v1 and v2. Stopping the unit kills what is left in it and removes
//! its cgroups.
//!
//! vesseld talks to systemd on its private socket (`/run/systemd/private`, root only, no bus
//! daemon needed, as `systemctl` does as root), or on the system bus where that socket is
//! missing.

use super::dbus::{Connection, DbusError, Reader, Value, Writer};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const DESTINATION: &str = "org.freedesktop.systemd1";
const PATH: &str = "/org/freedesktop/systemd1";
const MANAGER: &str = "org.freedesktop.systemd1.Manager";
const PRIVATE_SOCKET: &str = "/run/systemd/private";
const SYSTEM_BUS: &str = "/run/dbus/system_bus_socket";
/// How long one call may take, and a started scope to hold its process.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
const MOVE_TIMEOUT: Duration = Duration::from_secs(10);

/// The slice of pods whose config names no cgroup parent.
pub const DEFAULT_SLICE: &str = "vessel.slice";
/// Prefix of the pod scopes' names (the orphan sweep matches it).
pub const POD_UNIT_PREFIX: &str = "vessel-pod-";

#[derive(Debug, thiserror::Error)]
pub enum SystemdError {
    #[error(
        "systemd is not the init system here (/run/systemd/system is missing): the systemd \
         cgroup driver needs it; set runtime.cgroup_driver = \"cgroupfs\""
    )]
    NotBooted,
    #[error("cannot reach systemd over D-Bus ({address}): {source}")]
    Connect {
        address: &'static str,
        source: DbusError,
    },
    #[error("systemd {method} {unit}: {source}")]
    Call {
        method: &'static str,
        unit: String,
        source: DbusError,
    },
    #[error("{slice:?} is not a systemd slice name: {reason}")]
    BadSlice { slice: String, reason: &'static str },
    #[error(
        "unit {unit}: process {pid} was not moved into it within {MOVE_TIMEOUT:?} (the unit \
         is {state})"
    )]
    NotMoved {
        unit: String,
        pid: u32,
        state: String,
    },
}

/// Whether systemd is the init system (`sd_booted()`).
pub fn booted() -> bool {
    std::fs::symlink_metadata("/run/systemd/system").is_ok_and(|m| m.is_dir())
}

/// The scope unit of pod `id`.
pub fn pod_unit(id: &str) -> String {
    format!("{POD_UNIT_PREFIX}{id}.scope")
}

/// The cgroup path of a slice, as systemd lays slices out: `a-b-c.slice` is
/// `/a.slice/a-b.slice/a-b-c.slice`, `-.slice` is the root.
pub fn expand_slice(slice: &str) -> Result<String, SystemdError> {
    let bad = |reason| SystemdError::BadSlice {
        slice: slice.to_string(),
        reason,
    };
    let Some(stem) = slice.strip_suffix(".slice") else {
        return Err(bad("it does not end in .slice"));
    };
    if stem == "-" {
        return Ok("/".into());
    }
    if stem.is_empty() || slice.len() > 255 {
        return Err(bad("empty or too long"));
    }
    if !stem
        .bytes()
        .all(|c| c.is_ascii_alphanumeric() || b":_.-\\".contains(&c))
    {
        return Err(bad("it holds characters a unit name cannot"));
    }
    if stem.starts_with('-') || stem.ends_with('-') || stem.contains("--") {
        return Err(bad("a dash-separated part is empty"));
    }
    let mut path = String::new();
    let mut prefix = String::new();
    for part in stem.split('-') {
        if !prefix.is_empty() {
            prefix.push('-');
        }
        prefix.push_str(part);
        path.push('/');
        path.push_str(&prefix);
        path.push_str(".slice");
    }
    Ok(path)
}

/// Whether process `pid` is in a cgroup named `unit` (in any hierarchy), read from
/// `/proc/<pid>/cgroup`.
fn in_unit(pid: u32, unit: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|t| {
        t.lines()
            .filter_map(|l| l.splitn(3, ':').nth(2))
            .any(|p| p.split('/').any(|c| c == unit))
    })
}

/// A connection to systemd, made on first use and made again when it breaks (systemd
/// re-executing itself closes it). Calls run on the blocking pool, one at a time.
#[derive(Default)]
pub struct Systemd {
    conn: Arc<Mutex<Option<Connection>>>,
}

impl std::fmt::Debug for Systemd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Systemd")
    }
}

fn connect() -> Result<Connection, SystemdError> {
    // The private socket needs no bus daemon; the system bus is the fallback.
    let (path, bus) = if Path::new(PRIVATE_SOCKET).exists() {
        (PRIVATE_SOCKET, false)
    } else {
        (SYSTEM_BUS, true)
    };
    Connection::connect(Path::new(path), bus, CALL_TIMEOUT).map_err(|source| {
        SystemdError::Connect {
            address: path,
            source,
        }
    })
}

impl Systemd {
    /// Checks that systemd runs and answers, for the daemon's start.
    pub async fn check(&self) -> Result<(), SystemdError> {
        if !booted() {
            return Err(SystemdError::NotBooted);
        }
        self.units(&format!("{POD_UNIT_PREFIX}*.scope"))
            .await
            .map(|_| ())
    }

    /// Calls the manager's `method` with `body` (of `signature`); returns the reply body and
    /// its byte order. A broken connection is made again once.
    async fn call(
        &self,
        method: &'static str,
        unit: &str,
        signature: &'static str,
        body: Vec<u8>,
    ) -> Result<(Vec<u8>, bool), SystemdError> {
        self.call_at((PATH.into(), MANAGER), method, unit, signature, body)
            .await
    }

    /// Calls `method` of interface `iface` on object `path`.
    async fn call_at(
        &self,
        (path, iface): (String, &'static str),
        method: &'static str,
        unit: &str,
        signature: &'static str,
        body: Vec<u8>,
    ) -> Result<(Vec<u8>, bool), SystemdError> {
        let conn = self.conn.clone();
        let unit = unit.to_string();
        tokio::task::spawn_blocking(move || {
            let mut g = conn.lock().unwrap_or_else(|p| p.into_inner());
            let mut last = None;
            for _ in 0..2 {
                if g.is_none() {
                    *g = Some(connect()?);
                }
                let Some(c) = g.as_mut() else { continue };
                match c.call(DESTINATION, &path, iface, method, signature, &body) {
                    Ok((_, body, be)) => return Ok((body, be)),
                    // An answer from systemd: final.
                    Err(source @ DbusError::Remote { .. }) => {
                        return Err(SystemdError::Call {
                            method,
                            unit,
                            source,
                        })
                    }
                    // The connection: made again once.
                    Err(e) => {
                        *g = None;
                        last = Some(e);
                    }
                }
            }
            Err(SystemdError::Call {
                method,
                unit,
                source: last.unwrap_or(DbusError::Malformed("no reply")),
            })
        })
        .await
        .unwrap_or_else(|e| {
            Err(SystemdError::Call {
                method,
                unit: String::new(),
                source: DbusError::Io(std::io::Error::other(e.to_string())),
            })
        })
    }

    /// Starts the delegated scope `unit` in `slice` holding process `pid`, and waits until
    /// the process is in it.
    pub async fn start_scope(
        &self,
        unit: &str,
        slice: &str,
        pid: u32,
        description: &str,
    ) -> Result<(), SystemdError> {
        let props = [
            ("Description", Value::Str(description.into())),
            ("Slice", Value::Str(slice.into())),
            ("Delegate", Value::Bool(true)),
            ("PIDs", Value::U32s(vec![pid])),
            // As runc's scopes: not ordered against shutdown targets, and gone once dead
            // even when they failed.
            ("DefaultDependencies", Value::Bool(false)),
            ("CollectMode", Value::Str("inactive-or-failed".into())),
        ];
        let mut w = Writer::default();
        w.str(unit);
        w.str("fail");
        w.array(8, |w| {
            for (k, v) in &props {
                w.structure();
                w.str(k);
                w.variant(v);
            }
        });
        // No auxiliary units: a(sa(sv)).
        w.array(8, |_| {});
        self.call("StartTransientUnit", unit, "ssa(sv)a(sa(sv))", w.buf)
            .await?;
        // Active once systemd has put the process into the unit's cgroup in every hierarchy
        // it manages (one at a time: the process may show in some before others).
        // StartTransientUnit returns once the start job is queued: until the job runs the unit
        // is `inactive` with the job pending, which is not a failure.
        let deadline = tokio::time::Instant::now() + MOVE_TIMEOUT;
        let not_moved = |state: &str| SystemdError::NotMoved {
            unit: unit.to_string(),
            pid,
            state: state.to_string(),
        };
        loop {
            let (state, job) = self.unit_state(unit).await?;
            match state.as_str() {
                "active" if in_unit(pid, unit) => return Ok(()),
                "failed" => return Err(not_moved(&state)),
                "inactive" if !job => return Err(not_moved(&state)),
                _ => {}
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(not_moved(&state));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// The `ActiveState` of a loaded unit (`active`, `activating`, `failed`, ...), and
    /// whether a job (its start or stop) is pending on it.
    async fn unit_state(&self, unit: &str) -> Result<(String, bool), SystemdError> {
        let bad = |source| SystemdError::Call {
            method: "GetUnit",
            unit: unit.to_string(),
            source,
        };
        let mut w = Writer::default();
        w.str(unit);
        let (body, be) = self.call("GetUnit", unit, "s", w.buf).await?;
        let path = Reader::new(&body, be).str().map_err(bad)?;
        let property = |name: &str| {
            let mut w = Writer::default();
            w.str("org.freedesktop.systemd1.Unit");
            w.str(name);
            self.call_at(
                (path.clone(), "org.freedesktop.DBus.Properties"),
                "Get",
                unit,
                "ss",
                w.buf,
            )
        };
        // Job first: (uo), the pending job's id and object path, id 0 for none. Read the
        // other way round, the job could run between the two reads: an old `inactive` with
        // no job pending would look final.
        let (body, be) = property("Job").await?;
        let mut r = Reader::new(&body, be);
        let job = match r.signature().map_err(bad)?.as_str() {
            "(uo)" => {
                r.structure().map_err(bad)?;
                r.u32().map_err(bad)? != 0
            }
            _ => return Err(bad(DbusError::Malformed("Job is not (uo)"))),
        };
        let (body, be) = property("ActiveState").await?;
        let mut r = Reader::new(&body, be);
        let state = match r.signature().map_err(bad)?.as_str() {
            "s" => r.str().map_err(bad)?,
            _ => return Err(bad(DbusError::Malformed("ActiveState is not a string"))),
        };
        Ok((state, job))
    }

    /// Stops `unit` (killing what is left in it) and waits until it is down; a unit that is
    /// gone is fine.
    pub async fn stop_unit(&self, unit: &str) -> Result<(), SystemdError> {
        let gone = |e: &SystemdError| {
            matches!(e, SystemdError::Call { source, .. }
                if source.name() == Some("org.freedesktop.systemd1.NoSuchUnit"))
        };
        let mut w = Writer::default();
        w.str(unit);
        w.str("replace");
        match self.call("StopUnit", unit, "ss", w.buf).await {
            Ok(_) => {}
            Err(e) if gone(&e) => return Ok(()),
            Err(e) => return Err(e),
        }
        // StopUnit queues a job: the unit's processes and cgroup go when it has run.
        let start = tokio::time::Instant::now();
        let deadline = start + MOVE_TIMEOUT;
        let done = || {
            tracing::debug!(
                unit,
                ms = u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX),
                "unit stopped"
            );
            Ok(())
        };
        loop {
            match self.unit_state(unit).await {
                Err(e) if gone(&e) => return done(),
                Err(e) => return Err(e),
                Ok((s, false)) if s == "inactive" || s == "failed" => return done(),
                Ok(_) if tokio::time::Instant::now() >= deadline => {
                    tracing::warn!(unit, "the unit is still stopping; going on");
                    return Ok(());
                }
                Ok(_) => tokio::time::sleep(Duration::from_millis(2)).await,
            }
        }
    }

    /// The names of loaded units matching `pattern` (`vessel-pod-*.scope`).
    pub async fn units(&self, pattern: &str) -> Result<Vec<String>, SystemdError> {
        let mut w = Writer::default();
        w.array(4, |_| {}); // any state
        w.array(4, |w| w.str(pattern));
        let (body, be) = self
            .call("ListUnitsByPatterns", pattern, "asas", w.buf)
            .await?;
        // a(ssssssouso): the name is the first field of each.
        let mut names = Vec::new();
        let mut r = Reader::new(&body, be);
        r.array(8, |r| {
            r.structure()?;
            names.push(r.str()?);
            for _ in 0..5 {
                r.str()?;
            }
            r.str()?; // o
            r.u32()?;
            r.str()?;
            r.str()?; // o
            Ok(())
        })
        .map_err(|source| SystemdError::Call {
            method: "ListUnitsByPatterns",
            unit: pattern.to_string(),
            source,
        })?;
        Ok(names)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_expand_as_systemd_lays_them_out() {
        assert_eq!(expand_slice("-.slice").unwrap(), "/");
        assert_eq!(expand_slice("system.slice").unwrap(), "/system.slice");
        assert_eq!(
            expand_slice("kubepods-besteffort-pod1a2b.slice").unwrap(),
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1a2b.slice"
        );
        for bad in [
            "kubepods",
            "/kubepods.slice",
            "a--b.slice",
            "-a.slice",
            "a-.slice",
            ".slice",
            "a b.slice",
        ] {
            assert!(expand_slice(bad).is_err(), "{bad}");
        }
        assert_eq!(pod_unit("ab12"), "vessel-pod-ab12.scope");
    }

    #[test]
    fn a_process_is_found_in_its_unit() {
        let me = std::process::id();
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let leaf = own
            .lines()
            .filter_map(|l| l.splitn(3, ':').nth(2))
            .filter_map(|p| p.rsplit('/').next())
            .find(|c| !c.is_empty());
        if let Some(leaf) = leaf {
            assert!(in_unit(me, leaf));
        }
        assert!(!in_unit(me, "vessel-pod-none.scope"));
    }
}
