"""The stage contract (dpbench/compiler/check.py, what `dpbench check` and every run verify for a
stage that is not dpbench's own), checked for EVERY registered stage (a new one is covered with
no edit here), and on broken twins that must fail it.

Each stage, built with its factory's defaults, is placed in the smallest pipeline its kinds
allow and compiled by the one compiler on a small model. Then:
1. the step jits and does not recompile across steps;
2. the declared bound holds against adversarial neighbours: adding one example with a huge
   input moves the noise-free clipped sum by at most the clip bound (per part, times the
   Lipschitz factors of the bounded stages), and an aggregate transform moves its output by at
   most its Lipschitz factor times the change of its input;
3. its state holds no private data: from the same state and keys, two different private
   batches leave the state identical, unless the stage is itself an accounted mechanism (a
   one-off release, or a cost other than NoOpDpEvent: a stage claiming its output ignores the
   private values is checked) or reads only released values (after the release). (A stage's
   initial state cannot read data at all: ``init`` gets only params and a key; the one-off
   release is the compiler's, accounted.)
4. a stage that declares ``Mask.PER_EXAMPLE`` (its per-example apply is its public mask, so the
   compiler may clip by book-keeping without materializing it) gives the same clipped sum
   compiled either way.
5. a stage that declares a scalar map (``Hooks.elementwise``, which book-keeping applies to
   reordered coordinates) gives, on a reordered, reshaped gradient, the same reordering of what
   its ``apply`` gives, whatever the key.
"""

import dataclasses
import re

import dp_accounting
import jax
import jax.numpy as jnp
import pytest

from dpbench import stages
from dpbench.compiler.check import (StageCheckError, check_bound,
                                    check_elementwise_declaration, check_jit, check_layer_clip,
                                    check_mask_declaration, check_state, harness_for)
from dpbench.stages.base import Kind, registered_stage, registered_stage_names

K = Kind


def _costs_nothing(facts):
    return dp_accounting.NoOpDpEvent()


@pytest.fixture(scope="module", params=registered_stage_names())
def contract(request):
    stage = registered_stage(request.param)()
    assert stage.name == request.param, "a factory's Stage must carry its registered name"
    return harness_for(stage)


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


def test_a_clips_book_keeping_form_gives_its_per_example_sum(contract):
    check_layer_clip(contract)


def test_a_book_keeping_form_that_is_not_the_clip_is_caught():
    """GEP's layer form is checked (it applies: logistic regression is one matmul layer); a twin
    whose layer form sends 10x the residual part its per-example apply sends (a residual clip
    the per-example path has and the layer form lacks) fails."""
    import dataclasses

    honest = stages.gep.embed_and_clip(num_anchors=64, num_basis=8)
    assert check_layer_clip(harness_for(honest))

    def make(facts):
        fns = honest.make(facts)

        def layer_clip(state):
            clip = fns.hooks.layer_clip(state)

            def unclipped_residual(grads, keep):
                total, finite = clip(grads, keep)
                rv = jax.tree.map(lambda x: 10.0 * x, total["rv"])
                return dict(total, rv=rv), finite
            return unclipped_residual
        return fns._replace(hooks=fns.hooks._replace(layer_clip=layer_clip))

    twin = dataclasses.replace(honest, name="broken.gep_layer_form", make=make)
    with pytest.raises(StageCheckError, match="'layer_clip' check"):
        check_layer_clip(harness_for(twin))


def test_the_contract_catches_broken_stages():
    """A 'clip' that does not clip, and a stage that says it ignores private values but keeps
    a function of them in its state, both fail their check."""
    def no_clip(value, state, ctx):
        return value, state

    fake_clip = stages.Stage(name="broken.no_clip", kind_in=K.PER_EXAMPLE, kind_out=K.BOUNDED,
                             make=stages.base.stateless(no_clip),
                             privacy=stages.Privacy(l2_bound=1.0))
    with pytest.raises(StageCheckError, match="'bound' check"):
        check_bound(harness_for(fake_clip))

    def peek(value, state, ctx):
        return value, {"seen": jax.tree.map(jnp.sum, value)}

    def make(facts):
        return stages.StageFns(apply=peek, init=lambda params, key: {
            "seen": jax.tree.map(lambda p: jnp.zeros((), p.dtype), params)})

    liar = stages.Stage(name="broken.peek", kind_in=K.AGGREGATE, kind_out=K.AGGREGATE,
                        make=make, privacy=stages.Privacy(lipschitz=1.0, cost=_costs_nothing))
    with pytest.raises(StageCheckError, match="depends on private data"):
        check_state(harness_for(liar))

    def flip(value, state, ctx):  # declares the per-example mask, applies something else
        return jax.tree.map(lambda v, m: -v * m, value, state["mask"]), state

    def make_flip(facts):
        return stages.StageFns(apply=flip, init=lambda params, key: {
            "mask": jax.tree.map(jnp.ones_like, params)})

    not_its_mask = stages.Stage(name="broken.flip", kind_in=K.PER_EXAMPLE,
                                kind_out=K.PER_EXAMPLE, make=make_flip,
                                privacy=stages.Privacy(
                                    public_mask=frozenset({stages.Mask.PER_EXAMPLE})))
    with pytest.raises(StageCheckError, match="not its declared per-example mask"):
        check_mask_declaration(harness_for(not_its_mask))

    def declaring_identity(apply):  # declares the identity as its scalar map
        return lambda facts: stages.StageFns(apply=apply, hooks=stages.Hooks(
            elementwise=lambda x: x))

    def ramp(value, state, ctx):  # but scales by position
        return jax.tree.map(lambda v: v * jnp.arange(v.size, dtype=v.dtype).reshape(v.shape),
                            value), state

    positional = stages.Stage(name="broken.ramp", kind_in=K.PER_EXAMPLE,
                              kind_out=K.PER_EXAMPLE, make=declaring_identity(ramp))
    with pytest.raises(StageCheckError, match="declared elementwise map"):
        check_elementwise_declaration(harness_for(positional))

    def keyed(value, state, ctx):  # but draws with its key
        return jax.tree.map(lambda v: v + jax.random.normal(ctx.key, ()), value), state

    random = stages.Stage(name="broken.keyed", kind_in=K.PER_EXAMPLE, kind_out=K.PER_EXAMPLE,
                          make=declaring_identity(keyed))
    with pytest.raises(StageCheckError, match="declared elementwise map"):
        check_elementwise_declaration(harness_for(random))

    def doubled(value, state, ctx):  # elementwise, but not the map it declares
        return jax.tree.map(lambda v: 2.0 * v, value), state

    other = stages.Stage(name="broken.other_map", kind_in=K.PER_EXAMPLE,
                         kind_out=K.PER_EXAMPLE, make=declaring_identity(doubled))
    with pytest.raises(StageCheckError, match="declared elementwise map"):
        check_elementwise_declaration(harness_for(other))


def test_a_stage_that_lies_about_its_bound_or_its_lipschitz_factor_is_caught():
    """The two lies of a researcher's stage that would otherwise train and state a false
    epsilon: a clip that declares 0.1 but clips at 1.0, and an aggregate transform that
    declares Lipschitz 1 but multiplies by 5."""
    from dpbench import ops

    loose = stages.Stage(name="broken.loose_clip", kind_in=K.PER_EXAMPLE, kind_out=K.BOUNDED,
                         make=stages.base.stateless(lambda v, s, ctx: (ops.clip_to_l2(v, 1.0),
                                                                       s)),
                         privacy=stages.Privacy(l2_bound=0.1))
    with pytest.raises(StageCheckError, match="'broken.loose_clip' fails the 'bound' check") as e:
        check_bound(harness_for(loose))
    assert "declared l2_bound 0.1" in str(e.value)  # the message names the lie to fix
    assert "Lipschitz" not in str(e.value)
    honest = stages.Stage(name="fine.clip", kind_in=K.PER_EXAMPLE, kind_out=K.BOUNDED,
                          make=stages.base.stateless(lambda v, s, ctx: (ops.clip_to_l2(v, 0.1),
                                                                        s)),
                          privacy=stages.Privacy(l2_bound=0.1))
    check_bound(harness_for(honest))
    stretch = stages.Stage(name="broken.times5", kind_in=K.AGGREGATE, kind_out=K.AGGREGATE,
                           make=stages.base.stateless(lambda v, s, ctx: (jax.tree.map(
                               lambda x: 5.0 * x, v), s)),
                           privacy=stages.Privacy(lipschitz=1.0, cost=_costs_nothing))
    with pytest.raises(StageCheckError, match="stretched a difference 5"):
        check_bound(harness_for(stretch))
    check_bound(harness_for(dataclasses.replace(
        stretch, privacy=stretch.privacy._replace(lipschitz=5.0))))
    # the same lie by a per-example stage after the clip: declares it halves, passes through
    shrink = stages.Stage(name="broken.half", kind_in=K.BOUNDED, kind_out=K.BOUNDED,
                          make=stages.base.stateless(lambda v, s, ctx: (v, s)),
                          privacy=stages.Privacy(lipschitz=0.5))
    with pytest.raises(StageCheckError, match="'broken.half' fails the 'bound' check") as e:
        check_bound(harness_for(shrink))
    # the researcher learns that the Lipschitz factor is the lie, and the least honest value
    assert "declared Lipschitz factor 0.5" in str(e.value)
    assert re.search(r"declare lipschitz >= (1|1\.0\d*|0\.99\d*)[ :]", str(e.value))
    check_bound(harness_for(dataclasses.replace(
        shrink, privacy=shrink.privacy._replace(lipschitz=1.0))))
