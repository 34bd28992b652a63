"""PERF.md's sweep trial cost: what one board trial costs per method, from the run records."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def trial_costs(records_dir: Path) -> list:
    """Per (model family, method), from the board's run records under ``records_dir``
    (<group>/<run>/run_record.json): how many runs, and their wall seconds per epoch (the
    record's wall_time_s / epochs): median, min and max. What a sweep trial costs."""
    per = {}
    for path in sorted(Path(records_dir).glob("*/*/run_record.json")):
        record = json.loads(path.read_text())
        family = path.parent.parent.name.split("__eps")[0]
        per.setdefault((family, record["pipeline"]), []).append(
            record["wall_time_s"] / record["epochs"])
    return [dict(family=family, method=method, runs=len(v), s_per_epoch_median=float(
        np.median(v)), s_per_epoch_min=float(min(v)), s_per_epoch_max=float(max(v)))
        for (family, method), v in sorted(per.items())]


def trial_cost_section(report: dict) -> list:
    costs = report.get("trial_costs")
    if not costs:
        return []
    lines = ["", "## Sweep trial cost (the board's run records)", "",
             f"Wall seconds per epoch of every published run under `{report['records_dir']}` "
             "(record `wall_time_s` / epochs): the board's sweep ran each trial pinned to one "
             "core, as many at once as the machine has cores, on the host and code its records "
             "name (`git_commit`); a method's trials differ in batch size and epochs.", "",
             "| family | method | runs | s/epoch median | min–max |", "|---|---|---|---|---|"]
    lines += [f"| {c['family']} | {c['method']} | {c['runs']} | {c['s_per_epoch_median']:.1f} | "
              f"{c['s_per_epoch_min']:.1f}–{c['s_per_epoch_max']:.1f} |" for c in costs]
    return lines
