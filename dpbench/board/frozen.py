"""Frozen boards: an archived board is checked by hash, never re-rendered by today's code.

A board folder whose board.json holds ``"frozen"`` is an archive: ``{"files": {name: sha256}
of its README.md and index.html, "records_sha256": the digest of every file under its
records/}``, written by ``dpbench board --freeze`` from the bytes that build rendered at that
moment. New columns or wording in the board code then never rewrite a committed archive, and
the archive's test is that its files and records still hash to what was frozen.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dpbench import records as records_lib

RENDERED = ("README.md", "index.html")


def records_digest(records_dir) -> str:
    """sha256 over every file under ``records_dir``: its relative path and its bytes, sorted."""
    root, digest = Path(records_dir), hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(root).as_posix()}\0".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def freeze_spec(board_dir) -> dict:
    """The ``"frozen"`` entry for ``board_dir`` as it is now."""
    board_dir = Path(board_dir)
    return dict(files={name: hashlib.sha256((board_dir / name).read_bytes()).hexdigest()
                       for name in RENDERED},
                records_sha256=records_digest(board_dir / "records"))


frozen_spec = records_lib.frozen_spec  # one reader: the sweep asks it too (sweep/preflight)


def check_frozen(board_dir) -> list:
    """What no longer matches a frozen board's hashes ([] when all of it does)."""
    spec, now = frozen_spec(board_dir), freeze_spec(board_dir)
    problems = [f"{name} changed since the board was frozen" for name in RENDERED
                if spec["files"].get(name) != now["files"][name]]
    if spec["records_sha256"] != now["records_sha256"]:
        problems.append("its records changed since the board was frozen")
    return problems


def freeze(board_dir) -> dict:
    """Writes the ``"frozen"`` entry into ``board_dir``/board.json (after a build)."""
    path = Path(board_dir) / "board.json"
    spec = json.loads(path.read_text()) if path.exists() else {}
    spec["frozen"] = freeze_spec(board_dir)
    records_lib.atomic_write_text(path, json.dumps(spec, indent=2) + "\n")
    return spec["frozen"]
