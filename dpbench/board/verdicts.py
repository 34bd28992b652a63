"""What a board's verdicts are checked against: the best DP-SGD configuration on record (the
baseline check) and an earlier board's gains."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.stats

from dpbench.board.results import (BASELINE, config_key, config_label,
                                   load_records, summarize)
from dpbench.search.tuning import GROUP_PATTERN


def best_recorded_baseline(records, dataset: str, model: str, epsilon: float, delta: float,
                           exclude=None):
    """The best OTHER DP-SGD configuration dpbench has recorded for a group (``records``: every
    record set's runs, archives included, each with ``_set`` naming the board whose code ran
    it): highest mean test accuracy over its seeds 1 and up (seed 0 is a search's selected
    seed, biased upward) among configurations with at least 2 such seeds, one board's code at
    a time (a configuration's seeds from two boards are never pooled); ``exclude`` is the
    (set, configuration key) of the row under check. A check, not a claim: picking the best on
    test is itself biased upward, which makes the check strict. None when there is none."""
    configs, seen = {}, []
    for r in records:
        if (r["pipeline"], r["dataset"], r["model"]) == (BASELINE, dataset, model) and \
                float(r["target_epsilon"]) == float(epsilon) and float(r["delta"]) == delta:
            key = (r.get("_set", ""), config_key(r))
            seen.append((key, r))  # the label names what sets the best apart from all of them
            if key != exclude and r.get("seed") != 0:
                configs.setdefault(key, []).append(r)
    scored = {k: [float(r["test_accuracy"]) for r in runs] for k, runs in configs.items()
              if len({r["seed"] for r in runs}) >= 2}
    if not scored:
        return None
    best = min(scored, key=lambda k: (-np.mean(scored[k]), k))
    others = [r for k, r in seen if k[1] != best[1]]
    return dict(key=best, scores=scored[best], where=str(configs[best][0].get("_path", "")),
                label=config_label(configs[best][0], others))


def baseline_check(current_scores, best) -> dict:
    """Is the board's DP-SGD row at least the best recorded DP-SGD configuration? 'weaker'
    when a 95% Welch t interval of (row - best) lies below zero, else 'ok'; both means shown."""
    row = np.asarray(current_scores, float)
    if best is None:
        return dict(status="ok", row=float(row.mean()), best=None)
    other = np.asarray(best["scores"], float)
    diff = float(row.mean() - other.mean())
    if row.var() == 0 and other.var() == 0:  # no spread at all: Welch's interval is undefined
        weaker = diff < 0
    else:
        welch = scipy.stats.ttest_ind(row, other, equal_var=False)
        weaker = welch.confidence_interval(0.95).high < 0
    return dict(status="weaker" if weaker else "ok", row=float(row.mean()),
                best=float(other.mean()), best_label=best["label"], best_where=best["where"])


def earlier_gains(records_dir) -> dict:
    """(model, epsilon, method) -> (gain, s.e.) over DP-SGD on an earlier board (its records
folder; {} without one)."""
    if records_dir is None or not Path(records_dir).is_dir():
        return {}
    out = {}
    for group, rows in summarize(load_records(Path(records_dir)), {}, Path(records_dir)).items():
        match = GROUP_PATTERN.match(group)
        for row in rows:
            out[(match["model"], float(match["eps"]), row["method"])] = (row["gain"],
                                                                         row["gain_se"])
    return out


def baseline_text(check: dict) -> str:
    """The group's baseline check as one sentence."""
    if check["best"] is None:
        return ("Baseline check: no other DP-SGD configuration with 2+ seeds besides seed 0 is "
                "recorded.")
    head = (f"Baseline check: DP-SGD's row {100 * check['row']:.2f} (its retrain seeds) against "
            f"the best other DP-SGD configuration on record (seeds 1 and up, one board's code "
            f"at a time), "
            f"{100 * check['best']:.2f} ({check['best_label']}; {check['best_where']}): ")
    if check["status"] == "weaker":
        return head + ("**weaker** (a 95% Welch interval lies below zero): every verdict of "
                       "this group is against a baseline below what DP-SGD is known to reach.")
    return head + "ok (not significantly below it)."


