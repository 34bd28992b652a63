#!/usr/bin/env bash
# A board sweep's trials on a lent accelerator machine (one GPU, 16 cores, no network), as
# board v3's sweep ran 207 of them (leaderboard/archive/v3-sweep.md). Two halves:
#
#   here:  bash tools/sweep_on_device.sh prepare COMMIT
#          fills .device/ (git-ignored): a clean clone of COMMIT (the commit the groups' records
#          come from), the pinned wheels the machine lacks, Debian's Fashion-MNIST files.
#          SHALLOW=1: a one-commit clone of HEAD without leaderboard/ (when the full clone, the
#          data and the board's records exceed the 64 MiB that travels).
#   there: PROTOCOL=FILE RECORDS=DIR bash tools/sweep_on_device.sh run GROUP [...]
#          (carry .device; $OUT set; FILE: the sweep's protocol, DIR: its records folder, both
#          relative to the repo, DIR holding each GROUP's search.json)
#          installs the wheels, then the clone's own `dpbench sweep local` (dpbench/sweep/
#          local.py) runs the groups' unpublished trials until POOL_BUDGET seconds (default
#          545) after the start: GPU_WORKERS (1) device processes, each training packs of one
#          method's trials of one structure as one compiled step (as many as the device's
#          memory holds, GROUP_SIZE caps them), and CPU_WORKERS (7) CPU processes;
#          GPU_BINDING, when set, a gin binding added to every device trial (e.g.
#          'train.accelerator_micro_batch_size = 0'). $OUT gets records.tar.gz (the newly
#          published runs) and logs.tar.gz (local.json, the driver's log, failed runs' logs).
#          Groups from another commit than the clone's need a clone of that commit (one
#          `prepare` each): records come from the code that trains them.
#
# Back here: tar xzf <files_at>/records.tar.gz -C DIR --skip-old-files (check each record's
# git_commit) before any further call: the next call sends this tree's records, and a trial
# not among them would run again.
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
  [ "$#" -gt 0 ] || { echo "usage: $0 run GROUP [...]" >&2; exit 2; }
  [ -n "${RECORDS:-}" ] && [ -n "${PROTOCOL:-}" ] || { echo "set PROTOCOL to the sweep's" \
    "protocol and RECORDS to its records folder (relative to the repo, e.g." \
    "leaderboard/v4/protocol.json and leaderboard/v4/records)" >&2; exit 2; }
  families=(); epsilons=()
  for group in "$@"; do
    [ -f "$RECORDS/$group/search.json" ] \
      || { echo "$RECORDS/$group/search.json is missing: is RECORDS the sweep's records" \
           "folder and $group one of its groups?" >&2; exit 2; }
    families+=("${group%%__eps*}"); rest="${group#*__eps}"; epsilons+=("${rest%%__delta*}")
  done
  start=$(date +%s)
  exec > >(tee "$OUT/setup.log") 2>&1
  device_install
  git config --global --add safe.directory '*'  # the copied clone's owner may differ
  [ -z "$(git -C .device/src status --porcelain --untracked-files=no)" ] \
    || { echo "the clone is not clean: its records would not be its commit's" >&2; exit 2; }
  left=$(( ${POOL_BUDGET:-545} - ($(date +%s) - start) ))
  status=0
  # every (family, epsilon) asked must already have its search.json (checked above): the
  # sweep's prepare then only reads them, and draws nothing on the device
  (cd .device/src && PYTHONUNBUFFERED=1 python3 -m dpbench.sweep local \
     --protocol="$OLDPWD/$PROTOCOL" --records="$OLDPWD/$RECORDS" --runs_dir=/tmp/runs \
     --families $(printf '%s\n' "${families[@]}" | sort -u) \
     --epsilons $(printf '%s\n' "${epsilons[@]}" | sort -u) \
     --deadline_s="$left" --gpu_workers="${GPU_WORKERS:-1}" --cpu_workers="${CPU_WORKERS:-7}" \
     --group_size="${GROUP_SIZE:-0}" --out="$OUT/local" \
     ${GPU_BINDING:+"--gpu_binding=$GPU_BINDING"}) > "$OUT/driver.log" 2>&1 || status=1
  tail -n 40 "$OUT/driver.log"
  # The device tool brings back at most 8 files from $OUT: the records tarball as it is,
  # every log (and local.json) in one logs.tar.gz.
  mv "$OUT/local/records.tar.gz" "$OUT/records.tar.gz" 2>/dev/null || status=1
  (cd "$OUT" && find . -mindepth 1 -type f ! -name records.tar.gz ! -name logs.tar.gz \
     ! -name .logs -printf '%P\n' > .logs \
     && tar czf logs.tar.gz --remove-files -T .logs && rm .logs) || status=1
  exit "$status"
  ;;
*)
  echo "usage: $0 prepare COMMIT | PROTOCOL=FILE RECORDS=DIR $0 run GROUP [...]" >&2
  exit 2
  ;;
esac
