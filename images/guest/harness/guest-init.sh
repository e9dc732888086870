#!/bin/busybox sh
# /init of the harness's test guest (L2). The test to run comes from the kernel command line
# (`vessel.test=NAME`); results are `vessel-event: ...` lines on the console, which the VMM
# timestamps and reports, and the guest's outcome (poweroff, reboot, panic).
echo "vessel-event: init"
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
t=$(sed -n 's/.*vessel\.test=\([^ ]*\).*/\1/p' /proc/cmdline)
case "$t" in
  init|poweroff) poweroff -f ;;
  reboot) reboot -f ;;
  panic) exit 3 ;;   # PID 1 exiting panics the kernel
  smp)
    echo "vessel-event: cpus-$(grep -c ^processor /proc/cpuinfo)"
    poweroff -f ;;
  blk)
    echo "vessel-event: blk-ro-$(head -c 13 /dev/vda)"
    echo "vessel-event: blk-serial-$(cat /sys/block/vda/serial)"
    if echo x | dd of=/dev/vda conv=fsync 2>/dev/null; then echo "vessel-event: blk-ro-accepted-write"; fi
    echo vessel-blk-written | dd of=/dev/vdb conv=fsync 2>/dev/null && echo "vessel-event: blk-written"
    poweroff -f ;;
  net)
    ip link set lo up
    ip addr add 10.0.2.2/24 dev eth0 && ip link set eth0 up
    echo "vessel-event: net-mac-$(cat /sys/class/net/eth0/address)"
    if ping -c 1 -W 5 10.0.2.1 >/dev/null 2>&1; then echo "vessel-event: net-ping-ok"; fi
    poweroff -f ;;
  net_mq)
    # A pod network with a multiqueue tap and two vCPUs: the driver enabled both queue
    # pairs, and each CPU's TX queue reaches the host (XPS maps tx-N to CPU N).
    ip link set lo up
    ip addr add 10.0.3.2/24 dev eth0 && ip link set eth0 up
    set -- /sys/class/net/eth0/queues/rx-*
    echo "vessel-event: net-queues-$#"
    # The driver sets its queue counts before the device answers VQ_PAIRS_SET, and only
    # complains if the answer is an error.
    dmesg | grep -q "Fail to set num of queue pairs" && echo "vessel-event: net-mq-refused"
    ok=yes
    for cpu in 1 2; do taskset "$cpu" ping -c 2 -W 5 10.0.3.1 >/dev/null 2>&1 || ok=no; done
    [ $ok = yes ] && echo "vessel-event: net-ping-ok"
    poweroff -f ;;
  bench)
    /bin/vsock-echo listen 1234 >/dev/null
    /bin/vsock-echo listen 1235 >/dev/null
    poweroff -f ;;
  stop)
    # The VMM's stop request arrives as a console line (vessel-stop), like a power button.
    echo "vessel-event: waiting-stop"
    while read -r line; do case "$line" in *vessel-stop*) break ;; esac; done </dev/console
    echo "vessel-event: stop-requested"
    poweroff -f ;;
  dmesg)
    dmesg
    poweroff -f ;;
  sleep)
    sleep 1000 ;;
  vsock)
    /bin/vsock-echo listen 1234 &
    l=$!
    echo "vessel-event: vsock-guest-reply-$(/bin/vsock-echo connect 5678 hello-from-guest)"
    wait $l
    /bin/vsock-echo listen 1236 >/dev/null && echo "vessel-event: vsock-bulk-done"
    poweroff -f ;;
  hotplug)
    # Spare disk slots filled by the host through the shim's control socket: wait for a vdX
    # with the serial and a non-zero size (the capacity comes with a config-change interrupt).
    hp_find() {
      for b in /sys/block/vd*; do
        [ "$(cat "$b/serial" 2>/dev/null)" = "$1" ] && [ "$(cat "$b/size")" != 0 ] &&
          { echo "${b##*/}"; return 0; }
      done
      return 1
    }
    hp_wait() { i=0; while [ $i -lt 1500 ]; do hp_find "$1" && return 0; sleep 0.02; i=$((i+1)); done; return 1; }
    hp_read() { # dev: drop cached blocks, then size and marker
      /bin/busybox blockdev --flushbufs "/dev/$1"; echo 3 >/proc/sys/vm/drop_caches
      echo "$1-$(cat "/sys/block/$1/size")-$(head -c 16 "/dev/$1")"
    }
    echo "vessel-event: hotplug-ready-$(cat /sys/block/vda/size)-$(cat /sys/block/vdb/size)"
    d=$(hp_wait vessel-hp-a) && echo "vessel-event: hotplug-a-$(hp_read "$d")"
    d=$(hp_wait vessel-hp-b) && echo "vessel-event: hotplug-b-$(hp_read "$d")"
    poweroff -f ;;
  logs)
    # Container logs to the host (vsock port 1025): the id line, then lines; the second part
    # only after the host connected to port 1234 (it has reopened the log file by then).
    {
      echo ctr-log-1
      echo "2024-01-01T00:00:00.000000001Z stdout F first line"
      echo "2024-01-01T00:00:00.000000002Z stderr F second line"
      /bin/vsock-echo listen 1234 >/dev/null
      echo "2024-01-01T00:00:00.000000003Z stdout F after reopen"
    } | /bin/vsock-echo send 1025 && echo "vessel-event: logs-sent"
    poweroff -f ;;
  *)
    echo "vessel-event: unknown-test-$t"
    poweroff -f ;;
esac
