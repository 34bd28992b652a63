"""Trials as data (compiler/group.py, run/group.py): a trial trained in a group is the trial
trained alone; the broken twins of a group step (a shared noise key, a shared number, a
finished trial still stepped, a shared Poisson draw) each fail the same check."""

import json
import signal
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import HANG_GUARD_S, REPO_ROOT, run_guarded
from dpbench import accounting, config
from dpbench.compiler import group as group_lib
from dpbench.run import group as run_group
from dpbench.run import launch
from dpbench.run import trials as run_trials
from dpbench.run.build import build_run
from dpbench.run.settings import Settings
from dpbench.run.start import saved_steps

DIGITS = "gin/data/digits.gin"
# (the PLD grid 10x coarser than a run's default: each trial's own epsilon still calibrates its
# own sigma, an upper bound all the same, in a third of the time)
SMALL = ("dataset.public_size = 32", "gep.embed_and_clip.num_anchors = 32",
         "gep.embed_and_clip.num_basis = 16", "train.epochs = 1",
         "prune.synflow.iterations = 5", "budget.pld_discretization = 1e-2")


# each method's own numbers, drawn per trial (the board's method.json spaces)
METHOD_KNOBS = {
    "rs": lambda rng: [f"sparsify.random_mask.final_rate = {rng.uniform(0.3, 0.9):.5g}"],
    "gep": lambda rng: [f"gep.embed_and_clip.residual_bound = {rng.uniform(0.05, 0.5):.5g}"],
    # the strategy's workload: each trial's own coefficients, lifted as numbers (BANDS is shape)
    "bandmf": lambda rng: [f"noise.banded.momentum = {rng.uniform(0.5, 0.95):.5g}"]}


def _knobs(rng, pipeline: str = "dpsgd") -> list:
    """Three trials that differ in every number a trial of ``pipeline`` has: learning rate,
    momentum, clip bound, epsilon (so sigma), EMA decay, planned steps (epochs), seed, and the
    method's own; drawn fresh each run."""
    method = METHOD_KNOBS.get(pipeline, lambda rng: [])
    return [[f"optimize.optax.learning_rate = {rng.uniform(0.05, 1.0):.5g}",
             "optimize.optax.optimizer = 'momentum'",
             f"optimize.optax.momentum = {rng.uniform(0.5, 0.95):.5g}",
             f"clip.global_l2.l2_bound = {rng.uniform(0.1, 3.0):.5g}",
             f"EPSILON = {rng.uniform(0.5, 4.0):.5g}", f"train.epochs = {epochs}",
             f"train.ema_decay = {rng.uniform(0.5, 0.95):.5g}",
             f"train.seed = {int(rng.integers(2**31))}", *method(rng)]
            for epochs in (1, 2, 1)]


def _runs(pipeline: str, trials: list) -> list:
    runs = []
    for bindings in trials:
        config.parse_config([f"pipelines/{pipeline}/pipeline.gin", DIGITS],
                            list(SMALL) + bindings)
        _, stages = config.pipeline_stages()
        runs.append(build_run(stages, config.TrainConfig(), accounting.Budget()))
    return runs


def _stack(trees):
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def _honest(knobs, ends, states, batches):
    return knobs, ends, states, batches


def _alone(runs) -> list:
    """Each trial's final state trained alone, to its own planned steps."""
    states = []
    for r in runs:
        state = r.initial_state()
        for t in range(r.total_steps):
            state, _ = r.compiled.step(state, r.host_batch(t))
        states.append(state)
    return states


def _traced(runs) -> list:
    return [group_lib.trace(r.compiled.lowered.step, r.initial_state(), r.host_batch(0))
            for r in runs]


def _group_minus_solo(runs, batching, twin=_honest, alone=None, gather="host",
                      traced=None) -> list:
    """Each trial's largest parameter difference, trained in one group (each its own batches,
    to its own planned steps; its examples gathered by the host or, ``gather='device'``, by
    the group step from the one training split) vs alone, and whether its step counters
    agree. ``twin`` may break the group step's inputs (its batches: the drawn ones on the
    device); ``traced``: the runs' traced programs, when the caller has them."""
    alone = _alone(runs) if alone is None else alone
    initial = [r.initial_state() for r in runs]
    step = group_lib.group_step(traced or _traced(runs), batching=batching)
    ends = jnp.array([r.total_steps for r in runs], jnp.int32)
    states = _stack(initial)
    if gather == "device":
        split = runs[0].dataset.train
        assert all(r.dataset.train.images is split.images for r in runs)
        jitted = jax.jit(run_group.gathering(step.step))
    else:
        jitted = jax.jit(step.step)
    for t in range(max(r.total_steps for r in runs)):
        if gather == "device":
            drawn = run_group.stack_on_host([run_group.drawn_batch(r, min(t, r.total_steps - 1))
                                             for r in runs])
            states, _ = jitted(*twin(step.knobs, ends, states, drawn), split.images,
                               split.labels)
        else:
            batches = [r.host_batch(min(t, r.total_steps - 1)) for r in runs]
            states, _ = jitted(*twin(step.knobs, ends, states, _stack(batches)))
    out = []
    for i, solo in enumerate(alone):
        grouped = jax.tree.map(lambda x: x[i], states)
        gap = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                  zip(jax.tree.leaves(grouped.params), jax.tree.leaves(solo.params)))
        out.append((gap, int(grouped.step) == int(solo.step)))
    return out


# XLA batches a vmapped step's products differently from the solo one's: a last-bit
# difference per step at most (measured 0.0 on this digits MLP), far under this tolerance; the
# map batching (the CPU's) runs each trial's own program and is held to bit-identical
# parameters for every method.
VMAP_TOL = 1e-5

# Where a lifted number can no longer be constant-folded, XLA's arithmetic differs from the
# solo program's in the last bit (a division by a knob instead of a multiplication by its
# folded reciprocal): measured on these digits runs (5-10 steps) 1.5e-8 (B-GEP's bounds) and
# 1.5e-11 (Nasr's ternary threshold) at most; every other method is bit-identical.
FOLDING_TOL = {"bgep": 1e-6, "nasr": 1e-6}

# every method of the board: its own real numbers (a trial's knobs), each as (binding, low, high)
METHOD_NUMBERS = {
    "dpsgd": [], "bgep": [],
    "rs": [("sparsify.random_mask.final_rate", 0.3, 0.9)],
    "dpssgd": [("prune.synflow.sparsity", 0.2, 0.8), ("drop.gradients.rate", 0.2, 0.8)],
    "gip": [("select.gip.k_end", 0.05, 0.5)],
    "randomk": [("select.random_k.k_end", 0.1, 0.9)],
    "nasr": [("discretize.ternary.threshold", 1e-4, 1e-2)],
    "gep": [("gep.embed_and_clip.residual_bound", 0.05, 0.5)],
    # the strategy's workload: each trial's own coefficients, lifted as numbers (BANDS is shape)
    "bandmf": [("noise.banded.momentum", 0.5, 0.95)]}
SHARED_NUMBERS = [("optimize.optax.learning_rate", 0.05, 1.0), ("optimize.optax.momentum", 0.5, 0.95),
                  ("clip.global_l2.l2_bound", 0.1, 3.0), ("EPSILON", 0.5, 4.0),
                  ("train.ema_decay", 0.5, 0.95)]
# which of two values each of three trials takes: every pair of trials shares a value in some
# position that the third does not (a knob rule that compared only some trials' numbers would
# train one trial on another's value)
GRID = ((0, 0, 1), (0, 1, 1), (0, 1, 0))


def _grid(rng, pipeline: str) -> list:
    """Three trials on a grid: every number two values drawn fresh, each trial taking one of
    them by ``GRID`` (so values repeat and differ in every position), its planned steps too
    (0.5 or 1 epoch), its own seed."""
    numbers = SHARED_NUMBERS + METHOD_NUMBERS[pipeline]
    values = [rng.uniform(low, high, size=2) for _, low, high in numbers]
    return [["optimize.optax.optimizer = 'momentum'", f"train.seed = {int(rng.integers(2**31))}",
             f"train.epochs = {(0.5, 1)[GRID[1][i]]}",
             *[f"{name} = {v[GRID[j % 3][i]]:.5g}" for j, ((name, _, _), v)
               in enumerate(zip(numbers, values))]] for i in range(3)]


def _declared(pipeline: str, runs, trials) -> list:
    """Each run's declared group key (Settings.group_key), as a group packs by it."""
    keys = []
    for run, bindings in zip(runs, trials):
        config.parse_config([f"pipelines/{pipeline}/pipeline.gin", DIGITS],
                            list(SMALL) + bindings)
        settings = Settings.of(pipeline=pipeline, compiled=run.compiled, dataset=run.dataset,
                               model=run.model_name, config=config.TrainConfig(),
                               budget=run.budget)
        keys.append(json.dumps(settings.group_key(), sort_keys=True))
    return keys


@pytest.mark.parametrize("pipeline", sorted(METHOD_NUMBERS))
def test_every_methods_grid_trials_pack_as_declared_and_step_as_alone(pipeline):
    """Three trials of each board method on a grid (``_grid``): their declaration puts them in
    one group, their programs agree (one group), and each trial stepped in the group (the
    CPU's map batching) is the trial stepped alone, bit for bit (``FOLDING_TOL``: where not)."""
    trials = _grid(np.random.default_rng(), pipeline)
    runs = _runs(pipeline, trials)
    assert len(set(_declared(pipeline, runs, trials))) == 1
    traced = _traced(runs)
    assert run_group.pack(traced) == [[0, 1, 2]]
    for i, (gap, steps_agree) in enumerate(_group_minus_solo(runs, "map", traced=traced)):
        assert steps_agree, f"trial {i} took another number of steps in the group"
        assert gap <= FOLDING_TOL.get(pipeline, 0.0), \
            f"trial {i}'s parameters differ from its solo run's by {gap}"


@pytest.mark.parametrize("pipeline", ["dpsgd", "bandmf"])
def test_a_trial_stepped_in_a_vmapped_group_is_the_trial_stepped_alone(pipeline):
    runs = _runs(pipeline, _knobs(np.random.default_rng(), pipeline))
    for i, (gap, steps_agree) in enumerate(_group_minus_solo(runs, "vmap")):
        assert steps_agree, f"trial {i} took another number of steps in the group"
        assert gap <= VMAP_TOL, f"trial {i}'s parameters differ from its solo run's by {gap}"


def _share_the_noise_key(knobs, ends, states, batches):
    keys = jnp.stack([states.key[0]] * len(ends))
    return knobs, ends, states._replace(key=keys), batches


def _read_trial_0s_numbers(knobs, ends, states, batches):
    return {p: np.stack([v[0]] * len(ends)) for p, v in knobs.items()}, ends, states, batches


def _step_past_the_plan(knobs, ends, states, batches):
    return knobs, jnp.full_like(ends, 10**6), states, batches


def _share_one_poisson_draw(knobs, ends, states, batches):
    return knobs, ends, states, jax.tree.map(lambda x: jnp.stack([x[0]] * len(ends)), batches)


def _read_trial_0s_numbers_where_they_repeat(knobs, ends, states, batches):
    """A knob rule that compared only trials 0 and 1: a number they share is taken as
    constant, so trial 2 runs on trial 0's value."""
    return ({p: np.stack([v[0]] * len(ends)) if v[0] == v[1] else v for p, v in knobs.items()},
            ends, states, batches)


@pytest.mark.parametrize("gather", run_group.GATHERS)
def test_each_broken_twin_of_a_group_fails_the_check(gather):
    """On a grid (values repeat: ``_grid``) and with either gather (the host's examples or the
    device's gather from drawn indices), the honest group equals the trials alone bit for bit
    and every broken twin fails the same check."""
    runs = _runs("dpsgd", _grid(np.random.default_rng(), "dpsgd"))
    alone = _alone(runs)
    honest = _group_minus_solo(runs, "map", alone=alone, gather=gather)
    assert all(gap == 0.0 and agree for gap, agree in honest), honest
    for twin in (_share_the_noise_key, _read_trial_0s_numbers, _step_past_the_plan,
                 _share_one_poisson_draw, _read_trial_0s_numbers_where_they_repeat):
        results = _group_minus_solo(runs, "map", twin, alone, gather=gather)
        assert any(gap > VMAP_TOL or not agree for gap, agree in results), \
            f"{twin.__name__} passed the group-vs-solo check ({gather}): {results}"


def test_numbers_inside_scan_while_and_cond_are_each_trials_own():
    def step(state, batch, k):  # k: a Python constant of each trial's own program
        def body(carry, row):
            return carry * k + jnp.sum(row) * 0.5, row * k
        carry, ys = jax.lax.scan(body, state["x"][0, 0], state["x"] + batch)
        looped = jax.lax.while_loop(lambda c: c[0] < 3.0 * k, lambda c: (c[0] + k, c[1] + 1),
                                    (carry * 0.0, 0))
        chosen = jax.lax.cond(carry > k, lambda v: v * k, lambda v: v - k, ys)
        new = {"x": chosen + carry + looped[0], "step": state["step"] + 1}
        return new, {"loops": looped[1]}

    rng = np.random.default_rng()
    state = {"x": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
             "step": jnp.zeros((), jnp.int32)}
    batch = jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)
    ks = [float(k) for k in rng.uniform(0.5, 2.0, size=3)]
    fns = [lambda s, b, k=k: step(s, b, k) for k in ks]
    traced = [group_lib.trace(fn, state, batch) for fn in fns]
    assert len(group_lib.knob_paths(traced)) >= 6  # k in the scan, the while and the cond
    for batching in group_lib.BATCHINGS:
        grouped = group_lib.group_step(traced, step_of=lambda s: s["step"], batching=batching)
        new, metrics = jax.jit(grouped.step)(grouped.knobs, jnp.ones(3, jnp.int32),
                                             _stack([state] * 3), _stack([batch] * 3))
        for i, fn in enumerate(fns):
            alone, alone_metrics = jax.jit(fn)(state, batch)
            np.testing.assert_allclose(new["x"][i], alone["x"], rtol=1e-6, atol=1e-6)
            assert int(metrics["loops"][i]) == int(alone_metrics["loops"]), batching


def test_a_shape_difference_makes_two_groups_and_says_where():
    a = group_lib.trace(lambda x: jnp.sum(x * 2.0), jnp.ones(3))
    b = group_lib.trace(lambda x: jnp.sum(x * 3.0), jnp.ones(3))
    c = group_lib.trace(lambda x: jnp.sum(x * 2.0), jnp.ones(4))
    assert run_group.pack([a, b, c]) == [[0, 1], [2]]
    # declared apart, they pack apart; declared together, the programs refuse the declaration
    assert run_group.pack([a, b, c], declared=["k", "k", "other"]) == [[0, 1], [2]]
    with pytest.raises(group_lib.NotGroupable, match="trials 0 and 2 share every setting .* "
                                                     "differ in stages.x.size"):
        run_group.pack([a, b, c], declared=["k", "k", "k"],
                       settings_of=lambda ids: ["stages.x.size"] if ids == [0, 2] else [])
    with pytest.raises(group_lib.NotGroupable, match="differs from trial 0's in more than"):
        group_lib.knob_paths([a, c])


def test_bands_are_structure_and_the_rest_of_a_bandmf_trial_is_numbers():
    """BandMF trials with 4 bands and different numbers (learning rate, clip, epsilon,
    planned steps: so their strategies differ) pack as one group; 2 bands (another noise
    buffer, another sampler) is another group."""
    rng = np.random.default_rng()
    trials = [bindings + [f"BANDS = {bands}"]
              for bindings, bands in zip(_knobs(rng, "bandmf"), (4, 2, 4))]
    runs = _runs("bandmf", trials)
    traced = [group_lib.trace(r.compiled.lowered.step, r.initial_state(), r.host_batch(0))
              for r in runs]
    assert run_group.pack(traced) == [[0, 2], [1]]
    paths = group_lib.knob_paths([traced[0], traced[2]])
    assert len(paths) > 5  # lifted: every number that differs (strategies included)


# what a grouped trial's record may hold otherwise than its solo record: timings, and the
# checkpoints it resumed from (the solo run ran uninterrupted)
TIMINGS = ("wall_time_s", "calibration_s", "median_step_s", "resumed_from_steps")


def _solo_record(workdir, bindings):
    files = ["pipelines/dpsgd/pipeline.gin", DIGITS]
    config.parse_config(files, list(SMALL) + bindings)
    return run_trials.train(workdir, gin_files=files)


def test_a_group_killed_at_a_random_step_resumes_to_each_trials_solo_record(tmp_path):
    rng = np.random.default_rng()
    trials = [b + ["train.checkpoint_every_steps = 4", "train.log_every_steps = 4"]
              for b in _knobs(rng)[:2]]
    spec = [dict(workdir=str(tmp_path / f"group{i}"), bindings=list(SMALL) + b,
                 gin_files=["pipelines/dpsgd/pipeline.gin", DIGITS])
            for i, b in enumerate(trials)]
    (tmp_path / "trials.json").write_text(json.dumps(spec))
    command = launch.launch_command(tmp_path / "trials.json", tmp_path / "outcomes.json")
    proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    start = time.monotonic()
    while not saved_steps(tmp_path / "group1"):  # the longer trial's first whole checkpoint
        assert proc.poll() is None, "the group ended before its first checkpoint"
        assert time.monotonic() - start < HANG_GUARD_S, "hung: no checkpoint"
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 0.1))  # somewhere after it: a random step
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_early = not (tmp_path / "group1" / "run_record.json").exists()
    resumed = run_guarded(command, cwd=REPO_ROOT)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    for i, bindings in enumerate(trials):
        grouped = json.loads((tmp_path / f"group{i}" / "run_record.json").read_text())
        solo = _solo_record(tmp_path / f"solo{i}", bindings)
        differ = [key for key in solo if key not in TIMINGS + ("group",)
                  and grouped.get(key) != solo[key]]
        assert not differ, f"trial {i}'s record differs from its solo record in {differ}"
        assert grouped["group"]["size"] == 2
        assert grouped["group"]["batches"] == "gathered on the host"  # the CPU's default
        steps = [row["step"] for row in
                 map(json.loads, (tmp_path / f"group{i}" / "metrics.jsonl").open())]
        assert max(steps) == solo["steps"], f"trial {i} logged steps past its plan"
        if killed_early and i == 1:  # the longer trial: resumed from a checkpoint of its own
            assert grouped["resumed_from_steps"], "trial 1 was not resumed"


def test_a_trial_alone_as_a_group_of_one_and_in_a_group_of_eight_gives_one_record(
        tmp_path, monkeypatch):
    """One trial trained alone (``train``), as a group of one (``train_trials``: no trace,
    its own step) and inside a group of 8 whose trials differ in every number and in planned
    steps on a grid (values repeating and differing in every position): the same record, but
    for timings and ``group``, which names the settings its group's trials differ in."""
    rng = np.random.default_rng()
    grid = _grid(rng, "dpsgd") + _grid(rng, "dpsgd") + _grid(rng, "dpsgd")[:2]
    files = ("pipelines/dpsgd/pipeline.gin", DIGITS)
    trials = [run_trials.Trial(tmp_path / f"t{i}", files, tuple(SMALL) + tuple(b))
              for i, b in enumerate(grid)]
    traced = []
    real_traced_of = group_lib.traced_of
    monkeypatch.setattr(group_lib, "traced_of",
                        lambda *a: traced.append(1) or real_traced_of(*a))
    (one,) = run_trials.train_trials([trials[0]._replace(workdir=tmp_path / "one")])
    assert not traced, "a group of one compared its step's program"
    assert one["group"] == dict(size=1, index=0, batching=None, lifted=[])
    eight = run_trials.train_trials(trials)
    assert {r["group"]["size"] for r in eight} == {8} and len(traced) == 8
    assert {"planned_steps", "noise_multiplier", "seed", "ema_decay",
            "stages.optimize.optax.learning_rate"} <= set(eight[0]["group"]["lifted"])
    assert "batch_size" not in eight[0]["group"]["lifted"]
    solo = _solo_record(tmp_path / "solo", grid[0])
    assert solo["group"] == one["group"]
    for name, record in (("the group of one", one), ("trial 0 of the group of 8", eight[0])):
        differ = [key for key in solo if key not in TIMINGS + ("group",)
                  and record.get(key) != solo[key]]
        assert not differ, f"{name} differs from the solo record in {differ}"


def test_a_group_over_its_memory_budget_is_halved_until_its_compiled_step_fits(tmp_path):
    """The budget sits between XLA's buffer plans for a group of two and a group of three:
    three trials train as a group of two (its plan, recorded, within the budget) and one
    alone. The device's own budget (a CPU's: half its available memory) holds all three.
    Their examples are gathered on the device (the CPU's default is the host: the resume test
    above), and the first trial equals its solo run bit for bit; trials on different carvings
    of the data are never gathered from one array."""
    files = ("pipelines/dpsgd/pipeline.gin", DIGITS)
    bindings = [tuple(SMALL) + tuple(b) for b in _knobs(np.random.default_rng())]
    probes = [run_trials.start(run_trials.Trial(tmp_path / f"probe{i}", files, b))
              for i, b in enumerate(bindings)]
    traced = [group_lib.trace(m.run.compiled.lowered.step, m.started.state,
                              m.run.host_batch(m.start_step)) for m in probes]
    need = {n: run_group._compile_group(probes[:n], traced[:n], None, "device").planned
            for n in (2, 3)}
    assert 0 < need[2] < need[3], need
    budget = (need[2] + need[3]) // 2
    trials = [run_trials.Trial(tmp_path / f"trial{i}", files, b) for i, b in enumerate(bindings)]
    split = run_trials.train_trials(trials, memory_budget=budget, gather="device")
    assert [r["group"]["size"] for r in split] == [2, 2, 1]
    assert split[0]["group"]["planned_bytes"] == need[2] <= split[0]["group"]["budget_bytes"]
    assert split[0]["group"]["batches"] == "gathered on the device"
    solo = _solo_record(tmp_path / "solo0", list(bindings[0][len(SMALL):]))
    assert split[0]["final_params_sha256"] == solo["final_params_sha256"]
    assert run_group.device_memory_budget() > need[3]  # a few MB: any test host has them
    other = run_trials.start(run_trials.Trial(tmp_path / "other", files, bindings[0] + (
        "dataset.split_seed = 1",)))
    assert run_group._shared_training_data(probes[:2]) is not None
    assert run_group._shared_training_data([probes[0], other]) is None


def test_a_groups_memory_plan_counts_the_per_example_gradients(tmp_path):
    """A DP step's memory is mostly its temporaries: Nasr et al.'s step discretizes every
    example's gradient, so one micro-batch's per-example gradients are in XLA's plan for the
    group step. The planned bytes count them; the step's arguments and outputs alone (a plan
    that left out the temporaries) are less than them."""
    files = ("pipelines/nasr/pipeline.gin", DIGITS)
    members = [run_trials.start(run_trials.Trial(tmp_path / f"t{i}", files, tuple(SMALL) + (
        f"train.seed = {i}", f"optimize.optax.learning_rate = {0.1 + i}"))) for i in range(2)]
    traced = [group_lib.trace(m.run.compiled.lowered.step, m.started.state,
                              m.run.host_batch(m.start_step)) for m in members]
    compiled = run_group._compile_group(members, traced, None, "host")
    params = sum(x.size for x in jax.tree.leaves(members[0].started.state.params))
    per_example = members[0].run.compiled.micro_batch_size * params * 4  # float32
    plan = compiled.executable.memory_analysis()
    without_temporaries = (plan.argument_size_in_bytes + plan.output_size_in_bytes
                           - plan.alias_size_in_bytes)
    assert without_temporaries < per_example <= compiled.planned, (
        without_temporaries, per_example, compiled.planned)


def test_processes_sharing_a_device_each_plan_for_their_share(monkeypatch):
    """$DPBENCH_MEMORY_FRACTION (the pool's share per worker) scales the budget; a value that is
    not a fraction is refused, naming the variable."""
    monkeypatch.delenv(run_group.MEMORY_FRACTION_ENV, raising=False)
    monkeypatch.setattr(run_group, "_host_available_bytes", lambda: 8_000_000_000)
    monkeypatch.setattr(jax, "devices", lambda *a: [type("Cpu", (), {
        "memory_stats": lambda self: None})()])
    assert run_group.device_memory_budget() == 4_000_000_000
    monkeypatch.setenv(run_group.MEMORY_FRACTION_ENV, "0.05")
    assert run_group.device_memory_budget() == 400_000_000
    for bad in ("0", "1.5", "half"):
        monkeypatch.setenv(run_group.MEMORY_FRACTION_ENV, bad)
        with pytest.raises(ValueError, match="DPBENCH_MEMORY_FRACTION"):
            run_group.device_memory_budget()
