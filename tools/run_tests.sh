#!/usr/bin/env bash
# Installs dpbench with its test and sweep extras (Ray Tune, for tests/test_sweep.py) and runs
# the whole test suite (CPU only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh "[test,sweep]"
# one pytest worker per core, at most 4 (each worker imports JAX and compiles its own programs)
workers=$(nproc 2>/dev/null || echo 2)
[ "$workers" -gt 4 ] && workers=4
# --dist loadfile: a module's tests share one worker, so a module-scoped fixture (the tiny Ray
# sweep of tests/test_sweep.py) runs once, not once per worker
exec .venv/bin/python -m pytest tests -n "$workers" --dist loadfile "$@"
