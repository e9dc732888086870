#!/usr/bin/env bash
# Installs vessel on a Debian machine and starts vesseld with its default configuration.
#   - Debian packages (scripts/deps.sh), a release build,
#     /usr/local/bin/{vesseld,vessel-agent,vessel-shim}
#   - the kernel modules vessel needs (overlay; tun for VM pods), now and at boot
#   - the microVM guest kernel and initrd (built, cached by content hash) in
#     /usr/local/share/vessel/guest/ (VESSEL_NO_VM=1 skips them: flat pods only)
#   - /etc/vessel/config.toml from `vesseld config default` (an existing one is kept)
#   - starts vesseld: as a systemd service where systemd runs, else as a detached daemon
#     logging to /var/log/vessel/vesseld.log
set -euo pipefail
# Root is needed; a user with sudo is asked for it, and root needs no sudo installed.
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then exec sudo bash "$(readlink -f "$0")" "$@"; fi
  echo "install.sh: run as root (vesseld manages mounts and namespaces)" >&2
  exit 1
fi
cd "$(dirname "$0")/.."

bash scripts/deps.sh
cargo build --release --locked -p vessel-cri -p vessel-agent -p vessel-shim
install -D -m 0755 target/release/vesseld /usr/local/bin/vesseld
install -D -m 0755 target/release/vessel-agent /usr/local/bin/vessel-agent
install -D -m 0755 target/release/vessel-shim /usr/local/bin/vessel-shim
# Kernel modules: overlay (containers' root filesystems) and, for VM pods, tun (their taps on
# the pod network). Loaded now and at every boot; one that is built in needs nothing, and one
# that cannot load is reported (vesseld doctor says what the node lacks).
MODULES="overlay"
[ "${VESSEL_NO_VM:-0}" != 1 ] && MODULES="$MODULES tun"
mkdir -p /etc/modules-load.d
printf '%s\n' $MODULES > /etc/modules-load.d/vessel.conf
for m in $MODULES; do
  if [ ! -e "/sys/module/$m" ] && ! modprobe "$m" 2>/dev/null; then
    echo "install: kernel module $m did not load (built in, or not available)" >&2
  fi
done
if [ "${VESSEL_NO_VM:-0}" != 1 ]; then
  # A failure here leaves flat pods working; vesseld's Status says what VM pods lack.
  if KDIR=$(bash scripts/build-guest-kernel.sh | tail -1) &&
     INITRD=$(bash scripts/build-guest-initrd.sh target/release/vessel-agent | tail -1) &&
     ROOTFS=$(FORMAT=erofs bash scripts/build-guest-initrd.sh target/release/vessel-agent | tail -1); then
    install -D -m 0644 "$KDIR/vmlinux" /usr/local/share/vessel/guest/vmlinux
    install -D -m 0644 "$INITRD" /usr/local/share/vessel/guest/initrd.img
    install -D -m 0644 "$ROOTFS" /usr/local/share/vessel/guest/rootfs.erofs
    echo "install: guest kernel and initrd in /usr/local/share/vessel/guest"
  else
    echo "install: building the guest kernel or initrd failed; VM pods are unavailable (flat pods work)" >&2
  fi
fi
mkdir -p /etc/vessel /var/log/vessel
if [ ! -f /etc/vessel/config.toml ]; then
  /usr/local/bin/vesseld config default > /etc/vessel/config.toml
  echo "install: wrote /etc/vessel/config.toml"
fi
/usr/local/bin/vesseld --config /etc/vessel/config.toml config check >/dev/null

SOCK=$(/usr/local/bin/vesseld --config /etc/vessel/config.toml config check | sed -n 's/^socket = "\(.*\)"$/\1/p' | head -1)

if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
  install -D -m 0644 docs/vessel.service /etc/systemd/system/vessel.service
  systemctl daemon-reload
  systemctl enable vessel.service >/dev/null
  systemctl restart vessel.service
else
  # No systemd: replace a running vesseld started by an earlier install.
  if [ -f /run/vessel/vesseld.pid ] && kill -0 "$(cat /run/vessel/vesseld.pid)" 2>/dev/null; then
    kill -TERM "$(cat /run/vessel/vesseld.pid)"
    for _ in $(seq 100); do kill -0 "$(cat /run/vessel/vesseld.pid)" 2>/dev/null || break; sleep 0.1; done
  fi
  mkdir -p /run/vessel
  setsid /usr/local/bin/vesseld --config /etc/vessel/config.toml serve \
    </dev/null >>/var/log/vessel/vesseld.log 2>&1 &
  echo $! > /run/vessel/vesseld.pid
fi

for _ in $(seq 200); do
  [ -S "$SOCK" ] && break
  sleep 0.05
done
if [ ! -S "$SOCK" ]; then
  echo "install: vesseld did not come up; see /var/log/vessel/vesseld.log or journalctl -u vessel" >&2
  tail -20 /var/log/vessel/vesseld.log 2>/dev/null >&2 || true
  exit 1
fi
echo "install: vesseld is serving CRI on unix://$SOCK"
