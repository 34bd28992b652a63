"""A sweep's Tune trials (dpbench/sweep/jobs.py): how jobs are packed into groups, and what a
pack publishes when its process ends, finished, diverged or failed. The packs' training itself
runs in tests/test_sweep.py (the researcher's sweep, the secret search) and tests/test_group.py."""

import json
import subprocess

import numpy as np
import pytest

from dpbench import config
from dpbench.sweep import jobs as sweep_jobs

GROUPS = ("digits__logistic__eps1.0__delta1e-05", "digits__logistic__eps3.0__delta1e-05")


def _job(tmp_path, group, method, trial, seed=0):
    return dict(records=str(tmp_path / "records"), runs_dir=str(tmp_path / "runs"),
                repo=str(config.REPO_ROOT), group=group, epsilon=3.0, delta=1e-5,
                method=method, trial=trial, seed=seed, gin_files=[], bindings=[])


@pytest.mark.parametrize("workers", [1, 2, 7, 64])
def test_packs_hold_one_method_and_group_each_fill_the_workers_and_keep_the_cap(tmp_path,
                                                                                 workers):
    rng = np.random.default_rng()
    trials = {m: int(rng.integers(1, 20)) for m in ("dpsgd", "rs", "gep")}
    jobs = [_job(tmp_path, g, m, t) for g in GROUPS for m, k in trials.items()
            for t in range(k)]
    name = lambda j: f"{j['group']}/{j['method']}-t{j['trial']}"  # noqa: E731
    spread = -(-workers // (2 * len(trials)))
    for cap in (0, 1, int(rng.integers(2, 6))):
        packs = sweep_jobs.pack_jobs(jobs, cap, workers, defaults={})
        assert sorted(name(j) for p in packs for j in p) == sorted(map(name, jobs))  # each once
        assert [name(j) for p in packs for j in p] == list(map(name, jobs))  # in order
        for group in GROUPS:
            for method, n in trials.items():
                mine = [len(p) for p in packs
                        if (p[0]["group"], p[0]["method"]) == (group, method)]
                assert all(len({(j["group"], j["method"]) for j in p}) == 1 for p in packs)
                assert max(mine) - min(mine) <= 1, mine  # balanced
                assert len(mine) == max(min(spread, n), -(-n // cap) if cap else 0), mine
                assert not cap or max(mine) <= cap


def _launched(tmp_path, finished=(), diverged=()):
    """A stand-in for ``dpbench train --trials=... --outcomes=...``: writes a run record into
    the workdirs of the jobs ``finished`` names, and its outcomes file (the ``diverged`` ones
    with a message)."""
    def run(command, **kwargs):
        flags = dict(a.split("=", 1) for a in command if a.startswith("--"))
        assert command[-4:-2] == ["dpbench.main", "train"], command
        spec, outcomes = json.loads(open(flags["--trials"]).read()), []
        for trial in spec:
            name = trial["workdir"].rsplit("/", 1)[-1]
            if name in finished:
                (tmp_path / "runs" / GROUPS[0] / name).mkdir(parents=True, exist_ok=True)
                (tmp_path / "runs" / GROUPS[0] / name / "run_record.json").write_text(
                    json.dumps({"validation_accuracy": 0.6, "name": name}))
            outcomes.append(dict(workdir=trial["workdir"],
                                 outcome="diverged" if name in diverged else "finished",
                                 message="training diverged at step 3" if name in diverged
                                 else None))
        with open(flags["--outcomes"], "w") as f:
            json.dump(outcomes, f)
        return Ended(1 if diverged else 0)
    return run


class Ended:
    """A stand-in for a process that has ended (what ``subprocess.Popen`` gives, waited on)."""

    def __init__(self, code: int):
        self.code = code

    def wait(self) -> int:
        return self.code


def test_a_pack_publishes_its_finished_and_diverged_trials_and_names_the_rest(tmp_path,
                                                                            monkeypatch):
    """A pack of four: one already published (never given to the process), one the process
    finished, one it saw diverge, one it left without an outcome (a crash): the first three are
    published (the diverged one as diverged.json), then the pack fails naming the fourth; a
    rerun gives the process that one trial only."""
    jobs = [_job(tmp_path, GROUPS[0], "dpsgd", t) for t in range(4)]
    done = tmp_path / "records" / GROUPS[0] / "dpsgd-t0-seed0"
    done.mkdir(parents=True)
    (done / "run_record.json").write_text(json.dumps({"validation_accuracy": 0.5}))
    monkeypatch.setattr(subprocess, "Popen", _launched(tmp_path, finished=("dpsgd-t1-seed0",),
                                                     diverged=("dpsgd-t2-seed0",)))
    with pytest.raises(RuntimeError, match=r"dpsgd-t3-seed0 failed \(exit 1\)") as failed:
        sweep_jobs.run_pack(jobs)
    assert "t1" not in str(failed.value).split("failed")[0]
    records = tmp_path / "records" / GROUPS[0]
    assert json.loads((records / "dpsgd-t1-seed0" / "run_record.json").read_text())[
        "name"] == "dpsgd-t1-seed0"
    assert "diverged at step 3" in (records / "dpsgd-t2-seed0" / "diverged.json").read_text()
    assert not (records / "dpsgd-t3-seed0").exists()
    launched = (tmp_path / "runs" / sweep_jobs.LAUNCH_LOG).read_text().split()
    assert launched == [f"{GROUPS[0]}/dpsgd-t{t}-seed0" for t in (1, 2, 3)]
    monkeypatch.setattr(subprocess, "Popen", _launched(tmp_path, finished=("dpsgd-t3-seed0",)))
    result = sweep_jobs.run_pack(jobs)
    assert result == dict(trials=4, diverged=1, validation_accuracy=0.6)
    launched = (tmp_path / "runs" / sweep_jobs.LAUNCH_LOG).read_text().split()
    assert launched[3:] == [f"{GROUPS[0]}/dpsgd-t3-seed0"]
