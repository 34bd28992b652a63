"""Index selection on the clipped sum: GIP's noisy top-k and the random-k baseline
(GIP paper, pipelines/gip/README.md).

The flat gradient sum is split into groups of ``group_size`` coordinates (in parameter order,
zero-padded at the end). Per group a fraction k_t of coordinates is kept; the index mask is
applied AFTER the Gaussian release (post-processing), so the noise survives only on kept
coordinates and the value release keeps sensitivity C.

GIP's index release: per group, the top-m set I0 (m = round(k_t * l)) of |sum| is perturbed by
the Mallows model P(I) ~ exp(-theta * d(I, I0)) over index sets with m ones, d the Hamming
distance, sampled exactly as the paper's appendix: draw i with P(i) ~ C(m,i) C(l-m,i)
exp(-2 theta i), then flip i random ones to zero and i random zeros to one. With index
sensitivity s1 = min(2m, 2(l-m)) and theta = eps_group / s1, each group is eps_group-DP
(Theorem 1 of the paper); the G groups of one step compose to eps_step = G * eps_group.

Exactness: at a real run's budget eps_group is ~1e-7 and theta ~1e-9, below float32
resolution, and the law's tails (~1e-76 at l = 256) are below any float. Everything random
about the index release is therefore drawn on the host, from public inputs only (the step's m,
theta, a seeded Generator): the swap counts i by ``exact.MallowsDistance`` (integer proposal,
exact Bernoulli(exp(-2 theta i)) acceptance, theta a rational) and a uniformly random
permutation per group that picks which ones and zeros flip (``mallows_flip``). The device only
computes the private top-m set and applies those draws, so the implemented law is the
Mallows law exactly (tests/stages/test_select.py checks the log-probability ratio).

Accounting (how it composes, and why that is sound): eps_step = index_fraction * target_eps / T
is fixed before training (the paper's budget split: 1% of epsilon for indices, spread evenly
over steps). Each step's index release is an eps_step-DP mechanism; it enters the ledger as
``accounting.PureDpEvent(eps_step)``: with PLD through the (eps_step, 0)-DP dominating pair
(binary randomized response, which dominates every eps_step-DP mechanism; Kairouz et al. 2015),
with RDP as eps_step^2/2-zCDP; composed with the step's sampled Gaussian. No amplification by
sampling is claimed for the indices (conservative). The accountant then composes all 2T events,
which is never looser than the paper's basic composition, and sigma is calibrated so that the
composition meets the target.
"""

from __future__ import annotations

import math
from fractions import Fraction

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from dpbench import accounting, exact
from dpbench.stages.order import float_key, smallest_mask
from dpbench.stages.base import Hooks, Kind, Mask, Privacy, Stage, StageFns, register_stage

SCHEDULES = ("linear", "exponential", "constant")


def keep_fraction(step, total_steps: int, k_start: float, k_end: float, schedule: str,
                  xp=jnp):
    """k_t: linear or exponential interpolation from k_start (step 0) to k_end (last step).
    ``xp=np`` computes it on the host in float64."""
    frac = xp.minimum(step / max(total_steps - 1, 1), 1.0)
    if schedule == "linear":
        return k_start + (k_end - k_start) * frac
    if schedule == "exponential":
        return k_start * (k_end / k_start) ** frac
    return k_start + 0.0 * frac


def _to_groups(tree, group_size: int):
    flat, unravel = ravel_pytree(tree)
    groups = -(-flat.size // group_size)
    padded = jnp.pad(flat, (0, groups * group_size - flat.size))
    return padded.reshape(groups, group_size), flat.size, unravel


def _from_groups(groups, size: int, unravel):
    return unravel(groups.reshape(-1)[:size])


def top_m_mask(values, m):
    """Per row, 1.0 on the m entries of largest |value| (m may be traced; ties by position),
    else 0.0: integer keys and one value sort (smallest_mask), no argsort."""
    return smallest_mask(~float_key(jnp.abs(values)), m).astype(values.dtype)


def index_theta(eps_group: Fraction, m: int, group_size: int) -> Fraction:
    """theta = eps_group / s1 with index sensitivity s1 = min(2m, 2(l - m)) (Theorem 1), as an
    exact rational (0 when s1 = 0: then only one index set exists and nothing is revealed)."""
    sensitivity = min(2 * m, 2 * (group_size - m))
    return Fraction(eps_group) / sensitivity if sensitivity else Fraction(0)


def group_index_law(eps_step, groups: int, m: int, group_size: int) -> exact.MallowsDistance:
    """The exact swap-count law of ONE group's index release in a step whose index release
    spends ``eps_step`` (what the ledger charges per step): the G groups of a step compose to
    eps_step, so each group is eps_group = eps_step / G -DP, with Mallows theta = eps_group / s1
    (``index_theta``), all in exact rational arithmetic."""
    return exact.MallowsDistance(group_size, m, index_theta(Fraction(eps_step) / groups, m,
                                                            group_size))


def mallows_flip(reference, distance, priority):
    """Per row, flips ``distance[g]`` ones of the 0/1 ``reference`` to zero and as many zeros to
    one: those of smallest ``priority`` within each class. With ``priority`` a uniformly random
    permutation of the row (drawn on the host, independent of the data), the flipped ones and
    zeros are uniform subsets of their class, exactly: the Mallows model's second stage."""
    group_size = reference.shape[-1]
    ones = reference > 0
    outside = jnp.int32(group_size)  # above every priority: never among the smallest
    priority = priority.astype(jnp.int32)
    off = ones & smallest_mask(jnp.where(ones, priority, outside), distance)
    on = ~ones & smallest_mask(jnp.where(ones, outside, priority), distance)
    return jnp.where(off | on, 1.0 - reference, reference).astype(reference.dtype)


def _ones_mask(params, key):
    del key
    return {"mask": jax.tree.map(jnp.ones_like, params)}


def _validate(name, group_size, k_start, k_end, schedule):
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"{name}.group_size must be an integer >= 2, got {group_size!r}")
    if not (0 < k_end <= 1 and 0 < k_start <= 1):
        raise ValueError(f"{name}.k_start and k_end must lie in (0, 1], got "
                         f"{k_start!r}, {k_end!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"{name}.schedule must be one of {SCHEDULES}, got {schedule!r}")


@register_stage("select.gip")
def gip(group_size: int = 256, k_start: float = 1.0, k_end: float = 0.1,
        schedule: str = "linear", index_fraction: float = 0.01) -> Stage:
    """GIP: noisy top-k index selection per group of the clipped sum (an accounted mechanism).

    Guarantee: each step's index release is exactly eps_step-DP (pure), eps_step =
    index_fraction * target epsilon / T: per group the Mallows law is sampled on the host
    with exact integer and rational arithmetic (``exact.MallowsDistance``, a uniform random
    permutation for the flips), so no float rounding changes the output probabilities.
    """
    _validate("select.gip", group_size, k_start, k_end, schedule)
    if not 0 < index_fraction < 1:
        raise ValueError(f"select.gip.index_fraction must lie in (0, 1), got {index_fraction!r}")
    options = dict(group_size=group_size, k_start=k_start, k_end=k_end, schedule=schedule,
                   index_fraction=index_fraction)

    def epsilon_per_step(facts) -> float:
        # the run's target epsilon: a needed fact, so the compiler refuses a run with a given
        # sigma (train.noise_multiplier) before this is read
        return index_fraction * facts.target_epsilon / facts.total_steps

    def make(facts) -> StageFns:
        total = facts.total_steps
        size = sum(math.prod(x.shape) for x in jax.tree.leaves(facts.param_shapes))
        groups = -(-size // group_size)
        eps_step = epsilon_per_step(facts)
        laws = {}  # m -> exact distance sampler (m takes at most group_size + 1 values)

        def host_inputs(step, rng):
            k = float(keep_fraction(step, total, k_start, k_end, schedule, xp=np))
            m = int(np.round(k * group_size))
            if m not in laws:
                laws[m] = group_index_law(eps_step, groups, m, group_size)
            distance = np.array([laws[m].sample(rng) for _ in range(groups)], np.int32)
            priority = rng.permuted(np.tile(np.arange(group_size, dtype=np.int32),
                                            (groups, 1)), axis=1)
            return {"m": np.int32(m), "distance": distance, "priority": priority}

        def apply(value, state, ctx):
            grouped, n, unravel = _to_groups(value, group_size)
            drawn = ctx.host_inputs
            reference = top_m_mask(grouped, drawn["m"])  # private: the exact top-m per group
            released = mallows_flip(reference, drawn["distance"], drawn["priority"])
            return value, {"mask": _from_groups(released, n, unravel)}

        mechanism = (f"Mallows index release of the top-k set of each of {groups} groups of "
                     f"{group_size} coordinates (each group {eps_step / groups:.4g}-DP with "
                     "theta = eps_group / min(2m, 2(l - m)), the groups of a step by basic "
                     "composition; sampled exactly on the host)")
        return StageFns(apply=apply, init=_ones_mask, hooks=Hooks(host_inputs=host_inputs),
                        derived=dict(
            eps_index_per_step=eps_step, groups=groups, eps_index_per_group=eps_step / groups,
            mechanism=mechanism))

    return Stage(name="select.gip", kind_in=Kind.AGGREGATE, kind_out=Kind.AGGREGATE,
                 make=make, needs={"target_epsilon", "total_steps", "param_shapes"},
                 privacy=Privacy(
                     lipschitz=1.0,
                     cost=lambda facts: accounting.PureDpEvent(epsilon_per_step(facts)),
                     public_mask=frozenset({Mask.RELEASED})),
                 options=options)


@register_stage("select.random_k")
def random_k(group_size: int = 256, k_start: float = 1.0, k_end: float = 0.5,
             schedule: str = "exponential") -> Stage:
    """Random-k: per group keep a uniformly random k_t fraction; ignores private values."""
    _validate("select.random_k", group_size, k_start, k_end, schedule)
    options = dict(group_size=group_size, k_start=k_start, k_end=k_end, schedule=schedule)

    def make(facts) -> StageFns:
        total = facts.total_steps

        def init(params, key):
            return {"mask": jax.tree.map(jnp.ones_like, params), "key": key}

        def apply(value, state, ctx):
            grouped, n, unravel = _to_groups(value, group_size)
            k = keep_fraction(ctx.step, total, k_start, k_end, schedule)
            scores = jax.random.bits(jax.random.fold_in(state["key"], ctx.step),
                                     grouped.shape, jnp.uint32)
            m = jnp.round(k * group_size).astype(jnp.int32)
            mask = smallest_mask(scores, m).astype(grouped.dtype)  # no private value
            return value, {"mask": _from_groups(mask, n, unravel), "key": state["key"]}

        return StageFns(apply=apply, init=init)

    return Stage(name="select.random_k", kind_in=Kind.AGGREGATE, kind_out=Kind.AGGREGATE,
                 make=make, needs={"total_steps"},
                 # its output ignores the private values: it costs nothing
                 privacy=Privacy(lipschitz=1.0, cost=lambda facts: dp_accounting.NoOpDpEvent(),
                                 public_mask=frozenset({Mask.RELEASED})),
                 options=options)
