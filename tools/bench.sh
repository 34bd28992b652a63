#!/usr/bin/env bash
# The speed benchmark: installs dpbench with the [bench] extra (torch 2.13.0 CPU wheel + Opacus)
# and measures every configuration side by side in one run.
# Usage: bash tools/bench.sh [OUT.md] [extra flags for python -m benchmarks.speed]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-leaderboard/PERF.md}"
shift || true
bash tools/install.sh "[bench]"
export DPBENCH_BENCH_COMMAND="bash tools/bench.sh $out $*"
exec .venv/bin/python -m benchmarks.speed --out="$out" "$@"
