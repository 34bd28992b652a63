"""A pipeline's compiled step, sized by XLA's own buffer plan: the temporary, argument and
output bytes of the step `dpbench train` would run, without running it (no device memory is
allocated, so a CPU machine sizes a GPU run; the GPU's plan differs in layout and fusion, so
read it as an estimate, within tens of percent).

    python -m benchmarks.step_memory --gin_file=pipelines/gep --gin_file=gin/model/mlp.gin \\
        --binding="model.hidden = (2048, 2048)" --batch_size=4096 --micro_batch_sizes 1024 256

One JSON line per micro-batch size: the padded batch, the per-example strategy and the plan's
GiB (leaderboard/PERF-gpu.md: GEP on the 5.8M-parameter MLP).
"""

from __future__ import annotations

import argparse
import json
import time

GIB = 1 << 30


def step_memory(gin_files, bindings, batch_size: int, micro_batch_size: int) -> dict:
    """XLA's buffer plan of the compiled step for these settings (noise multiplier fixed at 1:
    the plan does not depend on it, and no calibration is needed)."""
    import jax

    from dpbench import accounting, config
    from dpbench.run import build_run

    config.parse_config(list(gin_files), [*bindings, f"train.batch_size = {batch_size}",
                                          f"train.micro_batch_size = {micro_batch_size}",
                                          "train.noise_multiplier = 1.0"])
    _, stages = config.pipeline_stages()
    start = time.time()
    run = build_run(stages, config.TrainConfig(), accounting.Budget())
    compiled = run.compiled
    batch_shapes = jax.eval_shape(lambda: run.host_batch(0))
    plan = compiled.step.lower(compiled.state_shapes, batch_shapes).compile().memory_analysis()
    return dict(batch_size=batch_size, micro_batch_size=micro_batch_size,
                padded_batch=run.sampler.padded_batch_size, strategy=compiled.plan.strategy,
                temp_gib=plan.temp_size_in_bytes / GIB,
                arguments_gib=plan.argument_size_in_bytes / GIB,
                outputs_gib=plan.output_size_in_bytes / GIB,
                device=jax.devices()[0].platform, seconds=time.time() - start)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gin_file", action="append", required=True,
                        help="the pipeline first (pipelines/<name>), then data and model files")
    parser.add_argument("--binding", action="append", default=[])
    parser.add_argument("--batch_size", type=int, required=True)
    parser.add_argument("--micro_batch_sizes", type=int, nargs="+", required=True)
    args = parser.parse_args(argv)
    files = list(args.gin_file)
    if not any(f.startswith("gin/data/") for f in files):
        files.insert(1, "gin/data/fashion_mnist.gin")
    for micro in args.micro_batch_sizes:
        print(json.dumps(step_memory(files, args.binding, args.batch_size, micro)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
