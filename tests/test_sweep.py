"""``dpbench sweep`` end to end on a local Ray instance: one tiny search (digits, DP-SGD and a
researcher's own method from their own folder, K = 2) interrupted and restored, its published
records, the search's epsilon recomputed from them, and the board built from them. Every test
that needs a finished sweep reads that one (the module fixture), so the suite runs it once."""

import argparse
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import ray  # the [sweep] extra: CI installs it, so this test never skips
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpbench import accounting, config, sweep
from dpbench.search import methods
from dpbench.search import tuning
from dpbench.sweep import cost as sweep_cost
from dpbench.sweep import preflight as sweep_checks
from dpbench.sweep import planning as sweep_plan
from dpbench.sweep import secret as sweep_secret
from dpbench.search.protocol import ProtocolError, at_epsilon, load_protocol
from dpbench.search.space import privacy_key, trial_bindings
from tests.conftest import HANG_GUARD_S, run_guarded, wait_guarded

GROUP = "digits__logistic__eps3.0__delta1e-05"
RECIPE = ["train.epochs = 1", "train.batch_size = 256"]
PROTOCOL = {
    "delta": 1e-05, "epsilons": [3.0], "seeds": [0, 1],
    "trials": {"shape": 1, "mean_random": 1, "seed": 7},  # J = 1 surely: K = 2
    "families": {"digits__logistic": {
        "gin_files": ["gin/data/digits.gin", "gin/model/logistic.gin"],
        "base": ["train.log_every_steps = 5"],
        "space": {"optimize.optax.learning_rate": {"log_uniform": [0.5, 4.0]},
                  "train.batch_size": {"choice": [256], "privacy": True},
                  "train.epochs": {"choice": [1], "privacy": True}},
        "methods": {"dpsgd": {"gin_file": "pipelines/dpsgd/pipeline.gin", "trial0": RECIPE},
                    "rs": {"gin_file": "pipelines/rs/pipeline.gin", "trial0": RECIPE,
                           "space": {"sparsify.random_mask.final_rate": {
                               "uniform": [0.3, 0.9]}}}}}}}


def sweep_command(tmp):
    return [sys.executable, "-c", "import sys; from dpbench import sweep; "
            "sys.exit(sweep.main(sys.argv[1:]))", f"--protocol={tmp / 'protocol.json'}",
            f"--runs_dir={tmp / 'runs'}", f"--records={tmp / 'records'}", "--cpus=2"]


# The researcher's own command (tests/test_method_folder.py's method folder and the
# documented protocol), run from their folder: the one tiny sweep every sweep and board test
# reads. Its records are under board/records there.
RESEARCHER_SWEEP = [sys.executable, "-m", "dpbench.main", "sweep", "--protocol=protocol.json",
                    "--records=board/records", "--runs_dir=runs", "--cpus=2"]
OTHER = "halfclip"  # the researcher's method, DP-SGD's opponent in the tiny sweep
RUNS = [f"{m}-t{t}-seed{s}" for m in ("dpsgd", OTHER) for t, s in ((0, 0), (1, 0))]


@pytest.fixture(scope="module")
def finished_sweep(tmp_path_factory):
    """A researcher's sweep (digits, K = 2 fixed, DP-SGD and their own method halfclip from
    their own folder): `dpbench sweep` stopped (SIGTERM, as Ctrl-C would) once its first
    record is published, then the same command again to the end. Returns (the researcher's
    folder, the records folder, the runs published before the stop, both outputs, git status
    of the repository before)."""
    from tests.test_method_folder import make_method, repo_status
    tmp = tmp_path_factory.mktemp("researcher")
    make_method(tmp)
    before = repo_status()
    records = tmp / "board" / "records"
    group = records / GROUP
    first = subprocess.Popen(RESEARCHER_SWEEP, cwd=tmp, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    start = time.monotonic()
    while not list(group.glob("*/run_record.json")) and first.poll() is None:
        if time.monotonic() - start > HANG_GUARD_S:
            first.kill()
            pytest.fail(f"hung: the sweep published no record under {group} and did not exit "
                        f"within {HANG_GUARD_S} s")
        time.sleep(0.2)
    published_before = sorted(p.parent.name for p in group.glob("*/run_record.json"))
    first.send_signal(signal.SIGTERM)
    out_first = wait_guarded(first, "the sweep, stopped with SIGTERM,")
    second = subprocess.Popen(RESEARCHER_SWEEP, cwd=tmp, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    out_second = wait_guarded(second, "the resumed sweep")
    assert second.returncode == 0, out_second[-6000:]
    return SimpleNamespace(folder=tmp, records=records, published_before=published_before,
                           out_first=out_first, out_second=out_second, repo_before=before)


# The law of a random K that draws the tiny sweep's K = 2 surely (J = 1), for the tests of a
# random-K search: they read the sweep's records under this law instead of its fixed K = 2.
RANDOM_LAW = {"shape": 1, "mean_random": 1, "seed": 7}


def copied_records(finished_sweep, tmp_path, trials_law=None):
    """A copy of the tiny sweep's records (tests change them), its plan's trials law replaced
    by ``trials_law`` when given. Returns (records, group)."""
    records = tmp_path / "records"
    shutil.copytree(finished_sweep.records, records)
    group = records / GROUP
    if trials_law is not None:
        plan = json.loads((group / sweep.SEARCH_FILE).read_text())
        plan["trials_law"] = trials_law
        (group / sweep.SEARCH_FILE).write_text(json.dumps(plan))
    return records, group


def test_an_interrupted_sweep_resumes_without_rerunning_a_finished_trial(finished_sweep):
    assert finished_sweep.published_before, finished_sweep.out_first[-2000:]
    launches = (finished_sweep.folder / "runs" / sweep.LAUNCH_LOG).read_text().split()
    for name in finished_sweep.published_before:  # finished before the stop: launched once
        assert launches.count(f"{GROUP}/{name}") == 1, launches
    assert "restoring" in finished_sweep.out_second  # Tune's own restore, not a fresh one
    group = finished_sweep.records / GROUP
    plan = json.loads((group / sweep.SEARCH_FILE).read_text())
    assert plan["num_trials"] == 2
    for name in RUNS:  # each method's search: one pack, its two trials one group step
        record = json.loads((group / name / "run_record.json").read_text())
        assert record["group"]["size"] == 2, (name, record.get("group"))
    summary = tuning.search_summary(group)
    for method in ("dpsgd", OTHER):  # the winner, and only it, got the second seed
        winner = summary[method]["winner"]
        assert (group / f"{method}-t{winner}-seed1" / "run_record.json").exists()
        assert not (group / f"{method}-t{1 - winner}-seed1").exists()


def test_a_researchers_method_goes_from_its_folder_to_the_board(finished_sweep):
    """Acceptance of the researcher's path: one stage module + one method folder, run from the
    researcher's own folder with the documented protocol (digits, K fixed at 2, dpsgd and the
    new method) through `dpbench sweep` (the fixture) and `dpbench board`; no file of the
    repository changes."""
    from tests.test_method_folder import repo_status
    folder, group = finished_sweep.folder, finished_sweep.records / GROUP
    record = json.loads((group / "halfclip-t0-seed0" / "run_record.json").read_text())
    assert record["pipeline"] == "halfclip" and record["stages"][1]["name"] == "halfclip.scale"
    assert record["stage_sources"][0]["path"] == str(
        folder / "my_methods" / "halfclip" / "halfclip_stages.py")
    summary = tuning.search_summary(group)
    # K = 2 fixed (public): the search's epsilon is the PLD composition of its two runs
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    for trial in (0, 1):
        run = json.loads((group / f"halfclip-t{trial}-seed0" / "run_record.json").read_text())
        pld.compose(accounting.event_from_json(run["dp_event"]))
    assert summary["halfclip"]["num_trials"] == 2
    assert summary["halfclip"]["search_epsilon"] == pytest.approx(pld.get_epsilon(1e-5),
                                                                  rel=1e-6)
    shown = subprocess.Popen([sys.executable, "-m", "dpbench.main", "board",
                              "--records=board/records", "--methods_dirs", "my_methods"],
                             cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    out = wait_guarded(shown, "dpbench board")
    assert shown.returncode == 0, out[-3000:]
    text = (folder / "board" / "README.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| halfclip |"))
    assert "| A. Res" in row and "+9 over DP-SGD" in row and f"{summary['halfclip']['search_epsilon']:.3f}" in row
    assert "2 (fixed K; ε composes the K runs)" in text
    assert repo_status() == finished_sweep.repo_before


def test_the_search_epsilon_is_recomputed_from_the_records_with_dp_accounting(finished_sweep,
                                                                              tmp_path):
    _, group = copied_records(finished_sweep, tmp_path, RANDOM_LAW)
    summary = tuning.search_summary(group)
    for method in ("dpsgd", OTHER):
        trial0 = json.loads((group / f"{method}-t0-seed0" / "run_record.json").read_text())
        trial1 = json.loads((group / f"{method}-t1-seed0" / "run_record.json").read_text())
        # one support point (B 256, 1 epoch) = trial 0's settings: dp_accounting's public
        # RepeatAndSelectDpEvent composed after trial 0 gives the search's epsilon
        run = accounting.event_from_json(trial0["dp_event"])
        assert trial1["dp_event"] == trial0["dp_event"]
        view, overflow = accounting._rdp_view(run)
        rdp = rdp_privacy_accountant.RdpAccountant()
        rdp.compose(dp_event.ComposedDpEvent([view, dp_event.RepeatAndSelectDpEvent(view, 1, 1)]))
        expected = rdp.get_epsilon(1e-5)
        assert summary[method]["search_epsilon"] == pytest.approx(expected, rel=1e-3)
        assert summary[method]["search_epsilon"] > trial0["epsilon"]


@pytest.mark.parametrize("law", [{"shape": "inf", "mean_random": 3},
                                 {"shape": 1, "mean_random": 4}])
def test_a_random_k_search_epsilon_is_dp_accountings_for_the_declared_law(finished_sweep,
                                                                          tmp_path, law):
    """Known value, from a group's records alone: the tiny sweep's records read as a random-K
    search with J ~ ``law`` (the epsilon depends on the law, not on the J drawn); each
    method's search_summary epsilon is dp_accounting's RDP of trial 0 composed with its public
    RepeatAndSelectDpEvent at the DECLARED mean and shape (a mean off by one moves it far
    beyond the tolerance)."""
    _, group = copied_records(finished_sweep, tmp_path, dict(law, seed=7))
    plan = json.loads((group / sweep.SEARCH_FILE).read_text())
    shape = math.inf if law["shape"] == "inf" else float(law["shape"])
    for method, got in tuning.search_summary(group).items():
        (support,) = plan["methods"][method]["support"]  # B 256, 1 epoch: one support point
        view, _ = accounting._rdp_view(accounting.event_from_json(support["event"]))
        rdp = rdp_privacy_accountant.RdpAccountant()
        rdp.compose(dp_event.ComposedDpEvent(
            [view, dp_event.RepeatAndSelectDpEvent(view, law["mean_random"], shape)]))
        # the search charges the truncated batches' overflow (~1e-12) to delta: rel 1e-3
        assert got["search_epsilon"] == pytest.approx(rdp.get_epsilon(1e-5), rel=1e-3)
        assert got["law"] == law


def test_a_fixed_k_board_states_its_deployments_secret_k_epsilon(finished_sweep, tmp_path):
    """A fixed K (board v3: K is public) with a declared deployment law: search_summary gives
    the K runs' composition AND the Papernot-Steinke epsilon of a deployment drawing J from that
    law in secret, dp_accounting's RepeatAndSelectDpEvent after trial 0."""
    _, group = copied_records(finished_sweep, tmp_path)
    plan = json.loads((group / sweep.SEARCH_FILE).read_text())
    plan["trials_law"] = {"fixed": 2, "seed": 7,
                          "deployment": {"shape": "inf", "mean_random": 3}}
    (group / sweep.SEARCH_FILE).write_text(json.dumps(plan))
    summary = tuning.search_summary(group)
    for method in ("dpsgd", OTHER):
        trial0 = json.loads((group / f"{method}-t0-seed0" / "run_record.json").read_text())
        trial1 = json.loads((group / f"{method}-t1-seed0" / "run_record.json").read_text())
        view, _ = accounting._rdp_view(accounting.event_from_json(trial0["dp_event"]))
        secret = rdp_privacy_accountant.RdpAccountant()
        secret.compose(dp_event.ComposedDpEvent(
            [view, dp_event.RepeatAndSelectDpEvent(view, 3, math.inf)]))
        # K = 2 public: the PLD composition of the two runs' own events
        composed = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
        for run in (trial0, trial1):
            composed.compose(accounting.event_from_json(run["dp_event"]))
        got = summary[method]
        assert got["deployment_epsilon"] == pytest.approx(secret.get_epsilon(1e-5), rel=1e-3)
        assert got["search_epsilon"] == pytest.approx(composed.get_epsilon(1e-5), rel=1e-6)
        assert got["deployment_epsilon"] > got["search_epsilon"]  # mean K 4 > K 2
        assert got["deployment_note"] is None
    # a deployment whose expected truncated-batch overflows, times (1 + e^eps), exceed delta
    # has no RDP bound: no number, and the reason (the board prints it under the group)
    assert trial0["dp_event"]["event"]["class"] == "TruncatedSubsampledGaussianDpEvent"
    plan["trials_law"]["deployment"]["mean_random"] = 1e4
    (group / sweep.SEARCH_FILE).write_text(json.dumps(plan))
    for got in tuning.search_summary(group).values():
        assert got["deployment_epsilon"] is None
        assert "overflow" in got["deployment_note"] and "overflow_stddevs" in got["deployment_note"]
        assert got["search_epsilon"] > 0  # K public: unaffected
    with pytest.raises(ProtocolError, match="deployment"):
        from dpbench.search import protocol
        protocol._check_trial_law("p.json", {"fixed": 8, "deployment": {"mean_random": 7}})


def test_a_malformed_or_mismatched_record_is_rejected_with_its_path(finished_sweep, tmp_path):
    _, group = copied_records(finished_sweep, tmp_path)
    bad = group / f"{OTHER}-t1-seed0" / "run_record.json"
    record = json.loads(bad.read_text())
    record["dp_event"]["count"] += 1  # a run longer than its declared support point
    bad.write_text(json.dumps(record))
    with pytest.raises(tuning.SearchRecordError, match="privacy") as e:
        tuning.search_summary(group)
    assert str(bad) in str(e.value)
    bad.write_text("{not json")
    with pytest.raises(tuning.SearchRecordError, match="unreadable") as e:
        tuning.search_summary(group)
    assert str(bad) in str(e.value)
    os.remove(bad)
    with pytest.raises(tuning.SearchRecordError, match="no published record"):
        tuning.search_summary(group)


def _scaled_noise(event: dict, factor: float) -> dict:
    """The event (JSON) with every noise multiplier times ``factor``."""
    out = {k: _scaled_noise(v, factor) if isinstance(v, dict) else v for k, v in event.items()}
    if "noise_multiplier" in out:
        out["noise_multiplier"] *= factor
    return out


def test_a_record_calibrated_on_another_numeric_stack_matches_its_support_point(
        finished_sweep, tmp_path):
    """Board v3's runs made on the lent GPU machine (scipy 1.18.1, numpy 2.5.2) calibrated
    sigma 3.5e-10 (relative) away from search.json's (this host's stack): the same mechanism,
    accepted; a sigma 1e-4 away (another mechanism) or one more step is refused, naming it."""
    _, group = copied_records(finished_sweep, tmp_path)
    path = group / f"{OTHER}-t1-seed0" / "run_record.json"
    record = json.loads(path.read_text())
    planned = record["dp_event"]
    for factor, matches in ((1 - 3.5e-10, True), (1 + 3.5e-10, True), (1 - 1e-4, False),
                            (1 + 1e-4, False)):
        moved = _scaled_noise(planned, factor)
        assert tuning.events_match(planned, moved) is matches, factor
        path.write_text(json.dumps({**record, "dp_event": moved}))
        if matches:
            tuning.search_summary(group)
        else:
            with pytest.raises(tuning.SearchRecordError, match="privacy") as e:
                tuning.search_summary(group)
            assert str(path) in str(e.value)
    longer = dict(planned, count=planned["count"] + 1)
    assert not tuning.events_match(planned, longer)
    assert not tuning.events_match(planned, dict(planned, count=float(planned["count"])))
    assert not tuning.events_match(planned, {**planned, "extra": 1})


def test_an_unfinished_search_is_listed_not_ranked(finished_sweep, tmp_path):
    from dpbench import board
    records, _ = copied_records(finished_sweep, tmp_path)
    winner = tuning.search_summary(records / GROUP)["dpsgd"]["winner"]
    shutil.rmtree(records / GROUP / f"dpsgd-t{winner}-seed1")  # a winner's seed still running
    table = board.build(records, tmp_path / "board")
    assert GROUP not in table
    assert f"`{GROUP}` 5 of 6 runs" in (tmp_path / "board" / "README.md").read_text()
    (records / GROUP / f"{OTHER}-t0-seed9").mkdir()  # a stray run the plan does not know
    (records / GROUP / f"{OTHER}-t0-seed9" / "diverged.json").write_text("{}")
    (records / GROUP / "extra").mkdir()
    shutil.copytree(records / GROUP / f"{OTHER}-t0-seed0", records / GROUP / "extra2")
    shutil.copytree(records / GROUP / f"{OTHER}-t0-seed0", records / GROUP / "extra3")
    with pytest.raises(board.LeaderboardError, match="remove the strays"):
        board.build(records, tmp_path / "board")


def test_the_board_shows_the_search_and_regenerates_identical_bytes(finished_sweep, tmp_path,
                                                                   capsys):
    from dpbench import board
    records, group = copied_records(finished_sweep, tmp_path, RANDOM_LAW)
    table = board.build(records, tmp_path / "a")
    # halfclip's folder is the researcher's, not passed here: its paper and claim show as
    # n/a, and the board says why and what to pass
    assert (f"no method folder for '{OTHER}'" in capsys.readouterr().err)
    summary = tuning.search_summary(group)
    for row in table[GROUP]:  # the protocol's delta (1e-5), not digits.gin's default (1e-4)
        assert row["search"]["search_epsilon"] == summary[row["method"]]["search_epsilon"]
        assert row["seeds"] == 2  # the winner's two seeds
    text = (tmp_path / "a" / "README.md").read_text()
    assert f"{summary['dpsgd']['search_epsilon']:.3f}" in text
    assert "2 (1 + J, J ~ geometric, mean 1)" in text
    assert f"plots/{GROUP}__trials.svg" in text
    board.build(records, tmp_path / "b")
    capsys.readouterr()
    for name in ("README.md", "index.html", f"plots/{GROUP}__trials.svg"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    # with the researcher's method folder passed, no warning (board v2's unpaired verdicts
    # are retired: a searched group without paired trials shows its configurations only)
    board.build(records, tmp_path / "c", methods_dirs=(
        methods.BOARD_METHODS, finished_sweep.folder / "my_methods"))
    assert "no method folder" not in capsys.readouterr().err  # every method has its folder
    assert "## The answer" not in (tmp_path / "c" / "README.md").read_text()


def test_a_changed_protocol_is_refused_once_a_search_began(tmp_path):
    """search.json fixes a group's trials: rerunning with another space must not silently mix
    two searches (their trials, and so their epsilon, would differ)."""
    protocol = json.loads(json.dumps(PROTOCOL))
    protocol["families"]["digits__logistic"]["methods"].pop("rs")
    plan = sweep_plan.prepare(protocol, "digits__logistic", 3.0, ["dpsgd"], tmp_path)
    assert plan["num_trials"] == 2 and len(plan["methods"]["dpsgd"]["support"]) == 1
    assert sweep_plan.prepare(protocol, "digits__logistic", 3.0, ["dpsgd"], tmp_path) == plan
    # a range of its own for epsilon 1 leaves this group's search as it was, and an epsilon-1
    # group stores the range in force there (search.json never holds "at_epsilon")
    revised = json.loads(json.dumps(protocol))
    lr = revised["families"]["digits__logistic"]["space"]["optimize.optax.learning_rate"]
    lr["at_epsilon"] = {"1.0": [0.01, 0.02]}
    assert sweep_plan.prepare(revised, "digits__logistic", 3.0, ["dpsgd"], tmp_path) == plan
    at_one = sweep_plan.prepare(revised, "digits__logistic", 1.0, ["dpsgd"], tmp_path)
    assert at_one["family_spec"]["space"]["optimize.optax.learning_rate"] == {
        "log_uniform": [0.01, 0.02]}
    drawn = dict(b.split(" = ") for b in at_one["methods"]["dpsgd"]["trials"][1])
    assert 0.01 <= float(drawn["optimize.optax.learning_rate"]) <= 0.02
    protocol["families"]["digits__logistic"]["space"]["optimize.optax.learning_rate"] = {
        "log_uniform": [0.1, 1.0]}
    with pytest.raises(ProtocolError, match="the protocol changed") as e:
        sweep_plan.prepare(protocol, "digits__logistic", 3.0, ["dpsgd"], tmp_path)
    assert str(tmp_path / GROUP / sweep.SEARCH_FILE) in str(e.value)


def _write_run(run_dir, wall_segments, record_wall=None, group_size=None):
    """A run directory whose metrics.jsonl logged ``wall_segments`` (one list of wall_s per
    process that trained it), and a run record when record_wall is given (of a trial trained
    in a group of ``group_size`` when given)."""
    run_dir.mkdir(parents=True)
    lines = []
    for segment in wall_segments:
        for step, wall in enumerate(segment):
            lines.append(json.dumps({"step": step, "wall_s": wall}))
            lines.append(json.dumps({"step": step, "validation_accuracy": 0.5}))
    lines.append('{"step": 9, "wall_s": 1')  # a line cut by a kill
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if record_wall is not None:
        record = {"wall_time_s": record_wall}
        if group_size is not None:
            record["group"] = {"size": group_size, "index": 0}
        (run_dir / "run_record.json").write_text(json.dumps(record))


def test_the_sweep_cost_sums_every_segment_of_every_run(tmp_path):
    """`dpbench sweep --cost`: per group, runs started and finished and the core-hours they
    took: each process's last logged wall time, the record's own for a finished run's last
    segment (it covers the steps after the last log), times the CPUs per trial; a trial
    trained in a group of T, 1/T of its group's process."""
    rng = np.random.default_rng()
    a, b, c = (float(x) for x in rng.uniform(100, 1000, size=3))
    _write_run(tmp_path / "g1" / "dpsgd-t0-seed0", [[10.0, a], [5.0, b]], record_wall=b + 7.0)
    _write_run(tmp_path / "g1" / "rs-t0-seed0", [[3.0, c]])  # interrupted, never finished
    _write_run(tmp_path / "g2" / "gep-t1-seed0", [[1.0, 2.0]], record_wall=2.5)
    for t in (2, 3, 4, 5):  # four trials that shared one process of 40 s
        _write_run(tmp_path / "g2" / f"gep-t{t}-seed0", [[1.0, 30.0]], record_wall=40.0,
                   group_size=4)
    cost = sweep_cost.sweep_cost(tmp_path, cpus_per_trial=2.0)
    assert cost["g1"]["started"] == 2 and cost["g1"]["finished"] == 1
    assert cost["g1"]["core_hours"] == pytest.approx(2.0 * (a + b + 7.0 + c) / 3600)
    assert cost["g2"]["core_hours"] == pytest.approx(2.0 * (2.5 + 40.0) / 3600)
    out = subprocess.run([sys.executable, "-m", "dpbench.sweep", "--cost",
                          f"--runs_dir={tmp_path}"], capture_output=True, text=True, check=True)
    assert "g1: 2 runs started, 1 finished" in out.stdout
    assert f"total: {(a + b + 7.0 + c + 2.5 + 40.0) / 3600:.2f} core-hours" in out.stdout


def test_the_sweeps_progress_is_read_from_its_published_records(tmp_path, capsys):
    """`dpbench sweep --progress`: per group, runs published of those expected, the junk so
    far, the published records' wall time, and each unpublished run estimated at its method's
    median in the group, else in its family's other groups, else unknown."""
    rng = np.random.default_rng()
    walls = {name: float(w) for name, w in zip(
        ["dpsgd-t0-seed0", "dpsgd-t1-seed0", "dpsgd-t2-seed0", "dpsgd-t0-seed1",
         "rs-t0-seed0", "rs-t1-seed0"], rng.uniform(100, 1000, size=6))}
    accuracy = {"dpsgd-t1-seed0": 0.70}  # the one junk trial: > 5 points below the best 0.86
    # a run made on a GPU: its wall time is GPU-worker time, neither core time nor a CPU estimate
    on_gpu = {"rs-t2-seed0"}
    walls["rs-t2-seed0"] = float(rng.uniform(10, 50))

    def group(name, runs, methods=("dpsgd", "rs")):
        (tmp_path / name).mkdir()
        (tmp_path / name / sweep.SEARCH_FILE).write_text(json.dumps(dict(
            family="F", seeds=[0, 1], num_trials=3, methods={m: {} for m in methods})))
        for run in runs:
            (tmp_path / name / run).mkdir()
            (tmp_path / name / run / "run_record.json").write_text(json.dumps(dict(
                wall_time_s=walls[run], test_accuracy=accuracy.get(run, 0.86),
                devices=["cuda:0"] if run in on_gpu else ["TFRT_CPU_0"])))
    group("F__eps1", walls)                    # dpsgd done (4 runs), rs 3 of 4 (1 on a GPU)
    group("F__eps3", ["rs-t0-seed0"])          # dpsgd 0 of 4: the family's median
    report = sweep_cost.progress(tmp_path)
    one, three = report["F__eps1"], report["F__eps3"]
    assert (one["published"], one["expected"], one["junk"], one["random"]) == (7, 8, 1, 4)
    cpu = [w for n, w in walls.items() if n not in on_gpu]
    assert one["core_hours"] == pytest.approx(sum(cpu) / 3600)
    assert one["gpu_hours"] == pytest.approx(walls["rs-t2-seed0"] / 3600)
    rs = [walls["rs-t0-seed0"], walls["rs-t1-seed0"]]
    assert one["left_core_hours"] == pytest.approx(1 * np.median(rs) / 3600)
    dpsgd = [w for n, w in walls.items() if n.startswith("dpsgd")]
    assert three["left_core_hours"] == pytest.approx(
        (4 * np.median(dpsgd) + 3 * walls["rs-t0-seed0"]) / 3600)
    sweep_cost.print_progress(tmp_path, 2)
    out = capsys.readouterr().out
    assert "F__eps1: 7 of 8 runs published; junk 1 of 4 random trials" in out
    assert f"{one['gpu_hours']:.2f} GPU-worker hours" in out
    total = one["left_core_hours"] + three["left_core_hours"]
    assert f"~{total:.1f} left (~{total / 2:.1f} h on 2 CPUs)" in out
    group("F__eps8", [], methods=("gep",))     # a method with no run anywhere: unknown
    assert sweep_cost.progress(tmp_path)["F__eps8"]["left_core_hours"] is None
    sweep_cost.print_progress(tmp_path, 2)
    assert "left unknown" in capsys.readouterr().out


def test_an_unreachable_ray_address_is_refused_at_once_with_one_line(tmp_path, capsys,
                                                                      monkeypatch):
    """A closed port (nothing listens on 127.0.0.1:1) gives up before any protocol work or
    Ray start (ray.init alone retried for minutes), with one line saying what to do."""
    def never(*args, **kwargs):
        raise AssertionError("ray.init was called for an unreachable address")
    monkeypatch.setattr(ray, "init", never)
    code = sweep.main(["--address=127.0.0.1:1", f"--records={tmp_path / 'records'}",
                       f"--runs_dir={tmp_path / 'runs'}"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no Ray cluster answers at --address=127.0.0.1:1" in err
    assert not (tmp_path / "records").exists()
    assert sweep_checks.unreachable_reason("auto") is None
    assert "is not host:port" in sweep_checks.unreachable_reason("localhost")


@pytest.mark.parametrize("break_it,match", [
    (lambda f: f["space"].update({"optimize.optax.learning_rat": {"uniform": [1.0, 2.0]}}),
     r"method 'dpsgd', trial 1: its settings do not parse .*learning_rat"),
    (lambda f: f["methods"].update(mine=f["methods"].pop("dpsgd")),
     r"method 'mine' runs pipelines/dpsgd/pipeline.gin, whose pipeline.name is 'dpsgd'")])
def test_a_protocol_typo_or_a_misnamed_method_is_refused_before_anything_is_written(
        break_it, match, tmp_path):
    protocol = json.loads(json.dumps(PROTOCOL))
    family = protocol["families"]["digits__logistic"]
    family["methods"].pop("rs")
    break_it(family)
    method = next(iter(family["methods"]))
    with pytest.raises(ProtocolError, match=match):
        sweep_plan.prepare(protocol, "digits__logistic", 3.0, [method], tmp_path)
    assert not (tmp_path / GROUP).exists()


def test_a_users_protocol_never_publishes_into_the_committed_board_by_default(tmp_path, capsys):
    (tmp_path / "protocol.json").write_text(json.dumps(PROTOCOL))
    before = sorted(p.name for p in (config.REPO_ROOT / "leaderboard" / "records").iterdir())
    assert sweep.main([f"--protocol={tmp_path / 'protocol.json'}", "--prepare_only"]) == 2
    err = capsys.readouterr().err
    assert "is not the board's own" in err and "pass --records=DIR" in err
    after = sorted(p.name for p in (config.REPO_ROOT / "leaderboard" / "records").iterdir())
    assert after == before
    # the board's own protocol, another records dir, or the explicit flag: no objection
    official = config.REPO_ROOT / "leaderboard"
    assert sweep_checks.foreign_protocol_reason(official / "protocol.json", official / "records",
                                         False) is None
    assert sweep_checks.foreign_protocol_reason(tmp_path / "protocol.json", tmp_path, False) is None
    assert sweep_checks.foreign_protocol_reason(tmp_path / "protocol.json", official / "records",
                                         True) is None


def test_a_published_or_finished_trial_is_never_trained_again(tmp_path):
    """run_pack of one trial whose record is published returns it untouched; one that finished
    under --runs_dir but was not published is published from there. Neither launches a run
    (the launch log stays empty: a real launch would write it before training)."""
    job = dict(records=str(tmp_path / "records"), runs_dir=str(tmp_path / "runs"),
               repo=str(config.REPO_ROOT), group=GROUP, epsilon=3.0, delta=1e-5,
               method="dpsgd", trial=1, seed=0, gin_files=[], bindings=[])
    target = tmp_path / "records" / GROUP / "dpsgd-t1-seed0"
    target.mkdir(parents=True)
    published = json.dumps({"validation_accuracy": 0.5, "note": "published"}).encode()
    (target / "run_record.json").write_bytes(published)
    assert sweep.run_pack([job]) == dict(trials=1, validation_accuracy=0.5, diverged=0)
    assert (target / "run_record.json").read_bytes() == published
    finished = tmp_path / "runs" / GROUP / "dpsgd-t2-seed0"
    finished.mkdir(parents=True)
    (finished / "run_record.json").write_text(json.dumps({"validation_accuracy": 0.7}))
    assert sweep.run_pack([dict(job, trial=2)])["validation_accuracy"] == 0.7
    assert (tmp_path / "records" / GROUP / "dpsgd-t2-seed0" / "run_record.json").read_text() \
        == (finished / "run_record.json").read_text()
    assert not (tmp_path / "runs" / sweep.LAUNCH_LOG).exists()


class _HalfThenFail:
    """A writable file that writes half of what it is given, then fails as a full disk or a
    killed process would."""

    def __init__(self, f):
        self._f = f

    def write(self, data):
        self._f.write(data[:len(data) // 2])
        self._f.flush()
        raise OSError(28, "No space left on device (injected half-way through a write)")

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


@pytest.mark.parametrize("path", ["finished before a restart", "a pack of one just finished",
                                  "a pack just finished"])
def test_a_publish_that_fails_half_way_leaves_no_record(path, tmp_path, monkeypatch):
    """run_pack publishing a finished run's record, on each of its paths (the run finished
    before the sweep restarted; the process it just launched for it alone finished it; the
    process of a larger pack finished it), its write failing after
    half the bytes (whatever file API publishing uses: builtins.open or os.fdopen): no record
    is under the records folder afterwards, partial or whole, so a resumed sweep or the board
    never reads a half-written record as a finished trial; the next call publishes it whole."""
    import builtins
    job = dict(records=str(tmp_path / "records"), runs_dir=str(tmp_path / "runs"),
               repo=str(config.REPO_ROOT), group=GROUP, epsilon=3.0, delta=1e-5,
               method="dpsgd", trial=1, seed=0, gin_files=[], bindings=[])
    finished = tmp_path / "runs" / GROUP / "dpsgd-t1-seed0"
    finished.mkdir(parents=True)
    whole = json.dumps({"validation_accuracy": 0.7, "pad": "x" * 4000})
    if path == "finished before a restart":
        (finished / "run_record.json").write_text(whole)
    else:  # the launched run (a stand-in for the dpbench command) writes its record and ends
        from tests.test_sweep_jobs import Ended

        def launched(command, **kwargs):
            (finished / "run_record.json").write_text(whole)
            return Ended(0)
        monkeypatch.setattr(subprocess, "Popen", launched)
    publish = sweep.run_pack
    job = [job, dict(job, trial=9)] if path == "a pack just finished" else [job]
    if len(job) == 2:  # the other trial of the pack was published before
        other = tmp_path / "records" / GROUP / "dpsgd-t9-seed0"
        other.mkdir(parents=True)
        (other / "run_record.json").write_text(json.dumps({"validation_accuracy": 0.1}))
    records = tmp_path / "records"
    real_open, real_fdopen = builtins.open, os.fdopen

    def faulty(opener):
        def wrapped(file, mode="r", *args, **kwargs):
            f = opener(file, mode, *args, **kwargs)
            writes = any(c in mode for c in "wax+")
            inside = isinstance(file, int) or str(records) in str(file)
            return _HalfThenFail(f) if writes and inside else f
        return wrapped
    monkeypatch.setattr(builtins, "open", faulty(real_open))
    monkeypatch.setattr(os, "fdopen", faulty(real_fdopen))
    with pytest.raises(OSError, match="injected"):
        publish(job)
    monkeypatch.setattr(builtins, "open", real_open)
    monkeypatch.setattr(os, "fdopen", real_fdopen)
    left = [p for p in records.rglob("*") if p.is_file() and "-t9-" not in str(p)] \
        if records.exists() else []
    assert left == [], left  # neither the record nor a temporary file
    assert publish(job)["validation_accuracy"] == 0.7  # the next call publishes it whole
    assert (records / GROUP / "dpsgd-t1-seed0" / "run_record.json").read_text() == whole


def test_a_failed_trial_says_whether_a_rerun_can_help():
    refused = "RuntimeError: rs-t1-seed0 failed (exit 2); log: /x.log:\nBudgetError: ..."
    crashed = "RuntimeError: rs-t1-seed0 failed (exit -9); log: /x.log:\n"
    assert "a rerun fails the same way" in sweep_checks.retry_advice(refused)
    assert "rerun the same command" in sweep_checks.retry_advice(crashed)


# Loaded first by every Python process that has its folder on PYTHONPATH: logs each seed a
# run draws from the OS (secrets.randbits, dpbench.run's only source) to a file OUTSIDE the
# records and runs folders, so the test can look for it in every file they hold.
SEED_LOGGER = """
import os, secrets
_draw = secrets.randbits
def randbits(k):
    value = _draw(k)
    with open(os.environ["DPBENCH_TEST_SEED_LOG"], "a") as log:
        log.write(f"{value}\\n")
    return value
secrets.randbits = randbits
"""


def _secret_search(root, protocol, seed_log, grouped=False) -> tuple:
    """One secret search of ``protocol`` under ``root`` (runs/, records/), its trials run as
    run_secret's Tune phase runs them, from a JAX-free process: one after another (a process
    each), or ``grouped`` as one pack (one process training them as a group).
    Returns (the private group folder, the published group folder)."""
    root.mkdir()
    (root / "protocol.json").write_text(json.dumps(protocol))
    args = sweep._parser().parse_args(sweep_command(root)[3:] + ["--secret_trial_count"])
    assert sweep.main([*sweep_command(root)[3:], "--secret_trial_count",
                       "--prepare_only"]) == 0  # the plan, drawn in secret; nothing published
    assert not (root / "records").exists()
    private = root / "runs" / "secret"
    plans = [json.loads((private / "records" / GROUP / sweep.SEARCH_FILE).read_text())]
    inside = argparse.Namespace(**{**vars(args), "records": private / "records"})
    hook = root.parent / "seed_logger"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SEED_LOGGER)
    env = dict(os.environ, DPBENCH_TEST_SEED_LOG=str(seed_log),
               PYTHONPATH=os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    jobs = sweep._jobs(plans, "search", inside)
    for work in ([("run_pack", jobs)] if grouped else [("run_pack", [job]) for job in jobs]):
        done = run_guarded([sys.executable, "-c", "import json, sys; from dpbench import sweep; "
                            f"sweep.{work[0]}(json.loads(sys.argv[1]))", json.dumps(work[1])],
                           cwd=config.REPO_ROOT, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    sweep_secret.publish_selected(plans, private / "records", root / "records")
    return private / "records" / GROUP, root / "records" / GROUP


def _holds(path, seed: int) -> bool:
    """Whether a file holds ``seed`` (63 bits, from the OS) or a key derived from it: as a
    decimal number, its 8 bytes, or one of the four derived 32-bit seeds as a decimal number
    standing alone or a PRNG key's data [0, seed]. Chance matches: a given 19-digit number or
    8-byte pattern in these few MB, < 1e-9."""
    import re
    import struct
    data = path.read_bytes()
    derived = np.random.SeedSequence(seed).generate_state(4)
    size = max(8, (seed.bit_length() + 7) // 8)
    if str(seed).encode() in data or seed.to_bytes(size, "little") in data or \
            seed.to_bytes(size, "big") in data:
        return True
    for d in map(int, derived):  # run.build_run's keys, sampler and host seeds
        if struct.pack("<II", 0, d) in data or re.search(
                rb"(?<![\d.])" + str(d).encode() + rb"(?![\d.])", data):
            return True
    return False


def test_a_secret_search_trains_on_secret_noise_and_publishes_only_each_winner(tmp_path):
    """--secret_trial_count, run twice on digits (K 2; a: a process per trial, b: both
    trials trained as one group): J and the trials stay under
    --runs_dir/secret; the records get one run per method (the winner's, under a name without
    its trial index) and release.json, whose epsilon is dp_accounting's RepeatAndSelectDpEvent
    after trial 0 for the deployment's law. Every trial draws its seed from the OS: the two
    searches' trial 0 (the same recipe) train on different noise, and no file under either
    search's records or runs holds a seed that was drawn (a fixed seed, the old
    train.seed = 0, gives byte-identical trial-0 models and fails). A rerun reuses the secret
    plan (drawing J again would void the bound)."""
    from dpbench import checkpoint
    from dpbench import run as run_lib
    protocol = json.loads(json.dumps(PROTOCOL))
    family = protocol["families"]["digits__logistic"]
    family["methods"] = {"dpsgd": family["methods"]["dpsgd"]}
    protocol["trials"] = {"fixed": 5, "seed": 7,  # the public board's K, not the secret one
                          "deployment": {"shape": 1, "mean_random": 1}}  # J = 1 surely
    seed_log = tmp_path / "seeds.log"
    searches = [_secret_search(tmp_path / name, protocol, seed_log, grouped=name == "b")
                for name in ("a", "b")]
    private, published_group = searches[0]
    published = sorted(str(p.relative_to(tmp_path / "a" / "records"))
                       for p in (tmp_path / "a" / "records").rglob("*") if p.is_file())
    assert published == [f"{GROUP}/dpsgd-selected/release.json",
                         f"{GROUP}/dpsgd-selected/run_record.json"]
    # the published run IS the winner on validation (byte for byte), not another trial
    trials = {t: json.loads((private / f"dpsgd-t{t}-seedsecret" / "run_record.json"
                             ).read_text()) for t in (0, 1)}
    winner = max(trials, key=lambda t: (trials[t]["validation_accuracy"], -t))
    assert tuning.search_summary(private)["dpsgd"]["winner"] == winner
    released = published_group / "dpsgd-selected" / "run_record.json"
    assert released.read_bytes() == (private / f"dpsgd-t{winner}-seedsecret" /
                                     "run_record.json").read_bytes()
    # secret noise: each search's trial 0 (the same bindings) trained on its own randomness
    first = [json.loads((p / "dpsgd-t0-seedsecret" / "run_record.json").read_text())
             for p, _ in searches]
    assert first[0]["final_params_sha256"] != first[1]["final_params_sha256"]
    seeds = [int(line) for line in seed_log.read_text().split()]
    assert len(seeds) >= 4 and len(set(seeds)) == len(seeds)  # >= 1 draw per trial, all fresh
    for root in (tmp_path / "a", tmp_path / "b"):
        for path in [*(root / "records").rglob("*"), *(root / "runs").rglob("*")]:
            if path.is_file():
                assert not any(_holds(path, seed) for seed in seeds), path
        # orbax compresses a checkpoint's arrays, so the bytes above cannot show its key:
        # read it back (a release run saves a zero key; test_checkpoint has the seeded twin)
        checkpoints = list((root / "runs").rglob(run_lib.CHECKPOINTS))
        assert len(checkpoints) == 2
        for directory in checkpoints:
            saved = checkpoint.load_saved(directory)
            assert not saved["ledger"]["key_saved"] and np.all(saved["state"]["key"] == 0)
    record = json.loads(released.read_text())
    release = json.loads((published_group / "dpsgd-selected" / sweep_secret.RELEASE
                          ).read_text())
    assert record["seed"] is None and record["privacy_statement"]["seed_secret"] is True
    assert "written to no file" in record["privacy_statement"]["statement"]
    assert release["seed"].startswith("secret") and "no file holds it" in release["statement"]
    plan_path = private / sweep.SEARCH_FILE
    grouped = json.loads((tmp_path / "b" / "runs" / "secret" / "records" / GROUP /
                          "dpsgd-t0-seedsecret" / "run_record.json").read_text())
    assert grouped["group"]["size"] == 2 and grouped["seed"] is None  # b's trials: one group
    plan = json.loads(plan_path.read_text())
    assert plan["num_trials"] == 2 and plan["trials_law"] == {"shape": 1, "mean_random": 1}
    assert plan["seeds"] == [None]
    view, _ = accounting._rdp_view(accounting.event_from_json(record["dp_event"]))
    rdp = rdp_privacy_accountant.RdpAccountant()
    rdp.compose(dp_event.ComposedDpEvent([view, dp_event.RepeatAndSelectDpEvent(view, 1, 1)]))
    assert release["epsilon"] == pytest.approx(rdp.get_epsilon(1e-5), rel=1e-3)
    assert "num_trials" not in release and "kept secret" in release["statement"]
    loaded = load_protocol(tmp_path / "a" / "protocol.json")
    again = sweep_plan.prepare_secret(loaded, "digits__logistic", 3.0, ["dpsgd"],
                                      private.parent)
    assert again == plan and json.loads(plan_path.read_text()) == plan  # not drawn again
    with pytest.raises(ProtocolError, match="exactly those --methods"):
        sweep_plan.prepare_secret(loaded, "digits__logistic", 3.0, ["dpsgd", "rs"],
                                  private.parent)
    assert sweep_secret.into_board_reason(config.REPO_ROOT / "leaderboard" / "records")
    assert sweep_secret.into_board_reason(tmp_path / "records") is None


def test_a_secret_searchs_trial_count_follows_the_deployment_law_over_searches():
    """J of repeated secret searches (sweep_plan.secret_num_random, what plan_group draws)
    follows the deployment's law: the chi-square of test_tuning passes at its 1e-5 level
    (false failures <= 1.6e-5, simulated there), and a J drawn from a fixed seed (one value
    over and over) is rejected by the same check."""
    from tests.test_tuning import trial_count_p_value
    trials = {"fixed": 5, "seed": 7, "deployment": {"shape": 1, "mean_random": 5}}
    draws = np.array([sweep_plan.secret_num_random(trials)[1] for _ in range(4000)])
    assert trial_count_p_value(draws, 5.0, 1.0) > 1e-5
    fixed = np.array([tuning.sample_trial_count(np.random.default_rng(7), 5.0, 1.0)
                      for _ in range(4000)])
    assert trial_count_p_value(fixed, 5.0, 1.0) < 1e-6
    # and the trials: two secret draws of the same space differ (i.i.d. from OS entropy)
    protocol = at_epsilon(json.loads(json.dumps(PROTOCOL)), 3.0)
    a, b = (trial_bindings(protocol, "digits__logistic", GROUP, "dpsgd", 3,
                                  rng=sweep_plan.secret_generator()) for _ in range(2))
    assert a[0] == b[0] and a[1:] != b[1:]  # trial 0 is the recipe; the rest are drawn


def _paired_board_records(finished_sweep, tmp_path, deployment=True):
    """The tiny sweep's records with two more retrain seeds of each winner (copies of seed 1
    with their seed, trajectory hash and test accuracy changed): a finished paired group with
    3 retrains."""
    records, group = copied_records(finished_sweep, tmp_path)
    plan = json.loads((group / sweep.SEARCH_FILE).read_text())
    plan["seeds"] = [0, 1, 2, 3]
    if deployment:
        plan["trials_law"] = {"fixed": 2, "seed": 7,
                              "deployment": {"shape": "inf", "mean_random": 1}}
    (group / sweep.SEARCH_FILE).write_text(json.dumps(plan))
    rng = np.random.default_rng()
    for method, s in tuning.search_summary(group).items():
        seed1 = group / f"{method}-t{s['winner']}-seed1" / "run_record.json"
        for seed in (2, 3):
            record = json.loads(seed1.read_text())
            record["seed"] = seed  # and a trajectory of its own (a copy is not a run)
            record["final_params_sha256"] = hashlib.sha256(
                f"{seed} {record['final_params_sha256']}".encode()).hexdigest()
            record["test_accuracy"] = float(np.clip(record["test_accuracy"]
                                                    + rng.normal(0, 0.01), 0, 1))
            target = group / f"{method}-t{s['winner']}-seed{seed}" / "run_record.json"
            target.parent.mkdir()
            target.write_text(json.dumps(record))
    return records, group


def _v3_row(text: str, method: str, header: str = "| method | paper |") -> dict:
    """The cells of ``method``'s row in the board's first table whose header starts with
    ``header`` (a v3 verdict table by default), by column name."""
    table = text[text.index(header):].split("\n\n")[0].splitlines()
    columns = [c.strip() for c in table[0].strip().strip("|").split("|")]
    (row,) = [line for line in table[2:] if line.startswith(f"| {method} |")]
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    assert len(cells) == len(columns)
    return dict(zip(columns, cells))


DEPLOYMENT = "| method, ε of a K-secret deployment |"  # the v3 page's privacy table


def test_a_paired_group_gets_v3_verdicts_intervals_both_epsilons_and_a_forest_plot(
        finished_sweep, tmp_path, monkeypatch):
    from dpbench import board
    from dpbench.board import paired
    records, group = _paired_board_records(finished_sweep, tmp_path)
    plan = json.loads((group / sweep.SEARCH_FILE).read_text())
    assert paired.is_paired(plan)  # trial 1 of dpsgd and halfclip binds the same shared draws
    unpaired = json.loads(json.dumps(plan))
    lr = "optimize.optax.learning_rate"
    unpaired["methods"][OTHER]["trials"][1] = [
        f"{lr} = 9.99" if b.startswith(lr) else b for b in plan["methods"][OTHER]["trials"][1]]
    assert not paired.is_paired(unpaired)
    calls, rule = [], paired.apply_rule

    def once(analyses, *args, **kwargs):
        calls.append(len(analyses))
        return rule(analyses, *args, **kwargs)
    monkeypatch.setattr(paired, "apply_rule", once)
    table = board.build(records, tmp_path / "a")
    monkeypatch.undo()
    assert calls == [1]  # every group of the board labelled together, once
    assert [r["seeds"] for r in table[GROUP]] == [3, 3]  # the selected seed 0 left out
    text = (tmp_path / "a" / "README.md").read_text()
    assert text.index("## The answer") < text.index("| method | paper |")  # before the tables
    assert (tmp_path / "a" / "plots" / f"{GROUP}__forest.svg").exists()
    analysis = paired.analyse_group(group, {})
    seed0 = {p.parent.name: json.loads(p.read_text())["test_accuracy"]
             for p in group.glob("*-seed0/run_record.json")}
    randoms = [v for name, v in seed0.items() if "-t0-" not in name]
    assert analysis["junk"] == (sum(v < max(seed0.values()) - 0.05 for v in randoms),
                                len(randoms))
    assert "Junk: {} of {} random trials".format(*analysis["junk"]) in (
        tmp_path / "a" / "README.md").read_text()
    labelled = paired.apply_rule([analysis])
    other = analysis["methods"][OTHER]
    tuned = other["tuned"]
    assert tuned["low"] <= tuned["point"] <= tuned["high"]
    assert other["verdict"] in ("better", "worse", "equivalent", "inconclusive") or other[
        "verdict"].startswith("undecided")  # the registered rule's labels (paired.apply_rule)
    low, high = tuned["p_adjusted"]  # the Holm-adjusted bounds of the hypothesis that decided
    assert labelled["comparisons"] == 3 and 0 <= low <= high <= 1
    assert tuned["level"] == labelled["level"] == 0.05 / 3  # one simultaneous level
    assert len(other["retrains"]) == 3  # seeds 1-3, not 0
    # everything published for halfclip (its 2 trials and 3 retrains), composed by dp_accounting's
    # PLD accountant without the board's folding of identical events
    events = [json.loads(p.read_text())["dp_event"]
              for p in group.glob(f"{OTHER}-*/run_record.json")]
    assert len(events) == 5
    pld = accounting.make_accountant(accounting.Budget(epsilon=1.0, delta=1e-5,
                                                       accountant="pld"))
    pld.compose(dp_event.ComposedDpEvent([accounting.event_from_json(e) for e in events]))
    assert other["published_epsilon"] == pytest.approx(pld.get_epsilon(1e-5), rel=2e-2)
    assert other["published_epsilon"] > other["deployment_epsilon"]  # 5 runs vs mean K 2, secret
    row = _v3_row(text, OTHER)  # one privacy number per row: what the row's runs cost
    assert row["ε, this row's runs"] == f"{other['published_epsilon']:.3f}"
    assert not any("K secret" in column for column in row)  # the deployment's: under Privacy
    (deployment,) = [v for k, v in _v3_row(text, OTHER, DEPLOYMENT).items() if k != "method, ε of a K-secret deployment"]
    assert deployment == f"{other['deployment_epsilon']:.3f}"
    assert "Baseline check" in text and "**weaker**" not in text
    board.build(records, tmp_path / "b")
    assert (tmp_path / "b" / "README.md").read_text() == text


def test_a_deployment_without_an_rdp_bound_is_shown_with_its_reason(finished_sweep, tmp_path):
    """A deployment law whose expected truncated-batch overflows use up delta (mean K 10^4
    here; board v3's Nasr at K 8, whose padded batch of 256 overflows more often): its 'K
    secret' cell says none and the group's text says why; 'all published' is unaffected."""
    from dpbench import board
    records, group = _paired_board_records(finished_sweep, tmp_path)
    plan = json.loads((group / sweep.SEARCH_FILE).read_text())
    plan["trials_law"]["deployment"]["mean_random"] = 1e4
    (group / sweep.SEARCH_FILE).write_text(json.dumps(plan))
    board.build(records, tmp_path / "a")
    text = (tmp_path / "a" / "README.md").read_text()
    assert list(_v3_row(text, OTHER, DEPLOYMENT).values())[1].startswith(
        "none: truncated-batch overflow")
    assert float(_v3_row(text, OTHER)["ε, this row's runs"]) > 0
    assert f"{OTHER} has no 'ε, K secret': truncated-batch overflow uses up delta" in text


def test_a_superseded_search_joins_its_methods_published_epsilon(finished_sweep, tmp_path):
    """A group whose space was revised after a first search: the board folder's board.json
    names the superseded searches; each method's 'ε, all published' composes its distinct runs
    there with its group's (checked with dp_accounting's PLD accountant directly), a method
    without any there keeps its epsilon, and the group's text says so. A run published twice
    (a superseded run that the new search repeated byte for byte: the same
    final_params_sha256) is one release and composes once: copies do not move the epsilon."""
    from dpbench import board
    from dpbench.board import arms, paired
    records, group = _paired_board_records(finished_sweep, tmp_path)
    before = paired.analyse_group(group, {})["methods"]
    earlier = tmp_path / "superseded" / GROUP
    for run in sorted(group.glob("dpsgd-*-seed*"))[:3]:  # 3 earlier runs of dpsgd: copies
        shutil.copytree(run, earlier / run.name)
    copied = paired.analyse_group(group, {}, superseded_dir=earlier)["methods"]
    assert copied["dpsgd"]["published_epsilon"] == before["dpsgd"]["published_epsilon"]
    assert copied["dpsgd"]["superseded_runs"] == 3 and copied["dpsgd"]["duplicate_runs"] == 3
    for path in earlier.glob("*/run_record.json"):  # now 3 runs of their own trajectories
        record = json.loads(path.read_text())
        path.write_text(json.dumps(dict(record, final_params_sha256=hashlib.sha256(
            f"earlier {record['final_params_sha256']}".encode()).hexdigest())))
    (tmp_path / board.INPUTS_FILE).write_text(json.dumps({"superseded": "superseded"}))
    assert board.main([f"--records={records}"]) == 0
    text = (tmp_path / "README.md").read_text()
    assert f"a first search (3 runs, published in `superseded/{GROUP}`, never ranked)" in text
    after = paired.analyse_group(group, {}, superseded_dir=earlier)["methods"]
    assert after[OTHER]["published_epsilon"] == before[OTHER]["published_epsilon"]
    assert after["dpsgd"]["superseded_runs"] == 3 and after[OTHER]["superseded_runs"] == 0
    assert after["dpsgd"]["duplicate_runs"] == 0
    events = [json.loads(p.read_text())["dp_event"]
              for p in [*group.glob("dpsgd-*/run_record.json"),
                        *earlier.glob("*/run_record.json")]]
    assert len(events) == 5 + 3
    pld = accounting.make_accountant(accounting.Budget(epsilon=1.0, delta=1e-5,
                                                       accountant="pld"))
    pld.compose(dp_event.ComposedDpEvent([accounting.event_from_json(e) for e in events]))
    assert after["dpsgd"]["published_epsilon"] == pytest.approx(pld.get_epsilon(1e-5),
                                                                rel=2e-2)
    assert after["dpsgd"]["published_epsilon"] > before["dpsgd"]["published_epsilon"] * 1.1
    assert _v3_row(text, OTHER)["ε, this row's runs"] == (
        f"{after[OTHER]['published_epsilon']:.3f}")
    # a run listed twice composes once, wherever it was published
    runs = list(arms.read_arm(group, json.loads((group / sweep.SEARCH_FILE).read_text()),
                              "dpsgd").runs)
    assert arms.published_epsilon(runs + [runs[0]], 1e-5) == arms.published_epsilon(
        runs, 1e-5)


def test_a_diverged_trial_counts_in_everything_published_at_its_planned_event(
        finished_sweep, tmp_path):
    """A random trial that diverged ran the accounted mechanism on private data, and the board
    publishes that it diverged: 'ε, all published' composes the event search.json planned for
    its privacy settings (its run published no record to read one from)."""
    from dpbench.board import arms, paired
    records, group = _paired_board_records(finished_sweep, tmp_path)
    plan = json.loads((group / sweep.SEARCH_FILE).read_text())
    for run in group.glob(f"{OTHER}-*-seed*"):  # OTHER's recipe wins: seeds 1-3 its retrains
        if run.name != f"{OTHER}-t0-seed0" and not run.name.startswith(f"{OTHER}-t1-seed0"):
            shutil.rmtree(run)
    recipe = json.loads((group / f"{OTHER}-t0-seed0" / "run_record.json").read_text())
    for seed in (1, 2, 3):
        (group / f"{OTHER}-t0-seed{seed}").mkdir()
        (group / f"{OTHER}-t0-seed{seed}" / "run_record.json").write_text(json.dumps(
            dict(recipe, seed=seed, final_params_sha256=f"{seed}" * 64)))  # distinct runs
    shutil.rmtree(group / f"{OTHER}-t1-seed0")
    (group / f"{OTHER}-t1-seed0").mkdir()
    (group / f"{OTHER}-t1-seed0" / tuning.DIVERGED).write_text("{}")
    other = paired.analyse_group(group, {})["methods"][OTHER]
    assert other["winner"] == 0
    key = privacy_key(plan["methods"][OTHER]["trials"][1], tuning._protocol_of(plan),
                             plan["family"], OTHER)
    (planned,) = [s["event"] for s in plan["methods"][OTHER]["support"]
                  if privacy_key(s["bindings"], tuning._protocol_of(plan),
                                        plan["family"], OTHER) == key]
    events = [recipe["dp_event"]] * 4 + [planned]
    pld = accounting.make_accountant(accounting.Budget(epsilon=1.0, delta=1e-5,
                                                       accountant="pld"))
    pld.compose(dp_event.ComposedDpEvent([accounting.event_from_json(e) for e in events]))
    assert other["published_epsilon"] == pytest.approx(pld.get_epsilon(1e-5), rel=2e-2)
    without = arms.published_epsilon([(str(s), recipe["dp_event"]) for s in range(4)], 1e-5)
    assert other["published_epsilon"] > without * 1.05  # the diverged run is not free


def test_the_baseline_check_fires_on_a_recorded_stronger_dp_sgd(finished_sweep, tmp_path):
    """A made-up earlier board whose DP-SGD scored far higher on 2 seeds: the group's
    verdicts say their baseline is weaker than what DP-SGD is known to reach."""
    from dpbench import board
    records, group = _paired_board_records(finished_sweep, tmp_path, deployment=False)
    history = tmp_path / "history"
    base = next(group.glob("dpsgd-t0-seed0")) / "run_record.json"
    for seed, acc in ((1, 0.995), (2, 0.996)):  # seeds 1 and up: seed 0 is never compared
        record = json.loads(base.read_text())
        record.update(seed=seed, test_accuracy=acc, ema_decay=0.5)  # another configuration
        target = history / GROUP / f"old-seed{seed}" / "run_record.json"
        target.parent.mkdir(parents=True)
        target.write_text(json.dumps(record))
    board.build(records, tmp_path / "a", history=[history])
    text = (tmp_path / "a" / "README.md").read_text()
    assert "**weaker**" in text and "99.55" in text
    # no deployment law: no secret-K epsilon, while the published one is a number
    assert list(_v3_row(text, OTHER, DEPLOYMENT).values())[1] == "n/a"
    assert float(_v3_row(text, OTHER)["ε, this row's runs"]) > 0


def test_a_sweep_mode_is_a_subcommand_that_stands_for_its_flag():
    """`dpbench sweep prepare|secret|progress|cost|run` parse as the flags they name (which
    still work), and an unknown mode is refused by argparse (exit 2)."""
    common = ["--protocol=p.json", "--records=r"]
    for mode, flag in (("prepare", "prepare_only"), ("secret", "secret_trial_count"),
                       ("progress", "progress"), ("cost", "cost")):
        by_mode = sweep.parse_args([mode, *common])
        assert getattr(by_mode, flag) is True
        assert vars(by_mode) == vars(sweep.parse_args([f"--{flag}", *common]))
    assert vars(sweep.parse_args(["run", *common])) == vars(sweep.parse_args(common))
    with pytest.raises(SystemExit) as refused:
        sweep.parse_args(["sweeep", *common])
    assert refused.value.code == 2

