"""WRN-16-4 step times: dpbench's DP-SGD step against a plain-JAX non-private step on the same
images, in one process, on whatever device JAX has (made for a lent GPU machine).

    python -m benchmarks.wrn_gpu --out=DIR [--steps=20] [--materialized_too]

Per setting (B examples x K augmentations): the DP-SGD step as `dpbench train` runs it (the
compiled step of run.build_run on Fashion-MNIST, its Poisson batches drawn beforehand, so the
host's batch assembly is not timed) and a non-private step (jax.grad of the mean loss over the
same B x K augmented images, an optax SGD update, one jitted function). Median of --steps
steps after 3 warm-up steps, each ended by blocking on its outputs. Writes DIR/wrn_gpu.json and
prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common import augmented_batch
from dpbench import accounting, config, models
from dpbench.run import build_run

SETTINGS = ((256, 16, 32), (1024, 1, 128))  # (B, augmult K, micro-batch)


def _timed(fn, count: int, warmup: int = 3) -> list:
    out = []
    for i in range(warmup + count):
        start = time.perf_counter()
        jax.block_until_ready(fn(i))
        if i >= warmup:
            out.append(time.perf_counter() - start)
    return out


def dp_sgd(batch: int, augmult: int, micro: int, steps: int, extra=(),
           materialized: bool = False) -> dict:
    """dpbench's DP-SGD step; ``materialized``: with book-keeping turned off (the compiler
    finds no tap layers), the per-example gradients vmapped, for the two strategies' ratio."""
    bindings = [f"train.batch_size = {batch}", f"train.micro_batch_size = {micro}",
                f"grad.per_example.augmult = {augmult}", *extra]
    if augmult > 1:
        bindings.append("grad.per_example.augmentation = 'crop_flip'")
    config.parse_config(["pipelines/dpsgd", "gin/data/fashion_mnist.gin",
                         "gin/model/wrn16_4.gin"], bindings)
    _, stages = config.pipeline_stages()
    with mock.patch("dpbench.compiler.facts.discover_taps", return_value=None) if materialized \
            else contextlib.nullcontext():
        run = build_run(stages, config.TrainConfig(), accounting.Budget())
    state = run.initial_state()
    batches = [run.host_batch(t) for t in range(steps + 3)]
    holder = {"state": state}

    def one(i):
        holder["state"], metrics = run.compiled.step(holder["state"], batches[i])
        return metrics["train_loss"]

    times = _timed(one, steps)
    return dict(step_s=statistics.median(times), padded_batch=run.sampler.padded_batch_size,
                strategy=run.compiled.plan.strategy,
                reason="turned off by the benchmark" if materialized else
                run.compiled.plan.strategy_reason,
                sigma=run.compiled.noise_multiplier, model=run.model, dataset=run.dataset,
                params=holder["state"].params)  # the first state was donated to the step


def non_private(model, params, images, labels, batch: int, augmult: int, steps: int) -> float:
    opt = optax.sgd(0.1)

    augment = augmented_batch(dict(augmult=augmult, crop_padding=4,
                                   augmentation="crop_flip" if augmult > 1 else "none"))

    @jax.jit
    def step(params, opt_state, x, y, key):
        x, y = augment(x, y, key)

        def loss(p):
            return jnp.mean(models.logits_loss(model.apply(p, x), y))
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    rng = np.random.default_rng(0)
    picks = [rng.choice(len(labels), batch, replace=False) for _ in range(steps + 3)]
    data = [(jnp.asarray(images[p]), jnp.asarray(labels[p])) for p in picks]
    holder = {"params": params, "opt": opt.init(params)}

    def one(i):
        holder["params"], holder["opt"], value = step(holder["params"], holder["opt"],
                                                      *data[i], jax.random.key(i))
        return value

    return statistics.median(_timed(one, steps))


def plain_vmap(model, params, images, labels, padded: int, micro: int, batch: int,
               steps: int) -> float:
    """A plain-JAX DP-SGD step at dpbench's padded batch: lax.scan over micro-batches of
    vmap(grad) per-example gradients, clipped to norm 1 and summed, Gaussian noise, SGD; no
    augmentation (for augmult 1 settings). What dpbench's materialized strategy does, written
    directly: the gap between the two is dpbench's own overhead."""
    def loss1(p, x, y):
        return models.logits_loss(model.apply(p, x[None]), y[None])[0]

    @jax.jit
    def step(p, x, y, key):
        def one(total, xy):
            g = jax.vmap(jax.grad(loss1), in_axes=(None, 0, 0))(p, *xy)
            norms = jnp.sqrt(sum(jnp.sum(leaf.reshape(leaf.shape[0], -1) ** 2, 1)
                                 for leaf in jax.tree.leaves(g)))
            scale = jnp.minimum(1.0, 1.0 / (norms + 1e-12))
            return jax.tree.map(lambda t, leaf: t + jnp.tensordot(scale, leaf, 1), total,
                                g), None
        xs = (x.reshape((-1, micro) + x.shape[1:]), y.reshape(-1, micro))
        total, _ = jax.lax.scan(one, jax.tree.map(jnp.zeros_like, p), xs)
        keys = jax.random.split(key, len(jax.tree.leaves(p)))
        noise = jax.tree.unflatten(jax.tree.structure(p), [
            jax.random.normal(k, leaf.shape) for k, leaf in zip(keys, jax.tree.leaves(p))])
        return jax.tree.map(lambda w, t, n: w - 0.1 * (t + n) / batch, p, total, noise)

    x, y = jnp.asarray(images[:padded]), jnp.asarray(labels[:padded])
    holder = {"p": params}

    def one_step(i):
        holder["p"] = step(holder["p"], x, y, jax.random.key(i))
        return holder["p"]

    return statistics.median(_timed(one_step, steps))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--settings", nargs="+", default=None,
                        help="B,augmult,micro-batch triples (default: 256,16,32 1024,1,128)")
    parser.add_argument("--binding", action="append", default=[],
                        help="extra gin bindings, e.g. 'model.depth = 10' for a CPU smoke run")
    parser.add_argument("--materialized_too", action="store_true",
                        help="also time the DP-SGD step with book-keeping turned off")
    parser.add_argument("--also", action="append", default=[],
                        help="also time the DP-SGD step with this gin binding added (an A/B of "
                             "a step knob, e.g. \"train.conv_grads = 'convolution'\")")
    args = parser.parse_args(argv)
    settings = SETTINGS if args.settings is None else [
        tuple(int(v) for v in s.split(",")) for s in args.settings]
    device = jax.devices()[0]
    rows = []
    for batch, augmult, micro in settings:
        dp = dp_sgd(batch, augmult, micro, args.steps, args.binding)
        train_split = dp["dataset"].train
        plain = non_private(dp["model"], dp["params"], train_split.images, train_split.labels,
                            batch, augmult, args.steps)
        vmap_ms = None if augmult > 1 else 1e3 * plain_vmap(
            dp["model"], dp["params"], train_split.images, train_split.labels,
            dp["padded_batch"], micro, batch, args.steps)
        slow_ms = 1e3 * dp_sgd(batch, augmult, micro, args.steps, args.binding,
                               materialized=True)["step_s"] if args.materialized_too else None
        also_ms = {b: 1e3 * dp_sgd(batch, augmult, micro, args.steps, [*args.binding, b])[
            "step_s"] for b in args.also}
        rows.append(dict(batch=batch, augmult=augmult, micro_batch=micro,
                         dp_sgd_also_ms=also_ms,
                         padded_batch=dp["padded_batch"], dp_sgd_ms=1e3 * dp["step_s"],
                         dp_sgd_materialized_ms=slow_ms,
                         non_private_ms=1e3 * plain, ratio=dp["step_s"] / plain,
                         plain_vmap_at_padded_ms=vmap_ms,
                         strategy=dp["strategy"], reason=dp["reason"], sigma=dp["sigma"]))
        print(json.dumps(rows[-1]), flush=True)
    result = dict(device=f"{device.platform}: {device.device_kind}", jax=jax.__version__,
                  steps=args.steps, bindings=args.binding, rows=rows)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "wrn_gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{result['device']}, JAX {result['jax']}, median of {args.steps} steps\n")
    print("| B x augmult (micro-batch; padded B) | JAX non-private ms | DP-SGD ms (strategy) | "
          "ratio | DP-SGD materialized ms | plain-JAX vmap DP-SGD at padded B ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        vmap, slow = ("n/a" if v is None else f"{v:.1f}" for v in (
            r["plain_vmap_at_padded_ms"], r["dp_sgd_materialized_ms"]))
        print(f"| {r['batch']} x {r['augmult']} ({r['micro_batch']}; {r['padded_batch']}) | "
              f"{r['non_private_ms']:.1f} | {r['dp_sgd_ms']:.1f} ({r['strategy']}) | "
              f"{r['ratio']:.2f}x | {slow} | {vmap} |")
        for binding, ms in r["dp_sgd_also_ms"].items():
            print(f"|   DP-SGD with `{binding}` | | {ms:.1f} | {ms / r['dp_sgd_ms']:.2f}x "
                  "DP-SGD | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
