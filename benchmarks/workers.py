"""The speed benchmark's workers: each configuration measured in its own process
(``python -m benchmarks.speed --worker=spec.json``), so its peak memory is its own."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from benchmarks import interleave
from benchmarks.common import SPEC_KEYS, augmented_batch, fixed_size_batches
from benchmarks.torch_workers import worker_opacus, worker_torch_nonprivate


# ---------------------------------------------------------------------------------------------
# Measurements inside one worker process
# ---------------------------------------------------------------------------------------------

def peak_rss_mib() -> float:
    """This process's resident-memory high-water mark, in MiB (stdlib ``resource``: ru_maxrss
    is the same VmHWM the kernel keeps, in KiB on Linux)."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# One timing loop for every worker: alone, its steps back to back; inside an interleaved run,
# one step per turn (benchmarks/interleave.py).
_summary = interleave.summary
_timed_loop = interleave.timed_loop


def _parse(spec: dict, with_sigma: bool):
    from dpbench import config as dpconfig
    bindings = list(spec["bindings"])
    if with_sigma and spec.get("noise_multiplier") is not None:
        bindings.append(f"train.noise_multiplier = {float(spec['noise_multiplier'])!r}")
    dpconfig.parse_config(spec["gin_files"], bindings)


def build_dp_run(spec: dict):
    """What run.train builds up to the compiled step and its initial state, the same way.

    Returns a dict with the pieces the timing loop needs. Sigma: spec['noise_multiplier'] (bound
    as train.noise_multiplier, as a user would) unless a stage needs the run's target epsilon
    (GIP splits it for its own budgeted mechanism): those take the calibrated path.
    """
    from dpbench import accounting, compiler
    from dpbench.config import TrainConfig, pipeline_stages
    from dpbench.run import build_run

    _parse(spec, with_sigma=False)
    _, probe = pipeline_stages()
    calibrated = spec.get("noise_multiplier") is None or any(
        "target_epsilon" in s.needs for s in probe)
    if not calibrated:
        _parse(spec, with_sigma=True)

    # Built exactly as run.train builds it (no workdir, no checkpoints).
    config = TrainConfig()
    config.validate()
    budget = accounting.Budget()
    pipeline_name, stages = pipeline_stages()
    compiler.validate_pipeline(stages)
    run = build_run(stages, config, budget)
    return dict(config=config, budget=budget, pipeline_name=pipeline_name, dataset=run.dataset,
                model=run.model, sampler=run.sampler, mesh=run.mesh, compiled=run.compiled,
                state=run.initial_state(), total_steps=run.total_steps, calibrated=calibrated,
                compile_pipeline_s=run.compile_s)

def _param_count(params) -> int:
    import jax
    return int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)))


def worker_dp(spec: dict) -> dict:
    """One dpbench pipeline: the compiled step on the sampler's padded batches."""
    import jax

    from dpbench import sharding

    run = build_dp_run(spec)
    compiled, sampler, dataset, mesh = run["compiled"], run["sampler"], run["dataset"], run["mesh"]
    # A step whose cost repeats every r steps (GEP's basis refreshed every r) is timed r
    # consecutive steps at a time, divided by r: the median of those is a per-step cost, where
    # a median over single steps would report only the steps without a refresh.
    r = spec.get("steps_per_timing", 1)
    num = (spec["warmup"] + spec["steps"]) * r
    samples = [sampler.sample(t) for t in range(num)]  # sampled before the loop
    holder = {"state": run["state"], "metrics": None}

    def prepare(t):
        batches = []
        for u in range(t * r, (t + 1) * r):
            s = samples[u]
            batches.append(sharding.put_batch(compiled.host_batch(
                dataset.train.images[s.indices], dataset.train.labels[s.indices], s.mask, u),
                mesh))
        return jax.block_until_ready(batches)

    def run_step(batches):
        for batch in batches:
            holder["state"], holder["metrics"] = compiled.step(holder["state"], batch)
        jax.block_until_ready((holder["state"], holder["metrics"]))

    timing = _timed_loop(spec["steps"], spec["warmup"], prepare, run_step)
    if r > 1:
        timing = dict(timing, steps_per_timing=r, **{k: timing[k] / r for k in (
            "ms_median", "ms_min", "ms_max") if timing.get(k) is not None})
    loss = float(holder["metrics"]["train_loss"])
    sizes = [s.size for s in samples]
    micro = compiled.micro_batch_size
    return dict(
        timing, pipeline=run["pipeline_name"], dataset_size=len(dataset.train),
        expected_batch_size=sampler.expected_batch_size,
        padded_batch_size=sampler.padded_batch_size, micro_batch_size=micro,
        micro_steps=compiled.micro_steps, realized_mean=float(np.mean(sizes)),
        nonempty_micro_batches_mean=float(np.mean([math.ceil(z / micro) for z in sizes])),
        noise_multiplier=compiled.noise_multiplier, sigma_calibrated=run["calibrated"],
        sensitivity=compiled.sensitivity, total_steps=run["total_steps"],
        compile_pipeline_s=run["compile_pipeline_s"], final_train_loss=loss,
        param_count=_param_count(holder["state"].params),
        stages=compiled.plan.facts())


def accumulated_value_and_grad(loss_fn, params, images, labels, chunk: int):
    """(the batch's mean loss, its gradient), summed over consecutive chunks of ``chunk``
    examples in a scan (each chunk's mean, averaged): the same values as one value_and_grad of
    the whole batch when chunk divides B, without XLA CPU's slowdown once a whole-batch step's
    activations outgrow the cache (B=1024: ~2.6x slower in one piece). The whole batch at once
    when chunk does not divide B."""
    import jax
    import jax.numpy as jnp

    b = images.shape[0]
    if chunk >= b or b % chunk:
        return jax.value_and_grad(loss_fn)(params, images, labels)
    xs = images.reshape((b // chunk, chunk) + images.shape[1:])
    ys = labels.reshape(b // chunk, chunk)

    def add(total, xy):
        return jax.tree.map(jnp.add, total, jax.value_and_grad(loss_fn)(params, *xy)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    total, _ = jax.lax.scan(add, zeros, (xs, ys))
    return jax.tree.map(lambda v: v / (b // chunk), total)


def _plain_step(spec: dict) -> dict:
    """JAX's own non-private step for the spec's model and optax optimizer: a plain mean-loss
    gradient on exactly B examples (each as the K augmented copies the pipeline's gradient
    stage declares, B x K images), accumulated over the micro-batches dpbench's rows use (of
    examples, so K x as many images each), then the update. Returns the step (un-jitted; it
    takes a key for the augmentation), its initial params and optimizer state, the loss, the
    dataset and the fixed-size batches' indices."""
    import jax
    import jax.numpy as jnp
    import optax

    from dpbench import data, models
    from dpbench.config import TrainConfig, pipeline_stages
    from dpbench.run import total_steps_for
    from dpbench.stages import optimize

    _parse(spec, with_sigma=False)
    config = TrainConfig()
    _, stages = pipeline_stages()
    dataset = data.load_dataset()
    n = len(dataset.train)
    model = models.ModelConfig().build(dataset.num_classes)
    total_steps = total_steps_for(config.epochs, n, config.batch_size)
    opt_options = stages[-1].options  # optimize.optax, built as its stage builds it
    transform = optimize.make_optimizer(
        opt_options["optimizer"],
        optimize.make_schedule(opt_options["schedule"], opt_options["learning_rate"],
                               total_steps, opt_options["warmup_steps"]),
        opt_options["momentum"], opt_options["nesterov"])
    seeds = np.random.SeedSequence(config.seed if config.seed is not None else 0
                                   ).generate_state(3)
    params = model.init(jax.random.key(int(seeds[0])),
                        jnp.zeros((1,) + dataset.input_shape, jnp.float32))

    def mean_loss(p, images, labels):
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
            model.apply(p, images), labels))

    augment = augmented_batch(stages[0].options)

    def plain_step(p, s, images, labels, key):
        images, labels = augment(images, labels, key)
        loss, grads = accumulated_value_and_grad(
            mean_loss, p, images, labels,
            config.micro_batch_size * images.shape[0] // config.batch_size)
        updates, s = transform.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    b = config.batch_size
    return dict(step=plain_step, params=params, opt_state=transform.init(params),
                mean_loss=mean_loss, dataset=dataset, batch_size=b,
                indices=fixed_size_batches(n, b, int(seeds[2]), spec["warmup"] + spec["steps"]))


def _batch_loader(plain: dict):
    import jax

    images, labels = plain["dataset"].train.images, plain["dataset"].train.labels

    def prepare(t):
        idx = plain["indices"][t]
        return jax.block_until_ready((jax.device_put(images[idx]), jax.device_put(labels[idx]),
                                      jax.random.key(t)))
    return prepare


def worker_jax_nonprivate(spec: dict) -> dict:
    """Same model and optax optimizer; plain mean-loss gradient on exactly B examples,
    accumulated over the micro-batches dpbench's rows use; jitted."""
    import jax

    plain = _plain_step(spec)
    step = jax.jit(plain["step"], donate_argnums=(0, 1))
    holder = {"p": plain["params"], "s": plain["opt_state"], "loss": None}

    def run_step(batch):
        holder["p"], holder["s"], holder["loss"] = step(holder["p"], holder["s"], *batch)
        jax.block_until_ready((holder["p"], holder["s"], holder["loss"]))

    timing = _timed_loop(spec["steps"], spec["warmup"], _batch_loader(plain), run_step)
    b = plain["batch_size"]
    return dict(timing, dataset_size=len(plain["dataset"].train), expected_batch_size=b,
                padded_batch_size=b, final_train_loss=float(holder["loss"]),
                param_count=_param_count(holder["p"]))


def worker_calibration(spec: dict) -> dict:
    """Times accounting.calibrate_noise_multiplier on the DP-SGD run's event, exactly the call
    compile_pipeline makes with noise_multiplier=None, once per accountant and repeat."""
    from dpbench import accounting

    run = build_dp_run(dict(spec, noise_multiplier=1.0))  # built once; calibration timed below
    compiled, base = run["compiled"], run["budget"]
    out = {}
    for accountant in spec["accountants"]:
        budget = dataclasses.replace(base, accountant=accountant)
        make_event = compiled.accounting.event_at  # noqa: E731
        times, sigma = [], None
        for _ in range(spec["repeats"]):
            start = time.perf_counter()
            sigma = accounting.calibrate_noise_multiplier(make_event, budget)
            times.append(time.perf_counter() - start)
        out[accountant] = dict(seconds_median=float(np.median(times)),
                               seconds_first=times[0], seconds_all=times, sigma=sigma)
    return dict(calibration=out, epsilon=base.epsilon, delta=base.delta,
                dataset_size=compiled.sampler.dataset_size,
                expected_batch_size=compiled.sampler.expected_batch_size,
                padded_batch_size=compiled.sampler.padded_batch_size,
                total_steps=compiled.total_steps, epochs=run["config"].epochs)


def worker_main_job(spec: dict) -> dict:
    """The README's main job (DP-SGD on Fashion-MNIST, 30 epochs, the pipeline's own settings)
    trained by run.train in a temporary workdir; its run record's wall time is the target."""
    from dpbench import config
    from dpbench import run as run_lib

    config.parse_config(spec["gin_files"], list(spec["bindings"]))
    with tempfile.TemporaryDirectory(prefix="dpbench-main-job-") as tmp:
        record = run_lib.train(Path(tmp) / "run", gin_files=spec["gin_files"])
    return {k: record[k] for k in ("wall_time_s", "test_accuracy", "validation_accuracy",
                                   "epsilon", "steps", "median_step_s", "noise_multiplier",
                                   "calibration_s")}


ANCHOR_CHUNK = 64  # gep.embed_and_clip's default anchor_chunk


def gep_floor_shapes(run: dict) -> dict:
    """The GEP light step's matrix shapes: {group: (p_g, k_g)}, the anchor count m and the
    step's expected batch B, read off the compiled GEP pipeline and its parameters."""
    from dpbench.stages import gep

    (stage,) = [f for f in run["compiled"].plan.facts() if f["name"] == "gep.embed_and_clip"]
    groups = gep.layer_groups(run["state"].params)
    shapes = {g: (_param_count(groups[g]), int(k))
              for g, k in sorted(stage["basis_per_group"].items())}
    return dict(groups=shapes, num_anchors=int(stage["num_anchors"]),
                batch_size=int(round(run["sampler"].expected_batch_size)))


def worker_gep_floor(spec: dict) -> dict:
    """A lower bound, on this machine, for any implementation of GEP's light step: only the
    matrix products the method cannot avoid, timed like a step. Per parameter group g (p_g
    coordinates, k_g basis vectors): the power iteration's two products over the m anchor
    gradients, (G B0^T)^T G (4 m p_g k_g FLOPs), and the embedding of the step's B examples
    (2 B p_g k_g), each one jitted product on random inputs of those shapes. Not counted:
    anchor and per-example gradients, the QR, the residual, the noise, the optimizer. When this
    alone exceeds a GEP target, no GEP step here can meet it.

    kind "gep_bound": the same products plus the least the two gradients cost, all in ONE
    jitted function: a plain (summed, not per-example) gradient of the m anchors at the
    current parameters, in chunks of ``ANCHOR_CHUNK``, and JAX's own non-private step on B
    examples (``worker_jax_nonprivate``'s, update included). Every GEP step does at least
    this; still not counted: per-example gradients and norms, the QR, the residual, noise."""
    import jax
    import jax.numpy as jnp

    run = build_dp_run(spec)
    shapes = gep_floor_shapes(run)
    m, b = shapes["num_anchors"], shapes["batch_size"]
    key = jax.random.PRNGKey(0)
    inputs = {}
    for i, (g, (p, k)) in enumerate(shapes["groups"].items()):
        ka, ks, kx = jax.random.split(jax.random.fold_in(key, i), 3)
        inputs[g] = (jax.random.normal(ka, (m, p)), jax.random.normal(ks, (k, p)),
                     jax.random.normal(kx, (b, p)))

    def products(inputs):
        return {g: ((anchors @ start.T).T @ anchors, examples @ start.T)
                for g, (anchors, start, examples) in inputs.items()}

    prepare, holder = (lambda t: None), {}
    if spec.get("kind") == "gep_bound":
        plain = _plain_step(spec)
        anchors = jnp.asarray(run["dataset"].public.images[:m])
        anchor_labels = jax.random.randint(key, (m,), 0, run["dataset"].num_classes)

        def work(inputs, p, s, images, labels, key):
            _, anchor_grads = accumulated_value_and_grad(plain["mean_loss"], p, anchors,
                                                         anchor_labels, ANCHOR_CHUNK)
            p, s, loss = plain["step"](p, s, images, labels, key)
            return products(inputs), anchor_grads, p, s, loss

        jitted = jax.jit(work, donate_argnums=(1, 2))
        prepare, holder = _batch_loader(plain), {"p": plain["params"], "s": plain["opt_state"]}

        def run_step(batch):
            out = jitted(inputs, holder["p"], holder["s"], *batch)
            holder["p"], holder["s"] = out[2], out[3]
            jax.block_until_ready(out)
    else:
        jitted = jax.jit(products)

        def run_step(_):
            jax.block_until_ready(jitted(inputs))

    timing = _timed_loop(spec["steps"], spec["warmup"], prepare, run_step)
    flops = sum((4 * m + 2 * b) * p * k for p, k in shapes["groups"].values())
    rate = flops / (timing["ms_median"] * 1e-3) if timing.get("ms_median") else None
    return dict(timing, pipeline="gep", flops=flops, gflop_per_s=None if rate is None else
                rate / 1e9, num_anchors=m, expected_batch_size=b,
                basis_per_group={g: k for g, (_, k) in shapes["groups"].items()})


def worker_interleaved(spec: dict) -> dict:
    """Every timed configuration of one batch size in this one process, their steps interleaved
    (benchmarks/interleave.py): the ratios' measurement. Each member is its own worker, built
    as when it runs alone."""
    members = [(m["label"], (lambda m=m: WORKERS[m["kind"]](m))) for m in spec["members"]]
    out = interleave.run_interleaved(members, spec["steps"], spec["blocks"], spec["pause_s"])
    for member, m in zip(out, spec["members"]):
        member["spec"] = {k: v for k, v in m.items() if k in SPEC_KEYS}
        member["result"] = {k: v for k, v in (member["result"] or {}).items()
                            if k in ("final_train_loss", "realized_mean", "padded_batch_size")}
    return dict(members=out, steps=spec["steps"], blocks=spec["blocks"],
                pause_s=spec["pause_s"])


WORKERS = {"dp": worker_dp, "jax_nonprivate": worker_jax_nonprivate,
           "torch_nonprivate": worker_torch_nonprivate, "opacus": worker_opacus,
           "calibration": worker_calibration, "main_job": worker_main_job,
           "interleaved": worker_interleaved, "gep_floor": worker_gep_floor,
           "gep_bound": worker_gep_floor}
# kinds run in the first round only (seconds, not ms/step; the interleaved run has its own)


def run_worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = dict(WORKERS[spec["kind"]](spec), ok=True)
    except Exception as e:  # noqa: BLE001 (recorded as a failed row, never a crash)
        result = dict(ok=False, error=f"{type(e).__name__}: {e}".strip(),
                      traceback=traceback.format_exc())
    result["peak_rss_mib"] = peak_rss_mib()
    if "jax" in sys.modules:  # the device the JAX rows ran on (a GPU report must name it)
        device = sys.modules["jax"].devices()[0]
        result["jax_device"] = f"{device.platform}: {device.device_kind}"
    Path(spec["result_path"]).write_text(json.dumps(result))
