"""``dpbench sweep --cost``: the core-hours a sweep's runs took, each process's wall time
summed from its metrics (runs interrupted and resumed count every segment). ``dpbench sweep
--progress``: where a sweep under way stands, from its published records alone (what a
checkout that did not run it has)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from dpbench import records
from dpbench.search import junk as search_junk
from dpbench.search import tuning


def _share(record: dict) -> float:
    """A run's share of the process that trained it: 1, or 1/T for one of a group of T trials
    (dpbench/run/group.py), whose wall time is its whole group's."""
    return 1.0 / ((record.get("group") or {}).get("size") or 1)


def _segments(run_dir: Path) -> list:
    """Wall seconds of each process that trained the run: a process's last logged ``wall_s``
    (each process restarts the clock, so a drop starts a segment); a finished run's last
    segment is its record's ``wall_time_s``, which also covers the steps after the last log.
    A finished run trained in a group counts its share of each (an unfinished one, whole)."""
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
    record = run_dir / records.RECORD_NAME
    if record.exists():
        finished = json.loads(record.read_text())
        segments[-1:] = [max(finished["wall_time_s"], segments[-1] if segments else 0.0)]
        segments = [s * _share(finished) for s in segments]
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
        group["finished"] += (run_dir / records.RECORD_NAME).exists()
        group["core_hours"] += sum(_segments(run_dir)) * cpus_per_trial / 3600
    return cost


def print_cost(runs_dir: Path, cpus_per_trial: float) -> None:
    cost = sweep_cost(runs_dir, cpus_per_trial)
    for group, c in cost.items():
        print(f"{group}: {c['started']} runs started, {c['finished']} finished, "
              f"{c['core_hours']:.2f} core-hours")
    print(f"total: {sum(c['core_hours'] for c in cost.values()):.2f} core-hours "
          f"({cpus_per_trial:g} CPU per trial)")


def progress(records_dir: Path) -> dict:
    """{group: {"published", "expected", "junk", "random", "core_hours", "gpu_hours",
    "left_core_hours"}} of every group under ``records_dir`` with a search.json: runs published
    (records and diverged runs) of those its search and retrains will publish, the junk rate so
    far (``search.junk.junk_rate``), the core-hours of the published records made on a CPU
    (their wall_time_s, one CPU each; a grouped run's share of its group's), the GPU-worker
    hours of those made on a GPU (wall time of a run sharing one GPU with others: not core
    time), and an estimate of the rest on CPUs:
    each unpublished run at the median wall time of its method's CPU runs in the group, else
    in the family's other groups (None when a method has none anywhere)."""
    groups = sorted(p.parent for p in Path(records_dir).glob(f"*/{tuning.SEARCH_FILE}"))
    walls, gpu_walls = {}, {}  # (family, group, method) -> published CPU / GPU wall times
    for group_dir in groups:
        plan = json.loads((group_dir / tuning.SEARCH_FILE).read_text())
        for method in plan["methods"]:
            key = plan["family"], group_dir.name, method
            walls[key], gpu_walls[key] = [], []
            for run_dir in tuning.method_run_dirs(group_dir, method):
                if not (run_dir / records.RECORD_NAME).exists():
                    continue
                record = json.loads((run_dir / records.RECORD_NAME).read_text())
                (gpu_walls if on_accelerator(record) else walls)[key].append(
                    record["wall_time_s"] * _share(record))
    out = {}
    for group_dir in groups:
        plan = json.loads((group_dir / tuning.SEARCH_FILE).read_text())
        published, expected = tuning.search_progress(group_dir)
        junk, random = search_junk.junk_rate(group_dir)
        left, spent, gpu = 0.0, 0.0, 0.0
        for method in plan["methods"]:
            mine = walls[plan["family"], group_dir.name, method]
            spent += sum(mine)
            gpu += sum(gpu_walls[plan["family"], group_dir.name, method])
            family = [w for (f, _, m), ws in walls.items() if f == plan["family"]
                      and m == method for w in ws]
            runs_left = plan["num_trials"] + len(plan["seeds"]) - 1 - _published_runs(
                group_dir, method)
            if runs_left and left is not None:
                left = None if not (mine or family) else left + runs_left * statistics.median(
                    mine or family)
        out[group_dir.name] = dict(published=published, expected=expected, junk=junk,
                                   random=random, core_hours=spent / 3600,
                                   gpu_hours=gpu / 3600,
                                   left_core_hours=None if left is None else left / 3600)
    return out


def on_accelerator(record: dict) -> bool:
    """Whether a run record was made on a GPU (its ``devices``, as jax names them)."""
    return any(str(d).startswith(("cuda", "gpu", "rocm")) for d in record.get("devices") or [])


def _published_runs(group_dir: Path, method: str) -> int:
    return sum(1 for d in tuning.method_run_dirs(group_dir, method) if tuning.published(d))


def print_progress(records_dir: Path, cpus: int) -> None:
    report = progress(records_dir)
    for group, g in report.items():
        left = "unknown" if g["left_core_hours"] is None else f"~{g['left_core_hours']:.1f}"
        print(f"{group}: {g['published']} of {g['expected']} runs published; junk {g['junk']} "
              f"of {g['random']} random trials; {g['core_hours']:.2f} core-hours spent"
              + (f" (and {g['gpu_hours']:.2f} GPU-worker hours)" if g["gpu_hours"] else "")
              + f", {left} left")
    spent = sum(g["core_hours"] for g in report.values())
    gpu = sum(g["gpu_hours"] for g in report.values())
    lefts = [g["left_core_hours"] for g in report.values()]
    left = None if None in lefts else sum(lefts)
    print(f"total: {spent:.2f} core-hours spent (the CPU records' wall_time_s), "
          + (f"{gpu:.2f} GPU-worker hours (the GPU records'), " if gpu else "")
          + ("left unknown" if left is None else
             f"~{left:.1f} left (~{left / cpus:.1f} h on {cpus} CPUs)"))
