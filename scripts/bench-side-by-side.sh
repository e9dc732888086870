#!/usr/bin/env bash
# vessel against containerd + runc on this machine, in one command:
#
#   sudo scripts/bench-side-by-side.sh            # extra arguments go to the bench binary
#   sudo scripts/bench-side-by-side.sh critest    # upstream critest -benchmark instead
#
# Starts a private containerd (scripts/containerd-bench.sh start: installs Debian's containerd,
# runc and containernetworking-plugins if missing), runs the lifecycle benchmark against vessel
# and that containerd in alternation (PullImage, every pod/container RPC, from scratch, pods/s
# at concurrency 1, 4 and 16, per-pod and daemon memory), then stops containerd and removes its
# state, mounts and bridge, whatever the bench did. The table goes to stdout and the JSON to
# benches/results/lifecycle-side-by-side-<host>-<date>.json. VESSEL_BENCH_RUNS overrides the
# number of runs (20); VESSELD=/path/to/vesseld measures a prebuilt daemon (with its
# vessel-agent sibling). Run it on a quiet machine: the result records the load average.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" -eq 0 ] || { echo "bench-side-by-side: run as root (sudo $0)" >&2; exit 1; }

scripts/containerd-bench.sh start
trap 'scripts/containerd-bench.sh stop' EXIT
BENCH=lifecycle
if [ "${1:-}" = critest ]; then
  BENCH=critest
  shift
fi
VESSEL_BENCH_CONTAINERD="$(scripts/containerd-bench.sh endpoint)" \
  cargo bench -p vessel-benches --bench "$BENCH" -- "$@"
