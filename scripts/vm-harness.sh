#!/usr/bin/env bash
# The nested VM test harness. This machine's /dev/kvm is too slow to boot a kernel, but QEMU's
# software emulation (TCG) offers AMD SVM with nested paging to its guest: we boot a Debian
# cloud kernel there (L1), load kvm_amd, and run vessel-shim in L1 to boot our guest (L2).
#
#   scripts/vm-harness.sh [test]              build what is needed, run the VM test suite in L1
#   scripts/vm-harness.sh run [--add SRC:DEST]... -- CMD [ARG]...
#                                             run CMD in L1 (with the same files, plus extras)
#   scripts/vm-harness.sh direct              run the suite on this host's KVM (real hardware)
#   scripts/vm-harness.sh bench [RUNS]        boot/vsock/memory benchmark in L1: vessel-shim vs
#                                             qemu-system-x86_64 -M microvm -enable-kvm, same
#                                             kernel and initrd, medians and ratios
#   scripts/vm-harness.sh pods [CRITEST-ARGS] vesseld in L1 driven by vessel-critest (pods of
#                                             handler $VESSEL_PODS_HANDLER, flat or vm), see
#                                             images/guest/harness/l1-pods.sh and README.md
#
# Environment: VESSEL_TESTS="boot_to_init smp ..." selects tests; VESSEL_HARNESS_TIMEOUT (s,
# default 300) is the watchdog of one L1 run; a run that hangs or crashes (no end marker) is
# retried once. VESSEL_PROFILE=release|debug (default release) picks the shim build.
# pods: VESSEL_PODS_HANDLER=flat|vm (default flat), VESSEL_PODS_FOCUS=REGEX (critest --focus),
# VESSEL_PODS_SUITE=0 (no vessel-critest: only VESSEL_PODS_EXTRA runs),
# VESSEL_PODS_ADD="FILE..." (copied into /vessel/bin, on PATH in L1),
# VESSEL_PODS_ADD_DIRS="SRC:DEST..." (directories copied to DEST in L1),
# VESSEL_PODS_EXTRA="CMD" (run in L1 after the suite), VESSEL_PODS_CONFIG="TOML" (appended to
# vesseld's config), VESSEL_PODS_BINDIR=DIR (take vesseld, vessel-agent, vessel-shim and
# vessel-critest from DIR instead of building them; default profile debug), VESSEL_HARNESS_MEM
# (MiB of L1 RAM; default 2048, pods 3072). Ends with `PODS-HARNESS: N passed, N failed, N skipped`.
# Output: the suite's `PASS name`/`FAIL name` lines and `N passed, N failed`; exit 0 iff all
# passed. Work files: ${VESSEL_HARNESS_WORK:-/var/tmp/vessel-harness}.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WORK=${VESSEL_HARNESS_WORK:-/var/tmp/vessel-harness}
TIMEOUT=${VESSEL_HARNESS_TIMEOUT:-300}
PROFILE=${VESSEL_PROFILE:-release}
MEM=${VESSEL_HARNESS_MEM:-2048}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
log() { echo "vm-harness: $*" >&2; }

mode=test
[ $# -gt 0 ] && { mode=$1; shift; }
adds=(); cmd=()
BENCH_RUNS=5
if [ "$mode" = bench ] && [ $# -gt 0 ]; then BENCH_RUNS=$1; shift; fi
pods_args=()
if [ "$mode" = pods ]; then
  pods_args=("$@")
  PROFILE=${VESSEL_PROFILE:-debug}
  TIMEOUT=${VESSEL_HARNESS_TIMEOUT:-900}
  MEM=${VESSEL_HARNESS_MEM:-3072}
  avail=$(awk '/^MemAvailable:/{print int($2/1024)}' /proc/meminfo)
  if [ "$avail" -lt $((MEM + 512)) ]; then
    echo "vm-harness: L1 needs ${MEM} MiB of RAM (+512 for QEMU) and this host has ${avail} MiB available" >&2; exit 1
  fi
fi
if [ "$mode" = run ]; then
  while [ $# -gt 0 ]; do
    case "$1" in
      --add) adds+=("$2"); shift 2 ;;
      --) shift; cmd=("$@"); break ;;
      *) echo "usage: $0 run [--add SRC:DEST]... -- CMD..." >&2; exit 2 ;;
    esac
  done
  [ ${#cmd[@]} -gt 0 ] || { echo "usage: $0 run [--add SRC:DEST]... -- CMD..." >&2; exit 2; }
fi

# --- dependencies
need=(qemu-system-x86 linux-image-cloud-amd64 busybox-static cpio kmod gcc libc6-dev iproute2)
[ "$mode" = pods ] && need+=(docker-registry erofs-utils binutils apparmor socat)
missing=()
for p in "${need[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  # One install at a time: vm_pods starts two L1 runs at once, and on a machine without
  # these packages both came here together, and the second failed on apt's lock.
  (
    flock 9
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
      --no-install-recommends "${missing[@]}" >&2
  ) 9>/var/lock/vessel-harness-apt.lock
fi

# --- build: guest kernel (cached), shim
KDIR=${VESSEL_GUEST_KDIR:-$(bash scripts/build-guest-kernel.sh | tail -n1)}
log "guest kernel: $KDIR"
if [ "$mode" = pods ]; then
  # vesseld, the agent, the shim and the suite: from VESSEL_PODS_BINDIR, or built here.
  if [ -n "${VESSEL_PODS_BINDIR:-}" ]; then
    BINDIR=$VESSEL_PODS_BINDIR
  else
    BINDIR="$CARGO_TARGET_DIR/$PROFILE"
    rel=(); [ "$PROFILE" = release ] && rel=(--release)
    cargo build "${rel[@]}" --workspace --bins >&2 ||
      { log "building the pods binaries failed (VESSEL_PODS_BINDIR=DIR uses binaries built elsewhere)"; exit 1; }
  fi
  for b in vesseld vessel-agent vessel-shim vessel-critest; do
    [ -x "$BINDIR/$b" ] || { log "no $BINDIR/$b"; exit 1; }
  done
  SHIM="$BINDIR/vessel-shim"
elif [ "$PROFILE" = release ]; then
  cargo build --release -p vessel-shim >&2; SHIM="$CARGO_TARGET_DIR/release/vessel-shim"
else
  # The workspace's feature set, as scripts/test.sh builds it: `-p vessel-shim` alone would
  # resolve the dependencies' features differently and rebuild ~60 crates (5 minutes in CI).
  cargo build --workspace --bins >&2; SHIM="$CARGO_TARGET_DIR/debug/vessel-shim"
fi

# --- stage: the files the suite needs, under $STAGE (becomes /vessel in L1)
STAGE="$WORK/stage"
rm -rf "$STAGE"; mkdir -p "$STAGE/bin" "$STAGE/guest"
cp "$SHIM" "$STAGE/bin/vessel-shim"
cp "$KDIR/bzImage" "$KDIR/vmlinux" "$STAGE/guest/"
cp images/guest/harness/l1-tests.sh "$STAGE/bin/l1-tests.sh"
if [ "$mode" = pods ]; then
  # Debug builds are ~200-350 MB each, mostly DWARF: L1 holds them in RAM, so strip that.
  for b in vesseld vessel-agent vessel-shim vessel-critest; do
    strip --strip-debug -o "$STAGE/bin/$b" "$BINDIR/$b"
  done
  cp images/guest/harness/l1-pods.sh "$STAGE/bin/l1-pods.sh"
  # More programs for VESSEL_PODS_EXTRA (e.g. the pods_e2e test binary), into /vessel/bin.
  for f in ${VESSEL_PODS_ADD:-}; do
    [ -f "$f" ] || { log "VESSEL_PODS_ADD: no file $f"; exit 1; }
    strip --strip-debug -o "$STAGE/bin/$(basename "$f")" "$f" 2>/dev/null || cp "$f" "$STAGE/bin/"
  done
  for a in ${VESSEL_PODS_ADD_DIRS:-}; do
    [ -d "${a%%:*}" ] || { log "VESSEL_PODS_ADD_DIRS: no directory ${a%%:*}"; exit 1; }
    adds+=("$a")
  done
  # The VM pods' guest initrd (/init = vessel-agent), when its build script exists.
  if [ -f scripts/build-guest-initrd.sh ]; then
    # Its last line names the initrd (or the directory holding initrd*).
    GI=$(bash scripts/build-guest-initrd.sh "$BINDIR/vessel-agent" | tail -n1)
    if [ -d "$GI" ]; then GI=$(find "$GI" -maxdepth 1 -name 'initrd*' -type f | sort | head -n1); fi
    [ -f "$GI" ] || { log "scripts/build-guest-initrd.sh did not name an initrd (got '$GI')"; exit 1; }
    cp "$GI" "$STAGE/guest/vessel-initrd.img"
    log "guest initrd: $GI"
    # The same agent as an EROFS root disk, which vesseld prefers (VESSEL_PODS_GUEST=initrd:
    # leave it out, to boot VM pods from the initrd).
    if [ "${VESSEL_PODS_GUEST:-erofs}" = erofs ]; then
      GR=$(FORMAT=erofs bash scripts/build-guest-initrd.sh "$BINDIR/vessel-agent" | tail -n1)
      cp "$GR" "$STAGE/guest/vessel-rootfs.erofs"
      log "guest root: $GR"
    fi
  else
    log "skip: scripts/build-guest-initrd.sh does not exist yet; no VM pod initrd staged (the vm handler cannot boot pods)"
  fi
fi
# agent_* tests: the agent's guest initrd, the agent (its debug client) and a busybox EROFS layer.
AGENT=
if [ "$mode" != pods ]; then
if [ "$PROFILE" = release ]; then
  cargo build --release -p vessel-agent >&2; AGENT="$CARGO_TARGET_DIR/release/vessel-agent"
else
  cargo build --workspace --bins >&2; AGENT="$CARGO_TARGET_DIR/debug/vessel-agent"
fi
cp "$(bash scripts/build-guest-initrd.sh "$AGENT" | tail -n1)" "$STAGE/guest/agent-initrd.img"
cp "$AGENT" "$STAGE/bin/vessel-agent"
BB="$WORK/busybox-layer"; rm -rf "$BB"; mkdir -p "$BB"/{bin,proc,sys,dev,etc,tmp,pod}
cp /bin/busybox "$BB/bin/busybox"; for a in sh echo cat hostname sleep ls; do ln -s busybox "$BB/bin/$a"; done
mkfs.erofs --quiet -T0 --all-root "$STAGE/guest/busybox.erofs" "$BB" >&2
fi

# The guest's initrd: busybox and the test /init.
G="$WORK/guest-initrd"
rm -rf "$G"; mkdir -p "$G"/{bin,sbin,proc,sys,dev,tmp}
cp /bin/busybox "$G/bin/busybox"
for a in sh mount sed grep cat echo head poweroff reboot sleep dd ip ifconfig ping dmesg taskset; do ln -sf busybox "$G/bin/$a"; done
install -m 0755 images/guest/harness/guest-init.sh "$G/init"
gcc -static -O2 -Wall -o "$G/bin/vsock-echo" images/guest/harness/vsock-echo.c
# Also in L1's PATH: the pods suite bind-mounts it into containers to try AF_VSOCK from there.
cp "$G/bin/vsock-echo" "$STAGE/bin/vsock-echo"
(cd "$G" && find . | LC_ALL=C sort | cpio -o -H newc --quiet -R 0:0) >"$STAGE/guest/initrd.cpio"

if [ "$mode" = direct ]; then
  VESSEL_HARNESS_DIR="$STAGE" TMPDIR="$WORK" exec sh "$STAGE/bin/l1-tests.sh"
fi

# --- L1 initrd: busybox, kvm modules, the shim and its libraries, the stage, /init
L1K=$(ls /boot/vmlinuz-*-cloud-amd64 | sort -V | tail -n1)
KVER=${L1K#/boot/vmlinuz-}
L="$WORK/l1-root"
rm -rf "$L"; mkdir -p "$L"/{bin,sbin,proc,sys,dev,tmp,run,lib/modules,vessel}
cp /bin/busybox "$L/bin/busybox"
for a in $(/bin/busybox --list); do [ -e "$L/bin/$a" ] || ln -s busybox "$L/bin/$a"; done
mods=()
add_mod() { # name, with dependencies first
  local m=$1 d
  for d in $(modinfo -k "$KVER" -F depends "$m" | tr ',' ' '); do add_mod "$d"; done
  local f; f=$(modinfo -k "$KVER" -F filename "$m")
  case " ${mods[*]:-} " in *" $f "*) ;; *) mods+=("$f") ;; esac
}
for m in kvm_amd tun vhost_vsock; do add_mod "$m"; done
# The net_mq test's pod network: a veth into a netns, joined to the shim's tap by tc.
for m in veth sch_ingress cls_u32 act_mirred; do add_mod "$m"; done
# Pods: overlayfs for flat pods' root filesystems, erofs and loop for layer images; the
# bridge (with the veths above) for the CNI bridge plugin.
if [ "$mode" = pods ]; then
  for m in overlay erofs loop bridge; do add_mod "$m"; done
  # iptables (nft) for the portmap CNI plugin's host-port rules.
  for m in nf_tables nft_compat nft_chain_nat nft_nat nft_masq nft_ct xt_comment xt_multiport \
    xt_nat xt_MASQUERADE xt_mark xt_addrtype xt_conntrack xt_tcpudp; do add_mod "$m"; done
fi
: >"$L/lib/modules/order"
for f in "${mods[@]}"; do
  case "$f" in *.xz) xz -dc "$f" >"$L/lib/modules/$(basename "${f%.xz}")" ;; *) cp "$f" "$L/lib/modules/" ;; esac
  basename "${f%.xz}" >>"$L/lib/modules/order"
done
# The shim's shared libraries (and QEMU's, for the benchmark), at the paths ldd names.
# iproute2's ip (busybox's lacks tuntap) for the net test.
IPBIN=$(command -v ip)
mkdir -p "$L/usr/local/bin"; cp "$IPBIN" "$L/usr/local/bin/ip"
bins=("$SHIM" "$IPBIN")
[ -n "$AGENT" ] && bins+=("$AGENT")
if [ "$mode" = pods ]; then
  # docker-registry for vessel-critest's test images (plain HTTP on 127.0.0.1), mkfs.erofs for
  # VM pods' layer images; /etc files that vesseld, the agent and the registry look at.
  mkdir -p "$L/usr/bin" "$L/etc" "$L/var/lib" "$L/newroot"
  for b in "$STAGE"/bin/vessel* /usr/bin/docker-registry /usr/bin/mkfs.erofs /usr/bin/fsck.erofs /usr/bin/dump.erofs; do
    bins+=("$b")
  done
  cp /usr/bin/docker-registry /usr/bin/mkfs.erofs /usr/bin/fsck.erofs /usr/bin/dump.erofs "$L/usr/bin/"
  # A CNI network for L1's pods, flat and VM (vesseld's default conf_dir and bin_dirs): Debian's
  # bridge + host-local + portmap (the agent brings the pod's lo up), and iptables (nft) for portmap.
  if [ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ]; then
    mkdir -p "$L/usr/lib/cni" "$L/etc/cni/net.d" "$L/usr/sbin" "$L/usr/lib/x86_64-linux-gnu"
    for p in bridge host-local portmap loopback tuning; do cp "/usr/lib/cni/$p" "$L/usr/lib/cni/"; bins+=("/usr/lib/cni/$p"); done
    # critest's host-IPC specs make a SysV segment with util-linux's ipcmk.
    cp /usr/bin/ipcmk "$L/usr/bin/"; bins+=(/usr/bin/ipcmk)
    XT=$(readlink -f /usr/sbin/iptables)
    cp "$XT" "$L/usr/sbin/"; bins+=("$XT")
    for t in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
      ln -sf "$(basename "$XT")" "$L/usr/sbin/$t"
    done
    cp -a /usr/lib/x86_64-linux-gnu/xtables "$L/usr/lib/x86_64-linux-gnu/"
    cat >"$L/etc/cni/net.d/10-vessel-l1.conflist" <<'EOC'
{"cniVersion": "1.0.0", "name": "vessel-l1", "plugins": [
  {"type": "bridge", "bridge": "vessel-l1", "isGateway": true, "ipMasq": false,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.89.0.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
EOC
  else
    log "no CNI plugins in /usr/lib/cni (containernetworking-plugins): L1's pods get loopback only"
  fi
  # L1's Debian kernel has AppArmor: critest's AppArmor specs load their profiles with
  # `sudo apparmor_parser -r -W`, which needs the parser, its includes, the feature ABI that
  # parser.conf pins and a cache dir. L1 runs everything as root and has no sudo: its
  # `sudo CMD` runs CMD.
  mkdir -p "$L/usr/sbin"; cp /sbin/apparmor_parser "$L/usr/sbin/"; bins+=(/sbin/apparmor_parser)
  cp -a /etc/apparmor /etc/apparmor.d "$L/etc/"; mkdir -p "$L/usr/share"; cp -a /usr/share/apparmor-features "$L/usr/share/"
  mkdir -p "$L/var/cache/apparmor"
  printf '#!/bin/sh\nexec "$@"\n' >"$L/usr/bin/sudo"; chmod 0755 "$L/usr/bin/sudo"
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n' >"$L/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' >"$L/etc/group"
  printf '127.0.0.1 localhost\n::1 localhost\n' >"$L/etc/hosts"
  printf 'nameserver 127.0.0.1\n' >"$L/etc/resolv.conf"
  echo vessel-l1 >"$L/etc/hostname"
  : >"$L/vessel/pods-args"
  if [ ${#pods_args[@]} -gt 0 ]; then printf '%s\n' "${pods_args[@]}" >"$L/vessel/pods-args"; fi
  printf 'export VESSEL_PODS_HANDLER=%q VESSEL_PODS_FOCUS=%q VESSEL_PODS_SUITE=%q VESSEL_PODS_EXTRA=%q VESSEL_PODS_CONFIG=%q\n' \
    "${VESSEL_PODS_HANDLER:-flat}" "${VESSEL_PODS_FOCUS:-}" "${VESSEL_PODS_SUITE:-1}" "${VESSEL_PODS_EXTRA:-}" "${VESSEL_PODS_CONFIG:-}" >"$L/vessel/pods-env"
fi
if [ "$mode" = bench ]; then
  bins+=(/usr/bin/qemu-system-x86_64)
  mkdir -p "$L/usr/bin" "$L/usr/share/qemu"
  cp /usr/bin/qemu-system-x86_64 "$L/usr/bin/"
  cp /usr/share/qemu/{qboot.rom,bios-microvm.bin,linuxboot_dma.bin} "$L/usr/share/qemu/"
fi
for lib in $(ldd "${bins[@]}" | grep -v ':$' | grep -o '/[^ ]*' | sort -u); do
  [ -e "$L$lib" ] && continue
  mkdir -p "$L$(dirname "$lib")"; cp -L "$lib" "$L$lib"
done
cp -a "$STAGE/." "$L/vessel/"
for a in "${adds[@]}"; do
  src=${a%%:*}; dst=${a#*:}
  mkdir -p "$L$(dirname "$dst")"; cp -a "$src" "$L$dst"
done
if [ "$mode" = run ]; then
  printf '%q ' "${cmd[@]}" >"$L/vessel/cmd"; echo >>"$L/vessel/cmd"
elif [ "$mode" = pods ]; then
  echo '. /vessel/pods-env; set --; while IFS= read -r a; do set -- "$@" "$a"; done </vessel/pods-args; sh /vessel/bin/l1-pods.sh "$@"' >"$L/vessel/cmd"
elif [ "$mode" = bench ]; then
  echo "/vessel/bin/vessel-shim bench --kernel /vessel/guest/bzImage --vmlinux /vessel/guest/vmlinux --initrd /vessel/guest/initrd.cpio --runs $BENCH_RUNS --qemu /usr/bin/qemu-system-x86_64 --work /tmp/bench" >"$L/vessel/cmd"
else
  echo "VESSEL_TESTS='${VESSEL_TESTS:-}' VERBOSE=${VERBOSE:-false} sh /vessel/bin/l1-tests.sh" >"$L/vessel/cmd"
fi
cat >"$L/init" <<'EOS'
#!/bin/sh
export PATH=/usr/local/bin:/bin:/sbin:/usr/bin:/usr/sbin HOME=/ TMPDIR=/tmp
if [ -d /newroot ] && [ "${1:-}" != stage2 ]; then
  # pivot_root(2) refuses to leave the initramfs, and container runtimes pivot_root into each
  # container's rootfs: move everything onto a tmpfs and make that the root.
  mount -t tmpfs -o size=80%,mode=0755 root /newroot
  for e in /* ; do [ "$e" = /newroot ] || cp -a "$e" /newroot/; done
  exec switch_root /newroot /init stage2
fi
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
if [ -f /vessel/pods-env ]; then
  mkdir -p /dev/pts /dev/shm /run; mount -t devpts devpts /dev/pts; mount -t tmpfs shm /dev/shm; mount -t tmpfs run /run
  hostname -F /etc/hostname
  [ -d /sys/kernel/security ] && mount -t securityfs securityfs /sys/kernel/security
  # As on a systemd host: / shared, so Bidirectional container mounts propagate back.
  mount --make-rshared / 2>/dev/null || mount -o rshared /
fi
while read -r m; do insmod "/lib/modules/$m" 2>/dev/null; done </lib/modules/order
[ -e /dev/kvm ] || echo "vm-harness: no /dev/kvm in L1 ($(cat /sys/module/kvm_amd/parameters/nested 2>/dev/null))"
ip link set lo up
echo "VESSEL-L1-UP $(cut -d' ' -f1 /proc/uptime)"
sh /vessel/cmd
echo "VESSEL-L1-EXIT $?"
poweroff -f
EOS
chmod +x "$L/init"
(cd "$L" && find . | LC_ALL=C sort | cpio -o -H newc --quiet -R 0:0) >"$WORK/l1-initrd.cpio"
log "L1 initrd $(du -h "$WORK/l1-initrd.cpio" | cut -f1), L1 kernel $KVER"

# --- boot L1 under a watchdog; retry once if it hangs or crashes
MON="$WORK/l1-monitor.sock"
run_l1() {
  rm -f "$MON"
  timeout --foreground -k 5 "$TIMEOUT" qemu-system-x86_64 -accel tcg -cpu EPYC -smp 1 -m "$MEM" \
    -nographic -no-reboot -nodefaults -serial stdio -monitor "unix:$MON,server=on,wait=off" \
    -kernel "$L1K" -initrd "$WORK/l1-initrd.cpio" \
    -append "console=ttyS0 quiet panic=-1 kvm_amd.nested=1 rdinit=/init" </dev/null 2>&1 |
    tee "$WORK/l1-console.log" | grep --line-buffered -v '^\s*$' | sed -u 's/\r$//'
}
# An emulated L1 running nested guests now and then stops for good (seen in a few of the
# 10-20 minute pods runs): QEMU idle, L1's vCPU halted with interrupts enabled, and its local
# APIC holding the timer interrupt in IRR, never delivered (a lost wake-up in QEMU 7.2's TCG
# with nested SVM; neither an NMI nor the monitor's stop/cont wakes it). The pods harness
# prints a heartbeat every 120 s, so after 150 s of silence the watcher asks QEMU's monitor:
# halted with an interrupt pending, twice 10 s apart, is that stop, and L1 is given up at
# once (the retry below starts). Silent for 400 s, L1 is given up whatever its state.
stuck_l1() {
  local out
  out=$( (printf 'info registers\n'; sleep 1; printf 'info lapic\n'; sleep 1) |
    timeout 10 socat - "UNIX-CONNECT:$MON" 2>/dev/null | tr -d '\r')
  echo "$out" | grep -q 'HLT=1' && echo "$out" | grep -Eq '^IRR[[:space:]]+[0-9]'
}
watch_l1() {
  local now age
  while sleep 20; do
    [ -S "$MON" ] && [ -f "$WORK/l1-console.log" ] || continue
    now=$(date +%s); age=$(( now - $(stat -c %Y "$WORK/l1-console.log") ))
    if [ "$age" -ge 400 ]; then
      log "L1 silent for ${age}s: stopping it"
    elif [ "$age" -ge 150 ] && stuck_l1 && sleep 10 && stuck_l1 &&
      [ $(( $(date +%s) - $(stat -c %Y "$WORK/l1-console.log") )) -ge 150 ]; then
      log "L1 silent for ${age}s, its vCPU halted with an interrupt pending (QEMU lost the wake-up): stopping it"
    else
      continue
    fi
    printf 'quit\n' | timeout 5 socat - "UNIX-CONNECT:$MON" >/dev/null 2>&1
  done
}
watcher=
if [ "$mode" = pods ] && command -v socat >/dev/null; then
  watch_l1 & watcher=$!
  trap '[ -n "$watcher" ] && kill "$watcher" 2>/dev/null' EXIT
fi
for attempt in 1 2; do
  t0=$(date +%s.%N)
  run_l1 || true
  t1=$(date +%s.%N)
  if grep -q "VESSEL-L1-EXIT" "$WORK/l1-console.log"; then
    rc=$(sed -n 's/.*VESSEL-L1-EXIT \([0-9]*\).*/\1/p' "$WORK/l1-console.log" | tail -n1)
    log "L1 run took $(echo "$t1 - $t0" | bc) s (attempt $attempt), exit $rc"
    exit "$rc"
  fi
  log "L1 run $attempt ended without its exit marker (hang or crash; watchdog ${TIMEOUT}s)"
done
echo "0 passed, 1 failed"
exit 1
