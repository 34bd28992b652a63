"""Board v4's design study, run and reported: ``python -m dpbench.board.study_report --out
leaderboard/v4/study`` (about 5 minutes on 2 cores) fits the board model to board v3's
records, judges thousands of simulated boards under each candidate design and scenario
(board/design_study.py) and writes ``study.json`` and ``README.md``: each design's
family-wise false-positive rate under the null, its intervals' coverage, each estimand's
detectable gain, the dimension ladder's, and the design the registration takes from them
(``CHOSEN``; tests/test_registration.py holds analysis.json to it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import scipy.stats

from dpbench import records
from dpbench.board import board_model as bm
from dpbench.board import design_study as ds
from dpbench.board import study_page
from dpbench.board.gains import slope_law
from dpbench.search.methods import claims as method_claims

REPO = Path(__file__).resolve().parents[2]
METHODS = ["dpsgd", "rs", "dpssgd", "gip", "randomk", "nasr", "gep", "bgep", "bandmf"]
LADDER_METHODS = METHODS[:-1]  # the ladder keeps v3's eight
RUNGS = {"tanh_cnn_x1": 26_010, "tanh_cnn_x2": 101_162, "tanh_cnn_x4": 398_922,
         "tanh_cnn_x8": 1_584_266}  # parameters (records' model_parameters)
LADDER_GROUP = "fashion_mnist__tanh_cnn__eps3.0__delta1e-05"
POWER = 0.8

# The registered design as committed before the study (analysis.json at 305f934): its family
# also labelled every ladder rung like a main-board group (44 hypotheses each, 4 rungs) plus a
# slope per method: 184 hypotheses outside the simulated main board.
REGISTERED = ds.Design("registered (K 32, R 8, bootstrap, tuned + paired, +-1 TOST, claims)",
                       32, 8, extra_family=184)
# The design the study chooses (README.md says why): the paired gain's surface-adjusted t test
# labelled (Welch on the space means for a method of its own space), claims above 0 on it,
# no margin; the tuned gain descriptive; the ladder's slopes a family of their own.
CHOSEN = ds.Design("chosen (K 33, R 3, surface-adjusted t, paired gain, claims > 0)", 33, 3,
                   test="adjusted", labelled=("paired",), kinds=("better", "worse", "claim"),
                   claim_on="paired", duplicate_claims=False, extra_family=0)
# The chosen family with the plain paired t: valid and conservative (its variance counts the
# part of the differences the quasirandom points average away).
PLAIN_T = dataclasses.replace(CHOSEN, name="plain paired t (K 33, R 3, otherwise as chosen)",
                              test="t")
CHOSEN_LADDER = dict(rungs=("tanh_cnn_x1", "tanh_cnn_x2", "tanh_cnn_x4"), trials=17,
                     x1_trials=33)
LADDER_FAMILY = 2 * (len(LADDER_METHODS) - 1)  # grows and shrinks per method: its own family


def _boards(args) -> list:
    """Worker: boards ``start .. stop`` of one (design, scenario)."""
    model, design, groups, claims, scenario, truths, seed, start, stop = args
    out = []
    for b in range(start, stop):
        board = ds.simulate_board(model, design, METHODS, groups, claims,
                                  np.random.default_rng([seed, 2, b]), scenario, truths)
        out.append(dict(p=board["p"], null=board["null"], pit=board["pit"],
                        estimate=board["estimate"], scale=board["scale"],
                        keys=board["keys"] if b == start else None))
    return out


def run(model, design, scenario, boards: int, seed: int, claims: dict, workers: int) -> dict:
    """``boards`` boards of one design under one scenario: the family's false rejections,
    the PITs and the point estimates."""
    groups = sorted(model.groups)
    truths = ds.tuned_truths(model, design, METHODS, groups, scenario, 300, seed)
    chunks = [(model, design, groups, claims, scenario, truths, seed, a, min(a + 50, boards))
              for a in range(0, boards, 50)]
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        results = [b for part in pool.map(_boards, chunks) for b in part]
    m = ds.family_size(design, model.groups, METHODS, claims)
    extra = m - len(results[0]["p"])
    wrong = np.array([(ds.holm_reject(r["p"], design.alpha, extra) & r["null"]).any()
                      for r in results])
    return dict(results=results, keys=results[0]["keys"], m=m, false_board=wrong,
                truths=truths)


def clopper_pearson(k: int, n: int, level: float = 0.95) -> list:
    a = (1 - level) / 2
    lo = scipy.stats.beta.ppf(a, k, n - k + 1) if k > 0 else 0.0
    hi = scipy.stats.beta.ppf(1 - a, k + 1, n - k) if k < n else 1.0
    return [float(lo), float(hi)]


def coverage(out: dict, estimand: str, m: int, alpha: float = 0.05) -> dict:
    """The PITs of ``estimand`` over every board and cell: coverage of the two-sided 95%
    interval, its tails, and each tail's rate at the family's smallest Holm level alpha / m
    (a calibrated law has alpha / m there)."""
    x = np.array([v for r in out["results"] for k, v in r["pit"].items() if k[2] == estimand])
    if not len(x):
        return {}
    level = alpha / m
    return dict(n=int(len(x)), cov95=float(np.mean((x >= 0.025) & (x <= 0.975))),
                cov98=float(np.mean((x >= 0.01) & (x <= 0.99))),
                cov99=float(np.mean((x >= 0.005) & (x <= 0.995))),
                low_2_5=float(np.mean(x < 0.025)), high_2_5=float(np.mean(x > 0.975)),
                level=level, low_at_level=float(np.mean(x < level)),
                high_at_level=float(np.mean(x > 1 - level)))


def detectable(out: dict, design: ds.Design, estimand: str) -> dict:
    """Per cell, the gain detectable at 80% power by the cell's test at the family's first
    Holm level: q x its law's mean s.d. (the scale the test judges against) + z_0.8 x the
    estimate's s.d. over the simulated boards (how much it truly moves; smaller where the
    quasirandom points average better than independent ones would)."""
    by_cell: dict = {}
    for r in out["results"]:
        for k, v in r["estimate"].items():
            if k[2] == estimand:
                by_cell.setdefault(k[:2], ([], [], []))
                by_cell[k[:2]][0].append(v)
                by_cell[k[:2]][1].append(r["scale"][k][0])
                by_cell[k[:2]][2].append(r["scale"][k][1])
    level = design.alpha / out["m"]

    def quantile(df):
        return scipy.stats.t.ppf(1 - level, df) if math.isfinite(df) else scipy.stats.norm.ppf(
            1 - level)

    mde = {f"{g}|{m}": float(quantile(np.median(df)) * np.mean(sd)
                             + scipy.stats.norm.ppf(POWER) * np.std(v, ddof=1))
           for (g, m), (v, sd, df) in by_cell.items()}
    values = np.array(list(mde.values()))
    return dict(median=float(np.median(values)), low=float(values.min()),
                high=float(values.max()), cells=mde)


def ladder(model, design: ds.Design, boards: int, seed: int, m: int, scenario) -> dict:
    """The dimension ladder's slope per doubling of the parameters, from each rung's paired
    gain (as the main board's; Welch for Nasr): false slopes (grows or shrinks) at its own
    family's first Holm level (``m``: 7 methods x 2), and its detectable size (normal
    quantiles)."""
    spec = CHOSEN_LADDER
    x = np.log2([RUNGS[r] / RUNGS["tanh_cnn_x1"] for r in spec["rungs"]])
    group = model.groups[LADDER_GROUP]
    level = design.alpha / m
    slopes, ses, wrong = {mth: [] for mth in LADDER_METHODS[1:]}, {}, 0
    for b in range(boards):
        rng = np.random.default_rng([seed, 3, b])
        rung_laws: dict = {}
        for rung in spec["rungs"]:
            trials = spec["x1_trials"] if rung == "tanh_cnn_x1" else spec["trials"]
            rung_design = dataclasses.replace(design, trials=trials, retrains=2)
            arms = ds.simulate_group(group, rung_design, LADDER_METHODS, rng, scenario)
            for mth in LADDER_METHODS[1:]:
                own = group.methods[mth]["own_space"]
                rung_laws.setdefault(mth, []).append(ds.laws(
                    rung_design, arms["dpsgd"], arms[mth], not own, group.space,
                    ds.pooled_seed_variance(arms))["paired"])
        any_wrong = False
        for mth in LADDER_METHODS[1:]:
            law = slope_law(rung_laws[mth], x)
            any_wrong |= min(law.below(0.0), law.above(0.0)) <= level  # grows, or shrinks
            slopes[mth].append(law.estimate)
            ses.setdefault(mth, []).append(law.se)
        wrong += int(any_wrong)
    z = scipy.stats.norm.ppf
    mde = {mth: float(z(1 - level) * np.mean(ses[mth]) + z(POWER) * np.std(v, ddof=1))
           for mth, v in slopes.items()}
    return dict(rungs=list(spec["rungs"]), log2_parameters=[float(v) for v in x],
                boards=boards, false_board=wrong, mde_per_doubling=mde,
                median_mde=float(np.median(list(mde.values()))))


def power_at(model, design: ds.Design, gain: float, boards: int, seed: int, claims: dict,
             workers: int) -> dict:
    """Every cell with v3's heterogeneity and a mean gain of ``gain`` (no fitted offsets): the
    share of boards where the cell's 'better' is rejected at the family's first Holm level."""
    scenario = ds.Scenario(f"v3 heterogeneity, gain {gain:g}", shift=gain, heterogeneous=True,
                           offsets=False)
    out = run(model, design, scenario, boards, seed, claims, workers)
    level = design.alpha / out["m"]
    where = [i for i, k in enumerate(out["keys"]) if k[3] == "better" and
             k[2] in design.labelled]
    power = {f"{out['keys'][i][0]}|{out['keys'][i][1]}": float(np.mean(
        [r["p"][i] <= level for r in out["results"]])) for i in where}
    values = np.array(list(power.values()))
    return dict(gain=gain, median=float(np.median(values)),
                at_least_80=int(np.sum(values >= POWER)), cells=len(values), power=power)


POOL = REPO / "leaderboard" / "gpu" / "v3-rerun" / "pool.json"
WINDOW_S = 9 * 60  # a lent window's usable device time: one 10-minute call less set-up


def gpu_cost(design: ds.Design, rung_trials: int) -> dict:
    """The device time the design needs, estimated from the one measured window (board v3's
    rerun: runs published per second of a call on one H100, x1-sized models, packs of 12-16),
    a wider rung's runs scaled by its parameter count (an upper bound: a GPU runs these small
    models far below its capacity)."""
    pool = json.loads(POOL.read_text())
    published = sum(r["outcome"] == "published" for r in pool["done"])
    per_run = pool["elapsed_s"] / published
    main = design.runs(4, len(METHODS)) * per_run
    rungs = {r: rung_trials * (len(LADDER_METHODS)) * per_run * RUNGS[r] / RUNGS["tanh_cnn_x1"]
             for r in CHOSEN_LADDER["rungs"] if r != "tanh_cnn_x1"}
    total = main + sum(rungs.values())
    return dict(measured=dict(published=published, elapsed_s=pool["elapsed_s"],
                              seconds_per_run=per_run),
                main_s=main, rungs_s=rungs, total_s=total, windows=math.ceil(total / WINDOW_S))


def study(boards: int, seed: int, workers: int) -> dict:
    """The whole study (README.md's numbers): both designs under every scenario, the chosen
    design's K sweep and power check, and its ladder."""
    model = bm.fit_board(REPO / "leaderboard" / "records")
    claims = method_claims()
    out = dict(model=model.as_json(), boards=boards, seed=seed, designs={},
               roles=dict(registered=REGISTERED.name, plain=PLAIN_T.name,
                          chosen=CHOSEN.name))
    for design, shares in ((REGISTERED, (1, 4, 4)), (PLAIN_T, (2, 0, 4)), (CHOSEN, (1, 2, 2))):
        entry = dict(design=dataclasses.asdict(design), runs=design.runs(4, len(METHODS)),
                     scenarios={})
        # boards per scenario: ``boards`` / share (0: not run); the null always, v3 as fitted
        # always (its detectable gains), v3 without gains for the designs whose error it tests
        for scenario, share in zip((ds.NULL, ds.V3_NULL, ds.V3), shares):
            if not share:
                continue
            n = boards // share
            result = run(model, design, scenario, n, seed, claims, workers)
            k = int(result["false_board"].sum())
            entry["m"] = result["m"]
            entry["scenarios"][scenario.name] = dict(
                boards=n, false_boards=k, fwer=k / n, fwer_interval=clopper_pearson(k, n),
                coverage={e: coverage(result, e, result["m"]) for e in ("tuned", "paired")})
            if scenario is ds.V3:
                entry["detectable"] = {e: detectable(result, design, e)
                                       for e in ("tuned", "paired")}
        out["designs"][design.name] = entry
    out["k_sweep"] = {}
    for trials in (17, 25, 33, 41):  # 16, 24, 32, 40 shared points
        design = dataclasses.replace(CHOSEN, trials=trials)
        result = run(model, design, ds.V3, boards // 10, seed, claims, workers)
        out["k_sweep"][trials] = dict(runs=design.runs(4, len(METHODS)),
                                      retrains=design.retrains,
                                      paired=detectable(result, design, "paired")["median"])
    out["power_at_0.5"] = power_at(model, CHOSEN, 0.5, boards // 4, seed, claims, workers)
    out["gpu_cost"] = gpu_cost(CHOSEN, CHOSEN_LADDER["trials"])
    m = LADDER_FAMILY
    out["ladder"] = dict(family=m, spec=dict(CHOSEN_LADDER), parameters=RUNGS,
                         null=ladder(model, CHOSEN, boards // 2, seed, m, ds.NULL),
                         v3=ladder(model, CHOSEN, boards // 2, seed, m, ds.V3))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="board v4's design study")
    parser.add_argument("--out", default=str(REPO / "leaderboard" / "v4" / "study"))
    parser.add_argument("--boards", type=int, default=2000,
                        help="null boards per design (half as many per other scenario)")
    parser.add_argument("--seed", type=int, default=20261129)
    parser.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 2))
    args = parser.parse_args(argv)
    start = time.time()
    result = study(args.boards, args.seed, args.workers)
    result["wall_s"] = round(time.time() - start, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=1, sort_keys=True, default=lambda o: o.item())
    records.atomic_write_text(out / "study.json", text + "\n")
    result = json.loads(text)  # the page reads what the file holds
    records.atomic_write_text(out / "README.md", study_page.render(result, args))
    print(f"study written to {out} in {result['wall_s']} s")


if __name__ == "__main__":
    main()
