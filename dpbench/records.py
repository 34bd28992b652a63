"""A run's files on disk: one name for each (``*_NAME``), atomic writes, metrics, the run
record's JSON, and the privacy statement's text; every file is written atomically."""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import subprocess
from pathlib import Path

RECORD_NAME = "run_record.json"          # a finished run's record
METRICS_NAME = "metrics.jsonl"           # the progress rows (appended)
CONFIG_NAME = "config.gin"               # the configuration a run starts from
OPERATIVE_CONFIG_NAME = "operative_config.gin"  # the gin values the finished run used
CHECKPOINTS_DIR = "checkpoints"          # orbax checkpoints with the privacy ledger
SUPERSEDED_DIR = "superseded"            # finished runs moved aside by --overwrite
DIVERGED_NAME = "diverged.json"          # a sweep trial that diverged (instead of a record)
WINDOWS_NAME = "windows.json"  # a registered board's lent-GPU windows' costs (sweep/window.land)


def cache_root() -> Path:
    """dpbench's cache folder: ``$DPBENCH_CACHE_DIR``, else ``$XDG_CACHE_HOME/dpbench``, else
    ``~/.cache/dpbench`` (features in ``features/``, the accountant's answers in
    ``accounting/``). Everything in it is recomputed when missing or not valid."""
    return Path(os.environ.get("DPBENCH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "dpbench"))


def atomic_write(path: Path, write) -> None:
    """Calls ``write(f)`` on a binary file in ``path``'s directory, then renames it to ``path``:
    a crash leaves either the old file or the new one, never a half-written one. The file gets
    the mode a plain ``open`` would give it: created with 0666 the kernel applies the umask
    (mkstemp's 0600 left records and the board unreadable to other users)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp"))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """``atomic_write`` of a UTF-8 text."""
    atomic_write(path, lambda f: f.write(text.encode()))


def device_of(record: dict) -> tuple:
    """(device kind, JAX version) a run trained on: its record's device_kind, else the
    platform of its first device ('cuda', 'cpu')."""
    kind = record.get("device_kind") or str(record.get("devices", ["?"])[0]).split(":")[0]
    return kind, record.get("versions", {}).get("jax", "?")


def frozen_spec(board_dir):
    """A board folder's ``"frozen"`` entry in its board.json (board/frozen.py writes it: the
    hashes of an archived board's pages and records), or None for a live board."""
    path = Path(board_dir) / "board.json"
    return json.loads(path.read_text()).get("frozen") if path.exists() else None


def publish_record(run_dir: Path, target: Path) -> None:
    """The one way a finished run's record enters a records folder (a sweep's trial, a secret
    search's winner): copied whole from ``run_dir`` into ``target``, atomically, so a crash or
    a full disk leaves no partial record to be read as a finished trial."""
    atomic_write_text(Path(target) / RECORD_NAME, (Path(run_dir) / RECORD_NAME).read_text())


def _json_default(value):
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def _finite_or_str(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def to_json(obj) -> str:
    def clean(o):
        if isinstance(o, dict):
            return {str(k): clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        return _finite_or_str(o)

    return json.dumps(clean(obj), indent=2, sort_keys=True, default=_json_default) + "\n"


def append_metrics(workdir: Path, row: dict) -> None:
    """Appends one JSON line; a torn last line from a crash is skipped by :func:`read_metrics`."""
    with open(Path(workdir) / METRICS_NAME, "a") as f:
        f.write(json.dumps({k: _finite_or_str(v) for k, v in row.items()},
                           default=_json_default) + "\n")
        f.flush()


def read_metrics(workdir: Path) -> list[dict]:
    rows = []
    path = Path(workdir) / METRICS_NAME
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def tree_sha256(tree) -> str:
    """sha256 over every leaf of a pytree of arrays (path, dtype, shape and bytes, in
    jax.tree order): a bit-exact fingerprint of a model's parameters."""
    import jax  # imported here: records is otherwise a plain-Python module
    import numpy as np

    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(tree)):
        leaf = np.ascontiguousarray(leaf)
        digest.update(f"{jax.tree_util.keystr(path)}|{leaf.dtype}|{leaf.shape}|".encode())
        digest.update(leaf.tobytes())
    return digest.hexdigest()


def outside_source(obj) -> dict | None:
    """Where a registered function or class that is not dpbench's own was defined: its module,
    that module's file and the file's sha256 (code outside the repository, which the record's
    git commit does not pin); None for dpbench's own."""
    import inspect  # here: records is otherwise a module of plain files
    module = inspect.getmodule(inspect.unwrap(obj))
    if module is None or module.__name__.split(".")[0] == "dpbench":
        return None
    path = Path(inspect.getsourcefile(module) or module.__file__).resolve()
    return dict(module=module.__name__, path=str(path),
                sha256=hashlib.sha256(path.read_bytes()).hexdigest())


def git_dirty(root: Path | None = None) -> bool | None:
    """Whether dpbench's checkout (or ``root``) has uncommitted changes to tracked files (None
    outside git): a dirty tree's records are not reproduced by their git_commit alone."""
    try:
        root = Path(__file__).resolve().parents[1] if root is None else root
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                cwd=root, capture_output=True, text=True, timeout=10, check=True)
        return bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None


def git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[1]
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=5, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _describe_mechanism(m: dict) -> str:
    """One mechanism of the ledger in words, from its machine-readable fields."""
    times = "once before training" if m["schedule"] == "once before training" else (
        f"at each of {m['count']} steps")
    cyclic = m.get("sampler_parts")
    if cyclic:  # cyclic Poisson: an example can be drawn only at its part's steps
        times = (f"{m['count']} times per example (cyclic Poisson sampling over {cyclic} parts "
                 f"draws an example's part at one step in {cyclic}: ceil(steps / {cyclic}))")
    head = f"{m['name']} by {m['source']}, {times}: "
    if m["kind"] == "pure":
        return head + (
            f"pure {m['epsilon_per_occurrence']:.6g}-DP each; the "
            f"{m['count']} releases compose by basic composition into one pure "
            f"{m['epsilon_total']:.6g}-DP event (no amplification by sampling claimed)")
    parts = m.get("parts", 1)
    text = head + f"Gaussian noise multiplier {m['noise_multiplier']:.6g}"
    correlated = m.get("correlated_noise")
    if correlated:
        coefficients = ", ".join(f"{c:.4g}" for c in correlated.get(
            "strategy_coefficients", []))
        text += (f", its noise correlated across steps by {correlated['stage']}: the noise "
                 f"added at step t is (C^-1 z)_t, z the steps' independent draws and C the "
                 f"{correlated['bands']}-banded lower-triangular Toeplitz strategy "
                 f"[{coefficients}] (every column of L2 norm <= 1), accounted by "
                 f"{correlated['equivalence']},")
    if parts > 1:
        text += (f" on each of {parts} separately clipped parts of L2 norm <= "
                 f"{m['l2_sensitivity']:g} (clip stage {m['clip_stage']}), i.e. one Gaussian "
                 f"mechanism with noise multiplier {m['noise_multiplier']:.6g}/sqrt({parts}) = "
                 f"{m['effective_noise_multiplier']:.6g}")
    else:
        text += f" on an L2 sensitivity of {m['l2_sensitivity']:g}"
    text += f" (noise stddev {m['noise_stddev']:.6g}"
    if m.get("part_bounds"):
        text += "; each part is scaled by its clip bound, so in parameter units " + ", ".join(
            f"{part} (bound {bound:g}) gets stddev {m['noise_stddev'] * bound:.6g}"
            for part, bound in m["part_bounds"].items())
    text += ")"
    if m.get("clip_note"):
        text += f"; {m['clip_note']}"
    text += ", on batches drawn by "
    if cyclic:
        text += (f"cyclic Poisson sampling (each example's part drawn once before training, "
                 f"independently of the data; within its part, rate q = "
                 f"{m['sampling_probability']:.6g}")
        text += (f", the largest part N = {m['dataset_size']}, at most "
                 f"{m['truncated_batch_size']} examples)" if m.get("truncated_batch_size")
                 is not None else ")")
    elif m.get("truncated_batch_size") is not None:
        text += (f"truncated Poisson sampling (rate q = {m['sampling_probability']:.6g} over "
                 f"N = {m['dataset_size']}, at most {m['truncated_batch_size']} examples)")
    else:
        text += f"Poisson sampling (rate q = {m['sampling_probability']:.6g})"
    return text


def privacy_statement(*, epsilon: float, delta: float, mechanisms: list, sampler: dict,
                      steps: int, accountant: str, accountant_version: str,
                      accountant_settings: dict, accounting_note: str,
                      not_covered: list, inputs: list = (), outside_stages: list = (),
                      outside_code: list = (), seed_secret: bool = False,
                      timing_protected: bool = False) -> dict:
    """The claim a run makes, generated from its privacy ledger.

    ``mechanisms`` are the ledger's lines as plain dicts (``mechanism_fields``): the statement
    lists every one of them (machine-readable and in words), the sampler, the step count, the
    accountant and its version; ``not_covered`` lists, as {"what", "why"}, everything the run
    touched that the epsilon does NOT protect (validation split, public split, tuning,
    non-private diagnostics, ...); ``inputs`` lists, the same way, what is done to each
    example before the model's first learned layer (feature transforms, per-example
    normalization) and why it costs nothing; ``outside_stages`` lists the stages that are not
    dpbench's own (``compiler.sources.stage_sources`` with the checks they passed): the epsilon
    rests on their declarations, which dpbench checks on synthetic data but cannot prove;
    ``outside_code`` lists the run's dataset and model when they are not dpbench's own
    ({"kind", "name"} and ``outside_source``'s module, path and sha256): what the run trained
    on and with, pinned by file hash where the git commit cannot;
    ``seed_secret``: the run drew its seed from OS entropy and wrote it nowhere
    (``train.seed = None``); ``timing_protected``: the step has no data-dependent
    conditional, so its running time does not depend on the realized batch.
    """
    poisson = sampler.get("poisson_accounted", False)
    text = (f"({epsilon:.6g}, {delta:g})-DP under add/remove-one-example adjacency for the "
            f"{sampler.get('dataset_size', 'N')} private training examples, from the "
            f"composition of {len(mechanisms)} mechanism(s), accounted together by "
            f"{accountant} ({accountant_version}; {accounting_note}): ")
    text += "; ".join(f"({i + 1}) {_describe_mechanism(m)}" for i, m in enumerate(mechanisms))
    text += f". {steps} training steps in all."
    if inputs:
        text += " Inputs, at no privacy cost: " + "; ".join(
            f"{item['what']} ({item['why']})" for item in inputs) + "."
    if seed_secret:
        text += (" The run's randomness (initialisation, batches, noise) came from a seed drawn "
                 "from the operating system's entropy, written to no file: not to this record, "
                 "its checkpoints or its logs.")
    if timing_protected:
        text += (" Its step has no data-dependent branch: its running time does not depend on "
                 "the realized batch size.")
    if outside_stages:
        text += (" Stages from outside dpbench: " + "; ".join(
            f"{s['stage']} (module {s['module']}, file sha256 {s['sha256'][:12]}, checked on "
            f"synthetic data: {', '.join(s.get('checks_passed', [])) or 'no check'})"
            for s in outside_stages) + "; this epsilon holds only if their declared privacy "
            "facts hold, which those checks test but do not prove.")
    if outside_code:
        text += (" Code from outside dpbench: " + "; ".join(
            f"{c['kind']} {c['name']} (module {c['module']}, file sha256 {c['sha256'][:12]})"
            for c in outside_code) + ".")
    if not poisson:
        text += (" WARNING: batches were shuffled fixed-size batches; the epsilon above is the "
                 "Poisson-sampling epsilon and does NOT hold for this run.")
    text += " NOT covered by this epsilon: " + "; ".join(
        f"{item['what']}: {item['why']}" for item in not_covered) + "."
    return dict(adjacency="add or remove one example", epsilon=epsilon, delta=delta,
                accountant=accountant, accountant_version=accountant_version,
                accountant_settings=dict(accountant_settings),
                accounting_note=accounting_note, steps=steps,
                sampling=sampler["sampling"], sampling_rate=sampler["sampling_rate"],
                poisson_accounted=poisson, padded_batch_size=sampler.get("padded_batch_size"),
                truncated_poisson=sampler.get("truncated", False),
                mechanisms=list(mechanisms), not_covered=list(not_covered),
                inputs=list(inputs), outside_stages=list(outside_stages),
                outside_code=list(outside_code), seed_secret=seed_secret,
                timing_protected=timing_protected, statement=text)
