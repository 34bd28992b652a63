import json
import os
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dp_accounting import dp_event

from dpbench import compiler, stages
from dpbench.stages.base import Kind, Privacy, Stage, stateless
from tests.conftest import (REPO_ROOT, compile_small, dpsgd_stages, make_batch, random_data,
                            run_guarded, small_model)
from tests.stages.test_noise import std_test_pvalue


def test_sigma_zero_and_infinite_clip_equals_plain_optax_sgd():
    n = 32
    images, labels = random_data(n, seed=int(np.random.default_rng().integers(1e6)))
    compiled, init_params, loss_fn = compile_small(
        dpsgd_stages(l2_bound=float("inf"), learning_rate=0.3), n=n, batch_size=n, micro=8,
        noise_multiplier=0.0, padded_batch_size=n)
    params = init_params(jax.random.key(0))
    state = compiled.init_state(params, jax.random.key(1))
    sgd = optax.sgd(0.3)
    ref_params, opt_state = params, sgd.init(params)
    mean_loss = lambda p: jnp.mean(jax.vmap(loss_fn, (None, 0, 0))(p, images, labels))  # noqa
    for step in range(3):
        b = compiled.sampler.sample(step)
        assert b.size == n  # q = 1: every example every step
        state, _ = compiled.step(state, make_batch(compiled, images, labels, b.indices, b.mask))
        grads = jax.grad(mean_loss)(ref_params)
        updates, opt_state = sgd.update(grads, opt_state)
        ref_params = optax.apply_updates(ref_params, updates)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_empty_batch_gives_finite_noise_only_update_with_std_sigma_c_over_b():
    n, batch = 64, 16
    compiled, init_params, _ = compile_small(dpsgd_stages(l2_bound=0.7, learning_rate=1.0),
                                             n=n, batch_size=batch, micro=8,
                                             noise_multiplier=1.3)
    images, labels = random_data(n)
    params = init_params(jax.random.key(0))
    state = compiled.init_state(params, jax.random.key(2))
    before = jax.tree.map(np.asarray, params)
    padded = compiled.sampler.padded_batch_size
    empty = make_batch(compiled, images, labels, np.zeros(padded, np.int64),
                       np.zeros(padded, bool))
    state, metrics = compiled.step(state, empty)
    assert int(state.step) == 1  # an empty batch still counts as a step
    deltas = np.concatenate([np.ravel(np.asarray(a) - b) for a, b in
                             zip(jax.tree.leaves(state.params), jax.tree.leaves(before))])
    assert np.all(np.isfinite(deltas)) and np.any(deltas != 0)
    # update = -lr * noise / expected batch size, noise ~ N(0, (sigma C)^2)
    assert std_test_pvalue(deltas, 1.3 * 0.7 / batch) > 1e-4


def test_noise_scale_of_the_compiled_step_rejects_a_wrong_sigma():
    """The whole compiled step: release stddev = sigma * C, divided by the EXPECTED size."""
    n, batch = 64, 16
    compiled, init_params, _ = compile_small(dpsgd_stages(l2_bound=2.0, learning_rate=1.0),
                                             n=n, batch_size=batch, micro=8,
                                             noise_multiplier=0.9, shape=(16, 16, 1))
    images, labels = random_data(n, shape=(16, 16, 1))
    state = compiled.init_state(init_params(jax.random.key(0)), jax.random.key(5))
    padded = compiled.sampler.padded_batch_size
    empty = make_batch(compiled, images, labels, np.zeros(padded, np.int64),
                       np.zeros(padded, bool))
    deltas = []
    for _ in range(20):
        before = jax.tree.map(np.array, state.params)
        state, _ = compiled.step(state, empty)
        deltas.append(np.concatenate([np.ravel(np.asarray(a) - b) for a, b in zip(
            jax.tree.leaves(state.params), jax.tree.leaves(before))]))
    deltas = np.concatenate(deltas)
    assert std_test_pvalue(deltas, 0.9 * 2.0 / batch) > 1e-4
    assert std_test_pvalue(deltas, 0.95 * 0.9 * 2.0 / batch) < 1e-6
    # fresh noise every step: consecutive steps are uncorrelated
    per_step = deltas.reshape(20, -1)
    assert abs(np.corrcoef(per_step[0], per_step[1])[0, 1]) < 0.1


def test_the_step_does_not_recompile_across_steps():
    n = 64
    compiled, init_params, _ = compile_small(dpsgd_stages(), n=n, batch_size=16, micro=8,
                                             noise_multiplier=1.0)
    images, labels = random_data(n)
    state = compiled.init_state(init_params(jax.random.key(0)), jax.random.key(1))
    sizes = set()
    for step in range(6):
        b = compiled.sampler.sample(step)
        sizes.add(b.size)
        state, _ = compiled.step(state, make_batch(compiled, images, labels, b.indices, b.mask))
    assert len(sizes) > 1  # different realized batch sizes ...
    assert compiled.step._cache_size() == 1  # ... one compiled executable


def _stage(name, kind_in, kind_out, make=None, needs=(), **privacy):
    """A test stage: its privacy declaration given by keyword (Privacy's fields)."""
    return Stage(name=name, kind_in=kind_in, kind_out=kind_out,
                 make=make or stateless(lambda v, s, ctx: (v, s)), needs=needs,
                 privacy=Privacy(**privacy))


def _costs_nothing(facts):
    return dp_event.NoOpDpEvent()


def test_noise_before_clip_is_rejected_naming_the_stage():
    bad = [stages.grad.per_example(), stages.noise.gaussian(), stages.clip.global_l2(1.0),
           stages.optimize.optax_optimizer()]
    with pytest.raises(compiler.PipelineError, match=r"stage #1 'noise.gaussian'.*clip"):
        compiler.validate_pipeline(bad)


def test_missing_clip_is_rejected_naming_the_stage():
    bad = [stages.grad.per_example(), stages.noise.gaussian(),
           stages.optimize.optax_optimizer()]
    with pytest.raises(compiler.PipelineError, match=r"'noise.gaussian'.*clip"):
        compiler.validate_pipeline(bad)


def test_missing_release_and_missing_optimizer_are_rejected():
    no_noise = [stages.grad.per_example(), stages.clip.global_l2(1.0),
                stages.optimize.optax_optimizer()]
    with pytest.raises(compiler.PipelineError, match=r"'optimize.optax'.*release"):
        compiler.validate_pipeline(no_noise)
    no_opt = [stages.grad.per_example(), stages.clip.global_l2(1.0), stages.noise.gaussian()]
    with pytest.raises(compiler.PipelineError, match="optimizer"):
        compiler.validate_pipeline(no_opt)


def test_undeclared_transforms_and_selection_are_rejected():
    unknown_lipschitz = _stage("project.mystery", Kind.BOUNDED, Kind.BOUNDED)
    with pytest.raises(compiler.PipelineError, match=r"'project.mystery'.*Lipschitz"):
        compiler.validate_pipeline([stages.grad.per_example(), stages.clip.global_l2(1.0),
                                    unknown_lipschitz, stages.noise.gaussian(),
                                    stages.optimize.optax_optimizer()])
    selection = _stage("select.topk_private", Kind.AGGREGATE, Kind.AGGREGATE, lipschitz=1.0)
    with pytest.raises(compiler.PipelineError, match=r"'select.topk_private'.*DP cost"):
        compiler.validate_pipeline([stages.grad.per_example(), stages.clip.global_l2(1.0),
                                    selection, stages.noise.gaussian(),
                                    stages.optimize.optax_optimizer()])
    second_clip = [stages.grad.per_example(), stages.clip.global_l2(1.0),
                   stages.clip.global_l2(1.0), stages.noise.gaussian(),
                   stages.optimize.optax_optimizer()]
    # a second clip is refused at the transition (a clip consumes per-example values, and only
    # a release may change a bounded value's kind), naming the stage
    with pytest.raises(compiler.PipelineError,
                       match=r"stage #2 'clip.global_l2' consumes per_example.*reorder"):
        compiler.validate_pipeline(second_clip)


@pytest.mark.parametrize("bound", [0.0, -1.0, None, float("nan")])
def test_a_clip_without_a_positive_bound_is_rejected(bound):
    """A clip's bound is the release's sensitivity: zero, negative or missing would calibrate
    no noise at all."""
    clip = _stage("clip.zero", Kind.PER_EXAMPLE, Kind.BOUNDED, l2_bound=bound)
    with pytest.raises(compiler.PipelineError,
                       match=r"stage #1 'clip.zero'.*declares no positive l2_bound"):
        compiler.validate_pipeline([stages.grad.per_example(), clip, stages.noise.gaussian(),
                                    stages.optimize.optax_optimizer()])
    fine = _stage("clip.fine", Kind.PER_EXAMPLE, Kind.BOUNDED, l2_bound=0.5)
    checked = compiler.validate_pipeline([stages.grad.per_example(), fine,
                                          stages.noise.gaussian(),
                                          stages.optimize.optax_optimizer()])
    assert checked.sensitivity == 0.5


@pytest.mark.parametrize("release,message", [
    ((1.0, 0.0), "without a finite positive l2_bound"),
    ((1.0, 1.0), "without a finite positive l2_bound"),
    ((float("inf"), 0.1), "without a finite positive l2_bound"),
    ((0.0, 0.1), "without a finite positive l2_bound"),
    (None, "only one stage may release private data before training"),  # two one-off stages
])
def test_one_off_releases_are_checked(release, message):
    """At most one stage releases private data before training, with a finite positive bound
    and a share of epsilon in (0, 1); (1.0, 0.1) alone passes."""
    from dpbench.stages.base import OneOffRelease

    def pruner(name, bound, fraction):
        return _stage(name, Kind.PER_EXAMPLE, Kind.PER_EXAMPLE,
                      one_off_release=OneOffRelease(l2_bound=bound, epsilon_fraction=fraction,
                                                    value=lambda p, g: g,
                                                    init=lambda p, r, k: ()))

    def pipeline(*middle):
        return [stages.grad.per_example(), *middle, stages.clip.global_l2(1.0),
                stages.noise.gaussian(), stages.optimize.optax_optimizer()]

    compiler.validate_pipeline(pipeline(pruner("prune.ok", 1.0, 0.1)))
    middle = ([pruner("prune.a", 1.0, 0.1), pruner("prune.b", 1.0, 0.1)] if release is None
              else [pruner("prune.bad", *release)])
    with pytest.raises(compiler.PipelineError, match=message):
        compiler.validate_pipeline(pipeline(*middle))


def test_the_compiler_runs_exactly_the_validated_declarations():
    """make() returns step functions only: a stage cannot change what was validated. A make
    that returns anything else and a cost that returns no DpEvent are rejected naming the
    stage, and a one-off release cannot be declared without its functions; an honest stage
    compiles."""
    def pipeline(middle):
        return [stages.grad.per_example(), stages.clip.global_l2(1.0), middle,
                stages.noise.gaussian(), stages.optimize.optax_optimizer()]

    sneaky = _stage("select.sneaky", Kind.AGGREGATE, Kind.AGGREGATE, lipschitz=1.0,
                    cost=_costs_nothing,
                    make=lambda facts: _stage("x", Kind.AGGREGATE, Kind.AGGREGATE))
    with pytest.raises(compiler.PipelineError, match=r"'select.sneaky'.*not StageFns"):
        compile_small(pipeline(sneaky), noise_multiplier=1.0)
    free = _stage("select.free", Kind.AGGREGATE, Kind.AGGREGATE, lipschitz=1.0,
                  cost=lambda facts: None)
    with pytest.raises(compiler.PipelineError,
                       match=r"'select.free' declares a DP cost, but its cost returned None"):
        compile_small(pipeline(free), noise_multiplier=1.0)
    from dpbench.stages.base import OneOffRelease
    with pytest.raises(TypeError, match="value"):
        OneOffRelease(l2_bound=1.0, epsilon_fraction=0.1)  # noqa: the functions are required
    honest = _stage("select.honest", Kind.AGGREGATE, Kind.AGGREGATE, lipschitz=1.0,
                    cost=_costs_nothing)
    compile_small(pipeline(honest), noise_multiplier=1.0)


def test_sensitivity_is_the_clip_bound_times_lipschitz_factors():
    mask = _stage("sparsify.half", Kind.BOUNDED, Kind.BOUNDED, lipschitz=0.5)
    v = compiler.validate_pipeline([stages.grad.per_example(), stages.clip.global_l2(3.0),
                                    mask, stages.noise.gaussian(),
                                    stages.optimize.optax_optimizer()])
    assert v.sensitivity == pytest.approx(1.5)


def test_calibrated_pipeline_meets_its_budget():
    from dpbench import accounting
    compiled, _, _ = compile_small(dpsgd_stages(), n=1000, batch_size=50, micro=10,
                                   budget=accounting.Budget(2.0, 1e-4), total_steps=200)
    eps = compiled.epsilon_after(200)
    assert eps <= 2.0 and 2.0 - eps < 1e-3
    assert compiled.epsilon_after(100) < eps


MULTI_DEVICE_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from jax.sharding import Mesh
    sys.path.insert(0, {root!r})
    from dpbench import stages
    from tests.conftest import compile_small, dpsgd_stages, make_batch, random_data
    def gip_stages():  # GIP's index release draws host randomness every step (replicated)
        dpsgd = dpsgd_stages(learning_rate=0.5)
        return dpsgd[:2] + [stages.select.gip(group_size=8, k_end=0.5)] + dpsgd[2:]
    def bandmf_stages(learning_rate):  # noise with memory: its buffer replicated, added once
        dpsgd = dpsgd_stages(learning_rate=learning_rate)
        return dpsgd[:2] + [stages.noise.banded(bands=2)] + dpsgd[3:]
    devices = jax.devices()
    out = {{}}
    for name, devs, book_keeping, chain in (
            ("one", devices[:1], False, dpsgd_stages), ("all", devices, False, dpsgd_stages),
            ("one_bk", devices[:1], True, dpsgd_stages), ("all_bk", devices, True, dpsgd_stages),
            ("one_gip", devices[:1], False, gip_stages), ("all_gip", devices, False, gip_stages),
            ("one_bmf", devices[:1], True, bandmf_stages),
            ("all_bmf", devices, True, bandmf_stages)):
        mesh = Mesh(np.asarray(devs), ("data",))
        gip = chain is gip_stages  # its sigma calibrated (its index budget needs the target)
        compiled, init_params, _ = compile_small(chain() if gip else chain(learning_rate=0.5),
            n=128, batch_size=32, micro=16, noise_multiplier=None if gip else 1.1, mesh=mesh,
            model_name="mlp", book_keeping=book_keeping,
            parts=2 if chain is bandmf_stages else 1)
        out[name + "_strategy"] = compiled.plan.strategy
        images, labels = random_data(128, seed=4)
        state = compiled.init_state(init_params(jax.random.key(0)), jax.random.key(9))
        for step in range(3):
            b = compiled.sampler.sample(step)
            batch = make_batch(compiled, images, labels, b.indices, b.mask, step=step)
            if step == 0:  # how the compiled step takes each batch array: per-device shape
                (_, placed), _ = compiled.step.lower(state, batch).compile().input_shardings
                arrays = jax.tree_util.tree_leaves_with_path(batch)
                out[name + "_shards"] = {{
                    jax.tree_util.keystr(k): [list(sh.shard_shape(np.shape(x))),
                                              len(sh.device_set), list(np.shape(x))]
                    for (k, x), sh in zip(arrays, jax.tree.leaves(placed))}}
            state, _ = compiled.step(state, batch)
        out[name] = [np.asarray(x).ravel().tolist() for x in jax.tree.leaves(state.params)]
        out[name + "_devices"] = len(devs)
    print("RESULT" + json.dumps(out))
""")


def _on_8_fake_devices(script: str) -> dict:
    """What ``script`` (formatted with the repository root) prints after RESULT, run in a
    process of its own with 8 fake CPU devices."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    proc = run_guarded([sys.executable, "-c", script.format(root=str(REPO_ROOT))], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


def test_step_on_8_fake_devices_equals_the_1_device_step():
    out = _on_8_fake_devices(MULTI_DEVICE_SCRIPT)
    assert out["all_devices"] == 8 and out["one_devices"] == 1
    # the examples are split over the 8 devices (micro-batch axis), not replicated on each;
    # GIP's host randomness (its index release's draws) is whole on every device
    for shards in (out["all_shards"], out["all_bk_shards"], out["all_gip_shards"]):
        examples = {k: v for k, v in shards.items() if "stage_inputs" not in k}
        assert set(examples) == {"['image']", "['label']", "['mask']"}
        for key, (shard, devices, shape) in examples.items():
            assert devices == 8 and shard[1] * 8 == shape[1] and shard[0] == shape[0], key
    host_inputs = {k: v for k, v in out["all_gip_shards"].items() if "stage_inputs" in k}
    assert host_inputs
    for key, (shard, devices, shape) in host_inputs.items():
        assert devices == 8 and shard == shape, key
    # both per-example strategies (book-keeping is what real runs of these models use)
    assert (out["all_strategy"], out["all_bk_strategy"]) == ("materialized", "bookkeeping")
    assert out["all_bmf_strategy"] == "bookkeeping"
    for one, many in (("one", "all"), ("one_bk", "all_bk"), ("one_gip", "all_gip"),
                      ("one_bmf", "all_bmf")):
        assert out[one] and len(out[one]) == len(out[many])
        for a, b in zip(out[one], out[many]):
            # identical noise (added once, from the same key), sums up to float reassociation
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


COMMUNICATION_SCRIPT = textwrap.dedent("""
    import json, re, sys
    import jax, numpy as np
    from jax.sharding import Mesh
    sys.path.insert(0, {root!r})
    from dpbench import compiler, stages
    from dpbench.compiler import pipeline
    from tests.conftest import compile_small, dpsgd_stages, make_batch, random_data
    mesh, shape, out = Mesh(np.asarray(jax.devices()), ("data",)), (16, 16, 1), {{}}

    def collectives(model, augmult, conv_grads="patches"):
        chain = dpsgd_stages()
        chain[0] = stages.grad.per_example(
            augmult=augmult, augmentation="crop_flip" if augmult > 1 else "none")
        compiled, init_params, _ = compile_small(
            chain, n=256, batch_size=64, micro=32, noise_multiplier=1.0, mesh=mesh,
            model_name=model, book_keeping=True, shape=shape,
            step_options=compiler.StepOptions(conv_grads=conv_grads))
        images, labels = random_data(256, shape=shape, seed=4)
        state = compiled.init_state(init_params(jax.random.key(0)), jax.random.key(9))
        b = compiled.sampler.sample(0)
        batch = make_batch(compiled, images, labels, b.indices, b.mask, step=0)
        text = compiled.step.lower(state, batch).compile().as_text()
        found, where = [], None
        for line in text.splitlines():  # (shape, kind, in the entry computation: not a loop)
            head = re.match(r"^(ENTRY )?%?\\S+ .*\\{{$", line)
            where = bool(head.group(1)) if head else where
            op = re.search(r"= (.+?) (all-gather|all-reduce|all-to-all)\\(", line)
            if op:
                found.append((op.group(1), op.group(2), where))
        return dict(strategy=compiled.plan.strategy,
                    gathered=[s for s, k, _ in found if k != "all-reduce"],
                    reduced=[s for s, k, _ in found if k == "all-reduce"],
                    # every all-reduce of a non-scalar (the sums), and whether in the entry
                    summed=[(s, entry) for s, k, entry in found
                            if k == "all-reduce" and re.search(r"\\[\\d", s)])

    for name, model, augmult in (("tanh_cnn", "tanh_cnn", 1), ("tanh_cnn_augmult", "tanh_cnn", 2),
                                 ("wrn_10_1_augmult", "wrn", 2), ("mlp", "mlp", 1)):
        out[name] = collectives(model, augmult)
    try:
        collectives("tanh_cnn", 2, "convolution")
    except ValueError as e:
        out["refused"] = str(e)
    pipeline._check_options = lambda options, mesh: None  # the knob it refuses, measured
    out["convolution"] = collectives("tanh_cnn", 2, "convolution")
    print("RESULT" + json.dumps(out))
""")


def test_the_sharded_step_gathers_no_batch_and_refuses_the_knob_that_would():
    """On 8 fake CPU devices, the compiled step of the tanh CNN (with and without augmentation
    multiplicity), of a WRN-10-1 with augmentation multiplicity and of an MLP, book-keeping as
    real runs use it, holds no all-gather (nor
    all-to-all): each device keeps its shard of the batch, sums its own examples over every
    micro-batch, and the clipped sums are all-reduced once, after the loop.
    train.conv_grads = 'convolution' (its per-example kernels by a vmapped, i.e. grouped,
    weight-gradient convolution) makes XLA all-gather the micro-batch's images onto every
    device (measured below, and openxla's issue 47945 on GPUs), so a mesh of more than one
    device refuses it, saying why."""
    out = _on_8_fake_devices(COMMUNICATION_SCRIPT)
    for name in ("tanh_cnn", "tanh_cnn_augmult", "wrn_10_1_augmult", "mlp"):
        assert out[name]["strategy"] == "bookkeeping", name
        assert out[name]["gathered"] == [], (name, out[name]["gathered"])
        # the clipped sum is all-reduced once a step, after the micro-batch loop (one tuple
        # of every parameter-sized sum, in the entry computation), never inside the loop
        summed = out[name]["summed"]
        assert len(summed) == 1 and summed[0][1] is True, (name, summed)
    assert "all-gathers the batch" in out["refused"] and "'patches'" in out["refused"]
    # the check can fail: the refused knob's step gathers the micro-batch's 64 augmented images
    assert "f32[64,16,16,1]" in " ".join(out["convolution"]["gathered"])


def test_nonfinite_per_example_gradient_is_zeroed_at_the_clip_and_counted():
    """One example with a NaN pixel: its gradient is replaced by zeros (norm 0 <= C), so the
    update equals the update of the batch without it, and the step reports one such example."""
    n = 32
    images, labels = random_data(n, seed=int(np.random.default_rng().integers(1e6)))
    compiled, init_params, _ = compile_small(
        dpsgd_stages(l2_bound=0.5, learning_rate=1.0), n=n, batch_size=n, micro=8,
        noise_multiplier=0.0, padded_batch_size=n)
    poisoned = images.copy()
    poisoned[3, 0, 0, 0] = np.nan
    indices, mask = np.arange(n), np.ones(n, bool)
    without = mask.copy()
    without[3] = False
    params = init_params(jax.random.key(0))
    results = []
    for imgs, m in ((poisoned, mask), (images, without)):
        state = compiled.init_state(params, jax.random.key(1))
        state, metrics = compiled.step(state, make_batch(compiled, imgs, labels, indices, m))
        results.append((state, metrics))
    (got, metrics), (want, clean_metrics) = results
    assert float(metrics["nonfinite_examples"]) == 1.0
    assert float(clean_metrics["nonfinite_examples"]) == 0.0
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_noise_is_fresh_every_step_and_every_leaf():
    """Noise-only updates (empty batches): no two steps and no two leaves share noise."""
    n, batch = 64, 16
    compiled, init_params, _ = compile_small(
        dpsgd_stages(l2_bound=1.0, learning_rate=1.0, optimizer="sgd"), n=n, batch_size=batch,
        micro=8, noise_multiplier=1.0, model_name="mlp", shape=(8, 8, 1))
    images, labels = random_data(n)
    state = compiled.init_state(init_params(jax.random.key(0)), jax.random.key(7))
    padded = compiled.sampler.padded_batch_size
    empty = make_batch(compiled, images, labels, np.zeros(padded, np.int64),
                       np.zeros(padded, bool))
    per_step = []
    for _ in range(3):
        before = jax.tree.map(np.array, state.params)
        state, _ = compiled.step(state, empty)
        per_step.append([np.ravel(np.asarray(a) - b) for a, b in
                         zip(jax.tree.leaves(state.params), jax.tree.leaves(before))])
    flat = [np.concatenate(leaves) for leaves in per_step]
    d = len(flat[0])
    for i in range(3):
        for j in range(i + 1, 3):
            assert abs(np.corrcoef(flat[i], flat[j])[0, 1]) < 5 / np.sqrt(d)  # fresh per step
    leaves = per_step[0]
    big = [leaf for leaf in leaves if leaf.size >= 16]
    assert len(big) >= 2
    for i in range(len(big)):
        for j in range(i + 1, len(big)):
            m = min(big[i].size, big[j].size)
            assert abs(np.corrcoef(big[i][:m], big[j][:m])[0, 1]) < 5 / np.sqrt(m)
            assert not np.allclose(big[i][:m], big[j][:m])  # leaves never share a key


@pytest.mark.parametrize("sigma", [0.0, 2.0])
def test_fidelity_diagnostics_compare_the_release_with_the_clean_clipped_mean(sigma):
    n = 32
    images, labels = random_data(n, seed=int(np.random.default_rng().integers(1e6)))
    compiled, init_params, _ = compile_small(
        dpsgd_stages(l2_bound=0.5, optimizer="sgd"), n=n, batch_size=n, micro=8,
        noise_multiplier=sigma, padded_batch_size=n)
    compiled = compiler.compile_pipeline(list(compiled.stages), compiler.RunInputs(
        loss_fn=small_model()[1],
        init_params=init_params, example_shape=(8, 8, 1), sampler=compiled.sampler,
        budget=compiled.budget, total_steps=10, steps_per_epoch=4,
        noise_multiplier=sigma), micro_batch_size=8, fidelity_diagnostics=True)
    state = compiled.init_state(init_params(jax.random.key(0)), jax.random.key(1))
    b = compiled.sampler.sample(0)
    _, metrics = compiled.step(state, make_batch(compiled, images, labels, b.indices, b.mask))
    if sigma == 0:  # the release IS the clean mean
        assert float(metrics["fidelity_cosine"]) == pytest.approx(1.0, abs=1e-5)
        assert float(metrics["noise_to_signal"]) == pytest.approx(0.0, abs=1e-5)
    else:
        # the noise key is fixed, the data not: over 40 data seeds the cosine stayed <= 0.26
        # and the ratio >= 5, so a chance failure is out of reach
        assert float(metrics["fidelity_cosine"]) < 0.9
        assert float(metrics["noise_to_signal"]) > 1.0


def test_masked_sum_is_the_sum_over_real_examples_and_ignores_the_rest_exactly():
    """compiler.masked_sum over [micro_steps, micro_batch] (a row larger than the CPU cache,
    where the sum is a dot product, and a small one): equal to the float64 sum over the real
    examples; padding slots whose values are NaN or inf contribute exactly nothing, and a
    micro-batch without a real example is skipped."""
    rng = np.random.default_rng()
    micro_steps, micro = 3, 8
    big = rng.normal(size=(micro_steps, micro, 397, 100)).astype(np.float32)
    small = rng.normal(size=(micro_steps, micro, 5)).astype(np.float32)
    mask = rng.random((micro_steps, micro)) < 0.6
    mask[0, 0], mask[1] = True, False  # at least one real example; one empty micro-batch
    big[~mask] = np.nan
    small[~mask] = np.inf
    batch = {"image": jnp.asarray(big), "label": jnp.asarray(small),
             "mask": jnp.asarray(mask)}

    def per_example(example, position):
        return ({"big": example["image"] * 2.0, "small": example["label"]},
                {"position": position.astype(jnp.float32)})

    total, aux = jax.jit(lambda b: compiler.masked_sum(per_example, b))(batch)
    want_big = 2.0 * big[mask].astype(np.float64).sum(axis=0)
    np.testing.assert_allclose(total["big"], want_big, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(total["small"], small[mask].astype(np.float64).sum(axis=0),
                               rtol=1e-5, atol=1e-5)
    positions = np.arange(micro_steps * micro).reshape(micro_steps, micro)
    assert float(aux["position"]) == float(positions[mask].sum())


@pytest.mark.parametrize("decay", [0.9, 0.999])
def test_evaluated_ema_is_the_normalized_average_of_the_steps_taken(decay):
    """The parameters a run evaluates with an EMA: sum_s (1 - d) d^(t-s) p_s / (1 - d^t) over
    the params after steps 1..t, with no weight on the initial parameters (an EMA started at
    them keeps d^t: 99.6% after 4 steps at d = 0.999, so its 'model' is the initialization)."""
    n = 32
    images, labels = random_data(n, seed=int(np.random.default_rng().integers(1e6)))
    compiled, init_params, _ = compile_small(dpsgd_stages(learning_rate=0.5), n=n, batch_size=n,
                                             micro=8, noise_multiplier=0.5, padded_batch_size=n,
                                             ema_decay=decay)
    state = compiled.init_state(init_params(jax.random.key(0)), jax.random.key(1))
    trajectory = []
    for step in range(4):
        b = compiled.sampler.sample(step)
        state, _ = compiled.step(state, make_batch(compiled, images, labels, b.indices, b.mask))
        trajectory.append(jax.tree.map(np.array, state.params))  # the step donates its input
    t = len(trajectory)
    weights = [(1 - decay) * decay ** (t - 1 - s) / (1 - decay ** t) for s in range(t)]
    want = jax.tree.map(lambda *ps: sum(w * p for w, p in zip(weights, ps)), *trajectory)
    got = compiled.evaluation_params(state)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
