#!/usr/bin/env bash
# benchmarks/group_cost.py on a lent GPU (one call; carry .device, filled here by
# `bash tools/perf_on_device.sh prepare`): DP-SGD on the tanh CNN, Fashion-MNIST, B 1024,
# micro-batch 512, EPOCHS epochs (default 2), trials grouped T = SIZES (default 1,4,16,64, vmap)
# against one process per trial; then the map batching at MAP_SIZES (default 16).
# Reports: $OUT/group-cost-gpu.md (+ .json), $OUT/group-cost-gpu-map.md.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/device_env.sh
device_install
export PYTHONPATH=/tmp/site:$PWD
COMMON=(--gin_file=pipelines/dpsgd/pipeline.gin --gin_file=gin/data/fashion_mnist.gin
        "--binding=train.epochs = ${EPOCHS:-2}" "--binding=train.batch_size = 1024"
        "--binding=train.micro_batch_size = 512" "--binding=train.ema_decay = 0.0")
timeout "${FIRST_S:-420}" python3 -m benchmarks.group_cost "${COMMON[@]}" \
  --sizes="${SIZES:-1,4,16,64}" --solo="${SOLO:-1}" --batching=vmap --out="$OUT/group-cost-gpu.md" \
  2>&1 | grep -v "^[WI][0-9]" | tail -40 || echo "first part stopped (exit $?)"
timeout "${SECOND_S:-120}" python3 -m benchmarks.group_cost "${COMMON[@]}" \
  --sizes="${MAP_SIZES:-16}" --solo=1 --batching=map --out="$OUT/group-cost-gpu-map.md" \
  2>&1 | grep -v "^[WI][0-9]" | tail -15 || echo "second part stopped (exit $?)"
