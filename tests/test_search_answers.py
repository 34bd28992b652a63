"""The search's privacy answers remembered on disk (dpbench/search/answers.py): a later build
gets the very float the accountant gave, and only for the same question, code, package versions
and host numerics; anything else is computed again."""

import json
from pathlib import Path

import numpy as np
import pytest
from dp_accounting import dp_event

from dpbench import accounting
from dpbench.search import answers, tuning


def fresh_event(rng) -> dp_event.DpEvent:
    """A run's event with random numbers, so no earlier test (or build) has asked it."""
    step = dp_event.PoissonSampledDpEvent(
        float(rng.uniform(0.01, 0.05)), dp_event.GaussianDpEvent(float(rng.uniform(0.8, 2.0))))
    return dp_event.SelfComposedDpEvent(step, int(rng.integers(50, 200)))


@pytest.fixture
def disk(tmp_path, monkeypatch):
    """An empty cache folder, every answer written (none is too quick)."""
    monkeypatch.setenv("DPBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(answers.DISABLE_ENV, raising=False)
    monkeypatch.setattr(answers, "SLOW_S", 0.0)
    return tmp_path / "accounting"


def refuse_the_accountant(monkeypatch):
    """A later process, in which the accountant must not be asked."""
    def refused(*args, **kwargs):
        raise AssertionError("the accountant was asked again")
    monkeypatch.setattr(accounting, "epsilon_of", refused)


def test_a_later_build_gets_the_accountants_own_float_and_only_for_its_question(
        disk, monkeypatch):
    rng = np.random.default_rng()
    events = [fresh_event(rng), fresh_event(rng)]
    want = tuning.published_epsilon(events, 1e-5)
    assert want == accounting.epsilon_of(dp_event.ComposedDpEvent(events), accounting.Budget(
        1.0, 1e-5))  # the accountant's own answer
    (entry,) = disk.glob("*.json")
    refuse_the_accountant(monkeypatch)
    assert tuning.published_epsilon(events, 1e-5) == want  # the same bits, from the disk
    for asked in ((events, 2e-5), (events, 1e-5, 2e-3), (events[:1], 1e-5),
                  ([events[0], fresh_event(rng)], 1e-5)):  # another question: asked
        with pytest.raises(AssertionError, match="asked again"):
            tuning.published_epsilon(*asked)
    assert json.loads(entry.read_text())["answer"] == want


@pytest.mark.parametrize("elsewhere", ["host", "versions", "accounting.py", "tuning.py"])
def test_an_answer_from_another_host_versions_or_code_is_not_read(disk, monkeypatch, elsewhere):
    """Each of the inputs of an answer's key, changed alone, makes it asked again; an edit of
    accounting.py (every answer's reductions) or search/tuning.py (the search's compositions)
    only: the key must cover those files by name, not by any file's hash."""
    events = [fresh_event(np.random.default_rng())]
    tuning.published_epsilon(events, 1e-5)
    if elsewhere.endswith(".py"):  # dpbench's own code edited: that file alone
        real = answers.source_hash
        monkeypatch.setattr(answers, "source_hash", lambda path: "edited" if Path(
            path).name == elsewhere else real(path))
    else:  # e.g. numpy's SIMD dispatch cut (CI's simulated other host), or dp-accounting's
        key = dict(answers.host_key(), **{"numerics" if elsewhere == "host" else elsewhere: {}})
        monkeypatch.setattr(answers, "host_key", lambda: key)
    refuse_the_accountant(monkeypatch)
    with pytest.raises(AssertionError, match="asked again"):
        tuning.published_epsilon(events, 1e-5)


def test_an_entry_that_does_not_hold_the_asked_key_is_recomputed_and_replaced(disk):
    events = [fresh_event(np.random.default_rng())]
    want = tuning.published_epsilon(events, 1e-5)
    (entry,) = disk.glob("*.json")
    stored = json.loads(entry.read_text())
    for bad in (json.dumps(dict(stored, key=stored["key"] + " ", answer=0.0)),  # another key
                '{"key": ', ""):  # cut short, empty
        entry.write_text(bad)
        assert tuning.published_epsilon(events, 1e-5) == want
        assert json.loads(entry.read_text()) == stored  # rewritten whole


def test_quick_answers_and_a_disabled_cache_write_nothing(disk, monkeypatch):
    rng = np.random.default_rng()
    monkeypatch.setattr(answers, "SLOW_S", 1e9)
    tuning.published_epsilon([fresh_event(rng)], 1e-5)
    monkeypatch.setattr(answers, "SLOW_S", 0.0)
    monkeypatch.setenv(answers.DISABLE_ENV, "0")
    tuning.published_epsilon([fresh_event(rng)], 1e-5)
    assert not disk.exists() or not list(disk.glob("*.json"))


def test_the_searchs_epsilon_is_remembered_with_its_own_code(disk, monkeypatch):
    rng = np.random.default_rng()
    trial0, support = fresh_event(rng), [fresh_event(rng), fresh_event(rng)]
    kwargs = dict(mean_random=float(rng.uniform(2, 8)), shape=1.0, delta=1e-5)
    want = tuning.search_epsilon(trial0, support, **kwargs)

    def refused(*args, **kwargs):
        raise AssertionError("computed again")
    monkeypatch.setattr(tuning, "_search_epsilon", refused)
    assert tuning.search_epsilon(trial0, support, **kwargs) == want
    with pytest.raises(AssertionError, match="computed again"):  # trial 0 is not a support run
        tuning.search_epsilon(support[0], [trial0, support[1]], **kwargs)
    with pytest.raises(AssertionError, match="computed again"):
        tuning.search_epsilon(trial0, support, **dict(kwargs, shape=0.5))
    real_hash = answers.source_hash
    monkeypatch.setattr(answers, "source_hash", lambda path: (
        "edited" if path.name == "tuning.py" else real_hash(path)))
    with pytest.raises(AssertionError, match="computed again"):  # tuning.py edited
        tuning.search_epsilon(trial0, support, **kwargs)
