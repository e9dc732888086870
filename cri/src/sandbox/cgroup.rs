//! cgroupfs helpers for the pod and container cgroups vesseld owns (v1 hierarchies and v2).

use std::path::{Path, PathBuf};

/// cgroupfs directories named `rel` under every mounted hierarchy (v1 controllers and v2).
pub fn cgroup_dirs(rel: &str) -> Vec<PathBuf> {
    let rel = rel.trim_start_matches('/');
    let mut out = Vec::new();
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return out;
    };
    for l in info.lines() {
        let parts: Vec<&str> = l.split(' ').collect();
        let Some(sep) = parts.iter().position(|p| *p == "-") else {
            continue;
        };
        let fstype = parts.get(sep + 1).copied().unwrap_or("");
        if fstype == "cgroup" || fstype == "cgroup2" {
            if let Some(mp) = parts.get(4) {
                out.push(Path::new(mp).join(rel));
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Removes the cgroup `rel` (and its empty children, deepest first) from every hierarchy.
pub fn remove_cgroup(rel: &str) {
    for dir in cgroup_dirs(rel) {
        if !dir.exists() {
            continue;
        }
        let mut dirs = vec![];
        let mut stack = vec![dir.clone()];
        while let Some(d) = stack.pop() {
            if let Ok(rd) = std::fs::read_dir(&d) {
                for e in rd.flatten() {
                    if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                        stack.push(e.path());
                    }
                }
            }
            dirs.push(d);
        }
        dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
        for d in dirs {
            if let Err(e) = std::fs::remove_dir(&d) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(cgroup = %d.display(), error = %e, "cannot remove cgroup");
                }
            }
        }
    }
}
