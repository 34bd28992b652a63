#!/usr/bin/env bash
# Trains every pipeline in pipelines/ on Fashion-MNIST at (EPSILON, 1e-5), one after another,
# and prints the summary table. Usage: bash tools/run_methods.sh [EPSILON] [OUTDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
eps="${1:-3.0}"
out="${2:-runs/methods-eps${eps}-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
for gin_file in pipelines/*.gin; do
  name="$(basename "$gin_file" .gin)"
  .venv/bin/dpbench --gin_file="$gin_file" --gin_bindings="EPSILON = ${eps}" \
    --workdir="$out/$name" --alsologtostderr 2> "$out/$name.log" || echo "$name failed" >&2
done
.venv/bin/python tools/summarize_runs.py "$out"/*
