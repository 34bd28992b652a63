"""Board v3's verdicts by the rule board v4 first registered before its data (commit 305f934,
kept as ``leaderboard/v3-rule.json``; board v4 has since revised its own analysis from a design
study, leaderboard/v4/study/): the rule board v3's page applies after its data, and says so.

Per (group, method) other than DP-SGD, two estimands of the method's gain over DP-SGD, in test
accuracy points:

- tuned: the tuned winner's retrain mean minus DP-SGD's (each winner chosen on validation among
  its K seed-0 trials, the board's rule). Its bootstrap draws: the search's selection (the K
  trials resampled, trial 0 kept, both winners re-chosen: board/uncertainty.py) plus each arm's
  own seed variance (Welch, never pooled).
- paired: the mean over the shared trials 1..K-1 of the method's seed-0 test accuracy minus
  DP-SGD's on the same point; its draws resample those trials. A method whose space shares no
  key with DP-SGD's has no paired estimand (the cell says unpaired).

Their hypotheses, one Holm family over the whole board: 'better' (gain <= 0 rejected), 'worse'
(gain >= 0 rejected), 'equivalent' (TOST: gain <= -margin and gain >= +margin both rejected,
its p the larger), the paper's claim (gain >= the smallest claimed gain rejected: 'claim
excluded') and, per method on the dimension ladder, the slope of the tuned gain against
log2(parameters) ('slope <= 0' rejected: 'grows'). Each p is a bootstrap proportion; the labels
come from board/decide.py, which bounds each proportion's Monte Carlo error and draws more until
every label is settled, or says 'undecided at N draws'. (Board v4's design study found that
this rule's percentile bootstraps over-reject: leaderboard/v4/study/README.md.)

Streams: each cell and estimand draws from numpy's default_rng seeded by (the bootstrap seed,
group, method, estimand, draws), so the same records give the same bytes; the labels do not
depend on the stream (decide.py's guarantee, with the registered flip probability).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np

from dpbench.board import decide as decide_lib
from dpbench.board import arms
from dpbench.board import uncertainty
from dpbench.board.results import BASELINE
from dpbench.search import methods as methods_lib
from dpbench.search import space as search_space
from dpbench.search import tuning

CHUNK = 100_000  # draws made at a time (memory: K x CHUNK trial indices)
LADDER_RUNG = re.compile(r"tanh_cnn_x\d+")  # the ladder's rungs: tanh_cnn_x1, _x2, ...


# One arm's runs and one cell, read as board v4 reads them (coordinates and devices unused).
Arm, Cell, read_arm, shares_keys = arms.Arm, arms.Cell, arms.read_arm, arms.shares_keys


def read_cells(records_dir, plans: dict, claims: dict) -> list:
    """Every (group, method) cell of the board: ``plans`` group -> search.json; ``claims``
    method -> its method.json claim (methods.claims)."""
    cells = []
    for group, plan in sorted(plans.items()):
        group_dir = Path(records_dir) / group
        match = tuning.GROUP_PATTERN.match(group)
        epsilon = float(match["eps"])
        base = read_arm(group_dir, plan, BASELINE)
        for method in sorted(set(plan["methods"]) - {BASELINE}):
            claim = methods_lib.claim_range(claims.get(method, {}).get("claim_gain"), epsilon)
            cells.append(Cell(group, method, epsilon, match["model"], base,
                              read_arm(group_dir, plan, method), shares_keys(plan, method),
                              claim_low(claim)))
    return cells


def claim_low(claim) -> Optional[float]:
    """The smallest gain a claimed range (methods.claim_range: points, None for an open end)
    claims; None when it claims no lower end."""
    return None if claim is None or claim[0] is None else float(claim[0])


def _rng(seed: int, *parts) -> np.random.Generator:
    return np.random.default_rng(search_space.stable_seed(seed, *parts))


def _scores(values) -> np.ndarray:
    return np.array([np.nan if v is None else 100.0 * v for v in values])


def tuned_draws(cell: Cell, draws: int, seed: int) -> np.ndarray:
    """``draws`` bootstrap draws of the tuned gain (points): the realized gain, plus the
    re-selected winners' seed-0 gain minus the realized one, plus Welch's seed part (Student t
    at its Welch-Satterthwaite df). A resample where a method has no finished trial gives nan
    (counted against every hypothesis)."""
    rng = _rng(seed, cell.group, cell.method, "tuned", draws)
    gain, se, df = uncertainty.welch(cell.base.retrains, cell.mine.retrains)
    realized = 100.0 * (cell.mine.test[cell.mine.winner] - cell.base.test[cell.base.winner])
    out = np.empty(draws)
    for start in range(0, draws, CHUNK):
        n = min(CHUNK, draws - start)
        idx = uncertainty.resampled_trials(len(cell.mine.validation), n, rng)
        wa = uncertainty.resample_winners(cell.base.validation, idx)
        wb = uncertainty.resample_winners(cell.mine.validation, idx)
        ta, tb = _scores(cell.base.test), _scores(cell.mine.test)
        selection = np.where((wa >= 0) & (wb >= 0), tb[wb] - ta[wa], np.nan)
        t = rng.standard_t(df, n) if math.isfinite(df) else rng.standard_normal(n)
        out[start:start + n] = 100.0 * gain + (selection - realized) + 100.0 * se * t
    return out


def paired_differences(cell: Cell) -> np.ndarray:
    """The method's seed-0 test accuracy minus DP-SGD's on each shared trial 1..K-1 where both
    finished (points)."""
    a, b = _scores(cell.base.test), _scores(cell.mine.test)
    d = (b - a)[1:]
    return d[np.isfinite(d)]


def paired_draws(cell: Cell, draws: int, seed: int) -> np.ndarray:
    d = paired_differences(cell)
    rng = _rng(seed, cell.group, cell.method, "paired", draws)
    out = np.empty(draws)
    for start in range(0, draws, CHUNK):
        n = min(CHUNK, draws - start)
        out[start:start + n] = d[rng.integers(0, len(d), size=(n, len(d)))].mean(axis=1)
    return out


def _slope(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares slopes of the columns of ``y`` (rungs x draws) against ``x``."""
    xc = x - x.mean()
    return (xc[:, None] * (y - y.mean(axis=0))).sum(axis=0) / (xc ** 2).sum()


def ladders(cells: list) -> dict:
    """method -> its cells on the dimension ladder (the ladder model's rungs, each with a
    parameter count), ordered by parameters; only methods with at least two rungs."""
    by_method: dict = {}
    for cell in cells:
        if LADDER_RUNG.fullmatch(cell.model) and cell.mine.parameters:
            by_method.setdefault(cell.method, []).append(cell)
    return {m: sorted(c, key=lambda c: c.mine.parameters) for m, c in by_method.items()
            if len({c.mine.parameters for c in c}) >= 2}


def slope_point(rungs: list) -> float:
    x = np.log2([c.mine.parameters for c in rungs])
    return float(_slope(x, np.array([[c.tuned_point()] for c in rungs]))[0])


def slope_draws(rungs: list, draws: int, seed: int) -> np.ndarray:
    x = np.log2([c.mine.parameters for c in rungs])
    return _slope(x, np.stack([tuned_draws(c, draws, seed) for c in rungs]))


class Hypothesis(NamedTuple):
    key: tuple     # (group, method, estimand, kind) or ('ladder', method, 'slope', 'grows')
    draws: object  # draws(n) -> np.ndarray of n bootstrap draws of its estimand
    null_side: object  # draws -> the number of draws on the null's side (its p's hits)


def _tost(margin: float):
    return lambda d: np.maximum(np.sum(~(d > -margin)), np.sum(~(d < margin)))


def hypotheses(cells: list, analysis: dict, seed: int,
               estimands: tuple = ("tuned", "paired")) -> list:
    """The board's family, in a fixed order (each nan draw counts as a hit: conservative);
    ``estimands``: which gains it labels (board v3's page labels the tuned gain alone)."""
    margin = float(analysis["margin_points"])
    out = []
    for cell in cells:
        estimands_here = [("tuned", lambda n, c=cell: tuned_draws(c, n, seed))]
        if "paired" in estimands and cell.paired and len(paired_differences(cell)) >= 2:
            estimands_here.append(("paired", lambda n, c=cell: paired_draws(c, n, seed)))
        for name, draws in estimands_here:
            key = (cell.group, cell.method, name)
            out += [Hypothesis(key + ("better",), draws, lambda d: np.sum(~(d > 0))),
                    Hypothesis(key + ("worse",), draws, lambda d: np.sum(~(d < 0))),
                    Hypothesis(key + ("equivalent",), draws, _tost(margin))]
            if name == "tuned" and cell.claim_low is not None:
                out.append(Hypothesis(key + ("claim",), draws,
                                      lambda d, c=cell.claim_low: np.sum(~(d < c))))
    for method, rungs in sorted(ladders(cells).items()):
        out.append(Hypothesis(("ladder", method, "slope", "grows"),
                              lambda n, r=rungs: slope_draws(r, n, seed),
                              lambda d: np.sum(~(d > 0))))
    return out


def drawn(h: Hypothesis, n: int, cache: dict) -> np.ndarray:
    """``h``'s n draws, drawn once per (estimand, n) into ``cache`` (an estimand's hypotheses
    share its draws)."""
    if (id(h.draws), n) not in cache:
        cache[(id(h.draws), n)] = h.draws(n)
    return cache[(id(h.draws), n)]


def decide_family(family: list, analysis: dict, cache: Optional[dict] = None):
    """decide.py over the family (``cache``: the draws, kept for the intervals). The TOST's p
    is the larger of two proportions, each bounded on its own: the flip probability is halved
    so that the union bound covers every interval."""
    mc, alpha = analysis["monte_carlo"], float(analysis["family"]["alpha"])
    cache = {} if cache is None else cache

    def hits_for(n: int, indices) -> np.ndarray:
        return np.array([int(family[i].null_side(drawn(family[i], n, cache)))
                         for i in indices])

    return decide_lib.decide(lambda n: hits_for(n, range(len(family))), alpha,
                             mc["schedule"], mc["flip_probability"] / 2, hits_for=hits_for)


def holm_levels(decision, alpha: float) -> np.ndarray:
    """Each hypothesis's Holm level alpha / (m - rank + 1), ranked as Holm steps down: by its
    raw p's upper bound (ties in the family's order). A rejection means adjusted_high <
    alpha, so its raw upper bound, and its p, lie below its level."""
    order = np.argsort(decision.high, kind="stable")
    levels = np.empty(len(order))
    levels[order] = alpha / (len(order) - np.arange(len(order)))
    return levels


def summary(draws: np.ndarray, level: float, power: float) -> dict:
    """The interval at the two-sided level matching a one-sided test at ``level``, and the
    minimum detectable gain at ``power`` for that test, read off the same draws' quantiles
    (the law shifted to a true gain g: the test calls it with probability ``power`` once g
    exceeds the interval's margin on that side plus the draws' distance from their median to
    their (1 - power) quantile; the larger of the two sides). The registered formula, (z(1 -
    level) + z(power)) x the draws' s.d., assumes a normal law and understates where the
    draws are heavy-tailed (4 retrain seeds: Student t with ~6 df), so the MDE would sit
    inside the interval it describes."""
    finite = draws[np.isfinite(draws)]
    lo, p_low, mid, p_high, hi = np.percentile(finite, [
        100 * level, 100 * (1 - power), 50, 100 * power, 100 * (1 - level)])
    mde = max((mid - lo) + (mid - p_low), (hi - mid) + (p_high - mid))
    return dict(low=float(lo), high=float(hi), sd=float(np.std(finite, ddof=1)),
                level=float(level), mde=float(mde))


def _label(kinds: dict, draws: int) -> str:
    """A gain's label from its hypotheses' decisions ({kind: 'reject'|'retain'|'undecided'})."""
    for kind in ("better", "worse", "equivalent"):
        if kinds.get(kind) == "reject":
            return kind
    if "undecided" in (kinds.get(k) for k in ("better", "worse", "equivalent")):
        return f"undecided at {draws:,} draws"
    return "inconclusive"


def interval_label(low: float, high: float, margin: float) -> str:
    """The label an interval shows by itself (the order _label decides in): what a reader
    concludes from the printed bar."""
    if low > 0:
        return "better"
    if high < 0:
        return "worse"
    if -margin < low and high < margin:
        return "equivalent"
    return "inconclusive"


def analyse(cells: list, analysis: dict, seed: int = 0,
            estimands: tuple = ("tuned", "paired")) -> dict:
    """The board's labels: {"cells": {(group, method): {estimand: {...}}}, "slopes": {method:
    {...}}, "draws", "comparisons", "level"}. Each estimand's point, label and the Holm bounds
    on the adjusted p of the hypothesis that decided it (when none did, of 'better' or 'worse',
    whichever the data lean to), and one interval for every row at the family's first Holm
    level (alpha / m a side: simultaneous), with the MDE at that level, all read off the draws
    of the look that settled that hypothesis (``floor``: none of them fell on its null's side,
    so the bound is the least those draws can show). Holm steps down, so a label can be
    decided at a looser level than the simultaneous interval shows: such a row (``shown``
    False, its label decided) carries ``step``, its interval from the same draws at the level
    that decided it (so inside the simultaneous one). The claim's label likewise, with
    ``shown`` and its one-sided bound at its own step."""
    family, cache = hypotheses(cells, analysis, seed, estimands), {}
    decision = decide_family(family, analysis, cache)
    alpha, power = float(analysis["family"]["alpha"]), float(analysis["mde"]["power"])
    margin = float(analysis["margin_points"])
    simultaneous = alpha / max(len(family), 1)
    levels = holm_levels(decision, alpha)
    by_key = {h.key: (h, label, level) for h, label, level
              in zip(family, decision.labels, levels)}
    looks = {h.key: int(n) for h, n in zip(family, decision.settled_draws)}
    bounds = {h.key: (float(lo), float(hi)) for h, lo, hi
              in zip(family, decision.adjusted_low, decision.adjusted_high)}
    first = int(analysis["monte_carlo"]["schedule"][0])
    out: dict = {"cells": {}, "slopes": {}, "draws": decision.draws,
                 "comparisons": len(family), "level": simultaneous}
    for cell in cells:
        row = {}
        for estimand in ("tuned", "paired"):
            kinds = {k[3]: by_key[k][1] for k in by_key if k[:3] == (cell.group, cell.method,
                                                                     estimand)}
            if not kinds:
                continue
            label = _label(kinds, decision.draws)
            key = (cell.group, cell.method, estimand)
            deciding = label if label in kinds else min(  # the side the data lean to
                ("better", "worse"), key=lambda k: bounds[key + (k,)][1])
            h, _, level = by_key[key + (deciding,)]
            draws = drawn(h, looks[h.key], cache)  # the look that settled it (most: the first)
            point = cell.tuned_point() if estimand == "tuned" else float(
                np.mean(paired_differences(cell)))
            interval = summary(draws, simultaneous, power)
            row[estimand] = dict(point=point, label=label, decided_by=deciding,
                                 p_adjusted=bounds[h.key],
                                 floor=bool(h.null_side(draws) == 0), **interval)
            row[estimand]["shown"] = interval_label(interval["low"], interval["high"],
                                                    margin) == label
            if not row[estimand]["shown"] and label in kinds:  # decided at a later step
                step = summary(draws, level, power)  # the same draws at that step's level
                row[estimand]["step"] = dict(low=step["low"], high=step["high"], level=level)
            if "claim" in kinds:
                ch, _, claim_level = by_key[key + ("claim",)]
                excluded = kinds["claim"] == "reject"
                row[estimand]["claim"] = dict(
                    low=cell.claim_low, p_adjusted=bounds[ch.key],
                    floor=bool(ch.null_side(draws) == 0),
                    label={"reject": "claim excluded", "retain": "consistent"}.get(
                        kinds["claim"], f"undecided at {decision.draws:,} draws"),
                    shown=(interval["high"] < cell.claim_low) == excluded,
                    step_high=summary(drawn(ch, looks[ch.key], cache), claim_level,
                                      power)["high"],
                    step_level=claim_level)
        row["unpaired"] = "paired" not in row
        out["cells"][(cell.group, cell.method)] = row
    for method, rungs in ladders(cells).items():
        h, label, level = by_key[("ladder", method, "slope", "grows")]
        out["slopes"][method] = dict(
            point=slope_point(rungs), rungs=[(c.mine.parameters, c.tuned_point()) for c in rungs],
            label={"reject": "grows", "retain": "no growth shown"}.get(
                label, f"undecided at {decision.draws:,} draws"),
            **summary(drawn(h, first, cache), simultaneous, power))
    return out
