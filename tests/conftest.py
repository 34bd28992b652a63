"""Shared fixtures: small models and a helper that compiles a pipeline on them."""

import subprocess
from pathlib import Path

import gin
import jax.numpy as jnp
import numpy as np
import pytest

import dpbench.stages  # noqa: F401
from dpbench import accounting, compiler, models, sampling, stages

REPO_ROOT = Path(__file__).resolve().parents[1]


def load_tool(name: str):
    """A fresh import of tools/<name>.py (the tools are scripts, not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
# A hang guard, never a verdict: no test's subprocess takes a tenth of this even on a loaded
# 2-core machine; one still running then is stuck, and the failure says "hung" and what.
HANG_GUARD_S = 1800


def run_guarded(command, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run with its output captured as text, under the suite's hang guard."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=HANG_GUARD_S,
                              **kwargs)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung: {' '.join(map(str, command))[:400]} did not exit within "
                    f"{HANG_GUARD_S} s")


def wait_guarded(proc: subprocess.Popen, what: str) -> str:
    """The output of a started process (Popen with stdout=PIPE, text) once it exits, under the
    suite's hang guard."""
    try:
        return proc.communicate(timeout=HANG_GUARD_S)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"hung: {what} did not exit within {HANG_GUARD_S} s")


# The longest modules first (measured: the tiny Ray sweep's module, then the trained runs'),
# so that pytest-xdist (--dist loadfile: a module per worker) starts them at once and shares
# the many short ones out at the end: started last, a long module leaves the other workers
# idle while it runs alone.
LONGEST_MODULES_FIRST = ("test_sweep.py", "test_pipelines.py", "test_checkpoint.py",
                         "test_stage_contract.py", "test_gep.py", "test_bookkeeping.py")


def pytest_collection_modifyitems(config, items):
    order = {name: i for i, name in enumerate(LONGEST_MODULES_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: else as found


@pytest.fixture(autouse=True, scope="session")
def shared_compilations(tmp_path_factory):
    """One JAX compilation cache for the whole test session: its pytest-xdist workers and every
    subprocess they start (through the environment) compile a program that another test
    already compiled only once. Keyed by JAX on the program, the compile options, the XLA flags
    and the backend, so a hit is the same executable a compilation would give (bit-identical
    results); it starts empty with each session, in the session's temporary folder.
    DPBENCH_TEST_JAX_CACHE=0 turns it off (to rule it out, or to time the suite without it)."""
    import os

    import jax
    if os.environ.get("DPBENCH_TEST_JAX_CACHE") == "0":
        yield None
        return
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "jax-cache"
    folder.mkdir(exist_ok=True)
    settings = {"jax_compilation_cache_dir": str(folder),
                # every program, not only those that take a second: the suite's are small
                "jax_persistent_cache_min_compile_time_secs": 0.0}
    old_env = {k.upper(): os.environ.get(k.upper()) for k in settings}
    old = {k: getattr(jax.config, k) for k in settings}
    for key, value in settings.items():
        jax.config.update(key, value)
        os.environ[key.upper()] = str(value)
    yield folder
    for key, value in old.items():
        jax.config.update(key, value)
    for key, value in old_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True, scope="session")
def feature_cache(tmp_path_factory):
    """Feature caches of the whole session in one temporary folder, never the user's
    (subprocesses inherit it through the environment)."""
    import os
    folder = tmp_path_factory.mktemp("dpbench-cache")
    old = os.environ.get("DPBENCH_CACHE_DIR")
    os.environ["DPBENCH_CACHE_DIR"] = str(folder)
    yield folder
    if old is None:
        os.environ.pop("DPBENCH_CACHE_DIR", None)
    else:
        os.environ["DPBENCH_CACHE_DIR"] = old


@pytest.fixture(autouse=True)
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def dpsgd_stages(l2_bound=1.0, learning_rate=0.5, optimizer="sgd"):
    return [stages.grad.per_example(), stages.clip.global_l2(l2_bound),
            stages.noise.gaussian(),
            stages.optimize.optax_optimizer(optimizer=optimizer, learning_rate=learning_rate)]


def small_model(shape=(8, 8, 1), num_classes=4, name="logistic"):
    # the WRN at its smallest: WRN-10-1 (its knobs are model.*; the others ignore them)
    wrn = dict(depth=10, width=1, group_norm_groups=4, input_size=shape[0]) if name == "wrn" \
        else {}
    model = models.make_model(num_classes, name=name, hidden=(16,), **wrn)
    loss_fn = models.cross_entropy_loss(model)

    def init_params(key):
        return model.init(key, jnp.zeros((1,) + shape, jnp.float32))

    return model, loss_fn, init_params


def compile_small(stage_list, *, n=64, batch_size=16, micro=8, noise_multiplier=None,
                  budget=None, total_steps=10, mesh=None, shape=(8, 8, 1), model_name="logistic",
                  padded_batch_size=None, seed=0, public_images=None, ema_decay=0.0,
                  book_keeping=False, step_options=compiler.StepOptions(), parts=1,
                  sampler=None):
    """book_keeping: hand the compiler the model, so a chain it allows runs in book-keeping form
    (as real runs do); without it the per-example gradients are materialized. ``parts`` > 1:
    cyclic Poisson sampling over that many parts; ``sampler``: that sampler instead."""
    model, loss_fn, init_params = small_model(shape, name=model_name)
    sampler = sampler or (sampling.PoissonSampler(n, batch_size, seed=seed, pad_multiple=micro,
                                       padded_batch_size=padded_batch_size) if parts == 1 else
               sampling.CyclicPoissonSampler(n, batch_size, seed=seed, parts=parts,
                                             pad_multiple=micro,
                                             padded_batch_size=padded_batch_size))
    budget = budget or accounting.Budget(epsilon=3.0, delta=1e-5)
    compiled = compiler.compile_pipeline(stage_list, compiler.RunInputs(
        loss_fn=loss_fn, init_params=init_params, example_shape=shape,
        sampler=sampler, budget=budget, total_steps=total_steps, steps_per_epoch=4,
        noise_multiplier=noise_multiplier, public_images=public_images, num_classes=4,
        model=model if book_keeping else None), micro_batch_size=micro, mesh=mesh,
        ema_decay=ema_decay, step_options=step_options)
    return compiled, init_params, loss_fn


def made(stage, **facts):
    """The stage's step functions made with small default run facts (override by keyword),
    seen as the compiler shows them: only the facts the stage names in ``needs``."""
    from dpbench.compiler.facts import StageFacts

    values = dict(dict(total_steps=10, steps_per_epoch=5, expected_batch_size=4,
                       dataset_size=40, param_shapes=None), **facts)
    return stage.make(StageFacts(values, stage.name, stage.needs))


def random_data(n, shape=(8, 8, 1), num_classes=4, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n,) + shape).astype(np.float32),
            rng.integers(0, num_classes, n).astype(np.int32))


def make_batch(compiled, images, labels, indices, mask, step=0):
    return compiled.host_batch(images[indices], labels[indices], mask, step)


def moved_and_mask_after_an_empty_step(masking_stage, model_name="mlp"):
    """One compiled step of [grad, masking_stage, clip, noise, sgd] on a batch with NO example
    (so the update is the release's noise alone): (which parameter coordinates moved, the
    stage's mask in that step), both flattened in the same order."""
    import jax
    compiled, init_params, _ = compile_small(
        [stages.grad.per_example(), masking_stage, stages.clip.global_l2(1.0),
         stages.noise.gaussian(), stages.optimize.optax_optimizer(optimizer="sgd")],
        n=64, batch_size=16, micro=8, noise_multiplier=1.0, model_name=model_name)
    images, labels = random_data(64)
    params = init_params(jax.random.key(0))
    state = compiled.init_state(params, jax.random.key(1))
    b = compiled.sampler.sample(0)
    new, _ = compiled.step(state, make_batch(compiled, images, labels, b.indices,
                                             np.zeros_like(b.mask)))
    (mask_state,) = [s for s in new.stage_states if isinstance(s, dict) and "mask" in s]
    flat = lambda tree: np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])  # noqa: E731
    moved = flat(new.params) != flat(params)
    return moved, flat(mask_state["mask"]) != 0
