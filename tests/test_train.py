"""The train loop's privacy and benchmark guarantees, each checked against a broken twin of the
function that keeps it (the twin must fail the same check):

1. the reported model (the best step) is chosen on the validation split, never on test;
6. the privacy statement's machine-readable fields are the ledger's DpEvent, field by field,
   for every pipeline and both model families;
7. a resumed run re-checks its ledger's epsilon with the accountant and refuses a mismatch.
"""

import functools
import math
from types import SimpleNamespace

import numpy as np
import pytest
from dp_accounting import dp_event

from dpbench import accounting, checkpoint, config, data, records
from dpbench.search import methods
from dpbench.config import TrainConfig, pipeline_stages
from dpbench.run import Settings, build_run
from dpbench.run import loop as train
from dpbench.run import record as run_record
from dpbench.run import start as run_lib


def expect_check(check, *args, broken: bool) -> None:
    """Runs a guarantee's check: it passes on the real function and must fail (AssertionError)
    on its deliberately broken twin."""
    if broken:
        with pytest.raises(AssertionError):
            check(*args)
    else:
        check(*args)

# --------------------------------------------- 1. the best step is chosen on validation only


def selection_on_test(eval_fn, params, dataset, batch_size):
    """Broken twin of train.selection_accuracy: scores the evaluated steps on the TEST split."""
    return train._evaluate(eval_fn, params, dataset.test, batch_size)


def _split(labels):
    return data.Split(images=np.zeros((len(labels), 1), np.float32),
                      labels=np.asarray(labels, np.int32))


def check_best_step_follows_validation(workdir):
    """Runs the train loop's evaluation (train._maybe_evaluate, as every trial's steps call it) over
    three steps whose 'model' predicts one class: validation prefers step 2, test step 1. The
    best step, its params and the logged accuracies (what the run record reports) must be
    validation's, and of the evaluation params (``CompiledPipeline.evaluation_params``)."""
    validation, test = _split([0, 0, 0, 1, 1, 2]), _split([1, 1, 1, 0, 0, 2])
    # the loop evaluates what the compiled pipeline names (the debiased EMA in a real run),
    # never the raw params: here those predict class 9, which no split holds
    run = SimpleNamespace(dataset=SimpleNamespace(validation=validation, test=test),
                          steps_per_epoch=1.0,
                          compiled=SimpleNamespace(evaluation_params=lambda s: s.ema_params))
    progress = run_lib.Progress(best={"validation_accuracy": -1.0, "step": 0, "params": None})
    started = SimpleNamespace(progress=progress, end_step=3)
    member = train.Member(run=run, config=config.TrainConfig(eval_every_steps=1),
                          workdir=workdir, started=started, start_step=0, verified={},
                          eval_fn=lambda params, x, y: int(np.sum(y == params["predicts"])),
                          wall_start=0.0)
    predicted = {1: 1, 2: 0, 3: 2}  # step -> the class its model predicts
    for step, label in predicted.items():
        state = SimpleNamespace(params={"predicts": np.asarray(9)},
                                ema_params={"predicts": np.asarray(label)})
        train._maybe_evaluate(member, lambda: state, step)
    logged = [row["validation_accuracy"] for row in records.read_metrics(workdir)]
    assert logged == [2 / 6, 3 / 6, 1 / 6], f"the selection scores are not validation's: {logged}"
    assert progress.best["step"] == 2, f"best step {progress.best['step']}, validation's is 2"
    assert int(progress.best["params"]["predicts"]) == 0
    assert progress.best["validation_accuracy"] == 3 / 6


@pytest.mark.parametrize("select", [train.selection_accuracy, selection_on_test],
                         ids=["selection_accuracy", "broken_twin_reads_test"])
def test_the_best_step_is_chosen_on_validation_never_on_test(select, tmp_path, monkeypatch):
    """Guarantee 1: inside a run, the reported model (best_step and its params) is chosen on
    the validation split; a selector that reads the test split fails the same check."""
    monkeypatch.setattr(train, "selection_accuracy", select)
    expect_check(check_best_step_follows_validation, tmp_path,
                 broken=select is selection_on_test)


# ----------------------------------- 6. the statement's fields are the ledger's DpEvent's fields

PIPELINES = sorted(methods.discover())  # every method folder under pipelines/
SMALL = ("train.epochs = 2", "dataset.public_size = 64", "gep.embed_and_clip.num_anchors = 64",
         "gep.embed_and_clip.num_basis = 48", "prune.synflow.iterations = 10")
MODELS = {"default": [], "scatter_linear": ["gin/model/scatter_linear.gin"]}
CASES = {f"{p}-{m}": ([f"pipelines/{p}/pipeline.gin", "gin/data/digits.gin", *files], [])
         for m, files in MODELS.items() for p in PIPELINES}
CASES["dpssgd+dp_snip-default"] = (["pipelines/dpssgd/pipeline.gin", "gin/data/digits.gin"],
                                   ["PRUNE = @prune.dp_snip()"])  # a one-off release
SEVERAL_PARTS = ("gep",)  # its release noises 2 parts (B-GEP releases the embedding only)


@functools.lru_cache(maxsize=1)  # the tests of one case run one after the other
def built(case: str):
    """(run, its settings, config, end step, epsilon) of a case, compiled with its calibrated
    sigma; nothing trains."""
    files, bindings = CASES[case]
    config.parse_config(files, list(SMALL) + bindings)
    _, stages = config.pipeline_stages()
    train_config, budget = config.TrainConfig(), accounting.Budget()
    run = build_run(stages, train_config, budget)
    end_step, _ = run_lib.budget_stop(run.compiled, budget, train_config)
    settings = Settings.of(pipeline=case, compiled=run.compiled, dataset=run.dataset,
                           model=run.model_name, config=train_config, budget=budget)
    return run, settings, train_config, end_step, run.compiled.epsilon_after(end_step)


def statement_with_pre_gep_sigma(settings, run, end_step, epsilon):
    """Broken twin of run_record.statement_for: reports the sigma the release adds to each part
    (GEP's, before the sqrt(2) of its two parts) as the effective noise multiplier."""
    statement = run_record.statement_for(settings, run, end_step, epsilon)
    for m in statement["mechanisms"]:
        if m["kind"] == "gaussian":
            m["effective_noise_multiplier"] = m["noise_multiplier"]
    return statement


def statement_with_realized_rate(settings, run, end_step, epsilon):
    """Broken twin of run_record.statement_for: reports the sampling rate of the first batch
    the sampler drew whose size is not B (realized size / N), not the expected q = B / N."""
    statement = run_record.statement_for(settings, run, end_step, epsilon)
    n = len(run.dataset.train)
    size = next(s for s in (run.sampler.sample(t).size for t in range(end_step))
                if s != settings.batch_size)
    for m in statement["mechanisms"]:
        if m["kind"] == "gaussian":
            m["sampling_probability"] = size / n
    statement["sampling_rate"] = size / n
    return statement


def ledger_lines(event) -> list:
    """The run's DpEvent as its lines: ComposedDpEvent of one event per ledger line."""
    return list(event.events) if isinstance(event, dp_event.ComposedDpEvent) else [event]


def check_statement_is_the_ledger(statement, run, train_config, end_step):
    """Every machine-readable field of every mechanism of ``statement`` is the one of the
    DpEvent the accountant composes (compiled.run_event), and the sampling rate is the expected
    q = B / N over the run's N private examples (B parts / N over the largest of its parts, an
    example's count its participations, for cyclic Poisson sampling over that many parts)."""
    lines = ledger_lines(run.compiled.run_event(end_step))
    mechanisms = statement["mechanisms"]
    assert len(mechanisms) == len(lines)
    parts = getattr(run.sampler, "parts", 1)
    n = len(run.dataset.train) if parts == 1 else run.sampler.largest_part
    q = train_config.batch_size * parts / len(run.dataset.train)
    assert statement["steps"] == end_step and statement["sampling_rate"] == q
    for m, line in zip(mechanisms, lines):
        steps = {accounting.EVERY_STEP: end_step, accounting.ONCE: 1,
                 accounting.EVERY_PARTICIPATION: -(-end_step // parts)}[m["schedule"]]
        assert m["count"] == steps, (m["name"], m["count"], steps)
        if isinstance(line, accounting.PureDpEvent):  # T pure releases as one pure event
            assert m["kind"] == "pure" and m["epsilon_total"] == line.epsilon
            assert m["epsilon_per_occurrence"] * steps == pytest.approx(line.epsilon, rel=1e-12)
            continue
        one, count = ((line.event, line.count) if isinstance(line, dp_event.SelfComposedDpEvent)
                      else (line, 1))  # a one-off release is its own event
        assert count == steps, (m["name"], "count")
        if isinstance(one, dp_event.TruncatedSubsampledGaussianDpEvent):
            sigma, size, truncated = one.noise_multiplier, one.dataset_size, \
                one.truncated_batch_size
            assert size == n and statement["padded_batch_size"] == truncated
        else:
            sigma, size, truncated = one.event.noise_multiplier, None, None
        assert m["effective_noise_multiplier"] == sigma, (m["name"], "effective sigma")
        assert m["sampling_probability"] == one.sampling_probability == q, (m["name"], "rate")
        assert m["dataset_size"] == size and m["truncated_batch_size"] == truncated


REAL, PRE_GEP, REALIZED = (run_record.statement_for, statement_with_pre_gep_sigma,
                           statement_with_realized_rate)
STATEMENT_PARAMS = [
    pytest.param(case, builder, id=f"{case}-{name}")
    for case in CASES for builder, name in ((REAL, "statement"),
                                            (PRE_GEP, "broken_twin_pre_gep_sigma"),
                                            (REALIZED, "broken_twin_realized_rate"))
    if builder is not PRE_GEP or case.startswith(SEVERAL_PARTS)]  # its sigma IS pre-GEP's


@pytest.mark.parametrize("case,builder", STATEMENT_PARAMS)
def test_the_statement_fields_are_the_ledgers_event(case, builder):
    """Guarantee 6: the privacy statement's machine-readable fields (effective sigma, sampling
    rate, count, truncation, N) equal the ledger's DpEvent for every pipeline on both model
    families (compiled, nothing trains); a builder that reports GEP's per-part sigma or the
    realized sampling rate fails the same check."""
    run, settings, train_config, end_step, epsilon = built(case)
    statement = builder(settings, run, end_step, epsilon)
    expect_check(check_statement_is_the_ledger, statement, run, train_config, end_step,
                 broken=builder is not REAL)


# --------------------------------- 7. a resumed run re-checks its ledger's epsilon


def skip_epsilon_check(ledger, step, epsilon_now):
    """Broken twin of run_lib.check_ledger_epsilon: resumes whatever the ledger says was spent."""


def _checkpoint_with_epsilon(run, settings, directory, scale: float):
    """A real checkpoint after 2 steps whose ledger says ``scale`` times the epsilon spent."""
    ckpts = checkpoint.RunCheckpoints(directory)
    state = run.initial_state()
    for step in range(2):
        state, _ = run.compiled.step(state, run.host_batch(step))
    progress = run_lib.Progress(best={"validation_accuracy": 0.5, "step": 2,
                                    "params": checkpoint.to_host(state.params)})
    train.save_checkpoint(ckpts, run.compiled, state, progress, settings, 2,
                           scale * run.compiled.epsilon_after(2), key_saved=True)
    return ckpts


@functools.lru_cache(maxsize=1)
def built_dpsgd():
    """(run, its settings, config) of DP-SGD on digits for one epoch, compiled, not trained."""
    config.parse_config(["pipelines/dpsgd", "gin/data/digits.gin"], ["train.epochs = 1"])
    name, stages = config.pipeline_stages()
    train_config, budget = config.TrainConfig(), accounting.Budget()
    run = build_run(stages, train_config, budget)
    settings = Settings.of(pipeline=name, compiled=run.compiled, dataset=run.dataset,
                           model=run.model_name, config=train_config, budget=budget)
    return run, settings, train_config


def check_resume_refuses_a_wrong_ledger_epsilon(tmp_path):
    """The honest checkpoint resumes; ledgers that claim twice or half the epsilon the
    accountant computes for their steps are refused, naming both numbers."""
    run, settings, train_config = built_dpsgd()
    for scale in (1.0, 2.0, 0.5):
        workdir = tmp_path / f"x{scale}"
        ckpts = _checkpoint_with_epsilon(run, settings, workdir / run_lib.CHECKPOINTS, scale)
        try:
            state, _ = run_lib.restore_or_init(run, ckpts, settings, workdir, train_config)
        except run_lib.ResumeError as error:
            assert scale != 1.0, f"the honest ledger was refused: {error}"
            said = repr(scale * run.compiled.epsilon_after(2))
            assert "the ledger of step 2 says epsilon" in str(error) and said in str(error)
        else:
            assert scale == 1.0, f"resumed a ledger that claims {scale}x the epsilon spent"
            assert int(state.step) == 2
        finally:
            ckpts.close()


@pytest.mark.parametrize("check", [run_lib.check_ledger_epsilon, skip_epsilon_check],
                         ids=["check_ledger_epsilon", "broken_twin_skips_the_check"])
def test_a_resume_refuses_a_ledger_epsilon_the_accountant_does_not_confirm(
        check, tmp_path, monkeypatch):
    """Guarantee 7: resuming re-checks the checkpoint ledger's epsilon with the accountant and
    refuses a mismatch with a clear error; a resume that skips the comparison fails the same
    check."""
    monkeypatch.setattr(run_lib, "check_ledger_epsilon", check)
    expect_check(check_resume_refuses_a_wrong_ledger_epsilon, tmp_path,
                 broken=check is skip_epsilon_check)


def test_a_non_private_ledgers_infinite_epsilon_is_compared_as_a_number():
    """A run with sigma 0 (train.enforce_budget = False) spends epsilon inf, which its ledger
    stores as the string 'inf' (records.to_json): resuming it compared a str with a float
    (TypeError). It resumes, and any other number against it is refused."""
    run_lib.check_ledger_epsilon({"epsilon_spent": "inf"}, 4, math.inf)
    with pytest.raises(run_lib.ResumeError, match="says epsilon inf"):
        run_lib.check_ledger_epsilon({"epsilon_spent": "inf"}, 4, 2.5)


def test_gep_anchors_are_the_datasets_public_split():
    """The run hands GEP the declared public split (carved from train, disjoint from the
    private examples): the compiled stage's anchor images are exactly its first m rows."""
    import gin
    from dpbench import compiler

    config.parse_config(["pipelines/gep", "gin/data/digits.gin"], [
        "train.batch_size = 64", "train.micro_batch_size = 32", "train.epochs = 1",
        "dataset.public_size = 48", "gep.embed_and_clip.num_anchors = 40",
        "gep.embed_and_clip.num_basis = 20"])
    try:
        _, stages = pipeline_stages()
        compiler.validate_pipeline(stages)
        run = build_run(stages, TrainConfig(), accounting.Budget())
        states = [s for s in run.initial_state().stage_states
                  if isinstance(s, dict) and "anchors" in s]
    finally:
        gin.clear_config()
    assert len(states) == 1
    np.testing.assert_array_equal(np.asarray(states[0]["anchors"]),
                                  run.dataset.public.images[:40])
    assert not set(run.dataset.public_indices.tolist()) & set(run.dataset.train_indices.tolist())


def test_branch_free_step_takes_a_bool_only():
    """train.branch_free_step (the clipped sum without data-dependent conditionals) is a
    switch: a string such as 'yes' would read as True, so it is refused with the name."""
    TrainConfig(branch_free_step=True).validate()
    with pytest.raises(ValueError, match="train.branch_free_step must be True or False"):
        TrainConfig(branch_free_step="yes").validate()
