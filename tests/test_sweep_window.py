"""dpbench/sweep/window.py: a lent device's window on board v4. Its device rule, read off the
registered analysis (right device kinds and JAX pass, others fail); a window's runs landing in
pending, whole cells only moving on to the records, one device kind per group; a window training
only what this device may train, from the board's records and pending runs, and refusing an
analysis that is not the proved one."""

import functools
import json
import os
import shutil
import subprocess
import tarfile

import numpy as np
import pytest

from dpbench.board.build import incomplete_text
from dpbench import sweep
from dpbench.search import tuning
from dpbench.sweep import preflight, window
from dpbench.sweep.planning import prepare
from tests.conftest import REPO_ROOT

V4 = REPO_ROOT / "leaderboard" / "v4"
TANH3 = "fashion_mnist__tanh_cnn__eps3.0__delta1e-05"
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
GIT_ENV = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.com")


def _commit(root, message):
    for args in (["add", "-A"], ["commit", "-qm", message]):
        subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                       env=GIT_ENV)


@pytest.fixture
def board(tmp_path):
    """A git repository holding board v4's registered analysis, its protocols and its search
    plans, committed in that order (as the repository's own)."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    board = tmp_path / "leaderboard" / "v4"
    board.mkdir(parents=True)
    for name in ("analysis.json", "protocol.json", "ladder.json"):
        shutil.copy(V4 / name, board / name)
    _commit(tmp_path, "register")
    for plan in V4.glob("records/*/search.json"):
        (board / "records" / plan.parent.name).mkdir(parents=True)
        shutil.copy(plan, board / "records" / plan.parent.name / plan.name)
    _commit(tmp_path, "plans")
    return board


@functools.lru_cache(maxsize=None)
def _plan(group):
    return json.loads((V4 / "records" / group / "search.json").read_text())


def _event(group, method, trial):
    """The DpEvent search.json planned for the trial (trial 0's recipe: its own, else any)."""
    plan = _plan(group)
    try:
        return tuning.planned_event(plan, method, trial)
    except (KeyError, IndexError):  # a recipe outside the space's support: the board checks no event of it
        return plan["methods"][method]["support"][0]["event"]


def _run(folder, name, accuracy, kind=H100, jax_version="0.11.2"):
    """A published run as a window brings it: its record with the seed and DpEvent its group's
    search.json plans, and its device."""
    method, trial, seed = tuning.parse_run_dir(name)
    path = folder / name / "run_record.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(dict(validation_accuracy=accuracy, device_kind=kind, seed=seed,
                                    dp_event=_event(folder.name, method, trial),
                                    versions={"jax": jax_version})))


def _window_files(tmp_path, runs, name="files"):
    """A window's returned folder: records.tar.gz of ``runs`` ((group, run, accuracy, kind)),
    and window.json."""
    staged, files = tmp_path / f"{name}-staged", tmp_path / name
    files.mkdir()
    for group, run, accuracy, kind in runs:
        _run(staged / group, run, accuracy, kind)
    with tarfile.open(files / window.RECORDS_TARBALL, "w:gz") as tar:
        for group, run, _, _ in runs:
            tar.add(staged / group / run, arcname=f"{group}/{run}")
    (files / window.WINDOW).write_text(json.dumps(dict(device=H100, jax="0.11.2",
                                                       commit="c" * 40, device_s=300.0)))
    return files


def _search(method, accuracies, kind=H100):
    return [(TANH3, f"{method}-t{t}-seed0", a, kind) for t, a in enumerate(accuracies)]


def _seeds(method, trial, kind=H100):
    return [(TANH3, f"{method}-t{trial}-seed{s}", 0.8, kind) for s in (1, 2, 3)]


def test_the_device_rule_lets_the_registered_kinds_and_jax_in_and_nothing_else():
    rule = window.device_rule(json.loads((V4 / "analysis.json").read_text()))
    assert rule == dict(jax="0.11.2", kinds=["h100", "h200"])
    for device in ((H100, "0.11.2"), (H200, "0.11.2"), ("NVIDIA H100 PCIe", "0.11.2")):
        assert window.refusal(device, rule) is None
    for device, why in (((H100, "0.10.2"), "JAX 0.10.2 is not the registered 0.11.2"),
                        (("cpu", "0.11.2"), "'cpu' is not one the registration lends"),
                        (("NVIDIA A100-SXM4-80GB", "0.11.2"), "not one the registration")):
        assert why in window.refusal(device, rule)
    with pytest.raises(window.WindowError, match="registers no device rule"):
        window.device_rule({"design": {}})


def test_a_windows_runs_wait_in_pending_until_their_cell_is_whole(board, tmp_path):
    rng = np.random.default_rng()
    k = 33
    accuracy = rng.uniform(0.5, 0.9, size=k)
    winner = int(np.argmax(accuracy))
    first = _window_files(tmp_path, [
        *_search("dpsgd", accuracy), *_seeds("dpsgd", winner),  # a whole cell
        *_search("rs", accuracy[:20]),  # a cell cut off by the window's end
        (TANH3, "gep-t0-seed0", 0.7, "cpu")])  # a CPU run never joins
    done = window.land(board, first, device_s=420.0)
    records, pending = board / "records" / TANH3, board / "pending" / TANH3
    assert done["landed"] == [f"{TANH3} dpsgd"]
    assert len(list(records.glob("dpsgd-*"))) == k + 3 and not list(pending.glob("dpsgd-*"))
    assert len(list(pending.glob("rs-*"))) == 20 and not list(records.glob("rs-*"))
    assert len(done["refused"]) == 1 and "'cpu' is not one" in done["refused"][0]
    assert not (pending / "gep-t0-seed0").exists() and not (records / "gep-t0-seed0").exists()
    kept = board / window.REFUSED / TANH3 / "gep-t0-seed0"  # nothing lost: kept with its reason
    assert "'cpu' is not one" in (kept / "refused.txt").read_text()
    assert (kept / "run_record.json").exists()
    assert window.pending_cells(board) == [(TANH3, "rs", 20, k + 3)]
    entry = json.loads((board / window.WINDOWS).read_text())[-1]
    assert entry["runs"] == k + 3 + 20 and entry["device_s"] == 420.0
    assert entry["runs_per_device_minute"] == pytest.approx(60 * (k + 23) / 420, abs=0.01)
    assert entry["cells_landed"] == [f"{TANH3} dpsgd"] and entry["device"] == H100
    # `dpbench board` on the unfinished board: where it stands, the cost, the windows left
    text = incomplete_text(board / "records")
    left = 1568 - (k + 3) - 20
    assert f"({k + 3} of 1568; 20 more wait in pending/" in text
    assert (f"1 lent-GPU window(s) ({H100}): 7.0 device minutes, {k + 23} runs, "
            f"{60 * (k + 23) / 420:.2f} per device minute. At {k + 23} runs a window, the "
            f"{left} runs left need about {-(-left // (k + 23))} more.") in text
    _commit(tmp_path, "window 1")

    # the next window finishes rs (its seeds from the winner over all 33 trials) and resends
    # one run it already brought (the first copy stays)
    rs_winner = int(np.argmax(accuracy))
    second = _window_files(tmp_path, [*_search("rs", accuracy)[20:], *_seeds("rs", rs_winner),
                                      (TANH3, "dpsgd-t0-seed0", 0.1, H100)], name="second")
    done = window.land(board, second)
    assert done["landed"] == [f"{TANH3} rs"] and done["skipped"] == [f"{TANH3}/dpsgd-t0-seed0"]
    assert len(list(records.glob("rs-*"))) == k + 3 and not (board / "pending").exists()
    assert json.loads((records / "dpsgd-t0-seed0" / "run_record.json").read_text())[
        "validation_accuracy"] == accuracy[0]
    assert len(json.loads((board / window.WINDOWS).read_text())) == 2


def test_a_cell_from_another_device_kind_than_its_groups_waits_and_a_wrong_winner_is_not_whole(
        board, tmp_path):
    accuracy = np.random.default_rng().uniform(0.5, 0.9, size=33)
    winner = int(np.argmax(accuracy))
    window.land(board, _window_files(tmp_path, [*_search("dpsgd", accuracy),
                                                *_seeds("dpsgd", winner)]))
    _commit(tmp_path, "window 1")
    loser = (winner + 1) % 33  # retrains of a trial that did not win make no whole cell
    done = window.land(board, _window_files(tmp_path, [
        *_search("rs", accuracy, kind=H200), *_seeds("rs", winner, kind=H200),
        *_search("gep", accuracy), *_seeds("gep", loser)], name="second"))
    assert done["landed"] == []
    assert {(g, m) for g, m, _, _ in window.pending_cells(board)} == {(TANH3, "rs"),
                                                                       (TANH3, "gep")}


def test_a_run_that_is_not_the_one_its_search_plans_is_refused_at_once(board, tmp_path):
    """A record whose DpEvent is not the one search.json planned for its trial (a privacy knob
    the protocol does not declare), whose seed is not its name's, or a trial the plan does not
    have: refused at the window that brought it, not found by the board after the last."""
    files = _window_files(tmp_path, [(TANH3, "dpsgd-t1-seed0", 0.8, H100),
                                     (TANH3, "dpsgd-t2-seed0", 0.8, H100),
                                     (TANH3, "dpsgd-t3-seed0", 0.8, H100),
                                     (TANH3, "dpsgd-t40-seed0", 0.8, H100)])
    staged = tmp_path / "files-staged" / TANH3
    record = json.loads((staged / "dpsgd-t1-seed0" / "run_record.json").read_text())
    assert _shifted(record["dp_event"]) != record["dp_event"]
    for name, change in (("dpsgd-t1-seed0", dict(dp_event=_shifted(record["dp_event"]))),
                         ("dpsgd-t2-seed0", dict(seed=7))):
        path = staged / name / "run_record.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with tarfile.open(files / window.RECORDS_TARBALL, "w:gz") as tar:
        for run in sorted(staged.iterdir()):
            tar.add(run, arcname=f"{TANH3}/{run.name}")
    done = window.land(board, files)
    refused = dict(r.split(": ", 1) for r in done["refused"])
    assert "its DpEvent is not the one search.json computed" in refused[f"{TANH3}/dpsgd-t1-seed0"]
    assert "seed 7 is not" in refused[f"{TANH3}/dpsgd-t2-seed0"]
    assert "not a run of this group's search.json" in refused[f"{TANH3}/dpsgd-t40-seed0"]
    assert done["pending"] == [f"{TANH3}/dpsgd-t3-seed0"]


def _shifted(event):
    """The event with every noise multiplier raised by a half: another mechanism."""
    if isinstance(event, dict):
        return {k: (v + 0.5 if k == "noise_multiplier" else _shifted(v)) for k, v in event.items()}
    if isinstance(event, list):
        return [_shifted(e) for e in event]
    return event


def test_landing_refuses_a_board_whose_analysis_changed_and_a_folder_without_a_window(
        board, tmp_path):
    with pytest.raises(window.WindowError, match="lacks records.tar.gz or window.json"):
        window.land(board, tmp_path)
    (board / "analysis.json").write_text((board / "analysis.json").read_text() + " ")
    with pytest.raises(window.registration.RegistrationError, match="differs from its regis"):
        window.land(board, _window_files(tmp_path, _search("dpsgd", [0.5])))


def test_a_window_trains_what_this_device_may_from_records_and_pending_and_brings_back_the_new(
        board, tmp_path):
    """run_window with the sweep's local runner replaced by one that publishes one run of each
    plan's first method: the registered board's plans (the protocol and the ladder) are the
    committed search.json files, the group an H200 started is skipped, pending runs count as
    done, and only the new runs travel back."""
    window.land(board, _window_files(tmp_path, [
        ("fashion_mnist__tanh_cnn__eps1.0__delta1e-05", "dpsgd-t0-seed0", 0.8, H200),
        (TANH3, "dpsgd-t0-seed0", 0.8, H100)]))
    _commit(tmp_path, "window 1")
    proof = window.registration_proof(board)
    trained = []

    def fake_run_local(plans, args):
        assert args.cpu_workers == 0 and args.device_only
        for plan in plans:
            (method, *_), group = plan["methods"], plan["group"]
            assert (args.records / group / f"{method}-t0-seed0").exists() == (group == TANH3)
            _run(args.records / group, f"{method}-t1-seed0", 0.8)
            trained.append(group)
        return 0

    said = window.run_window(board, proof, (H100, "0.11.2"), prepare, fake_run_local, 600.0,
                             tmp_path / "out", tmp_path / "runs")
    assert said["ran"] == ["protocol.json", "ladder.json"] and said["refused"] is None
    assert "fashion_mnist__tanh_cnn__eps1.0__delta1e-05" not in trained and len(trained) == 5
    assert any("eps1.0" in s and H200 in s for s in said["skipped"])
    with tarfile.open(tmp_path / "out" / window.RECORDS_TARBALL) as tar:
        runs = {"/".join(n.split("/")[:2]) for n in tar.getnames() if "/" in n}
    assert runs == {f"{g}/dpsgd-t1-seed0" for g in trained}
    assert json.loads((tmp_path / "out" / window.WINDOW).read_text())["runs"] == 5

    said = window.run_window(board, proof, ("cpu", "0.11.2"), prepare, fake_run_local, 600.0,
                             tmp_path / "cpu", tmp_path / "runs2")
    assert said["ran"] == [] and "'cpu' is not one" in said["refused"]
    (board / "analysis.json").write_text((board / "analysis.json").read_text() + " ")
    with pytest.raises(window.WindowError, match="not the registered analysis"):
        window.run_window(board, proof, (H100, "0.11.2"), prepare, fake_run_local, 600.0,
                          tmp_path / "x", tmp_path / "runs3")


def test_board_v4_trains_only_through_windows_and_a_frozen_board_not_at_all(board, capsys):
    """The sweep's own paths refuse a board whose analysis registers a device rule (its runs
    would skip pending and the device check) but still write its plans; the committed board
    v3 (the sweep's default --records) is frozen, so the default sweep trains nothing."""
    flags = [f"--protocol={board / 'protocol.json'}", f"--records={board / 'records'}"]
    assert sweep.main(["local", "--deadline_s=60", *flags]) == 2
    assert "its runs come only from lent-GPU windows" in capsys.readouterr().err
    assert sweep.main(["prepare", *flags]) == 0
    assert sweep.main([]) == 2
    assert "is frozen (an archive" in capsys.readouterr().err
    assert preflight.frozen_board_reason(board / "records") is None
    assert preflight.frozen_board_reason(REPO_ROOT / "leaderboard" / "records") is not None
