#!/usr/bin/env bash
# A private containerd + runc for side-by-side benchmarks against vessel
# (`cargo bench -p vessel-benches --bench lifecycle` with VESSEL_BENCH_CONTAINERD set; see
# benches/README.md, or run scripts/bench-side-by-side.sh, which does all of it).
#
#   sudo scripts/containerd-bench.sh start    # install (idempotent), configure, start, load pause
#   sudo scripts/containerd-bench.sh stop     # stop pods, containerd and shims; remove all state
#   sudo scripts/containerd-bench.sh status
#   scripts/containerd-bench.sh endpoint      # prints unix:///run/vessel-bench-containerd/containerd.sock
#   sudo scripts/containerd-bench.sh mirror registry.k8s.io http://127.0.0.1:5000
#
# Everything is private to this script and never touches a system containerd:
#   state, socket, CNI conf: /run/vessel-bench-containerd
#   root (content, snapshots): /var/lib/vessel-bench-containerd
#   CNI: Debian's /usr/lib/cni plugins, the chain vessel's critest bench runs: `bridge`
#        (vbench0, gateway, no masquerade, hairpin) + host-local IPAM (10.217.0.0/24) and
#        `portmap`; containerd's CRI adds `loopback` itself. (The lifecycle bench's vessel
#        runs pods without CNI, so there containerd's pod start/stop includes a veth + bridge
#        set-up that vessel's does not; the critest bench gives both the same chain.)
#   cgroups: cgroupfs (SystemdCgroup = false); restrict_oom_score_adj = true, since root here
#        may lack CAP_SYS_RESOURCE.
#   sandbox (pause) image: no registry is reachable, so `start` builds one locally and imports
#        it with `ctr -n k8s.io images import`: a `docker save` archive of one layer holding
#        Debian's static busybox (busybox-static) as /bin/busybox, entrypoint
#        `/bin/busybox sleep 2147483647`, tagged vessel.invalid/bench/pause:1. containerd kills the
#        sandbox with SIGKILL on StopPodSandbox, so no signal handling is needed.
#   registries: `config_path` hosts dirs under the state dir; containerd pulls plain HTTP from
#        loopback registries (127.0.0.1:<port>, as the bench's docker-registry) without one.
set -euo pipefail

NAME=vessel-bench-containerd
STATE=/run/$NAME
ROOT=/var/lib/$NAME
SOCK=$STATE/containerd.sock
CONFIG=$STATE/config.toml
PIDFILE=$STATE/containerd.pid
LOG=$STATE/containerd.log
CNI_CONF=$STATE/cni
CNI_DATA=$STATE/cni-ipam
HOSTS_DIR=$STATE/certs.d
BRIDGE=vbench0
PAUSE_IMAGE=vessel.invalid/bench/pause:1
BUSYBOX=/bin/busybox
PKGS=(containerd runc containernetworking-plugins busybox-static)

die() { echo "containerd-bench: $*" >&2; exit 1; }
need_root() { [ "$(id -u)" -eq 0 ] || die "run as root (sudo $0 $*)"; }
ctr_() { ctr --address "$SOCK" -n k8s.io "$@"; }

running() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

install_pkgs() {
  local missing=()
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "containerd-bench: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
  # Debian's package starts the system containerd where systemd runs; ours is separate either
  # way (own socket, state and root), so it is left alone.
}

write_config() {
  mkdir -p "$STATE" "$ROOT" "$CNI_CONF" "$CNI_DATA" "$HOSTS_DIR"
  cat >"$CONFIG" <<EOF
# Written by scripts/containerd-bench.sh: a private containerd for vessel's benchmarks.
version = 2
root = "$ROOT"
state = "$STATE"

[grpc]
  address = "$SOCK"

[ttrpc]
  address = "$SOCK.ttrpc"

[debug]
  address = ""
  level = "info"

[metrics]
  address = ""

[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = "$ROOT/opt"
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "$PAUSE_IMAGE"
    restrict_oom_score_adj = true
    disable_apparmor = true
    enable_selinux = false
    netns_mounts_under_state_dir = true
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
    enable_cdi = false
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = false
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "$CNI_CONF"
      max_conf_num = 1
    [plugins."io.containerd.grpc.v1.cri".registry]
      config_path = "$HOSTS_DIR"
EOF
  # The chain vessel's test and bench networks run (critest daemon::TestCni), less loopback,
  # which containerd's CRI sets up itself.
  cat >"$CNI_CONF/10-vessel-bench.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "vessel-bench",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "dataDir": "$CNI_DATA",
        "ranges": [[{ "subnet": "10.217.0.0/24" }]],
        "routes": [{ "dst": "0.0.0.0/0" }]
      }
    },
    { "type": "portmap", "capabilities": { "portMappings": true } }
  ]
}
EOF
}

# Registry host $1 pulled from $2 (http://127.0.0.1:PORT) instead: a hosts.toml in our
# config_path, which containerd reads at each pull.
mirror() {
  need_root mirror
  [ -n "${1:-}" ] && [ -n "${2:-}" ] || die "usage: $0 mirror HOST URL"
  mkdir -p "$HOSTS_DIR/$1"
  cat >"$HOSTS_DIR/$1/hosts.toml" <<EOF
server = "$2"

[host."$2"]
  capabilities = ["pull", "resolve"]
  skip_verify = true
EOF
}

# A `docker save` archive of the pause image, on stdout.
pause_archive() {
  [ -x "$BUSYBOX" ] || die "$BUSYBOX missing (apt-get install busybox-static)"
  local d
  d=$(mktemp -d)
  mkdir -p "$d/rootfs/bin"
  cp "$BUSYBOX" "$d/rootfs/bin/busybox"
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$d/rootfs" -cf "$d/layer.tar" bin
  local diff cfg cfgid
  diff=$(sha256sum "$d/layer.tar" | cut -d' ' -f1)
  cfg='{"architecture":"amd64","os":"linux","created":"1970-01-01T00:00:00Z","config":{"Entrypoint":["/bin/busybox","sleep","2147483647"]},"rootfs":{"type":"layers","diff_ids":["sha256:'$diff'"]}}'
  printf '%s' "$cfg" >"$d/config.json"
  cfgid=$(sha256sum "$d/config.json" | cut -d' ' -f1)
  mv "$d/config.json" "$d/$cfgid.json"
  printf '[{"Config":"%s.json","RepoTags":["%s"],"Layers":["layer.tar"]}]' "$cfgid" "$PAUSE_IMAGE" >"$d/manifest.json"
  tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$d" -cf - manifest.json "$cfgid.json" layer.tar
  rm -rf "$d"
}

start() {
  need_root start
  if running; then
    echo "containerd-bench: already running (pid $(cat "$PIDFILE")), $SOCK"
    return 0
  fi
  install_pkgs
  write_config
  rm -f "$SOCK" "$SOCK.ttrpc"
  setsid containerd --config "$CONFIG" >>"$LOG" 2>&1 </dev/null &
  echo $! >"$PIDFILE"
  for _ in $(seq 1 200); do
    [ -S "$SOCK" ] && ctr --address "$SOCK" version >/dev/null 2>&1 && break
    running || { tail -n 30 "$LOG" >&2; die "containerd exited; log: $LOG"; }
    sleep 0.1
  done
  [ -S "$SOCK" ] || { tail -n 30 "$LOG" >&2; die "containerd did not serve $SOCK"; }
  pause_archive | ctr_ images import - >/dev/null
  ctr_ images ls -q | grep -qx "$PAUSE_IMAGE" || die "pause image not imported"
  echo "containerd-bench: $(containerd --version | awk '{print $3}') + runc $(runc --version | awk 'NR==1{print $3}') on unix://$SOCK (pid $(cat "$PIDFILE"), log $LOG)"
}

# Mount points at or below $1, deepest first.
mounts_under() {
  awk -v p="$1" '$5 == p || index($5, p "/") == 1 { print $5 }' /proc/self/mountinfo | awk '{ print length, $0 }' | sort -rn | cut -d' ' -f2-
}

# PIDs of containerd shims serving our containerd (their command line names our socket).
our_shims() {
  local p cmd
  for p in /proc/[0-9]*; do
    case "$(cat "$p/comm" 2>/dev/null)" in containerd-shim*) ;; *) continue ;; esac
    cmd=$(tr '\0' ' ' 2>/dev/null <"$p/cmdline") || continue
    case "$cmd" in *"-address $SOCK "*) echo "${p#/proc/}" ;; esac
  done
  return 0
}

stop() {
  need_root stop
  if running && [ -S "$SOCK" ]; then
    # Tasks first (pods and containers), so no container process outlives its shim.
    for t in $(ctr_ tasks ls -q 2>/dev/null); do
      ctr_ tasks kill -s SIGKILL "$t" >/dev/null 2>&1 || true
    done
    for t in $(ctr_ tasks ls -q 2>/dev/null); do
      for _ in $(seq 1 50); do
        ctr_ tasks delete "$t" >/dev/null 2>&1 && break
        sleep 0.1
      done
    done
    for c in $(ctr_ containers ls -q 2>/dev/null); do
      ctr_ containers delete "$c" >/dev/null 2>&1 || true
    done
  fi
  if running; then
    local pid
    pid=$(cat "$PIDFILE")
    kill -TERM "$pid"
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  fi
  rm -f "$PIDFILE"
  # Shims of ours that outlived containerd (they name our socket on their command line).
  for pid in $(our_shims); do
    kill -KILL "$pid" 2>/dev/null || true
  done
  sleep 0.2
  for d in "$STATE" "$ROOT"; do
    for m in $(mounts_under "$d"); do
      umount -l "$m" 2>/dev/null || true
    done
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  rm -rf "$STATE" "$ROOT"
  local left
  left=$(grep -c "$NAME" /proc/self/mountinfo || true)
  [ "$left" = 0 ] || die "$left mounts still under $NAME"
  echo "containerd-bench: stopped, state removed"
}

status() {
  if running; then
    echo "running: pid $(cat "$PIDFILE"), unix://$SOCK"
  else
    echo "not running"
    return 1
  fi
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  endpoint) echo "unix://$SOCK" ;;
  mirror) shift; mirror "$@" ;;
  *) echo "usage: $0 start|stop|status|endpoint|mirror HOST URL" >&2; exit 2 ;;
esac
