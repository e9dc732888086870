#!/usr/bin/env bash
# Coverage-guided fuzzing (libFuzzer, through cargo-fuzz) of what vessel reads from others:
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]
#
# Targets (images/fuzz/fuzz_targets): layer_unpack (image layer tar streams), registry_input
# (references, digests, auth challenges, platforms, manifests, indexes, image configs),
# spdy_decode (streaming clients' SPDY frames), container_request (CRI container and pod
# configs to OCI specs), agent_spec (the OCI spec the pod agent prepares for libcontainer).
# Each runs SECONDS (default 20) from the committed seeds
# (images/fuzz/corpus/<target>), with AddressSanitizer, new inputs kept in a scratch corpus
# (VESSEL_FUZZ_CORPUS, default a temp dir); a crash, leak or panic fails the run, and its
# input is kept under images/fuzz/artifacts/<target>/. cargo-fuzz comes from crates.io
# (scripts/deps.sh). The sanitizer flags are unstable options of rustc: RUSTC_BOOTSTRAP lets
# the stable toolchain take them.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-20}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(layer_unpack registry_input spdy_decode container_request agent_spec)
command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz --version 0.13.2
export RUSTC_BOOTSTRAP=1
if [ -n "${VESSEL_FUZZ_CORPUS:-}" ]; then
  scratch=$VESSEL_FUZZ_CORPUS
else
  scratch=$(mktemp -d /tmp/vessel-fuzz.XXXXXX)
  trap 'rm -rf "$scratch"' EXIT
fi
cd images
echo "fuzz: building the targets (release, sanitizer coverage, AddressSanitizer)"
cargo fuzz build -O
failed=()
for t in "${targets[@]}"; do
  mkdir -p "$scratch/$t" "fuzz/artifacts/$t"
  log="$scratch/$t.log"
  echo "fuzz: $t for ${secs}s"
  # The scratch corpus first: new inputs go there, the committed seeds stay as they are.
  # The targets' own temp files (an image root, layer directories) go under the scratch
  # directory too: libFuzzer exits without running destructors.
  mkdir -p "$scratch/tmp"
  if TMPDIR="$scratch/tmp" cargo fuzz run -O "$t" "$scratch/$t" "fuzz/corpus/$t" -- \
      -max_total_time="$secs" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
      -artifact_prefix="fuzz/artifacts/$t/" >"$log" 2>&1; then
    echo "fuzz: $t: $(grep -E 'DONE' "$log" | tail -1 | tr -s '\t ' ' ')"
  else
    echo "fuzz: $t FAILED; the end of its log:"
    tail -n 40 "$log"
    failed+=("$t")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]} (inputs under images/fuzz/artifacts/)" >&2
  exit 1
fi
echo "fuzz: all ${#targets[@]} targets ran ${secs}s each without a crash"
