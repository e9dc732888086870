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
  *)
    echo "vessel-event: unknown-test-$t"
    poweroff -f ;;
esac
