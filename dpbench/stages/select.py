"""Index selection on the clipped sum: GIP's noisy top-k and the random-k baseline
(GIP paper, docs/methods/gip.md).

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

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
from jax.scipy.special import gammaln

from dpbench import accounting
from dpbench.stages.base import Kind, Stage, StageInfo, register_stage, requires_build

SCHEDULES = ("linear", "exponential", "constant")


def keep_fraction(step, total_steps: int, k_start: float, k_end: float, schedule: str):
    """k_t: linear or exponential interpolation from k_start (step 0) to k_end (last step)."""
    frac = jnp.minimum(step / max(total_steps - 1, 1), 1.0)
    if schedule == "linear":
        return k_start + (k_end - k_start) * frac
    if schedule == "exponential":
        return k_start * (k_end / k_start) ** frac
    return jnp.asarray(k_start, jnp.float32) + 0.0 * frac


def _to_groups(tree, group_size: int):
    flat, unravel = ravel_pytree(tree)
    groups = -(-flat.size // group_size)
    padded = jnp.pad(flat, (0, groups * group_size - flat.size))
    return padded.reshape(groups, group_size), flat.size, unravel


def _from_groups(groups, size: int, unravel):
    return unravel(groups.reshape(-1)[:size])


def row_ranks(scores):
    """Per row, the rank (0 = smallest; ties by position) of each entry: argsort's inverse
    permutation, by one sort and a scatter (a second argsort doubled GIP's step overhead)."""
    order = jnp.argsort(scores, axis=-1)  # stable
    positions = jnp.broadcast_to(jnp.arange(scores.shape[-1], dtype=order.dtype), order.shape)
    return jnp.put_along_axis(jnp.zeros_like(order), order, positions, axis=-1, inplace=False)


def _rank_within(scores, selected):
    """Rank (0 = smallest score) of each selected entry among the selected ones of its row."""
    return row_ranks(jnp.where(selected, scores, jnp.inf))


def top_m_mask(values, m):
    """Per row, 1.0 on the m entries of largest |value| (m may be traced), else 0.0."""
    return (row_ranks(-jnp.abs(values)) < m).astype(values.dtype)


def mallows_distance_logits(group_size: int, m, theta):
    """log P(i) up to a constant for i = 0..group_size, -inf where i > min(m, l - m)."""
    i = jnp.arange(group_size + 1, dtype=jnp.float32)
    m = jnp.asarray(m, jnp.float32)

    def log_comb(n, r):
        return gammaln(n + 1) - gammaln(r + 1) - gammaln(jnp.maximum(n - r, 0) + 1)

    logits = log_comb(m, i) + log_comb(group_size - m, i) - 2.0 * theta * i
    return jnp.where(i <= jnp.minimum(m, group_size - m), logits, -jnp.inf)


def mallows_perturb(key, reference, m, theta):
    """Samples I ~ Mallows(theta) around each row of the 0/1 ``reference`` (m ones per row)."""
    groups, group_size = reference.shape
    dist_key, ones_key, zeros_key = jax.random.split(key, 3)
    logits = mallows_distance_logits(group_size, m, theta)
    distance = jax.random.categorical(dist_key, logits, shape=(groups,))[:, None]
    ones = reference > 0
    flip_off = ones & (_rank_within(jax.random.uniform(ones_key, reference.shape), ones)
                       < distance)
    flip_on = ~ones & (_rank_within(jax.random.uniform(zeros_key, reference.shape), ~ones)
                       < distance)
    return jnp.where(flip_off, 0.0, jnp.where(flip_on, 1.0, reference)).astype(reference.dtype)


def index_theta(eps_group: float, m, group_size: int):
    """theta = eps_group / s1 with index sensitivity s1 = min(2m, 2(l - m)) (Theorem 1)."""
    sensitivity = jnp.minimum(2 * m, 2 * (group_size - m))
    return eps_group / jnp.maximum(sensitivity, 1.0)


def _mask_after_release(released, state, ctx):
    del ctx
    return jax.tree.map(jnp.multiply, released, state["mask"])


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
    """GIP: noisy top-k index selection per group of the clipped sum (an accounted mechanism)."""
    _validate("select.gip", group_size, k_start, k_end, schedule)
    if not 0 < index_fraction < 1:
        raise ValueError(f"select.gip.index_fraction must lie in (0, 1), got {index_fraction!r}")
    options = dict(group_size=group_size, k_start=k_start, k_end=k_end, schedule=schedule,
                   index_fraction=index_fraction)

    def build(stage: Stage, info: StageInfo) -> Stage:
        if info.target_epsilon is None:
            raise ValueError("select.gip needs a target epsilon to split its index budget; "
                             "do not set train.noise_multiplier with GIP")
        total = info.total_steps
        size = sum(math.prod(x.shape) for x in jax.tree.leaves(info.param_shapes))
        groups = -(-size // group_size)
        eps_step = index_fraction * info.target_epsilon / total
        eps_group = eps_step / groups

        def init(params, key, info):
            del info
            return {"mask": jax.tree.map(jnp.ones_like, params)}

        def apply(value, state, ctx):
            grouped, n, unravel = _to_groups(value, group_size)
            k = keep_fraction(ctx.step, total, k_start, k_end, schedule)
            m = jnp.round(k * group_size)
            reference = top_m_mask(grouped, m)
            theta = index_theta(eps_group, m, group_size)
            released = mallows_perturb(ctx.key, reference, m, theta)
            return value, {"mask": _from_groups(released, n, unravel)}

        def step_event(info):
            del info
            return accounting.PureDpEvent(eps_step)

        return Stage(name=stage.name, kind_in=Kind.AGGREGATE, kind_out=Kind.AGGREGATE,
                     apply=apply, init=init, lipschitz=1.0, dp_event=step_event,
                     after_release=_mask_after_release,
                     options=dict(options, eps_index_per_step=eps_step, groups=groups))


    # Declared at factory time too, so validation sees a priced mechanism.
    return Stage(name="select.gip", kind_in=Kind.AGGREGATE, kind_out=Kind.AGGREGATE,
                 apply=requires_build("select.gip"), lipschitz=1.0,
                 dp_event=lambda info: None, build=build,
                 options=options)


@register_stage("select.random_k")
def random_k(group_size: int = 256, k_start: float = 1.0, k_end: float = 0.5,
             schedule: str = "exponential") -> Stage:
    """Random-k: per group keep a uniformly random k_t fraction; ignores private values."""
    _validate("select.random_k", group_size, k_start, k_end, schedule)
    options = dict(group_size=group_size, k_start=k_start, k_end=k_end, schedule=schedule)

    def build(stage: Stage, info: StageInfo) -> Stage:
        total = info.total_steps

        def init(params, key, info):
            del info
            return {"mask": jax.tree.map(jnp.ones_like, params), "key": key}

        def apply(value, state, ctx):
            grouped, n, unravel = _to_groups(value, group_size)
            k = keep_fraction(ctx.step, total, k_start, k_end, schedule)
            scores = jax.random.uniform(jax.random.fold_in(state["key"], ctx.step),
                                        grouped.shape)
            mask = top_m_mask(scores, jnp.round(k * group_size))  # depends on no private value
            return value, {"mask": _from_groups(mask, n, unravel), "key": state["key"]}

        return Stage(name=stage.name, kind_in=Kind.AGGREGATE, kind_out=Kind.AGGREGATE,
                     apply=apply, init=init, lipschitz=1.0, reads_private=False,
                     after_release=_mask_after_release, options=options)


    return Stage(name="select.random_k", kind_in=Kind.AGGREGATE, kind_out=Kind.AGGREGATE,
                 apply=requires_build("select.random_k"), lipschitz=1.0, reads_private=False,
                 build=build,
                 options=options)
