"""A run's settings, computed once: :class:`Settings` is every setting a trial's privacy ledger
and its model depend on, built from the config, the budget and the compiled pipeline. It is
the one source of the resume check, the checkpoint's ledger, the run record (the record is the
settings plus the outcomes) and the privacy statement.

Trials that share one compiled step (run/group.py) must agree on the settings that fix the
step's shapes and structure: declared once here (``SHARED_BY_A_GROUP``, ``Settings.group_key``);
every other setting is a trial's own number.
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
        """The settings every trial of one compiled step shares (the declaration run/group.py
        packs by): ``SHARED_BY_A_GROUP``; of the sampler, what fixes its batch's shape and
        kind (``SHARED_SAMPLING``); whether an EMA is kept; and of each stage, its name and
        every fact that is not a real number (counts, flags, names: top-k sizes, bands,
        basis sizes, the optimizer's kind). A stage's real numbers (rates, bounds, learning
        rates) and sigma, the seed and the planned steps are each trial's own."""
        settings = self.as_json()
        key = {name: settings[name] for name in SHARED_BY_A_GROUP}
        key["sampling"] = {k: settings["sampling"].get(k) for k in SHARED_SAMPLING}
        key["ema"] = self.ema_decay > 0
        key["stages"] = [{k: v for k, v in stage.items()
                          if k not in PROSE_FACTS and _is_structure(v)
                          and k not in INTEGER_NUMBERS.get(stage["name"], ())}
                         for stage in settings["stages"]]
        return key


def _is_structure(value) -> bool:
    """A fact that is not a real number: an int, a flag, a name (or a list / dict of them)."""
    if isinstance(value, dict):
        return all(_is_structure(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_is_structure(v) for v in value)
    return not isinstance(value, float)


# What fixes the compiled step's shapes and structure: the data and its splits, the model,
# the method, the expected batch size and the micro-batch, a branch-free step or not.
SHARED_BY_A_GROUP = ("dataset", "features", "dataset_size", "validation_size", "public_size",
                     "model", "pipeline", "batch_size", "micro_batch_size", "branch_free_step")
SHARED_SAMPLING = ("sampling", "padded_batch_size", "parts")
PROSE_FACTS = ("statement_note", "mechanism")  # a stage's words for its statement, not structure
# A stage's integer facts that are a trial's own numbers: BandMF's strategy is optimized for the
# run's length, and enters the step as coefficients (lifted), so the length is not structure.
INTEGER_NUMBERS = {"noise.banded": ("strategy_steps",)}

# Bindings whose values are each trial's own although integers: its seed and its length.
TRIAL_NUMBER_BINDINGS = ("train.seed", "train.epochs", "EPSILON", "DELTA")
EMA_BINDING = "train.ema_decay"  # a real number, but whether it is 0 is structure (an EMA kept)


def binding_structure(name: str, value):
    """What a gin binding ``name = value`` fixes of a trial's compiled step: the rule of
    ``Settings.group_key`` read off a binding, before anything is built (the sweep packs by it):
    None for a trial's own number (a real number; the seed, the epochs, the budget), whether an
    EMA is kept for the EMA decay, and the value itself otherwise (a count, a flag, a name, a
    reference such as @prune.synflow())."""
    if name in TRIAL_NUMBER_BINDINGS:
        return None
    if name == EMA_BINDING:
        return float(value) > 0
    return None if isinstance(value, float) else value
