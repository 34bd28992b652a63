"""dpbench/board/v3_rule.py: board v3's labels by the rule board v4 first registered (commit
305f934, leaderboard/v3-rule.json): the tuned and paired gains, Holm over the whole board,
labels settled by the Monte Carlo rule, the papers' claims, and the dimension ladder's slope.
Fresh random boards each run; every label asserted sits far from its threshold (or is the
boundary case, which must not be decided wrongly)."""

import numpy as np
import pytest

from dpbench.board import v3_rule as v4

ANALYSIS = dict(margin_points=1.0, family=dict(correction="holm", alpha=0.05),
                mde=dict(power=0.8),
                monte_carlo=dict(schedule=[2000, 8000, 32000], flip_probability=1e-6))


def arm(rng, quality, shift, parameters=None, noise=0.001):
    """K trials of qualities ``quality`` (fractions) moved by ``shift``; the winner's 4
    retrains around its quality."""
    q = np.asarray(quality) + shift
    validation = list(q + rng.normal(0, noise, len(q)))
    test = list(q + rng.normal(0, noise, len(q)))
    winner = int(np.argmax(validation))
    retrains = list(q[winner] + rng.normal(0, 0.0005, 4))
    return v4.Arm(validation, test, winner, retrains, parameters)


def board(rng, gains, model="tanh_cnn", parameters=None, claims=None, group=None, k=16):
    """A group of K trials: DP-SGD and each method of ``gains`` (points; None: DP-SGD's own
    runs under another name, a gain of exactly zero)."""
    quality = rng.uniform(0.70, 0.85, k)
    group = group or f"fashion_mnist__{model}__eps3.0__delta1e-05"
    base = arm(rng, quality, 0.0, parameters)
    return [v4.Cell(group, m, 3.0, model, base,
                    base if g is None else arm(rng, quality, g / 100, parameters), True,
                    (claims or {}).get(m)) for m, g in gains.items()]


def test_clear_gains_get_their_labels_and_the_claims_theirs():
    rng = np.random.default_rng()
    cells = board(rng, {"up": 5.0, "same": None, "down": -5.0},
                  claims={"up": 2.0, "down": 1.0})
    out = v4.analyse(cells, ANALYSIS, seed=int(rng.integers(1 << 30)))
    group = cells[0].group
    labels = {m: out["cells"][(group, m)]["tuned"]["label"] for m in ("up", "same", "down")}
    assert labels == {"up": "better", "same": "equivalent", "down": "worse"}
    assert {m: out["cells"][(group, m)]["paired"]["label"] for m in labels} == labels
    up = out["cells"][(group, "up")]["tuned"]
    assert up["low"] < up["point"] < up["high"] and 4 < up["point"] < 6
    assert up["claim"]["label"] == "consistent"  # +5 is no evidence against a +2 claim
    assert out["cells"][(group, "down")]["tuned"]["claim"]["label"] == "claim excluded"
    assert out["comparisons"] == 3 * 2 * 3 + 2
    same = out["cells"][(group, "same")]["tuned"]
    assert 0 < same["mde"] < 1 and same["level"] <= 0.05


def test_a_decided_label_does_not_depend_on_the_stream_that_computed_it():
    """Noisy retrains (a gain near no threshold in particular, whatever the draw): on three
    streams every label that is decided is the same one (decide.py: a label differs from the
    infinite-draw one with probability <= 1e-6 per stream, so this fails with probability
    <= 3e-6); 'undecided' is the only other answer."""
    rng = np.random.default_rng()
    cells = board(rng, {"edge": float(rng.uniform(-1.5, 1.5))})
    noisy = cells[0].mine._replace(retrains=list(np.array(cells[0].mine.retrains)
                                                 + rng.normal(0, 0.01, 4)))
    cells = [cells[0]._replace(mine=noisy)]
    labels = set()
    for seed in rng.integers(1 << 30, size=3):
        out = v4.analyse(cells, ANALYSIS, seed=int(seed))
        labels.add(out["cells"][(cells[0].group, "edge")]["tuned"]["label"])
    assert len({label for label in labels if not label.startswith("undecided")}) <= 1, labels


def test_the_ladder_slope_says_grows_only_when_the_gain_grows_with_the_parameters():
    rng = np.random.default_rng()
    cells = []
    for rung, (params, model) in enumerate([(26_000, "tanh_cnn_x1"), (100_000, "tanh_cnn_x2"),
                                             (400_000, "tanh_cnn_x4")]):
        cells += board(rng, {"grow": 2.0 * rung, "flat": -0.5 + 0.5 * (rung % 2)},
                       model=model, parameters=params)
    out = v4.analyse(cells, ANALYSIS, seed=int(rng.integers(1 << 30)))
    grow, flat = out["slopes"]["grow"], out["slopes"]["flat"]
    assert grow["label"] == "grows" and 0.8 < grow["point"] < 1.2  # 2 points per 4x = 1/doubling
    assert flat["label"] != "grows"
    assert [p for p, _ in grow["rungs"]] == [26_000, 100_000, 400_000]


def test_an_unpaired_method_has_no_paired_gain():
    rng = np.random.default_rng()
    cells = board(rng, {"nasr": 1.0})
    cells = [cells[0]._replace(paired=False)]
    out = v4.analyse(cells, ANALYSIS, seed=1)
    row = out["cells"][(cells[0].group, "nasr")]
    assert row["unpaired"] and "paired" not in row and "tuned" in row


def test_the_same_records_give_the_same_bytes():
    rng = np.random.default_rng()
    cells = board(rng, {"up": 1.5})
    a, b = v4.analyse(cells, ANALYSIS, seed=7), v4.analyse(cells, ANALYSIS, seed=7)
    assert a == b


def test_holm_levels_rank_by_the_raw_bounds_not_the_adjusted_ones():
    """Holm steps down in the order of the raw p-values: with raw upper bounds 0.004, 0.001,
    0.002 the adjusted ones are 0.004, 0.003, 0.004 (a tie), and the levels alpha / 2 and
    alpha belong to the 0.002 and the 0.004, whatever the tie's order."""
    high = np.array([0.004, 0.001, 0.002])
    adjusted = v4.decide_lib.holm_adjusted(high)
    assert list(adjusted) == pytest.approx([0.004, 0.003, 0.004])
    decision = v4.decide_lib.Decision(("reject",) * 3, 100, adjusted / 2, adjusted, high / 2,
                                      high, np.full(3, 100))
    assert list(v4.holm_levels(decision, 0.05)) == pytest.approx([0.05, 0.05 / 3, 0.05 / 2])


def test_every_interval_is_at_one_level_and_a_label_it_does_not_show_carries_its_step():
    """Fresh random boards of many cells near and far from the thresholds: every printed
    interval is at the family's first Holm level (alpha / m a side); a label (or a claim's)
    is 'shown' exactly when its interval says it by itself, and a decided label that is not
    shown carries its interval at the (looser) Holm level that decided it, inside the
    simultaneous one. Every assertion is exact, none a draw's luck. (That the step interval
    shows its label is held on the committed page, whose draws are fixed: on random boards
    the settling look's percentiles can sit a draw off the bounds that decided it, which
    intersect every look's.)"""
    rng = np.random.default_rng()
    gains = {f"m{i}": float(g) for i, g in enumerate(rng.uniform(-4, 4, 10))}
    claims = {m: float(rng.uniform(-1, 3)) for m in gains}
    cells = board(rng, gains, claims=claims)
    cells = [c._replace(mine=c.mine._replace(retrains=list(
        np.array(c.mine.retrains) + rng.normal(0, 0.004, 4)))) for c in cells]
    out = v4.analyse(cells, ANALYSIS, seed=int(rng.integers(1 << 30)))
    level = ANALYSIS["family"]["alpha"] / out["comparisons"]
    assert out["level"] == level
    seen = set()
    for (_, method), row in out["cells"].items():
        for estimand in ("tuned", "paired"):
            t = row[estimand]
            assert t["level"] == level and t["low"] <= t["point"] <= t["high"]
            shows = v4.interval_label(t["low"], t["high"], ANALYSIS["margin_points"])
            assert t["shown"] == (shows == t["label"])
            decided = t["label"] in ("better", "worse", "equivalent")
            assert ("step" in t) == (decided and not t["shown"])
            if "step" in t:  # a looser level: an interval inside the simultaneous one
                step = t["step"]
                assert step["level"] >= level and step["low"] >= t["low"] - 1e-9
                assert step["high"] <= t["high"] + 1e-9
            seen.add(t["shown"])
            if "claim" in t:
                c = t["claim"]
                assert c["shown"] == ((t["high"] < c["low"]) == (c["label"] == "claim excluded"))
                if not c["shown"] and c["label"] == "claim excluded":
                    assert c["step_high"] < c["low"]
    assert True in seen
