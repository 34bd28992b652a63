"""Junk: the random trials of a search that ended far below its group's best, or diverged,
a fact of a search's published outcomes (the board prints it; ``dpbench sweep progress``
reports it while a search is under way)."""

from __future__ import annotations

import json
from pathlib import Path

from dpbench.search import tuning

JUNK_POINTS = 0.05  # a random trial this far (test accuracy) below its group's best is junk


def junk_breakdown(group_dir) -> dict:
    """Junk over the random trials (j >= 1, seed 0) of every method of a group published so
    far: {"junk", "random", "by_method": {method: junk}, "own_best"}. Junk ends more than 5
    points below the best seed-0 trial of the group, or diverged; "own_best" counts the random
    trials more than 5 points below their own method's best seed-0 trial (or diverged), which
    tells a method that is weak everywhere from a space that draws badly. Works on a search
    still under way (what is unpublished is not counted)."""
    group_dir = Path(group_dir)
    plan = json.loads((group_dir / tuning.SEARCH_FILE).read_text())
    seed0, scores = plan["seeds"][0], {}
    for method in plan["methods"]:
        for trial in range(plan["num_trials"]):
            try:
                record = tuning.trial_outcome(group_dir, method, trial, seed0)[0]
            except tuning.SearchIncomplete:
                continue
            scores[(method, trial)] = None if record is None else record["test_accuracy"]
    out = dict(junk=0, random=0, by_method={m: 0 for m in plan["methods"]}, own_best=0)
    finished = [v for v in scores.values() if v is not None]
    if not finished:
        return out
    best = max(finished)
    own = {m: max((v for (mm, _), v in scores.items() if mm == m and v is not None),
                  default=None) for m in plan["methods"]}
    for (method, trial), v in scores.items():
        if trial == 0:
            continue
        out["random"] += 1
        if v is None or v < best - JUNK_POINTS:
            out["junk"] += 1
            out["by_method"][method] += 1
        if v is None or v < own[method] - JUNK_POINTS:
            out["own_best"] += 1
    return out


def junk_rate(group_dir) -> tuple[int, int]:
    """(junk, published) of ``junk_breakdown``."""
    breakdown = junk_breakdown(group_dir)
    return breakdown["junk"], breakdown["random"]
