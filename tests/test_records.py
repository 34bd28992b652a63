"""Run records' provenance fields and atomic writes (dpbench/records.py)."""

import os
import subprocess

import pytest

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


def test_an_atomic_write_that_fails_midway_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "run_record.json"
    records.atomic_write_text(path, "old")

    def half(f):
        f.write(b"half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        records.atomic_write(path, half)
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run_record.json"]
    records.atomic_write_text(path, "new")
    assert path.read_text() == "new"


def test_an_atomic_write_gets_the_mode_a_plain_open_would(tmp_path):
    """0666 less the umask, as open() gives: the records and the board are readable by others
    where the umask allows (mkstemp alone gives 0600)."""
    old = os.umask(0o022)
    try:
        records.atomic_write_text(tmp_path / "a.json", "{}")
        with open(tmp_path / "b.json", "w") as f:
            f.write("{}")
    finally:
        os.umask(old)
    mode = lambda name: (tmp_path / name).stat().st_mode & 0o777  # noqa: E731
    assert mode("a.json") == mode("b.json") == 0o644
