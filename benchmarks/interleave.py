"""Lock-step timing: several configurations in ONE process, their timed steps interleaved one
at a time, so a ratio of two configurations' step times is measured on the same minutes of the
machine (a noisy minute slows both) instead of on different ones.

Each configuration (a "member") is an ordinary benchmark worker function run in its own thread;
its timing loop (``timed_loop``) runs its warm-up steps at once and then takes one timed step per
turn the driver gives it. Only one member runs at any time: the others wait on their gate. The
members are built one after another (each reaches its first turn, i.e. is compiled and warmed
up, before the next one is built), so a builder that reads global configuration (gin) sees its
own. A member that compiles during a timed turn is flagged (``recompiles``): its step changed
under it, and its time would include a compilation.

A turn is two steps on the same inputs, the first untimed: measured without it (Fashion-MNIST,
B=256, every configuration in one run), a JAX step that followed a torch step took ~25% longer
than one that followed a JAX step, and the torch steps ~2x longer than alone; the ratios then
depended on the order of the members. Between two turns the driver also sleeps ``pause_s``
(untimed), so thread pools that spin after their work (OpenMP's in torch, Eigen's in XLA) are
asleep before the next member starts.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Optional, Sequence

import numpy as np

_local = threading.local()
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_listener_lock = threading.Lock()
_listener_installed = False


@dataclasses.dataclass
class _Gate:
    go: threading.Semaphore = dataclasses.field(default_factory=lambda: threading.Semaphore(0))
    done: threading.Semaphore = dataclasses.field(default_factory=lambda: threading.Semaphore(0))
    times: list = dataclasses.field(default_factory=list)
    in_turn: bool = False
    recompiles: int = 0


def _on_compile(event: str, duration_secs: float, **kwargs) -> None:
    del duration_secs, kwargs
    gate = getattr(_local, "gate", None)
    if event == _COMPILE_EVENT and gate is not None and gate.in_turn:
        gate.recompiles += 1


def _install_compile_listener() -> None:
    global _listener_installed
    with _listener_lock:
        if not _listener_installed:
            import jax.monitoring
            jax.monitoring.register_event_duration_secs_listener(_on_compile)
            _listener_installed = True


def summary(times: Sequence[float]) -> dict:
    ms = np.asarray(times, np.float64) * 1e3
    return dict(ms_median=float(np.median(ms)), ms_min=float(ms.min()), ms_max=float(ms.max()),
                timed_steps=int(ms.size))


def timed_loop(num_steps: int, warmup: int, prepare, run_step) -> dict:
    """prepare(t) builds step t's inputs (untimed); run_step(inputs) runs and blocks (timed).

    Alone: warm-up then the timed steps back to back. Inside ``run_interleaved``: warm-up, then
    per turn one untimed and one timed step on the same inputs."""
    gate: Optional[_Gate] = getattr(_local, "gate", None)
    times, first = [], None
    for t in range(warmup + num_steps):
        if gate is not None and t >= warmup:
            gate.done.release()      # warmed up / previous turn over
            gate.go.acquire()        # wait for this step's turn
            gate.in_turn = True
            # One untimed step on the same inputs first: the timed step then starts from this
            # configuration's own caches and thread pools, not from the previous member's.
            run_step(prepare(t))
        inputs = prepare(t)
        start = time.perf_counter()
        run_step(inputs)
        elapsed = time.perf_counter() - start
        del inputs
        if gate is not None:
            gate.in_turn = False
        if t == 0:
            first = elapsed
        if t >= warmup:
            times.append(elapsed)
    if gate is not None:
        gate.times = list(times)
    return dict(summary(times), first_step_s=first)


@dataclasses.dataclass
class _Member:
    label: str
    run: Callable[[], dict]
    gate: _Gate = dataclasses.field(default_factory=_Gate)
    thread: Optional[threading.Thread] = None
    result: Optional[dict] = None
    error: Optional[str] = None
    finished: bool = False

    def main(self) -> None:
        _local.gate = self.gate
        try:
            self.result = self.run()
        except Exception as e:  # noqa: BLE001 (a failed member is reported, never a crash)
            self.error = f"{type(e).__name__}: {e}".strip()
        finally:
            self.finished = True      # before the release: the driver reads it after acquiring
            self.gate.done.release()  # never leave the driver waiting


def _turn(member: _Member) -> None:
    member.gate.go.release()
    member.gate.done.acquire()


def run_interleaved(members: Sequence[tuple], steps: int, blocks: int = 3,
                    pause_s: float = 0.02) -> list:
    """members: (label, fn) pairs; fn() runs one benchmark worker whose timing loop is
    ``timed_loop`` with ``steps`` timed steps. Step t gives every ready member one turn, starting
    from member t mod n (so no member always follows the same one). Returns per member: ok,
    error, the worker's own result, its step times (ms), their median, the medians of ``blocks``
    consecutive blocks of steps (the spread's units), and compilations during timed turns."""
    _install_compile_listener()
    built = []
    for label, fn in members:  # one at a time: built, compiled and warmed up before the next
        m = _Member(label, fn)
        m.thread = threading.Thread(target=m.main, name=f"bench:{label}", daemon=True)
        m.thread.start()
        m.gate.done.acquire()   # ready for its first turn, or finished (a failure)
        built.append(m)
    for t in range(steps):
        ready = [m for m in built if not m.finished]
        if not ready:
            break
        k = t % len(ready)
        for m in ready[k:] + ready[:k]:
            _turn(m)
            time.sleep(pause_s)
    out = []
    for m in built:
        m.thread.join()
        ms = np.asarray(m.gate.times, np.float64) * 1e3
        ok = m.error is None and m.result is not None and ms.size == steps
        error = m.error or (None if ok else f"{ms.size} of {steps} timed steps ran")
        parts = np.array_split(ms, blocks) if ok else []
        out.append(dict(label=m.label, ok=ok, error=error, result=m.result,
                        times_ms=ms.tolist(), ms_median=float(np.median(ms)) if ok else None,
                        block_medians=[float(np.median(p)) for p in parts],
                        recompiles=m.gate.recompiles))
    return out
