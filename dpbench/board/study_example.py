"""Board v4's page on a simulated board: ``python -m dpbench.board.study_example`` draws one
board from the design study's model (v3 as fitted: the four groups and the ladder's wider
rungs, board/design_study.py), judges it with the registered analysis (board/v4.py) and
renders it with the board's own page code (board/v4_page.py) into
``leaderboard/v4/study/simulated-board/``: what a reader of the real board will see, before
any of its runs. Its numbers are simulated, and the page says so first.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from dpbench import records
from dpbench.board import board_model as bm
from dpbench.board import design_study as ds
from dpbench.board import v4, v4_page
from dpbench.board import study_report as sr
from dpbench.search import methods as methods_lib

REPO = sr.REPO
OUT = REPO / "leaderboard" / "v4" / "study" / "simulated-board"


def _arm(arm: dict, parameters: int, retrains: bool) -> v4.Arm:
    return v4.Arm(list(arm["val"] / 100), list(arm["test"] / 100), int(arm["winner"]),
                  list(arm["retrains"] / 100) if retrains else [], parameters, arm["points"])


def simulated_cells(model: bm.BoardModel, analysis: dict, seed: int) -> list:
    """One simulated board as v4 cells: the main board's groups (K and R as registered) and
    the ladder's wider rungs (K as registered, no retrains), v3 as fitted."""
    design = analysis["design"]
    claims = methods_lib.claims()
    main = ds.Design("registered", design["trials_per_method"], design["retrains"])
    rungs = design["ladder"]["rungs"]
    plan = [(name, name, main, True, rungs["tanh_cnn_x1"]) for name in sorted(model.groups)]
    plan += [(sr.LADDER_GROUP.replace("tanh_cnn", rung), sr.LADDER_GROUP,
              ds.Design("rung", design["ladder"]["trials"], 2), False, parameters)
             for rung, parameters in rungs.items() if rung != "tanh_cnn_x1"]
    rng = np.random.default_rng([seed, 4])
    cells = []
    for name, fitted, d, retrains, parameters in plan:
        group = model.groups[fitted]
        methods = sr.METHODS if retrains else sr.LADDER_METHODS
        arms = ds.simulate_group(group, d, methods, rng, ds.V3)
        epsilon = ds.epsilon_of(name)
        lows = ds.claim_lows(claims, epsilon)
        base = _arm(arms["dpsgd"], parameters, retrains)
        for method in methods[1:]:
            own = ds.modelled(group, method).methods[method]["own_space"]
            cells.append(v4.Cell(name, method, epsilon, name.split("__")[1], base,
                                 _arm(arms[method], parameters, retrains), not own,
                                 lows.get(method), group.space))
    return cells


def render(out_dir: Path, seed: int) -> Path:
    analysis = json.loads((REPO / "leaderboard" / "v4" / "analysis.json").read_text())
    model = bm.fit_board(REPO / "leaderboard" / "records")
    cells = simulated_cells(model, analysis, seed)
    out = v4.analyse(cells, analysis)
    plots = {}
    v4_page._plot_gains(out, out_dir / "plots" / "v4-gains.svg")  # noqa: SLF001
    v4_page._plot_ladder(out, out_dir / "plots" / "v4-ladder.svg")  # noqa: SLF001
    plots.update(gains="plots/v4-gains.svg", ladder="plots/v4-ladder.svg")
    head = [f"**A simulated board, not a result.** Drawn by `python -m "
            f"dpbench.board.study_example --seed={seed}` from the design study's model of "
            "board v3 as fitted (../README.md), judged by the registered analysis "
            "(../../analysis.json) and rendered by the board's own page code: the page the "
            "real board will have, with made-up numbers. Its epsilons are not computed (-)."]
    epsilons = {(c.group, c.method): math.nan for c in cells}
    checks = {c.group: {"status": "simulated"} for c in cells}
    page = out_dir / v4_page.PAGE
    records.atomic_write_text(page, "\n".join(v4_page.page_lines(
        out, cells, analysis, head, epsilons, checks, plots)) + "\n")
    return page


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="board v4's page on a simulated board")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    print(render(Path(args.out), args.seed))


if __name__ == "__main__":
    main()
