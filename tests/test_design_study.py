"""dpbench/board/design_study.py and study_report.py: one simulated board is judged as the
design says (its family, its nulls, Holm), and the study's summaries read it right."""

import numpy as np
import pytest

from dpbench.board import board_model as bm
from dpbench.board import decide
from dpbench.board import design_study as ds
from dpbench.board import study_report as sr
from dpbench.search import methods
from tests.conftest import REPO_ROOT


@pytest.fixture(scope="module")
def model():
    return bm.fit_board(REPO_ROOT / "leaderboard" / "records")


def test_holm_rejects_what_decides_adjusted_p_rejects():
    rng = np.random.default_rng()
    for _ in range(50):
        p = rng.uniform(0, 0.01, int(rng.integers(1, 20))) ** rng.uniform(0.5, 2)
        assert (ds.holm_reject(p, 0.05) == (decide.holm_adjusted(p) <= 0.05)).all()
    assert not ds.holm_reject(np.array([0.01]), 0.05, extra=9).any()  # 0.01 > 0.05 / 10


def test_a_null_board_of_the_chosen_design_has_its_family_and_true_nulls(model):
    claims = methods.claims()
    design = sr.CHOSEN
    groups = sorted(model.groups)
    truths = ds.tuned_truths(model, design, sr.METHODS, groups, ds.NULL, 1, 0)
    board = ds.simulate_board(model, design, sr.METHODS, groups, claims,
                              np.random.default_rng(0), ds.NULL, truths)
    assert len(board["p"]) == ds.family_size(design, model.groups, sr.METHODS, claims)
    assert ((board["p"] >= 0) & (board["p"] <= 1)).all()
    kinds = {k[3] for k in board["keys"]}
    assert kinds == {"better", "worse", "claim"} and {k[2] for k in board["keys"]} == {"paired"}
    # under the null every 'better' and 'worse' is a true null; a claim above 0 is false
    for key, null in zip(board["keys"], board["null"]):
        assert null == (key[3] != "claim")
    assert all(v == 0 for v in board["truth"].values())


def test_the_studys_summaries_read_the_boards(model):
    claims = methods.claims()
    out = sr.run(model, sr.CHOSEN, ds.V3, 6, 1, claims, 1)
    cov = sr.coverage(out, "paired", out["m"])
    assert cov["n"] == 6 * 32 and 0 <= cov["cov95"] <= 1
    mde = sr.detectable(out, sr.CHOSEN, "paired")
    assert len(mde["cells"]) == 32 and 0 < mde["low"] <= mde["median"] <= mde["high"]
