#!/usr/bin/env bash
# The leaderboard's audit column: `dpbench audit` (Dirac canary, 2000 one-step runs) of every
# pipeline at every epsilon on the board, one JSON report per (pipeline, epsilon) in
# leaderboard/audits/<pipeline>-eps<E>.json. The builder matches a report to a board group by
# the report's claimed epsilon. GEP is audited with 128 anchors and 40 basis vectors instead of
# 512 and 200 (speed; the mechanism and its accounting are the same, see tests/test_audit.py).
# B-GEP is not audited: its release never reaches the canary's coordinates (zero in every public
# anchor gradient), so any canary audit of it is uninformative (its column says n/a).
# Usage: bash tools/audit_board.sh [EPSILON ...]   (default: 1 3)
set -euo pipefail
cd "$(dirname "$0")/.."
epsilons=("${@:-1 3}")
mkdir -p leaderboard/audits
for eps in ${epsilons[@]}; do
  for pipeline in dpsgd rs dpssgd gip randomk nasr gep; do
    extra=()
    if [ "$pipeline" = gep ]; then
      extra=("--gin_bindings=gep.embed_and_clip.num_anchors = 128"
             "--gin_bindings=gep.embed_and_clip.num_basis = 40")
    fi
    .venv/bin/dpbench audit --gin_file="pipelines/$pipeline.gin" "${extra[@]}" --trials=2000 \
      --claimed_epsilon="$eps" --out="leaderboard/audits/$pipeline-eps$eps.json" > /dev/null
    echo "audited $pipeline at epsilon $eps -> leaderboard/audits/$pipeline-eps$eps.json"
  done
done
