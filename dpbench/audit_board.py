"""``dpbench audit --board``: the board's audit column, from the protocol itself.

Every method the protocol's families list, at every epsilon the protocol declares (its own
delta), audited as its method.json says (extra ``"audit": {"bindings": [...]}`` or ``"audit":
{"skip": why}``), one report per (method, epsilon) in ``<audits_dir>/<method>-eps<E>.json``;
the board matches a report to a group by the epsilon it claims. The epsilons and methods are
read from the protocol, never written a second time.
"""

from __future__ import annotations

import json
from pathlib import Path

from dpbench.search import methods
from dpbench.search.protocol import load_protocol


def board_audits(protocol_path) -> tuple:
    """([(method, epsilon, gin_file, bindings)] of a protocol's audit column, in order;
    {method: why} of those whose method.json says ``"skip"``; the protocol's delta)."""
    path = Path(protocol_path)
    protocol = load_protocol(path)
    names = list(dict.fromkeys(m for spec in protocol["families"].values()
                               for m in spec["methods"]))
    raw = json.loads(path.read_text())
    dirs = [path.parent / d for d in raw.get("method_dirs", [])] + [methods.BOARD_METHODS]
    found = methods.discover(dirs)
    audits = [(name, float(eps), found[name].gin_file,
               list(found[name].audit.get("bindings", [])))
              for eps in protocol["epsilons"] for name in names
              if "skip" not in found[name].audit]
    skipped = {name: found[name].audit["skip"] for name in names if "skip" in found[name].audit}
    return audits, skipped, protocol["delta"]


def report_name(method: str, epsilon: float) -> str:
    return f"{method}-eps{epsilon:g}.json"


def run_board(protocol_path, audits_dir, audit_one) -> int:
    """Audits the protocol's column with ``audit_one(gin_file, bindings, epsilon, delta, out)``
    (which returns whether the audit flagged); 1 when any flagged (every report is written
    first), else 0."""
    audits, skipped, delta = board_audits(protocol_path)
    for name, why in skipped.items():
        print(f"not audited: {name} ({why})")
    audits_dir = Path(audits_dir)
    audits_dir.mkdir(parents=True, exist_ok=True)
    flagged = []
    for name, epsilon, gin_file, bindings in audits:
        out = audits_dir / report_name(name, epsilon)
        if audit_one(gin_file, bindings, epsilon, delta, out):
            flagged.append(f"{name} at epsilon {epsilon:g}")
        print(f"audited {name} at epsilon {epsilon:g} -> {out}", flush=True)
    if flagged:
        print(f"dpbench: FLAGGED: {', '.join(flagged)}")
    return 1 if flagged else 0
