//! What a spec works with: the CRI client, the test images, and helpers that label
//! everything they create so that the runner can remove it.

use super::testimages::Images;
use super::{ctr_state, Stop, RUN_LABEL, SPEC_LABEL};
use crate::check;
use crate::client::CriClient;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vessel_cri_api::v1 as cri;

/// Shared by every spec of a run.
#[derive(Debug)]
pub struct Env {
    pub images: Images,
    pub registry: String,
    pub run_id: String,
    pub runtime_handler: String,
    pub vm_pods: bool,
    /// See [`crate::suite::Config::vsock_probe`].
    pub vsock_probe: Option<PathBuf>,
    /// A temporary directory: pod log directories and host paths for mounts.
    pub work: PathBuf,
}

/// One spec's context.
#[derive(Clone)]
pub struct Ctx {
    pub c: CriClient,
    pub env: Arc<Env>,
    /// Unique per spec: the value of the spec label and a prefix for names.
    pub id: String,
    pulled: Arc<Mutex<Vec<String>>>,
    host_mounts: Arc<Mutex<Vec<PathBuf>>>,
}

pub(crate) fn spec(image: &str) -> Option<cri::ImageSpec> {
    Some(cri::ImageSpec {
        image: image.to_string(),
        ..Default::default()
    })
}

/// The images of `names` that the runtime already has.
pub(crate) async fn present_images(c: &CriClient, names: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    for n in names {
        let mut c = c.clone();
        if let Ok(r) = c
            .images
            .image_status(cri::ImageStatusRequest {
                image: spec(n),
                verbose: false,
            })
            .await
        {
            if r.into_inner().image.is_some() {
                out.push(n.clone());
            }
        }
    }
    out
}

pub(crate) async fn remove_image(c: &CriClient, name: &str) {
    let mut c = c.clone();
    let _ = c
        .images
        .remove_image(cri::RemoveImageRequest { image: spec(name) })
        .await;
}

/// Stops and removes every pod carrying `labels` (and so their containers).
pub(crate) async fn remove_pods(c: &CriClient, labels: HashMap<String, String>) {
    let mut c = c.clone();
    let Ok(pods) = c
        .runtime
        .list_pod_sandbox(cri::ListPodSandboxRequest {
            filter: Some(cri::PodSandboxFilter {
                label_selector: labels,
                ..Default::default()
            }),
        })
        .await
    else {
        return;
    };
    for p in pods.into_inner().items {
        let _ = c
            .runtime
            .stop_pod_sandbox(cri::StopPodSandboxRequest {
                pod_sandbox_id: p.id.clone(),
            })
            .await;
        let _ = c
            .runtime
            .remove_pod_sandbox(cri::RemovePodSandboxRequest {
                pod_sandbox_id: p.id,
            })
            .await;
    }
}

/// One line of a CRI log file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    pub time: String,
    pub stream: String,
    pub tag: String,
    pub content: String,
}

/// Parses a CRI log file; a line not in `<RFC3339Nano> stdout|stderr F|P <content>` form
/// is an error.
pub fn parse_log(text: &str) -> Result<Vec<LogLine>, String> {
    let mut out = Vec::new();
    for l in text.split_terminator('\n') {
        let mut it = l.splitn(4, ' ');
        let (Some(time), Some(stream), Some(tag)) = (it.next(), it.next(), it.next()) else {
            return Err(format!("malformed log line {l:?}"));
        };
        let content = it.next().unwrap_or("");
        if chrono::DateTime::parse_from_rfc3339(time).is_err() {
            return Err(format!("bad timestamp {time:?} in log line {l:?}"));
        }
        if stream != "stdout" && stream != "stderr" {
            return Err(format!("bad stream {stream:?} in log line {l:?}"));
        }
        if tag != "F" && tag != "P" {
            return Err(format!("bad tag {tag:?} in log line {l:?}"));
        }
        out.push(LogLine {
            time: time.into(),
            stream: stream.into(),
            tag: tag.into(),
            content: content.into(),
        });
    }
    Ok(out)
}

impl Ctx {
    pub(crate) fn new(c: CriClient, env: Arc<Env>, id: String) -> Ctx {
        Ctx {
            c,
            env,
            id,
            pulled: Default::default(),
            host_mounts: Default::default(),
        }
    }

    /// Removes this spec's pods, the images it pulled and host mounts it made.
    pub(crate) async fn cleanup(&self) {
        remove_pods(
            &self.c,
            HashMap::from([(SPEC_LABEL.to_string(), self.id.clone())]),
        )
        .await;
        let pulled = std::mem::take(&mut *self.pulled.lock().unwrap_or_else(|e| e.into_inner()));
        for img in pulled {
            remove_image(&self.c, &img).await;
        }
        let mounts =
            std::mem::take(&mut *self.host_mounts.lock().unwrap_or_else(|e| e.into_inner()));
        for m in mounts.iter().rev() {
            unmount(m);
        }
    }

    /// Remembers a host mount point to detach at cleanup.
    pub fn track_host_mount(&self, p: &Path) {
        self.host_mounts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(p.to_path_buf());
    }

    /// A fresh directory under the run's work directory.
    pub fn dir(&self, name: &str) -> Result<PathBuf, Stop> {
        let p = self.env.work.join(format!("{}-{name}", self.id));
        std::fs::create_dir_all(&p).map_err(|e| Stop::Fail(format!("mkdir {p:?}: {e}")))?;
        Ok(p)
    }

    pub fn labels(&self) -> HashMap<String, String> {
        HashMap::from([
            (RUN_LABEL.to_string(), self.env.run_id.clone()),
            (SPEC_LABEL.to_string(), self.id.clone()),
        ])
    }

    /// A pod config: labelled, logs under the work dir, a unique uid. No hostname, as
    /// upstream critest sends none (the runtime gives the node's).
    pub fn pod_config(&self, name: &str) -> cri::PodSandboxConfig {
        let log_dir = self.env.work.join(format!("{}-{name}-logs", self.id));
        let _ = std::fs::create_dir_all(&log_dir);
        cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name: format!("{name}-{}", self.id),
                uid: format!("uid-{name}-{}", self.id),
                namespace: "vessel-critest".into(),
                attempt: 0,
            }),
            log_directory: log_dir.display().to_string(),
            labels: self.labels(),
            annotations: HashMap::from([("vessel-critest/pod".to_string(), name.to_string())]),
            linux: Some(cri::LinuxPodSandboxConfig::default()),
            ..Default::default()
        }
    }

    /// Runs a pod named `name`, privileged or not (a privileged container needs a
    /// privileged pod).
    pub async fn run_pod_privileged(
        &self,
        name: &str,
        privileged: bool,
    ) -> Result<(String, cri::PodSandboxConfig), Stop> {
        let mut pcfg = self.pod_config(name);
        pcfg.linux
            .get_or_insert_with(Default::default)
            .security_context
            .get_or_insert_with(Default::default)
            .privileged = privileged;
        Ok((self.run_pod_with(&pcfg).await?, pcfg))
    }

    pub async fn run_pod_with(&self, cfg: &cri::PodSandboxConfig) -> Result<String, Stop> {
        self.c
            .run_pod(cfg, &self.env.runtime_handler)
            .await
            .map_err(|e| Stop::Fail(format!("RunPodSandbox: {:?}: {}", e.code(), e.message())))
    }
    /// Runs a pod with [`Ctx::pod_config`].
    pub async fn run_pod(&self, name: &str) -> Result<(String, cri::PodSandboxConfig), Stop> {
        let cfg = self.pod_config(name);
        let id = self.run_pod_with(&cfg).await?;
        Ok((id, cfg))
    }

    /// Pulls `image` (remembered for removal at cleanup unless it was already there).
    pub async fn pull(&self, image: &str) -> Result<String, Stop> {
        let had = !present_images(&self.c, &[image.to_string()])
            .await
            .is_empty();
        let mut c = self.c.clone();
        let r = c
            .images
            .pull_image(cri::PullImageRequest {
                image: spec(image),
                ..Default::default()
            })
            .await
            .map_err(|e| {
                Stop::Fail(format!(
                    "PullImage {image}: {:?}: {}",
                    e.code(),
                    e.message()
                ))
            })?;
        if !had {
            self.pulled
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(image.to_string());
        }
        Ok(r.into_inner().image_ref)
    }

    /// Pulls `image` unless the runtime has it (shared images stay for the whole run).
    pub async fn ensure_image(&self, image: &str) -> Result<(), Stop> {
        if present_images(&self.c, &[image.to_string()])
            .await
            .is_empty()
        {
            let mut c = self.c.clone();
            c.images
                .pull_image(cri::PullImageRequest {
                    image: spec(image),
                    ..Default::default()
                })
                .await
                .map_err(|e| {
                    Stop::Fail(format!(
                        "PullImage {image}: {:?}: {}",
                        e.code(),
                        e.message()
                    ))
                })?;
        }
        Ok(())
    }

    /// A busybox container running `sh -c script`, logging to `<name>.log`.
    pub fn ctr_config(&self, name: &str, script: &str) -> cri::ContainerConfig {
        cri::ContainerConfig {
            labels: self.labels(),
            annotations: HashMap::from([("vessel-critest/ctr".to_string(), name.to_string())]),
            linux: Some(cri::LinuxContainerConfig::default()),
            ..crate::client::sh_container(name, &self.env.images.busybox, script)
        }
    }
    /// The container's security context, created if absent.
    pub fn sec(cfg: &mut cri::ContainerConfig) -> &mut cri::LinuxContainerSecurityContext {
        cfg.linux
            .get_or_insert_with(Default::default)
            .security_context
            .get_or_insert_with(Default::default)
    }

    pub async fn create(
        &self,
        pod: &str,
        pcfg: &cri::PodSandboxConfig,
        cfg: cri::ContainerConfig,
    ) -> Result<String, Stop> {
        if let Some(img) = cfg.image.as_ref() {
            self.ensure_image(&img.image).await?;
        }
        self.c
            .create_container(pod, pcfg, cfg)
            .await
            .map_err(|e| Stop::Fail(format!("CreateContainer: {:?}: {}", e.code(), e.message())))
    }

    pub async fn start(&self, id: &str) -> Result<(), Stop> {
        self.c
            .start_container(id)
            .await
            .map_err(|e| Stop::Fail(format!("StartContainer: {:?}: {}", e.code(), e.message())))
    }
    /// Creates and starts `cfg`.
    pub async fn run_cfg(
        &self,
        pod: &str,
        pcfg: &cri::PodSandboxConfig,
        cfg: cri::ContainerConfig,
    ) -> Result<String, Stop> {
        let id = self.create(pod, pcfg, cfg).await?;
        self.start(&id).await?;
        Ok(id)
    }

    /// Creates and starts a busybox container running `script`.
    pub async fn run(
        &self,
        pod: &str,
        pcfg: &cri::PodSandboxConfig,
        name: &str,
        script: &str,
    ) -> Result<String, Stop> {
        self.run_cfg(pod, pcfg, self.ctr_config(name, script)).await
    }

    /// StopContainer with `timeout` seconds before the kill.
    pub async fn stop(&self, id: &str, timeout: i64) -> Result<(), Stop> {
        self.c
            .runtime
            .clone()
            .stop_container(cri::StopContainerRequest {
                container_id: id.into(),
                timeout,
            })
            .await?;
        Ok(())
    }

    /// ContainerStats of `id` (None where the runtime sends no stats).
    pub async fn stats(&self, id: &str) -> Result<Option<cri::ContainerStats>, Stop> {
        Ok(self
            .c
            .runtime
            .clone()
            .container_stats(cri::ContainerStatsRequest {
                container_id: id.into(),
            })
            .await?
            .into_inner()
            .stats)
    }

    pub async fn status(&self, id: &str) -> Result<cri::ContainerStatus, Stop> {
        Ok(self.c.container_status(id).await?)
    }
    pub async fn pod_status(&self, id: &str) -> Result<cri::PodSandboxStatus, Stop> {
        Ok(self.c.pod_status(id).await?)
    }
    /// Waits for the container to reach `state` within `limit`.
    pub async fn wait_state(
        &self,
        id: &str,
        state: cri::ContainerState,
        limit: Duration,
    ) -> Result<cri::ContainerStatus, Stop> {
        let start = Instant::now();
        loop {
            let s = self.status(id).await?;
            if s.state == state as i32 {
                return Ok(s);
            }
            check!(
                start.elapsed() < limit,
                "container did not become {} within {limit:?} (state {}, reason {:?}, exit {})",
                ctr_state(state as i32),
                ctr_state(s.state),
                s.reason,
                s.exit_code
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn wait_exit(&self, id: &str) -> Result<cri::ContainerStatus, Stop> {
        self.wait_state(
            id,
            cri::ContainerState::ContainerExited,
            Duration::from_secs(20),
        )
        .await
    }

    pub async fn exec(
        &self,
        id: &str,
        cmd: &[&str],
        timeout: i64,
    ) -> Result<cri::ExecSyncResponse, tonic::Status> {
        self.c.exec_sync(id, cmd, timeout).await
    }
    /// `sh -c script` in the container: (exit code, stdout, stderr).
    pub async fn sh(&self, id: &str, script: &str) -> Result<(i32, String, String), Stop> {
        let r = self
            .exec(id, &["sh", "-c", script], 20)
            .await
            .map_err(|e| {
                Stop::Fail(format!(
                    "ExecSync {script:?}: {:?}: {}",
                    e.code(),
                    e.message()
                ))
            })?;
        Ok((
            r.exit_code,
            String::from_utf8_lossy(&r.stdout).into_owned(),
            String::from_utf8_lossy(&r.stderr).into_owned(),
        ))
    }

    /// Like [`Ctx::sh`], failing the spec unless it exits 0; returns stdout trimmed.
    pub async fn sh_ok(&self, id: &str, script: &str) -> Result<String, Stop> {
        let (code, out, err) = self.sh(id, script).await?;
        check!(
            code == 0,
            "{script:?} exited {code}: stdout {:?} stderr {:?}",
            out.trim(),
            err.trim()
        );
        Ok(out.trim().to_string())
    }

    /// A running `sleep` container with `cfg`'s changes applied, in a fresh pod.
    pub async fn sleeper_with(
        &self,
        pod_name: &str,
        edit: impl FnOnce(&mut cri::ContainerConfig),
    ) -> Result<String, Stop> {
        let (pod, pcfg) = self.run_pod(pod_name).await?;
        let mut cfg = self.ctr_config("sleeper", "sleep 100000");
        edit(&mut cfg);
        self.run_cfg(&pod, &pcfg, cfg).await
    }

    /// The container's log file (the pod's log directory + the container's log path).
    pub fn log_path(&self, pcfg: &cri::PodSandboxConfig, name: &str) -> PathBuf {
        Path::new(&pcfg.log_directory).join(format!("{name}.log"))
    }

    /// Reads and parses a container's log.
    pub fn read_log(&self, path: &Path) -> Result<Vec<LogLine>, Stop> {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        parse_log(&text).map_err(Stop::Fail)
    }

    /// Waits until `f` holds for the log's lines.
    pub async fn wait_log(
        &self,
        path: &Path,
        what: &str,
        f: impl Fn(&[LogLine]) -> bool,
    ) -> Result<Vec<LogLine>, Stop> {
        let start = Instant::now();
        loop {
            let lines = self.read_log(path)?;
            if f(&lines) {
                return Ok(lines);
            }
            check!(
                start.elapsed() < Duration::from_secs(10),
                "{what}: not in {} within 10 s; it has {:?}",
                path.display(),
                lines.iter().map(|l| &l.content).collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Detaches a host mount (cleanup; errors ignored).
pub fn unmount(p: &Path) {
    if let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) {
        // SAFETY: umount2 with a valid NUL-terminated path; the result is ignored.
        unsafe {
            libc::umount2(c.as_ptr(), libc::MNT_DETACH);
        }
    }
}
