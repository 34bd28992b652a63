"""A board's analysis registered before its first trial (board v4 on; with the protocol, since
the sweep checks it before it trains and the board before it renders): ``<board>/analysis.json``
names every choice the verdicts make (estimands, the family of the correction, margins, labels,
the variance model, the Monte Carlo rule), and git history proves it came first.

The registration is the last commit that changed ``analysis.json``. A board is registered when
that file is committed, unchanged in the working copy, and every record under
``<board>/records`` was first committed after the registration (git history shows it; a record
not yet committed proves nothing and is refused). The analysis may be revised only while no
record exists: a revision after the first record would be an analysis chosen after the data.
``dpbench sweep`` refuses to train into a board whose analysis is not registered.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ANALYSIS = "analysis.json"
# what an analysis must fix, each a JSON object or value the verdicts read
KEYS = {"board", "about", "study", "estimands", "tests", "family", "labels", "variance",
        "intervals", "mde", "design"}


class RegistrationError(ValueError):
    """An analysis that is not registered, or records that came before it; the message says
    what to do."""


def analysis_path(records_dir) -> Path:
    """Where the analysis of the board whose records are ``records_dir`` lives."""
    return Path(records_dir).resolve().parent / ANALYSIS


def load_analysis(path) -> dict:
    """The analysis, its keys and the numbers its verdicts read checked."""
    try:
        analysis = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RegistrationError(f"{path}: not a readable JSON analysis ({e})") from e
    missing, extra = KEYS - set(analysis), set(analysis) - KEYS
    if missing or extra:
        raise RegistrationError(f"{path}: an analysis names exactly {sorted(KEYS)}; missing "
                                f"{sorted(missing)}, unknown {sorted(extra)}")
    numbers = [("family", "alpha"), ("mde", "power"), ("intervals", "tuned_level")]
    for section, key in numbers:
        value = analysis[section].get(key) if isinstance(analysis[section], dict) else None
        if not isinstance(value, (int, float)) or not 0 < value < 1:
            raise RegistrationError(f"{path}: {section}.{key} must be a number in (0, 1), got "
                                    f"{value!r}")
    return analysis


def _git(cwd: Path, *args) -> str:
    done = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True)
    if done.returncode != 0 and "does not have any commits" in done.stderr:
        return ""  # a repository with no commit yet: nothing is committed
    if done.returncode != 0:
        raise RegistrationError(f"git {' '.join(args)} failed in {cwd}: "
                                f"{done.stderr.strip()[:300]} (a registration is proved by "
                                "git history: the board must be in a git repository)")
    return done.stdout


def registration(board_dir) -> dict:
    """{commit, date, analysis} of the board's registered analysis; raises RegistrationError
    unless it is committed, unchanged since, and older than every record."""
    board = Path(board_dir).resolve()
    path = board / ANALYSIS
    if not path.exists():
        raise RegistrationError(f"{board} has no {ANALYSIS}: register the board's analysis "
                                "(commit it) before any of its trials runs")
    analysis = load_analysis(path)
    root = Path(_git(board, "rev-parse", "--show-toplevel").strip())
    relative = path.relative_to(root).as_posix()
    last = _git(root, "log", "-1", "--format=%H %cI", "--", relative).split()
    if not last:
        raise RegistrationError(f"{relative} is not committed: commit it (that commit is the "
                                "registration) before any of the board's trials runs")
    commit, date = last
    if _git(root, "show", f"{commit}:{relative}") != path.read_text():
        raise RegistrationError(
            f"{relative} differs from its registration ({commit[:10]}, {date}): a board "
            "renders only with the analysis registered before its trials; restore it "
            f"(git checkout {commit[:10]} -- {relative})")
    _check_records_after(root, board / "records", commit, date)
    return dict(commit=commit, date=date, analysis=analysis)


def _check_records_after(root: Path, records: Path, commit: str, date: str) -> None:
    if not records.exists():
        return
    relative = records.relative_to(root).as_posix()
    loose = _git(root, "status", "--porcelain", "--untracked-files=all", "--",
                 relative).splitlines()
    if loose:
        raise RegistrationError(
            f"{len(loose)} file(s) under {relative} are not committed (first: "
            f"{loose[0][3:]}): commit them, so that git history shows they came after the "
            f"analysis's registration ({commit[:10]})")
    after = set(_git(root, "rev-list", f"{commit}..HEAD").split())
    added, current = {}, None
    for line in _git(root, "log", "--diff-filter=A", "--format=%H", "--name-only", "--",
                     relative).splitlines():
        if len(line) == 40 and " " not in line and "/" not in line:
            current = line
        elif line:
            added[line] = current  # log runs newest first: the last seen is the first add
    early = sorted(name for name, c in added.items() if c not in after)
    if early:
        raise RegistrationError(
            f"{len(early)} record file(s) were committed before the analysis's registration "
            f"({commit[:10]}, {date}), e.g. {early[0]}: the analysis was registered after "
            "data existed; a board's analysis is registered before its first trial")
