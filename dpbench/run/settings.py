"""A run's settings, computed once: :class:`Settings` is every setting a trial's privacy ledger
and its model depend on, built from the config, the budget and the compiled pipeline. It is
the one source of the resume check, the checkpoint's ledger, the run record (the record is the
settings plus the outcomes) and the privacy statement.

A run trains one trial today; a group of trials that share one compiled step (a later step of
the design) must agree on the settings that fix the step's shapes and structure, named once in
``SHARED_BY_A_GROUP``; every other setting is a trial's own.
"""

from __future__ import annotations

import dataclasses
import fractions
import json
import math
from typing import Optional

from dpbench import accounting, checkpoint, records
from dpbench.config import TrainConfig


def branch_free(config: TrainConfig) -> bool:
    """Whether the step is compiled without data-dependent conditionals: always for a release
    run (``train.seed = None``), whose step time must not tell how many micro-batches the
    realized Poisson batch filled (a function of who was sampled); on request
    (``train.branch_free_step``) for a benchmark run, which otherwise skips empty ones."""
    return config.branch_free_step or config.seed is None


def total_steps_for(epochs: float, dataset_size: int, batch_size: int) -> int:
    """ceil(epochs * N / B), computed exactly on the decimal the user wrote for ``epochs``
    (float rounding would make 30 * (50000 / 3000) = 500.00000000000006 into 501 steps)."""
    return int(math.ceil(fractions.Fraction(str(epochs)) * dataset_size / batch_size))


@dataclasses.dataclass(frozen=True)
class Settings:
    """One trial's settings, each under the name its run record gives it. A resume under a
    change to any of them is refused, naming the change."""

    pipeline: str
    stages: tuple              # each stage's declared facts (compiled.plan.facts())
    dataset: str
    features: dict
    dataset_size: int          # N, the private training examples
    validation_size: int
    public_size: int
    model: str
    batch_size: int            # the expected batch size B (q = B / N)
    micro_batch_size: int
    epochs: float
    planned_steps: int
    sampling: dict             # the sampler's description (its DpEvent's parameters)
    seed: Optional[int]        # None: a release run, its OS-drawn seed written nowhere
    target_epsilon: float
    delta: float
    accountant: str
    pld_discretization: float  # the PLD accountant's value discretization
    accountant_version: str
    noise_multiplier: float
    init_noise_multiplier: Optional[float]  # a one-off release's before training (DP-SNIP)
    l2_sensitivity: float
    ema_decay: float
    budget_enforced: bool
    branch_free_step: bool     # no data-dependent conditional: the step's time is public

    @classmethod
    def of(cls, *, pipeline: str, compiled, dataset, model: str, config: TrainConfig,
           budget: accounting.Budget) -> "Settings":
        """The settings of a run whose pipeline ``compiled`` was compiled for ``dataset`` and
        ``model`` under ``config`` and ``budget``."""
        return cls(
            pipeline=pipeline, stages=tuple(compiled.plan.facts()), dataset=dataset.name,
            features=dict(dataset.features), dataset_size=len(dataset.train),
            validation_size=len(dataset.validation),
            public_size=0 if dataset.public is None else len(dataset.public),
            model=model, batch_size=config.batch_size, micro_batch_size=compiled.micro_batch_size,
            epochs=config.epochs, planned_steps=compiled.total_steps,
            sampling=compiled.sampler.describe(), seed=config.seed,
            target_epsilon=budget.epsilon, delta=budget.delta, accountant=budget.accountant,
            pld_discretization=budget.pld_discretization,
            accountant_version=accounting.accountant_version(),
            noise_multiplier=compiled.noise_multiplier,
            init_noise_multiplier=compiled.init_noise_multiplier,
            l2_sensitivity=compiled.sensitivity, ema_decay=config.ema_decay,
            budget_enforced=config.enforce_budget, branch_free_step=branch_free(config))

    def budget(self) -> accounting.Budget:
        """The budget these settings were made under."""
        return accounting.Budget(epsilon=self.target_epsilon, delta=self.delta,
                                 accountant=self.accountant,
                                 pld_discretization=self.pld_discretization)

    def as_json(self) -> dict:
        """The settings as plain JSON values, the form a checkpoint's ledger and the run
        record store (an infinite number as the string 'inf', records.to_json)."""
        return json.loads(records.to_json(dataclasses.asdict(self)))

    def digest(self) -> str:
        """sha256 of :meth:`as_json`: the record's and the ledger's ``settings_sha256``."""
        return checkpoint.settings_digest(self.as_json())

    def group_key(self) -> dict:
        """The settings the trials of one compiled step must share (``SHARED_BY_A_GROUP``)."""
        shared = self.as_json()
        key = {name: shared[name] for name in SHARED_BY_A_GROUP if name != "stages"}
        key["stages"] = [stage["name"] for stage in shared["stages"]]
        return key


# What fixes the compiled step's shapes and structure: the data and its splits, the model,
# the method's stage list (by name; its numbers are a trial's own), the expected batch size
# (and so the padded batch) and the micro-batch. Learning rate, clip bound, sigma, EMA decay,
# a stage's rates, the seed and the planned steps are a trial's own.
SHARED_BY_A_GROUP = ("dataset", "features", "dataset_size", "validation_size", "public_size",
                     "model", "pipeline", "stages", "batch_size", "micro_batch_size")
