"""A finished run's record: its :class:`~dpbench.run.settings.Settings` plus its outcomes
(accuracies, the epsilon spent, timings, versions), the privacy statement generated from the
ledger of the mechanisms it ran, and what the run touches that its epsilon does not protect."""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from dpbench import accounting, data, numerics, records
from dpbench.models import registry as model_registry
from dpbench.compiler.sources import stage_sources
from dpbench.config import TrainConfig
from dpbench.run.settings import Settings


def run_record(settings: Settings, run, config: TrainConfig, state, progress, *, end_step: int,
               stop_reason: str, test_accuracy: float, gin_files, verified: dict,
               wall_time_s: float) -> dict:
    """The run record: the settings, then what the run did. ``verified`` maps each stage that
    is not dpbench's own to the checks it passed before training."""
    compiled, best = run.compiled, progress.best
    epsilon = compiled.epsilon_after(end_step)
    steady = progress.interval_step_s[1:] or progress.interval_step_s  # first holds compile
    sources = [dict(source, checks_passed=verified[source["stage"]])  # what dpbench verified
               for source in stage_sources(s.name for s in compiled.plan.stages)]
    code = outside_code(settings)
    return dict(
        settings.as_json(), gin_files=list(gin_files), epsilon=epsilon, steps=end_step,
        stop_reason=stop_reason, per_example_strategy=compiled.plan.strategy,
        per_example_strategy_reason=compiled.plan.strategy_reason or None,
        validation_accuracy=best["validation_accuracy"], best_step=best["step"],
        test_accuracy=test_accuracy, wall_time_s=wall_time_s,
        final_params_sha256=records.tree_sha256(state.params),
        final_params_fingerprint=numerics.params_fingerprint(state.params),
        model_parameters=int(sum(np.size(x) for x in jax.tree.leaves(state.params))),
        host_numerics=numerics.host_numerics(),
        resumed_from_steps=progress.resumed_from, nonfinite_examples=progress.nonfinite_total,
        fidelity=fidelity_summary(config, progress.fidelity),
        dp_event=accounting.event_to_json(compiled.run_event(end_step)),
        settings_sha256=settings.digest(), calibration_s=run.compile_s,
        median_step_s=float(np.median(steady)) if steady else None,
        versions=numerics.versions(), git_commit=records.git_commit(),
        git_dirty=records.git_dirty(), stage_sources=sources, outside_code=code,
        devices=[str(d) for d in run.mesh.devices.flat],
        device_kind=run.mesh.devices.flat[0].device_kind,  # e.g. 'cpu', 'NVIDIA H100 80GB HBM3'
        privacy_statement=statement_for(settings, run, end_step, epsilon, sources,
                                        diagnostics=bool(config.fidelity_every_steps),
                                        code=code),
        non_private_outputs=["train_loss, update_norm and nonfinite_examples in metrics.jsonl "
                             "are diagnostics computed from private batches; they are not "
                             "released by the accounted mechanism"] + (
            ["fidelity (fidelity_cosine, noise_to_signal) compares the release with the clean "
             "clipped gradient: non-private benchmark output"]
            if config.fidelity_every_steps else []))


def outside_code(settings: Settings) -> list:
    """The run's dataset and model where they are not dpbench's own: each registered
    function's module, file and sha256 (records.outside_source)."""
    registered = (("dataset", settings.dataset, data.dataset_loader(settings.dataset)),
                  ("model", settings.model, model_registry.model_spec(settings.model).build))
    return [dict(kind=kind, name=name, **source) for kind, name, obj in registered
            if (source := records.outside_source(obj)) is not None]


def not_covered(settings: Settings, diagnostics: bool = False) -> list:
    """What a run touches that its epsilon does not protect, each with why (for the privacy
    statement): the splits carved from the training set, tuning, the non-private diagnostics
    (``diagnostics``: the fidelity metrics too), and, for a seeded benchmark run, the noise."""
    if settings.validation_size:
        items = [dict(what=f"the validation split ({settings.validation_size} examples carved "
                           "from the training set)",
                      why="it chooses the reported model (the best validation step) and, in a "
                          "sweep, the configuration; its individuals are not protected")]
    else:  # a refit: every training example is private and protected by this run's epsilon
        items = [dict(what="the choice of this run's settings",
                      why="this run has no validation split (dataset.validation_size = 0) and "
                          "reports its last step's model; its settings were chosen on a "
                          "validation split in earlier runs on the same data, which is "
                          "hyperparameter tuning (below)")]
    if settings.public_size:
        items.append(dict(what=f"the public split ({settings.public_size} examples carved from "
                               "the training set)",
                          why="declared public and read without noise (e.g. GEP's anchor "
                              "gradients); its individuals are not protected"))
    items += [
        dict(what="the test split", why="its accuracy is reported without noise"),
        dict(what="hyperparameter tuning",
             why="choosing among several runs on the same private data costs privacy beyond "
                 "this one run's epsilon, which does not include it"),
        dict(what="the non-private diagnostics",
             why="train loss, update norm, non-finite counts" + (
                 " and the fidelity metrics" if diagnostics else "") +
                 " are computed from private batches without noise, and so is the decision "
                 "to stop a diverged run")]
    if not settings.branch_free_step:
        items.append(dict(what="the step's running time",
                          why="this benchmark run's step skips the micro-batches its Poisson "
                              "batch left empty, so its time depends on the realized batch "
                              "size, a function of who was sampled; a release run "
                              "(train.seed = None) compiles a step without data-dependent "
                              "branches"))
    if settings.seed is not None:
        items.append(dict(what=f"this run as a release (train.seed = {settings.seed})",
                          why="a benchmark run derives all its noise from the recorded seed, "
                              "so anyone holding the record can regenerate the noise; a model "
                              "meant to be released needs train.seed = None"))
    return items


def statement_for(settings: Settings, run, end_step: int, epsilon: float,
                  outside_stages: list = (), diagnostics: bool = False,
                  code: list = ()) -> dict:
    """The statement of a run with these settings after ``end_step`` steps, from the compiled
    pipeline's ledger (records.privacy_statement words it)."""
    compiled, budget = run.compiled, settings.budget()
    return records.privacy_statement(
        epsilon=epsilon, delta=settings.delta,
        mechanisms=[accounting.mechanism_fields(m) for m in compiled.ledger(end_step)
                    if m.count > 0],
        sampler=dict(settings.sampling, dataset_size=settings.dataset_size), steps=end_step,
        accountant=settings.accountant, accountant_version=settings.accountant_version,
        accountant_settings=accounting.accountant_settings(budget),
        accounting_note=accounting.accounting_note(compiled.run_event(end_step), budget),
        not_covered=not_covered(settings, diagnostics), inputs=list(run.inputs),
        outside_stages=outside_stages, outside_code=code, seed_secret=settings.seed is None,
        timing_protected=settings.branch_free_step)


def fidelity_summary(config: TrainConfig, fidelity: dict) -> Optional[dict]:
    """The fidelity diagnostics' means (non-private), or None when they were off."""
    if not config.fidelity_every_steps:
        return None
    cosine, ratio = fidelity["cosine"], fidelity["noise_to_signal"]
    return dict(every_steps=config.fidelity_every_steps, samples=len(cosine),
                cosine_mean=float(np.mean(cosine)) if cosine else None,
                noise_to_signal_mean=float(np.mean(ratio)) if ratio else None,
                non_private=True)
