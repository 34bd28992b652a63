#!/usr/bin/env bash
# Installs dpbench with its test and sweep extras (Ray Tune, for tests/test_sweep.py) and runs
# the whole test suite (CPU only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh "[test,sweep]"
exec .venv/bin/python -m pytest tests "$@"
