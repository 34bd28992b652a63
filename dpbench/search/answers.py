"""The search's slow privacy answers, remembered on disk: a board composes the same runs'
events at every build (a method's K trials and retrains, a dataset's hundreds of runs: 1-3 s of
PLD arithmetic each; the secret search's RDP epsilon), and each answer is a pure function of its
inputs.

An entry is keyed by everything the answer depends on: the question (the event's JSON, delta,
discretization, the search's parameters), dpbench's own code that computes it (hashes of
accounting.py, whose reductions every answer goes through, and of search/tuning.py), the
versions of the packages that compute it (dp-accounting, numpy, scipy) and this host's
numerics (CPU ISA, numpy's SIMD dispatch, the environment knobs that change them: another
host's float may differ in its last bits, so it is never read here). The file stores the whole
key and is used only when the stored key equals the asked one; anything else (missing,
unreadable, another key under the same hash) is recomputed and rewritten whole (an atomic
rename). Only answers that took at least ``SLOW_S`` are written (a quick one costs less than
its file).
``DPBENCH_ACCOUNTING_CACHE=0`` turns the disk off (every answer computed).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable

from dpbench import numerics, records

SLOW_S = 0.05  # an answer that took less is not written
FORMAT_VERSION = 1  # bump when an entry's layout or meaning changes: old entries then miss
DISABLE_ENV = "DPBENCH_ACCOUNTING_CACHE"
# the code that computes every answer: dpbench's reductions and the search's compositions
SOURCES = (Path(__file__).parents[1] / "accounting.py", Path(__file__).with_name("tuning.py"))


def folder() -> Path:
    return records.cache_root() / "accounting"


@functools.lru_cache(maxsize=1)
def host_key() -> dict:
    """What besides the question decides an answer's bits on this host (no JAX: the board's
    process never imports it)."""
    return {"format": FORMAT_VERSION,
            "versions": numerics.versions(("dp-accounting", "numpy", "scipy")),
            "numerics": numerics.host_numerics_without_jax()}


@functools.lru_cache(maxsize=None)
def source_hash(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _path(full_key: str) -> Path:
    return folder() / f"{hashlib.sha256(full_key.encode()).hexdigest()}.json"


def remembered(question, compute: Callable[[], float]) -> float:
    """``compute()``, or the answer a previous process stored for the same ``question`` (any
    JSON-able value naming every input) on this host, with these package versions and the same
    ``SOURCES``."""
    if os.environ.get(DISABLE_ENV) == "0":
        return compute()
    code = {path.name: source_hash(path) for path in SOURCES}
    full_key = json.dumps({"question": question, "code": code, "host": host_key()},
                          sort_keys=True, default=repr)
    path = _path(full_key)
    try:
        stored = json.loads(path.read_text())
        if stored["key"] == full_key:
            return float(stored["answer"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # missing or not valid: computed below
    began = time.perf_counter()
    answer = float(compute())
    if time.perf_counter() - began >= SLOW_S:
        try:
            # json writes a float as its shortest repr, which reads back to the same float
            records.atomic_write_text(path, json.dumps({"key": full_key, "answer": answer}))
        except OSError:
            pass  # a read-only cache folder costs time, never an answer
    return answer
