"""Board v4's design study, one board at a time: whole boards simulated from a model fitted to
board v3's records (board/board_model.py), each judged exactly as a design's procedure judges a
real board, with exact laws (board/ideal.py, or Student t) in place of Monte Carlo draws.

A design (:class:`Design`) fixes K trials, R retrains, the test behind its labels (the
registered percentile bootstrap, or Student t), which estimands carry labels (the tuned gain,
the paired gain) and which hypotheses enter the one Holm family (better, worse, the TOST
equivalence at a margin, the papers' claims). Per simulated board and cell the study keeps
every hypothesis's p-value and each estimand's PIT (its law's CDF at the estimand's true
value): a calibrated interval has Uniform PITs, so coverage at any level is read off them.

A scenario (:class:`Scenario`) says what is true: the global null (every method is DP-SGD),
v3 as fitted (each method's offset, slope and configuration terms), v3 without offsets (the
same heterogeneity, no mean gain: every 'better' and 'worse' a true null), and shifts (a gain
of the same size in every cell, for power). The study's runner is board/study_report.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from dpbench.board import board_model as bm
from dpbench.board import decide, ideal
from dpbench.board.gains import TLaw
from dpbench.search.methods import claim_range

BASELINE = bm.BASELINE
LIKE_RS = "rs"  # BandMF has no record to fit: simulated with RS's relation, without its offset


@dataclasses.dataclass(frozen=True)
class Design:
    """One candidate procedure: its sizes and its family."""

    name: str
    trials: int               # K per method per group
    retrains: int             # R seeds of each winner
    test: str = "bootstrap"   # the labelled gains' law: bootstrap, 't' or 'adjusted' (t)
    labelled: tuple = ("tuned", "paired")   # estimands whose hypotheses enter the family
    kinds: tuple = ("better", "worse", "equivalent", "claim")
    margin: float = 1.0       # the TOST's margin (points), when 'equivalent' is a kind
    claim_on: str = "tuned"   # the estimand the papers' claims are tested on
    duplicate_claims: bool = True   # test a claim 'gain >= 0' that 'worse' already tests
    extra_family: int = 0     # hypotheses outside the simulated board in its Holm family
    alpha: float = 0.05

    def runs(self, groups: int, methods: int) -> int:
        return groups * methods * (self.trials + self.retrains)


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    shift: float = 0.0          # added to every method's mean gain
    heterogeneous: bool = False  # each method's fitted slope and configuration terms
    offsets: bool = True        # (heterogeneous) each method's fitted mean gain a_m


NULL = Scenario("global null")
V3 = Scenario("v3 as fitted", heterogeneous=True)
V3_NULL = Scenario("v3 heterogeneity, no gain", heterogeneous=True, offsets=False)


def claim_lows(claims: dict, epsilon: float) -> dict:
    """method -> the smallest gain its paper claims at ``epsilon`` (methods.claim_range)."""
    out = {}
    for method, claim in claims.items():
        low = claim_range(claim.get("claim_gain"), epsilon)
        if low is not None and low[0] is not None:
            out[method] = float(low[0])
    return out


def epsilon_of(group: str) -> float:
    return float(group.split("__eps")[1].split("__")[0])


def laws(design: Design, base: dict, mine: dict, paired: bool, space=None,
         seed_variance: float = 0.0) -> dict:
    """The cell's laws: the tuned gain's ideal bootstrap; the paired gain's ideal bootstrap,
    paired t, or surface-adjusted t (``design.test``) where the method shares DP-SGD's
    points; with a t test, a method of its own space gets Welch's test of its random trials'
    mean against DP-SGD's (its space-mean gain)."""
    out = dict(tuned=ideal.TunedLaw(
        list(base["val"] / 100), list(base["test"] / 100), base["winner"],
        list(base["retrains"] / 100), list(mine["val"] / 100), list(mine["test"] / 100),
        mine["winner"], list(mine["retrains"] / 100)))
    d = mine["test"][1:] - base["test"][1:]
    if design.test == "bootstrap":
        if paired:
            out["paired"] = ideal.PairedLaw(d)
    elif not paired:
        out["paired"] = TLaw.welch(base["test"][1:], mine["test"][1:])
    elif design.test == "t":
        out["paired"] = TLaw.paired(d)
    else:
        out["paired"] = TLaw.adjusted(d, base["test"][1:], space.features(base["points"][1:]),
                                      seed_variance)
    return out


def pooled_seed_variance(arms: dict) -> float:
    """The group's seed variance of test accuracy, pooled over every arm's winner retrains."""
    dev = [a["retrains"] - a["retrains"].mean() for a in arms.values() if len(a["retrains"]) > 1]
    return float(sum(np.sum(x ** 2) for x in dev) / sum(len(x) - 1 for x in dev))


def estimands_of(design: Design, own_space: bool) -> list:
    return ["tuned"] + ([] if own_space and design.test == "bootstrap" else ["paired"])


def cell_hypotheses(design: Design, estimands: list, claim_low: Optional[float]) -> list:
    """The (estimand, kind) hypotheses one cell adds to the family: a claim 'gain >= 0' is
    'worse' again, tested twice only where the design says so."""
    out = []
    for estimand in estimands:
        if estimand not in design.labelled:
            continue
        out += [(estimand, k) for k in ("better", "worse", "equivalent") if k in design.kinds]
        if ("claim" in design.kinds and estimand == design.claim_on and claim_low is not None
                and (design.duplicate_claims or claim_low > 0)):
            out.append((estimand, "claim"))
    return out


def family_size(design: Design, groups: dict, methods: list, claims: dict) -> int:
    """The hypotheses of the design's family on the simulated board, plus its extra ones."""
    m = design.extra_family
    for name, group in groups.items():
        lows = claim_lows(claims, epsilon_of(name))
        for method in methods[1:]:
            own = group.methods.get(method, group.methods[BASELINE])["own_space"]
            m += len(cell_hypotheses(design, estimands_of(design, own), lows.get(method)))
    return m


def modelled(group: bm.GroupModel, method: str) -> bm.GroupModel:
    """The group with ``method`` fitted; a method with no record (BandMF) gets RS's slope and
    configuration terms and no offset."""
    if method in group.methods:
        return group
    like = dict(group.methods[LIKE_RS], a=0.0, delta=group.methods[BASELINE]["delta"])
    return dataclasses.replace(group, methods={**group.methods, method: like})


def simulate_group(group: bm.GroupModel, design: Design, methods: list, rng,
                   scenario: Scenario) -> dict:
    """One group's arms (method -> board_model.simulate_arm's dict) at one set of shared
    points (trial 0 the recipe); a method with a space of its own draws its own."""
    recipe = np.asarray(group.methods[BASELINE]["trial0"])[None]
    points = np.concatenate([recipe, group.space.draw(design.trials - 1, rng)])
    base_means = group.baseline(points, rng)
    arms = {}
    for method in methods:
        model = modelled(group, method)
        means, where = base_means, points
        if model.methods[method]["own_space"]:
            where = np.concatenate([recipe, group.space.draw(design.trials - 1, rng)])
            means = group.baseline(where, rng)
        arms[method] = dict(bm.simulate_arm(
            model, method, means, design.retrains, rng,
            0.0 if method == BASELINE else scenario.shift, scenario.heterogeneous,
            scenario.offsets), points=where)
    return arms


def paired_truth(group: bm.GroupModel, method: str, scenario: Scenario) -> float:
    """The space-mean gain: the method's mean over its space minus DP-SGD's over its own."""
    a = modelled(group, method).methods[method]["a"]
    return (a if scenario.heterogeneous and scenario.offsets else 0.0) + scenario.shift


def winner_gap(arms: dict, method: str) -> float:
    """This search's true tuned gap: the true mean accuracy of the method's winner minus
    DP-SGD's (the tuned gain's estimand is its mean over searches)."""
    base, mine = arms[BASELINE], arms[method]
    return float(mine["mu"][mine["winner"]] - base["mu"][base["winner"]])


def tuned_truths(model: bm.BoardModel, design: Design, methods: list, groups: list,
                 scenario: Scenario, boards: int, seed: int) -> dict:
    """The tuned gain's true value per cell: its winner gap averaged over ``boards`` searches
    (exactly the shift where every method is DP-SGD plus it)."""
    if not scenario.heterogeneous:
        return {(g, m): scenario.shift for g in groups for m in methods[1:]}
    sums: dict = {}
    for b in range(boards):
        rng = np.random.default_rng([seed, 1, b])
        for name in groups:
            arms = simulate_group(model.groups[name], design, methods, rng, scenario)
            for method in methods[1:]:
                sums[(name, method)] = sums.get((name, method), 0.0) + winner_gap(arms, method)
    return {k: v / boards for k, v in sums.items()}


def law_sd(law) -> float:
    """The scale its test judges a gain against: a t test's standard error (its quantile is
    Student's), a bootstrap law's standard deviation (its quantile taken as normal)."""
    if isinstance(law, TLaw):
        return law.se
    if isinstance(law, ideal.PairedLaw):
        x = law.sums / (law.n * law.grid)
        mean = float(law.pmf @ x)
        return float(math.sqrt(max(law.pmf @ (x - mean) ** 2, 0.0)))
    w = law.weights / law.weights.sum()
    spread = (law.se ** 2 * law.df / (law.df - 2) if math.isfinite(law.df) and law.df > 2
              else law.se ** 2)
    mean = float(w @ law.centres)
    return float(math.sqrt(max(w @ (law.centres - mean) ** 2 + spread, 0.0)))


def _estimate(law) -> float:
    if isinstance(law, TLaw):
        return law.estimate
    if isinstance(law, ideal.PairedLaw):
        return float(np.dot(law.pmf, law.sums) / (law.n * law.grid))
    return float(law.weights @ law.centres / law.weights.sum())


def simulate_board(model: bm.BoardModel, design: Design, methods: list, groups: list,
                   claims: dict, rng, scenario: Scenario, tuned_truth: dict) -> dict:
    """One board judged: "keys" [(group, method, estimand, kind)] with "p" their p-values and
    "null" whether each is a true null; per (group, method, estimand): "pit", "estimate" (the
    point estimate), "truth", "scale" (its law's s.d. and the df of its test)."""
    keys, ps, nulls, pit, estimate, truth, scale = [], [], [], {}, {}, {}, {}
    for name in groups:
        group = model.groups[name]
        lows = claim_lows(claims, epsilon_of(name))
        arms = simulate_group(group, design, methods, rng, scenario)
        seed_var = pooled_seed_variance(arms)
        for method in methods[1:]:
            own = modelled(group, method).methods[method]["own_space"]
            cell = laws(design, arms[BASELINE], arms[method], not own, group.space, seed_var)
            truths = dict(tuned=tuned_truth[(name, method)],
                          paired=paired_truth(group, method, scenario))
            for estimand, law in cell.items():
                at = (name, method, estimand)
                truth[at] = truths[estimand]
                pit[at] = law.below(truths[estimand]) / max(
                    1.0 - getattr(law, "nan_mass", 0.0), 1e-12)
                estimate[at] = (float(np.mean(arms[method]["retrains"])
                                      - np.mean(arms[BASELINE]["retrains"]))
                                if estimand == "tuned" else _estimate(law))
                scale[at] = (law_sd(law), law.df if isinstance(law, TLaw) else math.inf)
                values = ideal.p_values(law, design.margin, lows.get(method))
                for e, kind in cell_hypotheses(design, [estimand], lows.get(method)):
                    keys.append((name, method, e, kind))
                    ps.append(values[kind])
                    nulls.append(is_null(kind, truths[e], lows.get(method), design.margin))
    return dict(keys=keys, p=np.array(ps), null=np.array(nulls, bool), pit=pit,
                estimate=estimate, truth=truth, scale=scale)


def is_null(kind: str, gain: float, claim_low: Optional[float], margin: float) -> bool:
    """Whether a hypothesis is a true null (rejecting it would be an error): 'better' where
    the gain is <= 0, 'worse' where >= 0, 'claim' where the gain reaches the claim,
    'equivalent' where |gain| >= margin."""
    if kind == "better":
        return gain <= 0
    if kind == "worse":
        return gain >= 0
    if kind == "claim":
        return gain >= claim_low
    return abs(gain) >= margin


def holm_reject(p: np.ndarray, alpha: float, extra: int = 0) -> np.ndarray:
    """Holm at ``alpha`` (decide.holm_adjusted) over ``p`` and ``extra`` hypotheses outside the
    simulated board, which never reject first (their p-values taken as 1: the board's share)."""
    return decide.holm_adjusted(np.concatenate([p, np.ones(extra)]))[:len(p)] <= alpha
