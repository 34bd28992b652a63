"""The launcher's files and command line, light enough for a sweep's driver to import: a trial
(where it writes, its gin files and bindings), a trials file, the outcomes file that says
which trials finished and which diverged (the only place a launcher reads divergence from),
and the process that trains a trials file (``dpbench train --trials``, run/trials.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NamedTuple, Sequence

from dpbench import records

DIVERGED, FINISHED = "diverged", "finished"


class Trial(NamedTuple):
    """One trial: where it writes, and its configuration (gin files and bindings, as
    ``dpbench train --gin_file ... --gin_bindings ...`` would take them)."""

    workdir: Path
    gin_files: tuple = ()
    bindings: tuple = ()


def read_trials_file(path: Path) -> list:
    """The trials of a JSON list of {workdir, gin_files, bindings} (``--trials``)."""
    try:
        spec = json.loads(Path(path).read_text())
        return [Trial(Path(t["workdir"]), tuple(t.get("gin_files", ())),
                      tuple(t.get("bindings", ()))) for t in spec]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--trials={path}: a JSON list of {{workdir, gin_files, bindings}} "
                         f"objects is expected ({type(e).__name__}: {e})") from e


def write_trials_file(path: Path, trials: Sequence[Trial]) -> None:
    records.atomic_write_text(Path(path), json.dumps(
        [dict(workdir=str(t.workdir), gin_files=list(t.gin_files), bindings=list(t.bindings))
         for t in trials], indent=1) + "\n")


def outcome_of(trial: Trial, result) -> dict:
    """What the outcomes file says of one trial: finished, or diverged with its message."""
    diverged = isinstance(result, Exception)
    return dict(workdir=str(trial.workdir), outcome=DIVERGED if diverged else FINISHED,
                message=str(result) if diverged else None)


def launch_command(trials_path: Path, outcomes_path: Path) -> list:
    """The process that trains a trials file: ``dpbench train --trials=... --outcomes=...``."""
    return [sys.executable, "-m", "dpbench.main", "train", f"--trials={trials_path}",
            f"--outcomes={outcomes_path}"]
