#!/usr/bin/env bash
# Installs vessel on a Debian machine and starts vesseld with its default configuration.
#   - Debian packages (scripts/deps.sh), a release build, /usr/local/bin/{vesseld,vessel-agent}
#   - /etc/vessel/config.toml from `vesseld config default` (an existing one is kept)
#   - starts vesseld: as a systemd service where systemd runs, else as a detached daemon
#     logging to /var/log/vessel/vesseld.log
set -euo pipefail
cd "$(dirname "$0")/.."

[ "$(id -u)" -eq 0 ] || { echo "install.sh: run as root (vesseld manages mounts and namespaces)" >&2; exit 1; }

bash scripts/deps.sh
cargo build --release --locked -p vessel-cri -p vessel-agent
install -D -m 0755 target/release/vesseld /usr/local/bin/vesseld
install -D -m 0755 target/release/vessel-agent /usr/local/bin/vessel-agent
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
