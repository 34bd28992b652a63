"""Run records' provenance fields (dpbench/records.py)."""

import subprocess

from dpbench import records


def _git(root, *args):
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


def test_git_dirty_says_whether_tracked_files_changed(tmp_path):
    assert records.git_dirty(tmp_path) is None  # not a git checkout
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    assert records.git_dirty(tmp_path) is False
    (tmp_path / "untracked.txt").write_text("not a change to the code\n")
    assert records.git_dirty(tmp_path) is False
    (tmp_path / "a.py").write_text("x = 2\n")
    assert records.git_dirty(tmp_path) is True
