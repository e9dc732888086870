#!/usr/bin/env bash
# Builds vessel's microVM guest kernel from Debian's linux-source-6.1 with the config fragment
# images/guest/guest-kernel.config on top of `tinyconfig`, and caches the result.
#
#   scripts/build-guest-kernel.sh            # build (or reuse) and print the cache directory
#   scripts/build-guest-kernel.sh --print    # print the cache directory a build would use
#
# Cache: /var/cache/vessel/guest-kernel/<key>/{vmlinux,bzImage,config,build-info}, where <key>
# is the sha256 of (linux-source-6.1 package version, fragment contents, this recipe's
# version). VESSEL_KERNEL_CACHE overrides the cache root, VESSEL_KERNEL_FRAGMENT the fragment.
# A second run with the same inputs is a cache hit and prints the same directory. The build
# runs under `nice -n 19 make -j$JOBS` (JOBS defaults to the number of CPUs) and every option
# of the fragment is checked to have stuck after `olddefconfig` (which silently drops options
# whose dependencies are missing).
# The last line on stdout is the cache directory; progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
FRAG=${VESSEL_KERNEL_FRAGMENT:-$ROOT/images/guest/guest-kernel.config}
CACHE_ROOT=${VESSEL_KERNEL_CACHE:-/var/cache/vessel/guest-kernel}
JOBS=${JOBS:-$(nproc)}
RECIPE=1   # bump when the build steps below change what is produced

log() { echo "build-guest-kernel: $*" >&2; }

need_pkgs=(linux-source-6.1 build-essential flex bison libelf-dev libssl-dev bc xz-utils lz4 cpio)
missing=()
for p in "${need_pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

SRC_VERSION=$(dpkg-query -W -f='${Version}' linux-source-6.1)
KEY=$( { echo "linux-source-6.1 $SRC_VERSION"; echo "recipe $RECIPE"; cat "$FRAG"; } | sha256sum | cut -c1-64)
OUT="$CACHE_ROOT/$KEY"
if [ "${1:-}" = "--print" ]; then echo "$OUT"; exit 0; fi

if [ -f "$OUT/bzImage" ] && [ -f "$OUT/vmlinux" ] && [ -f "$OUT/build-info" ]; then
  log "cache hit ($SRC_VERSION): $OUT"
  echo "$OUT"
  exit 0
fi

mkdir -p "$CACHE_ROOT"
exec 9>"$CACHE_ROOT/.lock"
flock 9
if [ -f "$OUT/bzImage" ]; then echo "$OUT"; exit 0; fi   # built by a concurrent run

# The source tree is extracted once per package version and shared by every config (out-of-tree builds).
SRC="$CACHE_ROOT/src-$SRC_VERSION/linux-source-6.1"
if [ ! -f "$SRC/Makefile" ]; then
  log "extracting /usr/src/linux-source-6.1.tar.xz"
  rm -rf "$CACHE_ROOT/src-$SRC_VERSION"
  mkdir -p "$CACHE_ROOT/src-$SRC_VERSION.tmp"
  tar -C "$CACHE_ROOT/src-$SRC_VERSION.tmp" -xf /usr/src/linux-source-6.1.tar.xz
  mv "$CACHE_ROOT/src-$SRC_VERSION.tmp" "$CACHE_ROOT/src-$SRC_VERSION"
fi

BUILD="$CACHE_ROOT/build-$KEY"
rm -rf "$BUILD"; mkdir -p "$BUILD"
start=$(date +%s)
mk() { nice -n 19 make -C "$SRC" O="$BUILD" ARCH=x86_64 "$@"; }

log "configuring: tinyconfig + $(grep -c '^CONFIG_' "$FRAG") fragment options"
mk tinyconfig >"$BUILD/config.log" 2>&1
# Apply the fragment with scripts/config, line by line.
args=()
while IFS= read -r line; do
  case "$line" in ''|'#'*) continue ;; esac
  name=${line%%=*}; val=${line#*=}; name=${name#CONFIG_}
  case "$val" in
    y) args+=(--enable "$name") ;;
    n) args+=(--disable "$name") ;;
    m) args+=(--module "$name") ;;
    \"*\") v=${val#\"}; v=${v%\"}; args+=(--set-str "$name" "$v") ;;
    *) args+=(--set-val "$name" "$val") ;;
  esac
done <"$FRAG"
"$SRC/scripts/config" --file "$BUILD/.config" "${args[@]}"
mk olddefconfig >>"$BUILD/config.log" 2>&1

# Every option of the fragment must have stuck.
bad=0
while IFS= read -r line; do
  case "$line" in ''|'#'*) continue ;; esac
  name=${line%%=*}; val=${line#*=}
  if [ "$val" = n ]; then
    if grep -q "^$name=" "$BUILD/.config"; then
      log "option did not stick: $line (got $(grep "^$name=" "$BUILD/.config"))"; bad=1
    fi
  elif ! grep -qxF "$name=$val" "$BUILD/.config"; then
    got=$(grep -E "^(# )?$name[= ]" "$BUILD/.config" || echo "absent")
    log "option did not stick: $line (got: $got)"; bad=1
  fi
done <"$FRAG"
if [ "$bad" -ne 0 ]; then
  log "FAILED: the config fragment does not apply cleanly (missing dependencies?); fix $FRAG"
  rm -rf "$BUILD"
  exit 1
fi

log "building vmlinux + bzImage with nice -n 19 make -j$JOBS (several minutes)"
if ! mk -j"$JOBS" vmlinux bzImage >"$BUILD/build.log" 2>&1; then
  tail -40 "$BUILD/build.log" >&2
  log "FAILED: make (full log: $BUILD/build.log)"
  exit 1
fi
secs=$(( $(date +%s) - start ))

TMP="$OUT.tmp"
rm -rf "$TMP"; mkdir -p "$TMP"
cp "$BUILD/vmlinux" "$TMP/vmlinux"
cp "$BUILD/arch/x86/boot/bzImage" "$TMP/bzImage"
cp "$BUILD/.config" "$TMP/config"
cp "$FRAG" "$TMP/fragment.config"
{
  echo "source=linux-source-6.1 $SRC_VERSION"
  echo "release=$(cat "$BUILD/include/config/kernel.release")"
  echo "build_seconds=$secs"
  echo "jobs=$JOBS"
  echo "vmlinux_bytes=$(stat -c %s "$TMP/vmlinux")"
  echo "bzImage_bytes=$(stat -c %s "$TMP/bzImage")"
  echo "built_at=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$TMP/build-info"
rm -rf "$OUT"; mv "$TMP" "$OUT"
rm -rf "$BUILD"
log "built in ${secs}s: $(tr '\n' ' ' <"$OUT/build-info")"
echo "$OUT"
