#!/usr/bin/env bash
# Resumes board v3's sweep where the committed records stop. Each group runs from the commit its
# records come from (leaderboard/sweep-v3/NOTE.md), checked out in a worktree beside this
# checkout, with dpbench's venv; records are published into leaderboard/sweep-v3/records (a
# published trial never runs again; a group's search.json pins its trials).
#   9071232: the tanh CNN at epsilon 1 (lr x C from its own epsilon-1 range)
#   3a1a49f: the tanh CNN at epsilon 3, ScatterNet at epsilon 3 and at epsilon 1
# The parts run one after another in the background, in that order; each worktree's
# out/sweep.log is its log.
# Usage: bash tools/resume_sweep_v3.sh [CPUS]   (default: every core)
set -euo pipefail
cd "$(dirname "$0")/.."
main="$PWD"
parent="$(dirname "$main")"
# commit, worktree (beside this checkout), the sweep's group flags
PARTS=(
  "9071232 sweep3-tanh-eps1 --families fashion_mnist__tanh_cnn --epsilons 1.0"
  "3a1a49f sweep3 --epsilons 3.0"
  "3a1a49f sweep3 --families fashion_mnist__scatter_linear --epsilons 1.0"
)
if [ "${1:-}" = "--run" ]; then  # the background part: every part in turn
  cpus="$2"
  for part in "${PARTS[@]}"; do
    read -r commit tree flags <<< "$part"
    # shellcheck disable=SC2086  # flags are words
    (cd "$parent/$tree" && PYTHONPATH="$parent/$tree" "$main/.venv/bin/python" -m dpbench.sweep \
      --records="$main/leaderboard/sweep-v3/records" --runs_dir="$parent/$tree/out/runs" \
      --cpus "$cpus" $flags) >> "$parent/$tree/out/sweep.log" 2>&1 < /dev/null || true
  done
  exit 0
fi
cpus="${1:-$(nproc)}"
[ -x .venv/bin/python ] || bash tools/install.sh "[sweep]"
for part in "${PARTS[@]}"; do
  read -r commit tree _ <<< "$part"
  [ -d "$parent/$tree" ] || git worktree add -q "$parent/$tree" "$commit"
  [ "$(git -C "$parent/$tree" rev-parse --short=7 HEAD)" = "$commit" ] \
    || { echo "$parent/$tree is not at $commit: remove it (git worktree remove $parent/$tree)" >&2
         exit 2; }
  mkdir -p "$parent/$tree/out"
done
setsid nohup bash "$0" --run "$cpus" > /dev/null 2>&1 < /dev/null &
echo "board v3's sweep resumed on $cpus cores (pid $!), part by part:"
printf '  %s\n' "${PARTS[@]}"
echo "logs: $parent/<worktree>/out/sweep.log"
