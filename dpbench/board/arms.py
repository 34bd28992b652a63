"""A board's published runs read per arm and cell: the one reader of a method's runs, what board
v4's analysis (board/v4.py), board v3's page (board/paired.py, board/v3_rule.py) and the
published epsilons all read; and the epsilon of what a board publishes (each distinct run
once, composed with PLD)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np

from dpbench import records as records_lib
from dpbench.board import board_model
from dpbench.board.board_model import BASELINE
from dpbench.search import space as search_space
from dpbench.search import tuning


class Arm(NamedTuple):
    """One method's runs in one group: the K seed-0 trials (None: diverged), its winner's
    retrains, its parameter count and each trial's coordinates in the family's space (None
    where the space has no lr x C and C to place them by)."""
    validation: list
    test: list
    winner: int
    retrains: list
    parameters: Optional[int]
    coordinates: Optional[np.ndarray] = None
    devices: frozenset = frozenset()  # (device kind, JAX version) of its records
    # every published run as (identity, DpEvent) (``run_identity``): the K trials (a diverged
    # one at the event search.json planned for it: it ran on private data, and that it
    # diverged is published), then the retrains
    runs: tuple = ()


class Cell(NamedTuple):
    group: str
    method: str
    epsilon: float
    model: str
    base: Arm
    mine: Arm
    paired: bool            # the method's trials share DP-SGD's points
    claim_low: Optional[float]   # the smallest claimed gain, points (None: no claim here)
    space: object = None    # board_model.Space of the family, or None

    def tuned_point(self) -> float:
        """The tuned gain in points: the mean of the method's winner's retrains minus
        DP-SGD's."""
        return 100.0 * (float(np.mean(self.mine.retrains)) - float(np.mean(self.base.retrains)))


def family_space(plan: dict):
    """The family's shared space as board_model places a configuration, or None."""
    try:
        return board_model.Space.of(plan["family_spec"])
    except (KeyError, TypeError):
        return None


def read_arm(group_dir: Path, plan: dict, method: str, space=None) -> Arm:
    """The arm's published runs (every search trial and every retrain must be published)."""
    seed0 = plan["seeds"][0]
    trials = [tuning.trial_outcome(group_dir, method, t, seed0)[0]
              for t in range(plan["num_trials"])]
    validation = [None if r is None else r["validation_accuracy"] for r in trials]
    winner = tuning.choose_trial(dict(enumerate(validation)))
    retrains, run_records = [], []
    for seed in plan["seeds"][1:]:
        record, where = tuning.trial_outcome(group_dir, method, winner, seed)
        if record is None:
            raise tuning.SearchRecordError(f"{where}: a retrain of {method}'s winner diverged; "
                                           "its seed part is undefined")
        retrains.append(record["test_accuracy"])
        run_records.append(record)
    coordinates = None
    if space is not None:
        coordinates = np.array([np.full(2 + len(space.levels), np.nan) if r is None else
                                space.coordinates(*board_model.record_config(r))
                                for r in trials])
    finished = [r for r in trials if r is not None]
    runs = tuple([(f"diverged:{method}-t{t}", tuning.planned_event(plan, method, t))
                  if r is None else (run_identity(r, f"{method}-t{t}"), r["dp_event"])
                  for t, r in enumerate(trials)]
                 + [(run_identity(r, f"{method}-retrain{i}"), r["dp_event"])
                    for i, r in enumerate(run_records)])
    return Arm(validation, [None if r is None else r["test_accuracy"] for r in trials], winner,
               retrains, finished[0].get("model_parameters") if finished else None,
               coordinates, frozenset(map(records_lib.device_of, finished + run_records)),
               runs)


def run_identity(record: dict, where: str) -> str:
    """A run's trajectory: its final parameters' sha256 (two records with the same one are one
    run published twice); a record without one is its own run."""
    return record.get("final_params_sha256") or f"record:{where}"


def shares_keys(plan: dict, method: str) -> bool:
    """Whether ``method``'s random trials keep any of the family's shared keys that DP-SGD's
    keep (then trial j of both ran the same values of them)."""
    if plan["num_trials"] < 2:
        return False
    protocol = {"families": {plan["family"]: plan["family_spec"]}}
    keys = [set(search_space.shared_draw(plan["methods"][m]["trials"][1], protocol,
                                         plan["family"], m)) for m in (BASELINE, method)]
    return bool(keys[0] & keys[1])


def distinct_events(runs) -> list:
    """The DpEvents of ``runs`` ((identity, event) pairs), each run once: one trajectory
    published twice (the same final parameters, e.g. a superseded search's run that the new
    search repeated byte for byte) is one release. Two records of one trajectory with
    different events contradict each other and are refused."""
    seen = {}
    for identity, event in runs:
        if identity in seen and seen[identity] != event:
            raise tuning.SearchRecordError(
                f"two records of the run {identity[:16]} state different DpEvents; one of "
                "them is not what ran: remove it")
        seen.setdefault(identity, event)
    return list(seen.values())


def published_epsilon(runs, delta: float) -> float:
    """The PLD epsilon of everything published about a method: its distinct runs
    (``distinct_events``) composed as independent mechanisms, i.e. as if each had drawn fresh
    secret noise (a benchmark's seeded runs that share a seed share a noise stream, which
    composition does not model; the board says so)."""
    return tuning.composition_epsilon(distinct_events(runs), delta)


def coarse_epsilon(events, delta: float) -> float:
    """A dataset's total over hundreds of distinct runs' events: PLD on a 3x coarser grid, an
    upper bound all the same (board v3: 98.07 against 97.37 at 1e-3, in 3.5 s instead of
    8.6)."""
    return tuning.published_epsilon([tuning.composed_event(events)], delta,
                                    discretization=3e-3)
