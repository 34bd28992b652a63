"""What a finished run reports about its privacy: the privacy statement (from the ledger's
mechanisms) and what the run touches that its epsilon does not protect."""

from __future__ import annotations

from typing import Optional

import numpy as np

from dpbench import accounting, data, records
from dpbench.config import TrainConfig


def not_covered(dataset: data.Dataset, config: TrainConfig) -> list:
    """What a run touches that its epsilon does not protect, each with why (for the privacy
    statement): the splits carved from the training set, tuning, the non-private diagnostics,
    and, for a seeded benchmark run, the noise itself."""
    if len(dataset.validation):
        items = [dict(what=f"the validation split ({len(dataset.validation)} examples carved "
                           "from the training set)",
                      why="it chooses the reported model (the best validation step) and, in a "
                          "sweep, the configuration; its individuals are not protected")]
    else:  # a refit: every training example is private and protected by this run's epsilon
        items = [dict(what="the choice of this run's settings",
                      why="this run has no validation split (dataset.validation_size = 0) and "
                          "reports its last step's model; its settings were chosen on a "
                          "validation split in earlier runs on the same data, which is "
                          "hyperparameter tuning (below)")]
    if dataset.public is not None:
        items.append(dict(what=f"the public split ({len(dataset.public)} examples carved from "
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
                 " and the fidelity metrics" if config.fidelity_every_steps else "") +
                 " are computed from private batches without noise, and so is the decision "
                 "to stop a diverged run")]
    if config.seed is not None:
        items.append(dict(what=f"this run as a release (train.seed = {config.seed})",
                          why="a benchmark run derives all its noise from the recorded seed, "
                              "so anyone holding the record can regenerate the noise; a model "
                              "meant to be released needs train.seed = None"))
    return items


def privacy_statement(run, budget, config: TrainConfig, end_step: int,
                      epsilon: float, outside_stages: list = ()) -> dict:
    compiled, n = run.compiled, len(run.dataset.train)
    return records.privacy_statement(
        epsilon=epsilon, delta=budget.delta,
        mechanisms=[accounting.mechanism_fields(m) for m in compiled.ledger(end_step)
                    if m.count > 0],
        sampler=dict(run.sampler.describe(), dataset_size=n), steps=end_step,
        accountant=budget.accountant, accountant_version=accounting.accountant_version(),
        accountant_settings=accounting.accountant_settings(budget),
        accounting_note=accounting.accounting_note(compiled.run_event(end_step), budget),
        not_covered=not_covered(run.dataset, config), inputs=list(run.inputs),
        outside_stages=outside_stages, seed_secret=config.seed is None)


def fidelity_summary(config: TrainConfig, fidelity: dict) -> Optional[dict]:
    if not config.fidelity_every_steps:
        return None
    cosine, ratio = fidelity["cosine"], fidelity["noise_to_signal"]
    return dict(every_steps=config.fidelity_every_steps, samples=len(cosine),
                cosine_mean=float(np.mean(cosine)) if cosine else None,
                noise_to_signal_mean=float(np.mean(ratio)) if ratio else None,
                non_private=True)
