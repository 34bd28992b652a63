"""dpbench/board/v3_page.py: the answer's sentences come from the labels (fresh random label
patterns, never a fixed text), and p-values and sign tests print as their bounds say."""

import numpy as np

from dpbench.board import v3_page

GROUPS = [f"fashion_mnist__{model}__eps{eps}__delta1e-05" for model in ("tanh_cnn", "wrn")
          for eps in ("1.0", "3.0")]
LABELS = ("better", "worse", "equivalent", "inconclusive", "undecided at 6,400,000 draws")


def _analyses(labels: dict, weak=()) -> list:
    return [dict(group=g, baseline=dict(status="weaker" if g in weak else "ok"),
                 methods={"dpsgd": {}, **{m: dict(tuned=dict(label=by_group[g]))
                                          for m, by_group in labels.items()}})
            for g in GROUPS]


def test_the_answer_says_what_the_labels_say():
    rng = np.random.default_rng()
    for _ in range(20):
        labels = {m: {g: str(rng.choice(LABELS)) for g in GROUPS} for m in ("a", "b", "c")}
        weak = [g for g in GROUPS if rng.random() < 0.3]
        text = " ".join(v3_page.answer_sentences(_analyses(labels, weak)))
        beats = [m for m, by in labels.items() if "better" in by.values()]
        assert ("No method beats DP-SGD in any of the 4 settings." in text) == (not beats)
        for m in beats:
            assert f"{m} beats DP-SGD in" in text
        for m, by in labels.items():
            worse = [g for g in GROUPS if by[g] == "worse"]
            if len(worse) == 4:
                assert m in text.split(" worse than DP-SGD in all 4")[0].split(".")[-1]
            elif worse:
                assert f"{m} is worse in" in text
            if any(v.startswith("undecided") for v in by.values()):
                assert f"{m}'s label is undecided in" in text
        assert ("Every other comparison is inconclusive" in text) == any(
            v == "inconclusive" for by in labels.values() for v in by.values())
        assert ("below its best recorded configuration" in text) == bool(weak)
    all_worse = {"x": dict.fromkeys(GROUPS, "worse"), "y": dict.fromkeys(GROUPS, "worse")}
    assert "x and y are worse than DP-SGD in all 4." in v3_page.answer_sentences(
        _analyses(all_worse))


def test_a_p_prints_as_its_bounds_say_and_a_sign_test_at_its_floor_says_so():
    assert v3_page.p_text((0.001, 0.0231), True, floor=True) == "< 0.024 (Monte Carlo floor)"
    assert v3_page.p_text((0.01, 0.0401), True, floor=False) == "≤ 0.041"
    assert v3_page.p_text((0.318, 0.4), False, floor=False) == "≥ 0.31"
    assert v3_page.p_text((1.0, 1.0), False, floor=False) == "1"
    seven = dict(median=0.01, wins=7, losses=0, sign_p=2 * 0.5 ** 7)
    assert v3_page.sign_text(seven) == "+1.00 (7-0, p 0.016, floor for 7)"
    assert "floor" not in v3_page.sign_text(dict(seven, wins=6, losses=1, sign_p=0.125))
