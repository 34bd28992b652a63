"""The run facts: the ONE record of the public, run-level facts a stage may read, each derived
here from what a run is compiled from (:class:`RunInputs`).

A stage names the facts it reads in ``Stage.needs``; the compiler hands ``make`` and
``Privacy.cost`` a view (:class:`StageFacts`) holding those names only, and refuses a
pipeline whose run lacks one of them, with what to set. Adding a fact for a new method is one
entry in ``RUN_FACTS`` and the stage that names it: nothing between the run and the stage
changes (tests/test_stage_contract.py adds one that way).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Callable, NamedTuple, Optional

import jax

from dpbench.compiler import bookkeeping
from dpbench.compiler.taps import MATMUL, discover_taps


@dataclasses.dataclass(frozen=True)
class RunInputs:
    """What a run is compiled from, all public: the sampler, the budget and the run's length,
    the model (its initializer, loss, flax module and linearized twin) and the dataset's
    public facts. ``noise_multiplier=None`` calibrates sigma to the budget."""

    sampler: Any
    budget: Any
    total_steps: int
    steps_per_epoch: int
    init_params: Callable
    example_shape: tuple
    loss_fn: Callable
    model: Any = None
    noise_multiplier: Optional[float] = None
    public_images: Any = None
    num_classes: int = 0
    linear_apply: Optional[Callable] = None


class RunFact(NamedTuple):
    """One run fact: ``derive(inputs, facts)`` (``facts``: the run's other facts, by name) and,
    when the run may lack it (``derive`` gives None), what to set to provide it."""

    derive: Callable
    when_absent: str = ""


def _param_shapes(inputs: RunInputs, facts) -> Any:
    return jax.eval_shape(inputs.init_params, jax.eval_shape(lambda: jax.random.key(0)))


def _taps(inputs: RunInputs, facts) -> Optional[tuple]:
    if inputs.model is None:
        return None
    return discover_taps(inputs.model, facts.get("param_shapes"), tuple(inputs.example_shape))


def _layer_grads(inputs: RunInputs, facts) -> Optional[Callable]:
    taps = facts.get("taps")
    if taps is None or not all(t.kind == MATMUL for t in taps):
        return None
    return bookkeeping.layer_grads_fn(inputs.model, taps)


RUN_FACTS = MappingProxyType({
    "total_steps": RunFact(lambda i, f: i.total_steps),
    "steps_per_epoch": RunFact(lambda i, f: i.steps_per_epoch),
    "expected_batch_size": RunFact(lambda i, f: i.sampler.expected_batch_size),
    "dataset_size": RunFact(lambda i, f: i.sampler.dataset_size),
    # the sampler's static batch size (examples + padding)
    "padded_batch_size": RunFact(lambda i, f: i.sampler.padded_batch_size),
    "param_shapes": RunFact(_param_shapes),  # pytree of jax.ShapeDtypeStruct
    "example_shape": RunFact(lambda i, f: tuple(i.example_shape)),
    "num_classes": RunFact(lambda i, f: i.num_classes),
    # (params, image, label) -> the loss of one example (models.cross_entropy_loss)
    "loss_fn": RunFact(lambda i, f: i.loss_fn),
    "target_epsilon": RunFact(
        lambda i, f: i.budget.epsilon if i.noise_multiplier is None else None,
        "a target epsilon (the run sets train.noise_multiplier, so sigma is not calibrated to "
        "one); leave train.noise_multiplier unset"),
    "public_images": RunFact(
        lambda i, f: i.public_images,
        "the dataset's declared public split (never private data); set dataset.public_size > 0 "
        "(carved from train, disjoint from the private set)"),
    "linear_apply": RunFact(
        lambda i, f: i.linear_apply,
        "the model with identity activations (public); the train loop passes it, so pass "
        "linear_apply= in RunInputs"),
    # the model's tap layers (compiler/taps.py), or None where a parameter sits outside them
    "taps": RunFact(_taps, ""),
    # (params, images, labels, mask) -> ({tap path: {"bias": (b, p), "kernel": (b, p, d)}},
    # losses): every example's gradient of models.logits_loss from ONE batched backward pass,
    # each kernel outputs-first; None unless every parameter is a matmul layer's
    # (compiler/bookkeeping.py). For ``Hooks.layer_clip`` and public anchor gradients.
    "layer_grads": RunFact(_layer_grads, ""),
})

# Facts a stage may read as None (it has a path without them); every other needed fact must
# be present, or the compiler refuses the pipeline with the fact's ``when_absent``.
OPTIONAL_FACTS = frozenset({"taps", "layer_grads"})


class RunFacts:
    """One run's facts, each derived once, when first read (``get``)."""

    def __init__(self, inputs: RunInputs):
        self.inputs = inputs
        self._catalogue = RUN_FACTS  # read when made, so a test may add a fact (monkeypatch)
        self._values: dict = {}

    def known(self) -> frozenset:
        return frozenset(self._catalogue)

    def get(self, name: str):
        if name not in self._values:
            if name not in self._catalogue:
                raise KeyError(f"no run fact {name!r}; the run facts are "
                               f"{sorted(self._catalogue)} (compiler/facts.py)")
            self._values[name] = self._catalogue[name].derive(self.inputs, self)
        return self._values[name]

    def absent(self, name: str) -> Optional[str]:
        """What to set when ``name`` is needed but this run lacks it; None when present."""
        if name in OPTIONAL_FACTS or self.get(name) is not None:
            return None
        return self._catalogue[name].when_absent or "a value this run does not have"

    def for_stage(self, stage) -> "StageFacts":
        return StageFacts(self, stage.name, stage.needs)


class StageFacts:
    """What ``make`` and ``Privacy.cost`` see: the run facts the stage names in ``needs``,
    as attributes (``facts.total_steps``); reading any other raises an error naming it."""

    def __init__(self, facts: RunFacts, stage_name: str, needs: frozenset):
        self._facts, self._stage, self._needs = facts, stage_name, frozenset(needs)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._needs:
            raise AttributeError(f"stage '{self._stage}' reads the run fact {name!r} without "
                                 f"naming it: add {name!r} to its Stage(needs=...)")
        return self._facts.get(name)
