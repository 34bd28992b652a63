import numpy as np
import pytest
import scipy.stats
from dp_accounting import dp_event

from dpbench import sampling


def test_poisson_batch_size_mean_and_variance_match_q_n():
    n, batch = 10_000, 500
    q = batch / n
    sampler = sampling.PoissonSampler(n, batch, seed=int(np.random.default_rng().integers(1e9)))
    sizes = np.array([sampler.sample(t).size for t in range(2000)])
    mean_se = np.sqrt(q * (1 - q) * n / len(sizes))
    # 4.5 standard errors each: false failures 6.8e-6 (the sizes' sum is exactly binomial) +
    # 9.2e-6 (chi-square(1999) tails of the sample variance) = 1.6e-5; at 4 they were 1.4e-4
    assert abs(sizes.mean() - q * n) < 4.5 * mean_se
    var = q * (1 - q) * n
    assert abs(sizes.var(ddof=1) - var) < 4.5 * var * np.sqrt(2 / (len(sizes) - 1))
    # A wrong rate is rejected by the same statistics (51 standard errors off).
    assert abs(sizes.mean() - 1.05 * q * n) > 4.5 * mean_se


def test_every_example_is_included_with_probability_q_independently_of_position():
    n, batch, steps = 200, 20, 3000
    sampler = sampling.PoissonSampler(n, batch, seed=3)
    counts = np.zeros(n)
    for t in range(steps):
        b = sampler.sample(t)
        assert len(np.unique(b.indices[b.mask])) == b.size  # no example twice
        counts[b.indices[b.mask]] += 1
    q = batch / n
    z = (counts - steps * q) / np.sqrt(steps * q * (1 - q))
    assert np.abs(z).max() < 5
    # the mask marks a prefix; padding slots are unused
    b = sampler.sample(0)
    assert b.mask[:b.size].all() and not b.mask[b.size:].any()


def test_steps_are_independent_and_reproducible():
    sampler = sampling.PoissonSampler(1000, 100, seed=5)
    a, b = sampler.sample(7), sampler.sample(7)
    np.testing.assert_array_equal(a.indices, b.indices)
    sizes = np.array([sampler.sample(t).size for t in range(1000)])
    # lag-1 autocorrelation of the batch sizes is ~0 for independent steps
    assert abs(np.corrcoef(sizes[:-1], sizes[1:])[0, 1]) < 0.15


def test_truncation_caps_the_batch_and_the_event_matches_it():
    sampler = sampling.PoissonSampler(1000, 100, seed=0, padded_batch_size=100)
    assert sampler.truncated
    assert max(sampler.sample(t).size for t in range(200)) == 100
    event = sampler.dp_event(1.5)
    assert isinstance(event, dp_event.TruncatedSubsampledGaussianDpEvent)
    assert (event.dataset_size, event.truncated_batch_size, event.noise_multiplier) == (
        1000, 100, 1.5)
    assert event.sampling_probability == pytest.approx(0.1)
    full = sampling.PoissonSampler(50, 10, seed=0, padded_batch_size=50)
    assert isinstance(full.dp_event(1.0), dp_event.PoissonSampledDpEvent)


@pytest.mark.parametrize("batch", [0, -3, 1001])
def test_sampling_rate_outside_unit_interval_is_rejected(batch):
    with pytest.raises(ValueError, match=r"q = batch_size / N"):
        sampling.PoissonSampler(1000, batch, seed=0)


def test_shuffle_sampler_is_only_built_behind_the_flag_and_says_so():
    assert isinstance(sampling.make_sampler(100, 10, 0, 1), sampling.PoissonSampler)
    s = sampling.make_sampler(100, 10, 0, 1, allow_shuffled_batches=True)
    assert not s.poisson_accounted and "NOT Poisson" in s.describe()["sampling"]
    assert s.sample(0).size == 10


def _consecutive_co_inclusion(sampler, n, steps):
    inside = np.zeros((steps, n), bool)
    for t in range(steps):
        b = sampler.sample(t)
        inside[t, b.indices[b.mask]] = True
    # disjoint pairs (steps 0-1, 2-3, ...): overlapping pairs share a step, so their counts are
    # positively correlated and a binomial test on them flags the truth ~10x too often
    # (a CI run failed at p = 9.3e-5 that way)
    pairs = steps // 2
    return int(np.sum(inside[0:2 * pairs:2] & inside[1:2 * pairs:2])), pairs * n


def test_poisson_steps_are_independent_and_the_test_rejects_shuffling():
    """P[i in step t and in step t+1] = q^2 for Poisson; a per-epoch shuffle (an example
    appears once per epoch) violates it, and the same test says so."""
    n, batch, steps = 100, 25, 2000
    q = batch / n
    seed = int(np.random.default_rng().integers(1e9))
    both, trials = _consecutive_co_inclusion(sampling.PoissonSampler(n, batch, seed=seed), n,
                                             steps)
    p = scipy.stats.binomtest(both, trials, q * q).pvalue
    # exact binomial test of exactly binomial counts: false failures 9.9e-5 (scipy.stats.binom);
    # the shuffle's count is 0 of 1e5 at rate 1/16, so its p-value is ~1e-2800
    assert p > 1e-4, (both, trials * q * q, seed)
    both, trials = _consecutive_co_inclusion(sampling.ShuffleSampler(n, batch, seed=seed), n,
                                             steps)
    assert scipy.stats.binomtest(both, trials, q * q).pvalue < 1e-6


def _pair_co_inclusion(sampler, n, steps, pairs):
    """(steps in which both examples of a pair were drawn, summed over the disjoint pairs;
    pair-steps observed)."""
    both = 0
    for t in range(steps):
        b = sampler.sample(t)
        inside = np.zeros(n, bool)
        inside[b.indices[b.mask]] = True
        both += int(np.sum(inside[pairs[:, 0]] & inside[pairs[:, 1]]))
    return both, steps * len(pairs)


class _ConsecutiveRunSampler(sampling.PoissonSampler):
    """Right batch-size law and right per-example rate, but a step's examples are one
    consecutive run of indices: not independent within the step."""

    def sample(self, step):
        b = super().sample(step)
        start = int(self._rng(step + 10**6).integers(self.dataset_size))
        indices = b.indices.copy()
        indices[:b.size] = (start + np.arange(b.size)) % self.dataset_size
        return sampling.BatchIndices(indices, b.mask, b.size)


@pytest.mark.parametrize("matching", ["neighbours", "random"])
def test_examples_are_included_independently_within_a_step(matching):
    """P[i and j both in one step] = q^2 for i != j under Poisson sampling, for neighbouring
    indices and for a random matching; disjoint pairs keep the counts binomial. A sampler whose
    steps are consecutive runs of indices (right size law, right per-example rate) fails it."""
    n, batch, steps = 200, 40, 1500
    q = batch / n
    rng = np.random.default_rng()
    pairs = (np.arange(n).reshape(-1, 2) if matching == "neighbours"
             else rng.permutation(n).reshape(-1, 2))
    seed = int(rng.integers(1e9))
    both, trials = _pair_co_inclusion(sampling.PoissonSampler(n, batch, seed=seed), n, steps,
                                      pairs)
    # exact binomial test of exactly binomial counts: false failures 9.9e-5 (scipy.stats.binom);
    # a consecutive run holds both neighbours ~5x as often as q^2, far beyond 1e-6
    assert scipy.stats.binomtest(both, trials, q * q).pvalue > 1e-4, (both, trials * q * q, seed)
    if matching == "neighbours":
        both, trials = _pair_co_inclusion(_ConsecutiveRunSampler(n, batch, seed=seed), n, steps,
                                          pairs)
        assert scipy.stats.binomtest(both, trials, q * q).pvalue < 1e-6


class _LowestIndicesTruncation(sampling.PoissonSampler):
    """Truncates an over-full batch to its lowest indices instead of a uniform subset."""

    def sample(self, step):
        rng = self._rng(step)
        size = int(rng.binomial(self.dataset_size, self.sampling_rate))
        chosen = np.sort(rng.choice(self.dataset_size, size=size, replace=False))
        kept = min(size, self.padded_batch_size)
        indices = np.zeros(self.padded_batch_size, np.int64)
        indices[:kept] = chosen[:kept]
        return sampling.BatchIndices(indices, np.arange(self.padded_batch_size) < kept, kept)


def test_an_over_full_batch_is_cut_to_a_uniform_random_subset():
    """The truncated event assumes the cut keeps a uniform subset of the drawn examples: with a
    padded size at the mean (half the steps overflow), every example is still included at the
    same rate E[min(size, P)] / N (chi-square over examples); keeping the lowest indices fails."""
    n, batch, padded, steps = 1000, 100, 100, 1500
    seed = int(np.random.default_rng().integers(1e9))
    sizes = scipy.stats.binom(n, batch / n)
    rate = sum(min(k, padded) * sizes.pmf(k) for k in range(n + 1)) / n

    def p_value(sampler):
        counts = np.zeros(n)
        for t in range(steps):
            b = sampler.sample(t)
            counts[b.indices[b.mask]] += 1
        expected = steps * rate
        chi2 = np.sum((counts - expected) ** 2 / (expected * (1 - rate)))
        return scipy.stats.chi2.sf(chi2, n)

    # The cut makes the counts slightly dependent: the statistic is ~1.0007 chi2(999) + 0.34
    # chi2(1) (their covariance; moments checked on 1,500 simulated runs), so false failures are
    # 1.0e-5 at this 1e-5 (1.003e-4 at 1e-4); the twin's statistic sits ~10 sds above 1e-6's
    assert p_value(sampling.PoissonSampler(n, batch, seed=seed, padded_batch_size=padded)) > 1e-5
    assert p_value(_LowestIndicesTruncation(n, batch, seed=seed, padded_batch_size=padded)) < 1e-6


# --- cyclic Poisson sampling (BandMF's sampler) ---------------------------------------------

class _RedrawnEachEpochSampler(sampling.CyclicPoissonSampler):
    """The broken twin: the right rate and the right parts per step, but the partition drawn
    again every cycle of ``parts`` steps, so an example can be drawn at two steps closer than
    ``parts`` (the last of one cycle and the first of the next)."""

    def sample(self, step):
        cycle = int(step) // self.parts
        part_of = np.random.default_rng([self.seed, sampling.PARTITION_STREAM, cycle]).integers(
            0, self.parts, self.dataset_size)
        members = np.flatnonzero(part_of == self.part_of_step(step))
        rng = np.random.default_rng([self.seed, int(step)])
        size = min(int(rng.binomial(len(members), self.sampling_rate)), self.padded_batch_size)
        chosen = members[rng.choice(len(members), size=size, replace=False)]
        indices = np.zeros(self.padded_batch_size, np.int64)
        indices[:size] = chosen
        return sampling.BatchIndices(indices, np.arange(self.padded_batch_size) < size, size)


def participation_steps(sampler, n, steps) -> list:
    """For every example, the steps whose batch held it."""
    seen = [[] for _ in range(n)]
    for t in range(steps):
        b = sampler.sample(t)
        for i in b.indices[b.mask]:
            seen[i].append(t)
    return seen


def closest_participations(sampler, n, steps) -> int:
    """The fewest steps between two participations of one example (steps if none repeats)."""
    gaps = [np.diff(s).min() for s in participation_steps(sampler, n, steps) if len(s) > 1]
    return int(min(gaps, default=steps))


@pytest.mark.parametrize("parts", [2, 4, 7])
def test_cyclic_poisson_draws_each_example_only_at_its_parts_steps(parts):
    """What banded noise relies on: an example is drawn only at steps t = its part mod parts,
    so two participations are at least ``parts`` steps apart and there are at most
    ceil(steps / parts) of them; the partition is the same for every step and every process.
    A twin that draws the partition again every cycle puts an example at two adjacent steps."""
    n, batch, steps = 300, 30, 240
    seed = int(np.random.default_rng().integers(1e9))
    sampler = sampling.CyclicPoissonSampler(n, batch, seed=seed, parts=parts)
    assert sampler.sampling_rate == pytest.approx(batch * parts / n)
    part_of = np.empty(n, int)
    for j, members in enumerate(sampler.members):
        part_of[members] = j
    for i, drawn in enumerate(participation_steps(sampler, n, steps)):
        assert all(t % parts == part_of[i] for t in drawn), (i, drawn, part_of[i])
        assert len(drawn) <= sampler.participations(steps) == -(-steps // parts)
    assert closest_participations(sampler, n, steps) >= parts == sampler.min_separation
    again = sampling.CyclicPoissonSampler(n, batch, seed=seed, parts=parts)
    assert all(np.array_equal(a, b) for a, b in zip(sampler.members, again.members))
    np.testing.assert_array_equal(sampler.sample(17).indices, again.sample(17).indices)
    # the broken twin (rate 0.2-0.7 over 240 steps: an adjacent pair is all but certain; the
    # chance that none occurs is below 1e-12 at these sizes)
    broken = _RedrawnEachEpochSampler(n, batch, seed=seed, parts=parts)
    assert closest_participations(broken, n, steps) < parts


def test_cyclic_poisson_includes_each_example_of_a_part_at_rate_p_and_parts_are_uniform():
    """Within its part an example is drawn at rate p = B * parts / N (chi-square over the
    examples' counts at their own steps); the parts are uniform: each example's part is a
    uniform draw (chi-square over part sizes). Both exact tests at 1e-5 (false failures
    2e-5 together)."""
    n, batch, parts, steps = 2000, 50, 4, 800
    seed = int(np.random.default_rng().integers(1e9))
    sampler = sampling.CyclicPoissonSampler(n, batch, seed=seed, parts=parts)
    sizes = np.array([len(m) for m in sampler.members])
    assert sizes.sum() == n
    assert scipy.stats.chisquare(sizes).pvalue > 1e-5
    counts = np.zeros(n)
    for t in range(steps):
        b = sampler.sample(t)
        counts[b.indices[b.mask]] += 1
    p, own_steps = sampler.sampling_rate, steps // parts
    chi2 = np.sum((counts - own_steps * p) ** 2 / (own_steps * p * (1 - p)))
    assert scipy.stats.chi2.sf(chi2, n) > 1e-5
    # the rate DP-SGD would draw at (B / N, a quarter of p) is rejected by the same statistic
    q = batch / n
    wrong = np.sum((counts - own_steps * q) ** 2 / (own_steps * q * (1 - q)))
    assert scipy.stats.chi2.sf(wrong, n) < 1e-6


def test_one_part_is_the_poisson_sampler_exactly():
    """parts = 1 draws the same batches from the same seed, and has the same event."""
    seed = int(np.random.default_rng().integers(1e9))
    one = sampling.CyclicPoissonSampler(1000, 64, seed=seed, parts=1, pad_multiple=16)
    plain = sampling.PoissonSampler(1000, 64, seed=seed, pad_multiple=16)
    assert one.padded_batch_size == plain.padded_batch_size and one.min_separation == 1
    for t in (0, 1, 37, sampling.PRE_TRAINING_STEP):
        a, b = one.sample(t), plain.sample(t)
        np.testing.assert_array_equal(a.indices, b.indices)
        np.testing.assert_array_equal(a.mask, b.mask)
    assert one.dp_event(1.3) == plain.dp_event(1.3)
    assert one.participations(10) == plain.participations(10) == 10


def test_cyclic_poisson_event_is_its_largest_parts_and_bad_settings_say_what_to_change():
    sampler = sampling.CyclicPoissonSampler(1000, 100, seed=3, parts=4, padded_batch_size=120)
    event = sampler.dp_event(1.5)
    assert isinstance(event, dp_event.TruncatedSubsampledGaussianDpEvent)
    assert event.dataset_size == max(len(m) for m in sampler.members) == sampler.largest_part
    assert event.sampling_probability == pytest.approx(0.4) and event.truncated_batch_size == 120
    assert max(sampler.sample(t).size for t in range(100)) <= 120
    described = sampler.describe()
    assert described["parts"] == 4 and described["sampling"] == "cyclic_poisson"
    with pytest.raises(ValueError, match="set train.batch_size to at most 250"):
        sampling.CyclicPoissonSampler(1000, 300, seed=0, parts=4)
    with pytest.raises(ValueError, match="sampler.parts must be a positive integer"):
        sampling.CyclicPoissonSampler(1000, 10, seed=0, parts=0)
    assert isinstance(sampling.make_sampler(100, 10, 0, 1, parts=2),
                      sampling.CyclicPoissonSampler)
    with pytest.raises(ValueError, match="exclude each other"):
        sampling.make_sampler(100, 10, 0, 1, allow_shuffled_batches=True, parts=2)
