#!/usr/bin/env bash
# A board sweep's trials on a lent accelerator machine (one GPU, 16 cores, no network), as
# board v3's sweep ran 207 of them (leaderboard/archive/v3-sweep.md). Two halves:
#
#   here:  bash tools/sweep_on_device.sh prepare COMMIT
#          fills .device/ (git-ignored): a clean clone of COMMIT (the commit the groups' records
#          come from), the pinned wheels the machine lacks, Debian's Fashion-MNIST files.
#          One commit per call: two clones, the data and the board's records exceed the 64 MiB
#          that travels. SHALLOW=1: a one-commit clone of HEAD without leaderboard/ (when even
#          one full clone is too much).
#   there: RECORDS=DIR bash tools/sweep_on_device.sh run [COMMIT:]GROUP [...]
#          (carry .device; $OUT set; DIR: the sweep's records folder, relative to the repo,
#          holding each GROUP's search.json)
#          installs the wheels, then tools/sweep_pool.py runs the groups' unpublished trials
#          until POOL_BUDGET seconds (default 545) after the start; GPU_WORKERS (8) and
#          CPU_WORKERS (7) workers; GROUP_SIZE (1) trials of one method (one family, any
#          epsilon) per GPU process, trained as groups (a COMMIT from before the sweep's
#          run_pack runs one per process); GPU_BINDING, when set, a gin binding added to every
#          GPU trial (e.g. 'train.accelerator_micro_batch_size = 0': the whole padded batch a
#          micro-step, the same sampler and DpEvent as on a CPU). A group named with another COMMIT (one the clone's history
#          holds, e.g. 9071232 for the tanh CNN at epsilon 1) runs from a worktree of that
#          commit, in a pool of its own beside the first (the workers split between the pools:
#          one process imports one checkout's dpbench). $OUT/COMMIT/ gets each pool's
#          records.tar.gz; every pool's pool.json and logs go into $OUT/logs.tar.gz.
#
# Back here, for each pool: tar xzf <files_at>/COMMIT/records.tar.gz -C DIR --skip-old-files (check each record's git_commit), before any
# further call: the next call sends this tree's records, and a trial not among them would run
# again.
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/device_env.sh  # WHEELS, device_fill, device_install

case "${1:-}" in
prepare)
  commit="${2:?usage: $0 prepare COMMIT}"
  device_fill
  if [ -n "${SHALLOW:-}" ]; then
    # one commit, without leaderboard/ (the records travel in this tree): the tree, the data
    # and a full clone of today's repository exceed the 64 MiB that travels. A COMMIT: group
    # prefix then has no history to take its worktree from.
    [ "$(git rev-parse "$commit^{commit}")" = "$(git rev-parse HEAD)" ] \
      || { echo "SHALLOW=1 clones this checkout's HEAD: check out $commit first" >&2; exit 2; }
    git clone -q --depth 1 --no-checkout "file://$PWD" .device/src
    git -C .device/src sparse-checkout set --no-cone '/*' '!/leaderboard/'
    git -C .device/src checkout -q "$commit"
  else
    git clone -q --no-local . .device/src && git -C .device/src checkout -q "$commit"
  fi
  git -C .device/src gc -q --prune=now
  du -sh .device
  ;;
run)
  shift
  [ "$#" -gt 0 ] || { echo "usage: $0 run [COMMIT:]GROUP [...]" >&2; exit 2; }
  [ -n "${RECORDS:-}" ] || { echo "set RECORDS to the sweep's records folder (relative to the" \
    "repo, e.g. leaderboard/sweep-v4/records)" >&2; exit 2; }
  for arg in "$@"; do
    [ -f "$RECORDS/${arg#*:}/search.json" ] \
      || { echo "$RECORDS/${arg#*:}/search.json is missing: is RECORDS the sweep's records" \
           "folder and ${arg#*:} one of its groups?" >&2; exit 2; }
  done
  start=$(date +%s)
  exec > >(tee "$OUT/setup.log") 2>&1
  device_install
  git config --global --add safe.directory '*'  # the copied clone's owner may differ
  head=$(git -C .device/src rev-parse HEAD)
  [ -z "$(git -C .device/src status --porcelain --untracked-files=no)" ] \
    || { echo "the clone is not clean: its records would not be its commit's" >&2; exit 2; }
  # the groups of each commit (a bare GROUP: the clone's own commit)
  declare -A groups_of=()
  for arg in "$@"; do
    if [[ "$arg" == *:* ]]; then
      commit=$(git -C .device/src rev-parse --verify "${arg%%:*}^{commit}") \
        || { echo "${arg%%:*} is not a commit of the clone's history" >&2; exit 2; }
      group="${arg#*:}"
    else
      commit="$head"; group="$arg"
    fi
    groups_of[$commit]="${groups_of[$commit]:-} $group"
  done
  pools=${#groups_of[@]}
  gpu=$(( ${GPU_WORKERS:-8} / pools )); cpu=$(( ${CPU_WORKERS:-7} / pools ))
  left=$(( ${POOL_BUDGET:-545} - ($(date +%s) - start) ))
  pids=()
  for commit in "${!groups_of[@]}"; do
    repo=.device/src
    if [ "$commit" != "$head" ]; then  # a clean checkout of that commit, same objects
      repo="/tmp/src-$commit"
      [ -d "$repo" ] || git -C .device/src worktree add -q --detach "$repo" "$commit"
      [ "$(git -C "$repo" rev-parse HEAD)" = "$commit" ] \
        && [ -z "$(git -C "$repo" status --porcelain --untracked-files=no)" ] \
        || { echo "$repo is not a clean checkout of $commit" >&2; exit 2; }
    fi
    mkdir -p "$OUT/$commit"
    echo "pool of $commit ($repo):${groups_of[$commit]}; $gpu GPU + $cpu CPU workers"
    # shellcheck disable=SC2086  # the groups are words
    PYTHONUNBUFFERED=1 python3 tools/sweep_pool.py --repo="$repo" \
      --records="$RECORDS" --groups ${groups_of[$commit]} \
      --runs_dir="/tmp/runs-$commit" --deadline_s="$left" --gpu_workers="$gpu" \
      --cpu_workers="$cpu" --group_size="${GROUP_SIZE:-1}" --out="$OUT/$commit" \
      ${GPU_BINDING:+"--gpu_binding=$GPU_BINDING"} \
      > "$OUT/$commit/driver.log" 2>&1 &
    pids+=("$!")
  done
  status=0
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  tail -n 40 "$OUT"/*/driver.log
  # The device tool brings back at most 8 files from $OUT (two pools left 9, and the second
  # pool's records were the one left out): the records tarballs come back as they are, every
  # log goes into one logs.tar.gz.
  (cd "$OUT" && find . -mindepth 1 -type f ! -name records.tar.gz ! -name logs.tar.gz \
     ! -name .logs -printf '%P\n' > .logs \
     && tar czf logs.tar.gz --remove-files -T .logs && rm .logs) || status=1
  exit "$status"
  ;;
*)
  echo "usage: $0 prepare COMMIT | RECORDS=DIR $0 run [COMMIT:]GROUP [...]" >&2
  exit 2
  ;;
esac
