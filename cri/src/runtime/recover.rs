//! Recovery at start: rebuilds memory from the records, reconnects to live pod agents, marks
//! pods whose host process died NotReady, finishes or undoes half-done work, and removes
//! debris (snapshots, netns pins, CNI attachments, backend leftovers) that no record owns.

use super::{Ctr, Runtime};
use crate::errors::agent_err;
use crate::sandbox::{held, netns, process};
use crate::state::{self, BackendState, ContainerState, PodRecord, PodState, VmPodState};
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use vessel_agent::proto as ap;
use vessel_cri_api::v1 as cri;

impl Runtime {
    /// Rebuilds memory from records after a (re)start: reconnects to live pod agents, marks
    /// pods whose agent died NotReady, finishes or undoes half-done work, and removes debris.
    pub(super) async fn recover(self: &Arc<Self>) {
        for dir in self.dirs.orphan_pod_dirs() {
            tracing::info!(dir = %dir.display(), "removing pod dir without record");
            let _ = vessel_images::fsutil::remove_any(&dir);
        }
        let records = self.dirs.load_pods();
        // What belongs to a record that could not be read is kept (its pod may still run).
        let unreadable = self.dirs.quarantined();
        let mut kept: HashSet<String> = unreadable
            .iter()
            .filter_map(|p| state::quarantined_id(p))
            .collect();
        if !kept.is_empty() {
            tracing::error!(ids = ?kept, "records quarantined; their data is kept and their pods are not managed (see Status)");
        }
        for b in [&self.backends.flat, &self.backends.vm] {
            b.sweep_orphans(&records, &kept).await;
        }
        self.opts.cgroups.sweep(&records, &kept).await;
        let mut agent_lists: HashMap<String, Listed> = HashMap::new();
        let (mut died, mut ready) = (Vec::new(), Vec::new());
        for rec in records {
            if rec.state == PodState::Creating {
                tracing::info!(pod = %rec.id, "cleaning up pod interrupted while being created");
                // A failed DEL keeps its cache entry: the sweep below, or the next start's.
                let _ = self.teardown_pod_resources(&rec).await;
                let _ = self.dirs.delete_pod(&rec.id);
                continue;
            }
            let pod = self.pod_object(rec.clone());
            self.relist(&self.pods, &rec.name_key, &rec.id, pod.clone());
            if rec.state == PodState::Ready {
                // The pid with its start time names the pod's own host process: while it
                // lives, the pod does. One that does not answer in time (a loaded node, a
                // VM guest slow to schedule its agent) is not killed for it: its pod stays
                // ready, and the watchers reconnect when they need to. One that refuses at
                // once (its socket is gone) can never serve: it goes as a dead one does.
                let host = self.backend(&rec).host_process();
                let gone = if !process::is_alive(rec.agent_pid, rec.agent_start_time) {
                    Some(format!("{host} exited while vesseld was down"))
                } else {
                    let answered = tokio::time::timeout(Duration::from_secs(5), async {
                        let mut c = pod.client().await?;
                        c.ping(ap::PingRequest {})
                            .await
                            .map_err(|s| agent_err("ping", s))
                    })
                    .await;
                    match answered {
                        Ok(Ok(_)) => None,
                        Ok(Err(e)) => Some(format!("{host} does not answer: {e}")),
                        Err(_) => {
                            tracing::warn!(pod = %rec.id, pid = rec.agent_pid, "pod agent alive but no answer in 5 s; the pod stays ready");
                            pod.set_client(None).await;
                            // Not asked again for its containers (that would wait once more).
                            agent_lists.insert(
                                rec.id.clone(),
                                Listed::Unanswered("no answer to a ping in 5 s".into()),
                            );
                            None
                        }
                    }
                };
                if let Some(why) = gone {
                    tracing::warn!(pod = %rec.id, reason = %why, "pod agent is gone; pod is not ready");
                    pod.set_client(None).await;
                    // A failed CNI DEL is asked again by kubelet's StopPodSandbox.
                    let _ = self.teardown_pod_resources(&rec).await;
                    let r = pod.update(|r| {
                        r.state = PodState::NotReady;
                        r.stopping = false;
                        r.reason = why;
                    });
                    let _ = self.dirs.save_pod(&r);
                    // Its containers' leftovers go once they are read back, below.
                    died.push(pod.clone());
                } else {
                    // Watched once its containers are known (below).
                    ready.push(pod.clone());
                }
            } else {
                // Not ready: make sure nothing of it runs or stays mounted.
                let _ = self.teardown_pod_resources(&rec).await;
            }
        }
        // Pods whose record could not be read: listed NotReady (placeholders, written back only
        // if they change), so that kubelet's or an operator's RemovePodSandbox can clean up
        // what is left of them. Nothing of theirs is torn down before that.
        for p in &unreadable {
            let Some(id) = state::quarantined_pod_id(p) else {
                continue;
            };
            if self.pod(&id).is_ok() {
                continue;
            }
            let rec = self.unreadable_pod(&id, p);
            tracing::warn!(pod = %id, record = %p.display(), "pod with an unreadable record listed as not ready; RemovePodSandbox cleans it up");
            let (key, pod) = (rec.name_key.clone(), self.pod_object(rec));
            self.relist(&self.pods, &key, &id, pod);
        }
        for rec in self.dirs.load_containers() {
            if held(&kept, &rec.pod_id) {
                tracing::warn!(container = %rec.id, pod = %rec.pod_id, "container of a pod whose record is quarantined: kept, not managed");
                kept.insert(rec.id.clone());
                continue;
            }
            let Ok(pod) = self.pod(&rec.pod_id) else {
                tracing::info!(container = %rec.id, "removing container of a pod that no longer exists");
                self.discard_snapshots(rec.snapshots());
                let _ = self.dirs.delete_container(&rec.id);
                continue;
            };
            let pod_ready = pod.record().state == PodState::Ready;
            if !agent_lists.contains_key(&rec.pod_id) {
                let list = if pod_ready {
                    list_agent(&pod).await
                } else {
                    Listed::Gone
                };
                if let Listed::Unanswered(why) = &list {
                    tracing::warn!(pod = %rec.pod_id, error = %why, "pod agent did not list its containers; they keep their recorded state and are watched");
                }
                agent_lists.insert(rec.pod_id.clone(), list);
            }
            let listed = &agent_lists[&rec.pod_id];
            if rec.state == ContainerState::Creating {
                tracing::info!(container = %rec.id, "cleaning up container interrupted while being created");
                if pod_ready {
                    if let Ok(mut c) = pod.client().await {
                        // Bounded, as the list: a wedged agent must not hold up the start.
                        let _ = tokio::time::timeout(
                            Duration::from_secs(10),
                            c.delete_container(ap::DeleteContainerRequest { id: rec.id.clone() }),
                        )
                        .await;
                    }
                }
                // What the backend holds for it: a VM pod's volume mounts for the guest,
                // its log, a flat container's cgroup.
                self.backend(&pod.record())
                    .release_container(&pod, &rec)
                    .await;
                self.discard_snapshots(rec.snapshots());
                let _ = self.dirs.delete_container(&rec.id);
                continue;
            }
            let ctr = Arc::new(Ctr::new(rec.clone()));
            self.relist(&self.ctrs, &rec.name_key, &rec.id, ctr.clone());
            // Done with; or never started in a pod that is stopped: it stays Created, as the
            // stop left it.
            if rec.state == ContainerState::Exited
                || (rec.state == ContainerState::Created && !pod_ready)
            {
                continue;
            }
            let known = match listed {
                Listed::Gone => {
                    self.mark_lost(&ctr, "the pod agent is gone");
                    continue;
                }
                // Still running as far as anyone knows (the agent lives): its watcher asks
                // the agent until it answers with the exit, or the agent dies. One that was
                // created stays so: its start asks the agent.
                Listed::Unanswered(_) => {
                    if rec.state == ContainerState::Running {
                        self.spawn_watcher(pod.clone(), ctr.clone(), None);
                    }
                    continue;
                }
                Listed::Known(m) => m.get(&rec.id),
            };
            match known {
                None => self.mark_lost(&ctr, "the pod agent no longer knows this container"),
                Some(info) => {
                    if let Some(exit) = &info.exit {
                        if info.state == ap::ContainerState::Exited as i32 {
                            let r = self.record_exit(&ctr, exit);
                            tracing::info!(container = %rec.id, exit_code = r.exit_code, "container exited while vesseld was down");
                            continue;
                        }
                    }
                    if info.state == ap::ContainerState::Running as i32 {
                        ctr.update(|r| {
                            r.state = ContainerState::Running;
                            r.pid = info.pid;
                            if r.started_at == 0 {
                                r.started_at = info.started_at;
                            }
                        });
                        let _ = ctr.persist(&self.dirs);
                        self.spawn_watcher(pod.clone(), ctr.clone(), pod.client().await.ok());
                    }
                }
            }
        }
        // Pods are watched once their containers are known, so that a death ends them all.
        // One whose host process died meanwhile (a container's watcher saw it, before all of
        // them were read back) is ended here.
        for pod in ready {
            let r = pod.record();
            if r.state == PodState::Ready {
                self.spawn_pod_watcher(pod);
            } else {
                self.pod_ended(&r.id, &r.reason);
                died.push(pod);
            }
        }
        for pod in died {
            self.release_orphans(&pod).await;
        }
        // Container records quarantined just now, while loading them.
        let quarantined = self.dirs.quarantined();
        kept.extend(quarantined.iter().filter_map(|p| state::quarantined_id(p)));
        *self.quarantined.lock().unwrap_or_else(|p| p.into_inner()) = quarantined;
        // CNI attachments without a pod: DEL them (their netns may be gone; DEL still frees
        // the IP). A pod whose record is quarantined may still run: its network stays.
        for id in self.opts.cni.cached_ids() {
            if self.pod(&id).is_err() && !held(&kept, &id) {
                if let Some(a) = self.opts.cni.cached(&id) {
                    tracing::info!(pod = %id, "detaching CNI attachment without a pod");
                    match self.opts.cni.del(&a).await {
                        Ok(()) => self.opts.cni.forget(&id),
                        // Kept: the next start asks again (its IP stays taken till then).
                        Err(e) => {
                            tracing::warn!(pod = %id, error = %e, "CNI DEL failed; kept to try again at the next start")
                        }
                    }
                } else {
                    // Unreadable: nothing to DEL with.
                    self.opts.cni.forget(&id);
                }
            }
        }
        // Snapshots without a container, and netns pins without a pod.
        let live: std::collections::HashSet<String> = self
            .ctrs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .flat_map(|c| c.record().snapshots().cloned().collect::<Vec<_>>())
            .collect();
        for s in self.store.list_snapshots().unwrap_or_default() {
            if !live.contains(&s) && !held(&kept, &s) {
                tracing::info!(snapshot = %s, "removing snapshot without container");
                let _ = self.store.remove_snapshot(&s);
            }
        }
        if let Ok(rd) = std::fs::read_dir(self.dirs.netns_dir()) {
            let pods = self.pods.lock().unwrap_or_else(|p| p.into_inner()).clone();
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                let keep = held(&kept, &name)
                    || pods
                        .get(&name)
                        .is_some_and(|p| p.record().state == PodState::Ready);
                if !keep {
                    let _ = netns::unpin(&e.path());
                }
            }
        }
        // Stops a restart interrupted: finished in the background (the daemon serves
        // meanwhile; the pods read as not ready, and a StopPodSandbox waits for this one).
        let stopping: Vec<String> = self
            .pods
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|p| p.record())
            .filter(|r| r.stopping && r.state == PodState::Ready)
            .map(|r| r.id)
            .collect();
        for id in stopping {
            tracing::info!(pod = %id, "finishing a StopPodSandbox a restart interrupted");
            let rt = self.clone();
            tokio::spawn(async move {
                if let Err(e) = rt.stop_pod_sandbox(&id).await {
                    tracing::warn!(pod = %id, error = %e, "finishing an interrupted stop failed");
                }
            });
        }
        let (np, nc) = (
            self.pods.lock().unwrap_or_else(|p| p.into_inner()).len(),
            self.ctrs.lock().unwrap_or_else(|p| p.into_inner()).len(),
        );
        tracing::info!(pods = np, containers = nc, "state recovered");
    }

    /// Lists a recovered pod or container in `objects` (the runtime's pods or containers) by
    /// its id, with its name reserved for it.
    fn relist<T>(
        &self,
        objects: &Mutex<HashMap<String, Arc<T>>>,
        name_key: &str,
        id: &str,
        object: Arc<T>,
    ) {
        self.names
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name_key.to_string(), id.to_string());
        objects
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.to_string(), object);
    }

    /// A stand-in record for pod `id`, whose record at `path` could not be read: what vesseld
    /// derives from the pod's id and directories (backend, agent socket, netns pin, default
    /// cgroup), not ready, named `unreadable-<id>`, so that RemovePodSandbox can stop what is
    /// left of it and remove it.
    fn unreadable_pod(&self, id: &str, path: &Path) -> PodRecord {
        let vm_dir = self.dirs.vm_dir(id);
        let (backend, agent_socket) = if vm_dir.is_dir() {
            let p = crate::sandbox::vm::VmPaths::new(&vm_dir);
            let vm = VmPodState {
                dir: vm_dir.clone(),
                vsock: p.vsock.clone(),
                control: p.control,
                ..VmPodState::default()
            };
            (BackendState::Vm { vm }, p.vsock)
        } else {
            (BackendState::Flat {}, self.dirs.agent_socket(id))
        };
        let short = id.get(..12).unwrap_or(id);
        PodRecord {
            id: id.to_string(),
            name_key: format!("{}{id}", state::UNREADABLE_POD_KEY),
            config: cri::PodSandboxConfig {
                metadata: Some(cri::PodSandboxMetadata {
                    name: format!("unreadable-{short}"),
                    uid: id.to_string(),
                    namespace: "vessel-unreadable".into(),
                    attempt: 0,
                }),
                labels: HashMap::from([(state::UNREADABLE_LABEL.to_string(), "true".to_string())]),
                ..Default::default()
            },
            runtime_handler: String::new(),
            backend,
            state: PodState::NotReady,
            // Never 0: kubelet's CRI client takes a status created at 0 for an invalid one,
            // and its PLEG would stumble on the pod at every relist until it is removed.
            created_at: std::fs::metadata(path)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .and_then(|d| i64::try_from(d.as_nanos()).ok())
                .filter(|n| *n > 0)
                .unwrap_or_else(state::now_nanos),
            agent_pid: 0,
            agent_start_time: 0,
            agent_socket,
            agent_state_dir: self.dirs.pod_run_dir(id).join("agent"),
            netns_path: self.dirs.netns_dir().join(id),
            hostname: String::new(),
            cgroup_parent: format!("/vessel/{id}"),
            // Its unit, if the driver makes them, is named after it: stopped with it.
            cgroup_unit: self.opts.cgroups.pod_unit(id),
            reason: format!(
                "its record could not be read (kept at {}); RemovePodSandbox stops what is left of it and removes it",
                path.display()
            ),
            ips: Vec::new(),
            stopping: false,
            shared_shm: false,
            pid_holder: false,
        }
    }
}

/// What a pod's agent said of its containers at recovery.
enum Listed {
    /// The pod is not ready: its host process, and its containers, are gone.
    Gone,
    /// The agent lives but did not answer (why): its containers' records stand.
    Unanswered(String),
    Known(HashMap<String, ap::ContainerInfo>),
}

/// Asks a ready pod's agent for its containers, bounded: a wedged agent must not hold up
/// the daemon's start.
async fn list_agent(pod: &crate::sandbox::Pod) -> Listed {
    let mut c = match pod.client().await {
        Ok(c) => c,
        Err(e) => return Listed::Unanswered(e.to_string()),
    };
    match tokio::time::timeout(
        Duration::from_secs(10),
        c.list_containers(ap::ListContainersRequest {}),
    )
    .await
    {
        Ok(Ok(r)) => Listed::Known(
            r.into_inner()
                .containers
                .into_iter()
                .map(|i| (i.id.clone(), i))
                .collect(),
        ),
        Ok(Err(s)) => Listed::Unanswered(s.to_string()),
        Err(_) => Listed::Unanswered("no answer in 10 s".into()),
    }
}
