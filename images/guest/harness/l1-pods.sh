#!/bin/sh
# The pods harness, run inside L1 by `scripts/vm-harness.sh pods`: starts vesseld on its own
# socket, root and state dir, runs vessel-critest against it (which starts docker-registry on
# 127.0.0.1 and pushes its test images there), then an optional extra command, and prints
# `PODS-HARNESS: N passed, N failed, N skipped`. Exit 0 iff nothing failed and something ran.
#
# Environment (the host passes these through): VESSEL_PODS_HANDLER (flat|vm, default flat),
# VESSEL_PODS_FOCUS (critest --focus), VESSEL_PODS_SUITE=0 (skip vessel-critest),
# VESSEL_PODS_EXTRA (a shell command run after the suite,
# counted as one more spec; vesseld is still up, its socket in $VESSEL_SOCK),
# VESSEL_PODS_CONFIG (TOML appended to vesseld's config). Arguments go to vessel-critest.
D=${VESSEL_HARNESS_DIR:-/vessel}
HANDLER=${VESSEL_PODS_HANDLER:-flat}
STATE=/run/vessel-test
ROOT=/var/lib/vessel-test
export PATH="$D/bin:$PATH"
mkdir -p "$STATE" "$ROOT"
VESSEL_SOCK="$STATE/vessel.sock"
export VESSEL_SOCK
since() { awk -v t="$1" '{printf "%.1f", $1 - t}' /proc/uptime; }

# The kernel's log, kept whole (no rate limit) for the VMM's seccomp records (audit type 1326)
# checked at the end.
echo 0 >/proc/sys/kernel/printk_ratelimit 2>/dev/null
cat /dev/kmsg >/tmp/kmsg &
kmsg=$!
echo "l1-pods: kernel log capture" >/dev/kmsg
# cgroup v2 with every controller delegated to children (vesseld and libcontainer need it).
if ! grep -q " /sys/fs/cgroup cgroup2 " /proc/mounts; then
  mount -t cgroup2 cgroup2 /sys/fs/cgroup
fi
for c in $(cat /sys/fs/cgroup/cgroup.controllers); do
  echo "+$c" >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || echo "l1-pods: cannot enable cgroup controller $c"
done

# The config: state under /run/vessel-test, root under /var/lib/vessel-test. For the vm handler,
# the [vm] keys this vesseld knows (from `vesseld config default`) point at the staged guest.
# With the vm handler, a pod that falls back to flat must fail, not pass as a flat pod.
vesseld config default >"$STATE/default.toml" 2>/dev/null
{
  printf '[daemon]\nsocket = "%s"\nroot_dir = "%s"\nstate_dir = "%s"\nlog_level = "debug"\nmetrics_address = ""\n\n' \
    "$VESSEL_SOCK" "$ROOT" "$STATE"
  printf '[runtime]\nagent_binary = "%s"\n' "$D/bin/vessel-agent"
  if [ "$HANDLER" = vm ] && grep -q '^vm_fallback *=' "$STATE/default.toml"; then
    echo 'vm_fallback = "refuse"'
  fi
} >"$STATE/config.toml"
vm_keys=$(awk '/^\[/{s=$0} s=="[vm]" && /^[a-z_]+ *=/{print $1}' "$STATE/default.toml")
if [ -n "$vm_keys" ]; then
  echo '' >>"$STATE/config.toml"
  echo '[vm]' >>"$STATE/config.toml"
  for k in $vm_keys; do
    v=""
    case "$k" in
      kernel) v="$D/guest/vmlinux" ;;
      initrd) [ -f "$D/guest/vessel-initrd.img" ] && v="$D/guest/vessel-initrd.img" ;;
      rootfs) v="$D/guest/vessel-rootfs.erofs" ;;
      shim|shim_binary) v="$D/bin/vessel-shim" ;;
    esac
    [ -n "$v" ] && echo "$k = \"$v\"" >>"$STATE/config.toml"
  done
fi
[ -n "${VESSEL_PODS_CONFIG:-}" ] && printf '\n%s\n' "$VESSEL_PODS_CONFIG" >>"$STATE/config.toml"
echo "l1-pods: handler $HANDLER, config:"; sed 's/^/  /' "$STATE/config.toml"

t0=$(cut -d' ' -f1 /proc/uptime)
vesseld --config "$STATE/config.toml" >"$STATE/vesseld.log" 2>&1 &
vpid=$!
i=0
while [ ! -S "$VESSEL_SOCK" ] && [ $i -lt 600 ] && kill -0 $vpid 2>/dev/null; do sleep 0.1; i=$((i+1)); done
if [ ! -S "$VESSEL_SOCK" ]; then
  echo "l1-pods: vesseld did not create its socket; its log:"; tail -n 50 "$STATE/vesseld.log"
  echo "PODS-HARNESS: 0 passed, 1 failed, 0 skipped"
  exit 1
fi
echo "l1-pods: vesseld up in $(since "$t0") s"
# A heartbeat on the console: tells an L1 that hangs (no heartbeat) from a suite that waits
# on something (heartbeats, with vesseld's last log line).
( while sleep 120; do
    echo "l1-pods: heartbeat at $(cut -d' ' -f1 /proc/uptime) s; vesseld: $(tail -n 1 "$STATE/vesseld.log" | cut -c1-300)"
  done ) &
hb=$!

set -- --endpoint "unix://$VESSEL_SOCK" --runtime-handler "$HANDLER" "$@"
[ "$HANDLER" = vm ] && set -- "$@" --vm
[ -n "${VESSEL_PODS_FOCUS:-}" ] && set -- "$@" --focus "$VESSEL_PODS_FOCUS"
if [ "${VESSEL_PODS_SUITE:-1}" = 0 ]; then
  echo "l1-pods: no vessel-critest (VESSEL_PODS_SUITE=0)"
  pass=0; fail=0; skip=0
else
  echo "l1-pods: vessel-critest $*"
  t1=$(cut -d' ' -f1 /proc/uptime)
  vessel-critest "$@" 2>&1 | tee "$STATE/critest.out"
  echo "l1-pods: vessel-critest took $(since "$t1") s"
  summary=$(grep -E '^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped' "$STATE/critest.out" | tail -n1)
  if [ -n "$summary" ]; then
    set -- $summary
    pass=$1; fail=$3; skip=$5
  else
    echo "l1-pods: vessel-critest printed no summary"
    pass=0; fail=1; skip=0
  fi
fi

if [ -n "${VESSEL_PODS_EXTRA:-}" ]; then
  echo "l1-pods: extra: $VESSEL_PODS_EXTRA"
  if sh -c "$VESSEL_PODS_EXTRA"; then pass=$((pass+1)); echo "PASS extra"
  else fail=$((fail+1)); echo "FAIL extra"
  fi
fi

kill $hb 2>/dev/null
kill -TERM $vpid 2>/dev/null
i=0; while kill -0 $vpid 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
kill -KILL $vpid 2>/dev/null
if [ "$fail" != 0 ] || [ "$pass" = 0 ]; then
  echo "l1-pods: the last 80 lines of vesseld's log:"; tail -n 80 "$STATE/vesseld.log"
fi
# Where L1's time went: each CRI method's calls, median and largest latency (vesseld's
# metrics lines), so that a slower run says which operations grew. Runs whose tests start
# their own vesseld (pods_e2e, cni_e2e) have no such lines here, and print no table.
table=$(sed -n 's/.*CRI call done method=\([A-Za-z]*\) .*took_us=\([0-9]*\).*/\1 \2/p' "$STATE/vesseld.log" |
  sort -k1,1 -k2,2n | awk '
    function flush() { if (n) printf "  %s %d %.1f %.1f\n", m, n, v[int((n+1)/2)]/1000, v[n]/1000 }
    $1 != m { flush(); m = $1; n = 0 }
    { v[++n] = $2 }
    END { flush() }')
[ -z "$table" ] || printf 'l1-pods: CRI latencies in L1 (method calls median_ms max_ms):\n%s\n' "$table"
# Where a pod's start and stop go: each step's calls, median and largest time since its phase
# began (vesseld's debug lines; a VM pod's guest events count from the shim's spawn).
table=$(sed -n -E \
  -e 's/.*(starting the pod sandbox|starting the VM pod|stopping the pod sandbox) .*step="?([a-z -]+)"? ms=([0-9.]+).*/\1: \2|\3/p' \
  -e 's/.*guest boot event event=([a-z0-9-]+) ms=([0-9.]+).*/guest event (since the shim began): \1|\2/p' \
  "$STATE/vesseld.log" | sort -t'|' -k1,1 -k2,2n | awk -F'|' '
    function flush() { if (n) printf "  %s %d %.1f %.1f\n", m, n, v[int((n+1)/2)], v[n] }
    $1 != m { flush(); m = $1; n = 0 }
    { v[++n] = $2 }
    END { flush() }')
[ -z "$table" ] || printf 'l1-pods: pod start and stop steps in L1 (phase: step calls median_ms max_ms):\n%s\n' "$table"
# The jailed VMMs' seccomp allow-lists refused nothing the suite made them do (each refusal
# is an audit record of the kernel's: the lists are installed with SECCOMP_FILTER_FLAG_LOG).
kill $kmsg 2>/dev/null
if [ "$HANDLER" = vm ] && ! grep -q 'l1-pods: kernel log capture' /tmp/kmsg; then
  fail=$((fail+1)); echo "FAIL the kernel log was not captured: the VMMs' seccomp refusals are not checked"
elif [ "$HANDLER" = vm ]; then
  refused=$(grep 'type=1326' /tmp/kmsg | grep 'vessel-shim' |
    sed -E 's/.*comm="([^"]*)".*syscall=([0-9]+).*/thread \1 system call \2/; s/vcpu[0-9]+/vcpuN/' | sort | uniq -c)
  if [ -z "$refused" ]; then pass=$((pass+1)); echo "PASS the VMMs' seccomp filters refused nothing"
  else fail=$((fail+1)); echo "FAIL the VMMs' seccomp filters refused:"; echo "$refused"
    grep 'type=1326' /tmp/kmsg | grep 'vessel-shim' | head -n 20
  fi
fi
echo "PODS-HARNESS: $pass passed, $fail failed, $skip skipped"
[ "$fail" = 0 ] && [ "$pass" != 0 ]
