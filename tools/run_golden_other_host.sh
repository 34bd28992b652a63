#!/usr/bin/env bash
# The golden checks (tests/test_pipelines.py) and the committed boards' regeneration as another
# x86-64 host would run them: XLA, numpy and OpenBLAS are told to compute like a different CPU
# (dpbench/numerics.py other_host_env), so the golden checks go through their cross-host
# tolerances instead of the exact hashes, and a host-bound expectation fails here on every
# machine. Run by .ci/run after the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash tools/install.sh "[test]"
eval "$(.venv/bin/python -m dpbench.numerics 2>/dev/null)"
export DPBENCH_GOLDEN_OTHER_HOST=1
echo "simulated other host: XLA_FLAGS=$XLA_FLAGS NPY_DISABLE_CPU_FEATURES=$NPY_DISABLE_CPU_FEATURES" \
     "OPENBLAS_CORETYPE=$OPENBLAS_CORETYPE"
workers=$(nproc 2>/dev/null || echo 2)
[ "$workers" -gt 4 ] && workers=4
# the golden runs, the fingerprint's own tests, and the committed boards' byte-identical
# regeneration (their numbers come from dp_accounting's numpy arithmetic too)
exec .venv/bin/python -m pytest tests/test_pipelines.py tests/test_numerics.py \
  tests/test_leaderboard.py -n "$workers" \
  -k "golden or digits or prune_variants or numerics or committed_board" "$@"
