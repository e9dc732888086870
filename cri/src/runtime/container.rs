//! Containers: CreateContainer, StartContainer, StopContainer, RemoveContainer,
//! UpdateContainerResources. The backend gives a container its root and log
//! (`SandboxBackend::prepare_container`); the pod agent runs it.

use super::restore::{self, Checkpoint};
use super::{config_with_metadata, Ctr, Runtime};
use crate::errors::{agent_err, if_found, internal, Result, RuntimeError};
use crate::sandbox::{ContainerRequest, Pod};
use crate::spec::apparmor::Wanted;
use crate::spec::{self, SpecInput};
use crate::state::{self, ContainerRecord, ContainerState, PodRecord, PodState};
use std::io;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::Channel;
use vessel_agent::proto::{self as ap, agent_client::AgentClient};
use vessel_cri_api::v1 as cri;

/// What CreateContainer settled before it makes anything of the container's own.
struct Made {
    /// The container's config as asked (its image volumes still naming images).
    config: cri::ContainerConfig,
    image: vessel_images::ImageRecord,
    /// The TARGET container's pid, for NamespaceMode TARGET.
    target_pid: Option<u32>,
    /// The config with image volumes as read-only host paths.
    volumes: cri::ContainerConfig,
    volume_snapshots: Vec<String>,
    /// The checkpoint the container is restored from at start.
    restore: Option<Checkpoint>,
}

impl Runtime {
    /// CRI CreateContainer, run to its end in a task of its own: a caller that gives up
    /// (kubelet's deadline; unpacking a large checkpoint) leaves neither a reserved name nor
    /// a half-made container behind.
    pub async fn create_container(
        self: &Arc<Self>,
        pod_id: &str,
        config: Option<cri::ContainerConfig>,
    ) -> Result<String> {
        let (rt, pod_id) = (self.clone(), pod_id.to_string());
        tokio::spawn(async move { rt.create_now(&pod_id, config).await })
            .await
            .map_err(internal("the create task"))?
    }

    async fn create_now(
        self: &Arc<Self>,
        pod_id: &str,
        config: Option<cri::ContainerConfig>,
    ) -> Result<String> {
        let (config, meta) =
            config_with_metadata("CreateContainer", config, |c| c.metadata.as_ref())?;
        if meta.name.is_empty() {
            return Err(RuntimeError::InvalidArgument(
                "CreateContainer: metadata has no name".into(),
            ));
        }
        let pod = self.pod(pod_id)?;
        // Creation and pod stop/remove exclude each other: no container appears in a pod
        // that is going away.
        let _pod_op = pod.op.lock().await;
        let prec = pod.record();
        if prec.state != PodState::Ready {
            return Err(RuntimeError::FailedPrecondition(format!(
                "CreateContainer {:?}: pod sandbox {} is not ready",
                meta.name, prec.id
            )));
        }
        let pmeta = prec.config.metadata.clone().unwrap_or_default();
        let key = format!(
            "{}_{}_{}_{}_{}",
            meta.name, pmeta.name, pmeta.namespace, pmeta.uid, meta.attempt
        );
        let id = state::new_id();
        self.reserve(&key, &id, "container")?;
        let res = self
            .create_container_inner(&pod, &prec, &id, &key, config)
            .await;
        if res.is_err() {
            self.release(&key, &id);
        }
        res.map(|_| id)
    }

    pub(super) async fn create_container_inner(
        self: &Arc<Self>,
        pod: &Arc<Pod>,
        prec: &PodRecord,
        id: &str,
        key: &str,
        mut config: cri::ContainerConfig,
    ) -> Result<()> {
        let mut image_name = image_name_of(&config);
        if image_name.is_empty() {
            return Err(RuntimeError::InvalidArgument(
                "CreateContainer: no image".into(),
            ));
        }
        // Fields checked before anything is made (mounts relabelled, profiles loaded).
        let ctr_privileged = config
            .linux
            .as_ref()
            .and_then(|l| l.security_context.as_ref())
            .is_some_and(|s| s.privileged);
        let pod_privileged = prec
            .config
            .linux
            .as_ref()
            .and_then(|l| l.security_context.as_ref())
            .is_some_and(|s| s.privileged);
        if ctr_privileged && !pod_privileged {
            // kubelet marks the pod privileged when any container is (containerd and CRI-O
            // refuse the pair too); a VM pod's backend is chosen from the pod's flag.
            return Err(RuntimeError::InvalidArgument(format!(
                "CreateContainer {key:?}: a privileged container needs a privileged pod, and pod {} is not",
                prec.id
            )));
        }
        if config.stop_signal != 0 && spec::cri_signal(config.stop_signal).is_none() {
            return Err(RuntimeError::InvalidArgument(format!(
                "CreateContainer {key:?}: stop_signal {} is not a CRI Signal",
                config.stop_signal
            )));
        }
        if let Some(m) = config.mounts.iter().find(|m| {
            !m.image_sub_path.is_empty() && m.image.as_ref().is_none_or(|i| i.image.is_empty())
        }) {
            return Err(RuntimeError::InvalidArgument(format!(
                "CreateContainer {key:?}: the mount at {:?} has an image_sub_path but no image",
                m.container_path
            )));
        }
        let (image, restore) = if restore::is_archive(&image_name) {
            let path = std::path::PathBuf::from(&image_name);
            let (ck, base) = self
                .checkpoint_to_restore(prec, key, restore::Source::Archive(path))
                .await?;
            (base, Some(ck))
        } else {
            let image = self.find_image(&image_name).await?;
            // A checkpoint image: its (top) layer holds the archive's files. Only such an
            // image's layers are looked up here.
            let layer = image
                .checkpoint_of
                .as_ref()
                .and_then(|_| self.store.layer_dirs(&image).pop());
            match layer {
                Some(layer) => {
                    let source = restore::Source::Dir(layer);
                    let (ck, base) = self.checkpoint_to_restore(prec, key, source).await?;
                    (base, Some(ck))
                }
                None => (image, None),
            }
        };
        if let Some(ck) = &restore {
            image_name = image
                .repo_tags
                .first()
                .cloned()
                .unwrap_or_else(|| ck.base_image_name().to_string());
            ck.apply(&mut config, &image_name);
        } else if let Some(shown) = shown_image_name(&config, &image, &image_name) {
            // kubelet names the image by the id PullImage answered and gives the pod spec's
            // name beside it: that name is what status shows (kubectl's `image:`), the
            // metrics' `image` label and a checkpoint's image name, as with containerd.
            if let Some(i) = config.image.as_mut() {
                i.image = shown;
            }
        }
        // TARGET pid namespace: the target container's pid in the agent's namespace.
        let ns_target = config
            .linux
            .as_ref()
            .and_then(|l| l.security_context.as_ref())
            .and_then(|s| s.namespace_options.as_ref())
            .filter(|n| n.pid == cri::NamespaceMode::Target as i32)
            .map(|n| n.target_id.clone());
        let target_pid = match ns_target {
            Some(t) => {
                let tc = self.ctr(&t).map_err(|_| {
                    RuntimeError::NotFound(format!(
                        "pid namespace target container {t:?} not found"
                    ))
                })?;
                let tr = tc.record();
                (tr.pod_id == prec.id && tr.state == ContainerState::Running).then_some(tr.pid)
            }
            None => None,
        };
        // Image volumes become read-only host directories; from here on both backends see
        // plain bind mounts (a VM pod shares them into its guest like any host path).
        let (mut volumes, mut volume_snapshots) = self.image_volumes(id, &mut config).await?;
        match self
            .image_defined_volumes(id, &prec.config, &image, &mut volumes)
            .await
        {
            Ok(Some(snap)) => volume_snapshots.push(snap),
            Ok(None) => {}
            Err(e) => {
                self.discard_snapshots(&volume_snapshots);
                return Err(e);
            }
        }
        let made = Made {
            config,
            image,
            target_pid,
            volumes,
            volume_snapshots,
            restore,
        };
        let snaps = made.volume_snapshots.clone();
        let res = self.create_made(pod, prec, id, key, made).await;
        if res.is_err() {
            self.discard_snapshots(&snaps);
        }
        res
    }

    /// The image CreateContainer names, which must be here.
    async fn find_image(&self, name: &str) -> Result<vessel_images::ImageRecord> {
        let (store, q) = (self.store.clone(), name.to_string());
        tokio::task::spawn_blocking(move || store.find(&q))
            .await
            .map_err(internal("image lookup"))?
            .map_err(|e| match e {
                vessel_images::ImageError::InvalidReference(_)
                | vessel_images::ImageError::Ambiguous { .. } => {
                    RuntimeError::InvalidArgument(e.to_string())
                }
                e => RuntimeError::Internal(e.to_string()),
            })?
            .ok_or_else(|| {
                RuntimeError::NotFound(format!("image {name:?} not found; pull it first"))
            })
    }

    /// The checkpoint at `source` (CreateContainer's image) that the container is to be
    /// restored from, and the image it was taken from, which must be here.
    async fn checkpoint_to_restore(
        &self,
        prec: &PodRecord,
        key: &str,
        source: restore::Source,
    ) -> Result<(Checkpoint, vessel_images::ImageRecord)> {
        self.criu_enabled(&format!("CreateContainer {key:?} from the {source}"))?;
        let store = self.store.clone();
        let (ck, base) = tokio::task::spawn_blocking(move || {
            let ck = Checkpoint::open(source)?;
            let mut base = None;
            for q in ck.base_images() {
                match store.find(q) {
                    Ok(Some(i)) => {
                        base = Some(i);
                        break;
                    }
                    Ok(None)
                    | Err(vessel_images::ImageError::InvalidReference(_))
                    | Err(vessel_images::ImageError::Ambiguous { .. }) => {}
                    Err(e) => return Err(internal("looking up the checkpoint's image")(e)),
                }
            }
            Ok::<_, RuntimeError>((ck, base))
        })
        .await
        .map_err(internal("reading the checkpoint"))??;
        let what = &ck.source;
        if self.backend(prec).kind() == crate::state::BackendKind::Vm {
            return Err(RuntimeError::FailedPrecondition(format!(
                "CreateContainer {key:?}: {what}: pod {} is a VM pod, whose guest has no CRIU: checkpoints are restored in flat pods",
                prec.id
            )));
        }
        let base = base.ok_or_else(|| {
            RuntimeError::NotFound(format!(
                "CreateContainer {key:?}: image {:?}, which the {what} was taken from, not found; pull it first",
                ck.base_image_name()
            ))
        })?;
        Ok((ck, base))
    }

    /// The container config with its image volumes (mounts naming an image) turned into
    /// read-only mounts of that image's content (or of its `image_sub_path`), each a snapshot
    /// of the image mounted read-only on the host; and those snapshots' ids. Kubelet pulls the
    /// image first: one that is not here is NotFound. `config` (what the record keeps) gets
    /// each volume's image reference, which ContainerStatus reports.
    async fn image_volumes(
        &self,
        id: &str,
        config: &mut cri::ContainerConfig,
    ) -> Result<(cri::ContainerConfig, Vec<String>)> {
        let mut out = config.clone();
        let mut snaps: Vec<String> = Vec::new();
        for (n, m) in out.mounts.iter_mut().enumerate() {
            let Some(image) = m.image.as_ref().filter(|i| !i.image.is_empty()) else {
                continue;
            };
            let (store, name, snap_id, sub) = (
                self.store.clone(),
                image.image.clone(),
                format!("{id}-iv{n}"),
                m.image_sub_path.clone(),
            );
            let at = m.container_path.clone();
            let made = tokio::task::spawn_blocking(move || {
                let rec = store
                    .find(&name)
                    .map_err(|e| {
                        RuntimeError::InvalidArgument(format!("image volume at {at:?}: {e}"))
                    })?
                    .ok_or_else(|| {
                        RuntimeError::NotFound(format!(
                            "image volume at {at:?}: image {name:?} not found; pull it first"
                        ))
                    })?;
                let snap = store
                    .prepare_snapshot(&snap_id, &rec)
                    .map_err(internal(format!("image volume at {at:?}")))?;
                let root = snap
                    .mount_overlay_readonly()
                    .map_err(internal(format!("image volume at {at:?}")));
                let path = root.and_then(|root| {
                    if sub.is_empty() {
                        return Ok(root.display().to_string());
                    }
                    image_sub_path(&root, &sub).map_err(|e| {
                        let at = format!(
                            "image volume at {at:?}: image_sub_path {sub:?} of image {name:?}"
                        );
                        match e {
                            SubPathError::Bad(m) | SubPathError::Missing(m) => {
                                RuntimeError::InvalidArgument(format!("{at} {m}"))
                            }
                            SubPathError::Node(m) => RuntimeError::Internal(format!("{at}: {m}")),
                        }
                    })
                });
                let image_ref = image_ref(&rec);
                match path {
                    Ok(p) => Ok((snap_id, p, image_ref)),
                    Err(e) => {
                        let _ = store.remove_snapshot(&snap_id);
                        Err(e)
                    }
                }
            })
            .await
            .map_err(internal("image volume"))
            .and_then(|r| r);
            match made {
                Ok((snap_id, path, image_ref)) => {
                    snaps.push(snap_id);
                    m.host_path = path;
                    m.readonly = true;
                    m.image = None;
                    m.image_sub_path.clear();
                    if let Some(i) = config.mounts[n].image.as_mut() {
                        i.image_ref = image_ref;
                    }
                }
                Err(e) => {
                    self.discard_snapshots(&snaps);
                    return Err(e);
                }
            }
        }
        Ok((out, snaps))
    }

    /// The volumes the image declares (its config's `Volumes`, a Dockerfile's `VOLUME`) that
    /// no CRI mount covers, made as containerd makes them: each a writable directory of this
    /// container alone, filled with a copy of what the image has at that path (a database
    /// image's data directory, owners and modes included), so it is writable under
    /// readOnlyRootFilesystem. A path the image lacks is an empty directory (0755, root).
    /// They are plain directories (an idmapped mount of an overlay is refused before Linux
    /// 6.x) in a snapshot of the image (`<id>-vols`) that goes with the container. Added to
    /// `out`'s mounts; the snapshot's id, if one was made.
    /// `runtime.ignore_image_defined_volumes` turns it off.
    async fn image_defined_volumes(
        &self,
        id: &str,
        pod: &cri::PodSandboxConfig,
        image: &vessel_images::ImageRecord,
        out: &mut cri::ContainerConfig,
    ) -> Result<Option<String>> {
        if self.opts.ignore_image_defined_volumes {
            return Ok(None);
        }
        // In a pod with its own user namespace they are mapped as kubelet's volumes are (the
        // pod's mappings): the image's owners show as in the container's root filesystem.
        let userns = crate::userns::of_pod(pod)
            .map_err(|e| RuntimeError::InvalidArgument(format!("pod user namespace: {e}")))?;
        let mut wanted: Vec<String> = Vec::new();
        for p in image.run_config.volumes.iter().flat_map(|v| v.keys()) {
            let path = Path::new(p);
            let rel = path.strip_prefix("/").unwrap_or(path);
            let named = rel
                .components()
                .any(|c| matches!(c, std::path::Component::Normal(_)));
            if !path.is_absolute() || !named || !stays_below(rel) {
                tracing::warn!(
                    container = id,
                    volume = p,
                    "the image's volume is not an absolute path below / without `..`: not made"
                );
                continue;
            }
            // A CRI mount at the path (kubelet's volume there) takes its place, compared as
            // the spec places mounts.
            let at = spec::clean_path(p);
            // Never over what the runtime mounts for the pod: the kernel's filesystems, the
            // container's /dev, the pod's hostname, hosts and resolv.conf (an image's copy of
            // /etc/resolv.conf would cut the container off cluster DNS).
            let runtime_owned = ["/proc", "/sys", "/dev"]
                .iter()
                .any(|r| Path::new(&at).starts_with(r))
                || ["/etc/hostname", "/etc/hosts", "/etc/resolv.conf"].contains(&at.as_str());
            if runtime_owned {
                tracing::warn!(
                    container = id,
                    volume = p,
                    "the image's volume is where the runtime mounts the pod's own: not made"
                );
                continue;
            }
            let covered = out
                .mounts
                .iter()
                .any(|m| spec::clean_path(&m.container_path) == at);
            if !covered && !wanted.iter().any(|w| spec::clean_path(w) == at) {
                wanted.push(p.clone());
            }
        }
        if wanted.is_empty() {
            return Ok(None);
        }
        let (store, image, snap_id) = (self.store.clone(), image.clone(), format!("{id}-vols"));
        let (snap_id, mounts) = tokio::task::spawn_blocking(move || {
            let snap = store
                .prepare_snapshot(&snap_id, &image)
                .map_err(internal("the image's volumes"))?;
            let base = snap.dir.join("volumes");
            let mounts = std::fs::create_dir(&base)
                .map_err(internal("the image's volumes"))
                .and_then(|()| {
                    snap.mount_overlay_readonly()
                        .map_err(internal("the image's volumes"))
                })
                .and_then(|root| {
                    let made = wanted
                        .iter()
                        .enumerate()
                        .map(|(n, p)| {
                            let at = format!("the image's volume {p:?}");
                            let dir = base.join(n.to_string());
                            let from = match image_sub_path(&root, &format!(".{p}")) {
                                Ok(from) => Some(from),
                                Err(SubPathError::Missing(_)) => None,
                                Err(SubPathError::Bad(m)) => {
                                    return Err(RuntimeError::InvalidArgument(format!("{at} {m}")))
                                }
                                Err(SubPathError::Node(m)) => {
                                    return Err(RuntimeError::Internal(format!("{at}: {m}")))
                                }
                            };
                            match &from {
                                Some(from) => copy_volume(Path::new(from), &dir),
                                None => empty_volume(&dir),
                            }
                            .map_err(internal(at))?;
                            Ok(cri::Mount {
                                container_path: p.clone(),
                                host_path: dir.display().to_string(),
                                // The container's own: labelled for it where the host has
                                // SELinux (as containerd relabels them).
                                selinux_relabel: true,
                                uid_mappings: userns.iter().map(|u| u.uid).collect(),
                                gid_mappings: userns.iter().map(|u| u.gid).collect(),
                                ..Default::default()
                            })
                        })
                        .collect::<Result<Vec<_>>>();
                    // Read for the copy only.
                    snap.unmount().map_err(internal("the image's volumes"))?;
                    made
                });
            match mounts {
                Ok(m) => Ok((snap_id, m)),
                Err(e) => {
                    let _ = store.remove_snapshot(&snap_id);
                    Err(e)
                }
            }
        })
        .await
        .map_err(internal("the image's volumes"))??;
        tracing::debug!(container = id, volumes = ?mounts.iter().map(|m| &m.container_path).collect::<Vec<_>>(), "the image's volumes made");
        out.mounts.extend(mounts);
        Ok(Some(snap_id))
    }

    /// The host paths of mounts with `selinux_relabel` get the container's file label, where
    /// the host has SELinux (flat and VM pods: a VM pod's volumes are host directories too);
    /// without SELinux there is no label to give.
    async fn relabel_mounts(
        &self,
        key: &str,
        sc: Option<&cri::LinuxContainerSecurityContext>,
        mounts: &[cri::Mount],
    ) -> Result<()> {
        let paths: Vec<std::path::PathBuf> = mounts
            .iter()
            .filter(|m| m.selinux_relabel && !m.host_path.is_empty())
            .map(|m| std::path::PathBuf::from(&m.host_path))
            .collect();
        if paths.is_empty() {
            return Ok(());
        }
        if !crate::selinux::enabled() {
            tracing::debug!(
                container = key,
                ?paths,
                "SELinux is not enabled here: nothing to relabel"
            );
            return Ok(());
        }
        let label = crate::selinux::mount_label(sc.and_then(|s| s.selinux_options.as_ref()));
        let key = key.to_string();
        tokio::task::spawn_blocking(move || {
            // Directories and regular files: a device node or socket is not the container's
            // to label (a VM pod's device mounts name the guest's own nodes).
            let labelled = paths
                .iter()
                .filter(|p| std::fs::metadata(p).is_ok_and(|m| m.is_dir() || m.is_file()));
            for p in labelled {
                match crate::selinux::relabel(p, &label) {
                    Ok(()) => tracing::debug!(container = key, path = %p.display(), label, "relabelled"),
                    Err(crate::selinux::RelabelError::Io { source, .. })
                        if source.raw_os_error() == Some(libc::EOPNOTSUPP) =>
                    {
                        tracing::warn!(container = key, path = %p.display(), "no SELinux labels on this filesystem: not relabelled");
                    }
                    Err(e @ crate::selinux::RelabelError::SystemPath(_)) => {
                        return Err(RuntimeError::InvalidArgument(format!(
                            "CreateContainer {key:?}: {e}"
                        )))
                    }
                    Err(e) => {
                        return Err(RuntimeError::FailedPrecondition(format!(
                            "CreateContainer {key:?}: {e}"
                        )))
                    }
                }
            }
            Ok(())
        })
        .await
        .map_err(internal("SELinux relabel"))?
    }

    /// CreateContainer once its image, namespaces and image volumes are settled.
    async fn create_made(
        self: &Arc<Self>,
        pod: &Arc<Pod>,
        prec: &PodRecord,
        id: &str,
        key: &str,
        made: Made,
    ) -> Result<()> {
        let (config, image, target_pid) = (made.config, made.image, made.target_pid);
        let (volumes, volume_snapshots, restore) =
            (made.volumes, made.volume_snapshots, made.restore);
        let image_name = image_name_of(&config);
        let backend = self.backend(prec);
        backend.admit_container(prec, &volumes)?;
        // AppArmor confines where the host has it: a flat pod's containers with the host's
        // kernel, a VM pod's with its guest kernel, which is given the host's compiled policy.
        // The loaded profiles are read only for a container that may be confined.
        let sc = config
            .linux
            .as_ref()
            .and_then(|l| l.security_context.as_ref());
        let wanted = spec::apparmor::wanted(sc)
            .map_err(|e| RuntimeError::InvalidArgument(format!("CreateContainer {key:?}: {e}")))?;
        let privileged = sc.is_some_and(|s| s.privileged);
        // Nothing asked, in a VM pod: its own kernel is the boundary, and a guest kernel that
        // refused the host's compiled default would fail every such container: none.
        let wanted = match wanted {
            Wanted::Unset if backend.kind() == crate::state::BackendKind::Vm => Wanted::Unconfined,
            w => w,
        };
        let mut apparmor = (wanted != Wanted::Unconfined)
            .then(spec::apparmor::host_profiles)
            .flatten();
        if let Some(loaded) = &mut apparmor {
            let default = matches!(wanted, Wanted::RuntimeDefault | Wanted::Unset);
            let gave_up = wanted == Wanted::Unset && UNSET_APPARMOR_FAILED.load(Ordering::Relaxed);
            if default
                && !privileged
                && !gave_up
                && !loaded.contains(spec::apparmor::DEFAULT_PROFILE)
            {
                let have = loaded.clone();
                let load = apparmor_task(key, move || spec::apparmor::ensure_default(&have));
                match (load.await, &wanted) {
                    (Ok(()), _) => {
                        loaded.insert(spec::apparmor::DEFAULT_PROFILE.to_string());
                    }
                    // Asked for: the container is not made unconfined instead.
                    (Err(e), Wanted::RuntimeDefault) => return Err(e),
                    (Err(e), _) => unset_apparmor_unconfined(&e.to_string()),
                }
            }
        }
        make_missing_sources(key, &config.mounts)?;
        check_propagation_sources(key, &config.mounts)?;
        let (mut spec, user) = spec::build(&SpecInput {
            pod: &prec.config,
            config: &volumes,
            image: &image.run_config,
            layer_dirs: &self.store.layer_dirs(&image),
            hostname: &prec.hostname,
            pod_dir: &backend.pod_files_dir(prec),
            cgroups_path: format!("{}/{}", prec.cgroup_parent.trim_end_matches('/'), id),
            target_pid,
            cgroup_ns: backend.cgroup_ns(),
            apparmor: apparmor.as_ref(),
            // HugeTLB limits need the hugetlb controller: the host's, for flat pods; a VM
            // guest has no huge pages.
            hugetlb: backend.kind() == crate::state::BackendKind::Flat && host_has_hugetlb(),
            // The host's, for flat pods; a VM guest has no swap.
            swap_accounting: backend.kind() == crate::state::BackendKind::Flat
                && vessel_agent::cgroups::accounts_swap(),
            // The host's, for flat pods; the guest kernel has no SELinux.
            selinux: backend.kind() == crate::state::BackendKind::Flat && crate::selinux::enabled(),
            vm_guest: backend.kind() == crate::state::BackendKind::Vm,
            shared_shm: prec.shared_shm,
            pid_holder: prec.pid_holder,
        })
        .map_err(|e| RuntimeError::InvalidArgument(format!("CreateContainer {:?}: {e}", key)))?;
        if let Some(ck) = &restore {
            ck.check_spec(&spec).map_err(|m| {
                RuntimeError::FailedPrecondition(format!("CreateContainer {key:?}: {m}"))
            })?;
        }
        // A VM guest is given the host's compiled policy for the profile it is to apply.
        let apparmor_policy = match spec["process"]["apparmorProfile"].as_str() {
            Some(name) if backend.kind() == crate::state::BackendKind::Vm => {
                let name = name.to_string();
                apparmor_task(key, move || spec::apparmor::host_policy(&name)).await?
            }
            _ => Vec::new(),
        };
        self.relabel_mounts(key, sc, &volumes.mounts).await?;
        let cdi = crate::cdi::requested(&config.cdi_devices, &config.annotations);
        if !cdi.is_empty() {
            let cdi_err = |e: crate::cdi::CdiError| {
                let m = format!("CreateContainer {key:?}: {e}");
                match e {
                    crate::cdi::CdiError::BadName(_) => RuntimeError::InvalidArgument(m),
                    crate::cdi::CdiError::Unresolved { .. } => RuntimeError::NotFound(m),
                    crate::cdi::CdiError::BadEdit { .. } => RuntimeError::FailedPrecondition(m),
                }
            };
            let edits = crate::cdi::resolve(&self.opts.cdi_spec_dirs, &cdi).map_err(cdi_err)?;
            crate::cdi::apply(&mut spec, &edits).map_err(cdi_err)?;
            tracing::debug!(container = %id, devices = ?cdi, "CDI devices applied");
        }
        let log_path = container_log_path(&prec.config.log_directory, &config.log_path).map_err(
            |e| match e {
                RuntimeError::InvalidArgument(m) => {
                    RuntimeError::InvalidArgument(format!("CreateContainer {key:?}: {m}"))
                }
                e => e,
            },
        )?;
        // The pod's lifecycle.stopSignal (kubelet sends it), else the image's, else SIGTERM.
        let stop_signal = spec::cri_signal(config.stop_signal)
            .or_else(|| {
                image
                    .run_config
                    .stop_signal
                    .as_deref()
                    .and_then(spec::parse_signal)
            })
            .unwrap_or(libc::SIGTERM);
        let image_ref = image_ref(&image);
        let mut rec = ContainerRecord {
            id: id.to_string(),
            pod_id: prec.id.clone(),
            name_key: key.to_string(),
            config: config.clone(),
            image_name: image_name.clone(),
            image_id: image.id.to_string(),
            image_ref,
            log_path: log_path.clone(),
            state: ContainerState::Creating,
            created_at: state::now_nanos(),
            started_at: 0,
            finished_at: 0,
            exit_code: 0,
            reason: String::new(),
            message: String::new(),
            pid: 0,
            uid: user.uid,
            gid: user.gid,
            groups: user.additional_gids.clone(),
            stop_signal,
            snapshot: id.to_string(),
            // Each once: a VM pod attaches one disk per layer, and its guest's overlay takes
            // a lower directory once.
            layers: vessel_images::snapshot::distinct_layers(
                image.layers.iter().map(|l| l.diff_id.to_string()),
            ),
            volume_snapshots,
            spec: None,
        };
        // The record (state Creating) and the writable layer are independent, each durable
        // on its own (a crash between them leaves what recovery cleans: a Creating record,
        // a snapshot without a container): written at once, their fsyncs overlap.
        let (store, snap_id, snap_image) = (self.store.clone(), id.to_string(), image.clone());
        let snapshot =
            tokio::task::spawn_blocking(move || store.prepare_snapshot(&snap_id, &snap_image));
        let saved = self.dirs.save_container(&rec);
        let snapshot = snapshot.await;
        let snap = match (saved, snapshot) {
            (Ok(()), Ok(Ok(s))) => s,
            (saved, snapshot) => {
                let _ = self.store.remove_snapshot(id);
                let _ = self.dirs.delete_container(id);
                return Err(match (saved, snapshot) {
                    (Err(e), _) => internal("saving container record")(e),
                    (_, Err(e)) => internal("preparing rootfs")(e),
                    (_, Ok(Err(e))) => internal("preparing rootfs")(e),
                    // Matched above: both went well.
                    (Ok(()), Ok(Ok(_))) => RuntimeError::Internal("preparing rootfs".into()),
                });
            }
        };
        let in_use = self
            .ctrs_of(&prec.id)
            .iter()
            .flat_map(|c| c.record().layers)
            .collect();
        let created = async {
            let restore_dir = match restore {
                None => String::new(),
                Some(ck) => {
                    let snap = snap.clone();
                    // Applied through the container's root filesystem (mounted for this),
                    // as CRI-O does: copy-up keeps the image's directories as they are.
                    let images = tokio::task::spawn_blocking(move || {
                        let r = snap
                            .mount_overlay()
                            .map_err(io::Error::other)
                            .and_then(|root| ck.unpack(&snap.dir, &root));
                        let unmounted = snap.unmount();
                        r.and_then(|i| unmounted.map(|()| i).map_err(io::Error::other))
                            .map_err(|e| (ck.source, e))
                    })
                    .await
                    .map_err(internal("unpacking the checkpoint"))?
                    .map_err(|(source, e)| {
                        let m = format!("CreateContainer {key:?}: unpacking the {source}: {e}");
                        match e.kind() {
                            io::ErrorKind::InvalidData | io::ErrorKind::InvalidInput => {
                                RuntimeError::InvalidArgument(m)
                            }
                            _ => RuntimeError::Internal(m),
                        }
                    })?;
                    images.display().to_string()
                }
            };
            let prepared = backend
                .prepare_container(
                    pod,
                    ContainerRequest {
                        id,
                        key,
                        config: &volumes,
                        spec: &mut spec,
                        layers: &rec.layers,
                        layers_in_use: in_use,
                        snapshot: &snap,
                        log_path: &log_path,
                    },
                )
                .await?;
            let text = serde_json::to_string(&spec).map_err(internal("spec"))?;
            rec.spec = Some(
                serde_json::value::RawValue::from_string(text.clone())
                    .map_err(internal("spec"))?
                    .into(),
            );
            let req = ap::CreateContainerRequest {
                id: id.to_string(),
                oci_spec: text.into_bytes(),
                rootfs: Some(prepared.rootfs),
                log_path: prepared.log_path,
                tty: config.tty,
                stdin: config.stdin,
                stdin_once: config.stdin_once,
                log_vsock_port: prepared.log_vsock_port,
                log_vsock_token: prepared.log_vsock_token,
                apparmor_policy,
                restore_dir,
            };
            let mut c = pod.client().await?;
            let resp = c
                .create_container(req)
                .await
                .map(|r| r.into_inner())
                .map_err(|s| agent_err(&format!("CreateContainer {key:?}"), s))?;
            rec.pid = resp.pid;
            rec.state = ContainerState::Created;
            self.dirs
                .save_container(&rec)
                .map_err(internal("saving container record"))
        }
        .await;
        if let Err(e) = created {
            if let Ok(mut c) = pod.client().await {
                let _ = c
                    .delete_container(ap::DeleteContainerRequest { id: id.to_string() })
                    .await;
            }
            backend.release_container(pod, &rec).await;
            let _ = self.store.remove_snapshot(id);
            let _ = self.dirs.delete_container(id);
            return Err(e);
        }
        self.ctrs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.to_string(), Arc::new(Ctr::new(rec.clone())));
        self.pin_vm_pod(&prec.id);
        self.emit(&rec, cri::ContainerEventType::ContainerCreatedEvent);
        tracing::info!(container = %id, pod = %prec.id, name = %key, image = %image_name, "container created");
        Ok(())
    }

    /// CRI StartContainer, run to its end in a task of its own: a caller that gives up
    /// (kubelet's deadline; a restore may take minutes) does not leave the record behind
    /// the container the agent started.
    pub async fn start_container(self: &Arc<Self>, id: &str) -> Result<()> {
        let (rt, id) = (self.clone(), id.to_string());
        tokio::spawn(async move { rt.start_now(&id).await })
            .await
            .map_err(internal("the start task"))?
    }

    async fn start_now(self: &Arc<Self>, id: &str) -> Result<()> {
        let ctr = self.ctr(id)?;
        let _op = ctr.op.lock().await;
        let rec = ctr.record();
        match rec.state {
            ContainerState::Created => {}
            ContainerState::Running => {
                return Err(RuntimeError::FailedPrecondition(format!(
                    "container {} is already running",
                    rec.id
                )))
            }
            _ => {
                return Err(RuntimeError::FailedPrecondition(format!(
                    "container {} is {:?}, not created; it cannot be started",
                    rec.id, rec.state
                )))
            }
        }
        // A start that fails leaves the container Exited with StartError (128), as
        // containerd's does, also where its pod can no longer run it: kubelet then makes the
        // next attempt (one left Created stayed so, watched by nothing).
        let start_failed = |e: RuntimeError| {
            let rec = ctr.update(|r| {
                r.state = ContainerState::Exited;
                r.finished_at = state::now_nanos();
                r.exit_code = 128;
                r.reason = "StartError".into();
                r.message = e.to_string();
            });
            let _ = ctr.persist(&self.dirs);
            self.emit(&rec, cri::ContainerEventType::ContainerStoppedEvent);
            e
        };
        let pod = self.pod(&rec.pod_id)?;
        let mut c = match pod.client().await {
            Ok(c) => c,
            Err(e) => return Err(start_failed(e)),
        };
        // Stamped before the call: a process that exits at once must not finish before it started.
        let started_at = state::now_nanos();
        // The agent makes the container's processes here (earlier agents did at create and
        // answer no pid).
        let started = c
            .start_container(ap::StartContainerRequest { id: rec.id.clone() })
            .await;
        let pid = match started {
            Ok(r) => r.into_inner().pid,
            Err(s) => {
                return Err(start_failed(agent_err(
                    &format!("StartContainer {}", rec.id),
                    s,
                )))
            }
        };
        let rec = ctr.update(|r| {
            if pid != 0 {
                r.pid = pid;
            }
            if r.state == ContainerState::Created {
                r.state = ContainerState::Running;
            }
            r.started_at = started_at;
            if r.finished_at != 0 && r.finished_at < started_at {
                r.finished_at = started_at;
            }
        });
        ctr.persist(&self.dirs)
            .map_err(internal("saving container record"))?;
        self.emit(&rec, cri::ContainerEventType::ContainerStartedEvent);
        self.spawn_watcher(pod, ctr.clone(), Some(c));
        tracing::info!(container = %rec.id, "container started");
        Ok(())
    }

    /// SIGKILLs every process of a container and waits for its exit.
    pub(super) async fn kill_and_wait(
        &self,
        c: &mut AgentClient<Channel>,
        ctr: &Ctr,
        limit: Duration,
    ) -> Result<()> {
        let id = ctr.record().id;
        let _ = c
            .signal_container(ap::SignalContainerRequest {
                id: id.clone(),
                signal: libc::SIGKILL as u32,
                all: true,
            })
            .await;
        match tokio::time::timeout(
            limit,
            c.wait_container(ap::WaitContainerRequest { id: id.clone() }),
        )
        .await
        {
            Ok(Ok(r)) => {
                self.record_exit(ctr, &r.into_inner().exit.unwrap_or_default());
                Ok(())
            }
            Ok(Err(s)) => Err(agent_err(&format!("stopping container {id}"), s)),
            Err(_) => Err(RuntimeError::DeadlineExceeded(format!(
                "container {id} did not exit within {limit:?} of SIGKILL"
            ))),
        }
    }

    /// CRI StopContainer: the stop signal, then SIGKILL once `timeout_secs` have passed (at
    /// once if it is not positive). The grace period is waited out without the container's
    /// lock, so that a stop with a shorter one (`crictl stop -t 0`) or a RemoveContainer
    /// (`crictl rm -f`) meanwhile kills it at once, as containerd's do.
    pub async fn stop_container(self: &Arc<Self>, id: &str, timeout_secs: i64) -> Result<()> {
        let Some(ctr) = if_found(self.ctr(id))? else {
            return Ok(());
        };
        let _stopping = super::Stopping::new(&ctr);
        if timeout_secs > 0 {
            let (rec, mut c) = {
                let _op = ctr.op.lock().await;
                let rec = ctr.record();
                if rec.state != ContainerState::Running {
                    return Ok(());
                }
                let mut c = self.pod(&rec.pod_id)?.client().await?;
                // Under the lock: set once the signal is sent (a call given up on before
                // that leaves it unset, and the next stop sends it).
                if !ctr.stop_signalled.load(Ordering::SeqCst) {
                    let sent = c
                        .signal_container(ap::SignalContainerRequest {
                            id: rec.id.clone(),
                            signal: rec.stop_signal as u32,
                            all: false,
                        })
                        .await;
                    match sent {
                        Ok(_) => ctr.stop_signalled.store(true, Ordering::SeqCst),
                        Err(s) => {
                            tracing::debug!(container = %rec.id, error = %s, "stop signal not delivered")
                        }
                    }
                }
                (rec, c)
            };
            let wait = c.wait_container(ap::WaitContainerRequest { id: rec.id.clone() });
            if let Ok(Ok(r)) =
                tokio::time::timeout(Duration::from_secs(timeout_secs as u64), wait).await
            {
                self.record_exit(&ctr, &r.into_inner().exit.unwrap_or_default());
                tracing::info!(container = %rec.id, "container stopped");
                return Ok(());
            }
        }
        let _op = ctr.op.lock().await;
        let rec = ctr.record();
        // Stopped (or removed) by another call meanwhile.
        if rec.state != ContainerState::Running || self.ctr(&rec.id).is_err() {
            return Ok(());
        }
        if timeout_secs > 0 {
            tracing::info!(container = %rec.id, timeout_secs, "stop signal timed out; killing");
        }
        let mut c = self.pod(&rec.pod_id)?.client().await?;
        self.kill_and_wait(&mut c, &ctr, Duration::from_secs(30))
            .await?;
        tracing::info!(container = %rec.id, "container killed");
        Ok(())
    }

    /// Deletes a container everywhere (agent, snapshot, record, name). Caller holds no locks.
    pub(super) async fn forget_container(&self, ctr: &Ctr) -> Result<()> {
        let _op = ctr.op.lock().await;
        let rec = ctr.record();
        // A removal behind another (kubelet's and a pod removal's, at once) finds it gone:
        // done, and its deletion is not announced twice.
        if !self
            .ctr(&rec.id)
            .is_ok_and(|listed| std::ptr::eq(Arc::as_ptr(&listed), ctr))
        {
            return Ok(());
        }
        if let Ok(pod) = self.pod(&rec.pod_id) {
            if pod.record().state == PodState::Ready {
                if let Ok(mut c) = pod.client().await {
                    if rec.state == ContainerState::Running {
                        let _ = self
                            .kill_and_wait(&mut c, ctr, Duration::from_secs(30))
                            .await;
                    }
                    if let Err(s) = c
                        .delete_container(ap::DeleteContainerRequest { id: rec.id.clone() })
                        .await
                    {
                        return Err(agent_err(&format!("RemoveContainer {}", rec.id), s));
                    }
                }
            }
        }
        for s in rec.snapshots() {
            self.store
                .remove_snapshot(s)
                .map_err(internal(format!("removing rootfs of {}", rec.id)))?;
        }
        if let Ok(pod) = self.pod(&rec.pod_id) {
            self.backend(&pod.record())
                .release_container(&pod, &rec)
                .await;
        }
        ctr.delete(&self.dirs)
            .map_err(internal("removing record"))?;
        self.ctrs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&rec.id);
        self.pin_vm_pod(&rec.pod_id);
        self.release(&rec.name_key, &rec.id);
        self.emit(&rec, cri::ContainerEventType::ContainerDeletedEvent);
        tracing::info!(container = %rec.id, "container removed");
        Ok(())
    }

    pub async fn remove_container(self: &Arc<Self>, id: &str) -> Result<()> {
        let Some(ctr) = if_found(self.ctr(id))? else {
            return Ok(());
        };
        self.forget_container(&ctr).await
    }

    /// CRI UpdateContainerResources: new cgroup limits for a created or running container.
    pub async fn update_container_resources(
        &self,
        id: &str,
        linux: Option<cri::LinuxContainerResources>,
    ) -> Result<()> {
        let ctr = self.ctr(id)?;
        let _op = ctr.op.lock().await;
        let rec = ctr.record();
        if !matches!(rec.state, ContainerState::Created | ContainerState::Running) {
            return Err(RuntimeError::FailedPrecondition(format!(
                "UpdateContainerResources: container {} is {:?}",
                rec.id, rec.state
            )));
        }
        let Some(r) = linux else {
            return Ok(());
        };
        spec::check_resources(&r).map_err(|e| {
            RuntimeError::InvalidArgument(format!("UpdateContainerResources {}: {e}", rec.id))
        })?;
        let pod = self.pod(&rec.pod_id)?;
        // As at create: the host's cpusets are not a VM pod guest's.
        let host_cpus = pod.record().backend.kind() != crate::state::BackendKind::Vm;
        let resources = ap::LinuxResources {
            cpu_period: r.cpu_period,
            cpu_quota: r.cpu_quota,
            cpu_shares: r.cpu_shares,
            memory_limit_in_bytes: r.memory_limit_in_bytes,
            cpuset_cpus: if host_cpus {
                r.cpuset_cpus.clone()
            } else {
                String::new()
            },
            cpuset_mems: if host_cpus {
                r.cpuset_mems.clone()
            } else {
                String::new()
            },
            memory_swap_limit_in_bytes: spec::default_swap(
                &r,
                host_cpus && vessel_agent::cgroups::accounts_swap(),
            ),
            unified: r.unified.clone(),
        };
        let mut c = pod.client().await?;
        c.update_resources(ap::UpdateResourcesRequest {
            id: rec.id.clone(),
            resources: Some(resources.clone()),
        })
        .await
        .map_err(|s| agent_err(&format!("UpdateContainerResources {}", rec.id), s))?;
        // The spec `crictl inspect` shows takes the update as the agent's copy does (zero
        // fields leave what is there). Worked out before the record's lock is taken; `op`
        // keeps the record's spec from changing meanwhile.
        let spec = rec.spec.as_ref().and_then(|s| {
            let mut v: serde_json::Value = serde_json::from_str(s.get()).ok()?;
            vessel_agent::spec::merge_resources(&mut v, &resources).ok()?;
            serde_json::value::RawValue::from_string(v.to_string()).ok()
        });
        let rec = ctr.update(|c| {
            let l = c.config.linux.get_or_insert_with(Default::default);
            l.resources = Some(spec::merge_update(
                l.resources.take(),
                &r,
                resources.memory_swap_limit_in_bytes,
            ));
            if let Some(s) = spec {
                c.spec = Some(s.into());
            }
        });
        ctr.persist(&self.dirs)
            .map_err(internal("saving container record"))?;
        self.pin_vm_pod(&rec.pod_id);
        tracing::info!(container = %rec.id, "container resources updated");
        Ok(())
    }

    /// A VM pod's process pinned to the host CPUs its created and running containers were
    /// given (kubelet's CPU manager; see `sandbox::vm::pin`), or to all. Failures are logged:
    /// the containers run either way.
    fn pin_vm_pod(&self, pod_id: &str) {
        let Ok(pod) = self.pod(pod_id) else { return };
        let prec = pod.record();
        if prec.backend.kind() != crate::state::BackendKind::Vm {
            return;
        }
        let lists: Vec<String> = self
            .ctrs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|c| c.record())
            .filter(|r| r.pod_id == pod_id)
            .filter(|r| matches!(r.state, ContainerState::Created | ContainerState::Running))
            .filter_map(|r| r.config.linux?.resources.map(|x| x.cpuset_cpus))
            .collect();
        let cpus = crate::sandbox::vm::pin::wanted(lists.iter().map(String::as_str));
        match crate::sandbox::vm::pin::pin_process(prec.agent_pid, prec.agent_start_time, &cpus) {
            Ok(threads) => {
                tracing::debug!(pod = %pod_id, ?cpus, threads, "VM pod's process pinned")
            }
            Err(e) => {
                tracing::warn!(pod = %pod_id, error = %e, "pinning the VM pod's process to its containers' CPUs")
            }
        }
    }
}

/// Set once the AppArmor default could not be loaded for a container that asked for no
/// profile: later ones run unconfined without trying again (an explicit RuntimeDefault
/// still tries, and fails).
static UNSET_APPARMOR_FAILED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// A container that asked for no AppArmor profile runs unconfined where the default cannot
/// be had (`why`): said once as a warning.
fn unset_apparmor_unconfined(why: &str) {
    if UNSET_APPARMOR_FAILED.swap(true, Ordering::Relaxed) {
        tracing::debug!(error = %why, "AppArmor default not applied");
    } else {
        tracing::warn!(error = %why, "AppArmor: containers that ask for no profile run unconfined, as the default profile cannot be applied");
    }
}

/// Runs blocking AppArmor work (`apparmor_parser`, securityfs) off the runtime's threads; its
/// failure fails CreateContainer `key` with FailedPrecondition.
async fn apparmor_task<T: Send + 'static>(
    key: &str,
    f: impl FnOnce() -> std::result::Result<T, String> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(internal("AppArmor"))?
        .map_err(|e| RuntimeError::FailedPrecondition(format!("CreateContainer {key:?}: {e}")))
}

/// Where a container's log goes: kubelet's `log_path` is relative to the pod's
/// `log_directory` (CRI contract). An absolute path or a `..` component is refused; the
/// directory is resolved here (kubelet's own, trusted), and the file is then opened beneath it
/// without following links (`vessel_agent::logs::open_log_nofollow`). Empty: no log.
fn container_log_path(log_directory: &str, log_path: &str) -> Result<String> {
    if log_directory.is_empty() || log_path.is_empty() {
        return Ok(String::new());
    }
    let rel = Path::new(log_path);
    if !stays_below(rel) || rel.file_name().is_none() {
        return Err(RuntimeError::InvalidArgument(format!(
            "log_path {log_path:?} must be a relative file path inside the pod's log directory {log_directory:?} (no `..`, not absolute)"
        )));
    }
    let dir = Path::new(log_directory);
    std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::canonicalize(dir))
        .map(|d| d.join(rel).display().to_string())
        .map_err(internal(format!("log directory {log_directory:?}")))
}

/// Why an image volume's `image_sub_path` cannot be mounted: the request's fault
/// (InvalidArgument) or the node's (Internal).
#[derive(Debug)]
enum SubPathError {
    Bad(String),
    /// It is not in the image (a request's fault too).
    Missing(String),
    Node(String),
}

/// Where `sub`, a CRI mount's `image_sub_path`, is in the image mounted at `root`: resolved as
/// inside the image (its symlinks taken relative to the image's root, never out of it, by
/// openat2's RESOLVE_IN_ROOT), as a path under `root`. It must exist (CRI: the runtime fails
/// otherwise), be relative without `..` (as kubelet checks), and be a directory or a regular
/// file (not a device, FIFO or socket the image holds).
fn image_sub_path(root: &Path, sub: &str) -> std::result::Result<String, SubPathError> {
    use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};
    use rustix::io::Errno;
    use SubPathError::{Bad, Node};
    let rel = Path::new(sub);
    if !stays_below(rel) {
        return Err(Bad("must be a relative path without `..`".into()));
    }
    if sub.contains('\0') {
        return Err(Bad("holds a NUL byte".into()));
    }
    let node = |what: &str, e: &dyn std::fmt::Display| Node(format!("{what}: {e}"));
    let dir = rustix::fs::open(
        root,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| node(&format!("opening {root:?}"), &e))?;
    let how = ResolveFlags::IN_ROOT | ResolveFlags::NO_MAGICLINKS | ResolveFlags::NO_XDEV;
    // EAGAIN: a rename or mount elsewhere raced a `..` of the image's links; try again.
    let mut tries = 0;
    let fd = loop {
        match rustix::fs::openat2(
            &dir,
            rel,
            OFlags::PATH | OFlags::CLOEXEC,
            Mode::empty(),
            how,
        ) {
            Err(Errno::AGAIN) if tries < 16 => tries += 1,
            r => break r,
        }
    }
    .map_err(|e| match e {
        Errno::NOENT | Errno::NOTDIR => SubPathError::Missing("does not exist in the image".into()),
        Errno::LOOP => Bad("is a loop of symlinks in the image".into()),
        Errno::NAMETOOLONG => Bad("is too long a path".into()),
        Errno::NOSYS => {
            Node("resolving it inside the image needs openat2 (Linux 5.6 or later)".into())
        }
        e => node("looking it up", &e),
    })?;
    let st = rustix::fs::fstat(&fd).map_err(|e| node("stat", &e))?;
    if !matches!(
        FileType::from_raw_mode(st.st_mode),
        FileType::Directory | FileType::RegularFile
    ) {
        return Err(Bad("is not a directory or a regular file".into()));
    }
    let found = std::fs::read_link(format!(
        "/proc/self/fd/{}",
        std::os::fd::AsRawFd::as_raw_fd(&fd)
    ))
    .map_err(|e| node("reading its path", &e))?;
    let root = std::fs::canonicalize(root).map_err(|e| node("resolving the image's root", &e))?;
    if !found.starts_with(&root) {
        return Err(Node(format!("resolved to {found:?}, outside the image")));
    }
    found
        .into_os_string()
        .into_string()
        .map_err(|p| Bad(format!("resolves to a name that is not UTF-8: {p:?}")))
}

/// Copies `from` (a directory or file of an image's read-only mount) to `to`, which must not
/// exist, as containerd copies an image's volume: directories, regular files and symlinks
/// (never followed), with their owners, modes, extended attributes (file capabilities,
/// ACLs) and times; hard links stay links; device nodes, FIFOs and sockets are left out, as
/// an image volume's content has none worth a copy.
///
/// Iterative: an image's tree as deep as paths allow (thousands of levels) must not overflow
/// the blocking thread's stack.
fn copy_volume(from: &Path, to: &Path) -> io::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    // Owner first: a chown clears set-id bits, which the mode then puts back, and file
    // capabilities, which the attributes then put back; times last.
    let own = |from: &Path, to: &Path, meta: &std::fs::Metadata| {
        std::os::unix::fs::lchown(to, Some(meta.uid()), Some(meta.gid()))?;
        std::fs::set_permissions(to, std::fs::Permissions::from_mode(meta.mode() & 0o7777))?;
        copy_xattrs(from, to)?;
        set_times(to, meta)
    };
    // Directories get the rest once filled (one without write permission for its owner
    // could not be filled after; filling it changes its times).
    let mut dirs: Vec<(std::path::PathBuf, std::path::PathBuf, std::fs::Metadata)> = Vec::new();
    // The first copy of each hard-linked file, by the image's inode.
    let mut linked: std::collections::HashMap<(u64, u64), std::path::PathBuf> =
        std::collections::HashMap::new();
    let mut todo = vec![(from.to_path_buf(), to.to_path_buf())];
    while let Some((from, to)) = todo.pop() {
        let meta = std::fs::symlink_metadata(&from)?;
        let kind = meta.file_type();
        if kind.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(&from)?, &to)?;
            std::os::unix::fs::lchown(&to, Some(meta.uid()), Some(meta.gid()))?;
            set_times(&to, &meta)?;
        } else if kind.is_dir() {
            std::fs::create_dir(&to)?;
            for entry in std::fs::read_dir(&from)? {
                let entry = entry?;
                todo.push((entry.path(), to.join(entry.file_name())));
            }
            dirs.push((from, to, meta));
        } else if kind.is_file() {
            let first = (meta.nlink() > 1)
                .then(|| linked.get(&(meta.dev(), meta.ino())))
                .flatten();
            if let Some(first) = first {
                std::fs::hard_link(first, &to)?;
                continue;
            }
            // A sparse file (a database's preallocated one) keeps its holes: written out in
            // full it could take far more of the node's disk than the image does.
            if meta.blocks().saturating_mul(512) < meta.len() {
                copy_sparse(&from, &to, meta.len())?;
            } else {
                std::fs::copy(&from, &to)?;
            }
            own(&from, &to, &meta)?;
            if meta.nlink() > 1 {
                linked.insert((meta.dev(), meta.ino()), to);
            }
        } else {
            tracing::debug!(path = %from.display(), "not a directory, file or link: not copied into the volume");
        }
    }
    // Deepest first: a parent's mode never stands in its children's way.
    for (from, to, meta) in dirs.iter().rev() {
        own(from, to, meta)?;
    }
    Ok(())
}

/// Copies the regular file `from` (`len` bytes) to the new file `to` with its holes: only
/// the ranges `SEEK_DATA` finds are written, and the length is set at the end. A filesystem
/// that does not tell holes apart answers its whole length as data.
fn copy_sparse(from: &Path, to: &Path, len: u64) -> io::Result<()> {
    use rustix::fs::SeekFrom;
    use std::os::unix::fs::FileExt;
    let src = std::fs::File::open(from)?;
    let dst = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(to)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut pos = 0u64;
    while pos < len {
        let data = match rustix::fs::seek(&src, SeekFrom::Data(pos)) {
            Ok(d) => d,
            // No data after `pos`: the rest is a hole.
            Err(rustix::io::Errno::NXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let end = rustix::fs::seek(&src, SeekFrom::Hole(data))?.min(len);
        let mut at = data;
        while at < end {
            let want = usize::try_from(end - at)
                .unwrap_or(usize::MAX)
                .min(buf.len());
            let n = src.read_at(&mut buf[..want], at)?;
            if n == 0 {
                // The file shrank under us (it is an image's: it does not).
                break;
            }
            dst.write_all_at(&buf[..n], at)?;
            at += n as u64;
        }
        pos = end.max(data + 1);
    }
    dst.set_len(len)
}

/// Copies the extended attributes of `from` to `to` (neither followed if a link); a
/// filesystem that does not take one (or any) goes without, as the attribute is not the
/// content.
fn copy_xattrs(from: &Path, to: &Path) -> io::Result<()> {
    use rustix::io::Errno;
    let size = match rustix::fs::llistxattr_query(from) {
        Ok(0) | Err(Errno::OPNOTSUPP) => return Ok(()),
        Ok(n) => n,
        Err(e) => return Err(e.into()),
    };
    let mut names = vec![0u8; size];
    let n = rustix::fs::llistxattr(from, &mut names[..])?;
    names.truncate(n);
    for name in names.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let name = <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(name);
        let value = match rustix::fs::lgetxattr_query(from, name) {
            Ok(len) => {
                let mut v = vec![0u8; len];
                let got = rustix::fs::lgetxattr(from, name, &mut v[..])?;
                v.truncate(got);
                v
            }
            Err(Errno::NODATA) => continue,
            Err(e) => return Err(e.into()),
        };
        match rustix::fs::lsetxattr(to, name, &value, rustix::fs::XattrFlags::empty()) {
            Ok(()) => {}
            Err(Errno::OPNOTSUPP | Errno::PERM | Errno::ACCESS | Errno::INVAL) => {
                tracing::debug!(path = %to.display(), attr = ?name, "extended attribute not taken by the volume's filesystem");
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Gives `to` (not followed if a link) the access and modification times of `meta`.
fn set_times(to: &Path, meta: &std::fs::Metadata) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let ts = |sec: i64, nsec: i64| rustix::fs::Timespec {
        tv_sec: sec,
        tv_nsec: nsec as _,
    };
    let times = rustix::fs::Timestamps {
        last_access: ts(meta.atime(), meta.atime_nsec()),
        last_modification: ts(meta.mtime(), meta.mtime_nsec()),
    };
    rustix::fs::utimensat(
        rustix::fs::CWD,
        to,
        &times,
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )?;
    Ok(())
}

/// An image volume's directory where the image has nothing: root's, 0755 whatever the
/// umask.
fn empty_volume(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new().mode(0o755).create(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
}

/// How ContainerStatus names an image (its `image_ref`, and an image volume's): its first
/// repo digest, else its id.
fn image_ref(image: &vessel_images::store::ImageRecord) -> String {
    image
        .repo_digests
        .first()
        .cloned()
        .unwrap_or_else(|| image.id.to_string())
}

/// Whether `rel` names a place under the directory it is taken from: relative, no `..`.
fn stays_below(rel: &Path) -> bool {
    use std::path::Component;
    rel.components()
        .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
}

/// The name a container's image is shown by, where the request named it by its id (as
/// kubelet does): the name the user gave (`user_specified_image`), else the image's first
/// tag (containerd's choice). `None`: keep the name the request gave.
fn shown_image_name(
    config: &cri::ContainerConfig,
    image: &vessel_images::store::ImageRecord,
    asked: &str,
) -> Option<String> {
    let hex = image.id.hex();
    let by_id = asked == image.id.to_string()
        || (asked.len() >= 12 && hex.starts_with(asked.strip_prefix("sha256:").unwrap_or(asked)));
    if !by_id {
        return None;
    }
    let user = config
        .image
        .as_ref()
        .map(|i| i.user_specified_image.as_str())
        .unwrap_or_default();
    if !user.is_empty() {
        return Some(user.to_string());
    }
    image.repo_tags.first().cloned()
}

/// The image a container config asks for, by the name it gives.
fn image_name_of(config: &cri::ContainerConfig) -> String {
    config
        .image
        .as_ref()
        .map(|i| i.image.clone())
        .unwrap_or_default()
}

/// Whether this host has the hugetlb cgroup controller, a v1 hierarchy or in v2's list (a
/// fact of the boot: read once).
fn host_has_hugetlb() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        std::path::Path::new("/sys/fs/cgroup/hugetlb").is_dir()
            || std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")
                .is_ok_and(|c| c.split_whitespace().any(|x| x == "hugetlb"))
    })
}

/// Makes the missing host paths of a container's volumes as directories (0755, root's), as
/// containerd and CRI-O do: kubelet checks and makes nothing for a hostPath volume without a
/// `type`, the default, and leaves a missing one to the runtime. A path that is not absolute
/// is left to the spec's refusal; an image volume has none.
fn make_missing_sources(key: &str, mounts: &[cri::Mount]) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    for m in mounts {
        let p = Path::new(&m.host_path);
        if !p.is_absolute() || std::fs::symlink_metadata(p).is_ok() {
            continue;
        }
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(p)
            .map_err(|e| {
                RuntimeError::InvalidArgument(format!(
                    "CreateContainer {key:?}: making the missing host path {:?} of the volume at {:?}: {e}",
                    m.host_path, m.container_path
                ))
            })?;
        tracing::info!(container = %key, path = %m.host_path, "made the volume's missing host path");
    }
    Ok(())
}

/// Refuses a volume whose propagation its host path's mount cannot give, as containerd
/// does: Bidirectional needs a shared mount (else the container's mounts never reach the
/// host: a CSI plugin's volume mounts would stay unseen by kubelet), HostToContainer a
/// shared or slave one (else later host mounts never show). A systemd host's mounts are
/// shared; kubelet makes its own directory shared. A missing path is left to the runtime.
fn check_propagation_sources(key: &str, mounts: &[cri::Mount]) -> Result<()> {
    use cri::MountPropagation as P;
    let mut table: Option<Vec<vessel_agent::mount_tree::MountInfo>> = None;
    for m in mounts {
        let wants = P::try_from(m.propagation).unwrap_or(P::PropagationPrivate);
        if wants == P::PropagationPrivate || m.host_path.is_empty() {
            continue;
        }
        let Ok(real) = std::fs::canonicalize(&m.host_path) else {
            continue;
        };
        let table = match &mut table {
            Some(t) => t,
            None => {
                let text = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| {
                    RuntimeError::Internal(format!("reading /proc/self/mountinfo: {e}"))
                })?;
                table.insert(vessel_agent::mount_tree::mountinfo(&text))
            }
        };
        // The path's own mount, by ID where the kernel gives it (5.8+): by name, a mount
        // tucked under another, or one covered by a later mount on a parent, is mistaken.
        let by_id = rustix::fs::statx(
            rustix::fs::CWD,
            &real,
            rustix::fs::AtFlags::empty(),
            rustix::fs::StatxFlags::MNT_ID,
        )
        .ok()
        .filter(|x| x.stx_mask & rustix::fs::StatxFlags::MNT_ID.bits() != 0)
        .and_then(|x| table.iter().find(|e| e.id == x.stx_mnt_id));
        let Some(on) = by_id.or_else(|| vessel_agent::mount_tree::mount_of(table, &real)) else {
            continue;
        };
        let (ok, asked, needs) = match wants {
            P::PropagationBidirectional => (on.is_shared(), "Bidirectional", "shared"),
            _ => (
                on.is_shared() || on.is_slave(),
                "HostToContainer",
                "shared or slave",
            ),
        };
        if !ok {
            return Err(RuntimeError::FailedPrecondition(format!(
                "CreateContainer {key:?}: the volume at {:?} asks for {} propagation, but its host path {:?} is on the mount {:?}, which is not {needs} (mount --make-rshared {:?} on the host)",
                m.container_path,
                asked,
                m.host_path,
                on.mount_point,
                on.mount_point,
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn propagation_needs_a_shared_or_slave_source() {
        use cri::MountPropagation as P;
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: mounting needs root");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let (shared, slave, private) = (
            t.path().join("sh"),
            t.path().join("sl"),
            t.path().join("pr"),
        );
        let sh = |cmd: String| {
            let ok = std::process::Command::new("sh")
                .args(["-c", &cmd])
                .status()
                .unwrap();
            assert!(ok.success(), "{cmd}");
        };
        // Unmounted whatever the test's end.
        struct Unmount(Vec<std::path::PathBuf>);
        impl Drop for Unmount {
            fn drop(&mut self) {
                for p in self.0.iter().rev() {
                    let _ = rustix::mount::unmount(p, rustix::mount::UnmountFlags::DETACH);
                }
            }
        }
        // A shared mount covered by a later private one on its parent: the path is on the
        // private one, though the shared one's mount point is the longer match by name.
        let covered = t.path().join("cov/a");
        let _u = Unmount(vec![
            shared.clone(),
            slave.clone(),
            private.clone(),
            covered.join("b"),
            covered.clone(),
        ]);
        for d in [&shared, &slave, &private] {
            std::fs::create_dir(d).unwrap();
        }
        sh(format!(
            "mount -t tmpfs t {0} && mount --make-shared {0} && mkdir {0}/in",
            shared.display()
        ));
        sh(format!(
            "mount --bind {} {1} && mount --make-slave {1}",
            shared.display(),
            slave.display()
        ));
        sh(format!(
            "mount -t tmpfs t {0} && mount --make-private {0}",
            private.display()
        ));
        std::fs::create_dir_all(covered.join("b")).unwrap();
        sh(format!("mount -t tmpfs t {0}/b && mount --make-shared {0}/b && mount -t tmpfs t {0} && mount --make-private {0} && mkdir {0}/b", covered.display()));
        let covered = covered.join("b");
        let check = |path: &Path, p: P| {
            let m = cri::Mount {
                container_path: "/v".into(),
                host_path: path.display().to_string(),
                propagation: p as i32,
                ..Default::default()
            };
            check_propagation_sources("c", &[m])
        };
        for p in [
            P::PropagationPrivate,
            P::PropagationHostToContainer,
            P::PropagationBidirectional,
        ] {
            assert!(
                check(&shared.join("in"), p).is_ok(),
                "{p:?} on a shared mount"
            );
            assert!(
                check(&private.join("missing"), p).is_ok(),
                "{p:?} of a missing path"
            );
        }
        assert!(check(&slave, P::PropagationHostToContainer).is_ok());
        assert!(check(&private, P::PropagationPrivate).is_ok());
        for (path, p) in [
            (&slave, P::PropagationBidirectional),
            (&private, P::PropagationBidirectional),
            (&private, P::PropagationHostToContainer),
            (&covered, P::PropagationHostToContainer),
        ] {
            match check(path, p) {
                Err(RuntimeError::FailedPrecondition(m)) => assert!(
                    m.contains("\"/v\"") && m.contains(&path.display().to_string()),
                    "{m}"
                ),
                other => panic!("{p:?} on {path:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn image_volumes_copy_trees_deeper_than_a_stack() {
        let (_t, from) = crate::testing::temp_path("from");
        let mut deep = from.clone();
        // As deep as a path allows (PATH_MAX), which recursion could not take on a
        // blocking thread's 2 MiB stack in a debug build.
        while deep.as_os_str().len() < 4000 {
            deep.push("d");
        }
        std::fs::create_dir_all(&deep).unwrap();
        std::fs::write(deep.join("f"), "x").unwrap();
        let to = from.with_file_name("to");
        let (f, t) = (from.clone(), to.clone());
        std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(move || copy_volume(&f, &t))
            .unwrap()
            .join()
            .unwrap()
            .unwrap();
        let rel = deep.strip_prefix(&from).unwrap();
        assert_eq!(std::fs::read(to.join(rel).join("f")).unwrap(), b"x");
    }

    #[test]
    fn image_volumes_copy_owners_modes_and_links() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let (_t, from) = crate::testing::temp_path("from");
        std::fs::create_dir_all(from.join("sub")).unwrap();
        std::fs::write(from.join("sub/f"), "data").unwrap();
        std::os::unix::fs::chown(from.join("sub/f"), Some(1000), Some(1001)).unwrap();
        std::fs::set_permissions(from.join("sub/f"), std::fs::Permissions::from_mode(0o4750))
            .unwrap();
        std::fs::set_permissions(&from, std::fs::Permissions::from_mode(0o1770)).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", from.join("link")).unwrap();
        std::os::unix::net::UnixListener::bind(from.join("sock")).unwrap();
        let (_u, to) = crate::testing::temp_path("to");
        copy_volume(&from, &to).unwrap();
        let f = std::fs::metadata(to.join("sub/f")).unwrap();
        assert_eq!((f.uid(), f.gid(), f.mode() & 0o7777), (1000, 1001, 0o4750));
        assert_eq!(std::fs::read_to_string(to.join("sub/f")).unwrap(), "data");
        assert_eq!(std::fs::metadata(&to).unwrap().mode() & 0o7777, 0o1770);
        // The link is copied as it is, never followed.
        assert_eq!(
            std::fs::read_link(to.join("link")).unwrap(),
            Path::new("/etc/passwd")
        );
        assert!(!to.join("sock").exists());
        // A file volume is a file.
        let (_v, file) = crate::testing::temp_path("file");
        copy_volume(&from.join("sub/f"), &file).unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "data");
    }

    #[test]
    fn image_volumes_keep_sparse_files_sparse() {
        use std::os::unix::fs::{FileExt, MetadataExt};
        let (_t, dir) = crate::testing::temp_path("sparse");
        let from = dir.join("from");
        std::fs::create_dir_all(&from).unwrap();
        // 64 MiB, with data at 1 MiB and in the last bytes.
        let f = std::fs::File::create(from.join("db")).unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(b"start of data", 1 << 20).unwrap();
        f.write_all_at(b"tail", (64 << 20) - 4).unwrap();
        // One that ends in a hole, and an empty one.
        let g = std::fs::File::create(from.join("prealloc")).unwrap();
        g.write_all_at(b"head", 0).unwrap();
        g.set_len(32 << 20).unwrap();
        std::fs::File::create(from.join("empty")).unwrap();
        drop((f, g));
        let to = dir.join("to");
        copy_volume(&from, &to).unwrap();
        for name in ["db", "prealloc", "empty"] {
            let (a, b) = (from.join(name), to.join(name));
            assert_eq!(
                std::fs::read(&a).unwrap(),
                std::fs::read(&b).unwrap(),
                "{name}"
            );
            let (ma, mb) = (
                std::fs::metadata(&a).unwrap(),
                std::fs::metadata(&b).unwrap(),
            );
            assert_eq!(ma.len(), mb.len(), "{name}");
            // Where the node's filesystem keeps holes, the copy takes no more than the file.
            if ma.blocks() * 512 < ma.len() {
                assert!(
                    mb.blocks() <= ma.blocks() + 16,
                    "{name}: {} blocks, image's {}",
                    mb.blocks(),
                    ma.blocks()
                );
            }
        }
    }

    #[test]
    fn image_volumes_keep_attributes_times_and_hard_links() {
        use std::os::unix::fs::MetadataExt;
        let (_t, from) = crate::testing::temp_path("from");
        std::fs::create_dir_all(from.join("d")).unwrap();
        std::fs::write(from.join("d/f"), "data").unwrap();
        std::fs::hard_link(from.join("d/f"), from.join("g")).unwrap();
        std::os::unix::fs::symlink("d/f", from.join("l")).unwrap();
        let flags = rustix::fs::XattrFlags::empty();
        let xattrs = rustix::fs::lsetxattr(from.join("d/f"), "user.vessel", b"file", flags)
            .and_then(|()| rustix::fs::lsetxattr(from.join("d"), "user.vessel", b"dir", flags));
        let past = |s: i64| rustix::fs::Timestamps {
            last_access: rustix::fs::Timespec {
                tv_sec: s,
                tv_nsec: 5,
            },
            last_modification: rustix::fs::Timespec {
                tv_sec: s + 1,
                tv_nsec: 7,
            },
        };
        let nofollow = rustix::fs::AtFlags::SYMLINK_NOFOLLOW;
        for (p, s) in [("d/f", 1_000_000), ("d", 2_000_000), ("l", 3_000_000)] {
            rustix::fs::utimensat(rustix::fs::CWD, from.join(p), &past(s), nofollow).unwrap();
        }
        let (_u, to) = crate::testing::temp_path("to");
        copy_volume(&from, &to).unwrap();
        let m = |p: &str| std::fs::symlink_metadata(to.join(p)).unwrap();
        assert_eq!((m("d/f").mtime(), m("d/f").mtime_nsec()), (1_000_001, 7));
        assert_eq!((m("d/f").atime(), m("d/f").atime_nsec()), (1_000_000, 5));
        assert_eq!(
            m("d").mtime(),
            2_000_001,
            "a directory's times, once filled"
        );
        assert_eq!(m("l").mtime(), 3_000_001, "a link's own times");
        assert_eq!(m("g").ino(), m("d/f").ino(), "hard links stay links");
        if xattrs.is_ok() {
            let get = |p: &str| {
                let mut v = vec![0u8; 16];
                let n = rustix::fs::lgetxattr(to.join(p), "user.vessel", &mut v[..]).unwrap();
                v.truncate(n);
                v
            };
            assert_eq!(get("d/f"), b"file");
            assert_eq!(get("d"), b"dir");
        }
    }

    #[test]
    fn image_sub_paths_resolve_inside_the_image() {
        let (_t, root) = crate::testing::temp_path("image");
        std::fs::create_dir_all(root.join("usr/share/data")).unwrap();
        std::fs::write(root.join("usr/share/data/f"), "x").unwrap();
        std::os::unix::fs::symlink("/usr/share", root.join("share")).unwrap();
        std::os::unix::fs::symlink("../../../../../../etc", root.join("up")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", root.join("passwd")).unwrap();
        std::os::unix::fs::symlink("loop2", root.join("loop1")).unwrap();
        std::os::unix::fs::symlink("loop1", root.join("loop2")).unwrap();
        std::os::unix::net::UnixListener::bind(root.join("sock")).unwrap();
        let real = std::fs::canonicalize(&root).unwrap();
        let found = |sub: &str| image_sub_path(&root, sub).map(std::path::PathBuf::from);
        assert_eq!(
            found("usr/share/data").unwrap(),
            real.join("usr/share/data")
        );
        assert_eq!(
            found("./usr/share/data/f").unwrap(),
            real.join("usr/share/data/f")
        );
        // An absolute link inside the image is the image's path, not the host's.
        assert_eq!(found("share/data").unwrap(), real.join("usr/share/data"));
        // Links that climb out stop at the image's root: the host's /etc is never reached.
        let bad = |sub: &str| match image_sub_path(&root, sub) {
            Err(SubPathError::Bad(m) | SubPathError::Missing(m)) => m,
            other => panic!("{sub}: {other:?}"),
        };
        for (sub, want) in [
            ("up", "does not exist"),
            ("passwd", "does not exist"),
            ("missing", "does not exist"),
            ("loop1", "loop of symlinks"),
            ("sock", "not a directory or a regular file"),
            ("/usr", "without `..`"),
            ("../x", "without `..`"),
            ("usr/../../x", "without `..`"),
            ("usr\0x", "NUL"),
        ] {
            let e = bad(sub);
            assert!(e.contains(want), "{sub}: {e}");
        }
        std::fs::create_dir(root.join("etc")).unwrap();
        assert_eq!(found("up").unwrap(), real.join("etc"));
    }

    #[test]
    fn log_path_stays_inside_the_log_directory() {
        let (t, d) = crate::testing::temp_path("pod");
        let ds = d.to_str().unwrap();
        for bad in [
            "../../../../../../etc/x.log",
            "/etc/x.log",
            "ctr/../../x.log",
            "..",
        ] {
            let e = container_log_path(ds, bad).unwrap_err();
            assert!(matches!(e, RuntimeError::InvalidArgument(_)), "{bad}: {e}");
        }
        assert!(!d.exists(), "nothing is created for a refused path");
        let canon = std::fs::canonicalize(t.path()).unwrap().join("pod");
        assert_eq!(
            container_log_path(ds, "ctr/0.log").unwrap(),
            canon.join("ctr/0.log").display().to_string()
        );
        assert_eq!(container_log_path(ds, "").unwrap(), "");
        assert_eq!(container_log_path("", "x.log").unwrap(), "");
    }
}
