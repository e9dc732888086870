#!/usr/bin/env bash
# Installs the Debian packages vessel needs to build, run and test.
# Idempotent: packages already present are skipped without touching apt.
set -euo pipefail

PKGS=(
  protobuf-compiler   # protoc: the CRI and agent gRPC bindings are generated at build time
  pkg-config
  busybox-static      # test images are built from Debian's busybox
  docker-registry     # the real OCI registry the tests pull from (127.0.0.1 only)
  erofs-utils         # mkfs.erofs: per-layer block images for VM pods
  libseccomp-dev      # seccomp for containers (youki libcontainer)
  iproute2
  containernetworking-plugins  # CNI plugins in /usr/lib/cni (bridge, host-local, portmap, ...)
  iptables            # the portmap and bridge (ipMasq) CNI plugins program iptables
  ca-certificates
  # the microVM guest kernel build (scripts/build-guest-kernel.sh)
  linux-source-6.1 build-essential flex bison libelf-dev libssl-dev bc xz-utils lz4 cpio
  # the nested VM test harness (scripts/vm-harness.sh): QEMU/TCG boots a Debian kernel (L1)
  qemu-system-x86 linux-image-cloud-amd64 kmod
  binutils            # strip: `vm-harness.sh pods` strips the debug binaries it puts in L1
  apparmor socat      # `vm-harness.sh pods`: AppArmor's parser and profiles go into L1; socat talks to QEMU's monitor
  systemd             # the systemd cgroup driver's tests boot it in namespaces of their own
)

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ "${#missing[@]}" -gt 0 ]; then
  echo "deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  # Debian starts docker-registry as a system service on install; vessel's tests start their
  # own instances on loopback, so the packaged one is not wanted.
  if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now docker-registry >/dev/null 2>&1 || true
  fi
else
  echo "deps: all present"
fi

if ! command -v cargo-nextest >/dev/null && ! cargo nextest --version >/dev/null 2>&1; then
  echo "deps: installing cargo-nextest"
  cargo install --locked cargo-nextest
fi
# Coverage-guided fuzzing (scripts/fuzz.sh, run by scripts/test.sh).
if ! command -v cargo-fuzz >/dev/null; then
  echo "deps: installing cargo-fuzz"
  cargo install --locked cargo-fuzz --version 0.13.2
fi
# CRIU for CheckpointContainer (flat pods): one that works on this kernel.
bash "$(dirname "$0")/criu.sh"
