"""Stage declarations verified, not trusted: ``dpbench check``, and what ``dpbench train`` and
``dpbench sweep`` run before any private training on every stage that is not dpbench's own.

A stage's privacy declaration (its kinds, clip bound, Lipschitz factor, cost, masks) is what the
compiler derives the sensitivity and the accounting from; a stage that lies about it trains and
states a guarantee it does not have. So each stage, configured as the pipeline binds it, is
placed in the smallest pipeline its kinds allow, compiled by the one compiler on a small public
synthetic problem (logistic regression on 8x8 random images), and must pass:

1. ``jit``: the step jits, trains to a finite loss and does not recompile across steps;
2. ``bound``: one added example with a huge input (scaled 1e3 and 1e6, its least likely label)
   moves the noise-free clipped sum by at most the clip bound (per part, times the Lipschitz
   factors of the bounded stages); an aggregate transform moves its output by at most its
   declared Lipschitz factor times the change of its input;
3. ``state``: from the same state and keys, two different private batches leave its state
   identical, unless it is an accounted mechanism (a one-off release, or a cost other than
   ``NoOpDpEvent``, which claims the output ignores the private values) or reads only released
   values;
4. ``mask``: a declared ``Mask.PER_EXAMPLE`` (its per-example apply IS its public mask, so
   book-keeping may skip materializing it) gives the same clipped sum compiled either way;
5. ``elementwise``: a stage's declared scalar map (``Hooks.elementwise``), applied to a
   reordered gradient, gives the same reordering of what its ``apply`` gives, whatever the key;
6. ``layer_clip``: a clip's book-keeping form (``Hooks.layer_clip``) gives the clipped sum
   its per-example apply gives, a non-finite example included;
7. ``correlation``: a release with correlated noise has the strategy it declares (lower
   triangular, its bands, columns of norm <= 1) and adds its own filter of the step's draw
   (``check_correlation.py``); it is compiled on the sampler it declares.

Inputs are public synthetic data: checking reads nothing private and spends no privacy.
tests/test_stage_contract.py runs the same checks on every registered stage, and on broken
twins that must fail them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from dp_accounting import dp_event

from dpbench import accounting, models, sampling, stages
from dpbench.compiler import check_correlation
from dpbench.compiler.facts import RunInputs
from dpbench.compiler.pipeline import compile_pipeline
from dpbench.compiler.rules import sampler_parts
from dpbench.models import losses
from dpbench.stages.base import Kind as K
from dpbench.compiler.sources import stage_sources

SHAPE, CLASSES, N, BATCH, MICRO = (8, 8, 1), 4, 32, 8, 8
CHECKS = ("jit", "bound", "state", "mask", "layer_clip", "elementwise", "correlation")
TEMPLATES = {  # (kind_in, kind_out) -> the pipeline around the stage X
    (K.EXAMPLE, K.PER_EXAMPLE): "X clip noise opt",
    (K.PER_EXAMPLE, K.PER_EXAMPLE): "grad X clip noise opt",
    (K.PER_EXAMPLE, K.BOUNDED): "grad X noise opt",
    (K.BOUNDED, K.BOUNDED): "grad clip X noise opt",
    (K.AGGREGATE, K.AGGREGATE): "grad clip X noise opt",
    (K.AGGREGATE, K.RELEASED): "grad clip X opt",
    (K.RELEASED, K.RELEASED): "grad clip noise X opt",
    (K.RELEASED, K.UPDATES): "grad clip noise X",
}


class StageCheckError(ValueError):
    """A stage whose declaration does not hold (or cannot be checked); names stage and check."""

    def __init__(self, stage: str, check: str, detail: str):
        super().__init__(f"stage {stage!r} fails the {check!r} check: {detail}; it is refused "
                         "before any private training (dpbench check explains each check)")
        self.stage, self.check = stage, check


@dataclasses.dataclass
class Harness:
    """One stage compiled in its smallest pipeline, with synthetic data and an initial state."""
    stage: stages.Stage
    index: int
    compiled: object
    model: object
    images: np.ndarray
    labels: np.ndarray
    state: object

    def batch(self, images, labels, mask=None, step=0):
        b = self.compiled.sampler.sample(0 if step is None else step)
        return self.compiled.host_batch(images[b.indices], labels[b.indices],
                                        b.mask if mask is None else mask, step)


def smallest_pipeline(stage: stages.Stage) -> list:
    parts = dict(grad=stages.grad.per_example, clip=lambda: stages.clip.global_l2(1.0),
                 noise=stages.noise.gaussian,
                 opt=lambda: stages.optimize.optax_optimizer(optimizer="sgd", learning_rate=1.0))
    template = TEMPLATES.get((stage.kind_in, stage.kind_out))
    if template is None:
        raise StageCheckError(stage.name, "jit", f"no pipeline takes kinds {stage.kind_in} -> "
                              f"{stage.kind_out}")
    return [stage if p == "X" else parts[p]() for p in template.split()]


def compile_small(stage_list, with_model: bool = True):
    """The pipeline compiled on logistic regression (its own linearized twin, for SynFlow);
    with the model the compiler picks its per-example strategy, without it materializes."""
    model = models.make_model(CLASSES, name="logistic")
    parts = sampler_parts(stage_list)  # a correlated release's own sampler (p = 1 at 4 parts)
    sampler = (sampling.PoissonSampler(N, BATCH, seed=0, pad_multiple=MICRO) if parts == 1 else
               sampling.CyclicPoissonSampler(N, BATCH, seed=0, parts=parts, pad_multiple=MICRO))
    public = np.random.default_rng(1).uniform(size=(512,) + SHAPE).astype(np.float32)
    inputs = RunInputs(
        loss_fn=losses.cross_entropy_loss(model),
        init_params=lambda key: model.init(key, jnp.zeros((1,) + SHAPE)), example_shape=SHAPE,
        # PLD: at this harness's q = 0.25 dp_accounting's RDP logs ~60 warnings about its
        # fractional orders for every checked stage (and PLD calibrates faster here)
        sampler=sampler, budget=accounting.Budget(epsilon=3.0, delta=1e-5, accountant="pld"),
        total_steps=10, steps_per_epoch=4, public_images=public, num_classes=CLASSES,
        linear_apply=model.apply, model=model if with_model else None)
    compiled = compile_pipeline(stage_list, inputs, micro_batch_size=MICRO)
    return compiled, model


def synthetic_data(seed):
    rng = np.random.default_rng(seed)
    return (rng.uniform(size=(N,) + SHAPE).astype(np.float32),
            rng.integers(0, CLASSES, N).astype(np.int32))


def harness_for(stage: stages.Stage) -> Harness:
    stage_list = smallest_pipeline(stage)
    compiled, model = compile_small(stage_list)
    images, labels = synthetic_data(0)
    params = model.init(jax.random.key(0), jnp.zeros((1,) + SHAPE))
    h = Harness(stage, stage_list.index(stage), compiled, model, images, labels, None)
    release = h.batch(images, labels, step=None) if compiled.needs_release_batch else None
    h.state = compiled.init_state(params, jax.random.key(1), release)
    return h


def _host(tree):
    """Host arrays (key data for PRNG keys), for exact comparisons."""
    return jax.tree.map(lambda v: np.asarray(jax.random.key_data(v) if jax.dtypes.issubdtype(
        v.dtype, jax.dtypes.prng_key) else v), tree)


def _norm(tree):
    return float(optax.tree.norm(tree))


def _copy(state):
    return jax.tree.map(lambda v: jnp.array(v, copy=True), state)  # the step donates its input


def check_jit(h: Harness) -> None:
    state = _copy(h.state)
    for step in range(3):
        state, metrics = h.compiled.step(state, h.batch(h.images, h.labels, step=step))
    if not np.isfinite(float(metrics["train_loss"])):
        raise StageCheckError(h.stage.name, "jit", "the training loss is not finite")
    if h.compiled.step._cache_size() != 1:
        raise StageCheckError(h.stage.name, "jit", "the step recompiles across steps")


def _bounded_sum_bound(compiled) -> float:
    """The clip bound times the Lipschitz factors of the BOUNDED stages after the clip."""
    plan = compiled.plan
    bound = plan.stages[plan.validated.clip_index].privacy.l2_bound
    for s in plan.stages[plan.validated.clip_index + 1:plan.num_per_example]:
        bound *= s.privacy.lipschitz
    return bound


def _which_declaration_lies(h: Harness, moved: float, declared: float) -> str:
    """Name the declaration that the measured move contradicts, and the least honest value."""
    said = (f"one example moved the clipped sum by {moved:.4g}, more than the declared bound "
            f"{declared:.4g}")
    declared_privacy = h.stage.privacy
    if h.stage.kind_in == K.BOUNDED and declared_privacy.lipschitz is not None:
        honest = declared_privacy.lipschitz * moved / declared
        return (f"{said}, so its declared Lipschitz factor {declared_privacy.lipschitz:g} is too "
                "small: "
                f"declare lipschitz >= {honest:.4g} or make the stage contract by the factor it "
                "declares")
    if h.stage.kind_out == K.BOUNDED and declared_privacy.l2_bound is not None:
        return (f"{said}, so it clips to more than its declared l2_bound "
                f"{declared_privacy.l2_bound:g}: "
                "clip to the bound it declares, or declare the bound it clips to")
    return f"{said}: the stage changes what the clip bounds"


def check_bound(h: Harness) -> None:
    rng = np.random.default_rng()
    clipped_sum = jax.jit(lambda state, batch: h.compiled.lowered.clipped_sum(state, batch)[0])
    plan = h.compiled.plan
    bound = _bounded_sum_bound(h.compiled)
    parts = plan.stages[plan.validated.clip_index].privacy.parts
    first = h.compiled.sampler.sample(0).indices[0]
    for scale in (1e3, 1e6):
        huge, huge_labels = h.images.copy(), h.labels.copy()
        huge[first] = scale * rng.normal(size=SHAPE)  # the adversarial example, with its least
        huge_labels[first] = int(jnp.argmin(h.model.apply(  # likely label: a large gradient
            h.state.params, jnp.asarray(huge[first])[None])[0]))
        mask = h.compiled.sampler.sample(0).mask
        without = mask.copy()  # its neighbour: without it (a copy: a batch may alias its mask)
        without[0] = False
        diff = jax.tree.map(jnp.subtract,
                            clipped_sum(h.state, h.batch(huge, huge_labels, mask.copy())),
                            clipped_sum(h.state, h.batch(huge, huge_labels, without)))
        moved = [_norm(p) for p in diff.values()] if parts > 1 else []
        if any(m > bound * (1 + 1e-4) for m in moved) or _norm(diff) > np.sqrt(
                parts) * bound * (1 + 1e-4):
            raise StageCheckError(h.stage.name, "bound", _which_declaration_lies(
                h, _norm(diff), np.sqrt(parts) * bound))
    lipschitz = h.stage.privacy.lipschitz
    if h.stage.kind_in == K.AGGREGATE and lipschitz is not None:
        ctx = stages.StepContext(params=h.state.params, step=jnp.asarray(0),
                                 key=jax.random.key(2),
                                 host_inputs=h.compiled.stage_inputs(0).get(str(h.index)))
        fns, own = h.compiled.plan.fns[h.index], h.state.stage_states[h.index]
        x, y = (jax.tree.map(lambda p: jnp.asarray(1e3 * rng.normal(size=p.shape), p.dtype),
                             h.state.params) for _ in range(2))
        out = jax.tree.map(jnp.subtract, fns.apply(x, own, ctx)[0], fns.apply(y, own, ctx)[0])
        ratio = _norm(out) / _norm(jax.tree.map(jnp.subtract, x, y))
        if ratio > lipschitz * (1 + 1e-5):
            raise StageCheckError(h.stage.name, "bound", (
                f"it stretched a difference {ratio:.4g}x, more than its declared Lipschitz "
                f"factor {lipschitz:g}"))


def _accounted(h: Harness) -> bool:
    """The stage is itself an accounted mechanism: a one-off release, or a cost other than
    NoOpDpEvent (which claims its output ignores the private values: checked, not trusted)."""
    privacy = h.stage.privacy
    if privacy.one_off_release is not None:
        return True
    return privacy.cost is not None and not isinstance(
        privacy.cost(h.compiled.plan.run_facts.for_stage(h.stage)), dp_event.NoOpDpEvent)


def check_state(h: Harness) -> None:
    stage = h.stage
    if _accounted(h) or stage.kind_in in (K.RELEASED, K.UPDATES):
        return
    after = [h.compiled.step(_copy(h.state), h.batch(x, y))[0].stage_states[h.index]
             for x, y in ((h.images, h.labels), synthetic_data(1))]
    same = jax.tree.map(lambda u, v: bool(np.array_equal(u, v)), *map(_host, after))
    if not all(jax.tree.leaves(same)):
        raise StageCheckError(stage.name, "state", "its state depends on private data (two "
                              "different batches left different states) and it declares no "
                              "cost for it")


def _strategies_agree(h: Harness, images) -> bool:
    """The clipped sum compiled with the model (book-keeping) equals the one compiled without
    it (materialized), on ``images``, both from the same begin_step states: a state computed two
    ways (GEP's basis, where the anchor gradients are rank-deficient) may differ in directions
    that carry no signal."""
    from dpbench.compiler import per_example
    from dpbench.compiler.lower import begin_step_fn

    slow, _ = compile_small(smallest_pipeline(h.stage), with_model=False)
    batch = h.batch(images, h.labels)
    key = jax.random.key(7)
    states = jax.jit(begin_step_fn(h.compiled.plan))(h.state, key)

    def clipped_sum(plan):
        fn = per_example.clipped_sum_fn(plan)
        return jax.jit(lambda b: fn(h.state.params, states, h.state.step, key, b)[0])(batch)

    fast_sum, slow_sum = clipped_sum(h.compiled.plan), clipped_sum(slow.plan)
    return (h.compiled.plan.strategy == "bookkeeping" and slow.plan.strategy == "materialized"
            and _norm(jax.tree.map(jnp.subtract, fast_sum, slow_sum))
            <= 1e-5 * (1 + _norm(slow_sum)))


def check_mask_declaration(h: Harness) -> bool:
    if stages.Mask.PER_EXAMPLE not in h.stage.privacy.public_mask:
        return False
    if not _strategies_agree(h, h.images):
        raise StageCheckError(h.stage.name, "mask", "it is not its declared per-example mask "
                              "(the clipped sum differs from the one that applies it)")
    return True


def check_layer_clip(h: Harness) -> bool:
    """A clip stage's book-keeping form (Hooks.layer_clip) gives the clipped sum its
    per-example apply gives (what the compiler relies on when it runs the layer form)."""
    if h.compiled.plan.fns[h.index].hooks.layer_clip is None:
        return False
    images, sample = h.images.copy(), h.compiled.sampler.sample(0)
    images[sample.indices[np.argmax(sample.mask)]] = np.nan  # non-finite: both leave it out
    if not _strategies_agree(h, images):
        raise StageCheckError(h.stage.name, "layer_clip", "its book-keeping form (layer_clip) "
                              "does not give the clipped sum its per-example apply gives")
    return True


def check_elementwise_declaration(h: Harness) -> bool:
    """The declared scalar map on the reversed, flattened g == the reversed, flattened apply(g)
    (any key): what book-keeping relies on when it maps outputs-first kernels with it."""
    fns, own = h.compiled.plan.fns[h.index], h.state.stage_states[h.index]
    scalar = fns.hooks.elementwise
    if scalar is None:
        return False
    rng = np.random.default_rng()
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 10.0 ** rng.uniform(
        -5, 1, size=p.shape), p.dtype), h.state.params)

    def apply(tree, seed):
        ctx = stages.StepContext(params=h.state.params, step=jnp.asarray(0),
                                 key=jax.random.key(seed))
        return jax.jit(lambda t: fns.apply(t, own, ctx)[0])(tree)

    want = apply(grads, 0)
    got = jax.jit(lambda t: jax.tree.map(scalar, t))(
        jax.tree.map(lambda g: g.reshape(-1)[::-1], grads))
    if any(not np.array_equal(g, w.reshape(-1)[::-1])
           for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got))) or not any(
            float(jnp.abs(w).sum()) > 0 for w in jax.tree.leaves(want)):
        raise StageCheckError(h.stage.name, "elementwise", "its declared elementwise map is "
                              "not what its apply does on every coordinate (apply depends on "
                              "positions or keys, or the map differs)")
    return True


def check_correlation_declaration(h: Harness) -> bool:
    correlation = h.stage.privacy.correlation
    if correlation is None:
        return False
    fns, own = h.compiled.plan.fns[h.index], h.state.stage_states[h.index]
    found = check_correlation.problems(check_correlation.strategy_of(
        fns.hooks.correlate, own, h.state.params, h.compiled.total_steps), correlation.bands)
    if not check_correlation.adds_its_filter(fns, own, h.state.params, 1.0):
        found.append("its apply does not add its own filter (Hooks.correlate) of the step's "
                     "fresh draw ops.gaussian_noise(value, ctx.key, ctx.noise_stddev)")
    if found:
        raise StageCheckError(h.stage.name, "correlation", "; ".join(found))
    return True


def verify_stage(stage: stages.Stage) -> list:
    """Runs every check on ``stage``; returns the checks that applied (each raises
    StageCheckError on failure, naming the stage and the check)."""
    try:
        h = harness_for(stage)
    except StageCheckError:
        raise
    except Exception as e:  # noqa: BLE001 (any failure to build is a failure to verify)
        raise StageCheckError(stage.name, "jit", f"it does not compile in its smallest "
                              f"pipeline on a small logistic model ({type(e).__name__}: {e})")
    check_jit(h)
    check_bound(h)
    check_state(h)
    return ["jit", "bound", "state"] + [name for name, ran in (
        ("mask", check_mask_declaration(h)), ("layer_clip", check_layer_clip(h)),
        ("elementwise", check_elementwise_declaration(h)),
        ("correlation", check_correlation_declaration(h))) if ran]


def unverified_stages(stage_list) -> list:
    """The stages of a pipeline not defined by dpbench (their declarations are verified before
    training; dpbench's own are verified by its tests)."""
    foreign = {s["stage"] for s in stage_sources([s.name for s in stage_list])}
    return [s for s in stage_list if s.name in foreign]


def verify_pipeline(stage_list) -> dict:
    """stage name -> the checks it passed, for every stage that is not dpbench's own; raises
    StageCheckError at the first that fails."""
    return {s.name: verify_stage(s) for s in unverified_stages(stage_list)}
