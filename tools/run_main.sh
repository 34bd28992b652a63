#!/usr/bin/env bash
# Installs dpbench and runs the main job: DP-SGD on Fashion-MNIST at (epsilon=3, delta=1e-5),
# offline, on the real data. Extra arguments are passed to dpbench (e.g. --gin_bindings=...).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh
workdir="${WORKDIR:-runs/dpsgd-fashion_mnist-eps3-$(date +%Y%m%d-%H%M%S)}"
exec .venv/bin/dpbench --gin_file=pipelines/dpsgd/pipeline.gin --workdir="$workdir" "$@"
