"""The speed benchmark's plan: its options and the configurations one run measures."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.common import (GEP_BOUNDS, GEP_FAMILY, OPACUS_MODES, PIPELINE_DIR,
                                 REPO_ROOT, TIMED)




# ---------------------------------------------------------------------------------------------
# The orchestrating process
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Options:
    steps: int = 30
    warmup: int = 3
    batch_sizes: tuple = (256, 1024)
    pipelines: str = "all"
    out: Optional[str] = None
    skip_torch: bool = False
    micro_batch_sizes: tuple = ((None, 32),)  # (B, size); B None: any other
    data_gin: str = "gin/data/fashion_mnist.gin"
    model_gin: str = "gin/model/tanh_cnn.gin"
    gin_bindings: tuple = ()
    noise_multiplier: Optional[float] = 1.0  # None: calibrated
    logical_batch: int = 4096
    gep_paper_anchors: int = 2000
    gep_paper_basis: int = 500
    gep_floor: bool = True  # GEP light's lower bounds (benchmarks.common.GEP_BOUNDS) with gep
    gep_refresh_every: int = 10  # GEP/B-GEP light with the basis every r steps (0 or 1: none)
    opacus_modes: tuple = OPACUS_MODES
    torch_threads: int = 0
    calibration: bool = True
    calibration_batch_size: int = 1024
    calibration_epochs: float = 30.0
    calibration_repeats: int = 3
    main_job: bool = True  # train the README's main job once and report its wall time
    config_timeout: int = 3600
    rounds: int = 3  # every configuration runs once per round, round-robin
    interleaved_steps: int = 60  # per configuration in the interleaved run (0: none)
    pause_s: float = 0.02  # between two interleaved turns (untimed)
    command: str = ""


def pipeline_names(selection: str) -> list:
    known = sorted(p.parent.name for p in PIPELINE_DIR.glob("*/pipeline.gin"))
    if selection.strip() in ("", "all"):
        names = known
    else:
        names = [s.strip() for s in selection.split(",") if s.strip()]
        unknown = [s for s in names if s not in known]
        if unknown:
            raise ValueError(f"unknown pipelines {unknown}; known: {', '.join(known)}")
    return sorted(names, key=lambda s: (s != "dpsgd", known.index(s)))


def _gin_files(options: Options, pipeline: str) -> list:
    files = [f"pipelines/{pipeline}/pipeline.gin", options.data_gin]
    if options.model_gin:
        files.append(options.model_gin)
    return files


def micro_batch_size_for(options: Options, batch_size: int) -> int:
    sizes = dict(options.micro_batch_sizes)
    return int(sizes.get(batch_size, sizes.get(None, 128)))


def parse_micro_batch_sizes(items: Sequence[str]) -> tuple:
    """'256:64', '128' -> ((256, 64), (None, 128))."""
    out = []
    for item in items:
        b, _, size = item.rpartition(":")
        out.append((int(b) if b else None, int(size)))
    return tuple(out)


def _bindings(options: Options, batch_size: int, extra: Sequence[str] = ()) -> list:
    return [f"train.batch_size = {int(batch_size)}",
            f"train.micro_batch_size = {micro_batch_size_for(options, batch_size)}",
            *options.gin_bindings, *extra]


def torch_settings(options: Options) -> dict:
    """What the torch rows must match, read off the DP-SGD pipeline's gin configuration: the
    dataset split, the model, the optimizer, the clip bound. {'skip': reason} when the model has
    no torch twin here (only the tanh CNN on 28x28x1 has one)."""
    import gin

    from dpbench import config as dpconfig

    dpconfig.parse_config(_gin_files(options, "dpsgd"), _bindings(options, 256))
    model = dict(gin.get_bindings("model"))
    if model.get("name") != "tanh_cnn" or model.get("group_norm_groups", 0) or \
            model.get("activation", "tanh") != "tanh":
        return {"skip": f"the torch twin exists for model tanh_cnn (tanh, no GroupNorm) only, "
                        f"not {model}"}
    _, stages = dpconfig.pipeline_stages()
    clip = [s for s in stages if s.name == "clip.global_l2"]
    optimizer = stages[-1].options
    dataset_kwargs = dict(gin.get_bindings("dataset"))
    config = dpconfig.TrainConfig()
    gin.clear_config()
    from dpbench import data
    shape = data.load_dataset(**dataset_kwargs).input_shape
    if tuple(shape) != (28, 28, 1):
        return {"skip": f"the torch tanh CNN takes 28x28x1 images, the data has {shape}"}
    return dict(dataset_kwargs=dataset_kwargs,
                model=dict(center_inputs=bool(model.get("center_inputs", True))),
                optimizer=dict(optimizer=optimizer["optimizer"],
                               learning_rate=optimizer["learning_rate"],
                               momentum=optimizer["momentum"], nesterov=optimizer["nesterov"]),
                l2_bound=clip[0].privacy.l2_bound,
                seed=config.seed if config.seed is not None else 0)


def torch_available() -> Optional[str]:
    """None when torch and opacus import (checked in a subprocess: this one stays torch-free),
    else why not."""
    probe = subprocess.run([sys.executable, "-c", "import torch, opacus"], capture_output=True,
                           text=True, timeout=600)
    if probe.returncode == 0:
        return None
    last = (probe.stderr.strip().splitlines() or ["import failed"])[-1]
    return f"torch/opacus not importable ({last}); install with bash tools/install.sh '[bench]'"


def plan(options: Options, torch_info: dict) -> list:
    """The configurations, in run order: (row label, spec) pairs."""
    names = pipeline_names(options.pipelines)
    common = dict(steps=options.steps, warmup=options.warmup)
    sigma = options.noise_multiplier
    configs = []
    for b in options.batch_sizes:
        configs.append(dict(common, kind="jax_nonprivate", label="JAX non-private",
                            group="nonprivate_jax", batch_size=b,
                            gin_files=_gin_files(options, "dpsgd"), bindings=_bindings(options, b)))
        if "skip" not in torch_info:
            tcommon = dict(common, batch_size=b,
                           micro_batch_size=micro_batch_size_for(options, b),
                           torch_threads=options.torch_threads or os.cpu_count(),
                           noise_multiplier=1.0 if sigma is None else sigma, **torch_info)
            configs.append(dict(tcommon, kind="torch_nonprivate", label="torch non-private",
                                group="nonprivate_torch"))
            for mode in options.opacus_modes:
                configs.append(dict(tcommon, kind="opacus", mode=mode, group="opacus",
                                    label=f"Opacus DP-SGD ({mode})"))
        for name in names:
            extra_settings = [("", [])]
            if name == "gep" and options.gep_paper_anchors > 0:
                extra_settings = [(" (light)", []), (" (paper)", [
                    f"dataset.public_size = {options.gep_paper_anchors}",
                    f"gep.embed_and_clip.num_anchors = {options.gep_paper_anchors}",
                    f"gep.embed_and_clip.num_basis = {options.gep_paper_basis}",
                    "gep.embed_and_clip.power_iterations = 1"])]
            elif name in GEP_FAMILY:
                extra_settings = [(" (light)", [])]
            if name in GEP_FAMILY and options.gep_refresh_every > 1:
                extra_settings.append((f" (light, r={options.gep_refresh_every})", [
                    f"gep.embed_and_clip.basis_refresh_every = {options.gep_refresh_every}"]))
            for suffix, extra in extra_settings:
                every = options.gep_refresh_every if "r=" in suffix else 1
                configs.append(dict(common, kind="dp", label=f"dpbench {name}{suffix}",
                                    group="dpbench", pipeline=name,
                                    setting=suffix.strip(" ()") or None, batch_size=b,
                                    noise_multiplier=sigma, gin_files=_gin_files(options, name),
                                    bindings=_bindings(options, b, extra),
                                    **({"steps_per_timing": every, "warmup": 1,
                                        "steps": max(3, options.steps // every)}
                                       if every > 1 else {})))  # as many steps as the others
            if name == "gep" and options.gep_floor:
                for group, label in GEP_BOUNDS.items():
                    configs.append(dict(common, kind=f"gep_{group}", label=label, group=group,
                                        pipeline=name, setting="light", batch_size=b,
                                        noise_multiplier=sigma,
                                        gin_files=_gin_files(options, name),
                                        bindings=_bindings(options, b)))
    if options.interleaved_steps > 0:
        for b in options.batch_sizes:
            members = [dict(c, steps=options.interleaved_steps) for c in configs
                       if c["kind"] in TIMED and c["batch_size"] == b
                       and "steps_per_timing" not in c]  # its unit is r steps: rounds only
            configs.append(dict(kind="interleaved", group="interleaved", batch_size=b,
                                label="interleaved run", members=members,
                                steps=options.interleaved_steps, blocks=max(1, options.rounds),
                                pause_s=options.pause_s))
    if options.logical_batch > 0 and "dpsgd" in names:
        b = options.logical_batch
        configs.append(dict(common, kind="dp", group="logical", pipeline="dpsgd",
                            label=f"dpbench dpsgd, logical batch {b} "
                                  f"(micro-batches of {micro_batch_size_for(options, b)})",
                            batch_size=b, noise_multiplier=sigma,
                            gin_files=_gin_files(options, "dpsgd"), bindings=_bindings(options, b)))
    if options.main_job:
        configs.append(dict(kind="main_job", group="main_job", label="main job (DP-SGD, 30 "
                            "epochs)", batch_size=1024, gin_files=["pipelines/dpsgd/pipeline.gin"],
                            bindings=[]))
    if options.calibration:
        b = options.calibration_batch_size
        configs.append(dict(kind="calibration", group="calibration", label="sigma calibration",
                            batch_size=b, accountants=["rdp", "pld"],
                            repeats=options.calibration_repeats,
                            gin_files=_gin_files(options, "dpsgd"),
                            bindings=_bindings(options, b, [
                                f"train.epochs = {options.calibration_epochs!r}"])))
    return configs


def run_config(spec: dict, timeout: int, workdir: Path, index: int) -> dict:
    spec_path = workdir / f"config{index:02d}.json"
    spec = dict(spec, result_path=str(workdir / f"result{index:02d}.json"))
    spec_path.write_text(json.dumps(spec))
    log_path = workdir / f"config{index:02d}.log"
    start = time.time()
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.speed",
                                   f"--worker={spec_path}"], cwd=REPO_ROOT, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    wall = time.time() - start
    result_path = Path(spec["result_path"])
    if result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        result = dict(ok=False, error=f"worker exited with {rc} after {wall:.0f}s, no result: "
                                      + " | ".join(tail))
    result["wall_s"] = wall
    return result
