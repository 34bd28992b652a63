"""The stage contract, checked for EVERY registered stage (a new one is covered with no edit here).

Each stage, built with its factory's defaults, is placed in the smallest pipeline its kinds
allow and compiled by the one compiler on a small model. Then:
1. the step jits and does not recompile across steps;
2. the declared bound holds against adversarial neighbours: adding one example with a huge
   input moves the noise-free clipped sum by at most the clip bound (per part, times the
   Lipschitz factors of the bounded stages), and an aggregate transform moves its output by at
   most its Lipschitz factor times the change of its input;
3. its state holds no private data: from the same state and keys, two different private
   batches leave the state identical, unless the stage is itself an accounted mechanism (a
   cost or a one-off release) or reads only released values (after the release). (A stage's
   initial state cannot read data at all: ``init`` gets only params and a key; the one-off
   release is the compiler's, accounted.)
4. a stage that declares ``Mask.PER_EXAMPLE`` (its per-example apply is its public mask, so the
   compiler may clip by book-keeping without materializing it) gives the same clipped sum
   compiled either way.
5. a stage that declares ``elementwise`` (so book-keeping may hand it reordered coordinates)
   maps a reordered, reshaped gradient to the same reordering of its output, whatever its key.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dpbench import accounting, compiler, models, sampling, stages
from dpbench.stages.base import Kind, registered_stage, registered_stage_names
from tests.conftest import make_batch

SHAPE, CLASSES, N, BATCH, MICRO = (8, 8, 1), 4, 32, 8, 8
K = Kind
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


def _pipeline(stage):
    parts = dict(grad=stages.grad.per_example, clip=lambda: stages.clip.global_l2(1.0),
                 noise=stages.noise.gaussian,
                 opt=lambda: stages.optimize.optax_optimizer(optimizer="sgd", learning_rate=1.0))
    return [stage if p == "X" else parts[p]()
            for p in TEMPLATES[(stage.kind_in, stage.kind_out)].split()]


def _compile(stage_list, with_model=True):
    model = models.make_model(CLASSES, name="logistic")  # small: compile time dominates
    twin = model  # logistic regression is its own linearized twin (SynFlow)
    sampler = sampling.PoissonSampler(N, BATCH, seed=0, pad_multiple=MICRO)
    public = np.random.default_rng(1).uniform(size=(512,) + SHAPE).astype(np.float32)
    compiled = compiler.compile_pipeline(
        stage_list, loss_fn=models.cross_entropy_loss(model),
        init_params=lambda key: model.init(key, jnp.zeros((1,) + SHAPE)), example_shape=SHAPE,
        sampler=sampler, budget=accounting.Budget(epsilon=3.0, delta=1e-5, accountant="rdp"),
        total_steps=10,
        steps_per_epoch=4, micro_batch_size=MICRO, public_images=public, num_classes=CLASSES,
        linear_apply=twin.apply,
        model=model if with_model else None)  # with it the compiler picks its strategy
    return compiled, model


def _data(seed):
    rng = np.random.default_rng(seed)
    return (rng.uniform(size=(N,) + SHAPE).astype(np.float32),
            rng.integers(0, CLASSES, N).astype(np.int32))


def _initial_state(compiled, model, images, labels):
    params = model.init(jax.random.key(0), jnp.zeros((1,) + SHAPE))
    release = None
    if compiled.needs_release_batch:
        b = compiled.sampler.sample(sampling.PRE_TRAINING_STEP)
        release = make_batch(compiled, images, labels, b.indices, b.mask, step=None)
    return compiled.init_state(params, jax.random.key(1), release)


def _host(tree):
    """Host arrays (key data for PRNG keys), for exact comparisons."""
    return jax.tree.map(lambda v: np.asarray(jax.random.key_data(v) if jax.dtypes.issubdtype(
        v.dtype, jax.dtypes.prng_key) else v), tree)


def _norm(tree):
    return float(optax.tree.norm(tree))


def _contract_for(stage):
    stage_list = _pipeline(stage)
    compiled, model = _compile(stage_list)
    images, labels = _data(0)
    state = _initial_state(compiled, model, images, labels)
    return stage, stage_list.index(stage), compiled, model, images, labels, state


@pytest.fixture(scope="module", params=registered_stage_names())
def contract(request):
    stage = registered_stage(request.param)()
    assert stage.name == request.param, "a factory's Stage must carry its registered name"
    return _contract_for(stage)


def _copy(state):
    return jax.tree.map(lambda v: jnp.array(v, copy=True), state)  # the step donates its input


def test_it_jits_and_does_not_recompile(contract):
    check_jit(contract)


def test_declared_bound_holds_against_adversarial_neighbours(contract):
    check_bound(contract)


def test_its_state_holds_no_private_data(contract):
    check_state(contract)


def test_a_declared_per_example_mask_is_what_the_stage_does(contract):
    check_mask_declaration(contract)


def test_a_declared_elementwise_stage_ignores_positions(contract):
    check_elementwise_declaration(contract)


def check_jit(contract):
    _, _, compiled, _, images, labels, state = contract
    state = _copy(state)
    for step in range(3):
        b = compiled.sampler.sample(step)
        state, metrics = compiled.step(state, make_batch(compiled, images, labels, b.indices,
                                                         b.mask, step))
    assert np.isfinite(float(metrics["train_loss"]))
    assert compiled.step._cache_size() == 1


def _bounded_sum_bound(compiled) -> float:
    """The clip bound times the Lipschitz factors of the BOUNDED stages after the clip (the
    stages inside the clipped sum)."""
    plan = compiled.plan
    bound = plan.stages[plan.validated.clip_index].l2_bound
    for s in plan.stages[plan.validated.clip_index + 1:plan.num_per_example]:
        bound *= s.lipschitz
    return bound


def check_bound(contract):
    stage, index, compiled, model, images, labels, state = contract
    rng = np.random.default_rng()
    clipped_sum = jax.jit(compiled.lowered.clipped_sum)
    bound, parts = _bounded_sum_bound(compiled), compiled.plan.stages[
        compiler.validate_pipeline(compiled.stages).clip_index].parts
    for scale in (1e3, 1e6):
        b = compiled.sampler.sample(0)
        huge, huge_labels = images.copy(), labels.copy()
        huge[b.indices[0]] = scale * rng.normal(size=SHAPE)  # the adversarial example, with
        huge_labels[b.indices[0]] = int(jnp.argmin(model.apply(  # its least likely label: a
            state.params, jnp.asarray(huge[b.indices[0]])[None])[0]))  # large gradient
        with_it = make_batch(compiled, huge, huge_labels, b.indices, b.mask)
        mask = b.mask.copy()
        mask[0] = False                                          # its neighbour: without it
        without = make_batch(compiled, huge, huge_labels, b.indices, mask)
        diff = jax.tree.map(jnp.subtract, clipped_sum(state, with_it),
                            clipped_sum(state, without))
        if parts > 1:
            for part in diff.values():
                assert _norm(part) <= bound * (1 + 1e-4)
        assert _norm(diff) <= np.sqrt(parts) * bound * (1 + 1e-4)
    if stage.kind_in == K.AGGREGATE and stage.lipschitz is not None:
        params = state.params
        ctx = stages.StepContext(params=params, step=jnp.asarray(0), key=jax.random.key(2),
                                 host_inputs=compiled.stage_inputs(0).get(str(index)))
        fns = compiled.plan.fns[index]
        x, y = (jax.tree.map(lambda p: jnp.asarray(1e3 * rng.normal(size=p.shape), p.dtype),
                             params) for _ in range(2))
        fx, fy = fns.apply(x, state.stage_states[index], ctx)[0], fns.apply(
            y, state.stage_states[index], ctx)[0]
        assert _norm(jax.tree.map(jnp.subtract, fx, fy)) <= stage.lipschitz * _norm(
            jax.tree.map(jnp.subtract, x, y)) * (1 + 1e-5)


def check_state(contract):
    stage, index, compiled, model, images, labels, state = contract
    other_images, other_labels = _data(1)
    allowed = (stage.cost is not None or stage.one_off_release is not None
               or stage.kind_in in (K.RELEASED, K.UPDATES))
    b = compiled.sampler.sample(0)
    after = {}
    for name, (x, y) in {"a": (images, labels), "b": (other_images, other_labels)}.items():
        after[name] = compiled.step(_copy(state), make_batch(compiled, x, y, b.indices, b.mask, 0))[0]
    same = jax.tree.map(lambda u, v: bool(np.array_equal(u, v)),
                        _host(after["a"].stage_states[index]),
                        _host(after["b"].stage_states[index]))
    if not allowed:
        assert all(jax.tree.leaves(same)), f"{stage.name}'s state depends on private data"


def check_mask_declaration(contract):
    stage, _, compiled, _, images, labels, state = contract
    if stage_mask := (stages.Mask.PER_EXAMPLE in stage.public_mask):
        assert compiled.plan.strategy == "bookkeeping"
        slow, _ = _compile(_pipeline(stage), with_model=False)
        assert slow.plan.strategy == "materialized"
        b = compiled.sampler.sample(0)
        batch = make_batch(compiled, images, labels, b.indices, b.mask)
        fast_sum = jax.jit(compiled.lowered.clipped_sum)(state, batch)
        slow_sum = jax.jit(slow.lowered.clipped_sum)(state, batch)
        assert _norm(jax.tree.map(jnp.subtract, fast_sum, slow_sum)) <= 1e-5 * (
            1 + _norm(slow_sum)), f"{stage.name} is not its declared per-example mask"
    return stage_mask


def check_elementwise_declaration(contract):
    """apply(reversed, flattened g) == reversed, flattened apply(g), with another key: what
    book-keeping relies on when it hands the stage outputs-first kernels."""
    stage, index, compiled, _, _, _, state = contract
    if not stage.elementwise:
        return False
    rng = np.random.default_rng()
    fns = compiled.plan.fns[index]
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 10.0 ** rng.uniform(
        -5, 1, size=p.shape), p.dtype), state.params)

    def apply(tree, seed):
        ctx = stages.StepContext(params=state.params, step=jnp.asarray(0),
                                 key=jax.random.key(seed))
        return jax.jit(lambda t: fns.apply(t, state.stage_states[index], ctx))(tree)

    want = apply(grads, 0)
    got = apply(jax.tree.map(lambda g: g.reshape(-1)[::-1], grads), 1)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(g, w.reshape(-1)[::-1], err_msg=(
            f"{stage.name} declares elementwise but its output depends on positions or keys"))
    assert any(float(jnp.abs(w).sum()) > 0 for w in jax.tree.leaves(want))
    return True


def test_the_contract_catches_broken_stages():
    """A 'clip' that does not clip, and a stage that says it ignores private values but keeps
    a function of them in its state, both fail their check."""
    def no_clip(value, state, ctx):
        return value

    fake_clip = stages.Stage(name="broken.no_clip", kind_in=K.PER_EXAMPLE, kind_out=K.BOUNDED,
                             make=stages.base.stateless(no_clip), l2_bound=1.0)
    with pytest.raises(AssertionError):
        check_bound(_contract_for(fake_clip))

    def peek(value, state, ctx):
        return value, {"seen": jax.tree.map(jnp.sum, value)}

    def make(info):
        return stages.StageFns(apply=peek, init=lambda params, key: {
            "seen": jax.tree.map(lambda p: jnp.zeros((), p.dtype), params)})

    liar = stages.Stage(name="broken.peek", kind_in=K.AGGREGATE, kind_out=K.AGGREGATE,
                        make=make, lipschitz=1.0, reads_private=False)
    with pytest.raises(AssertionError, match="depends on private data"):
        check_state(_contract_for(liar))

    def flip(value, state, ctx):  # declares the per-example mask, applies something else
        return jax.tree.map(lambda v, m: -v * m, value, state["mask"])

    def make_flip(info):
        return stages.StageFns(apply=flip, init=lambda params, key: {
            "mask": jax.tree.map(jnp.ones_like, params)})

    not_its_mask = stages.Stage(name="broken.flip", kind_in=K.PER_EXAMPLE,
                                kind_out=K.PER_EXAMPLE, make=make_flip,
                                public_mask=frozenset({stages.Mask.PER_EXAMPLE}))
    with pytest.raises(AssertionError, match="not its declared per-example mask"):
        check_mask_declaration(_contract_for(not_its_mask))

    def ramp(value, state, ctx):  # declares elementwise, but scales by position
        return jax.tree.map(lambda v: v * jnp.arange(v.size, dtype=v.dtype).reshape(v.shape),
                            value)

    positional = stages.Stage(name="broken.ramp", kind_in=K.PER_EXAMPLE,
                              kind_out=K.PER_EXAMPLE, make=stages.base.stateless(ramp),
                              elementwise=True)
    with pytest.raises(AssertionError, match="declares elementwise"):
        check_elementwise_declaration(_contract_for(positional))

    def keyed(value, state, ctx):  # declares elementwise, but draws with its key
        return jax.tree.map(lambda v: v + jax.random.normal(ctx.key, ()), value)

    random = stages.Stage(name="broken.keyed", kind_in=K.PER_EXAMPLE, kind_out=K.PER_EXAMPLE,
                          make=stages.base.stateless(keyed), elementwise=True)
    with pytest.raises(AssertionError, match="declares elementwise"):
        check_elementwise_declaration(_contract_for(random))
