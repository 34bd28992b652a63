"""A run's life, one module per stage of it, in order:

- ``settings``: :class:`Settings`, every setting a trial's ledger and model depend on, built
  once; the resume check, the checkpoint, the run record and the statement all read it;
- ``build``: ``build_run`` (data, model, keys, sampler, the compiled pipeline) and
  ``run_event`` (the same run's DpEvent, nothing lowered);
- ``start``: the workdir, the budget stop, restore or init (``start``);
- ``loop``: the one train loop (``train_members``), a trial's ``begin`` and ``finish``;
- ``record``: the run record (the settings plus the outcomes) and its privacy statement;
- ``group``: trials as data on the device: packing, the memory plan, a group's stepping;
- ``trials``: ``train`` (a run: a group of one) and ``train_trials``, the launcher's.
"""

from dpbench.run.build import Run, build_run, run_event
from dpbench.run.loop import TrainingDiverged
from dpbench.run.trials import Trial, train, train_trials
from dpbench.run.settings import SHARED_BY_A_GROUP, Settings, total_steps_for
from dpbench.run.start import CHECKPOINTS, SUPERSEDED, ResumeError, WorkdirError

__all__ = ["CHECKPOINTS", "ResumeError", "Run", "SHARED_BY_A_GROUP", "SUPERSEDED", "Settings",
           "Trial", "TrainingDiverged", "WorkdirError", "build_run", "run_event",
           "total_steps_for", "train", "train_trials"]
