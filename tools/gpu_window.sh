#!/usr/bin/env bash
# One lent-GPU window, resumable: each call runs the next unfinished work and brings back what
# finished. Three steps:
#
#   here:  bash tools/gpu_window.sh prepare
#          fills .device/ (git-ignored): the pinned wheels the machine lacks, Debian's
#          Fashion-MNIST files, a one-commit clone of HEAD without leaderboard/ (the code the
#          records come from; the board's records and pending runs travel in this tree), and
#          proof.json, board v4's registration checked with git here (the device has no git
#          history; the window trains only while the analysis keeps the proof's hash).
#   there: bash tools/gpu_window.sh run     (the device tool: carry [".device"], timeout_s 600)
#          1. once, unless leaderboard/gpu/group-cost-gpu.md exists: the group throughput table
#             (tools/group_cost_on_device.sh, 1 epoch, at most GROUP_COST_S = 170 s);
#          2. `dpbench sweep window` (dpbench/sweep/window.py): board v4's unfinished cells that
#             this device may train (its kind and JAX as registered, one kind per group), cells
#             nearest whole first, until WINDOW_S (540) s after the start.
#          $OUT: records.tar.gz, window.json, group-cost-gpu*.md/.json, logs.tar.gz.
#   here:  bash tools/gpu_window.sh land FILES_AT [WALL_S]
#          the group throughput table into leaderboard/gpu/, then `dpbench sweep land`: every
#          returned run into leaderboard/v4/pending/, each whole cell on into
#          leaderboard/v4/records/, the window's cost (WALL_S: the device tool's wall_s) into
#          leaderboard/v4/windows.json. Commit at once (windows.json names device, JAX, commit).
#
# ScatterNet's features cannot travel prepared (952 MB for Fashion-MNIST's train split against
# the 64 MiB that travels): the window computes them once in a CPU process (about a minute on
# one core) while the device trains the tanh CNN's cells (sweep/local.precompute_features).
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/device_env.sh  # WHEELS, device_fill, device_install

case "${1:-}" in
prepare)
  [ -z "$(git status --porcelain --untracked-files=no)" ] \
    || { echo "commit first: the window's records come from HEAD's code" >&2; exit 2; }
  device_fill
  git clone -q --depth 1 --no-checkout "file://$PWD" .device/src
  git -C .device/src sparse-checkout set --no-cone '/*' '!/leaderboard/'
  git -C .device/src checkout -q HEAD
  .venv/bin/python -m dpbench.sweep --write_proof=.device/proof.json --board=leaderboard/v4
  du -sh .device
  ;;
run)
  start=$(date +%s)
  exec > >(tee "$OUT/setup.log") 2>&1
  device_install
  git config --global --add safe.directory '*'  # the copied clone's owner may differ
  if [ ! -f leaderboard/gpu/group-cost-gpu.md ]; then
    EPOCHS=1 SIZES=1,4,16,64 FIRST_S=$(( ${GROUP_COST_S:-170} - 40 )) SECOND_S=40 \
      bash tools/group_cost_on_device.sh || echo "group throughput stopped (exit $?)"
  fi
  setup=$(( $(date +%s) - start ))
  status=0
  (cd .device/src && PYTHONUNBUFFERED=1 python3 -m dpbench.sweep window \
     --board="$OLDPWD/leaderboard/v4" --proof="$OLDPWD/.device/proof.json" \
     --deadline_s=$(( ${WINDOW_S:-540} - setup )) --setup_s="$setup" \
     --runs_dir=/tmp/runs --out="$OUT/window" \
     ${GPU_BINDING:+"--gpu_binding=$GPU_BINDING"}) > "$OUT/window.log" 2>&1 || status=$?
  tail -n 40 "$OUT/window.log"
  # at most 8 files come back: the records and window.json as they are, every log in one tarball
  mv "$OUT/window/records.tar.gz" "$OUT/window/window.json" "$OUT/" 2>/dev/null || status=1
  (cd "$OUT" && find . -mindepth 1 -type f ! -name records.tar.gz ! -name window.json \
     ! -name 'group-cost-gpu*' ! -name logs.tar.gz -printf '%P\n' > /tmp/logs.list \
     && tar czf logs.tar.gz --remove-files -T /tmp/logs.list) || status=1
  exit "$status"
  ;;
land)
  files="${2:?usage: $0 land FILES_AT [WALL_S]}"
  for f in "$files"/group-cost-gpu*; do
    [ -e "$f" ] && cp "$f" leaderboard/gpu/ && echo "leaderboard/gpu/$(basename "$f")"
  done
  .venv/bin/python -m dpbench.sweep land --board=leaderboard/v4 --files="$files" \
    ${3:+"--device_s=$3"}
  ;;
*)
  echo "usage: $0 prepare | run | land FILES_AT [WALL_S]" >&2
  exit 2
  ;;
esac
