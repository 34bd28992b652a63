#!/usr/bin/env bash
# Builds board v3 once its sweep is complete (leaderboard/sweep-v3/NOTE.md, "When every run is
# published"): archives board v2 (records, generated pages, claims, and copies of the audits
# and PERF.json it was built with) under leaderboard/archive/v2/ and checks it regenerates to
# the same bytes there; moves the sweep's records to leaderboard/records/ and its superseded
# epsilon-1 search to leaderboard/archive/v3-superseded/; writes the board's inputs; builds the
# board and its screenshot. Refuses to start while any group is unfinished. Stages the moves
# with git; the commit is yours.
# Usage: bash tools/finish_board_v3.sh
#        (REHEARSE=1: in a scratch worktree, the same steps on a sweep still under way)
set -euo pipefail
cd "$(dirname "$0")/.."
lb=leaderboard
dpbench=.venv/bin/dpbench
[ -d "$lb/sweep-v3/records" ] || { echo "no $lb/sweep-v3/records: already finished?" >&2; exit 2; }
[ -z "$(git status --porcelain -- "$lb")" ] \
  || { echo "commit or remove what is uncommitted under $lb/ first" >&2; exit 2; }
# every group complete: every run of the search and every winner's seeds published
.venv/bin/python - <<'EOF'
import os
import sys
from pathlib import Path
from dpbench import tuning
unfinished = []
for group in sorted(Path("leaderboard/sweep-v3/records").iterdir()):
    if (group / tuning.SEARCH_FILE).exists():
        done, expected = tuning.search_progress(group)
        if done < expected:
            unfinished.append(f"{group.name} {done} of {expected}")
if unfinished and os.environ.get("REHEARSE") != "1":
    sys.exit("the sweep is not finished: " + "; ".join(unfinished))
EOF

# 1. board v2 to the archive, then rebuilt there: its pages must not change (but the one link
#    to board v1, which is relative to the board's folder)
v2="$lb/archive/v2"
git mv "$lb/records" "$v2/records"
for f in README.md index.html plots screenshot.png claims.json; do git mv "$lb/$f" "$v2/$f"; done
cp -r "$lb/audits" "$lb/PERF.json" "$v2/"
cat > "$v2/board.json" <<'EOF'
{
  "audits": "audits",
  "claims": "claims.json",
  "v1_records": "../v1/records",
  "perf": "PERF.json"
}
EOF
sed -i 's#(archive/v1/index.html)#(../v1/index.html)#' "$v2/records/NOTE.md"
before="$(mktemp -d)"
trap 'rm -rf "$before"' EXIT
cp "$v2/README.md" "$v2/index.html" "$before/"
"$dpbench" board --records="$v2/records"
for page in README.md index.html; do
  diff <(sed 's#archive/v1/index.html#../v1/index.html#' "$before/$page") "$v2/$page" \
    || { echo "board v2's $page does not regenerate to its bytes in the archive" >&2; exit 1; }
done

# 2. board v3's records, its superseded search, its inputs
git mv "$lb/sweep-v3/records" "$lb/records"
git mv "$lb/sweep-v3/superseded" "$lb/archive/v3-superseded"
git mv "$lb/sweep-v3/NOTE.md" "$lb/archive/v3-sweep.md"
git mv "$lb/sweep-v3/board-NOTE.md" "$lb/records/NOTE.md"
cat > "$lb/board.json" <<'EOF'
{
  "audits": "audits",
  "perf": "PERF.json",
  "history": ["archive/v1/records", "archive/v2/records"],
  "earlier_records": "archive/v2/records",
  "superseded": "archive/v3-superseded"
}
EOF
"$dpbench" board --records="$lb/records"
bash tools/screenshot_board.sh
git add -A "$lb"
echo "board v3 built: look at $lb/screenshot.png; point the docs' leaderboard/sweep-v3 paths
(README.md, WORKSPACE.md, docs/board-protocol.md, tools/) at their new homes; then commit"
