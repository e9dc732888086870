#!/usr/bin/env bash
# Makes sure a CRIU that works on this kernel is on PATH (CheckpointContainer of flat pods).
#
# Debian bookworm's criu (3.17) cannot initialise on kernels whose vDSO has the split
# vvar/vvar_vclock layout (6.x; "Unexpected rt vDSO area bounds"), and 4.1 cannot dump an
# inet socket on 6.16+ (SO_PASSSEC is refused there), so where `criu check` fails, CRIU
# 4.2.1 is built from Debian's own source (sid's orig tarball, checksum pinned) and
# installed as /usr/local/sbin/criu. Idempotent: a working criu is left alone.
set -euo pipefail

VERSION=4.2.1
SHA256=29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9
URL="http://deb.debian.org/debian/pool/main/c/criu/criu_${VERSION}.orig.tar.xz"
BUILD_DEPS=(libbsd-dev libcap-dev libgnutls28-dev libnet1-dev libnftables-dev libnl-3-dev
  libprotobuf-c-dev libprotobuf-dev pkgconf protobuf-c-compiler protobuf-compiler uuid-dev
  python3-protobuf build-essential curl xz-utils)

export PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH"
# `criu check` passes for 4.1 on kernels it cannot dump sockets on: older ones are rebuilt.
have=$(criu --version 2>/dev/null | sed -n 's/^Version: //p' || true)
if [ -n "$have" ] && [ "$(printf '%s\n%s\n' 4.2 "$have" | sort -V | head -1)" = 4.2 ] &&
  criu check >/dev/null 2>&1; then
  echo "criu: $(criu --version | head -1) works here ($(command -v criu))"
  exit 0
fi
echo "criu: none that works on $(uname -r); building CRIU $VERSION from Debian's source"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
missing=()
for p in "${BUILD_DEPS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
curl -fsS --retry 3 -o "$work/criu.tar.xz" "$URL"
echo "$SHA256  $work/criu.tar.xz" | sha256sum -c --quiet
tar -C "$work" -xf "$work/criu.tar.xz"
make -C "$work/criu-$VERSION" -j"$(nproc)" criu >"$work/build.log" 2>&1 || {
  tail -40 "$work/build.log"
  echo "criu: build failed" >&2
  exit 1
}
$SUDO install -m 0755 "$work/criu-$VERSION/criu/criu" /usr/local/sbin/criu
if ! /usr/local/sbin/criu check; then
  echo "criu: CRIU $VERSION does not work on this kernel either; checkpoints will be refused" >&2
  exit 0
fi
echo "criu: installed $(/usr/local/sbin/criu --version | head -1) as /usr/local/sbin/criu"
