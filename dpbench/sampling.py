"""Batch samplers. The sampler the data loader uses is the object whose DpEvent the accountant
composes, so sampling and accounting cannot drift apart.

Each sampler also says how often one example can take part: ``participations(steps)``, the
most steps of the first ``steps`` whose batch can hold a given example (the number of times the
accountant composes its step event), and ``min_separation``, the fewest steps between two of
them (what correlated noise relies on: ``stages.base.Correlation``).

Batches have a static padded size (no recompiles) and a validity mask. With Poisson sampling the
realized size can exceed the padded size; then the batch is truncated to a uniformly random subset
of the padded size, which is exactly the mechanism of dp_accounting's
``TruncatedSubsampledGaussianDpEvent`` (see :meth:`PoissonSampler.dp_event`).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import gin
import numpy as np
import scipy.stats
from dp_accounting import dp_event


# The sampler position of a one-off release before training (DP-SNIP): a batch drawn exactly
# like a training step's, from a position no training step uses.
PRE_TRAINING_STEP = 2 ** 40
# The random stream of the cyclic sampler's partition: one no step's batch uses.
PARTITION_STREAM = 2 ** 41


class BatchIndices(NamedTuple):
    indices: np.ndarray  # int64 [padded_batch_size]; entries where mask is False are 0 (unused)
    mask: np.ndarray     # bool  [padded_batch_size]
    size: int            # realized batch size (private: never leaves the host loop except as mask)


def _round_up(value: int, multiple: int) -> int:
    return int(math.ceil(value / multiple) * multiple)


def _padded_size(n: int, rate: float, overflow_stddevs: float, pad_multiple: int,
                 padded_batch_size: Optional[int]) -> int:
    """The static batch size: ``overflow_stddevs`` standard deviations above Binomial(n, rate)'s
    mean (at most n), rounded up to ``pad_multiple``."""
    if padded_batch_size is None:
        std = math.sqrt(n * rate * (1 - rate))
        padded_batch_size = min(int(math.ceil(n * rate + overflow_stddevs * std)), n)
    return _round_up(max(int(padded_batch_size), 1), pad_multiple)


def _poisson_draw(rng: np.random.Generator, n: int, rate: float, padded: int) -> np.ndarray:
    """Positions in [0, n) each drawn with probability ``rate``, as a Binomial(n, rate) size
    then a uniform subset of it (the same distribution); a uniform subset of ``padded`` of them
    when more are drawn (truncation)."""
    size = min(int(rng.binomial(n, rate)), padded)
    return rng.choice(n, size=size, replace=False)


def _padded(chosen: np.ndarray, positions_to_indices, padded: int) -> BatchIndices:
    indices = np.zeros(padded, np.int64)
    indices[:len(chosen)] = positions_to_indices(chosen)
    mask = np.zeros(padded, bool)
    mask[:len(chosen)] = True
    return BatchIndices(indices, mask, len(chosen))


def _gaussian_event(n: int, rate: float, padded: int, noise_multiplier: float):
    """A Poisson-sampled Gaussian over n examples at ``rate``, truncated at ``padded``."""
    if padded < n:
        return dp_event.TruncatedSubsampledGaussianDpEvent(
            dataset_size=n, sampling_probability=rate, truncated_batch_size=padded,
            noise_multiplier=noise_multiplier)
    return dp_event.PoissonSampledDpEvent(rate, dp_event.GaussianDpEvent(noise_multiplier))


class PoissonSampler:
    """Poisson sampling with rate q = expected_batch_size / dataset_size, padded to a static size.

    Every example is included in a step's batch independently with probability q (drawn as a
    Binomial(N, q) size followed by a uniform subset of that size, which is the same
    distribution). Steps are independent: step t's batch depends only on (seed, t), so a resumed
    run draws exactly the batches an uninterrupted one would.
    """

    poisson_accounted = True
    name = "poisson"
    min_separation = 1  # an example may be drawn at every step

    def __init__(self, dataset_size: int, expected_batch_size: int, seed: int,
                 pad_multiple: int = 1, padded_batch_size: Optional[int] = None,
                 overflow_stddevs: float = 8.0):
        if not isinstance(dataset_size, (int, np.integer)) or dataset_size <= 0:
            raise ValueError(f"dataset size must be a positive integer, got {dataset_size!r}")
        q = expected_batch_size / dataset_size
        if not 0 < q <= 1:
            raise ValueError(
                f"sampling rate q = batch_size / N = {expected_batch_size} / {dataset_size} = "
                f"{q:.4g} must lie in (0, 1]; set train.batch_size between 1 and {dataset_size}")
        self.dataset_size = int(dataset_size)
        self.expected_batch_size = expected_batch_size
        self.sampling_rate = q
        self.seed = seed
        self.padded_batch_size = _padded_size(dataset_size, q, overflow_stddevs, pad_multiple,
                                              padded_batch_size)
        if self.padded_batch_size < expected_batch_size:
            raise ValueError(f"padded batch size {self.padded_batch_size} is below the expected "
                             f"batch size {expected_batch_size}")

    @property
    def truncated(self) -> bool:
        """True when a realized batch can exceed the padded size (then it is truncated)."""
        return self.padded_batch_size < self.dataset_size

    @staticmethod
    def participations(steps: int) -> int:
        """Every step can draw any example."""
        return int(steps)

    @property
    def overflow_probability(self) -> float:
        """P[Binomial(N, q) > padded size]: how often truncation actually happens per step."""
        return float(scipy.stats.binom.sf(self.padded_batch_size, self.dataset_size,
                                          self.sampling_rate))

    def _rng(self, step: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, int(step)])

    def sample(self, step: int) -> BatchIndices:
        chosen = _poisson_draw(self._rng(step), self.dataset_size, self.sampling_rate,
                               self.padded_batch_size)
        return _padded(chosen, lambda positions: positions, self.padded_batch_size)

    def dp_event(self, noise_multiplier: float) -> dp_event.DpEvent:
        """The DpEvent of one step: this sampler followed by a Gaussian with this multiplier."""
        return _gaussian_event(self.dataset_size, self.sampling_rate, self.padded_batch_size,
                               noise_multiplier)

    def describe(self) -> dict:
        return dict(sampling=self.name, sampling_rate=self.sampling_rate,
                    expected_batch_size=self.expected_batch_size,
                    padded_batch_size=self.padded_batch_size, truncated=self.truncated,
                    overflow_probability_per_step=self.overflow_probability,
                    poisson_accounted=self.poisson_accounted)


class ShuffleSampler:
    """Fixed-size batches from a per-epoch shuffle. NOT what the Poisson accounting assumes.

    Only built when the user sets ``train.allow_shuffled_batches = True``; the run record and the
    privacy statement then say that the reported epsilon is the Poisson-sampling epsilon and does
    not hold for this sampler.
    """

    poisson_accounted = False
    name = "shuffle (NOT Poisson-accounted)"
    min_separation = 1  # the last batch of one epoch and the first of the next may share one
    participations = PoissonSampler.participations

    def __init__(self, dataset_size: int, expected_batch_size: int, seed: int,
                 pad_multiple: int = 1):
        if not 0 < expected_batch_size <= dataset_size:
            raise ValueError(f"batch size {expected_batch_size} must lie in [1, {dataset_size}]")
        self.dataset_size = int(dataset_size)
        self.expected_batch_size = expected_batch_size
        self.sampling_rate = expected_batch_size / dataset_size
        self.seed = seed
        self.padded_batch_size = _round_up(expected_batch_size, pad_multiple)
        self.steps_per_epoch = dataset_size // expected_batch_size
        self.truncated = False

    def sample(self, step: int) -> BatchIndices:
        epoch, position = divmod(int(step), self.steps_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size)
        chosen = order[position * self.expected_batch_size:
                       (position + 1) * self.expected_batch_size]
        indices = np.zeros(self.padded_batch_size, np.int64)
        indices[:len(chosen)] = chosen
        mask = np.zeros(self.padded_batch_size, bool)
        mask[:len(chosen)] = True
        return BatchIndices(indices, mask, len(chosen))

    def dp_event(self, noise_multiplier: float) -> dp_event.DpEvent:
        # The Poisson event is what gets reported, flagged as not holding for this sampler.
        return dp_event.PoissonSampledDpEvent(self.sampling_rate,
                                              dp_event.GaussianDpEvent(noise_multiplier))

    def describe(self) -> dict:
        return dict(sampling=self.name, sampling_rate=self.sampling_rate,
                    expected_batch_size=self.expected_batch_size,
                    padded_batch_size=self.padded_batch_size, truncated=False,
                    poisson_accounted=False)


class CyclicPoissonSampler:
    """Cyclic Poisson sampling: the examples are split into ``parts`` parts once, before
    training, each example's part drawn uniformly and independently of every other and of the
    data (from the sampler's seed, stream ``PARTITION_STREAM``); step t draws only from part
    t mod parts, each of its examples independently with probability
    p = expected_batch_size * parts / N, so a step's expected batch is still about B.

    An example is drawn only at the steps of its own part: at most ceil(steps / parts) of the
    first ``steps``, and never at two steps less than ``parts`` apart. That separation is what
    banded correlated noise needs (Choquette-Choo et al. 2023, "(Amplified) Banded Matrix
    Factorization"): its b-banded noise then costs what DP-SGD's independent noise costs at
    rate p over ceil(steps / b) steps. A part's batch is padded like PoissonSampler's (and
    truncated, accounted by its event, when it overflows). With one part this IS
    PoissonSampler: the same draws from the same seed.

    Why independent parts, not equal ones: under add/remove adjacency an added example must
    leave every other example's part unchanged; an equal split of the indices would shift.
    """

    poisson_accounted = True
    name = "cyclic_poisson"

    def __init__(self, dataset_size: int, expected_batch_size: int, seed: int, parts: int,
                 pad_multiple: int = 1, padded_batch_size: Optional[int] = None,
                 overflow_stddevs: float = 8.0):
        if not isinstance(parts, (int, np.integer)) or isinstance(parts, bool) or parts < 1:
            raise ValueError(f"sampler.parts must be a positive integer, got {parts!r}")
        if not isinstance(dataset_size, (int, np.integer)) or dataset_size < parts:
            raise ValueError(f"dataset size {dataset_size!r} must be an integer >= "
                             f"sampler.parts = {parts}")
        self.parts = int(parts)
        self.dataset_size = int(dataset_size)
        self.expected_batch_size = expected_batch_size
        self.seed = seed
        rate = expected_batch_size * parts / dataset_size
        rate = 1.0 if abs(rate - 1) < 1e-12 else rate  # B = N / parts, up to float rounding
        if not 0 < rate <= 1:
            raise ValueError(
                f"cyclic Poisson sampling rate p = batch_size * parts / N = "
                f"{expected_batch_size} * {parts} / {dataset_size} = {rate:.4g} must lie in "
                f"(0, 1]; set train.batch_size to at most {dataset_size // parts} or use fewer "
                "parts (sampler.parts)")
        self.sampling_rate = rate
        if parts == 1:  # the whole set in its own order: PoissonSampler's draws exactly
            part_of = np.zeros(dataset_size, np.int64)
        else:
            part_of = np.random.default_rng([seed, PARTITION_STREAM]).integers(
                0, parts, dataset_size)
        self.members = tuple(np.flatnonzero(part_of == j) for j in range(parts))
        sizes = [len(m) for m in self.members]
        if min(sizes) == 0:
            raise ValueError(f"a part of the {parts}-part split of {dataset_size} examples is "
                             "empty; use fewer parts (sampler.parts)")
        self.largest_part = max(sizes)
        self.padded_batch_size = _padded_size(self.largest_part, rate, overflow_stddevs,
                                              pad_multiple, padded_batch_size)

    @property
    def min_separation(self) -> int:
        return self.parts

    def participations(self, steps: int) -> int:
        """The steps of part 0, the first sampled: ceil(steps / parts)."""
        return -(-int(steps) // self.parts)

    def part_of_step(self, step: int) -> int:
        return int(step) % self.parts

    @property
    def truncated(self) -> bool:
        return self.padded_batch_size < self.largest_part

    @property
    def overflow_probability(self) -> float:
        """P[Binomial(largest part, p) > padded size]: a step's chance of truncation, at most."""
        return float(scipy.stats.binom.sf(self.padded_batch_size, self.largest_part,
                                          self.sampling_rate))

    def sample(self, step: int) -> BatchIndices:
        """Part ``step mod parts``'s Poisson draw for ``step`` (from the generator seeded by
        (seed, step), as PoissonSampler's), as indices of the whole training set."""
        members = self.members[self.part_of_step(step)]
        chosen = _poisson_draw(np.random.default_rng([self.seed, int(step)]), len(members),
                               self.sampling_rate, self.padded_batch_size)
        return _padded(chosen, lambda positions: members[positions], self.padded_batch_size)

    def dp_event(self, noise_multiplier: float) -> dp_event.DpEvent:
        """One participation's event: a Gaussian on the largest part's Poisson draw at rate p
        (truncated like its batch); the accountant composes ``participations(steps)`` of
        them."""
        return _gaussian_event(self.largest_part, self.sampling_rate, self.padded_batch_size,
                               noise_multiplier)

    def describe(self) -> dict:
        sizes = [len(m) for m in self.members]
        return dict(sampling=self.name, sampling_rate=self.sampling_rate,
                    expected_batch_size=self.expected_batch_size,
                    padded_batch_size=self.padded_batch_size, truncated=self.truncated,
                    overflow_probability_per_step=self.overflow_probability,
                    poisson_accounted=True, parts=self.parts,
                    part_sizes=[min(sizes), max(sizes)],
                    partition="each example's part drawn once, uniformly and independently, "
                              "from the sampler's seed before training; step t draws part "
                              "t mod parts")


@gin.configurable("sampler")
def make_sampler(dataset_size: int, expected_batch_size: int, seed: int, pad_multiple: int,
                 allow_shuffled_batches: bool = False, overflow_stddevs: float = 8.0,
                 parts: int = 1):
    """Poisson sampler by default; ``parts`` > 1: cyclic Poisson over that many parts (what
    banded correlated noise needs, one part per band); shuffled fixed-size batches only behind
    an explicit flag."""
    if allow_shuffled_batches:
        if parts != 1:
            raise ValueError("sampler.allow_shuffled_batches and sampler.parts > 1 exclude each "
                             "other; unset one")
        return ShuffleSampler(dataset_size, expected_batch_size, seed, pad_multiple)
    if parts != 1:
        return CyclicPoissonSampler(dataset_size, expected_batch_size, seed, parts,
                                    pad_multiple, overflow_stddevs=overflow_stddevs)
    return PoissonSampler(dataset_size, expected_batch_size, seed, pad_multiple,
                          overflow_stddevs=overflow_stddevs)
