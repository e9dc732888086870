#!/usr/bin/env bash
# Runs vessel's whole test suite: formatting, lints, unit tests and the end-to-end tests
# (a real vesseld driven over its CRI socket, images from a real docker-registry on 127.0.0.1).
# Run as root: the tests mount overlayfs and chown files as image layers ask.
set -euo pipefail
cd "$(dirname "$0")/.."

[ "$(id -u)" -eq 0 ] || { echo "test.sh: run as root (tests mount overlayfs, set file owners)" >&2; exit 1; }

start=$(date +%s)
bash scripts/deps.sh

step() { echo; echo "==> $*"; }
step "cargo fmt --check"
cargo fmt --all --check
step "cargo clippy (warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings
step "guest kernel for the VM suite (built once, then cached by content hash)"
# The nested VM suite (shim/tests/vm_suite.rs) runs inside QEMU/TCG with our guest kernel;
# a fresh machine builds it here (5-20 minutes), later runs hit the cache.
bash scripts/build-guest-kernel.sh | tail -1
step "cargo nextest (unit and end-to-end tests)"
set +e
cargo nextest run --workspace --locked --profile ci "$@"
rc=$?
set -e
echo
echo "test.sh: $(( $(date +%s) - start ))s in all; nextest exit code $rc"
if [ $rc -ne 0 ]; then
  echo "test.sh: FAILED" >&2
  exit $rc
fi
echo "test.sh: all passed"
