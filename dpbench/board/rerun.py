"""A board's protocol rerun (e.g. on a lent GPU, trials as groups) against the board's committed
records: per group and method, what the rerun has published and how its test accuracy compares.

Two comparisons per (group, method), each a difference rerun - committed with a 95% interval:

- search (paired): trial j of the rerun and of the board ran the same configuration with the
  same seed (0), so the same Poisson batches and noise keys; only the device's rounding (and
  the step's summation order) differs. The mean over the trials both have of the paired
  differences in test accuracy, with a t interval over those trials. A diverged trial on
  either side is left out and counted.
- retrains (unpaired): the winner chosen on validation (the board's rule) retrained on seeds
  1..; the mean test accuracy of the rerun's retrains against the board's (Welch interval). The
  winners may differ: this difference holds the selection's randomness as well as the seeds'.

The page leads with what the rerun can establish outright: whether each cell whose search
both sides ran whole chose the same winner. A paired difference is not a random draw (same
configuration, same seed): it is the device's rounding carried through training, so a per-cell
interval asks whether that rounding moves accuracy one way. Intervals are per cell (95%) and
Bonferroni-adjusted over the cells; a cell with fewer than ``MIN_PAIRS_BONFERRONI`` pairs gets
no adjusted interval (with 1 degree of freedom it spans tens of points and says nothing).

  python -m dpbench.board.rerun --rerun=leaderboard/gpu/v3-rerun/records \
      --committed=leaderboard/records --out=leaderboard/gpu/v3-rerun/comparison.md
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from scipy import stats

from dpbench.search import tuning

MIN_PAIRS_BONFERRONI = 4  # fewer pairs: no Bonferroni interval (1-2 df span tens of points)


def _outcome(group_dir: Path, method: str, trial: int, seed: int):
    """('ok', record) | ('diverged', None) | ('missing', None)."""
    try:
        record, _ = tuning.trial_outcome(group_dir, method, trial, seed)
    except tuning.SearchIncomplete:
        return "missing", None
    return ("diverged", None) if record is None else ("ok", record)


def _interval(values, level: float):
    n = len(values)
    if n < 2:
        return None
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    half = stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return mean - half, mean + half


def _welch(a, b, level: float):
    if len(a) < 2 or len(b) < 2:
        return None
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1)) if se else 1.0
    diff = statistics.fmean(a) - statistics.fmean(b)
    half = stats.t.ppf(0.5 + level / 2, df) * se
    return diff - half, diff + half


def _winner(group_dir: Path, plan: dict, method: str):
    validation = {}
    for t in range(plan["num_trials"]):
        kind, record = _outcome(group_dir, method, t, plan["seeds"][0])
        if kind == "missing":
            return None
        validation[t] = None if record is None else record["validation_accuracy"]
    return tuning.choose_trial(validation)


def compare_cell(rerun: Path, committed: Path, plan: dict, method: str, cells: int) -> dict:
    """The two comparisons of one (group, method); ``cells``: the family's size, for the
    Bonferroni level."""
    seed0 = plan["seeds"][0]
    pairs, devices, diverged, missing = [], set(), 0, 0
    for t in range(plan["num_trials"]):
        (ka, ra), (kb, rb) = (_outcome(rerun, method, t, seed0),
                              _outcome(committed, method, t, seed0))
        if ka == "missing":
            missing += 1
        elif "diverged" in (ka, kb):
            diverged += 1
        else:
            pairs.append(ra["test_accuracy"] - rb["test_accuracy"])
            devices.update(ra.get("devices") or [])
    out = dict(method=method, search_pairs=len(pairs), search_missing=missing,
               search_diverged=diverged, devices=sorted(devices))
    if pairs:
        out["search_diff"] = statistics.fmean(pairs)
        out["search_ci"] = _interval(pairs, 0.95)
        if len(pairs) >= MIN_PAIRS_BONFERRONI:
            out["search_ci_bonferroni"] = _interval(pairs, 1 - 0.05 / cells)
    winners = (_winner(rerun, plan, method), _winner(committed, plan, method))
    out["winners"] = winners
    retrains = []
    for directory, winner in zip((rerun, committed), winners):
        accs = []
        if winner is not None:
            for s in plan["seeds"][1:]:
                kind, record = _outcome(directory, method, winner, s)
                if kind == "ok":
                    accs.append(record["test_accuracy"])
        retrains.append(accs)
    out["retrains"] = [len(a) for a in retrains]
    if all(len(a) == len(plan["seeds"]) - 1 for a in retrains):
        out["retrain_means"] = [statistics.fmean(a) for a in retrains]
        out["retrain_diff"] = out["retrain_means"][0] - out["retrain_means"][1]
        out["retrain_ci"] = _welch(*retrains, 0.95)
        out["retrain_ci_bonferroni"] = _welch(*retrains, 1 - 0.05 / cells)
    return out


def _pts(x) -> str:
    return f"{100 * x:+.2f}"


def _ci(ci) -> str:
    return "n/a" if ci is None else f"[{_pts(ci[0])}, {_pts(ci[1])}]"


def same_winner(rows: list) -> tuple:
    """(cells whose search both sides ran whole, of them those that chose the same winner)."""
    whole = [r for r in rows if None not in r["winners"]]
    return len(whole), sum(r["winners"][0] == r["winners"][1] for r in whole)


def render(rows: list, rerun: Path, committed: Path) -> str:
    search = [r for r in rows if r.get("search_ci")]
    retrain = [r for r in rows if r.get("retrain_ci")]
    excl = lambda key: sum(1 for r in rows if r.get(key) and not r[key][0] <= 0 <= r[key][1])
    whole, same = same_winner(rows)
    few = sum(1 for r in search if "search_ci_bonferroni" not in r)
    lines = [
        f"Rerun `{rerun}` against the committed `{committed}` (generated by "
        "`python -m dpbench.board.rerun`; test accuracy in points, rerun - committed).", "",
        f"- **The winner on validation is the same trial in {same} of the {whole} cells whose "
        "search both sides ran whole**: the board's choice of configuration does not move "
        "with the device.",
        f"- cells with a paired search comparison: {len(search)} of {len(rows)}; their 95% "
        f"interval excludes 0 in {excl('search_ci')}, the Bonferroni interval (over "
        f"{len(rows)} cells) in {excl('search_ci_bonferroni')}. A pair is the same "
        "configuration on the same seed: its difference is the device's rounding carried "
        "through training, not a random draw; an interval asks whether it moves accuracy one "
        f"way. {few} cell(s) with fewer than {MIN_PAIRS_BONFERRONI} pairs get no Bonferroni "
        "interval (with 1-2 degrees of freedom it spans tens of points).",
        f"- cells with both winners' retrains: {len(retrain)} of {len(rows)}; 95% interval "
        f"excludes 0 in {excl('retrain_ci')} (about {0.05 * len(retrain):.1f} expected), "
        f"Bonferroni in {excl('retrain_ci_bonferroni')}.", "",
        "| group | method | search: trials paired | mean diff | 95% CI | Bonferroni CI | "
        "winner rerun / board | retrains: rerun mean | board mean | diff | 95% CI (Welch) | "
        "Bonferroni CI | rerun devices |",
        "|" + "---|" * 13]
    for r in rows:
        means = r.get("retrain_means")
        lines.append("| " + " | ".join([
            r["group"], r["method"],
            f"{r['search_pairs']}" + (f" ({r['search_missing']} not run)" if r["search_missing"]
                                      else "")
            + (f" ({r['search_diverged']} diverged)" if r["search_diverged"] else ""),
            _pts(r["search_diff"]) if "search_diff" in r else "n/a", _ci(r.get("search_ci")),
            _ci(r.get("search_ci_bonferroni")),
            " / ".join("-" if w is None else f"t{w}" for w in r["winners"]),
            f"{100 * means[0]:.2f}" if means else f"{r['retrains'][0]} of 4 run",
            f"{100 * means[1]:.2f}" if means else "",
            _pts(r["retrain_diff"]) if means else "n/a", _ci(r.get("retrain_ci")),
            _ci(r.get("retrain_ci_bonferroni")), ", ".join(r["devices"]) or "-"]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """``python -m dpbench.board.rerun --rerun=DIR --committed=DIR [--out=FILE.md]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rerun", type=Path, required=True)
    parser.add_argument("--committed", type=Path, required=True)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    groups = sorted(p.parent.name for p in args.rerun.glob("*/search.json"))
    if not groups:
        parser.error(f"{args.rerun} holds no <group>/search.json: is it a sweep's records folder?")
    plans = {g: json.loads((args.rerun / g / "search.json").read_text()) for g in groups}
    cells = sum(len(p["methods"]) for p in plans.values())
    rows = []
    for group, plan in plans.items():
        for method in plan["methods"]:
            row = compare_cell(args.rerun / group, args.committed / group, plan, method, cells)
            rows.append(dict(row, group=group))
    text = render(rows, args.rerun, args.committed)
    if args.out:
        args.out.write_text(text)
        (args.out.with_suffix(".json")).write_text(json.dumps(rows, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
