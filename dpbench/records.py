"""Run records, metrics and the privacy statement; every file is written atomically."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path

RECORD_NAME = "run_record.json"
METRICS_NAME = "metrics.jsonl"
PACKAGES = ("jax", "jaxlib", "flax", "optax", "dp-accounting", "gin-config", "orbax-checkpoint",
            "numpy")


def atomic_write_text(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` via a temporary file in the same directory and a rename, so a
    crash leaves either the old file or the new one, never a half-written one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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


def versions(packages=PACKAGES) -> dict:
    """Python's version and each package's installed version (None where not installed)."""
    out = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[1]
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=5, check=True).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def privacy_statement(*, epsilon: float, delta: float, noise_multiplier: float,
                      sensitivity: float, steps: int, sampler: dict, accountant: str,
                      accountant_version: str, releases_per_step: int,
                      one_off_releases: list = ()) -> dict:
    """The claim a run makes, with every parameter the accountant used to make it."""
    poisson = sampler.get("poisson_accounted", False)
    text = (f"({epsilon:.4g}, {delta:g})-DP under add/remove-one-example adjacency, for "
            f"{steps} steps of {sampler['sampling']} sampling with rate q = "
            f"{sampler['sampling_rate']:.6g}, Gaussian noise multiplier {noise_multiplier:.6g} "
            f"on an L2 sensitivity of {sensitivity:g}, accounted by {accountant} "
            f"({accountant_version}).")
    for release in one_off_releases:
        text += (f" Plus one {release['stage']} release before training (the same sampler, "
                 f"noise multiplier {release['noise_multiplier']:.6g}, L2 sensitivity "
                 f"{release['l2_bound']:g}), composed into that epsilon.")
    if not poisson:
        text += (" WARNING: batches were shuffled fixed-size batches; the epsilon above is the "
                 "Poisson-sampling epsilon and does NOT hold for this run.")
    return dict(adjacency="add or remove one example", sampling=sampler["sampling"],
                sampling_rate=sampler["sampling_rate"], poisson_accounted=poisson,
                padded_batch_size=sampler.get("padded_batch_size"),
                truncated_poisson=sampler.get("truncated", False),
                noise_multiplier=noise_multiplier, l2_sensitivity=sensitivity,
                releases_per_step=releases_per_step, one_off_releases=list(one_off_releases),
                steps=steps, delta=delta,
                epsilon=epsilon, accountant=accountant, accountant_version=accountant_version,
                statement=text)
