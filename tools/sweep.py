"""The leaderboard sweep: every method x configuration x epsilon x seed on Fashion-MNIST.

Usage:
  .venv/bin/python tools/sweep.py [--epsilons 1 3] [--seeds 0 1 2] [--methods dpsgd rs ...]
                                  [--records leaderboard/records] [--dry_run]
  .venv/bin/dpbench leaderboard

Each run's workdir is <records>/fashion_mnist__tanh_cnn__eps<E>__delta1e-05/<method>-<config>-
seed<S>; a workdir with a run record is skipped and one with checkpoints resumes, so the sweep
can be interrupted and rerun. Configurations are chosen by the board on validation accuracy only;
'configs tried' on the board counts them. Cost on 2 CPU cores: about 6 minutes per run (GEP and
B-GEP about 17), so the full grid below is a GPU job or a long weekend.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DELTA = "1e-05"

# method -> {config name: (gin file, bindings)}; the first config is the pipeline's default.
GRID = {
    "dpsgd": {"lr4": ("pipelines/dpsgd.gin", []),
              "lr2": ("pipelines/dpsgd.gin", ["optimize.optax.learning_rate = 2.0"])},
    "rs": {"r0.7": ("pipelines/rs.gin", []),
           "r0.9": ("pipelines/rs.gin", ["sparsify.random_mask.final_rate = 0.9"])},
    "dpssgd-random": {"d0.5": ("pipelines/dpssgd.gin", ["PRUNE = @prune.random()",
                                                         "pipeline.name = 'dpssgd-random'"]),
                      "mag0.5": ("pipelines/dpssgd.gin", ["PRUNE = @prune.random()",
                                                           "drop.gradients.criterion = "
                                                           "'magnitude'",
                                                           "pipeline.name = 'dpssgd-random'"])},
    "dpssgd-synflow": {"d0.5": ("pipelines/dpssgd.gin", ["PRUNE = @prune.synflow()",
                                                          "pipeline.name = 'dpssgd-synflow'"])},
    "dpssgd-dp_snip": {"d0.5": ("pipelines/dpssgd.gin", ["PRUNE = @prune.dp_snip()",
                                                          "pipeline.name = 'dpssgd-dp_snip'"])},
    "gip": {"k0.1": ("pipelines/gip.gin", []),
            "k0.3": ("pipelines/gip.gin", ["select.gip.k_end = 0.3"])},
    "randomk": {"k0.1": ("pipelines/randomk.gin", [])},
    "nasr": {"tau1e-3": ("pipelines/nasr.gin", [])},
    "gep": {"m512": ("pipelines/gep.gin", [])},
    "bgep": {"m512": ("pipelines/bgep.gin", [])},
}


def runs(epsilons, seeds, methods, records: Path):
    for eps in epsilons:
        group = records / f"fashion_mnist__tanh_cnn__eps{float(eps)}__delta{DELTA}"
        for method in methods:
            for config, (gin_file, bindings) in GRID[method].items():
                for seed in seeds:
                    workdir = group / f"{method}-{config}-seed{seed}"
                    command = [str(REPO / ".venv/bin/dpbench"), f"--gin_file={gin_file}",
                               f"--gin_bindings=EPSILON = {float(eps)}",
                               f"--gin_bindings=train.seed = {seed}",
                               *[f"--gin_bindings={b}" for b in bindings],
                               f"--workdir={workdir}"]
                    yield workdir, command


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 3.0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(GRID), choices=list(GRID))
    parser.add_argument("--records", type=Path, default=REPO / "leaderboard" / "records")
    parser.add_argument("--dry_run", action="store_true")
    args = parser.parse_args(argv)
    failed = 0
    for workdir, command in runs(args.epsilons, args.seeds, args.methods, args.records):
        if (workdir / "run_record.json").exists():
            continue
        print(" ".join(command), flush=True)
        if args.dry_run:
            continue
        workdir.mkdir(parents=True, exist_ok=True)
        with open(workdir.parent / f"{workdir.name}.log", "a") as log:
            if subprocess.run(command, cwd=REPO, stderr=log, stdout=log).returncode:
                failed += 1
                print(f"FAILED: {workdir} (log: {workdir.parent / workdir.name}.log)",
                      file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
