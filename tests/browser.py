"""Headless Chromium (Debian's package) for the board's pages: which numbers a page's layout
breaks across lines at a given window width.

The page is copied with a script appended that walks every text node, finds each number (digits
with their sign, point, commas and per cent), and asks the layout for the lines its characters
occupy; Chromium's --dump-dom prints the page after the script ran."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

CHROMIUM = shutil.which("chromium")

_PROBE = r"""<script>
const wrapped = [];
const number = /[-+\u2212]?\d[\d.,]*%?/g;
const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
for (let node = walker.nextNode(); node; node = walker.nextNode()) {
  for (const m of node.data.matchAll(number)) {
    const range = document.createRange();
    range.setStart(node, m.index);
    range.setEnd(node, m.index + m[0].replace(/,$/, '').length);
    const lines = new Set([...range.getClientRects()].map(r => Math.round(r.top)));
    if (lines.size > 1) wrapped.push(m[0]);
  }
}
const out = document.createElement('pre');
out.id = 'dpbench-wrapped';
out.textContent = JSON.stringify(wrapped);
document.body.appendChild(out);
</script>"""


def wrapped_numbers(page: Path, width: int = 1400) -> list:
    """The numbers of the HTML ``page`` that its layout at ``width`` px breaks across lines
    (the page's images and links resolve next to the copy, so it renders as published)."""
    page = Path(page)
    with tempfile.TemporaryDirectory() as tmp:
        probe = page.with_name(f".probe-{Path(tmp).name}.html")
        probe.write_text(page.read_text().replace("</body>", _PROBE + "</body>"))
        try:
            done = subprocess.run(
                [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", f"--user-data-dir={tmp}", f"--window-size={width},1000",
                 "--virtual-time-budget=10000", "--dump-dom", probe.resolve().as_uri()],
                capture_output=True, text=True, timeout=120, check=True)
        finally:
            probe.unlink()
    found = re.search(r"<pre id=\"dpbench-wrapped\">(.*?)</pre>", done.stdout, re.S)
    if found is None:
        raise RuntimeError(f"Chromium did not run the probe on {page}: {done.stderr[-2000:]}")
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))
