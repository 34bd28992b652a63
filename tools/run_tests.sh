#!/usr/bin/env bash
# Installs dpbench with its test and sweep extras (Ray Tune, for tests/test_sweep.py) and runs
# the whole test suite (CPU only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh "[test,sweep]"
# one pytest worker per core, at most 4 (each worker imports JAX and compiles its own programs)
workers=$(nproc 2>/dev/null || echo 2)
[ "$workers" -gt 4 ] && workers=4
exec .venv/bin/python -m pytest tests -n "$workers" "$@"
