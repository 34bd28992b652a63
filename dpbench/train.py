"""The one train loop: data -> sampler -> compiled step -> evaluation -> run record."""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
from pathlib import Path
from typing import Optional, Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from dpbench import accounting, compiler, data, models, records, sampling, sharding
from dpbench.stages.base import Stage


@gin.configurable("pipeline")
def pipeline_stages(stages: Sequence[Stage] = gin.REQUIRED, name: str = "unnamed") -> tuple:
    """The pipeline's stages, as listed in its gin file (``pipeline.stages = %STAGES``)."""
    return name, tuple(stages)


@gin.configurable("train")
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Run-level settings (bind as ``train.batch_size = 2048`` etc.).

    batch_size is the EXPECTED batch size B; the sampling rate is q = B / N.
    seed=None draws every key from the OS and writes none of them anywhere (for a run that is
    meant to be released); an integer seed makes a benchmark run reproducible.
    noise_multiplier=None calibrates sigma to the budget; a number is for non-private baselines.
    """

    batch_size: int = 256
    epochs: float = 30.0
    micro_batch_size: int = 64
    seed: Optional[int] = 0
    ema_decay: float = 0.0
    eval_every_steps: int = 0  # 0: once per epoch
    log_every_steps: int = 50
    eval_batch_size: int = 1000
    noise_multiplier: Optional[float] = None

    def validate(self):
        if not isinstance(self.batch_size, int) or self.batch_size <= 0:
            raise ValueError(f"train.batch_size must be a positive integer, got "
                             f"{self.batch_size!r}")
        if not isinstance(self.epochs, (int, float)) or not self.epochs > 0:
            raise ValueError(f"train.epochs must be > 0, got {self.epochs!r}")


def _evaluate(apply_fn, params, split: data.Split, batch_size: int) -> float:
    correct = 0
    for start in range(0, len(split), batch_size):
        images = split.images[start:start + batch_size]
        labels = split.labels[start:start + batch_size]
        correct += int(apply_fn(params, images, labels))
    return correct / max(len(split), 1)


def check_workdir(workdir: Path) -> None:
    record = Path(workdir) / records.RECORD_NAME
    if record.exists():
        raise FileExistsError(f"{record} holds a finished run; pick a new --workdir (finished "
                              "results are never overwritten)")


def train(workdir: str | Path, config: Optional[TrainConfig] = None,
          budget: Optional[accounting.Budget] = None, gin_files: Sequence[str] = ()) -> dict:
    """Trains the configured pipeline and writes metrics and the run record into ``workdir``."""
    wall_start = time.time()
    workdir = Path(workdir)
    check_workdir(workdir)
    config = TrainConfig() if config is None else config
    config.validate()
    budget = accounting.Budget() if budget is None else budget
    pipeline_name, stages = pipeline_stages()
    compiler.validate_pipeline(stages)  # fail on a bad pipeline before loading any data
    dataset = data.load_dataset()
    n = len(dataset.train)
    budget.validate(n)
    model = models.make_model(dataset.num_classes)
    loss_fn = models.cross_entropy_loss(model)
    example_shape = dataset.input_shape

    seed = config.seed if config.seed is not None else secrets.randbits(63)
    seeds = np.random.SeedSequence(seed).generate_state(3)
    params_key, run_key = jax.random.key(int(seeds[0])), jax.random.key(int(seeds[1]))
    mesh = sharding.make_mesh()
    sampler = sampling.make_sampler(n, config.batch_size, seed=int(seeds[2]),
                                    pad_multiple=config.micro_batch_size)
    steps_per_epoch = n / config.batch_size
    total_steps = int(math.ceil(config.epochs * steps_per_epoch))

    def init_params(key):
        return model.init(key, jnp.zeros((1,) + tuple(example_shape), jnp.float32))

    t0 = time.time()
    compiled = compiler.compile_pipeline(
        stages, loss_fn=loss_fn, init_params=init_params, example_shape=example_shape,
        sampler=sampler, budget=budget, total_steps=total_steps,
        steps_per_epoch=max(int(round(steps_per_epoch)), 1),
        micro_batch_size=config.micro_batch_size, mesh=mesh, ema_decay=config.ema_decay,
        noise_multiplier=config.noise_multiplier,
        public_images=None if dataset.public is None else dataset.public.images,
        num_classes=dataset.num_classes,
        linear_apply=models.linearized(dataset.num_classes).apply)
    calibration_s = time.time() - t0
    logging.info("pipeline %s: sigma=%.5f sensitivity=%g steps=%d q=%.5g padded batch=%d "
                 "(calibrated in %.1fs)", pipeline_name, compiled.noise_multiplier,
                 compiled.sensitivity, total_steps, sampler.sampling_rate,
                 sampler.padded_batch_size, calibration_s)
    workdir.mkdir(parents=True, exist_ok=True)
    records.atomic_write_text(workdir / "config.gin", gin.config_str())

    release_batch = None
    if compiled.needs_release_batch:
        # a one-off accounted release before training (DP-SNIP), on a batch of the same sampler
        pre = sampler.sample(sampling.PRE_TRAINING_STEP)
        release_batch = sharding.put_batch(compiled.batch_layout({
            "image": dataset.train.images[pre.indices], "label": dataset.train.labels[pre.indices],
            "mask": pre.mask}), mesh)
    state = compiled.init_state(init_params(params_key), run_key, release_batch)
    eval_fn = jax.jit(lambda p, x, y: jnp.sum(jnp.argmax(model.apply(p, x), -1) == y))
    eval_every = config.eval_every_steps or max(int(round(steps_per_epoch)), 1)
    best = {"validation_accuracy": -1.0, "step": 0, "params": None}
    interval_step_s = []  # seconds per step over each log interval (first one holds compile)
    last_log_time, last_log_step = time.time(), 0
    for step in range(total_steps):
        indices = sampler.sample(step)
        batch = compiled.batch_layout({
            "image": dataset.train.images[indices.indices],
            "label": dataset.train.labels[indices.indices],
            "mask": indices.mask})
        batch = sharding.put_batch(batch, mesh)
        state, metrics = compiled.step(state, batch)
        done = step + 1
        if done % config.log_every_steps == 0 or done == total_steps:
            jax.block_until_ready(state)
            now = time.time()
            rate = (done - last_log_step) / max(now - last_log_time, 1e-9)
            interval_step_s.append(1.0 / rate)
            last_log_time, last_log_step = now, done
            epsilon = compiled.epsilon_after(done)
            loss = float(metrics["train_loss"])
            logging.info("step %d/%d  %.2f steps/s  epsilon spent %.4f  loss %.4f",
                         done, total_steps, rate, epsilon, loss)
            records.append_metrics(workdir, dict(step=done, steps_per_s=rate, epsilon=epsilon,
                                                 train_loss=loss, wall_s=now - wall_start))
            if not math.isfinite(loss):
                raise FloatingPointError(f"training loss became {loss} at step {done}; lower "
                                         "optimize.optax.learning_rate")
        if done % eval_every == 0 or done == total_steps:
            params = state.ema_params if config.ema_decay > 0 else state.params
            val_acc = _evaluate(eval_fn, params, dataset.validation, config.eval_batch_size)
            logging.info("step %d  validation accuracy %.4f", done, val_acc)
            records.append_metrics(workdir, dict(step=done, validation_accuracy=val_acc))
            if val_acc > best["validation_accuracy"]:
                best = {"validation_accuracy": val_acc, "step": done,
                        "params": jax.device_get(params)}
    test_acc = _evaluate(eval_fn, best["params"], dataset.test, config.eval_batch_size)
    epsilon = compiled.epsilon_after(total_steps)
    steady = interval_step_s[1:] or interval_step_s
    sampler_info = sampler.describe()
    statement = records.privacy_statement(
        epsilon=epsilon, delta=budget.delta, noise_multiplier=compiled.noise_multiplier,
        sensitivity=compiled.sensitivity, steps=total_steps, sampler=sampler_info,
        accountant=budget.accountant, accountant_version=accounting.accountant_version(),
        releases_per_step=sum(1 for s in compiled.stages if s.is_release),
        one_off_releases=[dict(stage=s.name, noise_multiplier=compiled.init_noise_multiplier,
                               l2_bound=s.init_release.l2_bound)
                          for s in compiled.stages if s.init_release is not None])
    record = dict(
        pipeline=pipeline_name, gin_files=list(gin_files),
        stages=[dict(name=s.name, **s.options) for s in compiled.stages],
        dataset=dataset.name, model=gin.query_parameter("model.name"),
        dataset_size=n, validation_size=len(dataset.validation),
        target_epsilon=budget.epsilon, epsilon=epsilon, delta=budget.delta,
        accountant=budget.accountant, noise_multiplier=compiled.noise_multiplier,
        l2_sensitivity=compiled.sensitivity, batch_size=config.batch_size,
        epochs=config.epochs, steps=total_steps, sampling=sampler_info,
        seed=config.seed,  # None for a release run: its OS-drawn seed is never written
        ema_decay=config.ema_decay,
        validation_accuracy=best["validation_accuracy"], best_step=best["step"],
        test_accuracy=test_acc, wall_time_s=time.time() - wall_start,
        calibration_s=calibration_s, median_step_s=float(np.median(steady)),
        versions=records.versions(), git_commit=records.git_commit(),
        devices=[str(d) for d in mesh.devices.flat], privacy_statement=statement,
        non_private_outputs=["train_loss and update_norm in metrics.jsonl are diagnostics "
                             "computed from private batches; they are not released by the "
                             "accounted mechanism"])
    records.atomic_write_text(workdir / "operative_config.gin", gin.operative_config_str())
    records.atomic_write_text(workdir / records.RECORD_NAME, records.to_json(record))
    logging.info("done: test accuracy %.4f (best validation %.4f at step %d), epsilon %.4f",
                 test_acc, best["validation_accuracy"], best["step"], epsilon)
    logging.info("privacy: %s", statement["statement"])
    return record
