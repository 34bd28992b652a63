"""The stage abstraction: a privacy declaration stated once, plus ``make`` for its step functions.

A stage is built by a factory registered with :func:`register_stage` (which registers it with
gin), so a pipeline's gin file names it as ``@clip.global_l2()``. The factory validates its
arguments and returns a :class:`Stage`: its kinds, its :class:`Privacy` DECLARATION (L2 bound,
Lipschitz factor, parts, cost, one-off release, where its public mask applies), the run facts
it ``needs``, and ``make(facts)``, which the compiler calls with those public run facts and
which returns the stage's pure step functions (:class:`StageFns`, optax-like). ``make``
returns functions only, so nothing it does can change what was declared and validated.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple, Optional

import gin
import jax
import jax.numpy as jnp


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


class Mask(enum.Enum):
    """Where the compiler applies a stage's public mask (``state["mask"]``, a params-shaped
    0/1 tree): the same helper, :func:`apply_mask`, everywhere."""

    PER_EXAMPLE = "per_example"  # the stage's per-example apply IS apply_mask(value, mask): the
    # compiler may use the mask directly (book-keeping clips masked gradients without them)
    RELEASED = "released"  # right after the release: noise only on kept coordinates
    UPDATES = "updates"    # on the optimizer's output: masked coordinates do not move
    PARAMS = "params"      # once, on the initial parameters (pre-pruning zeroes weights)


def apply_mask(tree, mask):
    """``tree * mask`` leaf by leaf: the one public-mask multiply of every masking stage."""
    return jax.tree.map(jnp.multiply, tree, mask)


class StepContext(NamedTuple):
    """What a stage's functions may read inside the step. Everything here is public or released.

    ``key`` is this stage's own key for this step (and, for per-example stages, this example);
    ``noise_stddev`` is, for the stages after the clip, the stddev of the Gaussian noise the
    release adds (the compiler's calibrated sigma times the pipeline's L2 sensitivity; 0 for the
    non-private baseline): the release adds it, a denoiser may read it; ``host_inputs`` is this
    stage's public host randomness for this step (``Hooks.host_inputs``).
    """

    params: Any
    step: jax.Array
    key: jax.Array
    noise_stddev: float = 0.0
    host_inputs: Any = None


class OneOffRelease(NamedTuple):
    """Declares ONE accounted Gaussian release of private data before training (DP-SNIP): each
    example's ``value(params, grad)`` clipped to ``l2_bound``, summed over a batch of the run's
    own sampler, noised so that it alone spends ``epsilon_fraction`` of epsilon; the stage's
    initial state is then ``init(params, released_sum, key)``."""

    l2_bound: float
    epsilon_fraction: float
    value: Callable
    init: Callable
    released: str = "the clipped per-example gradient sum"  # what it releases, in words


class Correlation(NamedTuple):
    """Declares a release whose noise has memory: the noise it adds at step t is
    ``(C^-1 z)_t``, z the steps' fresh N(0, noise_stddev^2) draws and C a fixed lower-triangular
    matrix with ``bands`` bands whose every column has L2 norm <= 1 (banded matrix
    factorization). Its privacy then rests on the sampler: with ``bands`` > 1 it holds only for
    a sampler named in ``samplers`` whose ``min_separation`` equals ``bands`` (cyclic Poisson
    over b parts: Choquette-Choo et al. 2023 prove the mechanism then costs what DP-SGD's
    independent noise costs at the part's rate over ceil(steps / b) participations), and the
    compiler refuses any other sampler. One band is independent noise: any sampler.

    bands: b, the noise buffer's length plus one.
    samplers: the sampler names (``sampler.name``) the equivalence is proven for.
    equivalence: that proof in words, for the privacy statement.

    The stage's ``Hooks.correlate`` is the filter z -> C^-1 z, one step at a time; dpbench
    check recovers C from it (unit impulses) and refuses a stage whose C has more bands or a
    column of norm > 1.
    """

    bands: int
    samplers: frozenset = frozenset({"cyclic_poisson"})
    equivalence: str = ""


class Privacy(NamedTuple):
    """A stage's privacy declaration: what the compiler validates and accounts, stated once.

    l2_bound: for a clip stage (PER_EXAMPLE -> BOUNDED): every output part has L2 norm <= it.
    parts: for a clip stage, how many separately bounded parts its output has, each of L2 norm
      <= l2_bound and released with the same sigma (GEP: embedding + residual = 2); a step then
      costs one Gaussian with multiplier sigma / sqrt(parts).
    lipschitz: for a BOUNDED -> BOUNDED or AGGREGATE -> AGGREGATE stage: its L2 Lipschitz
      factor (a public mask is 1). ``None`` means unknown, which the compiler rejects.
    cost: for an AGGREGATE -> AGGREGATE stage (it sees the private sum before the release):
      ``cost(facts) -> dp_accounting.DpEvent``, its privacy cost per step;
      ``dp_accounting.NoOpDpEvent()`` states that its output ignores the private values
      (random-k), which then adds no ledger line.
    one_off_release: a :class:`OneOffRelease` when the stage's initial state needs one
      accounted release of private data before training (DP-SNIP).
    public_mask: where the compiler applies the stage's public ``state["mask"]``
      (:class:`Mask` members).
    correlation: for a release whose noise has memory, its :class:`Correlation` (the bands
      and the samplers its privacy is proven for).

    A stage is a release (Gaussian noise of stddev ``ctx.noise_stddev``) exactly when it maps
    AGGREGATE to RELEASED: that kind change is its declaration.
    """

    l2_bound: Optional[float] = None
    parts: int = 1
    lipschitz: Optional[float] = None
    cost: Optional[Callable] = None
    one_off_release: Optional[OneOffRelease] = None
    public_mask: frozenset = frozenset()
    correlation: Optional[Correlation] = None


def _no_state(params, key):  # noqa: ARG001
    return ()


class Hooks(NamedTuple):
    """A stage's optional step functions; the compiler calls each where its doc says.

    begin_step: ``begin_step(state, ctx) -> state``, once per step before the batch, from public
      inputs only (params, public data, the step key): GEP's basis, DP-SSGD's drop mask.
    after_release: ``after_release(released, state, ctx) -> released`` for a stage before the
      release: public post-processing with its own public state (GEP's reconstruction). Public
      masks need none: the compiler applies them (``Privacy.public_mask``).
    finish_sum: ``finish_sum(total, state) -> total`` for a per-example stage: a PUBLIC LINEAR
      map the compiler applies to the masked sum of the per-example values, before anything
      else sees it (GEP forms its residual sum from sum c g and sum c w). By linearity the
      sum of the finished per-example values is the finished sum, so a clip stage's bound may
      be stated for ``finish_sum`` of each example's value (checked by the contract test).
    host_inputs: ``host_inputs(step, rng) -> pytree of numpy arrays``: public randomness drawn
      on the host, exactly (GIP's Mallows draws: float32 on the device cannot sample them to
      the precision their privacy claim needs). ``rng`` is a numpy Generator seeded by (run host
      seed, stage, step); the result reaches ``apply`` as ``ctx.host_inputs``; it never sees data.
    layer_clip: for a clip stage right after grad.per_example, the same sum in book-keeping form:
      ``layer_clip(state) -> clip`` once per step, then per micro-batch
      ``clip(grads, keep) -> (total, finite)`` with ``grads`` from the run fact ``layer_grads``:
      ``total`` is the sum over the examples with ``keep`` of what ``apply`` returns for them
      (before ``finish_sum``), ``finite`` per example whether its value is finite; an example
      without keep or finite contributes exactly zero. The compiler uses it when the run has
      ``layer_grads`` and the gradient has no augmentation (GEP's embedding and clips as
      contractions: tests/stages/test_gep.py checks the same release both ways).
    elementwise: for a per-example stage whose ``apply`` is one scalar function applied to every
      coordinate, reading no position, state or key (Nasr's ternary): that scalar function
      (jnp arrays in and out, elementwise). The compiler may then apply it to a gradient whose
      leaves are laid out differently (book-keeping's outputs-first kernels), since such a map
      commutes with any reordering of the coordinates (compiler/check.py tests it equals ``apply``).
    correlate: for a release that declares a :class:`Correlation`: ``correlate(fresh, state)
      -> (noise, state)``, the linear filter from the step's fresh Gaussian draw (a tree shaped
      like the released value) to the noise the release adds, its state the memory of earlier
      steps' noise (never a private value). ``apply`` adds exactly ``correlate`` of
      ``ops.gaussian_noise(value, ctx.key, ctx.noise_stddev)``.
    """

    begin_step: Optional[Callable] = None
    after_release: Optional[Callable] = None
    finish_sum: Optional[Callable] = None
    host_inputs: Optional[Callable] = None
    layer_clip: Optional[Callable] = None
    elementwise: Optional[Callable] = None
    correlate: Optional[Callable] = None


class StageFns(NamedTuple):
    """A stage's pure step functions, made by ``Stage.make(facts)``.

    apply: ``apply(value, state, ctx) -> (value, state)``, one shape for every stage. A batch
      stage returns its new state. A per-example stage (the compiler vmaps it) reads its state
      only and returns it as given; the gradient stage (EXAMPLE -> PER_EXAMPLE), which has no
      state, returns its per-example record in that place: ``{"loss": ...}``.
    init: ``init(params, key) -> state``; the state is public (never private data).
    hooks: the optional step functions (:class:`Hooks`).
    derived: public facts ``make`` derived from the run facts (GIP's per-step index epsilon,
      GEP's basis split), recorded next to the stage's options in the run record and the
      privacy statement.
    """

    apply: Callable
    init: Callable = _no_state
    hooks: Hooks = Hooks()
    derived: Mapping = MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class Stage:
    """One step of a pipeline: its privacy declaration (validated by the compiler) and ``make``.

    Attributes:
      name: the registered name (``clip.global_l2``); errors name stages by it.
      kind_in / kind_out: the kinds this stage consumes and produces.
      make: ``make(facts) -> StageFns``, called once by the compiler with the run facts the
        stage names in ``needs`` (reading any other is an error that names it).
      privacy: the stage's :class:`Privacy` declaration.
      needs: the names of the run facts ``make`` and ``privacy.cost`` read (the compiler's
        record of run facts, compiler/facts.py, lists them); the compiler refuses a pipeline
        whose run lacks one, saying what to set.
      options: the factory's arguments (and facts for the privacy statement), recorded.
    """

    name: str
    kind_in: Kind
    kind_out: Kind
    make: Callable[[Any], StageFns]
    privacy: Privacy = Privacy()
    needs: frozenset = frozenset()
    options: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.needs, str):
            raise TypeError(f"stage {self.name!r}: needs is a set of run fact names, e.g. "
                            f"{{{self.needs!r}}}, not a string")
        object.__setattr__(self, "needs", frozenset(self.needs))
        if isinstance(self.privacy, Privacy):  # a set literal is fine to write; kept frozen
            object.__setattr__(self, "privacy", self.privacy._replace(
                public_mask=frozenset(self.privacy.public_mask)))

    @property
    def per_example(self) -> bool:
        return self.kind_in in (Kind.EXAMPLE, Kind.PER_EXAMPLE, Kind.BOUNDED)

    @property
    def is_release(self) -> bool:
        """A release is the stage that maps the private aggregate to released values."""
        return (self.kind_in, self.kind_out) == (Kind.AGGREGATE, Kind.RELEASED)


# The stage contract's version (CHANGELOG.md says what each changed). Version 2 (dpbench 0.2)
# moved a stage's privacy facts from Stage's own keywords into one Privacy record; a stage
# written in version 1's spelling is refused naming where each keyword went.
CONTRACT_VERSION = 2
_MOVED_IN_VERSION_2 = {
    **{name: f"privacy=Privacy({name}=...)"
       for name in ("l2_bound", "parts", "lipschitz", "cost", "one_off_release", "public_mask")},
    "is_release": "nothing: a stage is a release exactly when it maps Kind.AGGREGATE to "
                  "Kind.RELEASED",
    "reads_private": "privacy=Privacy(cost=lambda facts: dp_accounting.NoOpDpEvent()) for a "
                     "stage whose output ignores the private values",
    "elementwise": "make(facts) returning StageFns(apply, hooks=Hooks(elementwise=f))",
}


class StageContractError(ValueError):
    """A stage written against an earlier version of the stage contract."""


def _refuse_moved_keywords(init: Callable) -> Callable:
    def checked_init(self, *args, **kwargs):
        moved = [name for name in _MOVED_IN_VERSION_2 if name in kwargs]
        if moved:
            name = kwargs.get("name", args[0] if args else "?")
            raise StageContractError(
                f"Stage {name!r} is written in the stage contract's version 1: " + "; ".join(
                    f"{m}= moved to {_MOVED_IN_VERSION_2[m]}" for m in moved) +
                f" (contract version {CONTRACT_VERSION}, dpbench 0.2; CHANGELOG.md)")
        init(self, *args, **kwargs)

    checked_init.__signature__ = inspect.signature(init)
    checked_init.__doc__ = init.__doc__
    return checked_init


Stage.__init__ = _refuse_moved_keywords(Stage.__init__)


def stateless(apply: Callable) -> Callable[[Any], StageFns]:
    """``make`` for a stage with no state and no run facts: just its ``apply``."""
    return lambda facts: StageFns(apply=apply)


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
            old = inspect.unwrap(_REGISTERED[name])
            if (old.__module__, old.__qualname__) != (factory.__module__, factory.__qualname__):
                raise ValueError(f"stage {name!r} is registered twice: by {old.__module__}."
                                 f"{old.__qualname__} and {factory.__module__}."
                                 f"{factory.__qualname__}; rename one")
            # the same function again: its module was re-imported (importlib.reload in a
            # notebook). gin has no public unregister; its registry's pop is the one reach in.
            gin.config._REGISTRY.pop(name)  # noqa: SLF001
        # A parse leaves gin's configuration locked, and a module re-imported after a run
        # (importlib.reload in a notebook) registers again: adding a configurable changes no
        # binding of the parsed configuration, so it is done with the lock lifted.
        with gin.unlock_config():
            configurable = gin.configurable(fn_name, module=module)(factory)
        _REGISTERED[name] = configurable
        return configurable

    return decorator


def registered_stage_names() -> list[str]:
    return sorted(_REGISTERED)


def registered_stage(name: str) -> Callable:
    """The gin-configurable factory registered under ``name``."""
    return _REGISTERED[name]
