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
#
# Environment: VESSEL_TESTS="boot_to_init smp ..." selects tests; VESSEL_HARNESS_TIMEOUT (s,
# default 300) is the watchdog of one L1 run; a run that hangs or crashes (no end marker) is
# retried once. VESSEL_PROFILE=release|debug (default release) picks the shim build.
# Output: the suite's `PASS name`/`FAIL name` lines and `N passed, N failed`; exit 0 iff all
# passed. Work files: ${VESSEL_HARNESS_WORK:-/var/tmp/vessel-harness}.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
WORK=${VESSEL_HARNESS_WORK:-/var/tmp/vessel-harness}
TIMEOUT=${VESSEL_HARNESS_TIMEOUT:-300}
PROFILE=${VESSEL_PROFILE:-release}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
log() { echo "vm-harness: $*" >&2; }

mode=test
[ $# -gt 0 ] && { mode=$1; shift; }
adds=(); cmd=()
BENCH_RUNS=5
if [ "$mode" = bench ] && [ $# -gt 0 ]; then BENCH_RUNS=$1; shift; fi
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
missing=()
for p in "${need[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

# --- build: guest kernel (cached), shim
KDIR=${VESSEL_GUEST_KDIR:-$(bash scripts/build-guest-kernel.sh | tail -n1)}
log "guest kernel: $KDIR"
if [ "$PROFILE" = release ]; then
  cargo build --release -p vessel-shim >&2; SHIM="$CARGO_TARGET_DIR/release/vessel-shim"
else
  cargo build -p vessel-shim >&2; SHIM="$CARGO_TARGET_DIR/debug/vessel-shim"
fi

# --- stage: the files the suite needs, under $STAGE (becomes /vessel in L1)
STAGE="$WORK/stage"
rm -rf "$STAGE"; mkdir -p "$STAGE/bin" "$STAGE/guest"
cp "$SHIM" "$STAGE/bin/vessel-shim"
cp "$KDIR/bzImage" "$KDIR/vmlinux" "$STAGE/guest/"
cp images/guest/harness/l1-tests.sh "$STAGE/bin/l1-tests.sh"
# agent_* tests: the agent's guest initrd, the agent (its debug client) and a busybox EROFS layer.
cargo build --release -p vessel-agent >&2; AGENT="$CARGO_TARGET_DIR/release/vessel-agent"
cp "$(bash scripts/build-guest-initrd.sh "$AGENT" | tail -n1)" "$STAGE/guest/agent-initrd.img"
cp "$AGENT" "$STAGE/bin/vessel-agent"
BB="$WORK/busybox-layer"; rm -rf "$BB"; mkdir -p "$BB"/{bin,proc,sys,dev,etc,tmp,pod}
cp /bin/busybox "$BB/bin/busybox"; for a in sh echo cat hostname sleep ls; do ln -s busybox "$BB/bin/$a"; done
mkfs.erofs --quiet -T0 --all-root "$STAGE/guest/busybox.erofs" "$BB" >&2

# The guest's initrd: busybox and the test /init.
G="$WORK/guest-initrd"
rm -rf "$G"; mkdir -p "$G"/{bin,sbin,proc,sys,dev,tmp}
cp /bin/busybox "$G/bin/busybox"
for a in sh mount sed grep cat echo head poweroff reboot sleep dd ip ifconfig ping dmesg; do ln -sf busybox "$G/bin/$a"; done
install -m 0755 images/guest/harness/guest-init.sh "$G/init"
gcc -static -O2 -Wall -o "$G/bin/vsock-echo" images/guest/harness/vsock-echo.c
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
: >"$L/lib/modules/order"
for f in "${mods[@]}"; do
  case "$f" in *.xz) xz -dc "$f" >"$L/lib/modules/$(basename "${f%.xz}")" ;; *) cp "$f" "$L/lib/modules/" ;; esac
  basename "${f%.xz}" >>"$L/lib/modules/order"
done
# The shim's shared libraries (and QEMU's, for the benchmark), at the paths ldd names.
# iproute2's ip (busybox's lacks tuntap) for the net test.
IPBIN=$(command -v ip)
mkdir -p "$L/usr/local/bin"; cp "$IPBIN" "$L/usr/local/bin/ip"
bins=("$SHIM" "$IPBIN" "$AGENT")
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
elif [ "$mode" = bench ]; then
  echo "/vessel/bin/vessel-shim bench --kernel /vessel/guest/bzImage --initrd /vessel/guest/initrd.cpio --runs $BENCH_RUNS --qemu /usr/bin/qemu-system-x86_64 --work /tmp/bench" >"$L/vessel/cmd"
else
  echo "VESSEL_TESTS='${VESSEL_TESTS:-}' VERBOSE=${VERBOSE:-false} sh /vessel/bin/l1-tests.sh" >"$L/vessel/cmd"
fi
cat >"$L/init" <<'EOS'
#!/bin/sh
export PATH=/usr/local/bin:/bin:/sbin HOME=/ TMPDIR=/tmp
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
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
run_l1() {
  timeout --foreground -k 5 "$TIMEOUT" qemu-system-x86_64 -accel tcg -cpu EPYC -smp 1 -m 2048 \
    -nographic -no-reboot -nodefaults -serial stdio -monitor none \
    -kernel "$L1K" -initrd "$WORK/l1-initrd.cpio" \
    -append "console=ttyS0 quiet panic=-1 kvm_amd.nested=1 rdinit=/init" </dev/null 2>&1 |
    tee "$WORK/l1-console.log" | grep --line-buffered -v '^\s*$' | sed -u 's/\r$//'
}
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
