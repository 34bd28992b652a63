"""The tuning protocol: the trial-count law, the search's epsilon, the protocol file."""

import math

import numpy as np
import pytest
import scipy.special
import scipy.stats
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from dpbench import accounting, config
from dpbench.search import tuning
from dpbench.search.protocol import ProtocolError, at_epsilon, load_protocol
from dpbench.search.space import privacy_key, privacy_support, trial_bindings

# DESIGN.md section 7's run: DP-SGD at eps 3 on the tanh CNN (q 0.0186, sigma 1.276, 1612 steps)
RUN = dp_event.SelfComposedDpEvent(
    dp_event.PoissonSampledDpEvent(0.0186, dp_event.GaussianDpEvent(1.276)), 1612)
SHAPES = (0.0, 0.5, 1.0, math.inf)


def public_epsilon(event, delta=1e-5):
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(event)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mean", [1.0, 5.0])
def test_search_epsilon_is_dp_accountings_repeat_and_select_for_one_support_point(shape, mean):
    ours = tuning.search_epsilon(RUN, [RUN], mean_random=mean, shape=shape, delta=1e-5)
    theirs = public_epsilon(dp_event.ComposedDpEvent(
        [RUN, dp_event.RepeatAndSelectDpEvent(RUN, mean, shape)]))
    assert ours == pytest.approx(theirs, rel=1e-12)
    assert ours > public_epsilon(RUN)  # the search costs more than its one run


def test_known_values_of_the_search_alone():
    """DESIGN.md section 7 (dp-accounting 0.6.0): the run inside a search of mean 8 trials."""
    for shape, known in ((math.inf, 6.35), (1.0, 5.98), (0.0, 5.19)):
        got = tuning.search_epsilon(dp_event.NoOpDpEvent(), [RUN], mean_random=8.0,
                                    shape=shape, delta=1e-5)
        assert got == pytest.approx(known, abs=0.006)


def test_the_worst_support_point_sets_the_search_epsilon():
    noisier = dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(0.0186, dp_event.GaussianDpEvent(2.0)), 1612)
    longer = dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(0.0186, dp_event.GaussianDpEvent(1.276)), 3224)
    kw = dict(mean_random=5.0, shape=1.0, delta=1e-5)
    base = tuning.search_epsilon(RUN, [RUN], **kw)
    assert tuning.search_epsilon(RUN, [RUN, noisier], **kw) == pytest.approx(base, rel=1e-12)
    assert tuning.search_epsilon(RUN, [RUN, longer], **kw) > base + 0.5
    assert tuning.search_epsilon(RUN, [noisier], **kw) < base


@pytest.mark.parametrize("shape", SHAPES)
def test_the_trial_count_has_the_declared_mean(shape):
    rng = np.random.default_rng()
    draws = np.array([tuning.sample_trial_count(rng, 5.0, shape) for _ in range(4000)])
    # 4.5 standard errors of the law's exact sd, not the draws' own: on the skewed shape-0 law a
    # low mean comes with a low sample sd (4 sample sds failed ~1.6e-4 of runs, simulated). The
    # exact law of the sum (the pmf's FFT power) puts <= 8.9e-6 beyond it at every shape.
    j = np.arange(401)
    sd = np.sqrt(np.sum(_trial_count_pmf(5.0, shape, 400) * (j - 5.0) ** 2))
    assert abs(draws.mean() - 5.0) < 4.5 * sd / np.sqrt(len(draws))
    assert draws.min() >= (0 if shape == math.inf else 1)


def _trial_count_pmf(mean: float, shape: float, j_max: int) -> np.ndarray:
    """P[J = j], j = 0..j_max, from the law's definition (Papernot & Steinke): Poisson(mean)
    for shape inf; else proportional to C(j + shape - 1, j) (1 - gamma)^j on j >= 1 (shape 0:
    (1 - gamma)^j / j), gamma from dp_accounting's inversion of the mean, normalised over
    j = 1..20 j_max (the rest of the tail is negligible)."""
    from dp_accounting.rdp import rdp_privacy_accountant
    j = np.arange(j_max + 1, dtype=np.float64)
    if shape == math.inf:
        return scipy.stats.poisson(mean).pmf(j)
    gamma = rdp_privacy_accountant._gamma_truncated_negative_binomial(shape, mean)
    k = np.arange(1, 20 * j_max, dtype=np.float64)
    log_w = k * np.log1p(-gamma) + (-np.log(k) if shape == 0 else scipy.special.gammaln(
        k + shape) - scipy.special.gammaln(shape) - scipy.special.gammaln(k + 1))
    w = np.exp(log_w)
    return np.concatenate([[0.0], w[:j_max]]) / w.sum()


def trial_count_p_value(draws, mean: float, shape: float, j_max: int = 12) -> float:
    """The chi-square p-value of 4,000-ish draws of J against the law's probabilities (bins
    0..j_max and the tail; bins expecting < 5 counts pooled into one)."""
    n = len(draws)
    pmf = _trial_count_pmf(mean, shape, j_max)  # bins 0..j_max; the rest is the tail bin
    expected = np.append(pmf, 1.0 - pmf.sum()) * n
    enough = expected >= 5
    pooled = expected[~enough].sum()
    counts = np.bincount(np.minimum(draws, j_max + 1), minlength=j_max + 2)
    observed, want = counts[enough], expected[enough]
    if pooled > 0:
        observed, want = np.append(observed, counts[~enough].sum()), np.append(want, pooled)
    elif counts[~enough].sum():  # a draw where the law puts no mass
        return 0.0
    return scipy.stats.chisquare(observed, want).pvalue


@pytest.mark.parametrize("shape", SHAPES)
def test_the_trial_count_follows_the_accounted_law_exactly(shape):
    """The search's epsilon holds for the exact law of J, not only its mean: a chi-square of
    4,000 draws against the law's probabilities (bins 0..12 and the tail) passes, and a law
    with the same mean but another shape (1 + Poisson(mean - 1)) is rejected by it."""
    mean, n = 5.0, 4000
    rng = np.random.default_rng()
    draws = np.array([tuning.sample_trial_count(rng, mean, shape) for _ in range(n)])
    assert draws.min() >= (0 if shape == math.inf else 1)
    # false failures (2e6 simulated multinomial draws per shape): 0.95e-5..1.6e-5 at this
    # 1e-5 (1.1e-4..1.4e-4 at 1e-4: bins of ~10 counts fatten the tail); the twin passes
    # < 1e-6 in ~1e-7 of runs (shape inf, 1e7 simulated; 0 at the other shapes)
    assert trial_count_p_value(draws, mean, shape) > 1e-5
    assert trial_count_p_value(1 + rng.poisson(mean - 1, n), mean, shape) < 1e-6


def test_the_trial_count_is_one_draw_per_group_from_the_recorded_seed():
    law = {"shape": 1, "mean_random": 5, "seed": 3}
    j = tuning.draw_random_trials(law, "g__m__eps3.0__delta1e-05")
    assert j == tuning.draw_random_trials(law, "g__m__eps3.0__delta1e-05")
    others = {tuning.draw_random_trials(dict(law, seed=s), "g__m__eps3.0__delta1e-05")
              for s in range(30)}
    assert len(others) > 3  # the seed matters
    assert tuning.draw_random_trials({"shape": 1, "mean_random": 1, "seed": 0}, "x") == 1


def protocol(**space):
    return {"delta": 1e-5, "epsilons": [3.0], "seeds": [0, 1],
            "trials": {"shape": 1, "mean_random": 2, "seed": 1},
            "families": {"digits__logistic": {
                "base": ["train.log_every_steps = 5"],
                "space": space or {"optimize.optax.learning_rate": {"log_uniform": [0.5, 4.0]},
                                   "train.batch_size": {"choice": [128, 256], "privacy": True},
                                   "train.epochs": {"value": 2, "privacy": True}},
                "methods": {"dpsgd": {"gin_file": "pipelines/dpsgd/pipeline.gin",
                                      "trial0": ["train.epochs = 2"]},
                            "gep": {"gin_file": "pipelines/gep/pipeline.gin",
                                    "exclude": ["optimize.optax.learning_rate"],
                                    "space": {"PRUNE": {"choice": ["@prune.random()"]}}}}}}}


def test_trials_are_the_recipe_then_draws_from_the_space(tmp_path):
    p = protocol()
    trials = trial_bindings(p, "digits__logistic", "G", "dpsgd", 4)
    assert trials[0] == ["train.log_every_steps = 5", "train.epochs = 2"]
    assert trials == trial_bindings(p, "digits__logistic", "G", "dpsgd", 4)
    for t in trials[1:]:
        values = dict(b.split(" = ") for b in t)
        assert 0.5 <= float(values["optimize.optax.learning_rate"]) <= 4.0
        assert values["train.batch_size"] in ("128", "256") and values["train.epochs"] == "2"
    gep = trial_bindings(p, "digits__logistic", "G", "gep", 1)[1]
    assert "PRUNE = @prune.random()" in gep  # a gin reference is bound as one
    assert not any(b.startswith("optimize.optax.learning_rate") for b in gep)
    support = privacy_support(p, "digits__logistic", "dpsgd")
    assert [s[1:] for s in support] == [["train.batch_size = 128", "train.epochs = 2"],
                                        ["train.batch_size = 256", "train.epochs = 2"]]


@pytest.mark.parametrize("space, message", [
    ({"train.batch_size": {"log_uniform": [64, 512], "privacy": True}}, "finite 'choice'"),
    ({"train.epochs": {"between": [1, 2]}}, "must be one of"),
    ({"optimize.optax.learning_rate": {"log_uniform": [0.0, 1.0]}}, "lo > 0"),
    ({"optimize.optax.learning_rate": {"uniform": [2.0, 1.0]}}, "lo < hi"),
    ({"train.epochs": {"choice": [1, 2]}}, "privacy\": true"),  # refused at load, not after
    ({"train.batch_size": {"value": 256}}, "privacy\": true"),  # every trial has run
])
def test_a_bad_space_is_refused_naming_the_key(tmp_path, space, message):
    path = tmp_path / "protocol.json"
    path.write_text(__import__("json").dumps(protocol(**space)))
    with pytest.raises(ProtocolError, match=message) as e:
        load_protocol(path)
    assert str(path) in str(e.value) and list(space)[0] in str(e.value)


@pytest.mark.parametrize("break_it, where, key", [
    (lambda p: p.update(trails_typo=1), "", "trails_typo"),
    (lambda p: p["families"]["digits__logistic"].update(spcae={}), "family digits__logistic",
     "spcae"),
    (lambda p: p["families"]["digits__logistic"]["methods"]["gep"].update(
        exlude=["train.epochs"]), "family digits__logistic method gep", "exlude"),
    (lambda p: p["families"]["digits__logistic"]["methods"]["dpsgd"].update(
        shared_ass={}), "family digits__logistic method dpsgd", "shared_ass"),
])
def test_an_unknown_key_at_any_level_is_refused_naming_it(tmp_path, break_it, where, key):
    """A typo must not silently mean 'no search' ("spcae") or bind a key the method meant to
    drop ("exlude"): every level of the protocol accepts only its known keys."""
    path = tmp_path / "protocol.json"
    good = protocol()
    path.write_text(__import__("json").dumps(good))
    load_protocol(path)  # the same protocol without the typo loads
    break_it(good)
    path.write_text(__import__("json").dumps(good))
    with pytest.raises(ProtocolError, match=rf"{where}.*unknown keys \['{key}'\]"):
        load_protocol(path)


@pytest.mark.parametrize("board", ["protocol.json", "v4/protocol.json"])
def test_every_trial_of_the_boards_protocol_is_a_valid_configuration(board):
    """Each method's trial 0 and a drawn trial parse with its pipeline and family files (gin
    checks every name), and the drawn values of privacy keys come from the support."""
    p = load_protocol(config.REPO_ROOT / "leaderboard" / board)
    assert p["trials"]["fixed"] >= 8  # board v3: K >= 8 for every method of every group
    assert p["trials"]["deployment"]["mean_random"] + 1 >= 8  # the secret-K deployment's
    for family, spec, epsilon in [(f, s, e) for e in p["epsilons"]
                                  for f, s in at_epsilon(p, e)["families"].items()]:
        at = at_epsilon(p, epsilon)  # the space a group at that epsilon draws from
        for method, m in spec["methods"].items():
            files = [m["gin_file"], *spec.get("gin_files", [])]
            support = {tuple(s) for s in privacy_support(at, family, method)}
            for trial in trial_bindings(at, family, "G", method, 1):
                config.parse_config(files, trial)
            key = privacy_key(trial, at, family, method)
            assert any(set(key) <= set(s) for s in support)


def test_expected_best_is_the_bootstrap_expectation_of_the_maximum():
    """Against brute force over every sample of n draws with replacement from K scores."""
    import itertools
    scores = np.random.default_rng().uniform(0.5, 0.9, size=4)
    for n in (1, 2, 3):
        brute = np.mean([max(c) for c in itertools.product(scores, repeat=n)])
        assert tuning.expected_best(scores, n) == pytest.approx(brute, rel=1e-12)
    assert tuning.expected_best(scores, 1) == pytest.approx(scores.mean())
    assert tuning.expected_best(scores, 200) == pytest.approx(scores.max(), abs=1e-6)


def choose_by_max(validation: dict) -> int:
    """Broken twin of tuning.choose_trial: the largest number wins (it skips only the trials
    that left no number), whether or not that number is a finite accuracy."""
    numbers = {t: v for t, v in validation.items() if v is not None}
    return max(numbers, key=numbers.get)


# trial -> validation accuracy (None: diverged), and the trial that must win. In each, a failed
# trial holds the 'highest' number: NaN (which no comparison moves past) or infinity.
SEARCHES_WITH_A_FAILED_TRIAL = {
    "nan": ({0: math.nan, 1: 0.84, 2: None, 3: 0.86}, 3),
    "inf": ({0: 0.80, 1: math.inf, 2: 0.85, 3: None}, 2),
}


def check_the_winner_is_the_best_finished_trial(select, validation: dict, winner: int):
    chosen = select(validation)
    assert chosen == winner, (f"trial {chosen} (validation {validation[chosen]!r}) won; the "
                              f"best finished trial is {winner}")


@pytest.mark.parametrize("search", SEARCHES_WITH_A_FAILED_TRIAL)
@pytest.mark.parametrize("select", [tuning.choose_trial, choose_by_max],
                         ids=["choose_trial", "broken_twin_max"])
def test_a_diverged_or_failed_trial_never_wins_the_search(select, search):
    """Guarantee 8 (the search: the sweep's winners_of and the board's search summary both
    choose with tuning.choose_trial): a diverged trial, or one whose accuracy is not a finite
    number, never wins, even with the highest number; a selector that takes the max fails."""
    validation, winner = SEARCHES_WITH_A_FAILED_TRIAL[search]
    if select is choose_by_max:
        with pytest.raises(AssertionError):
            check_the_winner_is_the_best_finished_trial(select, validation, winner)
        return
    check_the_winner_is_the_best_finished_trial(select, validation, winner)
    # NaN and infinity as a run record stores them (records.to_json writes strings)
    check_the_winner_is_the_best_finished_trial(select, {0: 0.80, 1: "nan", 2: 0.82,
                                                         3: "inf"}, 2)
    with pytest.raises(ValueError, match="diverged or failed"):
        select({0: None, 1: math.nan, 2: "inf"})


def test_the_published_epsilon_is_dp_accountings_pld_composition_of_every_run():
    """Recomputed with dp_accounting's own PLD accountant, from events as records store them;
    a wrong composition (the largest run alone) falls short of it."""
    from dp_accounting.pld import pld_privacy_accountant

    from dpbench import accounting

    rng = np.random.default_rng()
    runs = [dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(
        float(rng.uniform(0.02, 0.03)), dp_event.GaussianDpEvent(float(rng.uniform(1.2, 1.4)))),
        int(rng.integers(400, 600))) for _ in range(3)]
    stored = [accounting.event_from_json(accounting.event_to_json(e)) for e in runs]
    got = tuning.published_epsilon(stored, 1e-5)
    want = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    want.compose(dp_event.ComposedDpEvent(runs))
    assert got == pytest.approx(want.get_epsilon(1e-5), rel=1e-9)
    largest = max(tuning.published_epsilon([e], 1e-5) for e in stored)
    # three similar runs: about sqrt(3) times one, but not 1.3x for every draw (~1e-3 fell below
    # in 3,000 RDP-accounted draws): the worst corner (one run at q 0.03, sigma 1.2, 599 steps,
    # two at 0.02, 1.4, 400) gives 1.178, so 1.15 holds for every draw (rate 0) and still
    # rejects the largest run alone (1.0)
    assert got > 1.15 * largest


def test_the_memoised_epsilons_are_keyed_on_the_events_content_not_on_their_identity():
    """A board asks for the same composition and the same run's RDP curve many times; the memo
    must give what a fresh computation gives, and a run whose event differs in one digit of one
    field (a fresh random sigma, or one step more) must never get the other's number."""
    rng = np.random.default_rng()
    sigma = float(rng.uniform(1.0, 2.0))

    def run_json(sigma, steps=200):
        return {"class": "SelfComposedDpEvent", "count": steps, "event": {
            "class": "PoissonSampledDpEvent", "sampling_probability": 0.02,
            "event": {"class": "GaussianDpEvent", "noise_multiplier": sigma}}}

    events = [run_json(sigma), run_json(sigma * 1.3)]
    fresh = tuning.published_epsilon([tuning.composed_event(events)], 1e-5)
    assert tuning.composition_epsilon(events, 1e-5) == fresh
    assert tuning.composition_epsilon(events[::-1], 1e-5) == fresh  # order-free
    assert tuning.composition_epsilon([run_json(sigma * (1 - 1e-3)), events[1]], 1e-5) > fresh
    assert tuning.composition_epsilon([run_json(sigma, 201), events[1]], 1e-5) > fresh
    assert tuning.composition_epsilon(events, 1e-6) > fresh
    # the RDP side: the same content twice, then a run one step longer
    run = accounting.event_from_json(run_json(sigma))
    kw = dict(mean_random=3.0, shape=1.0, delta=1e-5)
    first = tuning.search_epsilon(run, [run], **kw)
    assert tuning.search_epsilon(accounting.event_from_json(run_json(sigma)),
                                 [run], **kw) == first
    theirs = public_epsilon(dp_event.ComposedDpEvent(
        [run, dp_event.RepeatAndSelectDpEvent(run, 3.0, 1.0)]))
    assert first == pytest.approx(theirs, rel=1e-12)
    longer = accounting.event_from_json(run_json(sigma, 201))
    assert tuning.search_epsilon(longer, [longer], **kw) > first
    assert tuning.search_epsilon(run, [run, longer], **kw) > first  # a worse support point
    assert tuning.search_epsilon(run, [run], **dict(kw, mean_random=4.0)) > first
    assert tuning.search_epsilon(run, [run], **dict(kw, shape=0.5)) != first


@pytest.mark.parametrize("family, epsilon, delta", [("fashion_mnist__tanh_cnn", 3, 1e-5),
                                                    ("digits__scatter-linear", 0.5, 1e-4)])
def test_a_group_folder_name_parses_back_to_what_wrote_it(family, epsilon, delta):
    """tuning writes and parses group and run folder names in one place."""
    match = tuning.GROUP_PATTERN.match(tuning.group_name(family, epsilon, delta))
    assert f"{match['dataset']}__{match['model']}" == family
    assert float(match["eps"]) == epsilon and float(match["delta"]) == delta


@pytest.mark.parametrize("method, trial, seed", [("dpsgd", 0, 0), ("gep-t2", 11, 3),
                                                 ("halfclip", 4, None)])
def test_a_run_folder_name_parses_back_to_what_wrote_it(method, trial, seed):
    name = tuning.run_dir_name(method, trial, seed)
    assert tuning.parse_run_dir(name) == (method, trial, seed)
    assert tuning.parse_run_dir(name + "x") is None and tuning.parse_run_dir("search.json") is None
