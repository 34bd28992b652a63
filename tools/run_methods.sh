#!/usr/bin/env bash
# Trains every method folder in pipelines/ on Fashion-MNIST at (EPSILON, 1e-5), one after
# another, and prints the summary table. Usage: bash tools/run_methods.sh [EPSILON] [OUTDIR]
# PIPELINES="rs gip" limits the set (default: every pipelines/<name>/pipeline.gin).
set -euo pipefail
cd "$(dirname "$0")/.."
eps="${1:-3.0}"
out="${2:-runs/methods-eps${eps}-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
names="${PIPELINES:-$(cd pipelines && ls -d */ | tr -d /)}"
for name in $names; do
  .venv/bin/dpbench --gin_file="pipelines/$name" --gin_bindings="EPSILON = ${eps}" \
    --workdir="$out/$name" 2> "$out/$name.log" || echo "$name failed" >&2
done
.venv/bin/python tools/summarize_runs.py "$out"/*
