"""The compiler's one intermediate form: a validated pipeline bound to one run's public facts
(``Plan``; made by ``bind``, read by every later phase)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from dpbench.compiler.rules import ValidatedPipeline
from dpbench.stages.base import Kind


CONV_GRADS = ("patches", "convolution")


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How the clipped sum is lowered: speed only, every choice gives the same sums (within
    float rounding). ``branch_free``: no data-dependent conditional (every micro-batch runs,
    book-keeping always takes its weighted sum that zeroes non-finite examples).
    ``conv_grads``: book-keeping's per-example convolution kernels from the input's image
    patches ("patches") or by XLA's own convolution of the input with the output gradient,
    vmapped over the examples ("convolution"; no patches formed). ``device_partials``: the
    clipped-sum loop carries one partial sum per device (compile_pipeline sets it to the
    mesh's size): each device sums its own examples over every micro-batch and the partial
    sums are added once after the loop, so a step all-reduces its clipped sum once, not once
    per micro-batch (on one device: 1, the loop as it always was)."""

    branch_free: bool = False
    conv_grads: str = "patches"
    device_partials: int = 1

    def __post_init__(self):
        if self.conv_grads not in CONV_GRADS:
            raise ValueError(f"train.conv_grads must be one of {CONV_GRADS}, got "
                             f"{self.conv_grads!r}")


@dataclasses.dataclass(frozen=True)
class Plan:
    """A validated pipeline bound to one run: declarations, step functions, run facts."""

    stages: tuple          # the declarations, exactly as validated
    fns: tuple             # StageFns per stage, from make(facts)
    validated: ValidatedPipeline
    run_facts: Any         # compiler.facts.RunFacts: the run's public facts
    model: Any = None      # the flax model, when the caller gives it (book-keeping needs it)
    taps: Optional[tuple] = None  # its tap layers (taps.discover_taps), if all params
    strategy: str = "materialized"  # per-example strategy: "materialized" or "bookkeeping"
    strategy_reason: str = ""  # why the materialized one ("" for book-keeping)

    @property
    def num_per_example(self) -> int:
        """Stages run per example: up to the clip, plus BOUNDED stages after it."""
        clip = self.validated.clip_index
        return clip + 1 + sum(1 for s in self.stages[clip + 1:] if s.kind_in == Kind.BOUNDED)

    @property
    def sensitivity(self) -> float:
        return self.validated.sensitivity

    def facts(self) -> list:
        """Per stage: its name, the factory's options and the run-derived public facts."""
        return [dict(name=s.name, **s.options, **f.derived) for s, f in zip(self.stages,
                                                                              self.fns)]
