#!/usr/bin/env bash
# Renders leaderboard/index.html in headless Chromium (Debian's package) and saves a screenshot,
# to check that the page and its plots render.
# Usage: bash tools/screenshot_board.sh [PAGE.html] [OUT.png]
set -euo pipefail
cd "$(dirname "$0")/.."
html="${1:-leaderboard/index.html}"
out="${2:-$(dirname "$html")/screenshot.png}"
if ! command -v chromium >/dev/null; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  # a fresh machine may have empty package lists: update only when the first try fails
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null 2>&1 \
    || { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
         $SUDO apt-get install -y -qq chromium >/dev/null; }
fi
[ -f "$html" ] || { echo "no $html: run .venv/bin/dpbench leaderboard" >&2; exit 2; }
page="file://$(realpath "$html")"
profile="$(mktemp -d)"
trap 'rm -rf "$profile"' EXIT
# no background networking: this machine has no internet, and Chromium's connection attempts
# otherwise slow the start down
# 3000 px tall: the four groups' verdict tables come first, and the first group's two plots
# (accuracy vs epsilon, expected best vs trials) must be in the picture below them
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1800,3000 \
  --no-first-run --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$profile" --screenshot="$(realpath -m "$out")" "$page" 2>/dev/null
[ -s "$out" ] || { echo "chromium wrote no screenshot to $out" >&2; exit 1; }
echo "wrote $out"
