//! AppArmor: the profile a container asks for (CRI `apparmor`, else the deprecated
//! `apparmor_profile` string), checked against where the container runs.
//!
//! - On a host with AppArmor enabled, a Localhost profile must be loaded and is applied by
//!   name; RuntimeDefault applies vessel's default profile, `vessel-default`, loaded with
//!   `apparmor_parser` the first time it is needed; Unconfined applies none.
//! - A VM pod's containers run on its guest kernel, which has AppArmor and no parser: they
//!   can have what the host has. The policy the host's kernel compiled for the profile
//!   ([`host_policy`], securityfs `raw_data`) goes to the agent, which loads it into the guest
//!   kernel before it makes the container.
//! - Nothing asked is RuntimeDefault, as with containerd and CRI-O, but for privileged
//!   containers and where the default cannot be loaded (no `apparmor_parser`; a VM pod
//!   where the host's kernel does not give compiled policies): then unconfined, logged once.
//! - On a host without AppArmor, RuntimeDefault and Unconfined are accepted and there is
//!   nothing to apply, while a Localhost profile is refused, naming it, as containerd and
//!   CRI-O do.

use super::{invalid, SpecError};
use std::collections::HashSet;
use std::path::Path;
use vessel_cri_api::v1 as cri;

/// The profile RuntimeDefault applies.
pub const DEFAULT_PROFILE: &str = "vessel-default";

/// vessel's default profile: everything a container normally does, without the kernel
/// interfaces that reach beyond it (mounting, kernel tunables, raw memory, firmware, the
/// security filesystem), and ptrace and signals only among processes under the same profile
/// (signals from unconfined processes too: the agent's stops, a node's admin), as
/// containerd's default profile has them: a root container in the host's pid namespace may
/// not signal the node's daemons.
const DEFAULT_PROFILE_TEXT: &str = r#"abi <abi/3.0>,
include <tunables/global>

profile vessel-default flags=(attach_disconnected,mediate_deleted) {
  include <abstractions/base>

  network,
  capability,
  file,
  umount,
  signal (receive) peer=unconfined,
  signal (send,receive) peer=vessel-default,
  ptrace (read, readby, trace, tracedby) peer=vessel-default,

  deny mount,
  deny pivot_root,
  deny @{PROC}/sys/** wklx,
  deny @{PROC}/sysrq-trigger rwklx,
  deny @{PROC}/kcore rwklx,
  deny @{PROC}/kmem rwklx,
  deny @{PROC}/mem rwklx,
  deny /sys/firmware/** rwklx,
  deny /sys/kernel/security/** rwklx,
  deny /sys/kernel/debug/** rwklx,
}
"#;

/// What the container asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wanted {
    /// Nothing asked (no field, no string, or no security context): RuntimeDefault where it
    /// can be had, as containerd and CRI-O apply their default then (kubernetes#51746), and
    /// unconfined where the default cannot be loaded (logged), as before vessel had it.
    Unset,
    RuntimeDefault,
    Unconfined,
    Localhost(String),
}

/// The container's AppArmor request.
pub fn wanted(sc: Option<&cri::LinuxContainerSecurityContext>) -> Result<Wanted, SpecError> {
    use cri::security_profile::ProfileType;
    let Some(sc) = sc else {
        return Ok(Wanted::Unset);
    };
    if let Some(p) = &sc.apparmor {
        return Ok(
            match ProfileType::try_from(p.profile_type).unwrap_or(ProfileType::Unconfined) {
                ProfileType::RuntimeDefault => Wanted::RuntimeDefault,
                ProfileType::Unconfined => Wanted::Unconfined,
                ProfileType::Localhost => {
                    let name = p.localhost_ref.trim();
                    let name = name.strip_prefix("localhost/").unwrap_or(name);
                    if name.is_empty() {
                        return Err(invalid("AppArmor Localhost profile without a name"));
                    }
                    Wanted::Localhost(name.to_string())
                }
            },
        );
    }
    // The deprecated field is still what older kubelets send.
    #[allow(deprecated)]
    let old = sc.apparmor_profile.trim();
    Ok(match old {
        "" => Wanted::Unset,
        "runtime/default" => Wanted::RuntimeDefault,
        "unconfined" => Wanted::Unconfined,
        _ => match old.strip_prefix("localhost/") {
            Some(n) if !n.is_empty() => Wanted::Localhost(n.to_string()),
            _ => {
                return Err(invalid(format!(
                "AppArmor profile {old:?} is not runtime/default, unconfined or localhost/<name>"
            )))
            }
        },
    })
}

/// The loaded profiles, where AppArmor confines processes on this host; `None` where it
/// does not.
pub fn host_profiles() -> Option<HashSet<String>> {
    let enabled = std::fs::read_to_string("/sys/module/apparmor/parameters/enabled")
        .is_ok_and(|s| s.trim() == "Y");
    if !enabled {
        return None;
    }
    let text = std::fs::read_to_string("/sys/kernel/security/apparmor/profiles").ok()?;
    Some(
        text.lines()
            .filter_map(|l| l.rsplit_once(" (").map(|(n, _)| n.to_string()))
            .collect(),
    )
}

/// Where the host's kernel shows its loaded profiles.
const PROFILES_DIR: &str = "/sys/kernel/security/apparmor/policy/profiles";

/// The compiled policy that holds the loaded profile `name`: what `apparmor_parser` handed the
/// host's kernel for it (with the other profiles of the same load), as the kernel keeps it
/// (securityfs `policy/profiles/<profile>/raw_data`, kernels built with
/// `CONFIG_SECURITY_APPARMOR_EXPORT_BINARY`, Debian's and Ubuntu's among them).
pub fn host_policy(name: &str) -> Result<Vec<u8>, String> {
    host_policy_in(Path::new(PROFILES_DIR), name)
}

fn host_policy_in(dir: &Path, name: &str) -> Result<Vec<u8>, String> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| format!("AppArmor profile {name:?}: reading {}: {e}", dir.display()))?;
    for entry in entries.flatten() {
        let p = entry.path();
        // Names are mangled in directory names: the `name` file has the real one.
        if std::fs::read_to_string(p.join("name")).is_ok_and(|n| n.trim_end() == name) {
            return std::fs::read(p.join("raw_data")).map_err(|e| {
                format!(
                    "AppArmor profile {name:?}: the host's kernel does not give its compiled policy ({}: {e}; \
                     it needs CONFIG_SECURITY_APPARMOR_EXPORT_BINARY and apparmor.export_binary=1), so a VM pod cannot load it",
                    p.join("raw_data").display()
                )
            });
        }
    }
    Err(format!(
        "AppArmor profile {name:?} is not loaded on this host (apparmor_parser -r <file> loads it)"
    ))
}

/// The OCI `process.apparmorProfile` for `wanted`, where `loaded` is what the container's
/// kernel has (`None`: no AppArmor there). For [`Wanted::Unset`], the default only where
/// `loaded` has it (the caller loads it first, and leaves it out where that failed).
pub fn profile(
    wanted: &Wanted,
    privileged: bool,
    loaded: Option<&HashSet<String>>,
) -> Result<Option<String>, SpecError> {
    match (wanted, loaded) {
        (Wanted::Unconfined, _) | (Wanted::RuntimeDefault | Wanted::Unset, None) => Ok(None),
        (Wanted::Localhost(name), None) => Err(invalid(format!(
            "AppArmor profile localhost/{name}: AppArmor is not enabled where this container runs (it cannot be confined by it)"
        ))),
        (Wanted::RuntimeDefault | Wanted::Unset, Some(_)) if privileged => Ok(None),
        (Wanted::RuntimeDefault, Some(_)) => Ok(Some(DEFAULT_PROFILE.to_string())),
        (Wanted::Unset, Some(l)) => Ok(l.contains(DEFAULT_PROFILE).then(|| DEFAULT_PROFILE.into())),
        (Wanted::Localhost(name), Some(l)) if l.contains(name) => Ok(Some(name.clone())),
        (Wanted::Localhost(name), Some(_)) => Err(invalid(format!(
            "AppArmor profile {name:?} is not loaded on this host (apparmor_parser -r <file> loads it)"
        ))),
    }
}

/// Loads [`DEFAULT_PROFILE`] with `apparmor_parser` unless `loaded` has it.
pub fn ensure_default(loaded: &HashSet<String>) -> Result<(), String> {
    if loaded.contains(DEFAULT_PROFILE) {
        return Ok(());
    }
    use std::io::Write as _;
    let mut child = std::process::Command::new("apparmor_parser")
        .args(["--replace", "--"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| {
            format!("loading the AppArmor profile {DEFAULT_PROFILE}: apparmor_parser: {e} (apt-get install apparmor)")
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(DEFAULT_PROFILE_TEXT.as_bytes())
            .map_err(|e| format!("loading the AppArmor profile {DEFAULT_PROFILE}: {e}"))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("loading the AppArmor profile {DEFAULT_PROFILE}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "loading the AppArmor profile {DEFAULT_PROFILE}: apparmor_parser: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    tracing::info!(profile = DEFAULT_PROFILE, "AppArmor profile loaded");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(deprecated)]
    fn sc(field: Option<(i32, &str)>, old: &str) -> cri::LinuxContainerSecurityContext {
        cri::LinuxContainerSecurityContext {
            apparmor: field.map(|(t, r)| cri::SecurityProfile {
                profile_type: t,
                localhost_ref: r.into(),
            }),
            apparmor_profile: old.into(),
            ..Default::default()
        }
    }

    /// The default profile compiles (where there is a parser to compile it, loaded or not)
    /// and lets signals only in from outside the profile, not out of it.
    #[test]
    fn the_default_profile_compiles_and_confines_signals() {
        assert!(DEFAULT_PROFILE_TEXT.contains("signal (receive) peer=unconfined,"));
        assert!(!DEFAULT_PROFILE_TEXT.contains("  signal,"));
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("vessel-default");
        std::fs::write(&p, DEFAULT_PROFILE_TEXT).unwrap();
        match std::process::Command::new("apparmor_parser")
            .args(["-Q", "-S"])
            .arg(&p)
            .output()
        {
            Ok(o) => assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr)),
            Err(e) => println!("SKIP compiling the default profile: apparmor_parser: {e}"),
        }
    }

    #[test]
    fn requests_read_from_both_fields() {
        use cri::security_profile::ProfileType as P;
        let w = |s| wanted(Some(&s)).unwrap();
        assert_eq!(w(sc(None, "")), Wanted::Unset);
        assert_eq!(wanted(None).unwrap(), Wanted::Unset);
        assert_eq!(w(sc(None, "runtime/default")), Wanted::RuntimeDefault);
        assert_eq!(w(sc(None, "localhost/p")), Wanted::Localhost("p".into()));
        assert_eq!(
            w(sc(Some((P::Localhost as i32, "localhost/q")), "unconfined")),
            Wanted::Localhost("q".into()),
            "the field wins over the deprecated string"
        );
        assert_eq!(
            w(sc(Some((P::Unconfined as i32, "")), "")),
            Wanted::Unconfined
        );
        assert!(wanted(Some(&sc(None, "bogus"))).is_err());
        assert!(wanted(Some(&sc(Some((P::Localhost as i32, "")), ""))).is_err());
    }

    #[test]
    fn a_profiles_compiled_policy_is_found_by_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let profile = |dirname: &str, name: &str, raw: Option<&[u8]>| {
            let p = dir.path().join(dirname);
            std::fs::create_dir(&p).unwrap();
            std::fs::write(p.join("name"), format!("{name}\n")).unwrap();
            if let Some(raw) = raw {
                std::fs::write(p.join("raw_data"), raw).unwrap();
            }
        };
        profile(
            "cri-validate-apparmor-test-deny-write.3",
            "cri-validate-apparmor-test-deny-write",
            Some(b"policy A"),
        );
        // Mangled: the directory name is not the profile's name.
        profile("usr.bin.man.1", "/usr/bin/man", Some(b"policy B"));
        profile("no-export.2", "no-export", None);
        assert_eq!(
            host_policy_in(dir.path(), "cri-validate-apparmor-test-deny-write").unwrap(),
            b"policy A"
        );
        assert_eq!(
            host_policy_in(dir.path(), "/usr/bin/man").unwrap(),
            b"policy B"
        );
        let e = host_policy_in(dir.path(), "absent").unwrap_err();
        assert!(e.contains("\"absent\" is not loaded"), "{e}");
        let e = host_policy_in(dir.path(), "no-export").unwrap_err();
        assert!(e.contains("EXPORT_BINARY"), "{e}");
    }

    #[test]
    fn applied_where_apparmor_runs_refused_where_localhost_cannot_be() {
        let l = |p: &str| Wanted::Localhost(p.into());
        // No AppArmor where the container runs.
        assert_eq!(profile(&Wanted::RuntimeDefault, false, None).unwrap(), None);
        assert_eq!(profile(&Wanted::Unconfined, false, None).unwrap(), None);
        let e = profile(&l("deny-write"), false, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("localhost/deny-write"), "{e}");
        // AppArmor there.
        let loaded: HashSet<String> = ["deny-write".to_string()].into();
        assert_eq!(
            profile(&l("deny-write"), false, Some(&loaded))
                .unwrap()
                .as_deref(),
            Some("deny-write")
        );
        assert!(profile(&l("other"), false, Some(&loaded)).is_err());
        assert_eq!(
            profile(&Wanted::RuntimeDefault, false, Some(&loaded))
                .unwrap()
                .as_deref(),
            Some(DEFAULT_PROFILE)
        );
        assert_eq!(
            profile(&Wanted::RuntimeDefault, true, Some(&loaded)).unwrap(),
            None
        );
        // Nothing asked: the default where it is loaded, and never for privileged.
        assert_eq!(profile(&Wanted::Unset, false, None).unwrap(), None);
        assert_eq!(profile(&Wanted::Unset, false, Some(&loaded)).unwrap(), None);
        let with_default: HashSet<String> = [DEFAULT_PROFILE.to_string()].into();
        assert_eq!(
            profile(&Wanted::Unset, false, Some(&with_default))
                .unwrap()
                .as_deref(),
            Some(DEFAULT_PROFILE)
        );
        assert_eq!(
            profile(&Wanted::Unset, true, Some(&with_default)).unwrap(),
            None
        );
    }
}
