"""Exact "the k smallest" selections without argsort: integer keys, a threshold, a count of ties.

XLA's CPU argsort sorts (key, index) pairs through a comparator and float sorts use a total-order
comparator: 3.5 ms for 26K float32 entries on 2 cores, against 0.5 ms for a plain sort of
uint32 values (benchmarks/speed.py, docs/speed.md). So selections order integer keys only and
recover the positions from the k-th smallest key and a cumulative count of ties. That key comes
from a sort of the keys on accelerators, and on CPU from a bitwise search (``kth_smallest``: one
compare-and-count over the row per bit, at most 32): 2.7x to 4.8x faster than XLA's CPU sort
from 26K to 5.8M keys (docs/speed.md), where a wide model's per-step masks spent most of their
step sorting.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_SIGN = jnp.uint32(0x80000000)


def float_key(x):
    """uint32 keys in the order of the float32 values ``x`` (finite or infinite; -0.0 sorts just
    below +0.0): non-negative floats get their bits with the top bit set, negative ones their
    inverted bits."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits & _SIGN, ~bits, bits | _SIGN)


def float_from_key(keys):
    """The float32 values whose ``float_key`` is ``keys`` (its inverse)."""
    bits = jnp.where(keys & _SIGN, keys & ~_SIGN, ~keys)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


@jax.jit
def kth_largest(values, count):
    """The ``count``-th largest of the float32 ``values`` (flattened; count in [1, size]), by
    the bitwise search on their keys: what ``jnp.sort(values)[::-1][count - 1]`` reads off a
    float sort (1.3 s for 5.8M entries on 2 CPU cores, once per SynFlow iteration). Jitted,
    ``count`` traced: a pre-pruning stage's init calls it eagerly, once per iteration, and
    one compiled search then serves every iteration."""
    keys = ~float_key(jnp.ravel(values))[None]
    return float_from_key(~kth_smallest(keys, jnp.full((1, 1), count, jnp.int32)))[0, 0]


def smallest_mask(keys, count):
    """Per row (last axis) of integer ``keys`` (at most 32 bits): True on exactly ``count``
    entries with the smallest keys, ties broken by position (lowest index first): the same set
    as ``stable_argsort_ranks < count``. ``count`` (scalar or one per row, may be traced) is
    clipped to [0, row length]."""
    n = keys.shape[-1]
    count = jnp.clip(jnp.asarray(count, jnp.int32), 0, n)
    count = jnp.broadcast_to(count, keys.shape[:-1])[..., None]
    return jax.lax.platform_dependent(_ordered_uint32(keys), count,
                                      cpu=_smallest_by_search, default=_smallest_by_sort)


def _ordered_uint32(keys):
    """uint32 keys in the order of the integer ``keys``."""
    if not jnp.issubdtype(keys.dtype, jnp.integer) or keys.dtype.itemsize > 4:
        raise TypeError(f"smallest_mask takes integer keys of at most 32 bits, got {keys.dtype}")
    if jnp.issubdtype(keys.dtype, jnp.unsignedinteger):
        return keys.astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(keys.astype(jnp.int32), jnp.uint32) ^ _SIGN


def _smallest_by_sort(keys, count):
    """smallest_mask of uint32 ``keys`` and counts [..., 1], the threshold read off a sort."""
    ordered = jnp.sort(keys, axis=-1)
    threshold = jnp.take_along_axis(ordered, jnp.maximum(count - 1, 0), axis=-1)
    return _below_and_first_ties(keys, count, threshold, tie_free_shortcut=False)


def _smallest_by_search(keys, count):
    """smallest_mask of uint32 ``keys`` and counts [..., 1], the threshold found bit by bit."""
    return _below_and_first_ties(keys, count, kth_smallest(keys, jnp.maximum(count, 1)),
                                 tie_free_shortcut=True)


def kth_smallest(keys, count):
    """Per row of uint32 ``keys``: the ``count``-th smallest key (counts [..., 1], each in
    [1, row length]), without sorting: the largest value v with fewer than ``count`` keys below
    it, built bit by bit from the highest bit in which two keys differ (the bits above it are
    every key's; one pass of compare-and-count over the row per bit: 9 for GIP's Mallows
    priorities, up to 32 for random or float keys)."""
    low, high = jnp.min(keys), jnp.max(keys)
    bits = 32 - jax.lax.clz(low ^ high).astype(jnp.int32)         # 0 when every key is equal
    below_top = (jnp.uint32(1) << bits.astype(jnp.uint32)) - 1    # wraps to all ones at 32
    shared = jnp.full(keys.shape[:-1] + (1,), low & ~below_top, jnp.uint32)

    def next_bit(i, value):
        candidate = value | (jnp.uint32(1) << (bits - 1 - i).astype(jnp.uint32))
        below = jnp.sum(keys < candidate, axis=-1, keepdims=True, dtype=jnp.int32)
        return jnp.where(below < count, candidate, value)

    return jax.lax.fori_loop(0, bits, next_bit, shared)


def _below_and_first_ties(keys, count, threshold, tie_free_shortcut: bool):
    """The keys below ``threshold`` (the count-th smallest) and, of those equal to it, the
    first ``count`` minus that many by position. With ``tie_free_shortcut`` the cumulative
    count of ties runs only when some row's ties are not all needed (a cheap branch on CPU;
    random 32-bit keys almost never tie)."""
    below = keys < threshold
    tied = keys == threshold
    needed = count - jnp.sum(below, axis=-1, keepdims=True, dtype=jnp.int32)

    def first_ties():
        return tied & (jnp.cumsum(tied, axis=-1, dtype=jnp.int32) <= needed)

    if tie_free_shortcut:
        all_tied_needed = jnp.sum(tied, axis=-1, keepdims=True, dtype=jnp.int32) == needed
        chosen = jax.lax.cond(jnp.all(all_tied_needed | (count == 0)), lambda: tied, first_ties)
    else:
        chosen = first_ties()
    return (below | chosen) & (count > 0)
