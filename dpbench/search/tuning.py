"""The board's tuning protocol: one declared search space, a random number of trials, and the
privacy cost of the search itself (Papernot & Steinke, ICLR 2022).

The protocol is one JSON file (``leaderboard/protocol.json``): per group family (dataset, model)
a search space shared by every method, each method's own knobs, and its trial 0 (the paper's
recipe); the trial-count distribution and the seeds. Everything here is pure and Ray-free:
``dpbench.sweep`` runs the trials on Ray Tune, ``dpbench.board`` reads what they left.

Trial count. Per group, K = 1 + J trials per method: trial 0 (fixed), and J random ones, with
J drawn ONCE per group from a truncated negative binomial (dp_accounting's RepeatAndSelect
family: shape 0 logarithmic, 1 geometric, inf Poisson) from a seed derived from the protocol's
seed and the group's name. Every method of the group runs the same K.

Privacy of the search. Trial 0's run and the best of the J random runs are two releases; the
winner (the better of the two on validation) is post-processing of them. So in RDP

    rdp_search(a) = rdp_trial0(a) + RepeatAndSelect_J(max over the space's support of rdp_run)(a)

Why the maximum over the support: a random trial is "draw a configuration from the space, then
run it"; that mixture's Renyi divergence is at most the largest of its components' (joint
quasi-convexity), and Papernot & Steinke's theorem needs one mechanism repeated i.i.d. The
support is finite: space keys marked ``"privacy": true`` (batch size, epochs, any knob that
changes the run's DpEvent) take values from a list, and the sweep computes every combination's
event before training (``search.json``). The board checks that every trial's recorded event is
its combination's, so a knob that changes the event without being declared is caught.

What this epsilon covers: releasing the ONE selected model of a search run as declared, with K
and the other trials' outputs kept secret (revealing K or the losers voids it). The board itself
publishes all trials for research; it is not such a release: what the board publishes costs
``published_epsilon``, the composition of every run it prints.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Optional

import numpy as np
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from dpbench import accounting, records
from dpbench.search import answers
from dpbench.search.space import privacy_key, stable_seed
from dpbench.search.protocol import ProtocolError
from dpbench.search.trial_count import sample_trial_count, shape_of

SEARCH_FILE = "search.json"  # a group's plan, beside its published runs
DIVERGED = records.DIVERGED_NAME  # what a run that diverged publishes instead of its record
# Two numeric stacks calibrate one support point's sigma a few ulps of Brent's root apart
# (board v3's runs on the lent GPU machine, scipy 1.18.1: 3.5e-10 relative from search.json's),
# far inside accounting.SIGMA_TOLERANCE; an undeclared privacy knob moves an event by much more
# (one step more, a batch size, epochs: sigma by 1e-3 and up). Each record's OWN event is what
# the board composes; this tolerance only decides which support point a record ran.
EVENT_RTOL = 1e-6


def events_match(planned, recorded, rtol: float = EVENT_RTOL) -> bool:
    """Whether two DpEvents (JSON) are one mechanism: the same classes, keys, integers and
    strings, and floats within ``rtol`` of each other (relative)."""
    if isinstance(planned, dict) and isinstance(recorded, dict):
        return planned.keys() == recorded.keys() and all(
            events_match(planned[k], recorded[k], rtol) for k in planned)
    if isinstance(planned, list) and isinstance(recorded, list):
        return len(planned) == len(recorded) and all(
            events_match(a, b, rtol) for a, b in zip(planned, recorded))
    if type(planned) is float and type(recorded) is float:
        return math.isclose(planned, recorded, rel_tol=rtol, abs_tol=0.0)
    return type(planned) is type(recorded) and planned == recorded


# The one place that writes (group_name, run_dir_name) and parses (GROUP_PATTERN,
# parse_run_dir) a group's folder name and a published run's.
GROUP_PATTERN = re.compile(r"^(?P<dataset>[\w\-]+)__(?P<model>[\w\-]+)__eps(?P<eps>[0-9.e+\-]+)"
                           r"__delta(?P<delta>[0-9.e+\-]+)$")
RUN_DIR_PATTERN = re.compile(r"^(?P<method>.+)-t(?P<trial>[0-9]+)-seed(?P<seed>[0-9]+|secret)$")


def group_name(family: str, epsilon: float, delta: float) -> str:
    """A group's folder: ``<dataset>__<model>__eps<E>__delta<D>`` (family = dataset__model)."""
    return f"{family}__eps{float(epsilon)}__delta{delta:g}"


def secret_law(trials: dict) -> dict:
    """The law a secret search draws J from: the protocol's own random law, or a fixed K's
    declared ``deployment``; a fixed K without one is refused."""
    if "fixed" not in trials:
        return {k: trials[k] for k in ("shape", "mean_random")}
    if "deployment" not in trials:
        raise ProtocolError("a secret search draws J from a law, and this protocol's 'trials' "
                            "is a fixed K with none: add \"deployment\": {\"shape\": \"inf\", "
                            "\"mean_random\": 7} to it (or give the random law itself)")
    return {k: trials["deployment"][k] for k in ("shape", "mean_random")}


def draw_random_trials(trials: dict, group: str) -> int:
    """J, the number of random trials of every method of ``group``: one draw, from a seed
    derived from the protocol's seed and the group's name, of the law dp_accounting's
    RepeatAndSelectDpEvent(mean_random, shape) accounts; K - 1 for a fixed K."""
    if "fixed" in trials:
        return int(trials["fixed"]) - 1
    rng = np.random.default_rng(stable_seed(trials["seed"], group, "trials"))
    return sample_trial_count(rng, float(trials["mean_random"]), shape_of(trials))


# ------------------------------------------------------------------ the search's epsilon (RDP)

def _rdp_curve(event: dp_event.DpEvent, orders) -> tuple[np.ndarray, float]:
    """(RDP at ``orders``, probability of any truncated-batch overflow) of one run's event.
    Truncated Poisson sampling is accounted as Poisson with the overflow charged to delta
    (accounting._rdp_view). dp_accounting keeps the composed curve in ``_rdp`` (no public
    getter); the version is pinned (tools/constraints.txt) and tests/test_tuning.py checks this
    path against the public RepeatAndSelectDpEvent for a single-point support."""
    key = (repr(event), tuple(float(o) for o in orders))
    if key not in _RDP_CURVES:
        view, overflow = accounting._rdp_view(event)
        acc = rdp_privacy_accountant.RdpAccountant(list(key[1]))
        acc.compose(view)
        _RDP_CURVES[key] = np.asarray(acc._rdp, dtype=np.float64), overflow
    curve, overflow = _RDP_CURVES[key]
    return curve.copy(), overflow


# A board asks for the same run's curve and the same composition many times (each method's
# row, its verdict, the search summary of every table that shows the group): computed once
# per content. The key is the event's repr (every field, floats exactly), never a path, so
# a changed record can never hit a stale entry.
_RDP_CURVES: dict = {}


def search_epsilon(trial0_event: dp_event.DpEvent, support_events, *, mean_random: float,
                   shape: float, delta: float) -> float:
    """Epsilon at ``delta`` of releasing the winner of trial 0 plus J ~ TNB(mean_random, shape)
    random trials, each a run whose event is one of ``support_events`` (K secret; a fixed K is
    the composition of its runs, ``composition_epsilon``). Remembered on disk (answers.py)."""
    return answers.remembered(
        ["search_epsilon", *map(accounting.event_to_json, [trial0_event, *support_events]),
         float(mean_random), float(shape), float(delta)],
        lambda: _search_epsilon(trial0_event, support_events, mean_random, shape, delta))


def _search_epsilon(trial0_event, support_events, mean_random, shape, delta) -> float:
    orders = np.asarray(rdp_privacy_accountant.DEFAULT_RDP_ORDERS, dtype=np.float64)
    rdp0, overflow0 = _rdp_curve(trial0_event, orders)
    curves = [_rdp_curve(e, orders) for e in support_events]
    worst = np.max([c for c, _ in curves], axis=0)
    overflow = overflow0 + mean_random * max(o for _, o in curves)
    rdp = rdp0 + np.asarray(rdp_privacy_accountant._compute_rdp_repeat_and_select(
        orders, worst, mean_random, shape))
    if np.isnan(rdp).any():  # never: a NaN order would read as free
        raise AssertionError("the search's RDP curve has NaN orders")
    # TV distance of the truncated search from the Poisson one: overflow (union bound over the
    # expected number of runs); it costs (1 + e^eps) * overflow of delta, with eps the result.
    epsilon = rdp_privacy_accountant.compute_epsilon(orders, rdp, delta)[0]
    cap = epsilon + 1.0
    charge = 0.0 if overflow == 0 else (  # math.exp overflows past 709: no bound there anyway
        math.inf if cap > 700 else (1.0 + math.exp(cap)) * overflow)
    left = delta - charge
    if left <= 0:
        raise accounting.BudgetError(
            f"truncated-batch overflow uses up delta in the search's accounting: P[some batch "
            f"overflows] {overflow:.3g} times (1 + e^{cap:.3g}) exceeds delta {delta:g}; runs "
            "with a larger sampler.overflow_stddevs (a larger padded batch) bound it")
    epsilon = rdp_privacy_accountant.compute_epsilon(orders, rdp, left)[0]
    if epsilon > cap:  # cannot happen (a smaller delta moves epsilon by far less than 1)
        raise AssertionError("search epsilon moved by more than its cap")
    return float(epsilon)


def published_epsilon(events, delta: float, discretization: float = 1e-3) -> float:
    """Epsilon at ``delta`` of everything a board publishes for one method of a group: the
    PLD composition of every run's own DpEvent (all K trials, the losers included, and the
    winner's retrains). True whatever is known about K: the board prints K and every trial, so
    Papernot & Steinke's epsilon (``search_epsilon``, K secret) does not cover it."""
    event = dp_event.ComposedDpEvent(list(events))
    return answers.remembered(  # 1-3 s of PLD each, asked at every board build
        ["published_epsilon", accounting.event_to_json(event), float(delta), float(discretization)],
        lambda: accounting.epsilon_of(event, accounting.Budget(1.0, delta, "pld", discretization)))


def composed_event(events_json) -> dp_event.DpEvent:
    """The composition of runs' events (JSON), identical events folded into one
    self-composition (sorted: the same runs give the same event, whatever their order)."""
    counts = Counter(json.dumps(e, sort_keys=True) for e in events_json)
    return dp_event.ComposedDpEvent([
        dp_event.SelfComposedDpEvent(accounting.event_from_json(json.loads(e)), n)
        for e, n in sorted(counts.items())])


def composition_epsilon(events_json, delta: float) -> float:
    """``published_epsilon`` of runs' events as records store them (JSON)."""
    return _composition_epsilon_of(
        tuple(sorted(json.dumps(e, sort_keys=True) for e in events_json)), float(delta))


@functools.lru_cache(maxsize=1024)
def _composition_epsilon_of(events_key: tuple, delta: float) -> float:
    """``composition_epsilon`` once per content: the sorted events' JSON (the composition
    does not depend on the order of its runs) and delta."""
    return published_epsilon([composed_event([json.loads(e) for e in events_key])], delta)


def finished_score(value):
    """A trial's validation accuracy as a number that may win, or None for a trial that must
    never win: a diverged run (None), or one whose accuracy is not a finite number (NaN or
    infinity, also as the strings "nan" / "inf" a run record stores them as)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def choose_trial(validation: dict) -> int:
    """The search's winner: trial -> validation accuracy (None for a diverged run); the highest
    finite accuracy wins, ties to the smaller trial number. A diverged trial, or one whose
    accuracy is not a finite number, never wins. Test accuracy is never read."""
    finished = {t: s for t, s in ((t, finished_score(v)) for t, v in validation.items())
                if s is not None}
    if not finished:
        raise ValueError("every trial of the search diverged or failed: there is no winner")
    return min(finished, key=lambda t: (-finished[t], t))


class SearchRecordError(ValueError):
    """A search whose records do not match its search.json; the message names the path."""


class SearchIncomplete(SearchRecordError):
    """A search still running: some of its runs are not published yet."""


def run_dir_name(method: str, trial: int, seed) -> str:
    """The directory of one published run of a search (and of its workdir); a secret search's
    trial (seed None: drawn from OS entropy inside the run, written nowhere) is 'seedsecret'."""
    return f"{method}-t{trial}-seed{'secret' if seed is None else seed}"


def parse_run_dir(name: str):
    """(method, trial, seed) of a run folder named by run_dir_name (seed None for 'secret'),
    or None for any other name."""
    match = RUN_DIR_PATTERN.match(name)
    if match is None:
        return None
    seed = None if match["seed"] == "secret" else int(match["seed"])
    return match["method"], int(match["trial"]), seed


def method_run_dirs(group_dir, method: str) -> list:
    """The folders of ``method``'s runs in a group (named by run_dir_name), sorted by name."""
    group_dir = Path(group_dir)
    if not group_dir.is_dir():
        return []
    return [d for d in sorted(group_dir.iterdir())
            if d.is_dir() and (parsed := parse_run_dir(d.name)) and parsed[0] == method]


def published(run_dir: Path) -> bool:
    """Whether a run folder holds its outcome: its record, or the note that it diverged."""
    return (run_dir / records.RECORD_NAME).exists() or (run_dir / DIVERGED).exists()


def trial_outcome(group_dir: Path, method: str, trial: int, seed: int):
    """(record or None for a diverged run, path) of one published trial."""
    directory = group_dir / run_dir_name(method, trial, seed)
    record_path = directory / records.RECORD_NAME
    if record_path.exists():
        try:
            return json.loads(record_path.read_text()), record_path
        except json.JSONDecodeError as e:
            raise SearchRecordError(f"{record_path}: unreadable run record ({e})") from e
    if (directory / DIVERGED).exists():
        return None, directory / DIVERGED
    raise SearchIncomplete(f"{directory}: trial {trial} of {method}'s search has no published "
                           "record; finish the sweep (rerun `dpbench sweep`) first")


def planned_events(plan: dict, method: str) -> dict:
    """privacy key -> the DpEvent search.json computed for it: the event each of ``method``'s
    trials has by its privacy settings (also a trial that diverged and published no record)."""
    return {privacy_key(s["bindings"], _protocol_of(plan), plan["family"], method): s["event"]
            for s in plan["methods"][method]["support"]}


def planned_event(plan: dict, method: str, trial: int) -> dict:
    key = privacy_key(plan["methods"][method]["trials"][trial], _protocol_of(plan),
                      plan["family"], method)
    return planned_events(plan, method)[key]


def record_problem(plan: dict, method: str, trial: int, seed: int, record: dict,
                   support: Optional[dict] = None) -> Optional[str]:
    """Why a published run's record is not the run ``plan`` asks for (None when it is): no
    DpEvent, a seed other than its own, or (a random trial, on any seed) a DpEvent other than
    the one search.json computed for its privacy settings (``support``: planned_events)."""
    if record.get("dp_event") is None or record.get("seed") != seed:
        return f"no dp_event, or seed {record.get('seed')} is not the search's seed {seed}"
    if trial > 0:
        key = privacy_key(plan["methods"][method]["trials"][trial], _protocol_of(plan),
                          plan["family"], method)
        support = planned_events(plan, method) if support is None else support
        if not events_match(support.get(key), record["dp_event"]):
            return (f"its DpEvent is not the one search.json computed for its privacy "
                    f"settings {key}: a knob that changes the event is missing \"privacy\": "
                    "true in the protocol's space")
    return None


def search_summary(group_dir) -> dict:
    """Per method of a finished search (``<group_dir>/search.json`` and its published trials):
    K, the winner, every trial's validation accuracy, and the search's epsilon recomputed from
    the records' own DpEvents. A random trial whose event is not its support point's is
    refused (a privacy-relevant knob was not declared)."""
    group_dir = Path(group_dir)
    path = group_dir / SEARCH_FILE
    try:
        plan = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SearchRecordError(f"{path}: unreadable search plan ({e})") from e
    law, seed0 = plan["trials_law"], plan["seeds"][0]
    out = {}
    for method in sorted(plan["methods"]):
        support = planned_events(plan, method)
        validation, events = {}, {}
        for trial in range(plan["num_trials"]):
            record, where = trial_outcome(group_dir, method, trial, seed0)
            validation[trial] = None if record is None else record["validation_accuracy"]
            if record is None:
                continue
            problem = record_problem(plan, method, trial, seed0, record, support)
            if problem:
                raise SearchRecordError(f"{where}: {problem}")
            events[trial] = record["dp_event"]
        if 0 not in events:
            raise SearchRecordError(f"{group_dir}: {method}'s trial 0 diverged; its event is "
                                    "unknown")
        fixed = "fixed" in law
        if fixed:  # K public: the K runs' PLD composition (a diverged one at its planned event)
            epsilon = composition_epsilon(
                [events[t] if t in events else planned_event(plan, method, t)
                 for t in range(plan["num_trials"])], plan["delta"])
        else:
            epsilon = search_epsilon(
                accounting.event_from_json(events[0]),
                [accounting.event_from_json(e) for e in support.values()],
                mean_random=float(law["mean_random"]), shape=shape_of(law),
                delta=plan["delta"])
        deployment = law.get("deployment")  # a fixed K's board, and how to deploy it
        deployment_epsilon = deployment_note = None
        if deployment is not None:
            try:
                deployment_epsilon = search_epsilon(
                    accounting.event_from_json(events[0]),
                    [accounting.event_from_json(e) for e in support.values()],
                    mean_random=float(deployment["mean_random"]),
                    shape=shape_of(deployment), delta=plan["delta"])
            except accounting.BudgetError as e:  # no bound to state: say why, never a number
                deployment_note = str(e)
        out[method] = dict(num_trials=plan["num_trials"], winner=choose_trial(validation),
                           validation=validation, search_epsilon=epsilon,
                           deployment_epsilon=deployment_epsilon,
                           deployment_note=deployment_note,
                           law=dict(fixed=law["fixed"]) if fixed else dict(
                               shape=law["shape"], mean_random=law["mean_random"]))
    return out


def search_progress(group_dir) -> tuple[int, int]:
    """(runs published, runs the search and the winners' seeds will publish) of a group."""
    group_dir = Path(group_dir)
    plan = json.loads((group_dir / SEARCH_FILE).read_text())
    expected = len(plan["methods"]) * (plan["num_trials"] + len(plan["seeds"]) - 1)
    done = sum(1 for d in group_dir.iterdir() if d.is_dir() and published(d))
    return done, expected


def _protocol_of(plan: dict) -> dict:
    """The one-family protocol a search.json snapshots (for method_space)."""
    return {"families": {plan["family"]: plan["family_spec"]}}


def expected_best(scores, n: int) -> float:
    """Expected best of ``n`` trials drawn with replacement from ``scores`` (Dodge et al. 2019,
    "Show Your Work"): sum_i s_(i) [(i/K)^n - ((i-1)/K)^n] over the sorted scores."""
    ordered = np.sort(np.asarray(scores, dtype=np.float64))
    k = len(ordered)
    i = np.arange(1, k + 1)
    return float(np.sum(ordered * ((i / k) ** n - ((i - 1) / k) ** n)))
