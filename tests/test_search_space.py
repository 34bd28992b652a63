"""What each trial binds: paired quasirandom draws, derived keys, the checks on them."""

import json

import numpy as np
import pytest

from dpbench.search import space as search_space
from dpbench.search import tuning
from dpbench.search.protocol import ProtocolError, at_epsilon, load_protocol
from dpbench.search.space import shared_draw, trial_bindings

CLIP, LR = "clip.global_l2.l2_bound", "optimize.optax.learning_rate"


def protocol(seed=None):
    """A family whose shared space has a range, a derived range and a privacy choice; four
    methods: one keeps everything, one adds its own knob, one binds the clip under its own
    name, one redefines the learning rate and excludes the batch size."""
    seed = int(np.random.default_rng().integers(1 << 30)) if seed is None else seed
    space = {CLIP: {"log_uniform": [0.02, 0.2]},
             LR: {"log_uniform": [0.1, 1.6], "over": CLIP},
             "train.batch_size": {"choice": [128, 256], "privacy": True},
             "train.ema_decay": {"choice": [0.0, 0.9, 0.99]}}
    pipeline = "pipelines/dpsgd/pipeline.gin"
    return {"trials": {"fixed": 9, "seed": seed}, "families": {"F": {"space": space, "methods": {
        "plain": {"gin_file": pipeline},
        "own": {"gin_file": pipeline, "space": {"sparsify.random_mask.final_rate":
                                                {"uniform": [0.3, 0.9]}}},
        "renamed": {"gin_file": pipeline, "shared_as": {CLIP: "gep.embed_and_clip.x"},
                    "space": {"gep.embed_and_clip.r": {"uniform": [0.1, 0.5],
                                                       "times": "gep.embed_and_clip.x"}}},
        "apart": {"gin_file": pipeline, "exclude": ["train.batch_size"],
                  "space": {LR: {"log_uniform": [1.0, 2.0]}}}}}}}


def _values(bindings):
    return dict(b.split(" = ", 1) for b in bindings)


def test_trial_j_shares_its_draw_across_methods_and_own_knobs_are_the_methods_own():
    p = protocol()
    trials = {m: trial_bindings(p, "F", "G", m, 8)
              for m in ("plain", "own", "renamed", "apart")}
    for j in range(1, 9):
        draws = {m: shared_draw(t[j], p, "F", m) for m, t in trials.items()}
        assert draws["plain"] == draws["own"] == draws["renamed"], j
        assert len(draws["plain"]) == 4
        # 'apart' keeps only the keys it neither excludes nor redefines, with the same values
        assert draws["apart"] == {k: draws["plain"][k] for k in (CLIP, "train.ema_decay")}
        renamed = _values(trials["renamed"][j])
        assert CLIP not in renamed and renamed["gep.embed_and_clip.x"] == draws["plain"][CLIP]
        ratio = float(renamed["gep.embed_and_clip.r"]) / float(renamed["gep.embed_and_clip.x"])
        assert 0.1 * (1 - 1e-3) <= ratio <= 0.5 * (1 + 1e-3)  # drawn times its own name
        assert 1.0 <= float(_values(trials["apart"][j])[LR]) <= 2.0
    # the draws differ between trials, and another group draws other points (two of the 8
    # stratified clips round to the same 4 digits only within 1e-3 in log of each other: the
    # closest pair is that close in 4e-5 of protocol seeds, fit over 60,000 of them)
    assert len({trials["plain"][j][0] for j in range(1, 9)}) == 8
    assert trial_bindings(p, "F", "H", "plain", 8) != trials["plain"]
    assert trial_bindings(p, "F", "G", "plain", 8) == trials["plain"]


def test_the_learning_rate_is_drawn_as_the_effective_step_over_the_clip():
    p = protocol()
    for trial in trial_bindings(p, "F", "G", "plain", 8)[1:]:
        v = _values(trial)
        step = float(v[LR]) * float(v[CLIP])
        assert 0.1 * (1 - 1e-3) <= step <= 1.6 * (1 + 1e-3)  # 4 significant digits each


def test_points_are_stratified_in_every_dimension():
    """The first 2^m scrambled Sobol points put exactly one point in each 1/2^m of every
    coordinate (why a K of 8 covers a range evenly; i.i.d. draws leave gaps)."""
    u = search_space.unit_points(8, 5, search_space.stable_seed(np.random.default_rng()
                                                                 .integers(1 << 30)))
    for d in range(5):
        assert sorted(np.floor(u[:, d] * 8).astype(int)) == list(range(8))


def test_a_choice_is_taken_evenly_over_a_balanced_block():
    p = protocol()
    sizes = [_values(t)["train.batch_size"] for t in trial_bindings(p, "F", "G", "plain",
                                                                           8)[1:]]
    assert sorted(sizes) == ["128"] * 4 + ["256"] * 4


@pytest.mark.parametrize("change, message", [
    (lambda p: p["families"]["F"]["methods"]["plain"].update(exclude=[CLIP]), "not a plain key"),
    (lambda p: p["families"]["F"]["space"][LR].update(over="train.nothing"), "not a plain key"),
    (lambda p: p["families"]["F"]["space"][LR].update(times=CLIP), "one of them"),
    (lambda p: p["families"]["F"]["space"]["train.batch_size"].update(over=CLIP), "finite"),
    (lambda p: p["families"]["F"]["methods"]["own"].update(shared_as={"x.y": "z"}), "shared_as"),
])
def test_a_bad_derived_or_renamed_key_is_refused(tmp_path, change, message):
    p = protocol(seed=1)
    p.update(delta=1e-5, epsilons=[1.0], seeds=[0])
    change(p)
    path = tmp_path / "protocol.json"
    path.write_text(json.dumps(p))
    with pytest.raises(ProtocolError, match=message):
        load_protocol(path)


def test_a_range_of_its_own_at_one_epsilon_keeps_each_trials_point_and_every_other_group():
    """"at_epsilon" gives a range for the groups at one target epsilon: there every trial j
    keeps its Sobol point (the same position in the new range, the same other knobs, so the
    pairing holds), and the protocol at any other epsilon is exactly what it was without it
    (a group's search.json stores the space in force: an added range changes no other group)."""
    p = protocol()
    lo, hi = sorted(np.exp(np.random.default_rng().uniform(np.log(0.01), np.log(2.0), 2)))
    revised = json.loads(json.dumps(p))
    revised["families"]["F"]["space"][LR]["at_epsilon"] = {"1.0": [lo, hi]}
    assert at_epsilon(revised, 3.0) == at_epsilon(p, 3.0) == p
    at_one = at_epsilon(revised, 1.0)
    assert at_one["families"]["F"]["space"][LR] == {"log_uniform": [lo, hi], "over": CLIP}
    assert at_epsilon(at_one, 1.0) == at_one  # resolving twice changes nothing
    for method in ("plain", "own", "renamed"):
        old = trial_bindings(p, "F", "G", method, 8)
        new = trial_bindings(at_one, "F", "G", method, 8)
        assert new[0] == old[0]  # the recipe
        for j in range(1, 9):
            a, b = _values(old[j]), _values(new[j])
            assert {k: v for k, v in a.items() if k != LR} == \
                {k: v for k, v in b.items() if k != LR}
            clip = float(a.get(CLIP) or a["gep.embed_and_clip.x"])
            u_old = np.log(float(a[LR]) * clip / 0.1) / np.log(16.0)
            u_new = np.log(float(b[LR]) * clip / lo) / np.log(hi / lo)
            assert abs(u_new - u_old) < 2e-3 * (1 + 1 / np.log(hi / lo)), j  # 4 digits
    # a method's own range takes an "at_epsilon" too, and an entry may state its own source
    revised["families"]["F"]["methods"]["apart"]["space"][LR]["at_epsilon"] = {
        "1": {"range": [3.0, 4.0], "source": "why"}}
    assert at_epsilon(revised, 1.0)["families"]["F"]["methods"]["apart"]["space"][LR] \
        == {"log_uniform": [3.0, 4.0], "source": "why"}
    for trial in trial_bindings(at_epsilon(revised, 1.0), "F", "G", "apart", 8)[1:]:
        assert 3.0 <= float(_values(trial)[LR]) <= 4.0


@pytest.mark.parametrize("at_epsilon, message", [
    ({"0.1": [0.05, 0.8]}, "not one of the protocol's epsilons"),
    ({"one": [0.05, 0.8]}, "not one of the protocol's epsilons"),
    ({"1.0": [0.8, 0.05]}, "at epsilon 1.0"),
    ({"1.0": [0.0, 0.8]}, "lo > 0"),
    ({"1.0": 0.5}, r"must be \[lo, hi\]"),
    ({"1.0": {"range": [0.05, 0.8], "sourse": "typo"}}, "is \\[lo, hi\\] or"),
    ({"1.0": {"range": [0.8, 0.05]}}, "at epsilon 1.0"),
    ([0.05, 0.8], "maps a target epsilon"),
])
def test_a_bad_range_at_an_epsilon_is_refused(tmp_path, at_epsilon, message):
    p = protocol(seed=1)
    p.update(delta=1e-5, epsilons=[3.0, 1.0], seeds=[0])
    p["families"]["F"]["space"][LR]["at_epsilon"] = at_epsilon
    path = tmp_path / "protocol.json"
    path.write_text(json.dumps(p))
    with pytest.raises(ProtocolError, match=message):
        load_protocol(path)
    p["families"]["F"]["space"][LR].pop("at_epsilon")  # only ranges have one
    p["families"]["F"]["space"]["train.ema_decay"]["at_epsilon"] = {"1.0": [0.0, 0.9]}
    path.write_text(json.dumps(p))
    with pytest.raises(ProtocolError, match="needs a log_uniform or uniform range"):
        load_protocol(path)


def test_the_test_protocol_loads(tmp_path):
    p = protocol(seed=1)
    p.update(delta=1e-5, epsilons=[1.0], seeds=[0])
    path = tmp_path / "protocol.json"
    path.write_text(json.dumps(p))
    loaded = load_protocol(path)
    assert set(loaded["families"]["F"]["methods"]) == {"plain", "own", "renamed", "apart"}


def test_a_secret_searchs_draws_are_iid_from_its_own_generator_and_inside_the_space():
    """A secret search (Papernot & Steinke) draws each trial i.i.d. from OS entropy: two
    generators give different trials, the public seed plays no part, values stay in range."""
    p = protocol()
    a = trial_bindings(p, "F", "G", "own", 32, rng=np.random.default_rng())
    b = trial_bindings(p, "F", "G", "own", 32, rng=np.random.default_rng())
    assert a[0] == b[0]  # trial 0 is the recipe
    assert a[1:] != b[1:]  # 32 equal draws from two entropy seeds: never (< 1e-100)
    for trial in a[1:]:
        v = _values(trial)
        assert 0.02 <= float(v[CLIP]) <= 0.2 and v["train.batch_size"] in ("128", "256")
        assert 0.1 * 0.999 <= float(v[LR]) * float(v[CLIP]) <= 1.6 * 1.001
    with pytest.raises(ProtocolError, match="deployment"):
        tuning.secret_law({"fixed": 8})
    assert tuning.secret_law({"fixed": 8, "deployment": {"shape": "inf", "mean_random": 7}}) \
        == {"shape": "inf", "mean_random": 7}
