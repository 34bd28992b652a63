"""``dpbench sweep --cost``: the core-hours a sweep's runs took, each process's wall time
summed from its metrics (runs interrupted and resumed count every segment)."""

from __future__ import annotations

import json
from pathlib import Path


def _segments(run_dir: Path) -> list:
    """Wall seconds of each process that trained the run: a process's last logged ``wall_s``
    (each process restarts the clock, so a drop starts a segment); a finished run's last
    segment is its record's ``wall_time_s``, which also covers the steps after the last log."""
    segments, last = [], None
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            wall = json.loads(line).get("wall_s")
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if wall is None:
            continue
        if last is not None and wall < last:
            segments.append(last)
        last = wall
    if last is not None:
        segments.append(last)
    record = run_dir / "run_record.json"
    if record.exists():
        final = json.loads(record.read_text())["wall_time_s"]
        segments[-1:] = [max(final, segments[-1] if segments else 0.0)]
    return segments


def sweep_cost(runs_dir: Path, cpus_per_trial: float = 1.0) -> dict:
    """{group: {"started", "finished", "core_hours"}} over every run directory under
    ``runs_dir`` (a run's group is its parent directory: also runs set aside by hand), each
    run's wall time summed over its segments, times the CPUs each trial holds."""
    cost = {}
    for metrics in sorted(Path(runs_dir).rglob("metrics.jsonl")):
        run_dir = metrics.parent
        group = cost.setdefault(run_dir.parent.name,
                                {"started": 0, "finished": 0, "core_hours": 0.0})
        group["started"] += 1
        group["finished"] += (run_dir / "run_record.json").exists()
        group["core_hours"] += sum(_segments(run_dir)) * cpus_per_trial / 3600
    return cost


def print_cost(runs_dir: Path, cpus_per_trial: float) -> None:
    cost = sweep_cost(runs_dir, cpus_per_trial)
    for group, c in cost.items():
        print(f"{group}: {c['started']} runs started, {c['finished']} finished, "
              f"{c['core_hours']:.2f} core-hours")
    print(f"total: {sum(c['core_hours'] for c in cost.values()):.2f} core-hours "
          f"({cpus_per_trial:g} CPU per trial)")
