"""Runs that survive: SIGKILL and resume, restore across device counts, corrupt checkpoints,
changed settings, divergence, full disks and finished workdirs."""

import dataclasses
import errno
import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant

from dpbench import accounting, checkpoint, config, records
from dpbench import run as run_lib
from dpbench.run import build as run_build
from tests.conftest import HANG_GUARD_S, REPO_ROOT, run_guarded

DIGITS = ["pipelines/dpsgd/pipeline.gin", "gin/data/digits.gin"]
SHORT = ["train.epochs = 2", "train.log_every_steps = 5", "train.checkpoint_every_steps = 4",
         "train.eval_every_steps = 8"]


def cli_command(workdir, bindings, gin_files=DIGITS):
    return [sys.executable, "-m", "dpbench.main", *[f"--gin_file={f}" for f in gin_files],
            *[f"--gin_bindings={b}" for b in bindings], f"--workdir={workdir}"]


def run_in_process(workdir, bindings=(), **kwargs):
    config.parse_config(DIGITS, list(SHORT) + list(bindings))
    return run_lib.train(workdir, gin_files=DIGITS, **kwargs)


def assert_trees_identical(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) and leaves_a
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# BandMF: its noise buffer resumes too, from checkpoints every 3 steps, mid-band of its 4
@pytest.mark.parametrize("pipeline", ["dpsgd", "bandmf"])
def test_sigkill_at_a_random_step_then_resume_is_bit_identical(pipeline, tmp_path):
    bindings = ["train.epochs = 4", "train.log_every_steps = 1", "train.seed = 11",
                "train.checkpoint_every_steps = 3", "train.eval_every_steps = 6",
                "train.ema_decay = 0.9"]  # the debiased EMA's state (its count too) resumes
    files = [f"pipelines/{pipeline}/pipeline.gin", DIGITS[1]]
    command = functools.partial(cli_command, bindings=bindings, gin_files=files)
    full, killed = tmp_path / "full", tmp_path / "killed"
    uninterrupted = subprocess.Popen(command(full), cwd=REPO_ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_after = int(np.random.default_rng().integers(4, 30))
    victim = subprocess.Popen(command(killed), cwd=REPO_ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    start = time.monotonic()
    while True:  # until the victim has logged step kill_after (its checkpoints are behind it)
        steps = [row["step"] for row in _metrics(killed) if "epsilon" in row]
        if steps and steps[-1] >= kill_after:
            break
        assert victim.poll() is None, "the run finished before it could be killed"
        if time.monotonic() - start > HANG_GUARD_S:
            victim.kill()
            pytest.fail(f"hung: the run to kill did not log step {kill_after} within "
                        f"{HANG_GUARD_S} s")
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert not (killed / "run_record.json").exists()
    saved = checkpoint.RunCheckpoints(killed / run_lib.CHECKPOINTS).latest_step()
    assert saved is not None and saved > 0
    resumed = run_guarded(command(killed), cwd=REPO_ROOT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert uninterrupted.wait(timeout=HANG_GUARD_S) == 0, "the uninterrupted run failed or hung"
    assert f"from its checkpoint at step {saved}" in resumed.stderr
    # The resumed process took up at the checkpoint's step: no step index (so no noise key
    # fold_in(key, step)) was replayed from the start, and the key came from the checkpoint.
    first_resumed_log = [line for line in resumed.stderr.splitlines()
                         if "steps/s  epsilon spent" in line][0]
    assert f"step {saved + 1}/" in first_resumed_log
    a, b = checkpoint.load_saved(full / run_lib.CHECKPOINTS), checkpoint.load_saved(
        killed / run_lib.CHECKPOINTS)
    assert a["step"] == b["step"]
    assert_trees_identical(a["state"], b["state"])  # params, stage states, EMA, step, key
    if pipeline == "bandmf":  # the buffer of the last 3 noise vectors came back with the state
        assert any(np.abs(np.asarray(x)).sum() > 0 for x in jax.tree.leaves(
            [s for s in b["state"]["stage_states"] if "noise" in s]))
    assert_trees_identical(a["best"], b["best"])
    ra, rb = (json.loads((d / "run_record.json").read_text()) for d in (full, killed))
    assert ra["epsilon"] == rb["epsilon"] and ra["test_accuracy"] == rb["test_accuracy"]
    assert rb["resumed_from_steps"] == [saved] and ra["resumed_from_steps"] == []
    # metrics hold each step once: the rows of the steps redone after the kill were dropped
    logged = [row["step"] for row in _metrics(killed) if "epsilon" in row]
    assert logged == sorted(set(logged)) == [row["step"] for row in _metrics(full)
                                             if "epsilon" in row]


def _metrics(workdir):
    return records.read_metrics(workdir)  # skips a line torn by the kill


def test_checkpoint_restores_from_1_to_8_devices_and_back(tmp_path):
    script = textwrap.dedent(f"""
        import jax, numpy as np
        from dpbench import checkpoint, compiler, sharding
        from tests.conftest import compile_small, dpsgd_stages
        devices = jax.devices()
        assert len(devices) == 8
        for save_on, restore_on, name in ((1, 8, "a"), (8, 1, "b")):
            save_mesh = sharding.make_mesh(devices[:save_on])
            compiled, init_params, _ = compile_small(dpsgd_stages(), mesh=save_mesh,
                                                     noise_multiplier=1.0, micro=8)
            state = compiled.init_state(init_params(jax.random.key(0)), jax.random.key(1))
            ckpts = checkpoint.RunCheckpoints(r"{tmp_path}/" + name)
            ckpts.save(state, best_params=state.params, ledger={{"x": 1}})
            restore_mesh = sharding.make_mesh(devices[:restore_on])
            restored = ckpts.restore(0, state_shapes=compiled.state_shapes,
                                     best_shapes=compiled.state_shapes.params,
                                     sharding=sharding.replicated(restore_mesh))
            for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state)):
                assert len(got.sharding.device_set) == restore_on, got.sharding
                if jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key):
                    got, want = jax.random.key_data(got), jax.random.key_data(want)
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            # the restored state runs on the new mesh
            other, _, _ = compile_small(dpsgd_stages(), mesh=restore_mesh,
                                        noise_multiplier=1.0, micro=8)
            padded = other.sampler.padded_batch_size
            batch = other.host_batch(np.zeros((padded, 8, 8, 1), np.float32),
                                     np.zeros(padded, np.int32), np.ones(padded, bool), 0)
            out, _ = other.step(restored.state, sharding.put_batch(batch, restore_mesh))
            assert int(out.step) == 1
        print("OK")
    """)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    proc = run_guarded([sys.executable, "-c", script], cwd=REPO_ROOT, env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


FINISHED_BINDINGS = ["train.fidelity_every_steps = 4"]
# what a resume may change in a finished run's record: timings and where it resumed from
RESUME_VOLATILE = {"calibration_s", "median_step_s", "resumed_from_steps", "wall_time_s"}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One short finished run; tests copy it and damage the copy."""
    import gin
    workdir = tmp_path_factory.mktemp("finished") / "run"
    record = run_in_process(workdir, FINISHED_BINDINGS)
    gin.clear_config()
    return workdir, record


def _unfinished_copy(finished_run, tmp_path):
    import shutil
    workdir, _ = finished_run
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    (copy / "run_record.json").unlink()  # as if killed after the last checkpoint
    return copy


def test_resuming_a_run_whose_last_checkpoint_is_final_writes_the_same_record(
        finished_run, tmp_path):
    copy = _unfinished_copy(finished_run, tmp_path)
    record = run_in_process(copy, FINISHED_BINDINGS)
    _, original = finished_run
    differ = {k for k in set(record) | set(original) if record.get(k) != original.get(k)}
    assert record["resumed_from_steps"] and not original.get("resumed_from_steps")
    assert differ <= RESUME_VOLATILE, differ - RESUME_VOLATILE


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_or_truncated_checkpoint_names_the_file_and_the_last_good_step(
        finished_run, tmp_path, damage):
    copy = _unfinished_copy(finished_run, tmp_path)
    ckpts = checkpoint.RunCheckpoints(copy / run_lib.CHECKPOINTS)
    steps = ckpts.steps()
    assert len(steps) == 2
    latest_dir = ckpts.step_dir(steps[-1])
    victim = max((p for p in latest_dir.rglob("*") if p.is_file() and "state" in p.parts),
                 key=lambda p: p.stat().st_size)
    data = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    else:
        victim.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(checkpoint.CheckpointError) as error:
        run_in_process(copy)
    message = str(error.value)
    assert str(victim) in message and f"last good checkpoint is step {steps[0]}" in message


def test_changed_privacy_setting_is_refused_and_named(finished_run, tmp_path):
    copy = _unfinished_copy(finished_run, tmp_path)
    with pytest.raises(run_lib.ResumeError, match=r"batch_size: 128 -> 64"):
        run_in_process(copy, ["train.batch_size = 64"])
    with pytest.raises(run_lib.ResumeError, match=r"target_epsilon: 3\.0 -> 2\.0"):
        run_in_process(copy, ["EPSILON = 2.0"])
    with pytest.raises(run_lib.ResumeError, match=r"l2_bound"):
        run_in_process(copy, ["clip.global_l2.l2_bound = 0.2"])


def test_finished_run_is_never_overwritten_without_the_flag(finished_run, tmp_path):
    import shutil
    workdir, original = finished_run
    copy = tmp_path / "run"
    shutil.copytree(workdir, copy)
    before = (copy / "run_record.json").read_bytes()
    with pytest.raises(run_lib.WorkdirError, match="--overwrite"):
        run_in_process(copy, ["train.epochs = 1"])
    assert (copy / "run_record.json").read_bytes() == before
    record = run_in_process(copy, ["train.epochs = 1"], overwrite=True)
    archived = list((copy / run_lib.SUPERSEDED).glob("*/run_record.json"))
    assert len(archived) == 1 and archived[0].read_bytes() == before  # nothing lost
    assert record["steps"] < original["steps"]


def test_fidelity_diagnostics_are_recorded_as_non_private(finished_run):
    _, record = finished_run
    fidelity = record["fidelity"]
    assert fidelity["non_private"] and fidelity["samples"] == record["steps"] // 4
    assert -1 <= fidelity["cosine_mean"] <= 1 and fidelity["noise_to_signal_mean"] > 0
    assert any("fidelity" in line for line in record["non_private_outputs"])


def test_checkpoint_records_the_privacy_ledger(finished_run):
    workdir, record = finished_run
    saved = checkpoint.load_saved(workdir / run_lib.CHECKPOINTS)
    ledger = saved["ledger"]
    assert ledger["step"] == record["steps"] == saved["step"]
    assert ledger["epsilon_spent"] == record["epsilon"]
    assert ledger["settings_sha256"] == checkpoint.settings_digest(ledger["settings"])
    assert ledger["dp_event"]["class"] in ("SelfComposedDpEvent", "ComposedDpEvent")
    assert ledger["settings"]["noise_multiplier"] == record["noise_multiplier"]
    # one Settings record: the ledger's settings are the record's, key for key, by one digest
    assert {k: record[k] for k in ledger["settings"]} == ledger["settings"]
    assert record["settings_sha256"] == ledger["settings_sha256"]
    assert set(ledger["settings"]) == {f.name for f in dataclasses.fields(run_lib.Settings)}
    # anyone can recompute the reported epsilon from the events in the record, with
    # dp_accounting's own classes and PLD accountant at the statement's settings (not
    # dpbench's JSON reader or accounting code)
    def rebuild(obj):
        if isinstance(obj, list):
            return [rebuild(o) for o in obj]
        if isinstance(obj, dict):
            return getattr(dp_event, obj["class"])(
                **{k: rebuild(v) for k, v in obj.items() if k != "class"})
        return obj
    statement = record["privacy_statement"]
    assert statement["accountant"] == "pld"
    pld = pld_privacy_accountant.PLDAccountant(**statement["accountant_settings"])
    pld.compose(rebuild(record["dp_event"]))
    assert pld.get_epsilon(record["delta"]) == pytest.approx(record["epsilon"], rel=1e-9)
    # seeded benchmark runs save their key (bit-identical resume) ...
    assert ledger["key_saved"] and np.any(saved["state"]["key"] != 0)


def test_release_run_never_writes_its_key(tmp_path):
    run_in_process(tmp_path / "run", ["train.seed = None", "train.epochs = 1"])
    saved = checkpoint.load_saved(tmp_path / "run" / run_lib.CHECKPOINTS)
    assert not saved["ledger"]["key_saved"] and np.all(saved["state"]["key"] == 0)
    assert saved["ledger"]["settings"]["seed"] is None


def test_fixed_noise_multiplier_stops_at_the_budget_and_says_why(tmp_path):
    record = run_in_process(tmp_path / "run", ["train.noise_multiplier = 0.9",
                                               "train.epochs = 3"])
    assert record["steps"] < record["planned_steps"]
    assert record["epsilon"] <= 3.0 and "privacy budget reached" in record["stop_reason"]
    # it stops at the LAST step within budget: one more step (the record's own events with
    # the step count + 1, recomputed with dp_accounting) would exceed it
    event = accounting.event_from_json(record["dp_event"])
    parts = event.events if isinstance(event, dp_event.ComposedDpEvent) else [event]
    steps = [i for i, e in enumerate(parts) if isinstance(e, dp_event.SelfComposedDpEvent)
             and e.count == record["steps"]]
    assert len(steps) == 1, event
    one_more = list(parts)
    one_more[steps[0]] = dp_event.SelfComposedDpEvent(parts[steps[0]].event, record["steps"] + 1)
    budget = accounting.Budget(epsilon=3.0, delta=record["delta"])
    assert accounting.epsilon_of(dp_event.ComposedDpEvent(list(parts)), budget) <= 3.0
    assert accounting.epsilon_of(dp_event.ComposedDpEvent(one_more), budget) > 3.0
    with pytest.raises(accounting.BudgetError, match="enforce_budget"):
        run_in_process(tmp_path / "zero", ["train.noise_multiplier = 0.0"])


def test_diverging_run_stops_and_keeps_its_last_good_checkpoint(tmp_path):
    workdir = tmp_path / "run"
    with pytest.raises(run_lib.TrainingDiverged, match="last good checkpoint is step") as error:
        run_in_process(workdir, ["optimize.optax.learning_rate = 1e38",
                                 "train.checkpoint_every_steps = 1", "train.log_every_steps = 1",
                                 "optimize.optax.momentum = 0.0"])
    last = int(str(error.value).split("last good checkpoint is step ")[1].split()[0])
    saved = checkpoint.load_saved(workdir / run_lib.CHECKPOINTS)
    assert saved["step"] == last
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(saved["state"]["params"]))
    assert not (workdir / "run_record.json").exists()


def test_full_disk_during_a_checkpoint_names_the_last_good_step(tmp_path, monkeypatch):
    calls = {"n": 0}
    original = checkpoint.ocp.CheckpointManager.save

    def failing_save(self, step, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "save", failing_save)
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"No space left on device.*last good checkpoint is step 4"):
        run_in_process(tmp_path / "run")


def _one_nonfinite_example_per_step(monkeypatch):
    """Every step reports one more non-finite (zeroed) example than it had: a count to follow
    through a checkpoint, the step's computation unchanged."""
    import dataclasses
    build = run_build.build_run  # run.start builds the run

    def counting_build(*args, **kwargs):
        run = build(*args, **kwargs)
        step = run.compiled.step

        def counting_step(state, batch):
            new, metrics = step(state, batch)
            return new, dict(metrics, nonfinite_examples=metrics["nonfinite_examples"] + 1.0)
        return dataclasses.replace(run, compiled=dataclasses.replace(run.compiled,
                                                                     step=counting_step))
    monkeypatch.setattr(run_build, "build_run", counting_build)


def test_a_resumed_run_reports_every_nonfinite_example_of_its_first_segment(tmp_path,
                                                                            monkeypatch):
    """The zeroed-example count is restored from the checkpoint's ledger: a run stopped after
    its step-4 checkpoint and resumed reports one example per step of both segments (digits
    has no non-finite example of its own), never only its second segment's."""
    _one_nonfinite_example_per_step(monkeypatch)
    original = checkpoint.ocp.CheckpointManager.save
    saves = {"n": 0}

    def second_save_fails(self, step, *args, **kwargs):
        saves["n"] += 1
        if saves["n"] > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, step, *args, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint.ocp.CheckpointManager, "save", second_save_fails)
        with pytest.raises(checkpoint.CheckpointError, match="last good checkpoint is step 4"):
            run_in_process(tmp_path / "stopped")
    resumed = run_in_process(tmp_path / "stopped")
    assert resumed["resumed_from_steps"] and resumed["steps"] > 8
    assert resumed["nonfinite_examples"] == resumed["steps"]


def test_unwritable_workdir_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(run_lib.WorkdirError, match="cannot write to --workdir"):
        run_in_process(blocker / "run")


def test_a_relative_workdir_checkpoints_and_finishes(tmp_path, monkeypatch):
    # regression: orbax refuses relative paths, which broke runs with --workdir=runs/x
    monkeypatch.chdir(tmp_path)
    record = run_in_process(Path("runs") / "relative", ["train.epochs = 1",
                                                        "train.checkpoint_every_steps = 3"])
    assert record["steps"] > 3
    assert checkpoint.RunCheckpoints(tmp_path / "runs" / "relative" / run_lib.CHECKPOINTS).steps()
