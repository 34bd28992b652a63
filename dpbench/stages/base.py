"""The stage abstraction: small optax-like objects plus the declarations the compiler checks.

A stage is built by a factory function registered with :func:`register_stage` (which registers it
with gin), so a pipeline's gin file names it as ``@clip.global_l2()``. The factory returns a
:class:`Stage`: pure ``init``/``apply`` functions and the privacy declarations (kinds, L2 bound,
Lipschitz factor, release flag, DP cost) that the compiler uses to validate the chain and derive
sensitivities without trusting any stage's arithmetic.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, NamedTuple, Optional

import gin
import jax


class Kind(enum.Enum):
    """What a value in the step is, privacy-wise. The compiler checks that kinds chain legally."""

    EXAMPLE = "example"          # one raw private example (image, label)
    PER_EXAMPLE = "per_example"  # derived from one private example, unbounded
    BOUNDED = "bounded"          # derived from one private example, L2 norm bounded by a clip
    AGGREGATE = "aggregate"      # masked sum of BOUNDED values over the batch (known sensitivity)
    RELEASED = "released"        # output of a DP release: public from here on (post-processing)
    UPDATES = "updates"          # optimizer output applied to the parameters


# Kinds whose values are private (functions of the private batch not yet released).
PRIVATE_KINDS = frozenset({Kind.EXAMPLE, Kind.PER_EXAMPLE, Kind.BOUNDED, Kind.AGGREGATE})


class StageInfo(NamedTuple):
    """Public, run-level facts a stage may use when it is built (all known before training)."""

    total_steps: int
    steps_per_epoch: int
    expected_batch_size: float
    dataset_size: int
    param_shapes: Any  # pytree of jax.ShapeDtypeStruct
    target_epsilon: Optional[float] = None  # the run's target; None when sigma is given
    public_images: Any = None  # the dataset's declared public split (never private data)
    num_classes: int = 0
    linear_apply: Optional[Callable] = None  # the model with identity activations (public)
    example_shape: tuple = ()


class StepContext(NamedTuple):
    """What a stage's ``apply`` may read inside the step. Everything here is public or released.

    ``key`` is this stage's own key for this step (and, for per-example stages, this example);
    ``noise_multiplier`` and ``sensitivity`` are filled in by the compiler for release stages.
    """

    params: Any
    step: jax.Array
    key: jax.Array
    loss_fn: Optional[Callable] = None
    noise_multiplier: float = 0.0
    sensitivity: float = 0.0
    host_inputs: Any = None  # this stage's public host randomness for this step (host_inputs)


def _gradient(params, grads):  # noqa: ARG001
    return grads


class InitRelease(NamedTuple):
    """A one-off Gaussian release before training (see Stage.init_release)."""

    l2_bound: float
    epsilon_fraction: float  # its noise is set so that it alone spends this share of epsilon
    init: Callable           # (params, released_sum, key) -> stage state
    # (params, one example's gradient) -> the per-example value that is clipped and summed
    per_example: Callable = _gradient
    released: str = "the clipped per-example gradient sum"  # what it releases, in words


def _no_state(params, key, info):  # noqa: ARG001
    return ()


@dataclasses.dataclass(frozen=True)
class Stage:
    """One step of a pipeline.

    Attributes:
      name: the registered name (``clip.global_l2``); errors name stages by it.
      kind_in / kind_out: the kinds this stage consumes and produces.
      apply: ``apply(value, state, ctx) -> value`` for per-example kinds (the compiler vmaps it;
        state is read-only there), ``apply(value, state, ctx) -> (value, new_state)`` otherwise.
      init: ``init(params, key, info) -> state``; the state is public (never private data).
      l2_bound: for a clip stage (PER_EXAMPLE -> BOUNDED): every output has L2 norm <= l2_bound.
      lipschitz: for a BOUNDED -> BOUNDED stage: its L2 Lipschitz factor (a public mask or an
        orthonormal projection is 1). ``None`` means unknown, which the compiler rejects.
      is_release: True for a stage that releases the aggregate with Gaussian noise of stddev
        ``noise_multiplier * sensitivity`` (both supplied by the compiler).
      dp_event: for a non-release stage that reads private values (AGGREGATE -> AGGREGATE), a
        function ``dp_event(info) -> dp_accounting.DpEvent`` giving its cost per step.
      build: ``build(stage, info) -> Stage``, called by the compiler with run-level facts (e.g.
        to build an optimizer schedule over the total number of steps).
      after_release: for a stage before the release whose state is public (e.g. a public mask),
        ``after_release(released, state, ctx) -> released``, applied by the compiler right after
        the release: post-processing with the same public state (e.g. keep noise only on the
        coordinates the mask kept).
      parts: for a clip stage, how many separately bounded parts its output has, each with
        L2 norm <= l2_bound and each released with the same sigma (GEP: embedding + residual = 2);
        the step then costs one Gaussian with multiplier sigma / sqrt(parts).
      init_release: for a stage whose initial state needs ONE accounted release of private
        data before training (DP-SNIP): an ``InitRelease``; the compiler performs the release
        (per-example grads, clip to ``l2_bound``, sum over a batch of the run's own sampler,
        Gaussian noise), composes its event into the ledger, and calls
        ``init_release.init(params, released, key) -> state`` with the released sum only.
      begin_step: ``begin_step(state, ctx) -> state`` for a per-example stage, run once per step
        before the batch from public inputs only (params, public data, key): e.g. GEP's basis.
      reads_private: False for an AGGREGATE stage whose choices ignore the private values (e.g.
        random-k); then it needs no ``dp_event``.
      prepare_params: ``prepare_params(params, state) -> params``, applied once to the initial
        parameters (e.g. a pre-pruning mask zeroing pruned weights); must not read private data.
      host_inputs: ``host_inputs(step, rng) -> pytree of numpy arrays``: public randomness
        this (batch) stage needs drawn on the host, exactly (e.g. GIP's Mallows draws, which
        float32 on the device cannot sample to the precision its privacy claim needs). ``rng``
        is a numpy Generator seeded by (run host seed, stage, step); the result reaches
        ``apply`` as ``ctx.host_inputs``. It never sees data.
      after_update: ``after_update(updates, state, ctx) -> updates``: public post-processing of
        the optimizer's output with the stage's own public state (DP-SSGD freezes the
        coordinates dropped this step, so momentum cannot move them).
      options: the factory's arguments, recorded in the run record.
    """

    name: str
    kind_in: Kind
    kind_out: Kind
    apply: Callable
    init: Callable = _no_state
    l2_bound: Optional[float] = None
    lipschitz: Optional[float] = None
    is_release: bool = False
    dp_event: Optional[Callable] = None
    build: Optional[Callable] = None
    after_release: Optional[Callable] = None
    prepare_params: Optional[Callable] = None
    reads_private: bool = True
    parts: int = 1
    init_release: Optional[Any] = None
    begin_step: Optional[Callable] = None
    host_inputs: Optional[Callable] = None
    after_update: Optional[Callable] = None
    options: dict = dataclasses.field(default_factory=dict)

    @property
    def per_example(self) -> bool:
        return self.kind_in in (Kind.EXAMPLE, Kind.PER_EXAMPLE, Kind.BOUNDED)


def requires_build(name: str) -> Callable:
    """The ``apply`` of a stage whose real ``apply`` is made by its ``build`` hook."""
    def unbuilt(*args, **kwargs):
        raise RuntimeError(f"{name} must be built by the compiler before use")
    return unbuilt


_REGISTERED: dict[str, Callable] = {}


def register_stage(name: str):
    """Registers a stage factory under ``module.function`` (e.g. ``'clip.global_l2'``) with gin.

    This is the only step needed to add a stage: decorate the factory and name it in a pipeline's
    gin file as ``@clip.global_l2()``.
    """
    module, _, fn_name = name.rpartition(".")
    if not module or not fn_name:
        raise ValueError(f"stage name {name!r} must look like 'module.function'")

    def decorator(factory):
        if name in _REGISTERED:
            raise ValueError(f"stage {name!r} is registered twice")
        configurable = gin.configurable(fn_name, module=module)(factory)
        _REGISTERED[name] = configurable
        return configurable

    return decorator


def registered_stage_names() -> list[str]:
    return sorted(_REGISTERED)
