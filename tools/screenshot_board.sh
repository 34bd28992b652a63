#!/usr/bin/env bash
# Renders leaderboard/index.html in headless Chromium (Debian's package) and saves a screenshot,
# to check that the page and its plots render.
# Usage: bash tools/screenshot_board.sh [PAGE.html] [OUT.png]
set -euo pipefail
cd "$(dirname "$0")/.."
html="${1:-leaderboard/index.html}"
out="${2:-$(dirname "$html")/screenshot.png}"
if ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ]; then apt-get install -y chromium; else sudo apt-get install -y chromium; fi
fi
[ -f "$html" ] || { echo "no $html: run .venv/bin/dpbench leaderboard" >&2; exit 2; }
page="file://$(realpath "$html")"
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1600,2400 \
  --screenshot="$(realpath -m "$out")" "$page" 2>/dev/null
echo "wrote $out"
