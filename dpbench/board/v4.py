"""Board v4's verdicts, computed exactly as its registered analysis (``<board>/analysis.json``,
proved first by search/registration.py, chosen by the design study leaderboard/v4/study/) says.

Decisions (two Holm families at the registered alpha; no Monte Carlo, so no label can depend
on a random stream):

- main: per (group, method) other than DP-SGD, the paired gain: the mean over the family's
  shared trials 1..K-1 of the method's seed-0 test accuracy minus DP-SGD's at the same
  configuration (points), by the surface-adjusted paired t (board/gains.py), or, for a method
  whose space is its own (Nasr et al.), Welch's t on the two arms' random trials. Hypotheses
  'better' (gain <= 0 rejected) and 'worse' (gain >= 0 rejected), and for a paper claiming a
  gain above 0 'claim excluded' (gain >= the claim rejected); a claim of 'at least 0' is
  'worse' itself and is not tested twice.
- ladder: per method, the least-squares slope of that paired gain against log2(parameters)
  over the rungs (the main board's tanh CNN at the ladder's epsilon is x1), 'grows' (slope <=
  0 rejected) and 'shrinks' (slope >= 0 rejected); a rung where DP-SGD's winner sits in the
  outer edge of the lr x C range is a drift out of the space: that method's slope is not judged.
  A wider rung's own gains enter only the slope (they label nothing).

Descriptive (outside both families, and said so): the tuned gain (the winners' retrain means)
with its ideal bootstrap interval (board/ideal.py) at the registered level, and the shared
trials' sign test (unadjusted).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import numpy as np
import scipy.stats

from dpbench.board import arms as arm_reader
from dpbench.board import decide, ideal, uncertainty
from dpbench.board.gains import TLaw, slope_law
from dpbench.board.results import BASELINE
from dpbench.search import methods as methods_lib
from dpbench.search import tuning

RUNG = re.compile(r"(?P<base>\w+)_x(?P<width>\d+)")  # a ladder rung's model: tanh_cnn_x2, ...


Arm, Cell, read_arm, shares_keys, family_space = (
    arm_reader.Arm, arm_reader.Cell, arm_reader.read_arm, arm_reader.shares_keys,
    arm_reader.family_space)


def read_cells(records_dir, plans: dict, claims: dict,
               jax_version: Optional[str] = None) -> list:
    """Every (group, method) cell of the board: ``plans`` group -> search.json; ``claims``
    method -> its method.json claim (methods.claims). A group whose runs trained on more than
    one device kind, or under another JAX version than ``jax_version`` (the registration's),
    is refused: one arm's device would be another's bias."""
    cells = []
    for group, plan in sorted(plans.items()):
        group_dir = Path(records_dir) / group
        match = tuning.GROUP_PATTERN.match(group)
        epsilon, space = float(match["eps"]), family_space(plan)
        base = read_arm(group_dir, plan, BASELINE, space)
        arms = {method: read_arm(group_dir, plan, method, space)
                for method in sorted(set(plan["methods"]) - {BASELINE})}
        check_devices(group, [base, *arms.values()], jax_version)
        for method, mine in arms.items():
            claim = methods_lib.claim_range(claims.get(method, {}).get("claim_gain"), epsilon)
            cells.append(Cell(group, method, epsilon, match["model"], base, mine,
                              shares_keys(plan, method),
                              None if claim is None or claim[0] is None else float(claim[0]),
                              space))
    return cells


def check_devices(group: str, arms: list, jax_version: Optional[str]) -> None:
    found = set().union(*(a.devices for a in arms))
    kinds = {kind for kind, _ in found}
    versions = {version for _, version in found}
    if len(kinds) > 1 or (jax_version is not None and versions != {jax_version}):
        raise tuning.SearchRecordError(
            f"{group}: its runs trained on {sorted(found)}; board v4's analysis registers one "
            f"device kind per group and JAX {jax_version}: rerun the group's odd runs there")


def _points(values) -> np.ndarray:
    return np.array([np.nan if v is None else 100.0 * v for v in values])


def seed_variance(cells: list) -> dict:
    """group -> its seed variance of test accuracy (points^2), pooled over every arm's
    retrains (DP-SGD's once)."""
    arms: dict = {}
    for c in cells:
        arms.setdefault(c.group, {})[BASELINE] = c.base
        arms[c.group][c.method] = c.mine
    out = {}
    for group, by_method in arms.items():
        dev = [_points(a.retrains) - np.mean(_points(a.retrains)) for a in by_method.values()
               if len(a.retrains) > 1]
        dof = sum(len(x) - 1 for x in dev)
        out[group] = float(sum(np.sum(x ** 2) for x in dev) / dof) if dof else 0.0
    return out


def paired_law(cell: Cell, seed_var: float) -> TLaw:
    """The cell's primary law (see the module docstring)."""
    a, b = _points(cell.base.test)[1:], _points(cell.mine.test)[1:]
    if not cell.paired:
        return TLaw.welch(a[np.isfinite(a)], b[np.isfinite(b)])
    ok = np.isfinite(a) & np.isfinite(b)
    if cell.space is None or cell.base.coordinates is None:
        return TLaw.paired((b - a)[ok])
    features = cell.space.features(cell.base.coordinates[1:][ok])
    return TLaw.adjusted((b - a)[ok], a[ok], features, seed_var)


def tuned_law(cell: Cell) -> ideal.TunedLaw:
    return ideal.TunedLaw(cell.base.validation, cell.base.test, cell.base.winner,
                          cell.base.retrains, cell.mine.validation, cell.mine.test,
                          cell.mine.winner, cell.mine.retrains)


def ladders(cells: list, ladder: dict) -> dict:
    """method -> its ladder cells ordered by parameters: the rungs' models (``base``_xN) and
    the main board's ``base`` model as x1, at the ladder's epsilon; only methods with at least
    two rungs of distinct parameter counts."""
    base, epsilon = ladder["x1"]["model"], float(ladder["x1"]["epsilon"])
    by_method: dict = {}
    for c in cells:
        rung = RUNG.fullmatch(c.model)
        on_ladder = c.model == base or (rung is not None and rung["base"] == base)
        if on_ladder and c.epsilon == epsilon and c.mine.parameters:
            by_method.setdefault(c.method, []).append(c)
    return {m: sorted(r, key=lambda c: c.mine.parameters) for m, r in by_method.items()
            if len({c.mine.parameters for c in r}) >= 2}


def at_edge(cell: Cell, edge: float) -> bool:
    """DP-SGD's winner at this rung sits in the outer ``edge`` of the lr x C log range."""
    if cell.base.coordinates is None:
        return False
    u = cell.base.coordinates[cell.base.winner][0]
    return bool(u < edge or u > 1 - edge)


def winner_accuracy(arm: Arm) -> float:
    """The winner's test accuracy (points): its retrains' mean, or seed 0's without them."""
    runs = arm.retrains or [arm.test[arm.winner]]
    return 100.0 * float(np.mean(runs))


def _holm(keys: list, p: list, alpha: float) -> dict:
    adjusted = decide.holm_adjusted(p) if p else np.array([])
    return {k: (float(pa), bool(pa <= alpha)) for k, pa in zip(keys, adjusted)}


def _primary_row(law: TLaw, level: float, power: float, decided: dict, key: tuple) -> dict:
    """The primary estimand's row: point, simultaneous interval and MDE at ``level`` (the
    family's first Holm level on each side), its label and adjusted p-values."""
    q = scipy.stats.t.ppf(1 - level, law.df) if law.se > 0 else 0.0
    better, worse = decided[key + ("better",)], decided[key + ("worse",)]
    label = "better" if better[1] else "worse" if worse[1] else "inconclusive"
    return dict(point=law.estimate, se=law.se, df=law.df, low=law.estimate - q * law.se,
                high=law.estimate + q * law.se, level=level, label=label,
                p_better=better[0], p_worse=worse[0],
                mde=(q + scipy.stats.norm.ppf(power)) * law.se)


def analyse(cells: list, analysis: dict) -> dict:
    """The board's decisions and descriptions: {"cells": {(group, method): {"paired",
    "tuned", "sign", "unpaired"}}, "slopes": {method: {...}}, "families": {"main", "ladder"}}
    (see the module docstring; ``analysis`` the registered analysis.json)."""
    alpha, power = float(analysis["family"]["alpha"]), float(analysis["mde"]["power"])
    ladder_spec = analysis["design"]["ladder"]
    seeds = seed_variance(cells)
    laws = {(c.group, c.method): paired_law(c, seeds[c.group]) for c in cells}
    main_cells = [c for c in cells if not RUNG.fullmatch(c.model)]  # a wider rung: the slope's
    keys, p = [], []
    for c in main_cells:
        law, key = laws[(c.group, c.method)], (c.group, c.method)
        keys += [key + ("better",), key + ("worse",)]
        p += [law.below(0.0), law.above(0.0)]
        if c.claim_low is not None and c.claim_low > 0:
            keys.append(key + ("claim",))
            p.append(law.above(c.claim_low))
    main = _holm(keys, p, alpha)
    level = alpha / max(len(keys), 1)
    out: dict = {"cells": {}, "slopes": {}, "families": {"main": len(keys)}}
    tuned_level = float(analysis["intervals"]["tuned_level"])
    for c in main_cells:
        key = (c.group, c.method)
        row = dict(paired=_primary_row(laws[key], level, power, main, key), unpaired=not c.paired)
        if key + ("claim",) in main:
            pa, rejected = main[key + ("claim",)]
            row["paired"]["claim"] = dict(low=c.claim_low, p=pa,
                                          label="claim excluded" if rejected else "consistent")
        row["tuned"] = None  # a ladder rung without retrains has none
        if len(c.base.retrains) > 1 and len(c.mine.retrains) > 1:
            tuned, tail = tuned_law(c), (1 - tuned_level) / 2
            row["tuned"] = dict(point=c.tuned_point(), low=tuned.quantile(tail),
                                high=tuned.quantile(1 - tail), level=tuned_level)
        row["sign"] = (uncertainty.paired_trial_gains(c.base.test, c.mine.test,
                                                      range(1, len(c.base.test)))
                       if c.paired else None)
        out["cells"][key] = row
    out["slopes"] = analyse_ladder(cells, laws, ladder_spec, alpha)
    out["families"]["ladder"] = 2 * len(out["slopes"])
    return out


def analyse_ladder(cells: list, laws: dict, spec: dict, alpha: float) -> dict:
    """Per ladder method: the slope of its paired gain per doubling of the parameters, its
    label in the ladder's own Holm family, and the rungs' DP-SGD accuracy (the check that its
    optimum stayed inside the space)."""
    rungs = ladders(cells, spec)
    edge = float(spec["edge_fraction"])
    keys, p, slopes = [], [], {}
    for method, rung_cells in sorted(rungs.items()):
        x = np.log2([c.mine.parameters for c in rung_cells])
        law = slope_law([laws[(c.group, c.method)] for c in rung_cells], x)
        edges = [c.model for c in rung_cells if at_edge(c, edge)]
        slopes[method] = dict(point=law.estimate, se=law.se, df=law.df, edges=edges,
                              rungs=[(c.mine.parameters, laws[(c.group, c.method)].estimate)
                                     for c in rung_cells],
                              dpsgd=[(c.base.parameters, winner_accuracy(c.base))
                                     for c in rung_cells])
        keys += [(method, "grows"), (method, "shrinks")]
        p += [1.0, 1.0] if edges else [law.below(0.0), law.above(0.0)]
    decided = _holm(keys, p, alpha)
    level = alpha / max(len(keys), 1)
    for method, s in slopes.items():
        q = scipy.stats.t.ppf(1 - level, s["df"]) if s["se"] > 0 else 0.0
        s.update(low=s["point"] - q * s["se"], high=s["point"] + q * s["se"], level=level)
        if s["edges"]:
            s["label"] = ("not judged: DP-SGD's optimum at the edge of the space at "
                          + ", ".join(s["edges"]))
        else:
            s["label"] = ("grows" if decided[(method, "grows")][1] else "shrinks"
                          if decided[(method, "shrinks")][1] else "no trend shown")
    return slopes

