#!/usr/bin/env bash
# Runs vessel's whole test suite: formatting, lints, unit tests and the end-to-end tests
# (a real vesseld driven over its CRI socket, images from a real docker-registry on 127.0.0.1).
# Run as root: the tests mount overlayfs and chown files as image layers ask.
set -euo pipefail
# Root is needed; a user with sudo is asked for it, and root needs no sudo installed.
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then exec sudo bash "$(readlink -f "$0")" "$@"; fi
  echo "test.sh: run as root (tests mount overlayfs, set file owners)" >&2
  exit 1
fi
cd "$(dirname "$0")/.."

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
# The nested suites' harness builds the same way (a no-op after this), so that no compile
# runs inside a timed test.
cargo build --workspace --bins --locked
step "upstream critest and crictl (cri-tools v1.36.0, built once, then cached) and their stand-in images"
# upstream_critest runs them against vesseld; without ../shared/cri-tools it prints SKIP.
SHARED_CRI_TOOLS=${VESSEL_CRI_TOOLS_SRC:-$(cd .. && pwd)/shared/cri-tools}
if [ -x "$SHARED_CRI_TOOLS/build.sh" ]; then
  export VESSEL_CRI_TOOLS_SRC=$SHARED_CRI_TOOLS
  VESSEL_CRI_TOOLS_BIN=$(bash "$SHARED_CRI_TOOLS/build.sh" | tail -n1)
  VESSEL_CRI_TOOLS_IMAGES=$(bash "$SHARED_CRI_TOOLS/images/build.sh" | tail -n1)
  export VESSEL_CRI_TOOLS_BIN VESSEL_CRI_TOOLS_IMAGES
  echo "critest and crictl: $VESSEL_CRI_TOOLS_BIN; images: $VESSEL_CRI_TOOLS_IMAGES"
else
  echo "no $SHARED_CRI_TOOLS/build.sh: the upstream critest test will print SKIP"
fi
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
step "coverage-guided fuzzing: every target ${VESSEL_FUZZ_SECONDS:-20}s from the committed seeds (scripts/fuzz.sh)"
if ! bash scripts/fuzz.sh "${VESSEL_FUZZ_SECONDS:-20}"; then
  echo "tests: ${n_passed:-0} passed, 0 failed, ${n_skipped:-0} skipped; fuzzing FAILED"
  echo "test.sh: FAILED (fuzzing: a target did not build, or found a crash in images/fuzz/artifacts/; see above)" >&2
  exit 1
fi
echo
echo "test.sh: $(( $(date +%s) - start ))s in all"
echo "test.sh: all passed"
echo "tests: ${n_passed:-0} passed, ${n_failed:-0} failed, ${n_skipped:-0} skipped"
