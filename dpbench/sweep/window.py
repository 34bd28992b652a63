"""A lent device's window on a registered board: ``dpbench sweep window`` trains there,
``dpbench sweep land`` publishes here.

A *cell* is one group's method: its K search trials on the first seed, then its winner's
retrains on the other seeds. The board's registered analysis (its ``design.device``) puts every
run of a group on one device kind under one JAX version, and a board cell lands whole or not at
all. So:

- there (:func:`run_window`): the device's kind and JAX version are read in a child process; a
  JAX other than the registered one, or a kind the registration does not lend, trains nothing.
  A group whose runs (published or pending) came from another device is skipped. The board's
  protocols (``PROTOCOLS``: the main board, then the dimension ladder) train through the
  sweep's local runner (sweep/local.py) on the device alone (no CPU worker, no fallback to the
  CPU; cells nearest whole first), into a staging copy of the records and the pending runs;
  ``records.tar.gz`` brings the new runs back, ``window.json`` the device and the time.
- here (:func:`land`): every returned run goes to ``<board>/pending/<group>/`` (the board never
  reads it; the next window's tree carries it); a cell whose runs are all there, on one lent
  device kind and the registered JAX, the group's, moves whole into ``<board>/records/``. A run
  from another device, or one its search.json does not plan, never joins: it is kept in
  ``<board>/refused/`` with its reason. Every window's cost is appended to
  ``<board>/windows.json``.

The registration is proved by git history, which the device's copy of the tree lacks:
``registration_proof`` (here) writes what ``registration.registration`` found and the analysis's
SHA-256, and a window trains only while the analysis still has that hash. The proof lets a
window train, never publish: ``land`` checks the registration again, here, with git.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from dpbench import records as records_lib
from dpbench.search import registration, tuning
from dpbench.search.protocol import load_protocol
from dpbench.sweep import jobs as sweep_jobs

PENDING = "pending"  # beside the board's records: a cell's runs until the cell is whole
REFUSED = "refused"  # beside them: runs that may never join the board, each with its reason
WINDOWS = records_lib.WINDOWS_NAME  # the board's cost line: one entry per landed window
WINDOW = "window.json"  # what a window says of itself (device, JAX, commit, seconds)
RECORDS_TARBALL = "records.tar.gz"
PROTOCOLS = ("protocol.json", "ladder.json")  # the board's protocols, in the order windows run
MIN_LEFT_S = 90.0  # a protocol is not started with less left than one device pack needs


class WindowError(ValueError):
    """A window or a landing that cannot go on as asked; the message says what to change."""


def device_rule(analysis: dict) -> dict:
    """The registered device rule: {'jax': version, 'kinds': model names}, the names read off
    the registration's ``vendor-model`` words (``nvidia-h100`` lends a kind naming H100)."""
    device = analysis.get("design", {}).get("device")
    if not device:
        raise WindowError("the board's analysis registers no device rule (design.device): a "
                          "window trains only a board that names its device kinds and JAX")
    kinds = re.findall(r"\b[a-z]+-([a-z0-9]+)\b", device["kinds"].lower())
    if not kinds:
        raise WindowError(f"design.device.kinds names no device as vendor-model (e.g. "
                          f"nvidia-h100): {device['kinds']!r}")
    return dict(jax=str(device["jax"]), kinds=kinds)


def refusal(device: tuple, rule: dict) -> Optional[str]:
    """Why runs from ``device`` ((kind, JAX version)) may not join the board, or None."""
    kind, jax_version = device
    if jax_version != rule["jax"]:
        return (f"JAX {jax_version} is not the registered {rule['jax']}: install JAX "
                f"{rule['jax']} there")
    if not set(kind.lower().split()) & set(rule["kinds"]):
        return (f"device kind {kind!r} is not one the registration lends "
                f"({', '.join(rule['kinds'])})")
    return None


def run_device(run_dir: Path) -> Optional[tuple]:
    """(kind, JAX version) of a published run; None for a diverged run (no record)."""
    path = Path(run_dir) / records_lib.RECORD_NAME
    return records_lib.device_of(json.loads(path.read_text())) if path.exists() else None


def run_dirs(group_dir: Path) -> list:
    """The published runs of a group folder (records or pending)."""
    if not Path(group_dir).is_dir():
        return []
    return [d for d in sorted(Path(group_dir).iterdir())
            if tuning.parse_run_dir(d.name) and tuning.published(d)]


def devices_of(group_dirs) -> set:
    return {d for g in group_dirs for r in run_dirs(g) if (d := run_device(r)) is not None}


def cell_runs(plan: dict, method: str, find: Callable[[str], Optional[Path]]) -> tuple:
    """(run names, whole) of ``method``'s cell: its search, and once the search is all found,
    its winner's retrains; ``find(name)`` is the run's folder, or None while it is missing."""
    seed0 = plan["seeds"][0]
    names = [tuning.run_dir_name(method, t, seed0) for t in range(plan["num_trials"])]
    folders = [find(n) for n in names]
    if any(f is None for f in folders):
        return names, False
    validation = {}
    for trial, folder in enumerate(folders):
        done = sweep_jobs.result(folder)
        validation[trial] = None if done["diverged"] else done["validation_accuracy"]
    try:
        winner = tuning.choose_trial(validation)
    except ValueError as e:
        raise WindowError(f"{plan['group']} {method}: {e}") from e
    names += [tuning.run_dir_name(method, winner, s) for s in plan["seeds"][1:]]
    return names, all(find(n) is not None for n in names)


# -- here -----------------------------------------------------------------------------------


def registration_proof(board: Path) -> dict:
    """What the board's registration is (checked with git, here) and its analysis's hash."""
    proof = registration.registration(board)
    return dict(commit=proof["commit"], date=proof["date"],
                analysis_sha256=_sha256(Path(board) / registration.ANALYSIS))


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def land(board: Path, files: Path, device_s: Optional[float] = None) -> dict:
    """Lands one window's files (``files``: its records.tar.gz and window.json) on ``board``;
    what happened: {pending, landed, refused, skipped, entry}."""
    board = Path(board)
    analysis = registration.registration(board)["analysis"]
    rule = device_rule(analysis)
    records, pending = board / "records", board / PENDING
    tarball, said = Path(files) / RECORDS_TARBALL, Path(files) / WINDOW
    if not tarball.exists() or not said.exists():
        raise WindowError(f"{files} lacks {RECORDS_TARBALL} or {WINDOW}: pass the folder the "
                          "window's files came back in")
    window = json.loads(said.read_text())
    out = dict(pending=[], landed=[], refused=[], skipped=[])
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(tarball) as tar:
            tar.extractall(tmp, filter="data")
        for group_dir in sorted(p for p in Path(tmp).iterdir() if p.is_dir()):
            if not (records / group_dir.name / tuning.SEARCH_FILE).exists():
                out["refused"] += [f"{group_dir.name}: not a group of this board (no "
                                   f"{tuning.SEARCH_FILE} under {records})"]
                continue
            plan = json.loads((records / group_dir.name / tuning.SEARCH_FILE).read_text())
            for run in run_dirs(group_dir):
                name = f"{group_dir.name}/{run.name}"
                if (records / name).exists() or (pending / name).exists():
                    out["skipped"].append(name)  # a window re-sent it: the first copy stays
                elif why := (_not_planned(plan, run) or ((device := run_device(run))
                                                         and refusal(device, rule))):
                    out["refused"].append(f"{name}: {why}")
                    kept = board / REFUSED / name  # never read, never carried: kept, and why
                    if not kept.exists():
                        kept.parent.mkdir(parents=True, exist_ok=True)
                        shutil.move(str(run), kept)
                        (kept / "refused.txt").write_text(why + "\n")
                else:
                    (pending / group_dir.name).mkdir(parents=True, exist_ok=True)
                    shutil.move(str(run), pending / name)
                    out["pending"].append(name)
    for group_dir in sorted(pending.iterdir()) if pending.is_dir() else []:
        out["landed"] += _land_whole_cells(records / group_dir.name, group_dir)
        if not any(group_dir.iterdir()):
            group_dir.rmdir()
    if pending.is_dir() and not any(pending.iterdir()):
        pending.rmdir()
    runs = out["pending"]
    entry = dict(landed_at=datetime.date.today().isoformat(), device=window.get("device"),
                 jax=window.get("jax"), commit=window.get("commit"),
                 device_s=round(float(device_s if device_s is not None
                                      else window.get("device_s", 0.0)), 1),
                 runs=len(runs),
                 diverged=sum((pending / n / tuning.DIVERGED).exists()
                              or (records / n / tuning.DIVERGED).exists() for n in runs),
                 refused=len(out["refused"]), cells_landed=out["landed"],
                 window_refused=window.get("refused"))
    entry["runs_per_device_minute"] = (round(60 * entry["runs"] / entry["device_s"], 2)
                                       if entry["device_s"] else None)
    log = board / WINDOWS
    entries = json.loads(log.read_text()) if log.exists() else []
    records_lib.atomic_write_text(log, json.dumps(entries + [entry], indent=1) + "\n")
    out["entry"] = entry
    return out


def _not_planned(plan: dict, run: Path) -> Optional[str]:
    """Why a returned run is not one its group's search.json plans (None when it is): a method
    or trial it does not have, or a record whose seed or DpEvent is not the plan's (the check
    the board makes, made at once: a drift shows at the first window, not after the last)."""
    method, trial, seed = tuning.parse_run_dir(run.name)
    if method not in plan["methods"] or not 0 <= trial < plan["num_trials"] \
            or seed not in plan["seeds"]:
        return f"not a run of this group's search.json ({plan['num_trials']} trials a method)"
    path = run / records_lib.RECORD_NAME
    if not path.exists():
        return None  # diverged: it carries no record to check
    return tuning.record_problem(plan, method, trial, seed, json.loads(path.read_text()))


def _finder(*folders: Path) -> Callable[[str], Optional[Path]]:
    """name -> the first of ``folders``' published run of that name, or None (cell_runs' find:
    a group's records, then its pending runs)."""
    return lambda name: next((d / name for d in folders if tuning.published(d / name)), None)


def _land_whole_cells(group_records: Path, group_pending: Path) -> list:
    """Moves each cell of the group that is whole over records and pending, and on one device,
    from pending into records; the cells landed ('group method')."""
    plan = json.loads((group_records / tuning.SEARCH_FILE).read_text())
    find, landed = _finder(group_records, group_pending), []
    for method in plan["methods"]:
        names, whole = cell_runs(plan, method, find)
        mine = [n for n in names if (group_pending / n).exists()]
        if not whole or not mine:
            continue
        devices = {d for n in names if (d := run_device(find(n))) is not None}
        if len(devices | devices_of([group_records])) > 1:
            continue  # a group's runs come from one device: this cell waits (see `pending`)
        for name in mine:
            shutil.move(str(group_pending / name), group_records / name)
        landed.append(f"{plan['group']} {method}")
    return landed


def pending_cells(board: Path) -> list:
    """[(group, method, runs found, runs the cell needs)] of every cell with runs in pending."""
    board = Path(board)
    out = []
    for group_dir in sorted((board / PENDING).iterdir()) if (board / PENDING).is_dir() else []:
        group_records = board / "records" / group_dir.name
        plan = json.loads((group_records / tuning.SEARCH_FILE).read_text())
        find = _finder(group_records, group_dir)
        for method in plan["methods"]:
            names, _ = cell_runs(plan, method, find)
            if any((group_dir / n).exists() for n in names):
                out.append((group_dir.name, method, sum(find(n) is not None for n in names),
                            plan["num_trials"] + len(plan["seeds"]) - 1))
    return out


# -- there ----------------------------------------------------------------------------------


def query_device(env: dict) -> tuple:
    """(device kind, JAX version) of the accelerator a child process in ``env`` (a device
    worker's, sweep/local.DEVICE_ENV) would use."""
    code = "import jax; print(jax.devices()[0].device_kind); print(jax.__version__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env})
    if done.returncode != 0:
        raise WindowError(f"JAX could not name its device: {done.stderr.strip()[-400:]}")
    kind, version = done.stdout.strip().splitlines()[-2:]
    return kind, version


def run_window(board: Path, proof: dict, device: tuple, prepare: Callable, train: Callable,
               deadline_s: float, out: Path, runs_dir: Path, group_size: int = 0,
               gpu_binding=(), setup_s: float = 0.0) -> dict:
    """Trains the board's unfinished cells that ``device`` ((kind, JAX version)) may train
    until ``deadline_s`` seconds from now: each group's plan from ``prepare`` (sweep/planning:
    its committed search.json, checked against the protocol), its runs by ``train``
    (sweep/local.run_local: plans, args). Writes ``out``/records.tar.gz (the new runs) and
    ``out``/window.json."""
    start, board, out, runs_dir = time.time(), Path(board), Path(out), Path(runs_dir)
    analysis_path = board / registration.ANALYSIS
    if _sha256(analysis_path) != proof["analysis_sha256"]:
        raise WindowError(f"{analysis_path} is not the registered analysis (its hash differs "
                          "from the proof's): prepare the window again from the committed board")
    rule = device_rule(registration.load_analysis(analysis_path))
    said = dict(device=device[0], jax=device[1], commit=records_lib.git_commit(),
                registration=proof["commit"], setup_s=round(setup_s, 1), skipped=[], ran=[])
    why = refusal(device, rule)
    staging = runs_dir / "records"
    if staging.exists():
        shutil.rmtree(staging)
    shutil.copytree(board / "records", staging)
    if (board / PENDING).is_dir():
        shutil.copytree(board / PENDING, staging, dirs_exist_ok=True)
    before = {(g.name, r.name) for g in staging.iterdir() if g.is_dir() for r in run_dirs(g)}
    for name in PROTOCOLS if why is None else ():
        if not (board / name).exists():
            continue
        protocol = load_protocol(board / name)
        plans = []
        for family, spec in protocol["families"].items():
            for epsilon in protocol["epsilons"]:
                group = tuning.group_name(family, epsilon, protocol["delta"])
                other = devices_of([staging / group]) - {device}
                if not (staging / group / tuning.SEARCH_FILE).exists():
                    said["skipped"].append(f"{group}: no {tuning.SEARCH_FILE} (run `dpbench "
                                           f"sweep prepare --protocol={board / name}` here)")
                elif other:
                    said["skipped"].append(f"{group}: its runs came from {sorted(other)}")
                else:
                    plans.append(prepare(protocol, family, epsilon, list(spec["methods"]),
                                         staging))
        left = deadline_s - (time.time() - start)
        if not plans or left < MIN_LEFT_S:
            continue
        said["ran"].append(name)
        train(plans, argparse.Namespace(
            records=staging, runs_dir=runs_dir, deadline_s=left, gpu_workers=1, cpu_workers=0,
            device_only=True, group_size=group_size, gpu_binding=list(gpu_binding),
            out=out / Path(name).stem, pack_every_s=60.0))
    out.mkdir(parents=True, exist_ok=True)
    new = sorted({(g.name, r.name) for g in staging.iterdir() if g.is_dir()
                  for r in run_dirs(g)} - before)
    with tarfile.open(out / (RECORDS_TARBALL + ".part"), "w:gz") as tar:
        for group, run in new:
            tar.add(staging / group / run, arcname=f"{group}/{run}")
    os.replace(out / (RECORDS_TARBALL + ".part"), out / RECORDS_TARBALL)
    said.update(refused=why, runs=len(new), elapsed_s=round(time.time() - start, 1))
    said["device_s"] = round(setup_s + said["elapsed_s"], 1)
    records_lib.atomic_write_text(out / WINDOW, json.dumps(said, indent=1) + "\n")
    return said
