"""Models as plug-ins: the wide ResNet registers itself like a user's model would, trains with
DP-SGD on Fashion-MNIST padded to 32x32 by book-keeping (the same clipped sum as vmap(grad)),
and a model from a folder outside the repository trains from its own gin file and is listed by
`dpbench train --help`."""

import hashlib
import json
import sys
import textwrap
from pathlib import Path

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpbench import accounting, compiler, config, models, sampling, stages
from dpbench.compiler import bookkeeping
from dpbench.compiler.taps import discover_taps
from dpbench.config import pipeline_stages
from dpbench.run import build_run
from tests.conftest import REPO_ROOT, make_batch, run_guarded


def _wrn_param_count(depth: int, width: int, classes: int = 10, channels: int = 1) -> int:
    """WRN-depth-width's parameters from its definition (Zagoruyko & Komodakis; GroupNorm's
    scale and bias where BatchNorm's were): a 3x3 stem to 16 channels, 3 stages of n = (depth
    - 4) / 6 pre-activation blocks (norm, conv 3x3, norm, conv 3x3) at 16, 32, 64 x width
    channels, a 1x1 shortcut where the shape changes, a final norm and the linear head."""
    n, count, c_in = (depth - 4) // 6, 9 * channels * 16 + 16, 16
    for stage, c in enumerate((16 * width, 32 * width, 64 * width)):
        for block in range(n):
            count += 2 * c_in + 9 * c_in * c + c  # norm (on the block's input), conv 3x3
            count += 2 * c + 9 * c * c + c  # norm, conv 3x3
            if block == 0 and (c_in != c or stage > 0):  # a channel change or stride 2
                count += c_in * c + c  # the 1x1 shortcut
            c_in = c
    return count + 2 * c_in + c_in * classes + classes  # the final norm and the head


def _wrn(depth: int, width: int, group_norm_groups: int = 16, activation: str = "relu",
         **knobs):
    """WRN-depth-width from model.* knobs (gin/model/wrn16_4.gin's GroupNorm and activation
    by default)."""
    return models.make_model(10, name="wrn", depth=depth, width=width,
                             group_norm_groups=group_norm_groups, activation=activation, **knobs)


def test_wrn_16_4_has_the_reference_size_and_treats_each_example_alone():
    """2.7M parameters (De et al.'s WRN-16-4); 28x28 inputs are the same as the 32x32 ones
    padded with zeros at the centre; GroupNorm normalizes each example alone (a batch gives
    each example's own logits)."""
    model = _wrn(16, 4)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
    count = sum(x.size for x in jax.tree.leaves(shapes))  # shapes only: no initialisation
    assert count == _wrn_param_count(16, 4) and 2.7e6 < count < 2.8e6
    model = _wrn(10, 1)
    params = model.init(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
    assert sum(x.size for x in jax.tree.leaves(params)) == _wrn_param_count(10, 1)
    x = jnp.asarray(np.random.default_rng().uniform(size=(4, 28, 28, 1)), jnp.float32)
    padded = jnp.pad(x, [(0, 0), (2, 2), (2, 2), (0, 0)])
    np.testing.assert_allclose(model.apply(params, x), model.apply(params, padded), atol=1e-5)
    single = jnp.concatenate([model.apply(params, x[i:i + 1]) for i in range(4)])
    np.testing.assert_allclose(model.apply(params, x), single, atol=1e-4)


def test_wrn_reads_model_knobs_and_its_errors_name_the_knob_to_change():
    """The WRN's knobs are model.* (no configurable of its own): gin/model/wrn16_4.gin builds
    WRN-16-4 from them, and each knob it cannot take is refused naming that knob, the
    default model.group_norm_groups = 0 (no GroupNorm) included."""
    gin.parse_config_file(str(REPO_ROOT / "gin/model/wrn16_4.gin"))
    model = models.ModelConfig().build(10)
    assert (model.depth, model.width, model.groups, model.activation, model.size) == (
        16, 4, 16, "relu", 32)
    for knobs, match in [(dict(depth=12), "model.depth must be 6 n \\+ 4"),
                         (dict(depth=4), "model.depth must be 6 n \\+ 4"),
                         (dict(width=0), "model.width must be >= 1"),
                         (dict(group_norm_groups=0), "bind model.group_norm_groups"),
                         (dict(group_norm_groups=3), "model.group_norm_groups must divide"),
                         (dict(input_size=4), "model.input_size must be >= 8"),
                         (dict(activation="gelu"), "model.activation must be one of")]:
        with pytest.raises(ValueError, match=match):
            _wrn(**{"depth": 10, "width": 1, **knobs})
    with pytest.raises(ValueError, match="model.input_size = 16"):
        model = _wrn(10, 1, input_size=16)
        model.init(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
    with pytest.raises(ValueError, match="No configurable matching 'wrn'"):
        gin.parse_config("wrn.depth = 10")


def test_dp_sgd_on_wrn_16_4_takes_two_steps_on_fashion_mnist_by_bookkeeping():
    """DP-SGD on WRN-16-4 x Fashion-MNIST-32 (gin/model/wrn16_4.gin): it compiles on CPU,
    takes two steps with a finite loss by book-keeping (every parameter in a tap layer, so no
    reason to give), and its privacy statement's inputs state the padding."""
    config.parse_config(["pipelines/dpsgd", "gin/data/fashion_mnist.gin",
                         "gin/model/wrn16_4.gin"],
                        ["train.batch_size = 8", "train.micro_batch_size = 8"])
    _, stages = pipeline_stages()
    run = build_run(stages, config.TrainConfig(), accounting.Budget())
    assert run.model_name == "wrn" and run.compiled.plan.strategy == "bookkeeping"
    assert run.compiled.plan.strategy_reason == ""
    assert any("zero-padded at the centre to 32x32" in item["what"] for item in run.inputs)
    state = run.initial_state()
    for step in range(2):
        state, metrics = run.compiled.step(state, run.host_batch(step))
        assert np.isfinite(float(metrics["train_loss"]))
    assert int(state.step) == 2


def _wrn_compiled(chain, with_model: bool, shape, model, step_options=None):
    sampler = sampling.PoissonSampler(48, 24, seed=0, pad_multiple=8)
    return compiler.compile_pipeline(chain, compiler.RunInputs(
        loss_fn=models.cross_entropy_loss(model),
        init_params=lambda key: model.init(key, jnp.zeros((1,) + shape)), example_shape=shape,
        sampler=sampler, budget=accounting.Budget(3.0, 1e-5), total_steps=10,
        steps_per_epoch=2, noise_multiplier=1.0,
        model=model if with_model else None), micro_batch_size=8,
        step_options=step_options or compiler.StepOptions())


def test_bookkeeping_gives_the_wrns_clipped_sum_with_augmentation():
    """WRN-10-1 at 16x16 (every layer kind of WRN-16-4: 3x3, strided 3x3 and strided 1x1
    convolutions, GroupNorm's scale and bias, the dense head) with augmentation multiplicity 2:
    book-keeping's clipped sum equals the materialized vmap(grad) one within float32 rounding,
    the same augmented copies drawn by both, with adversarial examples in the batch (a NaN
    image, zeroed and counted by both; one scaled by 1e3; an all-zero one) and RS's public mask
    on every parameter, scales and biases included (tests/test_bookkeeping.py checks each
    path's norms, unmasked, masked and transformed, on a net of the same layer kinds)."""
    model, shape = _wrn(10, 1, input_size=16, group_norm_groups=4), (12, 12, 1)
    chain = [stages.grad.per_example(augmult=2, augmentation="crop_flip", crop_padding=2),
             stages.sparsify.random_mask(final_rate=0.5, cooling="none"),
             stages.clip.global_l2(0.05), stages.noise.gaussian(),
             stages.optimize.optax_optimizer(optimizer="sgd", learning_rate=0.5)]
    fast, slow = (_wrn_compiled(chain, with_model, shape, model) for with_model in (True, False))
    assert (fast.plan.strategy, slow.plan.strategy) == ("bookkeeping", "materialized")
    assert {t.kind for t in fast.plan.taps} == {"matmul", "affine"}
    # the run fact layer_grads has its documented form only: matmul taps only
    assert fast.plan.run_facts.get("layer_grads") is None
    assert {t.path[0].split("_")[0] for t in fast.plan.taps} == {
        "GroupNorm", "conv", "head", "shortcut", "stem"}
    rng = np.random.default_rng()
    images = rng.uniform(size=(48,) + shape).astype(np.float32)
    labels = rng.integers(0, 10, 48).astype(np.int32)
    images[3], images[4], images[5] = np.nan, 0.0, images[5] * 1e3
    state = fast.init_state(model.init(jax.random.key(1), jnp.zeros((1,) + shape)),
                            jax.random.key(2))
    b = fast.sampler.sample(0)
    b.mask[:6], b.indices[:6] = True, np.arange(6)
    batch = make_batch(fast, images, labels, b.indices, b.mask)
    (got, fast_aux), (want, slow_aux) = (jax.jit(c.lowered.clipped_sum)(state, batch)
                                         for c in (fast, slow))
    scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * scale)  # observed: ~3e-7
    assert float(fast_aux["nonfinite"]) == float(slow_aux["nonfinite"]) == 1.0
    np.testing.assert_allclose(fast_aux["loss"], slow_aux["loss"], rtol=1e-4)
    # GEP's layer form takes matmul layers only: its record says so for the WRN.
    gep = [stages.grad.per_example(), stages.gep.embed_and_clip(num_basis=2, num_anchors=4)]
    reason = bookkeeping.strategy_reason(gep + chain[3:], 2, fast.plan.taps, model,
                                         fast.plan.run_facts.get("param_shapes"), shape)
    assert "not GroupNorm's scale and bias" in reason


def test_the_per_layer_rule_picks_both_norms_in_wrn_10_1_and_either_gives_the_same_sum(
        monkeypatch):
    """Book-keeping's per-layer rule (taps.Tap.ghost_is_cheaper_at: Gram products where
    2 T'(d + p) < d p, T' an example's positions over all its augmented copies; measured on
    a CPU in docs/speed.md): on WRN-10-1 at 16x16 it puts the last stage's 3x3 convolutions
    (T' 16) on ghost norms and every other convolution on per-example kernel gradients; with 2
    copies per example (T' 32) those flip to kernel gradients too. The clipped sum is the same
    by the rule, with every layer forced onto ghost norms and with every layer forced onto
    kernel gradients, with adversarial examples in the batch (a NaN image, zeroed and counted;
    one scaled by 1e3; an all-zero one). That the rule's sum is vmap(grad)'s on this WRN:
    test_bookkeeping_gives_the_wrns_clipped_sum_with_augmentation and tests/test_bookkeeping.py."""
    from dpbench.compiler import taps as taps_lib
    model, shape = _wrn(10, 1, input_size=16, group_norm_groups=4), (16, 16, 1)
    params = jax.jit(model.init)(jax.random.key(1), jnp.zeros((1,) + shape))
    taps = discover_taps(model, jax.eval_shape(lambda: params), shape)
    rule = taps_lib.Tap.ghost_is_cheaper_at
    for copies, ghost_wanted in ((1, 2), (2, 0)):
        ghost = {t.path for t in taps if t.conv and rule(t, t.positions * copies)}
        assert len(ghost) == ghost_wanted, (copies, ghost)
        assert all(t.positions == 16 and t.inputs >= 9 * 32 for t in taps if t.path in ghost)
    assert any(t.conv and not rule(t, t.positions) for t in taps)  # both branches at K 1
    rng = np.random.default_rng()
    b = 6
    images = rng.uniform(size=(b,) + shape).astype(np.float32)
    images[0], images[1], images[2] = np.nan, 0.0, images[2] * 1e3
    labels = rng.integers(0, 10, b).astype(np.int32)
    mask = np.arange(b) < b - 1  # the last example: padding

    def by(choice):  # eager: three compilations of the WRN's clipped sum cost ~40 s here
        monkeypatch.setattr(taps_lib.Tap, "ghost_is_cheaper_at", choice)
        return bookkeeping.clipped_sum(model, taps, params, images, labels, mask, 0.05)

    want, want_aux = by(rule)
    top = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want))
    assert top > 0 and float(want_aux["nonfinite"]) == 1.0  # not vacuous
    for name, choice in (("all ghost", lambda self, n: True),
                         ("all kernel gradients", lambda self, n: False)):
        got, aux = by(choice)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * top, err_msg=name)
        assert float(aux["nonfinite"]) == 1.0, name


@pytest.mark.parametrize("name,masked", [("wrn", True), ("tanh_cnn", False)])
def test_conv_grads_by_convolution_give_the_same_clipped_sum(name, masked, monkeypatch):
    """conv_grads 'convolution' (each example's convolution kernel gradient by XLA's
    convolution of the input with the output gradient, no image patches): book-keeping's
    clipped sum of one micro-batch equals the patches' on WRN-10-1 (3x3, strided 3x3 and
    strided 1x1 convolutions, GroupNorm) under a public mask and on the tanh CNN unmasked, each
    example as 2 copies, with adversarial examples (a NaN image, zeroed and counted by both;
    one scaled by 1e3; an all-zero one). tests/test_bookkeeping.py runs the option through
    compile_pipeline."""
    model = _wrn(10, 1, input_size=16, group_norm_groups=4) if name == "wrn" else \
        models.make_model(10, name=name)
    shape = (12, 12, 1) if name == "wrn" else (28, 28, 1)
    params = model.init(jax.random.key(1), jnp.zeros((1,) + shape))
    taps = discover_taps(model, jax.eval_shape(lambda: params), shape)
    rng = np.random.default_rng()
    b, copies = 6, 2
    images = rng.uniform(size=(b * copies,) + shape).astype(np.float32)
    images[0], images[2], images[4] = np.nan, 0.0, images[4] * 1e3  # examples 0, 1, 2
    labels = np.repeat(rng.integers(0, 10, b), copies).astype(np.int32)
    mask = np.arange(b) < b - 1  # the last example: padding
    masks = jax.tree.map(lambda x: jnp.asarray(rng.integers(0, 2, x.shape), x.dtype),
                         params) if masked else None
    formed = set()  # the convolution taps whose kernels came from _conv_kernels
    conv_kernels = bookkeeping._conv_kernels
    monkeypatch.setattr(bookkeeping, "_conv_kernels", lambda x, delta, tap, n: formed.add(
        tap.path) or conv_kernels(x, delta, tap, n))

    def clipped(how):
        return jax.jit(lambda p, x, y, m: bookkeeping.clipped_sum(
            model, taps, p, x, y, m, 0.05, masks, copies=copies, conv_grads=how))(
                params, images, labels, mask)

    want, want_aux = clipped("patches")
    assert formed == set()
    got, got_aux = clipped("convolution")
    assert formed == {t.path for t in taps if t.conv} != set()
    scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want))
    assert scale > 0  # not vacuous
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * scale)
    assert float(got_aux["nonfinite"]) == float(want_aux["nonfinite"]) == 1.0
    np.testing.assert_allclose(got_aux["loss"], want_aux["loss"], rtol=1e-5)


USER_MODEL = textwrap.dedent('''
    import dataclasses

    import flax.linen as nn
    import gin
    import numpy as np

    from dpbench import data, models


    @gin.configurable("tiny")
    @dataclasses.dataclass(frozen=True)
    class TinyKnobs:
        hidden: int = 8


    class Tiny(nn.Module):
        num_classes: int
        hidden: int

        @nn.compact
        def __call__(self, x):
            x = nn.tanh(nn.Dense(self.hidden)(x.reshape(x.shape[:-3] + (-1,))))
            return nn.Dense(self.num_classes)(x)


    models.register_model("tiny", lambda n, knobs, linearized: Tiny(n, TinyKnobs().hidden))


    def blobs(data_dir):
        """Two classes of 8x8 images: bright top half or bright bottom half, plus noise."""
        rng = np.random.default_rng(0)
        labels = rng.integers(0, 2, 700)
        images = rng.uniform(0, 0.3, (700, 8, 8, 1)).astype(np.float32)
        for i, label in enumerate(labels):
            images[i, 4 * label:4 * label + 4] += 0.6
        return images[:600], labels[:600], images[600:], labels[600:], 2


    data.register_dataset("blobs", blobs)
''')


def test_a_model_and_a_dataset_from_the_users_own_folder_train_and_are_listed(tmp_path):
    """One module (registering a model with its knob, and a dataset) and one gin file, outside
    the repository: `dpbench train` trains the model on the dataset and its record names both;
    `dpbench train --help` with that gin file lists them."""
    (tmp_path / "my_models.py").write_text(USER_MODEL)
    (tmp_path / "tiny.gin").write_text(
        "import my_models\ninclude 'pipelines/dpsgd/pipeline.gin'\n"
        "dataset.name = 'blobs'\ndataset.validation_size = 100\n"
        "model.name = 'tiny'\ntiny.hidden = 12\ntrain.epochs = 2\ntrain.batch_size = 100\n")
    command = Path(sys.executable).parent / "dpbench"
    listed = run_guarded([str(command), "train", "--help", "--gin_file=tiny.gin"], cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr[-2000:]
    (line,) = [x for x in listed.stdout.splitlines() if x.startswith("models (model.name):")]
    assert "tiny" in line.split(":", 1)[1].strip().split(", ") and "wrn" in line
    (line,) = [x for x in listed.stdout.splitlines() if x.startswith("datasets (dataset.name):")]
    assert "blobs" in line.split(":", 1)[1].strip().split(", ") and "fashion_mnist" in line
    trained = run_guarded([str(command), "--gin_file=tiny.gin", "--workdir=run"], cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "run_record.json").read_text())
    assert record["model"] == "tiny" and record["dataset"] == "blobs"
    assert record["dataset_size"] == 500 and record["epsilon"] <= record["target_epsilon"]
    assert "tiny.hidden = 12" in (tmp_path / "run" / "operative_config.gin").read_text()
    assert not (REPO_ROOT / "my_models.py").exists()
    # the code it trained on and with, outside the repository, pinned by file hash
    digest = hashlib.sha256((tmp_path / "my_models.py").read_bytes()).hexdigest()
    assert [(c["kind"], c["name"], c["module"], c["sha256"]) for c in record["outside_code"]] \
        == [("dataset", "blobs", "my_models", digest), ("model", "tiny", "my_models", digest)]
    statement = record["privacy_statement"]
    assert statement["outside_code"] == record["outside_code"]
    assert f"dataset blobs (module my_models, file sha256 {digest[:12]})" in statement["statement"]
