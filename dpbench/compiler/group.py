"""A group of trials as one step: each trial's compiled step traced, its numbers lifted out.

Two trials of one method on one model at one batch size compile to the same program up to its
numbers: the learning rate, the clip bound, the calibrated noise stddev, EMA decay, a method's
rates and thresholds all enter a traced step as scalar literals (or constant arrays). So a
group is found, not declared: each trial's step is traced to a jaxpr, the jaxprs are compared
with every number blanked out (:func:`signature`), and the trials whose jaxprs are equal form
a group. Every number that differs between them becomes a KNOB: an input of the group's step
holding each trial's own value, read where that trial's own program had the constant. The
group's step evaluates the shared program once, vmapped over the trial axis.

Why the jaxpr and not a list of named knobs: a stage written by a user needs no change, and no
knob can be forgotten. A number one trial's program holds is either equal in every trial (then
it is that number) or lifted (then each trial reads its own); a difference in anything else
(a shape, a primitive, a parameter such as top-k's k) makes the trials different groups.

The group step also keeps a trial past its planned steps where it is: its state is not
updated, its step counter does not move, and (since the host loop charges only steps a
trial took) it spends no privacy.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax import lax


class NotGroupable(ValueError):
    """Trials whose steps differ in more than their numbers (or a number in a place the group
    step cannot lift); the message says where."""


class Traced(NamedTuple):
    """One trial's step as data: its jaxpr, the trees it takes and gives, its signature (the
    jaxpr with every number blanked) and its numbers, by where they sit."""

    jaxpr: Any            # jax.extend.core.ClosedJaxpr
    in_tree: Any
    out_tree: Any
    signature: tuple
    numbers: dict         # path -> np.ndarray: every literal and constant of the program


def _sub_jaxprs(value) -> list:
    items = value if isinstance(value, (tuple, list)) else [value]
    return [v for v in items if isinstance(v, (jex.core.ClosedJaxpr, jex.core.Jaxpr))]


def _open(j):
    """(jaxpr, consts) of a ClosedJaxpr or an open Jaxpr."""
    if isinstance(j, jex.core.ClosedJaxpr):
        return j.jaxpr, list(j.consts)
    return j, []


def _number(value) -> np.ndarray:
    return np.asarray(value)


def _walk(jaxpr, consts, path: tuple, numbers: dict) -> tuple:
    """The signature of ``jaxpr`` (every number blanked, each var by its order of appearance)
    and, into ``numbers``, each literal and constant by its path."""
    ids: dict = {}

    def name(var) -> int:
        return ids.setdefault(var, len(ids))

    head = []
    for i, (var, const) in enumerate(zip(jaxpr.constvars, consts)):
        numbers[path + ("const", i)] = _number(const)
        head.append(("const", name(var), str(var.aval)))
    head += [("in", name(v), str(v.aval)) for v in jaxpr.invars]
    body = []
    for e, eqn in enumerate(jaxpr.eqns):
        ins = []
        for i, var in enumerate(eqn.invars):
            if isinstance(var, jex.core.Literal):
                numbers[path + (e, "in", i)] = _number(var.val)
                ins.append(("literal", str(var.aval)))
            else:
                ins.append(name(var))
        params = []
        for key in sorted(eqn.params):
            subs = _sub_jaxprs(eqn.params[key])
            if subs:
                params.append((key, tuple(_walk(*_open(s), path + (e, key, b), numbers)
                                          for b, s in enumerate(subs))))
            else:
                params.append((key, repr(eqn.params[key])))
        outs = tuple((name(v), str(v.aval)) for v in eqn.outvars)
        body.append((eqn.primitive.name, tuple(ins), outs, tuple(params)))
    tail = []
    for i, var in enumerate(jaxpr.outvars):
        if isinstance(var, jex.core.Literal):
            numbers[path + ("out", i)] = _number(var.val)
            tail.append(("literal", str(var.aval)))
        else:
            tail.append(name(var))
    return tuple(head), tuple(body), tuple(tail)


def trace(fn: Callable, *args) -> Traced:
    """``fn(*args)`` traced (nothing runs): its jaxpr, signature and numbers."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    return traced_of(closed, jax.tree.structure(args), out_shape)


def traced_of(closed, in_tree, out_shape) -> Traced:
    """A program already traced (its ClosedJaxpr, the tree of its arguments, its output
    shapes) as a :class:`Traced`: its signature and numbers."""
    numbers: dict = {}
    signature = _walk(closed.jaxpr, closed.consts, (), numbers)
    return Traced(jaxpr=closed, in_tree=in_tree, out_tree=jax.tree.structure(out_shape),
                  signature=signature, numbers=numbers)


def _first_difference(a, b, where="step") -> str:
    """Where two signatures first differ, in words (for NotGroupable's message)."""
    if type(a) is not type(b) or not isinstance(a, tuple):
        return f"{where}: {str(a)[:160]} vs {str(b)[:160]}"
    if len(a) != len(b):
        return f"{where}: {len(a)} vs {len(b)} items"
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            label = x[0] if isinstance(x, tuple) and x and isinstance(x[0], str) else i
            return _first_difference(x, y, f"{where}/{label}")
    return where


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def knob_paths(traced: Sequence[Traced]) -> list:
    """The paths of the numbers that differ between the trials: the group's knobs. Raises
    NotGroupable, saying where, when the programs differ in anything else."""
    first = traced[0]
    for t, other in enumerate(traced[1:], start=1):
        if other.signature != first.signature:
            raise NotGroupable(f"trial {t}'s step differs from trial 0's in more than its "
                               f"numbers: {_first_difference(first.signature, other.signature)}")
        if (other.in_tree, other.out_tree) != (first.in_tree, first.out_tree):
            raise NotGroupable(f"trial {t}'s step takes or gives other trees than trial 0's")
    return [path for path, value in first.numbers.items()
            if not all(_equal(value, other.numbers[path]) for other in traced[1:])]


class _Program:
    """The shared program evaluated with the knobs' values in their places."""

    def __init__(self, closed, knobs: dict):
        self.closed = closed
        self.knobs = knobs  # path -> this trial's value (a tracer under vmap)
        # the equations with a knob inside one of their own programs (a path's string other
        # than in/out/const names the parameter that holds that program)
        self.nested = {path[:n] for path in knobs for n, part in enumerate(path)
                       if isinstance(part, str) and part not in ("in", "out", "const")}

    def run(self, args: list) -> list:
        return self._eval(self.closed.jaxpr, list(self.closed.consts), args, ())

    def _eval(self, jaxpr, consts, args, path):
        env = {}

        def read(var, key):
            if isinstance(var, jex.core.Literal):
                return self.knobs.get(path + key, var.val)
            return env[var]

        for i, (var, const) in enumerate(zip(jaxpr.constvars, consts)):
            env[var] = self.knobs.get(path + ("const", i), const)
        env.update(zip(jaxpr.invars, args))
        for e, eqn in enumerate(jaxpr.eqns):
            values = [read(v, (e, "in", i)) for i, v in enumerate(eqn.invars)]
            if path + (e,) in self.nested:  # a knob inside this equation's own programs
                outs = self._higher_order(eqn, values, path + (e,))
            else:
                with eqn.ctx.manager:
                    outs = eqn.primitive.bind(*values,
                                              **eqn.primitive.get_bind_params(eqn.params))
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for var, value in zip(eqn.outvars, outs):
                if not isinstance(var, jex.core.DropVar):
                    env[var] = value
        return [read(v, ("out", i)) for i, v in enumerate(jaxpr.outvars)]

    def _sub(self, closed, path):
        jaxpr, consts = _open(closed)
        return lambda *args: self._eval(jaxpr, consts, list(args), path)

    def _higher_order(self, eqn, values, path):
        """The control-flow primitives a step is made of, rebuilt around their programs with
        the knobs read in place (lax traces the closures; each knob enters as a constant)."""
        name, p = eqn.primitive.name, eqn.params
        if name in ("jit", "pjit", "closed_call", "core_call", "remat", "checkpoint"):
            key = "jaxpr" if "jaxpr" in p else "call_jaxpr"
            return self._sub(p[key], path + (key, 0))(*values)
        if name == "scan":
            closed = p["jaxpr"]
            body = self._sub(closed, path + ("jaxpr", 0))
            nc, ncarry = _scan_split(eqn, _open(closed)[0])
            consts, init, xs = values[:nc], values[nc:nc + ncarry], values[nc + ncarry:]

            def step(carry, x):
                outs = body(*consts, *carry, *x)
                return outs[:ncarry], outs[ncarry:]

            carry, ys = lax.scan(step, init, xs, length=p["length"],
                                 reverse=p.get("reverse", False), unroll=p.get("unroll", 1))
            return list(carry) + list(ys)
        if name == "while":
            # the split from the programs' own arities (the parameters' names move between
            # JAX versions): cond takes (cond consts, carry), body (body consts, carry)
            cond_jaxpr, body_jaxpr = _open(p["cond_jaxpr"])[0], _open(p["body_jaxpr"])[0]
            ncarry = len(eqn.outvars)
            nc, nb = len(cond_jaxpr.invars) - ncarry, len(body_jaxpr.invars) - ncarry
            cond = self._sub(p["cond_jaxpr"], path + ("cond_jaxpr", 0))
            body = self._sub(p["body_jaxpr"], path + ("body_jaxpr", 0))
            cond_consts, body_consts, init = values[:nc], values[nc:nc + nb], values[nc + nb:]
            return list(lax.while_loop(lambda c: cond(*cond_consts, *c)[0],
                                       lambda c: body(*body_consts, *c), init))
        if name == "cond":
            branches = [self._sub(b, path + ("branches", i)) for i, b in enumerate(p["branches"])]
            return list(lax.switch(values[0], branches, *values[1:]))
        raise NotGroupable(f"a number that differs between trials sits inside a "
                           f"'{name}' primitive, which the group step cannot rebuild")


BATCHINGS = ("vmap", "map")


def default_batching() -> str:
    """'vmap' (the trials' arithmetic batched: one wide program) on an accelerator; 'map' (one
    program that loops over the trials, each trial's arithmetic exactly its solo step's) on a
    CPU. Why not vmap on a CPU: XLA's CPU runtime (jaxlib 0.10.2) deadlocks running GEP's
    vmapped clipped sum (no thread busy, forever; XLA_FLAGS=--xla_cpu_use_thunk_runtime=false
    runs it), and a CPU's cores are already filled by one trial's batch."""
    return "map" if jax.default_backend() == "cpu" else "vmap"


def _trailing_stacked(outer, inner, length: int) -> int:
    """How many of the last ``outer`` vars are the matching ``inner`` ones with the scan's
    length in front (xs of ys); a const or carry has its inner shape, so the count stops there."""
    count = 0
    for o, i in zip(reversed(outer), reversed(inner)):
        if tuple(o.aval.shape) != (length,) + tuple(i.aval.shape):
            break
        count += 1
    return count


def _scan_split(eqn, body) -> tuple:
    """(number of consts, number of carries) of a scan equation from its programs' arities and
    shapes alone (the parameters that say so are renamed or gone between JAX versions): its
    inputs are (consts, carry, xs) and its outputs (carry, ys), each x and y the body's with
    the scan's length in front."""
    length = eqn.params["length"]
    if len(body.invars) != len(eqn.invars) or len(body.outvars) != len(eqn.outvars):
        raise NotGroupable("a number that differs between trials sits inside a scan whose "
                           "program takes other inputs than the scan (a JAX version this "
                           "group step does not know)")
    num_carry = len(eqn.outvars) - _trailing_stacked(eqn.outvars, body.outvars, length)
    num_consts = len(eqn.invars) - num_carry - _trailing_stacked(eqn.invars, body.invars,
                                                                 length)
    return num_consts, num_carry


class GroupStep(NamedTuple):
    """A group of T trials' steps as one function. ``knobs`` holds each knob's T values
    (stacked on a leading trial axis); ``step(knobs, ends, states, batches)`` takes every
    trial's state and batch stacked the same way and ``ends`` (int32[T]) the step each trial
    stops at, and returns the stacked new states and metrics. A trial whose state's step has
    reached its end is returned unchanged (its metrics are then not meaningful)."""

    step: Callable
    knobs: dict           # path -> np.ndarray [T, ...]
    size: int
    batching: str


def group_step(traced: Sequence[Traced], step_of: Callable = lambda state: state.step,
               batching: str | None = None) -> GroupStep:
    """The group step of the trials whose steps are ``traced`` (each ``trace(step, state,
    batch)``); ``step_of(state)`` reads a state's step counter; ``batching`` is 'vmap' or
    'map' (default: :func:`default_batching`). Raises NotGroupable."""
    batching = default_batching() if batching is None else batching
    if batching not in BATCHINGS:
        raise ValueError(f"batching must be one of {BATCHINGS}, got {batching!r}")
    paths = knob_paths(traced)
    knobs = {path: np.stack([t.numbers[path] for t in traced]) for path in paths}
    first = traced[0]

    def one(knob_values, end, state, batch):
        args = jax.tree.leaves((state, batch))
        outs = _Program(first.jaxpr, knob_values).run(args)
        new_state, metrics = jax.tree.unflatten(first.out_tree, outs)
        active = step_of(state) < end
        kept = jax.tree.map(lambda new, old: jnp.where(active, new, old), new_state, state)
        return kept, metrics

    if batching == "vmap":
        step = jax.vmap(one)
    else:
        def step(knob_values, ends, states, batches):
            return lax.map(lambda args: one(*args), (knob_values, ends, states, batches))
    return GroupStep(step=step, knobs=knobs, size=len(traced), batching=batching)
