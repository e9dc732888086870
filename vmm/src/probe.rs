//! KVM usability probe: is `/dev/kvm` there, and does it run guest code at a useful speed?
//!
//! Nested or emulating hypervisors can expose a `/dev/kvm` that works but runs guest code
//! hundreds of times slower than the host (this project's development machine is one). The
//! probe runs a tiny calibration guest: a vCPU in 64-bit long mode with paging (the mode a
//! booted kernel runs in) executes a fixed dependency-chained arithmetic loop
//! (`imul; add; dec; jnz`) `n` times and then writes to an I/O port. The VMM times `KVM_RUN`
//! for `n = 1` (one entry/exit round trip) and for an `n` grown adaptively until the run takes
//! [`TARGET_RUN`] or the time budget runs out; the slope is the guest's nanoseconds per
//! iteration. The same instructions are then timed natively (inline assembly) and the ratio
//! guest/native decides:
//!
//! * **Absent**: no KVM device node.
//! * **Unusable**: the node can't be opened or a VM can't be built or run, or the guest loop runs
//!   more than [`UNUSABLE_RATIO`] times slower than natively. Hardware virtualisation runs such
//!   a loop at ~1x; even two levels of nesting with hardware assistance stay within a few x; an
//!   emulating KVM is 100x-1000x off. 20x leaves a wide margin on both sides.
//! * **Usable**: otherwise.
//!
//! The whole probe takes well under a second (budget [`ProbeOptions::budget`]), also on a
//! slow KVM, because each step's size is predicted from the previous one.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd};
use serde::{Deserialize, Serialize};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use crate::arch;

/// Guest/native slowdown above which KVM is called unusable.
pub const UNUSABLE_RATIO: f64 = 20.0;
/// How long the longest calibration run should take.
pub const TARGET_RUN: Duration = Duration::from_millis(40);

const MEM_SIZE: usize = 0x20_0000;
const CODE_ADDR: u64 = 0x1000;
const DONE_PORT: u16 = 0x10;
/// `1: imul eax,eax,3; add eax,ecx; dec rcx; jnz 1b; out 0x10,al; hlt` in 64-bit mode.
const LOOP_CODE: [u8; 13] = [
    0x6b, 0xc0, 0x03, // imul eax, eax, 3
    0x01, 0xc8, // add eax, ecx
    0x48, 0xff, 0xc9, // dec rcx
    0x75, 0xf6, // jnz -10
    0xe6, 0x10, // out 0x10, al
    0xf4, // hlt
];

/// The probe's conclusion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// No KVM device.
    Absent,
    /// KVM is there but can't run guests, or runs them far below native speed.
    Unusable,
    /// KVM runs guest code at about native speed.
    Usable,
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Verdict::Absent => "absent",
            Verdict::Unusable => "unusable",
            Verdict::Usable => "usable",
        })
    }
}

/// What the calibration guest measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Evidence {
    /// Nanoseconds per loop iteration in the guest (slope between the 1- and n-iteration runs).
    pub guest_ns_per_iter: f64,
    /// Nanoseconds per iteration of the same instructions on the host.
    pub native_ns_per_iter: f64,
    /// `guest_ns_per_iter / native_ns_per_iter`.
    pub ratio: f64,
    /// Iterations of the longest guest run.
    pub guest_iterations: u64,
    /// Time of one `KVM_RUN` entering the guest and exiting on its port write (n = 1), in ns.
    pub exit_round_trip_ns: f64,
    /// The ratio above which the verdict is unusable.
    pub threshold_ratio: f64,
}

/// Outcome of [`probe`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProbeResult {
    pub verdict: Verdict,
    /// One line a person can act on: why this verdict.
    pub reason: String,
    /// Measurements, when the calibration guest ran.
    pub evidence: Option<Evidence>,
    /// The device probed.
    pub device: PathBuf,
    /// Wall time the probe took, in milliseconds.
    pub probe_ms: f64,
}

/// Knobs for [`probe_with`].
#[derive(Debug, Clone)]
pub struct ProbeOptions {
    pub device: PathBuf,
    pub threshold_ratio: f64,
    /// Soft bound on the time spent in the guest; a guest that has not finished after twice
    /// this is stopped and KVM called unusable.
    pub budget: Duration,
}

impl Default for ProbeOptions {
    fn default() -> Self {
        ProbeOptions {
            device: PathBuf::from("/dev/kvm"),
            threshold_ratio: UNUSABLE_RATIO,
            budget: Duration::from_millis(600),
        }
    }
}

/// Probes `/dev/kvm` with the default options.
pub fn probe() -> ProbeResult {
    probe_with(&ProbeOptions::default())
}

/// Probes the KVM device in `opts`.
pub fn probe_with(opts: &ProbeOptions) -> ProbeResult {
    let start = Instant::now();
    let mut r = probe_inner(opts);
    r.probe_ms = start.elapsed().as_secs_f64() * 1e3;
    tracing::info!(verdict = %r.verdict, reason = %r.reason, "KVM probe");
    r
}

fn result(
    opts: &ProbeOptions,
    verdict: Verdict,
    reason: String,
    evidence: Option<Evidence>,
) -> ProbeResult {
    ProbeResult {
        verdict,
        reason,
        evidence,
        device: opts.device.clone(),
        probe_ms: 0.0,
    }
}

fn probe_inner(opts: &ProbeOptions) -> ProbeResult {
    let dev = &opts.device;
    if !dev.exists() {
        return result(
            opts,
            Verdict::Absent,
            format!("{} does not exist", dev.display()),
            None,
        );
    }
    let guest = match measure_guest(dev, opts.budget) {
        Ok(g) => g,
        Err(reason) => return result(opts, Verdict::Unusable, reason, None),
    };
    let native = native_ns_per_iter();
    let ratio = guest.ns_per_iter / native;
    let evidence = Evidence {
        guest_ns_per_iter: guest.ns_per_iter,
        native_ns_per_iter: native,
        ratio,
        guest_iterations: guest.iterations,
        exit_round_trip_ns: guest.round_trip_ns,
        threshold_ratio: opts.threshold_ratio,
    };
    if ratio > opts.threshold_ratio {
        result(
            opts,
            Verdict::Unusable,
            format!(
                "guest code runs {ratio:.0}x slower than native ({:.2} ns vs {:.2} ns per loop iteration; \
                 threshold {}x): an emulating or nested KVM",
                guest.ns_per_iter, native, opts.threshold_ratio
            ),
            Some(evidence),
        )
    } else {
        result(
            opts,
            Verdict::Usable,
            format!(
                "guest code runs at {ratio:.1}x native ({:.2} ns vs {:.2} ns per loop iteration; threshold {}x)",
                guest.ns_per_iter, native, opts.threshold_ratio
            ),
            Some(evidence),
        )
    }
}

struct GuestTiming {
    ns_per_iter: f64,
    iterations: u64,
    round_trip_ns: f64,
}

/// The calibration VM: 2 MiB of memory holding boot tables and the loop, one vCPU.
struct CalibrationVm {
    _kvm: Kvm,
    _vm: kvm_ioctls::VmFd,
    _mem: GuestMemoryMmap,
    vcpu: VcpuFd,
}

fn build_vm(dev: &Path) -> Result<CalibrationVm, String> {
    let path = CString::new(dev.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("bad device path {}", dev.display()))?;
    let kvm =
        Kvm::new_with_path(&path).map_err(|e| format!("cannot open {}: {e}", dev.display()))?;
    if kvm.get_api_version() != 12 {
        return Err(format!(
            "KVM API version {} (want 12)",
            kvm.get_api_version()
        ));
    }
    let vm = kvm.create_vm().map_err(|e| format!("KVM_CREATE_VM: {e}"))?;
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM_SIZE)])
        .map_err(|e| format!("guest memory: {e}"))?;
    arch::write_boot_tables(&mem).map_err(|e| e.to_string())?;
    mem.write_slice(&LOOP_CODE, GuestAddress(CODE_ADDR))
        .map_err(|e| format!("guest memory: {e}"))?;
    for (slot, region) in mem.iter().enumerate() {
        let host = mem
            .get_host_address(region.start_addr())
            .map_err(|e| format!("guest memory: {e}"))?;
        // One region, slot 0.
        #[allow(clippy::cast_possible_truncation)]
        let r = kvm_userspace_memory_region {
            slot: slot as u32,
            flags: 0,
            guest_phys_addr: region.start_addr().0,
            memory_size: region.len(),
            userspace_addr: host as u64,
        };
        // SAFETY: the region is a live mapping owned by `mem`, which the returned
        // CalibrationVm keeps alive as long as the VM fd.
        unsafe { vm.set_user_memory_region(r) }
            .map_err(|e| format!("KVM_SET_USER_MEMORY_REGION: {e}"))?;
    }
    let vcpu = vm
        .create_vcpu(0)
        .map_err(|e| format!("KVM_CREATE_VCPU: {e}"))?;
    let mut cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(|e| format!("KVM_GET_SUPPORTED_CPUID: {e}"))?;
    arch::normalize_cpuid(&mut cpuid, 0, 1);
    vcpu.set_cpuid2(&cpuid)
        .map_err(|e| format!("KVM_SET_CPUID2: {e}"))?;
    arch::setup_long_mode_vcpu(&vcpu, CODE_ADDR, 0x8000, 0).map_err(|e| e.to_string())?;
    Ok(CalibrationVm {
        _kvm: kvm,
        _vm: vm,
        _mem: mem,
        vcpu,
    })
}

/// Runs the loop `n` times in the guest; returns the time spent in `KVM_RUN`.
fn run_loop(vcpu: &mut VcpuFd, n: u64) -> Result<Duration, String> {
    let mut regs = arch::entry_regs(CODE_ADDR, 0x8000, 0);
    regs.rcx = n;
    vcpu.set_regs(&regs)
        .map_err(|e| format!("KVM_SET_REGS: {e}"))?;
    let mut spent = Duration::ZERO;
    loop {
        let t = Instant::now();
        let exit = vcpu.run();
        spent += t.elapsed();
        match exit {
            Ok(VcpuExit::IoOut(DONE_PORT, _)) => return Ok(spent),
            Ok(VcpuExit::Intr) => continue,
            Ok(other) => return Err(format!("calibration guest exited unexpectedly: {other:?}")),
            Err(e) if e.errno() == libc::EINTR => return Err("calibration guest timed out".into()),
            Err(e) if e.errno() == libc::EAGAIN => continue,
            Err(e) => return Err(format!("KVM_RUN: {e}")),
        }
    }
}

fn measure_guest(dev: &Path, budget: Duration) -> Result<GuestTiming, String> {
    let mut vm = build_vm(dev)?;
    crate::kick::install_kick_handler();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let (res_tx, res_rx) = mpsc::channel();
    let worker = std::thread::Builder::new()
        .name("kvm-probe".into())
        .spawn(move || {
            let r = calibrate(&mut vm.vcpu, budget);
            let _ = res_tx.send(r);
            let _ = done_rx.recv();
        })
        .map_err(|e| format!("spawning the probe vCPU thread: {e}"))?;
    let deadline = budget * 2 + Duration::from_millis(200);
    let r = match res_rx.recv_timeout(deadline) {
        Ok(r) => r,
        Err(_) => {
            use std::os::unix::thread::JoinHandleExt;
            // Kick the vCPU out of KVM_RUN; it then reports a timeout.
            crate::kick::kick_thread(worker.as_pthread_t());
            res_rx
                .recv_timeout(Duration::from_secs(2))
                .unwrap_or_else(|_| Err("calibration guest did not stop".into()))
                .and(Err(format!(
                    "calibration guest did not finish in {deadline:?}"
                )))
        }
    };
    drop(done_tx);
    let _ = worker.join();
    r
}

fn calibrate(vcpu: &mut VcpuFd, budget: Duration) -> Result<GuestTiming, String> {
    let start = Instant::now();
    // Warm up (first entry faults in pages), then take the best of a few single-iteration runs.
    run_loop(vcpu, 1)?;
    let mut t1 = Duration::MAX;
    for _ in 0..3 {
        t1 = t1.min(run_loop(vcpu, 1)?);
    }
    let mut n: u64 = 1024;
    loop {
        let t = run_loop(vcpu, n)?;
        let per_iter = t.saturating_sub(t1).as_secs_f64() / (n - 1) as f64;
        let left = budget.saturating_sub(start.elapsed());
        if t >= TARGET_RUN || left < t * 2 || n >= 1 << 34 {
            return Ok(GuestTiming {
                ns_per_iter: (per_iter * 1e9).max(1e-3),
                iterations: n,
                round_trip_ns: t1.as_secs_f64() * 1e9,
            });
        }
        // Aim the next run at TARGET_RUN, within what is left of the budget, at most 64x bigger.
        let want = TARGET_RUN.min(left / 2).as_secs_f64();
        let grow = if per_iter > 0.0 {
            want / (per_iter * n as f64)
        } else {
            64.0
        };
        // n <= 2^34 (see above) times at most 64 fits a u64; the fraction is dropped.
        #[allow(clippy::cast_possible_truncation)]
        let next = (n as f64 * grow.clamp(2.0, 64.0)) as u64;
        n = next.max(n * 2);
    }
}

/// The guest loop's instructions, run natively `n` times.
#[cfg(target_arch = "x86_64")]
fn native_loop(n: u64) {
    // SAFETY: the assembly only computes in eax/ecx (both declared clobbered/inout); it reads
    // and writes no memory and leaves the stack alone.
    unsafe {
        std::arch::asm!(
            "2:",
            "imul eax, eax, 3",
            "add eax, ecx",
            "dec rcx",
            "jnz 2b",
            inout("rcx") n.max(1) => _,
            inout("eax") 0u32 => _,
            options(nomem, nostack),
        );
    }
}

fn native_ns_per_iter() -> f64 {
    let mut n: u64 = 1 << 16;
    loop {
        let t = Instant::now();
        native_loop(n);
        let e = t.elapsed();
        if e >= Duration::from_millis(5) || n >= 1 << 34 {
            // Best of three at this size.
            let mut best = e;
            for _ in 0..2 {
                let t = Instant::now();
                native_loop(n);
                best = best.min(t.elapsed());
            }
            return (best.as_secs_f64() * 1e9 / n as f64).max(1e-3);
        }
        n *= 4;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_device_is_absent() {
        let r = probe_with(&ProbeOptions {
            device: "/nonexistent/kvm".into(),
            ..Default::default()
        });
        assert_eq!(r.verdict, Verdict::Absent);
        assert!(r.reason.contains("does not exist"), "{}", r.reason);
    }

    #[test]
    fn non_kvm_device_is_unusable() {
        let r = probe_with(&ProbeOptions {
            device: "/dev/null".into(),
            ..Default::default()
        });
        assert_eq!(r.verdict, Verdict::Unusable);
        assert!(r.evidence.is_none());
    }

    #[test]
    fn native_loop_timing_is_sane() {
        let ns = native_ns_per_iter();
        assert!(ns > 0.01 && ns < 100.0, "{ns}");
    }

    #[test]
    fn verdict_json_is_lowercase() {
        assert_eq!(
            serde_json::to_string(&Verdict::Unusable).unwrap(),
            "\"unusable\""
        );
    }
}
