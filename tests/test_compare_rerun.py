"""dpbench/board/rerun.py: a protocol's rerun against the committed records, per group and
method: the search's trials paired by configuration, the winners' retrains unpaired, and
whether each cell chose the same winner."""

import json

import numpy as np
import pytest

from dpbench.board import rerun

GROUP = "digits__logistic__eps3.0__delta1e-05"


def _tool():
    return rerun


def _write(root, plan, accuracy, skip=()):
    """Records for every run of ``plan``: accuracy(method, trial, seed) -> (validation, test)."""
    (root / GROUP).mkdir(parents=True)
    (root / GROUP / "search.json").write_text(json.dumps(plan))
    for method in plan["methods"]:
        for trial in range(plan["num_trials"]):
            for seed in plan["seeds"]:
                if (method, trial, seed) in skip:
                    continue
                run = root / GROUP / f"{method}-t{trial}-seed{seed}"
                run.mkdir()
                validation, test = accuracy(method, trial, seed)
                (run / "run_record.json").write_text(json.dumps(dict(
                    validation_accuracy=validation, test_accuracy=test, devices=["cuda:0"])))


def test_paired_search_and_welch_retrains_against_the_committed_records(tmp_path):
    rng = np.random.default_rng()
    plan = dict(group=GROUP, num_trials=4, seeds=[0, 1, 2, 3],
                methods={"a": {}, "b": {}})
    base = {(m, t, s): rng.uniform(0.5, 0.9) for m in "ab" for t in range(4) for s in range(4)}
    shift = rng.uniform(0.01, 0.03)
    _write(tmp_path / "board", plan, lambda m, t, s: (0.9 - 0.1 * t, base[m, t, s]))
    # the rerun: every test accuracy of method a shifted; trial 3 of b not run yet
    _write(tmp_path / "rerun", plan, lambda m, t, s: (0.9 - 0.1 * t,
                                                      base[m, t, s] + (shift if m == "a" else 0)),
           skip={("b", 3, 0)})
    tool = _tool()
    out = tmp_path / "comparison.md"
    assert tool.main([f"--rerun={tmp_path / 'rerun'}", f"--committed={tmp_path / 'board'}",
                      f"--out={out}"]) == 0
    rows = {r["method"]: r for r in json.loads(out.with_suffix(".json").read_text())}
    a, b = rows["a"], rows["b"]
    assert a["search_pairs"] == 4 and a["search_diff"] == pytest.approx(shift)
    assert a["search_ci"][0] == pytest.approx(shift) == pytest.approx(a["search_ci"][1])
    assert a["winners"] == [0, 0] and a["retrain_diff"] == pytest.approx(shift)
    lo, hi = a["retrain_ci"]
    assert lo < shift < hi and a["retrain_ci_bonferroni"][0] < lo  # wider, for 2 cells
    assert b["search_pairs"] == 3 and b["search_missing"] == 1
    assert b["search_diff"] == pytest.approx(0.0, abs=1e-12)
    assert b["winners"][0] is None and "retrain_ci" not in b  # its search is not complete
    assert "| a |" in out.read_text() and "cuda:0" in out.read_text()
    # b's 3 pairs: no Bonferroni interval (1-2 df would span tens of points), said on the page
    assert "search_ci_bonferroni" in a and "search_ci_bonferroni" not in b
    assert rerun.same_winner(list(rows.values())) == (1, 1)  # a: both ran whole, same winner
    assert "same trial in 1 of the 1 cells" in out.read_text()
