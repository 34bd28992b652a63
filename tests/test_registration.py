"""A board's analysis registered before its first trial (dpbench/board/registration.py): git
history must show the analysis committed, unchanged since, and older than every record; the
sweep refuses to train into a board whose analysis is not registered."""

import json
import os
import subprocess
import sys

import pytest

from dpbench.search import registration
from tests.conftest import REPO_ROOT

GIT_ENV = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.com")


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                   env=GIT_ENV)


def _commit(root, message):
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", message)


def _record(board, name, accuracy=0.8):
    path = board / "records" / "g" / name / "run_record.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"test_accuracy": accuracy}))


@pytest.fixture
def board(tmp_path):
    """A git repository whose board v4 folder holds the repository's registered analysis."""
    _git(tmp_path, "init", "-q")
    board = tmp_path / "leaderboard" / "v4"
    board.mkdir(parents=True)
    (board / "analysis.json").write_text(
        (REPO_ROOT / "leaderboard" / "v4" / "analysis.json").read_text())
    return board


def test_the_repositorys_own_analysis_is_registered_before_any_v4_record():
    """leaderboard/v4/analysis.json is committed, unchanged and older than every v4 record
    (acceptance: the registration commit precedes every v4 record)."""
    found = registration.registration(REPO_ROOT / "leaderboard" / "v4")
    assert len(found["commit"]) == 40 and found["analysis"]["board"] == "v4"


def test_an_analysis_is_registered_only_committed_unchanged_and_before_the_records(board):
    with pytest.raises(registration.RegistrationError, match="is not committed"):
        registration.registration(board)
    _commit(board, "register")
    registered = registration.registration(board)
    _record(board, "dpsgd-t0-seed0")
    with pytest.raises(registration.RegistrationError, match="are not committed .*: commit them"):
        registration.registration(board)
    _commit(board, "a record")
    assert registration.registration(board)["commit"] == registered["commit"]
    analysis = json.loads((board / "analysis.json").read_text())
    analysis["family"]["alpha"] = 0.1  # changed after the data: refused, however small
    (board / "analysis.json").write_text(json.dumps(analysis))
    with pytest.raises(registration.RegistrationError, match="differs from its registration"):
        registration.registration(board)
    _commit(board, "a revision after the first record")
    with pytest.raises(registration.RegistrationError,
                       match="1 record file.* committed before the analysis's registration"):
        registration.registration(board)


def test_records_committed_before_the_analysis_are_refused(board):
    (board / "analysis.json").rename(board.parent / "later.json")
    _record(board, "rs-t3-seed0")
    _commit(board, "data first")
    (board.parent / "later.json").rename(board / "analysis.json")
    _commit(board, "then the analysis")
    with pytest.raises(registration.RegistrationError, match="rs-t3-seed0"):
        registration.registration(board)


def test_an_analysis_missing_a_choice_is_refused(board):
    analysis = json.loads((board / "analysis.json").read_text())
    del analysis["variance"]
    analysis["family"]["alpha"] = 5  # a level, not a percentage
    (board / "analysis.json").write_text(json.dumps(analysis))
    with pytest.raises(registration.RegistrationError, match="missing \\['variance'\\]"):
        registration.load_analysis(board / "analysis.json")
    analysis["variance"] = "welch"
    (board / "analysis.json").write_text(json.dumps(analysis))
    with pytest.raises(registration.RegistrationError, match="family.alpha must be a number"):
        registration.load_analysis(board / "analysis.json")


def test_the_sweep_refuses_a_board_whose_analysis_is_not_registered(board, capsys):
    """A protocol naming its board's analysis: refused (exit 2, one line, nothing written)
    while the analysis is uncommitted, and when --records is not that board's."""
    from dpbench import sweep
    from tests.test_sweep import PROTOCOL
    protocol = dict(PROTOCOL, analysis="analysis.json")
    (board / "protocol.json").write_text(json.dumps(protocol))
    argv = [f"--protocol={board / 'protocol.json'}", f"--records={board / 'records'}",
            f"--runs_dir={board.parent / 'runs'}", "--prepare_only"]
    assert sweep.main(argv) == 2
    assert "is not committed" in capsys.readouterr().err
    assert not (board / "records").exists()
    assert sweep.main([*argv[:1], f"--records={board.parent / 'elsewhere'}", *argv[2:]]) == 2
    assert f"--records={board / 'records'}" in capsys.readouterr().err


def test_the_registration_is_the_design_its_study_evaluated():
    """leaderboard/v4/analysis.json takes its sizes from the design study: the families' sizes,
    K, retrains and the ladder's rungs and K are those study.json evaluated for the chosen
    design, the study's numbers at the commit the analysis names are the committed ones, and
    the code's chosen design is that one."""
    from dpbench.board import study_report
    analysis = registration.load_analysis(REPO_ROOT / "leaderboard" / "v4" / "analysis.json")
    study_file = REPO_ROOT / "leaderboard" / "v4" / "study" / "study.json"
    study = json.loads(study_file.read_text())
    chosen = study["designs"][study["roles"]["chosen"]]
    design, ladder = analysis["design"], analysis["design"]["ladder"]
    assert analysis["study"]["design"] == study["roles"]["chosen"] == study_report.CHOSEN.name
    assert analysis["family"]["main"]["size"] == chosen["m"]
    assert analysis["family"]["ladder"]["size"] == study["ladder"]["family"]
    assert (design["trials_per_method"], design["retrains"]) == (
        chosen["design"]["trials"], chosen["design"]["retrains"])
    assert design["main_runs"] == chosen["runs"]
    assert list(ladder["rungs"]) == study["ladder"]["spec"]["rungs"]
    assert ladder["trials"] == study["ladder"]["spec"]["trials"]
    assert design["methods"] == study_report.METHODS
    committed = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "show",
         f"{analysis['study']['commit']}:leaderboard/v4/study/study.json"],
        capture_output=True, text=True)
    assert committed.returncode == 0, committed.stderr
    assert json.loads(committed.stdout) == study
