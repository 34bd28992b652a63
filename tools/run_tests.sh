#!/usr/bin/env bash
# Installs dpbench with its test extra and runs the whole test suite (CPU only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh "[test]"
exec .venv/bin/python -m pytest tests "$@"
