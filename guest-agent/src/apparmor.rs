//! AppArmor policy for VM pods. The guest has no `apparmor_parser` and no profile files:
//! vesseld sends, with a container that names a profile, the policy the host's kernel
//! compiled for it (the profile's securityfs `raw_data`), and the agent loads it into the
//! guest kernel before the container is made. libcontainer then applies the profile by name
//! (`process.apparmorProfile`), as on a host.

use crate::error::AgentError;
use std::io::Write as _;
use std::path::Path;
use std::sync::Mutex;

const ENABLED: &str = "/sys/module/apparmor/parameters/enabled";
const SECURITYFS: &str = "/sys/kernel/security";
const REPLACE: &str = "/sys/kernel/security/apparmor/.replace";

/// Serializes the mount of securityfs and the policy writes.
static LOADING: Mutex<()> = Mutex::new(());

/// Loads (or replaces) the compiled `policy` in this kernel. Loading the same policy again
/// replaces its profiles with themselves, so it is done for every container that asks.
pub fn load(policy: &[u8]) -> Result<(), AgentError> {
    let _guard = LOADING.lock().unwrap_or_else(|p| p.into_inner());
    let enabled = std::fs::read_to_string(ENABLED).is_ok_and(|s| s.starts_with('Y'));
    if !enabled {
        return Err(AgentError::FailedPrecondition(
            "AppArmor is not enabled in this pod's guest kernel, so no profile can confine its containers"
                .into(),
        ));
    }
    if !Path::new(REPLACE).exists() {
        nix::mount::mount(
            Some("securityfs"),
            SECURITYFS,
            Some("securityfs"),
            nix::mount::MsFlags::MS_NOSUID
                | nix::mount::MsFlags::MS_NODEV
                | nix::mount::MsFlags::MS_NOEXEC,
            None::<&str>,
        )
        .map_err(|e| AgentError::internal(format!("mounting securityfs on {SECURITYFS}"), e))?;
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(REPLACE)
        .map_err(|e| AgentError::internal(format!("opening {REPLACE}"), e))?;
    // The kernel takes a policy in one write, from offset 0.
    match f.write(policy) {
        Ok(n) if n == policy.len() => {
            tracing::info!(bytes = policy.len(), "AppArmor policy loaded");
            Ok(())
        }
        Ok(n) => Err(AgentError::internal(
            "loading AppArmor policy",
            format!("the kernel took {n} of {} bytes", policy.len()),
        )),
        Err(e) => Err(AgentError::FailedPrecondition(format!(
            "loading the host's AppArmor policy ({} bytes) into the pod's guest kernel: {e} \
             (the guest kernel refuses it: a host kernel's policy format it does not know?)",
            policy.len()
        ))),
    }
}
