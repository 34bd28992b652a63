#!/usr/bin/env bash
# Resumes board v3's sweep where the committed records stop: the code that made them (commit
# 3a1a49f, leaderboard/sweep-v3/NOTE.md) in a worktree beside this checkout, dpbench's venv,
# records published into leaderboard/sweep-v3/records (a published trial never runs again).
# Runs in the background; its log is ../sweep3/out/sweep.log.
# Usage: bash tools/resume_sweep_v3.sh [CPUS [SWEEP FLAGS...]]   (default: every core, every
# group; e.g. `2 --families fashion_mnist__tanh_cnn --epsilons 1.0` runs that group's trials
# first: which trials run when never changes what a trial computes)
set -euo pipefail
cd "$(dirname "$0")/.."
main="$PWD"
commit=3a1a49f
tree="$(dirname "$main")/sweep3"
[ -x .venv/bin/python ] || bash tools/install.sh "[sweep]"
[ -d "$tree" ] || git worktree add -q "$tree" "$commit"
[ "$(git -C "$tree" rev-parse --short=7 HEAD)" = "$commit" ] \
  || { echo "$tree is not at $commit: remove it (git worktree remove $tree)" >&2; exit 2; }
mkdir -p "$tree/out"
cpus="${1:-$(nproc)}"
shift || true
cd "$tree"
PYTHONPATH="$tree" setsid nohup "$main/.venv/bin/python" -m dpbench.sweep \
  --records="$main/leaderboard/sweep-v3/records" --runs_dir="$tree/out/runs" --cpus "$cpus" "$@" \
  >> "$tree/out/sweep.log" 2>&1 < /dev/null &
echo "sweep resumed from $commit on $cpus cores${*:+ ($*)} (pid $!); log: $tree/out/sweep.log"
