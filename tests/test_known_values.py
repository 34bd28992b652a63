"""Known-value accounting tests: dpbench's ledger against independently published epsilons.

Every number in KNOWN below was read in the cited source (repository + path + commit, or paper);
none is computed here. Each row reproduces the source's own step count (its expression is written
out in the row) and the source's sampling (all Poisson, or no sampling at all), and the events go
through dpbench's own sampler (``PoissonSampler(N, B, padded_batch_size=N).dp_event``), so these
tests check the ledger dpbench builds, not only dp_accounting.

Row kinds (what the source's number is, and so what dpbench must do with it):

* ``rdp``    -- modern RDP (dp_accounting / Opacus conversion, Balle et al. 2020 Thm 21 = Canonne
  et al. 2020 Prop 12). dpbench with accountant='rdp' must match at the source's precision.
* ``pld``    -- PLD accountant value. dpbench with accountant='pld' must match.
* PRV_ROWS   -- PRV accountant (Gopi et al. 2021) upper estimates. See test_prv_rows.
* ``legacy`` -- printed before 2020 with the old RDP -> (eps, delta) conversion
  eps = min_a rdp(a) + log(1/delta) / (a - 1) (Mironov 2017 Prop 3; for integer orders this is the
  moments accountant of Abadi et al. 2016). These are upper bounds: dpbench (modern RDP and PLD)
  must not exceed them; and applying the legacy conversion, with the source's orders, to the RDP
  curve of dpbench's own event must give the printed value (this pins N, B, sigma and steps).

For every row PLD <= RDP must hold (PLD is the tight accountant). Run time of the whole file is
about 20 s on 2 busy cores; the slowest single PLD here (default grid 1e-3) takes ~0.3 s, so no row
skips PLD.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from dpbench import accounting, sampling
from dpbench.run import total_steps_for

# RDP orders the legacy sources minimised over (copied from those sources).
# tensorflow/privacy tutorials/mnist_dpsgd_tutorial.py @ d435fcbf, compute_epsilon():
TUTORIAL_ORDERS = [1 + x / 10. for x in range(1, 100)] + list(range(12, 64))
# tensorflow/privacy privacy/analysis/compute_dp_sgd_privacy.py @ 0a0e5cb3 (the CLI), main():
CLI_ORDERS = ([1.25, 1.5, 1.75, 2., 2.25, 2.5, 3., 3.5, 4., 4.5] + list(range(5, 64))
              + [128, 256, 512])
# Abadi et al. 2016 moments accountant: integer moments lambda (= RDP order - 1). The optimum for
# their example is at order 20, so any integer grid containing it gives the same value.
MOMENT_ORDERS = list(range(2, 34))

EPOCH_60K_256 = 60000 // 256  # the TF tutorial's training loop: steps_per_epoch (drops remainder)

KNOWN = [
    # ---------------------------------------------------------------- modern RDP, pinned in tests
    # tensorflow/privacy tensorflow_privacy/privacy/analysis/compute_dp_sgd_privacy_test.py
    # @ 2cd46dbb, test_compute_dp_sgd_privacy 'Test0': (60000, 150, 1.3, 15, 1e-5,
    # 0.7242234026109595, order 19.0), checked with assertAlmostEqual (7 places). Steps as in
    # compute_dp_sgd_privacy_lib.compute_dp_sgd_privacy: int(math.ceil(epochs * n / batch_size)).
    # TF minimises over CLI_ORDERS; the optimum is integer order 19, also in dpbench's grid.
    dict(id="tfp-test0", kind="rdp", N=60000, B=150, sigma=1.3,
         steps=int(math.ceil(15 * 60000 / 150)), epochs=15, delta=1e-5,
         value=0.7242234026109595, tol=5e-8),
    # same file, 'Test1': (100000, 100, 1.0, 30, 1e-7, 1.4154988495444842, order 13.0), 7 places.
    dict(id="tfp-test1", kind="rdp", N=100000, B=100, sigma=1.0,
         steps=int(math.ceil(30 * 100000 / 100)), epochs=30, delta=1e-7,
         value=1.4154988495444842, tol=5e-8),
    # same file, test_compute_dp_sgd_example_privacy: num_epochs=1.2, noise_multiplier=0.7,
    # example_delta=1e-5, poisson_subsampling_probability=1e-2, assertAlmostEqual (7 places).
    # _compute_dp_sgd_example_privacy (lib @ the same revision): count =
    # int(math.ceil(num_epochs / q)), and with used_microbatching the noise multiplier is halved;
    # accountants are dp_accounting's RdpAccountant() / PLDAccountant() (grid 1e-4) defaults.
    # q = 1e-2 is written as B/N = 600/60000 (the same float).
    dict(id="tfp-example-rdp", kind="rdp", N=60000, B=600, sigma=0.7,
         steps=int(math.ceil(1.2 / 1e-2)), delta=1e-5, value=3.2392676, tol=5e-8),
    dict(id="tfp-example-rdp-microbatched", kind="rdp", N=60000, B=600, sigma=0.7 / 2,
         steps=int(math.ceil(1.2 / 1e-2)), delta=1e-5, value=22.6248601, tol=5e-8),
    # no subsampling: count = int(math.ceil(num_epochs)) Gaussian releases
    dict(id="tfp-example-rdp-unsampled", kind="rdp", N=None, B=None, sigma=0.7,
         steps=int(math.ceil(1.2)), delta=1e-5, value=10.8602036, tol=5e-8),
    dict(id="tfp-example-rdp-unsampled-microbatched", kind="rdp", N=None, B=None, sigma=0.7 / 2,
         steps=int(math.ceil(1.2)), delta=1e-5, value=26.2880374, tol=5e-8),
    # same file, test_dp_sgd_privacy_statement_no_user_dp_with_rdp: number_of_examples=10000,
    # batch_size=64, num_epochs=5.0, noise_multiplier=2.0 (microbatching: halved), delta=1e-6;
    # "Epsilon assuming Poisson sampling (*): 1.616" (printed :12.3f).
    dict(id="tfp-statement-rdp", kind="rdp", N=10000, B=64, sigma=2.0 / 2,
         steps=int(math.ceil(5.0 / (64 / 10000))), epochs=5.0, delta=1e-6, value=1.616, tol=5e-4),
    # tensorflow/privacy g3doc/tutorials/classification_privacy.ipynb @ 197ce2ad: epochs = 3,
    # batch_size = 250, noise_multiplier = 1.3, MNIST n = 60000, delta=1e-5, printed via
    # compute_dp_sgd_privacy_statement (RDP, used_microbatching default True: sigma halved):
    # "the trained model has an epsilon value of 3.426" (the Poisson line, :12.3f).
    dict(id="tfp-classification-tutorial", kind="rdp", N=60000, B=250, sigma=1.3 / 2,
         steps=int(math.ceil(3 / (250 / 60000))), epochs=3, delta=1e-5, value=3.426, tol=5e-4),
    # pytorch/opacus opacus/tests/accountants_test.py @ 030b723f, test_rdp_accountant:
    # noise_multiplier=1.5, sample_rate=0.04, steps = int(90 / 0.04) (= 2250), delta=1e-5,
    # assertAlmostEqual(epsilon, 7.32911117143) (7 places). q = 2000/50000.
    # TOLERANCE 5e-4, NOT 7 places: dp_accounting 0.6.0 evaluates log A_alpha at fractional orders
    # (the optimum here is alpha = 3.9) by summing the absolute values of the binomial series
    # (_compute_log_a_frac; _log_comb uses gammaln, so the signs of binom(alpha, i), i > alpha,
    # are lost). That is an upper bound, 5.4e-5 relative above the exact log A (mpmath quadrature
    # gives 7.3291111715, Opacus's signed series 7.32911117143); dpbench reports 7.3293347, i.e.
    # 2.2e-4 above Opacus, on the safe side. 5e-4 still rejects the wrong step count 2249 (off by
    # 1.6e-3, see test_integer_step_counts_matter).
    dict(id="opacus-rdp", kind="rdp", N=50000, B=2000, sigma=1.5, steps=int(90 / 0.04),
         epochs=90, delta=1e-5, value=7.32911117143, tol=5e-4),
    # ------------------------------------------------------------- modern PLD, pinned in tests
    # tensorflow/privacy compute_dp_sgd_privacy_test.py @ 2cd46dbb (as above), PLD rows,
    # 7 places, computed on dp_accounting's default PLD grid 1e-4. dpbench's default grid is 1e-3;
    # a coarser pessimistic grid can only add epsilon, so dpbench must lie in
    # [value - 5e-8, value * (1 + 1e-4)] (measured: at most 1.7e-5 relative above);
    # test_pld_rows_reproduce_at_the_source_grid repeats one row on the source's grid at 7 places.
    dict(id="tfp-example-pld", kind="pld", N=60000, B=600, sigma=0.7,
         steps=int(math.ceil(1.2 / 1e-2)), delta=1e-5, value=2.4612381, tol=None),
    dict(id="tfp-example-pld-microbatched", kind="pld", N=60000, B=600, sigma=0.7 / 2,
         steps=int(math.ceil(1.2 / 1e-2)), delta=1e-5, value=18.6977407, tol=None),
    dict(id="tfp-example-pld-unsampled", kind="pld", N=None, B=None, sigma=0.7,
         steps=int(math.ceil(1.2)), delta=1e-5, value=10.1224946, tol=None),
    dict(id="tfp-example-pld-unsampled-microbatched", kind="pld", N=None, B=None, sigma=0.7 / 2,
         steps=int(math.ceil(1.2)), delta=1e-5, value=24.7160779, tol=None),
    # same file, test_dp_sgd_privacy_statement_no_user_dp_with_pld: "Epsilon assuming Poisson
    # sampling (*): 1.199" (:12.3f)
    dict(id="tfp-statement-pld", kind="pld", N=10000, B=64, sigma=2.0 / 2,
         steps=int(math.ceil(5.0 / (64 / 10000))), epochs=5.0, delta=1e-6, value=1.199, tol=5e-4),
    # ------------------------------------------------- legacy conversion: upper bounds, 2-3 digits
    # Abadi et al., "Deep Learning with Differential Privacy", CCS 2016 (arXiv:1607.00133), Sec 3.1:
    # "with L=0.01N, sigma=4, delta=1e-5, and T=10000, we have eps ~ 1.26 using the moments
    # accountant" (Poisson lots, q = L/N). No modern pinned value was found for this setting; the
    # paper's value is the bound dpbench must not exceed (dpbench: RDP 1.035, PLD 0.960).
    dict(id="abadi2016", kind="legacy", N=60000, B=600, sigma=4.0, steps=10000, delta=1e-5,
         value=1.26, tol=5e-3, orders=MOMENT_ORDERS),
    # tensorflow/privacy tutorials/README.md @ d435fcbf: "compute_dp_sgd_privacy.py --N=60000
    # --batch_size=256 --noise_multiplier=1.1 --epochs=60 --delta=1e-5 ... eps = 3.01".
    # The CLI (privacy/analysis/compute_dp_sgd_privacy.py): steps =
    # int(math.ceil(FLAGS.epochs * FLAGS.N / FLAGS.batch_size)), CLI_ORDERS, printed '{:.3g}'.
    dict(id="tfp-readme-cli-sigma1.1-60ep", kind="legacy", N=60000, B=256, sigma=1.1,
         steps=int(math.ceil(60 * 60000 / 256)), epochs=60, delta=1e-5, value=3.01, tol=5e-3,
         orders=CLI_ORDERS),
    # same README, "Select Parameters" table (and "Expected Output"), produced by
    # tutorials/mnist_dpsgd_tutorial.py @ d435fcbf: compute_epsilon(epoch * steps_per_epoch) with
    # steps_per_epoch = 60000 // batch_size, TUTORIAL_ORDERS, printed '%.2f'.
    dict(id="tfp-readme-table-sigma1.1-60ep", kind="legacy", N=60000, B=256, sigma=1.1,
         steps=60 * EPOCH_60K_256, delta=1e-5, value=3.01, tol=5e-3, orders=TUTORIAL_ORDERS),
    dict(id="tfp-readme-table-sigma1.3-15ep", kind="legacy", N=60000, B=256, sigma=1.3,
         steps=15 * EPOCH_60K_256, delta=1e-5, value=1.19, tol=5e-3, orders=TUTORIAL_ORDERS),
    # (7.10 needs TUTORIAL_ORDERS: with the CLI's orders the legacy value is 7.12.)
    dict(id="tfp-readme-table-sigma0.7-45ep", kind="legacy", N=60000, B=256, sigma=0.7,
         steps=45 * EPOCH_60K_256, delta=1e-5, value=7.10, tol=5e-3, orders=TUTORIAL_ORDERS),
    # README "Expected Output": "after 1 epochs ... epsilon is: 1.03", "after 2 epochs ... 1.11"
    dict(id="tfp-readme-output-epoch1", kind="legacy", N=60000, B=256, sigma=1.1,
         steps=1 * EPOCH_60K_256, delta=1e-5, value=1.03, tol=5e-3, orders=TUTORIAL_ORDERS),
    dict(id="tfp-readme-output-epoch2", kind="legacy", N=60000, B=256, sigma=1.1,
         steps=2 * EPOCH_60K_256, delta=1e-5, value=1.11, tol=5e-3, orders=TUTORIAL_ORDERS),
    # tensorflow/privacy tutorials/Classification_Privacy.ipynb @ 28d6db4c (2019):
    # compute_dp_sgd_privacy(n=60000, batch_size=250, noise_multiplier=1.3, epochs=15,
    # delta=1e-5) -> "an epsilon value of 1.18" (CLI steps and orders, '{:.3g}').
    dict(id="tfp-classification-2019", kind="legacy", N=60000, B=250, sigma=1.3,
         steps=int(math.ceil(15 * 60000 / 250)), epochs=15, delta=1e-5, value=1.18, tol=5e-3,
         orders=CLI_ORDERS),
    # tensorflow/privacy privacy/analysis/compute_dp_sgd_privacy.py @ 0a0e5cb3, docstring:
    # --N=60000 --batch_size=256 --noise_multiplier=1.12 --epochs=60 --delta=1e-5 "satisfies
    # (2.92, 1e-5)-DP".
    dict(id="tfp-cli-docstring-sigma1.12", kind="legacy", N=60000, B=256, sigma=1.12,
         steps=int(math.ceil(60 * 60000 / 256)), epochs=60, delta=1e-5, value=2.92, tol=5e-3,
         orders=CLI_ORDERS),
]

# pytorch/opacus opacus/tests/prv_accountant.py @ 334b5a88: msr_values "Computed from
# https://github.com/microsoft/prv_accountant", keys (noise_multiplier, sample_rate, steps),
# delta=1e-6 (Opacus checks its PRVAccountant against them at places=5). PRVAccountant.get_epsilon
# returns eps_upper with eps_error=0.01 (opacus/accountants/prv.py), i.e. the true epsilon lies in
# [value - 2 * 0.01, value]. Rows with q >= 0.05 or few steps; q = 0.001 long runs are in
# test_small_q_long_runs_*.
PRV_EPS_ERROR = 0.01
PRV_ROWS = [
    dict(id="prv-0.8-0.001-100", sigma=0.8, N=1000, B=1, steps=100,
         value=0.270403364058018680360362395731),
    dict(id="prv-1.5-0.05-100", sigma=1.5, N=1000, B=50, steps=100,
         value=1.95385313568420015961635272106),
    dict(id="prv-3.0-0.2-100", sigma=3.0, N=1000, B=200, steps=100,
         value=3.38122051022184422208738396876),
    dict(id="prv-3.0-0.05-1000", sigma=3.0, N=1000, B=50, steps=1000,
         value=2.52757432605973830774814814504),
    dict(id="prv-2.0-0.05-20000", sigma=2.0, N=1000, B=50, steps=20000,
         value=24.4217185703225858617315680021),
    dict(id="prv-3.0-0.05-50000", sigma=3.0, N=1000, B=50, steps=50000,
         value=24.9420056431444763234139827546),
]
# same file, q = 0.001 and many steps: dpbench's default PLD grid (1e-3) is coarser than the
# per-step privacy loss (~q / sigma^2 ~ 1e-4), so the pessimistic rounding of every step adds up.
PRV_SMALL_Q_ROWS = [
    dict(id="prv-2.0-0.001-20000", sigma=2.0, N=1000, B=1, steps=20000,
         value=0.305837939762453436820521801565),
    dict(id="prv-3.0-0.001-100000", sigma=3.0, N=1000, B=1, steps=100000,
         value=0.443671720880875475323534828931),
]
PRV_DELTA = 1e-6

# pytorch/opacus opacus/tests/accountants_test.py @ 030b723f, get_noise_multiplier (accountant
# 'rdp', epsilon_tolerance=0.01: it returns a sigma whose epsilon is in [target - 0.01, target]),
# assertAlmostEqual(..., places=4): test_get_noise_multiplier_rdp_epochs (epochs=90, so
# steps = int(epochs / sample_rate) in opacus/accountants/utils.py) and ..._rdp_steps.
OPACUS_CALIBRATION = [
    dict(id="opacus-sigma-epochs", N=50000, B=2000, steps=int(90 / 0.04), epsilon=8.0,
         delta=1e-5, sigma=1.416),
    dict(id="opacus-sigma-steps", N=50000, B=2000, steps=2000, epsilon=8.0, delta=1e-5,
         sigma=1.3562),
]
OPACUS_EPSILON_TOLERANCE = 0.01

BY_ID = {row["id"]: row for row in KNOWN}


def _ids(row):
    return row["id"]


def _event(row, sigma=None, steps=None):
    """The run's ledger as dpbench builds it: its sampler's per-step event, self-composed."""
    sigma = row["sigma"] if sigma is None else sigma
    steps = row["steps"] if steps is None else steps
    if row["N"] is None:  # the source's no-subsampling variant: plain Gaussian releases
        step = dp_event.GaussianDpEvent(sigma)
    else:
        sampler = sampling.PoissonSampler(row["N"], row["B"], seed=0,
                                          padded_batch_size=row["N"])
        step = sampler.dp_event(sigma)
    return dp_event.SelfComposedDpEvent(step, steps)


@functools.lru_cache(maxsize=None)
def _eps(row_id, accountant, scale=1.0, steps=None, grid=1e-3):
    row = {**BY_ID, **{r["id"]: r for r in PRV_ROWS + PRV_SMALL_Q_ROWS}}[row_id]
    delta = row.get("delta", PRV_DELTA)
    budget = accounting.Budget(epsilon=1.0, delta=delta, accountant=accountant,
                               pld_discretization=grid)
    return accounting.epsilon_of(_event(row, row["sigma"] * scale, steps), budget)


def _legacy_eps(row, scale=1.0):
    """The pre-2020 conversion applied to the RDP curve of dpbench's own event."""
    orders = row["orders"]
    acc = rdp_privacy_accountant.RdpAccountant(orders)
    acc.compose(_event(row, row["sigma"] * scale))
    return min(r + math.log(1 / row["delta"]) / (a - 1) for a, r in zip(orders, acc._rdp))


def _within(eps, row):
    if row["tol"] is None:  # PLD pinned on a finer grid than dpbench's default
        return row["value"] - 5e-8 <= eps <= row["value"] * (1 + 1e-4)
    return abs(eps - row["value"]) <= row["tol"]


# ------------------------------------------------------------------------------------- ledger


@pytest.mark.parametrize("row", [r for r in KNOWN if r["N"] is not None], ids=_ids)
def test_sampler_event_is_the_sources_poisson_event(row):
    """No truncation and the same q: dpbench's step event is the one the source accounted."""
    sampler = sampling.PoissonSampler(row["N"], row["B"], seed=0, padded_batch_size=row["N"])
    assert not sampler.truncated
    assert sampler.dp_event(row["sigma"]) == dp_event.PoissonSampledDpEvent(
        row["B"] / row["N"], dp_event.GaussianDpEvent(row["sigma"]))


# ------------------------------------------------------------------------------ known values


@pytest.mark.parametrize("row", [r for r in KNOWN if r["kind"] == "rdp"], ids=_ids)
def test_rdp_reproduces_published_value(row):
    eps = _eps(row["id"], "rdp")
    assert _within(eps, row), (row["id"], eps, row["value"], row["tol"])


@pytest.mark.parametrize("row", [r for r in KNOWN if r["kind"] == "pld"], ids=_ids)
def test_pld_reproduces_published_value(row):
    eps = _eps(row["id"], "pld")
    assert _within(eps, row), (row["id"], eps, row["value"], row["tol"])


def test_pld_rows_reproduce_at_the_source_grid():
    """On TF-Privacy's grid (dp_accounting's PLDAccountant default, 1e-4): all 7 places."""
    row = BY_ID["tfp-example-pld"]
    assert abs(_eps(row["id"], "pld", grid=1e-4) - row["value"]) < 5e-8


@pytest.mark.parametrize("row", [r for r in KNOWN if r["kind"] == "legacy"], ids=_ids)
def test_legacy_values_are_reproduced_and_bound_dpbench(row):
    legacy = _legacy_eps(row)
    assert abs(legacy - row["value"]) <= row["tol"], (row["id"], legacy, row["value"])
    # the modern conversion and the PLD are tighter: never above the published bound
    assert _eps(row["id"], "rdp") <= row["value"] + row["tol"]
    assert _eps(row["id"], "pld") <= row["value"] + row["tol"]


@pytest.mark.parametrize("row", KNOWN, ids=_ids)
def test_pld_is_no_looser_than_rdp(row):
    assert _eps(row["id"], "pld") <= _eps(row["id"], "rdp")


@pytest.mark.parametrize("row", [r for r in KNOWN if r["kind"] != "legacy"]
                         + [BY_ID["abadi2016"], BY_ID["tfp-readme-table-sigma0.7-45ep"],
                            BY_ID["tfp-readme-output-epoch1"]], ids=_ids)
def test_pins_are_tight_enough_to_catch_a_one_percent_sigma_error(row):
    """A 1% wrong sigma must fall outside the tolerance used for the row (the tests can fail)."""
    for scale in (0.99, 1.01):
        if row["kind"] == "legacy":
            eps = _legacy_eps(row, scale)
        else:
            eps = _eps(row["id"], row["kind"], scale)
        assert not _within(eps, row), (row["id"], scale, eps)


@pytest.mark.parametrize("row", PRV_ROWS, ids=_ids)
def test_prv_rows(row):
    """PLD within the PRV estimate's stated error band; PLD <= RDP."""
    pld, rdp = _eps(row["id"], "pld"), _eps(row["id"], "rdp")
    # 2e-3: allowance for dpbench's own (pessimistic) PLD discretization at grid 1e-3.
    assert row["value"] - 2 * PRV_EPS_ERROR <= pld <= row["value"] + 2e-3, (row["id"], pld)
    assert pld <= rdp


@pytest.mark.parametrize("row", PRV_SMALL_Q_ROWS, ids=_ids)
def test_small_q_long_runs_match_prv_on_a_finer_pld_grid(row):
    pld = _eps(row["id"], "pld", grid=1e-5)
    assert row["value"] - 2 * PRV_EPS_ERROR <= pld <= row["value"] + 2e-3, (row["id"], pld)
    assert pld <= _eps(row["id"], "rdp")


@pytest.mark.xfail(strict=True, reason=(
    "dpbench's default Budget.pld_discretization=1e-3 is coarser than the per-step privacy "
    "loss when q=0.001: PLD then exceeds RDP (0.380 vs 0.323 and 0.677 vs 0.470) and the PRV "
    "values (0.306, 0.444) by up to 53%. Sound, but looser than RDP."))
@pytest.mark.parametrize("row", PRV_SMALL_Q_ROWS, ids=_ids)
def test_small_q_long_runs_pld_is_no_looser_than_rdp_at_the_default_grid(row):
    assert _eps(row["id"], "pld") <= _eps(row["id"], "rdp")


# ------------------------------------------------------------------------------- step counts

def _dpbench_total_steps(epochs, n, batch_size):
    return total_steps_for(epochs, n, batch_size)  # what a run trains and accounts


@pytest.mark.parametrize("row", [r for r in KNOWN if "epochs" in r], ids=_ids)
def test_dpbench_counts_the_steps_the_source_counted(row):
    assert _dpbench_total_steps(row["epochs"], row["N"], row["B"]) == row["steps"]


def test_integer_step_counts_matter():
    # Python: 90 / 0.04 rounds to 2250.0, while floor division is exact on the binary 0.04
    # (slightly above 0.04), so 90 // 0.04 == 2249.0. Opacus uses int(90 / 0.04) in
    # test_rdp_accountant and int(90 // 0.04) in test_gdp_accountant (accountants_test.py).
    assert int(90 / 0.04) == 2250 and int(90 // 0.04) == 2249
    assert math.ceil(5.0 / (64 / 10000)) == 782 and int(5.0 / (64 / 10000)) == 781
    row = BY_ID["opacus-rdp"]
    assert row["steps"] == 2250
    assert _dpbench_total_steps(90, row["N"], row["B"]) == 2250
    assert _within(_eps(row["id"], "rdp", steps=2250), row)
    # one step fewer is rejected by the pin: dpbench gives 7.3275 at 2249 steps
    assert not _within(_eps(row["id"], "rdp", steps=2249), row)


def test_dpbench_step_count_has_no_float_rounding_excess():
    # regression: ceil(30 * (50000 / 3000)) == 501 in floating point; the source counts 500
    assert _dpbench_total_steps(30, 50000, 3000) == 500 == int(math.ceil(30 * 50000 / 3000))
    assert _dpbench_total_steps(0.1, 1000, 10) == 10 and _dpbench_total_steps(1.5, 10, 4) == 4


# ------------------------------------------------------------------------------- calibration


@pytest.mark.parametrize("row", OPACUS_CALIBRATION, ids=_ids)
def test_calibration_agrees_with_opacus(row):
    budget = accounting.Budget(epsilon=row["epsilon"], delta=row["delta"], accountant="rdp")
    sampler = sampling.PoissonSampler(row["N"], row["B"], seed=0, padded_batch_size=row["N"])

    def make(sigma):
        return dp_event.SelfComposedDpEvent(sampler.dp_event(sigma), row["steps"])

    # Opacus's sigma spends between target - 0.01 and the target. 1e-3 covers its 4-place
    # rounding (|d eps / d sigma| ~ 9 here, so 5e-5 in sigma ~ 4.5e-4) and dp_accounting's
    # fractional-order excess (~2e-4, see the opacus-rdp row).
    eps_at_opacus_sigma = accounting.epsilon_of(make(row["sigma"]), budget)
    assert row["epsilon"] - OPACUS_EPSILON_TOLERANCE - 1e-3 <= eps_at_opacus_sigma
    assert eps_at_opacus_sigma <= row["epsilon"] + 1e-3
    sigma = accounting.calibrate_noise_multiplier(make, budget)
    assert accounting.epsilon_of(make(sigma), budget) <= row["epsilon"]
    assert abs(sigma - row["sigma"]) < 2e-3


# A fixed seed drawn at random once; DPBENCH_KNOWN_VALUES_SEED=<int> reruns another draw
# (every failure message says which seed and setting failed).
PROPERTY_SEED = int(os.environ.get("DPBENCH_KNOWN_VALUES_SEED", "907035831"))
PROPERTY_CASES = 8
PROPERTY_PLD_CASES = 2


def _property_settings(seed):
    rng = np.random.default_rng(seed)
    pld_at = set(rng.choice(PROPERTY_CASES, PROPERTY_PLD_CASES, replace=False).tolist())
    n = 10_000
    settings = []
    for i in range(PROPERTY_CASES):
        settings.append(dict(
            n=n, batch=int(rng.integers(10, 1001)),           # q in [0.001, 0.1]
            steps=int(rng.integers(50, 2001)),
            epsilon=float(rng.uniform(0.5, 8.0)),
            delta=float(10 ** rng.uniform(-7, -5)),            # < 1/n
            accountant="pld" if i in pld_at else "rdp"))
    return settings


@pytest.mark.parametrize("case", range(PROPERTY_CASES))
def test_calibration_never_overshoots_random_settings(case):
    setting = _property_settings(PROPERTY_SEED)[case]
    where = (f"seed={PROPERTY_SEED} case={case} setting={setting} "
             f"(rerun: DPBENCH_KNOWN_VALUES_SEED={PROPERTY_SEED})")
    budget = accounting.Budget(epsilon=setting["epsilon"], delta=setting["delta"],
                               accountant=setting["accountant"])
    sampler = sampling.PoissonSampler(setting["n"], setting["batch"], seed=0,
                                      padded_batch_size=setting["n"])

    def make(sigma):
        return dp_event.SelfComposedDpEvent(sampler.dp_event(sigma), setting["steps"])

    sigma = accounting.calibrate_noise_multiplier(make, budget)
    eps = accounting.epsilon_of(make(sigma), budget)
    assert eps <= setting["epsilon"], f"overshoot: sigma={sigma} eps={eps}; {where}"
    if sigma > accounting.SIGMA_BRACKET[0]:  # else the target is met even at the smallest sigma
        gap = (setting["epsilon"] - eps) / setting["epsilon"]
        assert gap <= 1e-2, f"sigma={sigma} eps={eps} is {gap:.2%} under the target; {where}"
