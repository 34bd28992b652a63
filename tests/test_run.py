"""dpbench/run.py: a run before its first step. ``run_event`` (what a sweep's planning reads,
from the compiler's ``account_only``) is the event the built run would account, for every
kind of ledger: the per-step Gaussian alone, a stage's own per-step cost (GIP), a one-off
release before training (DP-SNIP), a clip with public inputs (GEP)."""

import json

import pytest

from dpbench import accounting, config, run
from tests.test_pipelines import golden_run


@pytest.mark.parametrize("key", ["dpsgd", "gip", "dpssgd+dp_snip", "gep"])
def test_run_event_is_the_built_runs_event_without_building_the_step(key, monkeypatch):
    files, bindings = golden_run(key)
    config.parse_config(files, bindings)
    _, stages = config.pipeline_stages()
    want = run.build_run(stages, config.TrainConfig(), accounting.Budget()).compiled.run_event()
    # account_only must not lower, trace or jit a step: those entry points are poisoned
    monkeypatch.setattr(run, "compile_pipeline", None)
    monkeypatch.setattr("dpbench.compiler.pipeline.lower", None)
    got = run.run_event(stages, config.TrainConfig(), accounting.Budget())
    assert accounting.event_to_json(got) == accounting.event_to_json(want)
    assert "Gaussian" in json.dumps(accounting.event_to_json(got))


def test_run_event_follows_the_settings_it_is_given():
    """The check can fail: another batch size gives another event."""
    files, bindings = golden_run("dpsgd")
    events = []
    for batch in (64, 128):
        config.parse_config(files, [*bindings, f"train.batch_size = {batch}"])
        events.append(accounting.event_to_json(run.run_event(
            config.pipeline_stages()[1], config.TrainConfig(), accounting.Budget())))
    assert events[0] != events[1]
