"""dpbench/compiler/facts.py and the stage contract's size: a stage reads the run facts it
names in ``needs``, each derived in ONE record (``RUN_FACTS``); adding a fact for a new method
touches that record and the stage that reads it, nothing between the run and the stage."""

import dataclasses
import inspect
from types import MappingProxyType

import pytest

from dpbench import accounting, config, run
from dpbench.compiler import check as stage_check
from dpbench.compiler import PipelineError, account_only, bind, compile_pipeline, facts
from dpbench.stages.base import Hooks, Kind, Privacy, Stage, StageFns, StepContext
from tests.test_pipelines import golden_run

# The contract a stage author writes against: the Stage's fields, the step functions'
# fields and their optional hooks, and what the step hands them. Privacy's members are the
# one privacy declaration (a Stage field), counted on their own; the run facts are read by name
# (Stage.needs) from the one record, so a new fact adds no name here.
CONTRACT = {"Stage": [f.name for f in dataclasses.fields(Stage)], "StageFns": StageFns._fields,
            "Hooks": Hooks._fields, "StepContext": StepContext._fields}


def test_the_stage_contract_has_at_most_25_public_names():
    names = {record: len(fields) for record, fields in CONTRACT.items()}
    assert sum(names.values()) <= 25, names
    # was 9 Stage fields, then one declaration of 6; the 7th, correlation, declares a release
    # whose noise has memory (BandMF): a mechanism no other field can state
    assert len(Privacy._fields) <= 7, Privacy._fields
    # no run fact is a field anywhere in the contract: facts are read by name, never declared
    # as a field a new method would have to add
    every_field = {n for fields in CONTRACT.values() for n in fields} | set(Privacy._fields)
    assert not every_field & set(facts.RUN_FACTS)


def _epochs_reader():
    """A test method's stage: it needs the run fact 'epochs' and records what it read."""
    def make(run_facts):
        return StageFns(apply=lambda value, state, ctx: (value, state),
                        derived={"epochs_read": run_facts.epochs})

    return Stage(name="test.epochs_reader", kind_in=Kind.PER_EXAMPLE,
                 kind_out=Kind.PER_EXAMPLE, make=make, needs={"epochs"})


def _dpsgd_with(stage):
    files, bindings = golden_run("dpsgd")
    config.parse_config(files, list(bindings))
    _, stages = config.pipeline_stages()
    return [stages[0], stage, *stages[1:]]


def test_a_new_run_fact_touches_the_record_and_the_stage_that_reads_it(monkeypatch):
    """Before the fact exists the compiler refuses the stage, naming it; one entry in
    RUN_FACTS later, the same run (data, model, sampler: run.build_run, untouched) hands the
    stage its value, and the sweep's accounting path takes it too."""
    stages = _dpsgd_with(_epochs_reader())
    with pytest.raises(PipelineError, match=r"'test.epochs_reader' needs run facts \['epochs'\] "
                                            r"that no run has"):
        run.build_run(stages, config.TrainConfig(), accounting.Budget())
    monkeypatch.setattr(facts, "RUN_FACTS", MappingProxyType(dict(
        facts.RUN_FACTS, epochs=facts.RunFact(lambda i, f: i.total_steps / i.steps_per_epoch))))
    built = run.build_run(stages, config.TrainConfig(), accounting.Budget())
    (record,) = [s for s in built.compiled.plan.facts() if s["name"] == "test.epochs_reader"]
    inputs = built.compiled.plan.run_facts.inputs
    assert record["epochs_read"] == inputs.total_steps / inputs.steps_per_epoch > 0
    run.run_event(stages, config.TrainConfig(), accounting.Budget())  # the sweep's path too
    # the stage checker's small problem (dpbench check) takes it with no edit either
    stage_check.check_jit(stage_check.harness_for(_epochs_reader()))


def test_nothing_between_the_run_and_a_stage_names_a_run_fact():
    """The compiler's entry points and every caller that builds a run take the run's inputs
    as one record: none has a keyword per fact (a new fact used to edit each of them)."""
    from benchmarks import workers

    entry_points = [compile_pipeline, account_only, bind, run.build_run, run.run_event,
                    stage_check.compile_small, workers.build_dp_run]
    for fn in entry_points:
        named = set(inspect.signature(fn).parameters) & set(facts.RUN_FACTS)
        assert not named, f"{fn.__qualname__} takes run facts {named} as keywords"


def test_a_stage_reads_only_the_facts_it_names_and_an_absent_one_is_refused():
    def make(run_facts):
        run_facts.total_steps  # noqa: B018 (read without naming it in needs)
        return StageFns(apply=lambda value, state, ctx: (value, state))

    sneaky = Stage(name="test.sneaky", kind_in=Kind.PER_EXAMPLE, kind_out=Kind.PER_EXAMPLE,
                   make=make, needs={"num_classes"})
    with pytest.raises(AttributeError, match=r"'test.sneaky' reads the run fact 'total_steps' "
                                             r"without naming it"):
        run.build_run(_dpsgd_with(sneaky), config.TrainConfig(), accounting.Budget())
    honest = dataclasses.replace(sneaky, name="test.honest", needs={"total_steps"})
    run.build_run(_dpsgd_with(honest), config.TrainConfig(), accounting.Budget())
    # GIP needs the run's target epsilon; a run with a given sigma has none: refused, saying
    # what to change
    files, bindings = golden_run("gip")
    config.parse_config(files, [*bindings, "train.noise_multiplier = 1.0"])
    with pytest.raises(PipelineError, match=r"'select.gip' needs the run fact 'target_epsilon'"
                                            r".*leave train.noise_multiplier unset"):
        run.build_run(config.pipeline_stages()[1], config.TrainConfig(), accounting.Budget())


def test_needs_is_a_set_of_names_not_a_string():
    """A string would read as its letters (needs='loss_fn' as {'l', 'o', ...}): refused where
    the stage is declared, saying how to write it."""
    with pytest.raises(TypeError, match=r"needs is a set of run fact names, e.g. \{'loss_fn'\}"):
        Stage(name="test.typo", kind_in=Kind.PER_EXAMPLE, kind_out=Kind.PER_EXAMPLE,
              make=lambda run_facts: None, needs="loss_fn")
