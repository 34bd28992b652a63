"""The board's verdicts: each method's gain over the baseline next to its paper's claim and
v1's gain."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.stats

from dpbench.board import uncertainty
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


def v1_gains(v1_records) -> dict:
    """(model, epsilon, method) -> (gain, s.e.) over DP-SGD on the archived board v1."""
    if v1_records is None or not Path(v1_records).is_dir():
        return {}
    out = {}
    for group, rows in summarize(load_records(Path(v1_records)), {}, Path(v1_records)).items():
        match = GROUP_PATTERN.match(group)
        for row in rows:
            out[(match["model"], float(match["eps"]), row["method"])] = (row["gain"],
                                                                         row["gain_se"])
    return out


def seed_comparison(base_scores, scores):
    """The seeds-only comparison of a searched (unpaired) group's winners: Welch's gain, s.e.
    and df, the two-sided t-test p-value and the 90% interval (for 'equivalent'); None with
    fewer than 2 seeds on either side. It leaves the search's luck out: the label says so."""
    if len(base_scores) < 2 or len(scores) < 2:
        return None
    gain, se, df = uncertainty.welch(base_scores, scores)
    if se == 0:
        p, half = (1.0 if gain == 0 else 0.0), 0.0
    else:
        p = float(2 * scipy.stats.t.sf(abs(gain) / se, df))
        half = float(scipy.stats.t.ppf(1 - uncertainty.ALPHA, df) * se)
    return dict(gain=gain, se=se, df=df, p_value=p, low90=gain - half, high90=gain + half)


def verdicts(table: dict, claims: dict, v1: dict) -> dict:
    """group -> one row per method (but DP-SGD) of a finished v2 search: its paper's claim,
    its gain over DP-SGD +- s.e., its verdict (the seeds-only comparison, Holm over every such
    comparison of the board: ``seed_comparison``), the search's epsilon, board v1's gain at
    the same model and epsilon, and the sentence on what changed (claims["what_changed"]
    [group], written by hand)."""
    out, tests = {}, {}
    for group, rows in table.items():
        if not any(r["search"] for r in rows):
            continue
        match = GROUP_PATTERN.match(group)
        base = next((r for r in rows if r["method"] == BASELINE), None)
        out[group] = []
        for r in sorted(rows, key=lambda r: r["method"]):
            if r["method"] == BASELINE:
                continue
            test = None if base is None else seed_comparison(base["test_scores"],
                                                             r["test_scores"])
            if test is not None:
                tests[(group, r["method"])] = test
            out[group].append(dict(
                method=r["method"], claim=claims.get("methods", {}).get(r["method"], {}),
                v1=v1.get((match["model"], float(match["eps"]), r["method"])),
                gain=r["gain"], gain_se=r["gain_se"], search=r["search"], test=test,
                changed=claims.get("what_changed", {}).get(group, {}).get(r["method"], "")))
    adjusted = uncertainty.holm({k: t["p_value"] for k, t in tests.items()})
    for group, rows in out.items():
        for v in rows:
            if v["test"] is not None:
                v["p_adjusted"] = adjusted[(group, v["method"])]
                v["verdict"] = uncertainty.label(v["test"], v["p_adjusted"])
    return out


def gain_text(gain, se) -> str:
    if gain is None:
        return "n/a"
    return f"{100 * gain:+.2f}" + ("" if se is None else f" ± {100 * se:.2f}")


VERDICT_COLUMNS = ("method", "paper", "paper's claim", "gain over DP-SGD, points (± s.e.)",
                   "verdict (seeds only, Holm; search luck not included)", "ε incl. tuning",
                   "gain on board v1", "what changed")


def verdict_tables(verdict_rows: dict) -> list:
    """[(title, rows of cells)] for the verdicts, one table per finished v2 group."""
    tables = []
    for group, rows in verdict_rows.items():
        cells = [[v["method"], v["claim"].get("paper", "n/a"), v["claim"].get("claim", "n/a"),
                  gain_text(v["gain"], v["gain_se"]),
                  "n/a (fewer than 2 seeds)" if v["test"] is None else
                  f"{v['verdict']} (p {_p_text(v['p_adjusted'])})",
                  f"{v['search']['search_epsilon']:.3f}",
                  "n/a (not on v1)" if v["v1"] is None else gain_text(*v["v1"]),
                  v["changed"] or "—"] for v in rows]
        tables.append((f"Verdicts: {group}", cells))
    return tables


V3_COLUMNS = ("method", "paper", "paper's claim", "gain, seeds 1-4",
              "interval (incl. search) at the level that decided the verdict",
              "verdict (Holm, p bound); the claim",
              "min. detectable gain (80% power, at that level)",
              "paired per-trial gain: median (W-L, sign p)",
              "ε, K secret (deployment)", "ε, all published (distinct runs)",
              "earlier board's gain")


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


def deployment_cell(row: dict) -> str:
    """The 'K secret' epsilon, or why there is none (RDP's charge for truncated batches)."""
    if row["deployment_epsilon"] is not None:
        return f"{row['deployment_epsilon']:.3f}"
    if row.get("deployment_note"):
        return "none: truncated-batch overflow uses up δ in RDP (see the group's notes)"
    return "n/a"


def _p_bound(p: float) -> str:
    """An upper bound on a Holm-adjusted p, rounded up (never printed below what it bounds)."""
    if p >= 1:
        return "1"
    digits = max(2, -int(np.floor(np.log10(p))) + 1)
    return f"{np.ceil(p * 10 ** digits) / 10 ** digits:.{digits}f}"


def _p_text(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def paired_cell(gains) -> str:
    """The per-trial paired gain: median over the matched trials, wins-losses, sign test p."""
    if gains is None:
        return "n/a"
    median = "n/a" if gains["median"] is None else f"{100 * gains['median']:+.2f}"
    return f"{median} ({gains['wins']}-{gains['losses']}, p {_p_text(gains['sign_p'])})"


def v3_table(analysis: dict, earlier: dict) -> tuple:
    """(title, rows of cells) of one paired group's verdicts; ``earlier``: (model, epsilon,
    method) -> (gain, s.e.) of the previous board (v2_gains)."""
    match = GROUP_PATTERN.match(analysis["group"])
    cells = []
    for method, r in sorted(analysis["methods"].items()):
        if "interval" not in r:
            continue
        i = r["interval"]
        before = earlier.get((match["model"], float(match["eps"]), method))
        cells.append([
            method, r["claim"].get("paper", "n/a"), r["claim"].get("claim", "n/a"),
            f"{100 * i['gain']:+.2f}",
            f"[{100 * i['low']:+.2f}, {100 * i['high']:+.2f}] ({100 * i['level']:.2f}%)",
            f"{r['verdict']} (p ≤ {_p_bound(r['p_adjusted'][1])})"
            + (f"; claim: {r['claim_label']}" if r.get("claim_label") else ""),
            f"{100 * i['mde']:.2f}",
            "unpaired: no shared knob" if not r["shares"] else paired_cell(r["paired_gains"]), deployment_cell(r),
            f"{r['published_epsilon']:.3f}",
            "n/a" if before is None else gain_text(*before)])
    return (f"Verdicts: {analysis['group']}", cells)
