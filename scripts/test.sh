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
step "cargo build --bins (the VM pod suite stages vesseld, vessel-agent, vessel-shim, vessel-critest)"
cargo build --workspace --bins --locked
step "cargo nextest (unit and end-to-end tests)"
out=$(mktemp)
set +e
cargo nextest run --workspace --locked --profile ci "$@" 2>&1 | tee "$out"
rc=${PIPESTATUS[0]}
set -e
# nextest: "Summary [ 95s] 146 tests run: 146 passed (1 slow), 3 failed, 0 skipped"
summary=$(grep -E '^ *Summary \[' "$out" | tail -1)
rm -f "$out"
n_passed=$(sed -nE 's/.* ([0-9]+) passed.*/\1/p' <<<"$summary")
n_failed=$(sed -nE 's/.* ([0-9]+) failed.*/\1/p' <<<"$summary")
n_skipped=$(sed -nE 's/.* ([0-9]+) skipped.*/\1/p' <<<"$summary")
echo
echo "test.sh: $(( $(date +%s) - start ))s in all; nextest exit code $rc"
if [ $rc -ne 0 ]; then
  echo "tests: ${n_passed:-0} passed, ${n_failed:-1} failed, ${n_skipped:-0} skipped"
  echo "test.sh: FAILED" >&2
  exit $rc
fi
echo "test.sh: all passed"
echo "tests: ${n_passed:-0} passed, ${n_failed:-0} failed, ${n_skipped:-0} skipped"
