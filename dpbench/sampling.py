"""Batch samplers. The sampler the data loader uses is the object whose DpEvent the accountant
composes, so sampling and accounting cannot drift apart (DESIGN.md section 2).

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


class BatchIndices(NamedTuple):
    indices: np.ndarray  # int64 [padded_batch_size]; entries where mask is False are 0 (unused)
    mask: np.ndarray     # bool  [padded_batch_size]
    size: int            # realized batch size (private: never leaves the host loop except as mask)


def _round_up(value: int, multiple: int) -> int:
    return int(math.ceil(value / multiple) * multiple)


class PoissonSampler:
    """Poisson sampling with rate q = expected_batch_size / dataset_size, padded to a static size.

    Every example is included in a step's batch independently with probability q (drawn as a
    Binomial(N, q) size followed by a uniform subset of that size, which is the same
    distribution). Steps are independent: step t's batch depends only on (seed, t), so a resumed
    run draws exactly the batches an uninterrupted one would.
    """

    poisson_accounted = True
    name = "poisson"

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
        if padded_batch_size is None:
            std = math.sqrt(dataset_size * q * (1 - q))
            padded_batch_size = min(int(math.ceil(dataset_size * q + overflow_stddevs * std)),
                                    dataset_size)
        self.padded_batch_size = _round_up(max(int(padded_batch_size), 1), pad_multiple)
        if self.padded_batch_size < expected_batch_size:
            raise ValueError(f"padded batch size {self.padded_batch_size} is below the expected "
                             f"batch size {expected_batch_size}")

    @property
    def truncated(self) -> bool:
        """True when a realized batch can exceed the padded size (then it is truncated)."""
        return self.padded_batch_size < self.dataset_size

    @property
    def overflow_probability(self) -> float:
        """P[Binomial(N, q) > padded size]: how often truncation actually happens per step."""
        return float(scipy.stats.binom.sf(self.padded_batch_size, self.dataset_size,
                                          self.sampling_rate))

    def _rng(self, step: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, int(step)])

    def sample(self, step: int) -> BatchIndices:
        rng = self._rng(step)
        size = int(rng.binomial(self.dataset_size, self.sampling_rate))
        size = min(size, self.padded_batch_size)  # truncation: a uniform subset of the padded size
        chosen = rng.choice(self.dataset_size, size=size, replace=False)
        indices = np.zeros(self.padded_batch_size, np.int64)
        indices[:size] = chosen
        mask = np.zeros(self.padded_batch_size, bool)
        mask[:size] = True
        return BatchIndices(indices, mask, size)

    def dp_event(self, noise_multiplier: float) -> dp_event.DpEvent:
        """The DpEvent of one step: this sampler followed by a Gaussian with this multiplier."""
        if self.truncated:
            return dp_event.TruncatedSubsampledGaussianDpEvent(
                dataset_size=self.dataset_size, sampling_probability=self.sampling_rate,
                truncated_batch_size=self.padded_batch_size, noise_multiplier=noise_multiplier)
        return dp_event.PoissonSampledDpEvent(self.sampling_rate,
                                              dp_event.GaussianDpEvent(noise_multiplier))

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


@gin.configurable("sampler")
def make_sampler(dataset_size: int, expected_batch_size: int, seed: int, pad_multiple: int,
                 allow_shuffled_batches: bool = False, overflow_stddevs: float = 8.0):
    """Poisson sampler by default; shuffled fixed-size batches only behind an explicit flag."""
    if allow_shuffled_batches:
        return ShuffleSampler(dataset_size, expected_batch_size, seed, pad_multiple)
    return PoissonSampler(dataset_size, expected_batch_size, seed, pad_multiple,
                          overflow_stddevs=overflow_stddevs)
