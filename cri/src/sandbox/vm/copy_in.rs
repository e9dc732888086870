//! VM pods today get the host paths of their CRI mounts copied into the guest when a
//! container is created (capped by `vm.copy_in_limit_mib`); writes stay in the guest.

use std::path::Path;
use vessel_agent::proto as ap;

use super::GUEST_FILES;

/// A CRI mount copied into the guest: where the spec's bind mount now comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopiedMount {
    pub container_path: String,
    pub host_path: String,
    pub guest_path: String,
}

/// Reads the host paths of a container's CRI mounts as `WriteFiles` entries under
/// `<GUEST_FILES>/ctr/<id>/<n>`: regular files, directories and symlinks, with their modes
/// and owners; other file types are skipped. More than `limit` bytes in all is an error.
pub fn copy_in_mounts(
    id: &str,
    mounts: &[k8s_cri::v1::Mount],
    limit: u64,
) -> Result<(Vec<ap::FileEntry>, Vec<CopiedMount>), String> {
    use std::os::unix::fs::MetadataExt;
    let mut entries = Vec::new();
    let mut copied = Vec::new();
    let mut total = 0u64;
    fn walk(
        host: &Path,
        guest: &str,
        top: bool,
        entries: &mut Vec<ap::FileEntry>,
        total: &mut u64,
        limit: u64,
    ) -> Result<(), String> {
        // The mount source itself may be a symlink (kubelet's /etc/hosts is not, but
        // projected volumes use them inside); inside a tree, links are copied as links.
        let md = if top {
            std::fs::metadata(host)
        } else {
            std::fs::symlink_metadata(host)
        }
        .map_err(|e| format!("mount source {}: {e}", host.display()))?;
        let base = |kind| ap::FileEntry {
            path: guest.to_string(),
            mode: md.mode() & 0o7777,
            uid: md.uid(),
            gid: md.gid(),
            kind: Some(kind),
        };
        let ft = md.file_type();
        if ft.is_symlink() {
            let t = std::fs::read_link(host).map_err(|e| format!("{}: {e}", host.display()))?;
            entries.push(base(ap::file_entry::Kind::Symlink(t.display().to_string())));
        } else if ft.is_dir() {
            entries.push(base(ap::file_entry::Kind::Dir(true)));
            let mut names: Vec<_> = std::fs::read_dir(host)
                .map_err(|e| format!("{}: {e}", host.display()))?
                .flatten()
                .map(|e| e.file_name())
                .collect();
            names.sort();
            for n in names {
                let g = format!("{guest}/{}", n.to_string_lossy());
                walk(&host.join(&n), &g, false, entries, total, limit)?;
            }
        } else if ft.is_file() {
            *total += md.len();
            if *total > limit {
                return Err(format!(
                    "mounts copied into a VM pod may hold at most {} MiB (vm.copy_in_limit_mib); {} goes beyond",
                    limit >> 20,
                    host.display()
                ));
            }
            let data = std::fs::read(host).map_err(|e| format!("{}: {e}", host.display()))?;
            entries.push(base(ap::file_entry::Kind::Data(data)));
        } else {
            tracing::debug!(path = %host.display(), "not copied into the VM: not a file, dir or link");
        }
        Ok(())
    }
    for (i, m) in mounts.iter().enumerate() {
        let guest = format!("{GUEST_FILES}/ctr/{id}/{i}");
        walk(
            Path::new(&m.host_path),
            &guest,
            true,
            &mut entries,
            &mut total,
            limit,
        )?;
        copied.push(CopiedMount {
            container_path: m.container_path.clone(),
            host_path: m.host_path.clone(),
            guest_path: guest,
        });
    }
    Ok((entries, copied))
}

/// Points the spec's bind mounts of copied-in host paths at their guest copies.
pub fn rewrite_mount_sources(spec: &mut serde_json::Value, copied: &[CopiedMount]) {
    let Some(mounts) = spec["mounts"].as_array_mut() else {
        return;
    };
    for m in mounts {
        let dest = m["destination"].as_str().unwrap_or_default().to_string();
        let src = m["source"].as_str().unwrap_or_default().to_string();
        if let Some(c) = copied
            .iter()
            .find(|c| c.container_path == dest && c.host_path == src)
        {
            m["source"] = serde_json::json!(c.guest_path);
            // Propagation between host and guest does not exist; keep the guest's private.
            if let Some(opts) = m["options"].as_array_mut() {
                for o in opts.iter_mut() {
                    if matches!(o.as_str(), Some("rslave" | "rshared" | "slave" | "shared")) {
                        *o = serde_json::json!("rprivate");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_cri::v1 as cri;

    #[test]
    fn mounts_are_copied_in_and_rewritten() {
        let d = tempfile::tempdir().unwrap();
        let vol = d.path().join("vol");
        std::fs::create_dir_all(vol.join("sub")).unwrap();
        std::fs::write(vol.join("sub/a"), "hello").unwrap();
        std::os::unix::fs::symlink("sub/a", vol.join("link")).unwrap();
        let file = d.path().join("hosts");
        std::fs::write(&file, "127.0.0.1 x\n").unwrap();
        let mounts = vec![
            cri::Mount {
                container_path: "/data".into(),
                host_path: vol.display().to_string(),
                ..Default::default()
            },
            cri::Mount {
                container_path: "/etc/hosts".into(),
                host_path: file.display().to_string(),
                propagation: cri::MountPropagation::PropagationHostToContainer as i32,
                ..Default::default()
            },
        ];
        let (entries, copied) = copy_in_mounts("c1", &mounts, 1 << 20).unwrap();
        let paths: Vec<&str> = entries.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/run/vessel/files/ctr/c1/0",
                "/run/vessel/files/ctr/c1/0/link",
                "/run/vessel/files/ctr/c1/0/sub",
                "/run/vessel/files/ctr/c1/0/sub/a",
                "/run/vessel/files/ctr/c1/1",
            ]
        );
        assert!(matches!(&entries[1].kind, Some(ap::file_entry::Kind::Symlink(t)) if t == "sub/a"));
        assert!(matches!(&entries[3].kind, Some(ap::file_entry::Kind::Data(b)) if b == b"hello"));
        let mut spec = serde_json::json!({"mounts": [
            {"destination": "/proc", "source": "proc"},
            {"destination": "/etc/hosts", "source": file, "options": ["rbind", "rslave", "ro"]},
        ]});
        rewrite_mount_sources(&mut spec, &copied);
        assert_eq!(spec["mounts"][1]["source"], "/run/vessel/files/ctr/c1/1");
        assert_eq!(spec["mounts"][1]["options"][1], "rprivate");
        assert_eq!(spec["mounts"][0]["source"], "proc");
        let e = copy_in_mounts("c1", &mounts, 3).unwrap_err();
        assert!(e.contains("copy_in_limit_mib"), "{e}");
    }
}
