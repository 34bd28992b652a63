"""The one module that talks to orbax: checkpoints of a run, with its privacy ledger.

A checkpoint at step s holds three items:

- ``state``: the whole ``TrainState`` (params, optimizer and stage states, EMA params, step and,
  for seeded benchmark runs only, the run's PRNG key). Batches need no saved position: the
  sampler draws step t's batch from (seed, t), so the step number is the sampler position.
- ``best``: the parameters with the best validation accuracy so far (model selection survives a
  resume).
- ``ledger``: JSON: the DP events composed so far, epsilon spent, every privacy-relevant setting
  and their sha256, the best validation accuracy/step, resume history.

Release runs (``train.seed = None``) never write their key: their checkpoints hold a zero key and
a resumed release run draws a fresh key from the OS (so no noise is ever re-derived or written).

After orbax has committed a step, a manifest with the size and sha256 of every file of that step
is written beside the checkpoints (``<dir>/manifests/<step>.json``). Restoring verifies the files
against it, so a truncated or bit-flipped checkpoint fails with the file's name and the last good
step instead of loading wrong numbers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from dpbench import records

MANIFESTS = "manifests"
STEPS = "steps"


class _QuietOrbax(logging.Filter):
    """Drops orbax's INFO chatter (dozens of lines per save); its warnings still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or "orbax" not in record.pathname


logging.getLogger("absl").addFilter(_QuietOrbax())


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or restored; the message names the file and step."""


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def keys_to_data(tree):
    """Typed PRNG keys become their uint32 data (orbax stores plain arrays)."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def data_to_keys(tree, like):
    """Inverse of :func:`keys_to_data`, guided by a tree (or shape tree) with typed keys."""
    return jax.tree.map(lambda x, ref: jax.random.wrap_key_data(x) if _is_key(ref) else x,
                        tree, like)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files(directory: Path) -> dict:
    return {str(p.relative_to(directory)): p for p in sorted(directory.rglob("*")) if p.is_file()}


@dataclasses.dataclass
class Restored:
    step: int
    state: Any       # TrainState on the requested mesh
    best_params: Any
    ledger: dict


class RunCheckpoints:
    """Periodic checkpoints of one run under ``directory`` (keeps the newest ``max_to_keep``)."""

    def __init__(self, directory: str | Path, *, max_to_keep: int = 2, save_key: bool = True):
        if not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"train.checkpoints_to_keep must be a positive integer, got "
                             f"{max_to_keep!r}")
        # orbax refuses relative paths; a relative --workdir is relative to the cwd
        self.directory = Path(directory).absolute()
        self.save_key = save_key
        (self.directory / MANIFESTS).mkdir(parents=True, exist_ok=True)
        self._manager = ocp.CheckpointManager(
            self.directory / STEPS,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, enable_async_checkpointing=False, create=True),
            item_names=("state", "best", "ledger"))

    # -- what is there ---------------------------------------------------------------------
    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> Optional[int]:
        steps = self.steps()
        return steps[-1] if steps else None

    def step_dir(self, step: int) -> Path:
        return self.directory / STEPS / str(step)

    def _manifest_path(self, step: int) -> Path:
        return self.directory / MANIFESTS / f"{step}.json"

    def verify(self, step: int) -> Optional[str]:
        """None if step's files match its manifest, else what is wrong (naming the file).

        A step without a manifest (killed between orbax's commit and the manifest write) is
        trusted to orbax's own atomic commit and checked by the restore itself.
        """
        manifest_path = self._manifest_path(step)
        if not manifest_path.exists():
            return None
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            return f"its manifest {manifest_path} is unreadable ({e})"
        root = self.step_dir(step)
        for name, (size, digest) in manifest["files"].items():
            path = root / name
            if not path.exists():
                return f"file {path} is missing"
            if path.stat().st_size != size:
                return (f"file {path} is truncated or altered ({path.stat().st_size} bytes, "
                        f"{size} were written)")
            if _sha256(path) != digest:
                return f"file {path} is corrupt (its sha256 differs from the one written)"
        return None

    def last_good_step(self, before: int) -> Optional[int]:
        for step in reversed(self.steps()):
            if step < before and self.verify(step) is None:
                return step
        return None

    # -- save ------------------------------------------------------------------------------
    def save(self, state, *, best_params, ledger: dict) -> None:
        step = int(jax.device_get(state.step))
        if not self.save_key:
            state = state._replace(key=jax.random.wrap_key_data(
                jnp.zeros_like(jax.random.key_data(state.key))))
        try:
            self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(keys_to_data(state)),
                best=ocp.args.StandardSave(best_params),
                ledger=ocp.args.JsonSave(ledger)))
            self._manager.wait_until_finished()
            files = {name: [path.stat().st_size, _sha256(path)]
                     for name, path in _files(self.step_dir(step)).items()}
            records.atomic_write_text(self._manifest_path(step),
                                      json.dumps({"step": step, "files": files}, indent=1))
        except OSError as e:
            last = self.last_good_step(step)
            raise CheckpointError(
                f"could not write checkpoint step {step} to {self.step_dir(step)}: {e}. The "
                f"last good checkpoint is step {last}; free disk space (or fix the directory's "
                "permissions) and rerun the same command to resume from it") from e
        kept = {str(s) for s in self.steps()}
        for manifest in (self.directory / MANIFESTS).glob("*.json"):
            if manifest.stem not in kept:
                manifest.unlink(missing_ok=True)

    # -- restore ---------------------------------------------------------------------------
    def read_ledger(self, step: int) -> dict:
        path = self.step_dir(step) / "ledger" / "metadata"
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            self._raise_corrupt(step, f"file {path} is unreadable ({e})")

    def _raise_corrupt(self, step: int, problem: str):
        last = self.last_good_step(step)
        where = (f"the last good checkpoint is step {last}: move {self.step_dir(step)} (and its "
                 f"manifest) out of the way to resume from it" if last is not None else
                 "no earlier checkpoint is intact: start a new --workdir")
        raise CheckpointError(f"checkpoint step {step} in {self.directory} cannot be restored: "
                              f"{problem}; {where}")

    def restore(self, step: int, *, state_shapes, best_shapes, sharding) -> Restored:
        """Restores ``step`` onto ``sharding`` (any device count: targets are shape-only)."""
        problem = self.verify(step)
        if problem is not None:
            self._raise_corrupt(step, problem)
        ledger = self.read_ledger(step)

        def target(shapes):
            return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                               sharding=sharding), shapes)

        saved_shapes = jax.eval_shape(keys_to_data, state_shapes)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target(saved_shapes)),
                best=ocp.args.StandardRestore(target(best_shapes))))
        except Exception as e:  # orbax/tensorstore raise many types for damaged files
            self._raise_corrupt(step, f"orbax could not read it ({type(e).__name__}: {e})")
        state = data_to_keys(restored.state, state_shapes)
        return Restored(step=step, state=state, best_params=restored.best, ledger=ledger)

    def close(self) -> None:
        self._manager.close()


def manifested_steps(directory: str | Path) -> list[int]:
    """The steps under ``directory`` whose manifest was written (each a whole checkpoint), read
    from the files alone: no orbax manager is opened, nothing is created."""
    return sorted(int(p.stem) for p in (Path(directory) / MANIFESTS).glob("*.json")
                  if p.stem.isdigit())


def settings_digest(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def changed_settings(saved: dict, current: dict) -> list[str]:
    """Human-readable differences between the settings a run started with and the current."""
    out = []
    for name in sorted(set(saved) | set(current)):
        old, new = saved.get(name, "<absent>"), current.get(name, "<absent>")
        if json.dumps(old, sort_keys=True, default=str) != json.dumps(new, sort_keys=True,
                                                                      default=str):
            out.append(f"{name}: {old!r} -> {new!r}")
    return out


def to_host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def load_saved(directory: str | Path, step: Optional[int] = None) -> dict:
    """A checkpoint's items as saved (host arrays and the ledger), for tools and tests."""
    manager = ocp.CheckpointManager(Path(directory).absolute() / STEPS,
                                    options=ocp.CheckpointManagerOptions(read_only=True),
                                    item_names=("state", "best", "ledger"))
    step = manager.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no checkpoint in {directory}")
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(), best=ocp.args.StandardRestore(),
        ledger=ocp.args.JsonRestore()))
    manager.close()
    return {"step": step, "state": to_host(restored.state), "best": to_host(restored.best),
            "ledger": restored.ledger}
