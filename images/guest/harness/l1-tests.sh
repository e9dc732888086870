#!/bin/sh
# The VM test suite, run inside L1 (QEMU/TCG with nested SVM) by scripts/vm-harness.sh, or
# directly on a host with hardware virtualisation (VESSEL_HARNESS_DIR pointing at the staged
# files). Prints `PASS name` / `FAIL name` lines and `N passed, N failed`.
D=${VESSEL_HARNESS_DIR:-/vessel}
SHIM="$D/bin/vessel-shim"
KERNEL="$D/guest/bzImage"
INITRD="$D/guest/initrd.cpio"
W=${TMPDIR:-/tmp}/vessel-tests
rm -rf "$W"; mkdir -p "$W"
pass=0; fail=0
# iproute2 (busybox's ip has no tuntap; busybox sh prefers its applets, so use a full path).
IP=$(command -v ip); [ -x /usr/local/bin/ip ] && IP=/usr/local/bin/ip

spec() { # name test vcpus mem [kernel] [extra JSON fields]
  [ -n "${5:-}" ] || set -- "$1" "$2" "$3" "$4" "$KERNEL" "${6:-}"
  cat >"$W/$1.json" <<EOS
{"kernel":"${5:-$KERNEL}","initrd":"$INITRD","mem_mib":$4,"vcpus":$3,${6:-}
 "console":{"file":"$W/$1.console"},"cmdline":"vessel.test=$2","verbose":${VERBOSE:-false}}
EOS
}
shim_run() { # name: runs the spec, output JSON in $W/name.out, exit code in $W/name.rc
  "$SHIM" run --spec "$W/$1.json" --timeout 60 >"$W/$1.out" 2>"$W/$1.err"
  echo $? >"$W/$1.rc"
}
check() { # name description command...
  n=$1; shift
  if "$@"; then pass=$((pass+1)); echo "PASS $n"
  else fail=$((fail+1)); echo "FAIL $n"
    for f in "$W/$n".out "$W/$n".err "$W/$n".console; do [ -f "$f" ] && { echo "--- $f"; tail -n 30 "$f"; }; done
  fi
}
rc_is() { [ "$(cat "$W/$1.rc")" = "$2" ]; }
out_has() { grep -q "$2" "$W/$1.out"; }

t_probe() {
  "$SHIM" probe --json >"$W/probe.out" 2>&1; r=$?
  cat "$W/probe.out" | tr -d '\n' | sed 's/  */ /g'; echo
  [ $r = 0 ]
}
t_boot_to_init() {
  spec boot_to_init init 1 128; shim_run boot_to_init
  cat "$W/boot_to_init.out"
  rc_is boot_to_init 0 && out_has boot_to_init '"init":' && out_has boot_to_init '"outcome":"poweroff"'
}
t_boot_elf() {
  spec boot_elf init 1 128 "$D/guest/vmlinux"; shim_run boot_elf
  cat "$W/boot_elf.out"
  rc_is boot_elf 0 && out_has boot_elf '"init":'
}
t_smp() {
  spec smp smp 2 128; shim_run smp
  cat "$W/smp.out"
  rc_is smp 0 && out_has smp '"cpus-2":'
}
t_reboot() { spec reboot reboot 1 128; shim_run reboot; rc_is reboot 10 && out_has reboot '"outcome":"reboot"'; }
t_panic() { spec panic panic 1 128; shim_run panic; rc_is panic 11 && out_has panic '"outcome":"panic"'; }
t_two_vms() {
  spec vm_a init 1 128; spec vm_b smp 2 128
  shim_run vm_a & a=$!
  shim_run vm_b & b=$!
  wait $a; wait $b
  rc_is vm_a 0 && rc_is vm_b 0 && out_has vm_a '"init":' && out_has vm_b '"cpus-2":'
}
t_blk() {
  printf 'vessel-blk-ro' >"$W/ro.img"; dd if=/dev/zero of="$W/ro.img" bs=1024 seek=1 count=1023 2>/dev/null
  dd if=/dev/zero of="$W/rw.img" bs=1024 count=1024 2>/dev/null
  spec blk blk 1 128 "" "\"disks\":[{\"path\":\"$W/ro.img\",\"read_only\":true,\"serial\":\"vessel-ro-0\"},{\"path\":\"$W/rw.img\"}],"
  shim_run blk; cat "$W/blk.out"
  rc_is blk 0 && out_has blk '"blk-ro-vessel-blk-ro":' && out_has blk '"blk-serial-vessel-ro-0":' &&
    out_has blk '"blk-written":' && ! out_has blk 'accepted-write' && [ "$(head -c 18 "$W/rw.img")" = vessel-blk-written ]
}
t_bad_disk() {
  spec bad_disk init 1 128 "" '"disks":[{"path":"/nonexistent/disk.img"}],'; shim_run bad_disk
  rc_is bad_disk 1 && grep -q "disk image /nonexistent/disk.img" "$W/bad_disk.err"
}
t_net() {
  "$IP" tuntap add dev vtap0 mode tap && "$IP" addr add 10.0.2.1/24 dev vtap0 && "$IP" link set vtap0 up || return 1
  spec net net 1 128 "" '"nets":[{"tap":"vtap0","mac":"52:54:00:12:34:56"}],'
  shim_run net; cat "$W/net.out"
  rx=$(cat /sys/class/net/vtap0/statistics/rx_packets); tx=$(cat /sys/class/net/vtap0/statistics/tx_packets)
  echo "tap vtap0: rx_packets=$rx tx_packets=$tx"
  "$IP" link del vtap0
  rc_is net 0 && out_has net '"net-mac-52:54:00:12:34:56":' && out_has net '"net-ping-ok":' && [ "$rx" -gt 0 ] && [ "$tx" -gt 0 ]
}
t_net_mq() {
  # The pod network as CNI leaves it (a netns holding eth0, one end of a veth) and a guest
  # with two vCPUs: the shim plugs a two-queue tap, the guest enables both pairs and reaches
  # the veth's other end from each CPU.
  ns=vessel-mq
  "$IP" netns add $ns || return 1
  if ! { "$IP" link add vmq-host type veth peer name eth0 netns $ns &&
    "$IP" addr add 10.0.3.1/24 dev vmq-host && "$IP" link set vmq-host up &&
    "$IP" -n $ns link set eth0 up; }; then
    "$IP" netns del $ns; return 1
  fi
  spec net_mq net_mq 2 128 "" "\"pod_net\":{\"netns\":\"/run/netns/$ns\"},"
  shim_run net_mq; cat "$W/net_mq.out"
  grep -o 'pod network plugged.*' "$W/net_mq.err" | head -n1
  "$IP" netns del $ns; "$IP" link del vmq-host 2>/dev/null
  rc_is net_mq 0 && out_has net_mq '"net-queues-2":' && ! out_has net_mq '"net-mq-refused":' &&
    out_has net_mq '"net-ping-ok":'
}
t_bad_tap() {
  spec bad_tap init 1 128 "" '"nets":[{"tap":"no-such-tap"}],'; shim_run bad_tap
  rc_is bad_tap 1 && grep -q "tap no-such-tap: no such interface" "$W/bad_tap.err" && ! "$IP" link show no-such-tap >/dev/null 2>&1
}
t_vsock() {
  "$SHIM" vsock-echo --path "$W/v.sock_5678" & e=$!
  spec vsock vsock 1 128 "" "\"vsock\":{\"guest_cid\":3,\"uds_path\":\"$W/v.sock\"},"
  shim_run vsock & s=$!
  i=0; while [ ! -S "$W/v.sock" ] && [ $i -lt 1000 ]; do sleep 0.01; i=$((i+1)); done
  refused=yes
  "$SHIM" vsock-connect --socket "$W/v.sock" --port 4321 >"$W/vsock.refused" 2>&1 && refused=no
  "$SHIM" vsock-connect --socket "$W/v.sock" --port 1234 --send hello-from-host --retry-ms 30000 \
    >"$W/vsock.reply" 2>"$W/vsock.reply.err"
  "$SHIM" vsock-connect --socket "$W/v.sock" --port 1236 --echo-bytes 4000000 --retry-ms 30000 \
    >"$W/vsock.bulk" 2>&1
  wait $s; kill $e 2>/dev/null
  cat "$W/vsock.out" "$W/vsock.refused" "$W/vsock.reply" "$W/vsock.reply.err" "$W/vsock.bulk"
  [ $refused = yes ] && grep -q "refused the connection to vsock port 4321" "$W/vsock.refused" &&
    grep -qx hello-from-host "$W/vsock.reply" && rc_is vsock 0 &&
    out_has vsock '"vsock-guest-reply-hello-from-guest":' && grep -q "^echo ok 4000000 bytes" "$W/vsock.bulk" &&
    out_has vsock '"vsock-bulk-done":' && [ ! -e "$W/v.sock" ]
}
wait_console() { # name text
  i=0; while ! grep -q "$2" "$W/$1.console" 2>/dev/null && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done
}
t_sigterm() {
  # The guest honours the stop request: a clean poweroff, exit 0.
  spec sigterm stop 1 128 "" "\"vsock\":{\"uds_path\":\"$W/term.sock\"},"
  "$SHIM" run --spec "$W/sigterm.json" --timeout 60 >"$W/sigterm.out" 2>"$W/sigterm.err" & pid=$!
  wait_console sigterm "vessel-event: waiting-stop"
  kill -TERM "$pid"; wait $pid; echo $? >"$W/sigterm.rc"
  cat "$W/sigterm.out"
  rc_is sigterm 0 && out_has sigterm '"stop-requested":' && out_has sigterm '"outcome":"poweroff"' && [ ! -e "$W/term.sock" ]
}
t_sigterm_deadline() {
  # The guest ignores it: stopped after stop_timeout_ms, exit 12, nothing left behind.
  spec sigterm_deadline sleep 1 128 "" "\"stop_timeout_ms\":1000,\"vsock\":{\"uds_path\":\"$W/term2.sock\"},"
  "$SHIM" run --spec "$W/sigterm_deadline.json" --timeout 60 >"$W/sigterm_deadline.out" 2>"$W/sigterm_deadline.err" & pid=$!
  wait_console sigterm_deadline "vessel-event: init"
  kill -TERM "$pid"; wait $pid; echo $? >"$W/sigterm_deadline.rc"
  cat "$W/sigterm_deadline.out"
  rc_is sigterm_deadline 12 && out_has sigterm_deadline '"outcome":"stopped"' && [ ! -e "$W/term2.sock" ]
}
t_sigkill_cleanup() {
  spec sigkill sleep 1 128 "" "\"vsock\":{\"uds_path\":\"$W/kill.sock\"},"
  "$SHIM" run --spec "$W/sigkill.json" --timeout 60 >"$W/sigkill.out" 2>"$W/sigkill.err" & pid=$!
  wait_console sigkill "vessel-event: init"
  kill -KILL "$pid"; wait $pid
  [ -S "$W/kill.sock" ] || return 1
  "$SHIM" cleanup --spec "$W/sigkill.json" && [ ! -e "$W/kill.sock" ]
}
t_bad_kernel() {
  spec bad_kernel init 1 128 /nonexistent/vmlinux; shim_run bad_kernel
  rc_is bad_kernel 1 && grep -q "nonexistent" "$W/bad_kernel.err"
}
t_corrupt_kernel() {
  head -c 100000 /dev/urandom >"$W/corrupt"; spec corrupt_kernel init 1 128 "$W/corrupt"; shim_run corrupt_kernel
  rc_is corrupt_kernel 1 && grep -q "not an ELF vmlinux or x86 bzImage" "$W/corrupt_kernel.err"
}
t_memory_too_large() {
  spec memory_too_large init 1 100000000; shim_run memory_too_large
  rc_is memory_too_large 1 && grep -q "more than this host has" "$W/memory_too_large.err"
}

# --- shim_: the shim's control socket (spare disk slots, log files) and log listener.
shim_wait_sock() { i=0; while [ ! -S "$1" ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done; [ -S "$1" ]; }
t_shim_hotplug() {
  n=shim_hotplug; C="$W/hp.ctl"
  printf 'vessel-hp-AAAAAA' >"$W/hp-a.img"; dd if=/dev/zero of="$W/hp-a.img" bs=1024 seek=1 count=1023 2>/dev/null
  printf 'vessel-hp-BBBBBB' >"$W/hp-b.img"; dd if=/dev/zero of="$W/hp-b.img" bs=1024 seek=1 count=2047 2>/dev/null
  spec $n hotplug 1 128 "" "\"spare_disks\":2,\"control_socket\":\"$C\","
  "$SHIM" run --spec "$W/$n.json" --timeout 60 >"$W/$n.out" 2>"$W/$n.err" & pid=$!
  shim_wait_sock "$C"
  mode=$(stat -c %a "$C" 2>/dev/null)
  ctl() { "$SHIM" ctl --socket "$C" "$@" >>"$W/$n.ctl" 2>&1; }
  ok=yes
  ctl '{"op":"ping"}' || ok=no
  wait_console $n "vessel-event: hotplug-ready"
  # Errors are answers, and leave the slot as it was.
  ctl '{"op":"attach_disk","slot":2,"path":"'"$W"'/hp-a.img"}' && ok=no
  ctl '{"op":"attach_disk","slot":1,"path":"/nonexistent.img","serial":"vessel-hp-a"}' && ok=no
  ctl '{"op":"attach_disk","slot":1,"path":"'"$W"'/hp-a.img","read_only":true,"serial":"vessel-hp-a"}' || ok=no
  wait_console $n "vessel-event: hotplug-a-"
  ctl '{"op":"detach_disk","slot":1}' || ok=no
  ctl '{"op":"attach_disk","slot":1,"path":"'"$W"'/hp-b.img","read_only":true,"serial":"vessel-hp-b"}' || ok=no
  wait $pid; echo $? >"$W/$n.rc"
  cat "$W/$n.out" "$W/$n.ctl"; echo "control socket mode $mode"
  [ $ok = yes ] && [ "$mode" = 600 ] && rc_is $n 0 && out_has $n '"hotplug-ready-0-0":' &&
    out_has $n '"hotplug-a-vdb-2048-vessel-hp-AAAAAA":' && out_has $n '"hotplug-b-vdb-4096-vessel-hp-BBBBBB":' &&
    grep -q '"error":"no spare disk slot 2' "$W/$n.ctl" && grep -q 'nonexistent.img' "$W/$n.ctl" && [ ! -e "$C" ]
}
t_shim_logs() {
  n=shim_logs; C="$W/lg.ctl"; V="$W/lg.sock"
  spec $n logs 1 128 "" "\"control_socket\":\"$C\",\"log_port\":1025,\"vsock\":{\"uds_path\":\"$V\"},"
  "$SHIM" run --spec "$W/$n.json" --timeout 60 >"$W/$n.out" 2>"$W/$n.err" & pid=$!
  shim_wait_sock "$C"
  ok=yes
  [ -S "${V}_1025" ] || ok=no
  "$SHIM" ctl --socket "$C" '{"op":"set_log","id":"ctr-log-1"}' --fd-file "$W/ctr-1.log" >>"$W/$n.ctl" 2>&1 || ok=no
  i=0; while [ "$(wc -l <"$W/ctr-1.log")" -lt 2 ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i+1)); done
  # ReopenContainerLog: the file is rotated, a new one registered; later lines go there.
  mv "$W/ctr-1.log" "$W/ctr-1.log.0"
  "$SHIM" ctl --socket "$C" '{"op":"set_log","id":"ctr-log-1"}' --fd-file "$W/ctr-1.log" >>"$W/$n.ctl" 2>&1 || ok=no
  "$SHIM" vsock-connect --socket "$V" --port 1234 --send go --retry-ms 30000 >/dev/null 2>&1 || ok=no
  wait $pid; echo $? >"$W/$n.rc"
  cat "$W/$n.out" "$W/$n.ctl"; echo "--- first file"; cat "$W/ctr-1.log.0"; echo "--- after reopen"; cat "$W/ctr-1.log"
  printf '%s\n' "2024-01-01T00:00:00.000000001Z stdout F first line" "2024-01-01T00:00:00.000000002Z stderr F second line" >"$W/$n.want0"
  echo "2024-01-01T00:00:00.000000003Z stdout F after reopen" >"$W/$n.want1"
  [ $ok = yes ] && rc_is $n 0 && out_has $n '"logs-sent":' && cmp -s "$W/ctr-1.log.0" "$W/$n.want0" &&
    cmp -s "$W/ctr-1.log" "$W/$n.want1" && [ ! -e "$C" ] && [ ! -e "${V}_1025" ] && [ ! -e "$V" ]
}
# --- vessel-agent in the guest (agent_* tests). Staged by vm-harness.sh: the agent's initrd
# ($D/guest/agent-initrd.img, scripts/build-guest-initrd.sh), the agent binary for its hidden
# debug client ($D/bin/vessel-agent) and a busybox EROFS layer ($D/guest/busybox.erofs).
agent_spec() { # name [extra JSON fields]
  cat >"$W/$1.json" <<EOS
{"kernel":"$D/guest/vmlinux","initrd":"$D/guest/agent-initrd.img","mem_mib":256,"vcpus":1,${2:-}
 "vsock":{"uds_path":"$W/$1.sock"},"console":{"file":"$W/$1.console"},
 "cmdline":"vessel.log=info","verbose":${VERBOSE:-false}}
EOS
}
t_agent_boot() {
  # Boot with the agent as /init, reach it over hybrid vsock, run a container from an EROFS
  # layer disk (overlay, libcontainer, cgroups), get its CRI log lines over vsock and its exit
  # code, then Shutdown powers the guest off.
  [ -f "$D/guest/agent-initrd.img" ] && [ -f "$D/guest/busybox.erofs" ] || { echo "agent files not staged"; return 1; }
  agent_spec agent_boot "\"disks\":[{\"path\":\"$D/guest/busybox.erofs\",\"read_only\":true,\"serial\":\"layer-busybox\"}],"
  "$SHIM" run --spec "$W/agent_boot.json" --timeout 120 >"$W/agent_boot.out" 2>"$W/agent_boot.err" & s=$!
  "$D/bin/vessel-agent" debug-client --hybrid-vsock "$W/agent_boot.sock" --wait-secs 60 run \
    --disk layer-busybox --hostname agent-pod --write-file /run/vessel/files/pod/msg=hello-from-files \
    --bind /run/vessel/files/pod:/pod --shutdown -- \
    sh -c 'echo out-line; echo err-line >&2; cat /pod/msg; echo; hostname; exit 7' >"$W/agent_boot.client" 2>&1
  wait $s; echo $? >"$W/agent_boot.rc"
  cat "$W/agent_boot.client" "$W/agent_boot.out"
  c="$W/agent_boot.client"
  grep -q '^ping ok pid=1 ' "$c" && grep -q '^configured hostname=agent-pod' "$c" &&
    grep -q '^log-id: debug$' "$c" && grep -q '^log: [^ ]* stdout F out-line$' "$c" &&
    grep -q '^log: [^ ]* stderr F err-line$' "$c" && grep -q '^log: [^ ]* stdout F hello-from-files$' "$c" &&
    grep -q '^log: [^ ]* stdout F agent-pod$' "$c" && grep -q '^exit 7$' "$c" && grep -q '^shutdown ok' "$c" &&
    rc_is agent_boot 0 && out_has agent_boot '"outcome":"poweroff"'
}
t_agent_stop() {
  # The shim's stop request (a vessel-stop console line) makes the agent power the guest off.
  agent_spec agent_stop
  "$SHIM" run --spec "$W/agent_stop.json" --timeout 120 >"$W/agent_stop.out" 2>"$W/agent_stop.err" & s=$!
  "$D/bin/vessel-agent" debug-client --hybrid-vsock "$W/agent_stop.sock" --wait-secs 60 ping >"$W/agent_stop.client" 2>&1
  kill -TERM $s; wait $s; echo $? >"$W/agent_stop.rc"
  cat "$W/agent_stop.client" "$W/agent_stop.out"
  grep -q '^ping ok pid=1 ' "$W/agent_stop.client" && rc_is agent_stop 0 && out_has agent_stop '"outcome":"poweroff"'
}
# --- end of agent_* tests

TESTS=${VESSEL_TESTS:-"probe boot_to_init boot_elf smp reboot panic two_vms blk vsock net net_mq sigterm sigterm_deadline sigkill_cleanup bad_kernel corrupt_kernel memory_too_large bad_disk bad_tap"}
[ -n "${VESSEL_TESTS:-}" ] || TESTS="$TESTS shim_hotplug shim_logs agent_boot agent_stop"
for t in $TESTS; do check "$t" "t_$t"; done
echo "$pass passed, $fail failed"
[ $fail = 0 ]
