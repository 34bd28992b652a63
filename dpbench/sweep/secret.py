"""``dpbench sweep --secret_trial_count``: a search run the way Papernot & Steinke's bound needs
it, for a deployment rather than a board.

J comes from the protocol's law (a fixed K's ``trials.deployment``) drawn with OS entropy, the
random trials are drawn i.i.d. (never the board's public, paired sequence: a configuration must
not name its trial's index), every trial trains with ``train.seed = None`` (its initialisation,
batches and noise from a seed the run draws from OS entropy and writes to no file: Papernot and
Steinke's bound needs independent runs whose randomness nobody can regenerate), and the plan,
every trial and its record stay under
``<runs_dir>/secret/``. Only each method's winner leaves: its run record and ``release.json``
(the Papernot-Steinke epsilon of releasing it, recomputed from the records' own events), under a
name without its trial index. No retrains: each would be a further release.
"""

from __future__ import annotations

import json
from pathlib import Path

from dpbench import records as records_lib
from dpbench.search import tuning
from dpbench.search.methods import REPO_ROOT as REPO

run_dir_name = tuning.run_dir_name


RELEASE = "release.json"  # a secret search's statement, beside the one run it publishes


def publish_selected(plans, private_records: Path, records: Path) -> list:
    """Per group and method of finished secret searches: the winner's run record (and nothing
    else of the search: not K, not the losers, not the trial's index) into
    ``<records>/<group>/<method>-selected/`` with ``release.json``, the Papernot-Steinke
    epsilon of releasing it (tuning.search_epsilon over the records' own events)."""
    published = []
    for plan in plans:
        summary = tuning.search_summary(private_records / plan["group"])
        law = plan["trials_law"]
        for method in plan["methods"]:
            s = summary[method]
            if s["winner"] is None:
                continue  # every trial diverged: nothing to release
            source = private_records / plan["group"] / run_dir_name(method, s["winner"],
                                                                   plan["seeds"][0])
            target = records / plan["group"] / f"{method}-selected"
            release = dict(
                method=method, group=plan["group"], target_epsilon=plan["epsilon"],
                delta=plan["delta"], law=dict(shape=law["shape"],
                                              mean_random=law["mean_random"]),
                epsilon=s["search_epsilon"],
                seed=("secret: the run drew its seed from the operating system's entropy and "
                      "wrote it to no file (its record's seed is null)"),
                statement=(
                    f"({s['search_epsilon']:.4g}, {plan['delta']:g})-DP for this one released "
                    "model, its configuration and its validation accuracy: the best on "
                    "validation of trial 0 (the method's recipe) and J random trials drawn "
                    "i.i.d. from the protocol's space, J ~ "
                    f"{'Poisson' if tuning.shape_of(law) == float('inf') else 'TNB'}"
                    f"(mean {law['mean_random']}, shape {law['shape']}) drawn from OS entropy "
                    "and kept secret with every other trial (Papernot & Steinke, ICLR 2022; "
                    "dp_accounting's RepeatAndSelectDpEvent). Every trial drew its own seed "
                    "(initialisation, batches, noise) from OS entropy, and no file holds it. "
                    "Releasing anything else of the search voids it."))
            records_lib.publish_record(source, target)
            records_lib.atomic_write_text(target / RELEASE, json.dumps(release, indent=1) + "\n")
            published.append(target)
    return published


def into_board_reason(records: Path):
    """A secret search must not publish into the committed board (which prints every trial)."""
    if Path(records).resolve() == (REPO / "leaderboard" / "records").resolve():
        return ("--secret_trial_count publishes only each method's winner; give it a "
                "--records=DIR of its own, not the committed board's (which prints every trial)")
    return None
