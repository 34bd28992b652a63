"""What a sweep's search runs, before any trial: per group, ``search.json`` (J, every method's
trial bindings, the events of the space's privacy support from the compiler's own accounting)."""

from __future__ import annotations

import json
from pathlib import Path

from dpbench import records as records_lib
from dpbench.search import tuning
from dpbench.search.protocol import ProtocolError, at_epsilon
from dpbench.search.space import privacy_support, trial_bindings

SEARCH_FILE = tuning.SEARCH_FILE


def check_trials(method: str, gin_files, trials, run_bindings) -> None:
    """Before anything is written or trained: every trial of ``method`` parses with gin
    exactly as its run will (its gin files, its bindings, then ``run_bindings``), so a
    misspelled key is refused here, not as a failed trial; and the pipeline those files name
    is ``method`` (the board ranks records by their pipeline's name); and trial 0's stages that
    are not dpbench's own pass their declaration checks (each trial's run checks its own)."""
    from dpbench import config
    from dpbench.compiler import check as stage_check

    for t, bindings in enumerate(trials):
        try:
            config.parse_config(list(gin_files), [*bindings, *run_bindings])
            name, _ = config.pipeline_stages()
        except (config.ConfigError, ValueError, TypeError) as e:
            raise ProtocolError(f"method {method!r}, trial {t}: its settings do not parse "
                                f"({e}); fix the key in the protocol") from e
        if name != method:
            raise ProtocolError(
                f"method {method!r} runs {gin_files[0]}, whose pipeline.name is {name!r}: a "
                f"protocol's method key must be its pipeline's name (the board ranks records "
                f"by it); rename the key to {name!r} or set pipeline.name = '{method}'")
    config.parse_config(list(gin_files), [*trials[0], *run_bindings])
    try:
        stage_check.verify_pipeline(config.pipeline_stages()[1])
    except stage_check.StageCheckError as e:
        raise ProtocolError(f"method {method!r}: {e}") from e


def support_event(gin_files, bindings) -> dict:
    """The DpEvent (JSON) a run with these settings would have, from the compiler's own
    accounting (run.build.run_event: no step is lowered, traced or jitted); nothing trains."""
    from dpbench import accounting, config
    from dpbench.run import build as run_build
    config.parse_config(list(gin_files), list(bindings))
    _, stages = config.pipeline_stages()
    return accounting.event_to_json(run_build.run_event(stages, config.TrainConfig(),
                                                      accounting.Budget()))


def support_events(tasks, workers: int) -> list:
    """support_event of each (gin_files, bindings), on ``workers`` fresh processes (each call
    loads the data and calibrates sigma: seconds each, hundreds per board)."""
    if workers <= 1 or len(tasks) <= 1:
        return [support_event(*t) for t in tasks]
    import concurrent.futures
    import multiprocessing
    with concurrent.futures.ProcessPoolExecutor(
            max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(support_event, *zip(*tasks)))


def secret_generator():
    """A generator seeded from the operating system's entropy, never from a recorded seed: a
    secret search's J and its random trials come from one."""
    import numpy as np
    return np.random.default_rng()


def secret_num_random(trials: dict, rng=None) -> tuple[dict, int]:
    """(the law, J) of a secret search: J drawn from the deployment's law (tuning.secret_law)
    with ``rng`` (a fresh :func:`secret_generator` when None)."""
    law = tuning.secret_law(trials)
    rng = secret_generator() if rng is None else rng
    return law, tuning.sample_trial_count(rng, float(law["mean_random"]), tuning.shape_of(law))


def plan_group(protocol: dict, family: str, epsilon: float, methods, workers: int = 1,
               secret: bool = False) -> dict:
    """What search.json holds for one group (trial bindings and the support's events). A
    ``secret`` search draws J from the deployment's law and its trials i.i.d., both from OS
    entropy (never from the protocol's public seed), and its trials train with ``train.seed =
    None`` (seeds [None]): each run draws its own seed from the OS and writes it nowhere."""
    group = tuning.group_name(family, epsilon, protocol["delta"])
    protocol = at_epsilon(protocol, epsilon)
    spec = protocol["families"][family]
    secret_rng = secret_generator() if secret else None
    if secret:
        law, num_random = secret_num_random(protocol["trials"], secret_rng)
    else:
        law = dict(protocol["trials"])
        num_random = tuning.draw_random_trials(law, group)
    plan = dict(group=group, family=family, epsilon=float(epsilon), delta=protocol["delta"],
                trials_law=law, num_random=num_random,
                num_trials=1 + num_random, seeds=[None] if secret else list(protocol["seeds"]),
                family_spec=spec, methods={})
    budget_bindings = [f"EPSILON = {float(epsilon)}", f"DELTA = {protocol['delta']!r}"]
    tasks = []
    for method in methods:
        gin_files = [spec["methods"][method]["gin_file"], *spec.get("gin_files", [])]
        support = privacy_support(protocol, family, method)
        tasks += [(method, gin_files, b) for b in support]
        plan["methods"][method] = dict(
            gin_files=gin_files, support=[],
            trials=trial_bindings(protocol, family, group, method, num_random,
                                         rng=secret_rng))
        check_trials(method, gin_files, plan["methods"][method]["trials"],
                            [*budget_bindings, "train.seed = 0"])
    events = support_events([(g, [*b, *budget_bindings]) for _, g, b in tasks], workers)
    for (method, _, bindings), event in zip(tasks, events):
        plan["methods"][method]["support"].append(dict(bindings=bindings, event=event))
    return plan


def prepare(protocol: dict, family: str, epsilon: float, methods, records: Path,
            workers: int = 1) -> dict:
    """search.json of the group: written once; a rerun must find the same trials."""
    group = tuning.group_name(family, epsilon, protocol["delta"])
    path = records / group / SEARCH_FILE
    if path.exists():
        plan = json.loads(path.read_text())
        protocol = at_epsilon(protocol, epsilon)  # the space in force at epsilon
        missing = [m for m in methods if m not in plan["methods"]]
        for method in set(methods) - set(missing):
            fresh = trial_bindings(protocol, family, group, method, plan["num_random"])
            if fresh != plan["methods"][method]["trials"] or plan["family_spec"] != \
                    protocol["families"][family]:
                raise ProtocolError(
                    f"{path}: the protocol changed since this search began ({method}'s trials "
                    "differ); restore the protocol, or start a new board in another --records")
        if not missing:
            return plan
        extra = plan_group(protocol, family, epsilon, missing, workers)
        plan["methods"].update(extra["methods"])
    else:
        plan = plan_group(protocol, family, epsilon, methods, workers)
    # insertion order kept (methods as the protocol lists them: the order trials are queued)
    records_lib.atomic_write_text(path, json.dumps(plan, indent=1) + "\n")
    return plan


def prepare_secret(protocol: dict, family: str, epsilon: float, methods, private: Path,
                   workers: int = 1) -> dict:
    """A secret search's plan, kept under ``private`` (never published): drawn once from OS
    entropy; a rerun reuses it (drawing J again and keeping the better search would void the
    bound)."""
    group = tuning.group_name(family, epsilon, protocol["delta"])
    path = private / group / tuning.SEARCH_FILE
    if path.exists():
        plan = json.loads(path.read_text())
        if sorted(plan["methods"]) != sorted(methods):
            raise ProtocolError(
                f"{path}: this secret search runs {sorted(plan['methods'])}; rerun with "
                "exactly those --methods (a new set of methods needs a new --runs_dir)")
        return plan
    plan = plan_group(protocol, family, epsilon, methods, workers, secret=True)
    records_lib.atomic_write_text(path, json.dumps(plan, indent=1) + "\n")
    return plan
