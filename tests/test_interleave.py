"""benchmarks/interleave.py: configurations timed in one process, one step each in turn."""

import threading

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import interleave


class _Recorder:
    """Shared log of what every fake member did, and how many ran a step at once."""

    def __init__(self):
        self.log, self.running, self.max_running = [], 0, 0
        self.lock = threading.Lock()

    def member(self, name: str, steps: int, warmup: int, fail_at=None):
        def run():
            self.log.append(("build", name))

            def run_step(t):
                with self.lock:
                    self.running += 1
                    self.max_running = max(self.max_running, self.running)
                if fail_at is not None and t == fail_at:
                    self.running -= 1
                    raise RuntimeError(f"{name} broke at step {t}")
                self.log.append(("step", name, t))
                with self.lock:
                    self.running -= 1

            timing = interleave.timed_loop(steps, warmup, lambda t: t, run_step)
            return dict(timing, name=name)
        return run


def test_members_are_built_in_order_then_take_one_step_each_in_turn():
    rec = _Recorder()
    steps, warmup = 5, 2
    out = interleave.run_interleaved(
        [(n, rec.member(n, steps, warmup)) for n in ("a", "b", "c")], steps, blocks=2,
        pause_s=0.0)
    assert [m["label"] for m in out] == ["a", "b", "c"]
    assert all(m["ok"] and m["error"] is None for m in out), out
    assert rec.max_running == 1  # never two members at once
    # each member is built and warmed up (its warm-up steps) before the next one is built
    builds = [i for i, e in enumerate(rec.log) if e[0] == "build"]
    for k, name in enumerate("abc"):
        warm = [i for i, e in enumerate(rec.log) if e[:2] == ("step", name) and e[2] < warmup]
        assert len(warm) == warmup and builds[k] < min(warm)
        if k + 1 < 3:
            assert max(warm) < builds[k + 1]
    # after the warm-up, a turn is two steps on the same inputs (untimed, then timed); step t
    # visits every member once, starting from member t mod 3
    turns = [e[1:] for e in rec.log if e[0] == "step" and e[2] >= warmup]
    assert turns[0::2] == turns[1::2]
    timed = [name for name, _ in turns[1::2]]
    rounds = [timed[3 * t:3 * t + 3] for t in range(steps)]
    for t, order in enumerate(rounds):
        assert sorted(order) == ["a", "b", "c"]
        assert order[0] == "abc"[t % 3]
    for m in out:
        assert len(m["times_ms"]) == steps and len(m["block_medians"]) == 2
        assert m["result"]["timed_steps"] == steps and m["recompiles"] == 0


def test_a_failing_member_is_reported_and_the_others_finish():
    rec = _Recorder()

    def broken_build():
        raise ValueError("no such pipeline")

    out = interleave.run_interleaved(
        [("a", rec.member("a", 4, 1)), ("broken", broken_build),
         ("mid", rec.member("mid", 4, 1, fail_at=3)), ("c", rec.member("c", 4, 1))],
        4, blocks=2, pause_s=0.0)
    by = {m["label"]: m for m in out}
    assert by["a"]["ok"] and by["c"]["ok"]
    assert not by["broken"]["ok"] and "ValueError: no such pipeline" in by["broken"]["error"]
    assert not by["mid"]["ok"] and "mid broke at step 3" in by["mid"]["error"]
    assert by["mid"]["ms_median"] is None and by["mid"]["block_medians"] == []


def test_a_member_that_compiles_during_a_timed_step_is_flagged():
    def member(change_shape: bool):
        def run():
            f = jax.jit(lambda x: jnp.sum(x * 2.0))

            def prepare(t):
                # the 4th step (t = 3, timed) gets a new shape: a compilation inside its turn
                return np.ones(5 if (change_shape and t == 3) else 4, np.float32)

            return interleave.timed_loop(3, 1, prepare, lambda x: f(x).block_until_ready())
        return run

    out = interleave.run_interleaved([("same", member(False)), ("changes", member(True))], 3,
                                     blocks=1, pause_s=0.0)
    by = {m["label"]: m for m in out}
    assert by["same"]["recompiles"] == 0
    assert by["changes"]["recompiles"] >= 1
    # the benchmark gives a flagged member no time, hence no ratio
    from benchmarks import report as reporting
    rows = reporting.interleaved_rows([dict(spec=dict(kind="interleaved"), result=dict(
        ok=True, members=[dict(m, spec=dict(label=m["label"])) for m in out]))])
    assert [r["result"]["ok"] for r in rows] == [True, False]


def test_alone_the_loop_times_its_steps_back_to_back():
    calls = []
    timing = interleave.timed_loop(3, 2, lambda t: t, calls.append)
    assert calls == [0, 1, 2, 3, 4]
    assert timing["timed_steps"] == 3 and timing["first_step_s"] >= 0
