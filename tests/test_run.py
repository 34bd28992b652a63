"""dpbench/run/ (build, settings): a run before its first step. ``run_event`` (what a
sweep's planning reads, from the compiler's ``account_only``) is the event the built run would
account, for every kind of ledger: the per-step Gaussian alone, a stage's own per-step cost
(GIP), a one-off release before training (DP-SNIP), a clip with public inputs (GEP). A
pipeline is validated once and lowered once; a release's step has no conditional."""

import json

import jax
import numpy as np
import pytest

from dpbench import accounting, config
from dpbench.run import build as run
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


@pytest.mark.parametrize("path", ["dpbench train", "api.train", "api.check"])
def test_a_pipeline_is_validated_once_and_compiled_once_on_its_way_to_the_step(
        path, tmp_path, monkeypatch):
    """The rules run once on every path (the validated pipeline travels to the compiler) and
    the step is lowered once; `check` compiles nothing for dpbench's own stages."""
    from dpbench import api
    from dpbench.compiler import pipeline, rules
    from dpbench.run import trials
    counts = {"validated": 0, "lowered": 0}
    check_one_off, lower = rules._check_one_off, pipeline.lower  # one call per validation

    def counting_check(stages):
        counts["validated"] += 1
        return check_one_off(stages)

    def counting_lower(*args, **kwargs):
        counts["lowered"] += 1
        return lower(*args, **kwargs)

    monkeypatch.setattr(rules, "_check_one_off", counting_check)
    monkeypatch.setattr(pipeline, "lower", counting_lower)
    files, quick = ["pipelines/dpsgd", "gin/data/digits.gin"], "train.epochs = 0.2"
    if path == "dpbench train":
        config.parse_config(files, [quick])
        trials.train(tmp_path / "run", gin_files=files)
    elif path == "api.train":
        api.train(tmp_path / "run", files, gin=quick)
    else:
        assert api.check(files) == {}
    assert counts == {"validated": 1, "lowered": 0 if path == "api.check" else 1}


def _settings(stages=("grad.per_example", "clip.global_l2"), l2_bound=1.0, batch_size=64,
              seed=0, epsilon=3.0, sigma=1.2):
    """Settings.of on a stand-in compiled pipeline and dataset (it reads their attributes)."""
    from types import SimpleNamespace
    from dpbench.run import Settings
    facts = [dict(name=n, l2_bound=l2_bound) for n in stages]
    sampler = SimpleNamespace(describe=lambda: dict(sampling="poisson", sampling_rate=0.1,
                                                    padded_batch_size=batch_size + 32))
    compiled = SimpleNamespace(plan=SimpleNamespace(facts=lambda: facts), total_steps=7,
                               sampler=sampler, noise_multiplier=sigma,
                               init_noise_multiplier=None, sensitivity=l2_bound,
                               micro_batch_size=32)
    dataset = SimpleNamespace(name="digits", features={"kind": "pixels"}, train=range(640),
                              validation=range(100), public=None)
    return Settings.of(pipeline="dpsgd", compiled=compiled, dataset=dataset, model="cnn",
                       config=config.TrainConfig(batch_size=batch_size, seed=seed),
                       budget=accounting.Budget(epsilon=epsilon, delta=1e-5))


def test_trials_share_a_group_by_shape_and_structure_never_by_their_numbers():
    """Settings.group_key names what the trials of one compiled step must share: a trial's
    clip bound, seed, epsilon and sigma (real numbers) are its own; its stage list, batch size
    and a stage's integer facts are not."""
    base = _settings()
    assert _settings(l2_bound=0.5, seed=3, epsilon=1.0, sigma=2.0).group_key() == \
        base.group_key()
    assert _settings(batch_size=128).group_key() != base.group_key()
    assert _settings(stages=("grad.per_example", "clip.other")).group_key() != base.group_key()
    assert _settings(l2_bound=2).group_key() != base.group_key()  # an int: a count, a shape
    assert base.as_json()["planned_steps"] == 7 and base.digest() == _settings().digest()
    assert _settings(seed=1).digest() != base.digest()


_CONDITIONALS = ("stablehlo.case", "stablehlo.if")


@pytest.mark.parametrize("pipeline", ["dpsgd", "bandmf"])  # bandmf: a release with memory
@pytest.mark.parametrize("seed", [0, None], ids=["benchmark", "release"])
def test_a_release_steps_time_does_not_depend_on_its_batch_and_a_benchmark_says_it_may(
        seed, pipeline):
    """A release run (train.seed = None) compiles its whole step without a data-dependent
    conditional: how many micro-batches the realized Poisson batch filled (who was sampled)
    does not change what runs. A benchmark run keeps the faster step that skips empty
    micro-batches, and its statement lists the step's time as not covered."""
    from dpbench.run import Settings, record
    files, bindings = golden_run(pipeline)
    config.parse_config(files, [*bindings, f"train.seed = {seed}"])
    name, stages = config.pipeline_stages()
    train_config, budget = config.TrainConfig(), accounting.Budget()
    built = run.build_run(stages, train_config, budget)
    state = built.initial_state()
    hlo = jax.jit(built.compiled.lowered.step).lower(state, built.host_batch(0)).as_text()
    has_conditional = any(op in hlo for op in _CONDITIONALS)
    settings = Settings.of(pipeline=name, compiled=built.compiled, dataset=built.dataset,
                           model=built.model_name, config=train_config, budget=budget)
    statement = record.statement_for(settings, built, 3, 1.0)
    timing = [item for item in statement["not_covered"] if "running time" in item["what"]]
    assert settings.branch_free_step is (seed is None) is statement["timing_protected"]
    if seed is None:
        assert not has_conditional and not timing
        assert "running time does not depend" in statement["statement"]
    else:
        assert has_conditional and timing  # the check can fail: the benchmark step has one


def test_an_accelerators_micro_batch_keeps_the_cpu_runs_batch_event_and_update(monkeypatch):
    """``train.accelerator_micro_batch_size = 0`` on an accelerator (here the backend is read
    as 'gpu') steps the whole padded batch at once, with the CPU run's padded batch, DpEvent,
    sigma and drawn batches, and the same update up to the order of its sums; on a CPU the
    option changes nothing; a size that does not divide the padded batch is refused."""
    files, bindings = golden_run("dpsgd")
    original = run.step_micro_batch_size

    def built(extra, backend):
        monkeypatch.setattr(run, "step_micro_batch_size",
                            lambda c, p: original(c, p, backend=backend))
        config.parse_config(files, [*bindings, *extra])
        return run.build_run(config.pipeline_stages()[1], config.TrainConfig(),
                             accounting.Budget())

    cpu = built([], "cpu")
    gpu = built(["train.accelerator_micro_batch_size = 0"], "gpu")
    assert cpu.compiled.micro_steps > 1 and gpu.compiled.micro_steps == 1  # can fail
    assert gpu.compiled.micro_batch_size == cpu.sampler.padded_batch_size
    assert gpu.sampler.describe() == cpu.sampler.describe()
    assert gpu.compiled.noise_multiplier == cpu.compiled.noise_multiplier
    assert (accounting.event_to_json(gpu.compiled.run_event())
            == accounting.event_to_json(cpu.compiled.run_event()))
    a, b = cpu.host_batch(3), gpu.host_batch(3)
    assert np.array_equal(np.asarray(a["mask"]).ravel(), np.asarray(b["mask"]).ravel())
    new_a, _ = jax.jit(cpu.compiled.lowered.step)(cpu.initial_state(), a)
    new_b, _ = jax.jit(gpu.compiled.lowered.step)(gpu.initial_state(), b)
    for x, y in zip(jax.tree.leaves(new_a), jax.tree.leaves(new_b)):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)  # float32 sums, reordered
    on_cpu = built(["train.accelerator_micro_batch_size = 0"], "cpu")
    assert on_cpu.compiled.micro_batch_size == cpu.compiled.micro_batch_size
    padded = cpu.sampler.padded_batch_size
    with pytest.raises(ValueError, match="must divide the padded batch"):
        built([f"train.accelerator_micro_batch_size = {padded - 1}"], "gpu")
