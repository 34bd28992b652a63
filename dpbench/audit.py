"""Empirical privacy audit of a pipeline's own compiled step with a Dirac canary.

``dpbench audit --gin_file=pipelines/X.gin`` (or ``python -m dpbench.audit``) compiles the
pipeline's stages, exactly as configured, on a small model (logistic regression on scikit-learn
digits) and audits the mechanism of ONE step with the canary always sampled (q = 1), which is
the mechanism whose epsilon the compiler calibrates here to ``--claimed_epsilon``:

- The canary is an image that is zero except at pixel 0 (value ``canary_scale``); pixel 0 is
  zeroed in every real and public image, so the canary's gradient lives on the weights of
  pixel 0, coordinates no other example's gradient touches (a Dirac canary).
- ``trials`` one-step runs from the same parameters with fresh keys, half with the canary in the
  batch and half without (add/remove adjacency). The score of a run is the released update
  projected on the canary's gradient direction (optimizer replaced by SGD with learning rate 1:
  post-processing, so the score is the release itself, rescaled).
- Nonparametric bound: a threshold chosen on the first quarter of the runs, then Clopper-Pearson
  bounds (scipy) on its false-positive and true-positive rates from the rest give the
  delta-aware lower bound eps_lb = log((TPR_lb - delta) / FPR_ub) (either direction), holding
  with the reported confidence. A correct mechanism gives eps_lb <= claimed.
- Parametric canary-shift check: the scores are Gaussian with a shift, so their effective noise
  multiplier is sigma_eff = pooled std / |mean shift|; the epsilon of a Gaussian with
  multiplier sigma_eff (dp_accounting) must not exceed the claim. Its lower confidence bound
  above the claim flags the pipeline: this catches factor-2 sigma errors that the
  nonparametric bound, limited to about log(trials), cannot see.

Audit-only settings (documented in the report): augmentation off (it would move the canary
pixel), SGD with learning rate 1, one step, q = 1. Stages that need a public split get digits'.
A release with correlated noise over b bands is compiled on cyclic Poisson over b parts, at
rate 1 in each part (its claim: one participation); the audit's one step sees its first noise
vector, z_0 / c_0, and so cannot test the correlation (tests/stages/test_banded.py does).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats
from absl import logging
from dp_accounting import dp_event

from dpbench import (accounting, cli_args, config, data, models, numerics, records, sampling,
                     sharding)
from dpbench.compiler.facts import RunInputs
from dpbench.compiler.pipeline import compile_pipeline
from dpbench.compiler.rules import PipelineError, sampler_parts
from dpbench.models import losses
from dpbench.stages.base import Stage

AUDIT_BINDINGS = (
    "optimize.optax.optimizer = 'sgd'", "optimize.optax.learning_rate = 1.0",
    "optimize.optax.schedule = 'constant'", "optimize.optax.warmup_steps = 0",
    "grad.per_example.augmult = 1", "grad.per_example.augmentation = 'none'",
)


@dataclasses.dataclass(frozen=True)
class AuditResult:
    claimed_epsilon: float
    delta: float
    noise_multiplier: float
    trials: int
    epsilon_lb: float
    confidence: float
    parametric_epsilon: float
    parametric_epsilon_lb: float
    mean_shift: float
    pooled_std: float
    sensitivity: float
    flagged: bool
    reasons: tuple
    seconds: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def clopper_pearson_epsilon_lb(true_positives: int, positives: int, false_positives: int,
                               negatives: int, delta: float, alpha: float) -> float:
    """eps such that, with confidence >= 1 - alpha, the mechanism is not (eps', delta)-DP for
    any eps' < eps: from an (eps, delta)-DP test, TPR <= e^eps FPR + delta."""
    tpr_lb = scipy.stats.binomtest(true_positives, positives).proportion_ci(
        confidence_level=1 - alpha, method="exact").low
    fpr_ub = scipy.stats.binomtest(false_positives, negatives).proportion_ci(
        confidence_level=1 - alpha, method="exact").high
    if tpr_lb - delta <= 0 or fpr_ub <= 0:
        return 0.0
    return max(0.0, math.log((tpr_lb - delta) / fpr_ub))


def _best_threshold(scores_in, scores_out, delta):
    """The threshold (classify 'in' when score > t) with the best empirical epsilon, placed
    midway to the next observed score so that held-out runs near the edge are not penalized."""
    candidates = np.unique(np.concatenate([scores_in, scores_out]))
    tpr = np.mean(scores_in[None, :] > candidates[:, None], axis=1)
    # floor below one false positive, so that none beats one (ties pick the lowest threshold)
    fpr = np.maximum(np.mean(scores_out[None, :] > candidates[:, None], axis=1),
                     0.5 / len(scores_out))
    with np.errstate(divide="ignore", invalid="ignore"):
        value = np.where(tpr - delta > 0, np.log(np.maximum(tpr - delta, 1e-300) / fpr),
                         -np.inf)
    i = int(np.argmax(value))
    return (candidates[i] + candidates[i + 1]) / 2 if i + 1 < len(candidates) else candidates[i]


def nonparametric_epsilon_lb(scores_in, scores_out, delta: float, alpha: float) -> float:
    """Threshold picked on the first quarter of the runs, Clopper-Pearson bounds on the rest,
    both directions (scores high for 'in', and low for 'in'); a union bound keeps 1 - alpha."""
    half_in, half_out = len(scores_in) // 4, len(scores_out) // 4
    best = 0.0
    for sign in (1.0, -1.0):
        a_in, a_out = sign * scores_in, sign * scores_out
        t = _best_threshold(a_in[:half_in], a_out[:half_out], delta)
        held_in, held_out = a_in[half_in:], a_out[half_out:]
        best = max(best, clopper_pearson_epsilon_lb(
            int(np.sum(held_in > t)), len(held_in), int(np.sum(held_out > t)), len(held_out),
            delta, alpha / 4))  # 2 directions x 2 bounds
    return best


# Below this multiplier the PLD of a Gaussian needs too many points; epsilon decreases with
# sigma, so the epsilon at this floor is a valid lower bound for any smaller sigma.
MIN_AUDIT_SIGMA = 0.25


def gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
    """Epsilon of one Gaussian mechanism (dp_accounting PLD); for multipliers below
    MIN_AUDIT_SIGMA the epsilon at that floor (a lower bound)."""
    budget = accounting.Budget(epsilon=1.0, delta=delta, pld_discretization=1e-4)
    return accounting.epsilon_of(dp_event.GaussianDpEvent(max(noise_multiplier,
                                                              MIN_AUDIT_SIGMA)), budget)


def parametric_check(scores_in, scores_out, delta: float, alpha: float):
    """(epsilon estimate, its lower confidence bound, shift, pooled std) of the canary shift."""
    n_in, n_out = len(scores_in), len(scores_out)
    shift = abs(float(np.mean(scores_in) - np.mean(scores_out)))
    pooled_var = ((n_in - 1) * np.var(scores_in, ddof=1) +
                  (n_out - 1) * np.var(scores_out, ddof=1)) / (n_in + n_out - 2)
    std = math.sqrt(pooled_var)
    dof = n_in + n_out - 2
    # Upper confidence end of sigma_eff: largest std, smallest shift (alpha split in two).
    std_hi = std * math.sqrt(dof / scipy.stats.chi2.ppf(alpha / 4, dof))
    shift_lo = shift - scipy.stats.norm.ppf(1 - alpha / 4) * std * math.sqrt(1 / n_in + 1 / n_out)
    estimate = gaussian_epsilon(std / shift, delta) if shift > 0 else 0.0
    lower = gaussian_epsilon(std_hi / shift_lo, delta) if shift_lo > 0 else 0.0
    return estimate, lower, shift, std


def _canary_setup(num_public: int, num_real: int, seed: int):
    dataset = data.load_dataset(name="digits", validation_size=0, public_size=num_public,
                                split_seed=seed)
    images = np.array(dataset.train.images[:num_real])
    labels = np.array(dataset.train.labels[:num_real])
    public = np.array(dataset.public.images)
    images[:, 0, 0, :] = 0.0   # pixel 0 is the canary's: no real or public example uses it
    public[:, 0, 0, :] = 0.0
    return images, labels, public, dataset.num_classes


class _Canary(NamedTuple):
    """The audit's data: real examples, and the canary (last example) with its label."""

    images: np.ndarray
    labels: np.ndarray
    public: np.ndarray
    num_classes: int
    model: object
    params: object
    label: int


def _canary_problem(num_public: int, num_real: int, seed: int, canary_scale: float):
    images, labels, public, num_classes = _canary_setup(num_public, num_real, seed)
    canary = np.zeros((1,) + images.shape[1:], np.float32)
    canary[0, 0, 0, :] = canary_scale
    model = models.make_model(num_classes, name="logistic")
    params = model.init(jax.random.key(seed), jnp.zeros((1,) + images.shape[1:], jnp.float32))
    # The canary's label is its least likely class, so its loss is far from saturated and its
    # gradient is large (a public choice: it depends on the initial parameters only).
    label = int(jnp.argmin(model.apply(params, jnp.asarray(canary))[0]))
    return _Canary(np.concatenate([images, canary]),
                   np.concatenate([labels, np.full(1, label, np.int32)]), public, num_classes,
                   model, params, label)


def _canary_direction(loss_fn, params, canary: _Canary):
    """The canary's gradient on the pixel-0 weights (no other example's gradient has a
    component there), as a unit vector over the whole parameter tree (host arrays)."""
    grad = jax.grad(loss_fn)(params, jnp.asarray(canary.images[-1]), jnp.int32(canary.label))
    direction = jax.tree.map(lambda p: np.zeros_like(np.asarray(p)), params)
    path = _pixel_weights_path(direction)
    row = np.asarray(_get(grad, path))[0]
    _get(direction, path)[0] = row / np.linalg.norm(row)
    return direction


def _trial_scores(compiled, state0, batches: dict, direction, trials: int, seed: int):
    """One step per trial from state0 with a fresh key, with (True) or without (False) the
    canary; the score is the released sum projected on the canary's direction."""
    params0 = jax.tree.map(np.asarray, jax.device_get(state0.params))
    expected_batch = float(compiled.sampler.expected_batch_size)
    copy = jax.jit(lambda s: jax.tree.map(lambda x: jnp.array(x, copy=True), s))
    key_root = jax.random.key(seed + 2)
    scores = {True: [], False: []}
    membership = np.random.default_rng(seed).permutation(np.arange(trials) % 2 == 0)
    for trial, include in enumerate(membership):
        state = copy(state0)._replace(key=jax.random.fold_in(key_root, trial))
        batch = batches[bool(include)]
        inputs = compiled.stage_inputs(0, stream=trial)  # fresh public host randomness (GIP)
        if inputs:
            batch = dict(batch, **sharding.put_batch({sharding.STAGE_INPUTS: inputs},
                                                     compiled.mesh))
        new_params = jax.device_get(compiled.step(state, batch)[0].params)
        # SGD with learning rate 1: params_1 = params_0 - released / B
        scores[bool(include)].append(-expected_batch * sum(
            float(np.sum((np.asarray(a) - b) * d)) for a, b, d in zip(
                jax.tree.leaves(new_params), jax.tree.leaves(params0),
                jax.tree.leaves(direction))))
    return np.array(scores[True]), np.array(scores[False])


def run_audit(stages: Sequence[Stage], *, claimed_epsilon: float = 3.0, delta: float = 1e-5,
              trials: int = 2000, num_real: int = 255, num_public: int = 512,
              micro_batch_size: int = 64,
              canary_scale: float = 100.0, alpha: float = 0.05, seed: int = 0,
              accountant: str = "pld") -> AuditResult:
    """Audits one step of ``stages`` (see the module docstring); returns the bounds."""
    start = time.time()
    canary = _canary_problem(num_public, num_real, seed, canary_scale)
    shape, n = canary.images.shape[1:], len(canary.labels)  # the canary is example n - 1
    loss_fn = losses.cross_entropy_loss(canary.model)
    parts = sampler_parts(stages)  # a correlated release's own sampler, at rate 1 in its part
    sampler = (sampling.PoissonSampler(n, n, seed=seed, pad_multiple=micro_batch_size)
               if parts == 1 else sampling.CyclicPoissonSampler(
                   n, n / parts, seed=seed, parts=parts, pad_multiple=micro_batch_size,
                   padded_batch_size=n))  # room for the audit's whole batch
    inputs = RunInputs(
        loss_fn=loss_fn, example_shape=shape, sampler=sampler,
        init_params=lambda key: canary.model.init(key, jnp.zeros((1,) + shape, jnp.float32)),
        budget=accounting.Budget(epsilon=claimed_epsilon, delta=delta, accountant=accountant),
        total_steps=1, steps_per_epoch=1, public_images=canary.public,
        num_classes=canary.num_classes,
        linear_apply=canary.model.apply,  # logistic: already linear
        model=canary.model)  # the audit checks the per-example strategy the run would use
    compiled = compile_pipeline(stages, inputs, micro_batch_size=micro_batch_size,
                                mesh=sharding.make_mesh())
    claimed = compiled.epsilon_after(1)
    indices = np.zeros(sampler.padded_batch_size, np.int64)
    indices[:n] = np.arange(n)
    masks = {True: np.arange(sampler.padded_batch_size) < n}
    masks[False] = masks[True] & (np.arange(sampler.padded_batch_size) != n - 1)
    batches = {k: sharding.put_batch(compiled.host_batch(
        canary.images[indices], canary.labels[indices], m, step=None), compiled.mesh)
        for k, m in masks.items()}
    state0 = compiled.init_state(canary.params, jax.random.key(seed + 1),
                                 batches[False] if compiled.needs_release_batch else None)
    direction = _canary_direction(loss_fn, state0.params, canary)
    scores_in, scores_out = _trial_scores(compiled, state0, batches, direction, trials, seed)
    epsilon_lb = nonparametric_epsilon_lb(scores_in, scores_out, delta, alpha)
    param_eps, param_lb, shift, std = parametric_check(scores_in, scores_out, delta, alpha)
    reasons = []
    if epsilon_lb > claimed:
        reasons.append(f"Clopper-Pearson epsilon lower bound {epsilon_lb:.3f} > claimed "
                       f"{claimed:.3f}")
    if param_lb > claimed:
        reasons.append(f"canary shift {shift:.4g} with noise std {std:.4g} is a Gaussian "
                       f"mechanism with epsilon >= {param_lb:.3f} > claimed {claimed:.3f}")
    return AuditResult(
        claimed_epsilon=claimed, delta=delta, noise_multiplier=compiled.noise_multiplier,
        trials=trials, epsilon_lb=epsilon_lb, confidence=1 - alpha,
        parametric_epsilon=param_eps, parametric_epsilon_lb=param_lb, mean_shift=shift,
        pooled_std=std, sensitivity=compiled.sensitivity, flagged=bool(reasons),
        reasons=tuple(reasons), seconds=time.time() - start)


def _pixel_weights_path(params) -> tuple:
    """The path of the first layer's kernel (input features x outputs) in a logistic model."""
    paths = [path for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
             if np.ndim(leaf) == 2]
    if len(paths) != 1:
        raise ValueError("the audit model must have exactly one weight matrix")
    return tuple(p.key for p in paths[0])


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def flag_parser() -> cli_args.FlagParser:
    """``dpbench audit``'s flags."""
    parser = cli_args.FlagParser("dpbench audit", "audit a pipeline's compiled step with a "
                                 "canary: an empirical epsilon lower bound")
    cli_args.add_gin_flags(parser)
    parser.add_argument("--trials", type=int, default=2000,
                        help="one-step runs (half with the canary)")
    parser.add_argument("--claimed_epsilon", type=float, default=3.0,
                        help="the audited step's target epsilon")
    parser.add_argument("--audit_delta", type=float, default=None,
                        help="delta of the claim and of the bound (default: the config's "
                             "budget.delta, e.g. DELTA in gin/data/digits.gin)")
    parser.add_argument("--audit_seed", type=int, default=0,
                        help="seed of the audit's data, keys and assignment")
    parser.add_argument("--out", default=None, help="write the audit report (JSON) here")
    parser.add_argument("--board", action="store_true",
                        help="audit the board's column instead: every method of --protocol at "
                             "every epsilon it declares, as each method.json says, one report "
                             "per (method, epsilon) in --audits_dir")
    parser.add_argument("--protocol", default=str(config.REPO_ROOT / "leaderboard" /
                                                  "protocol.json"),
                        help="with --board: the protocol whose methods and epsilons are audited")
    parser.add_argument("--audits_dir", default=None,
                        help="with --board: where the reports go (default: the audits/ folder "
                             "beside --protocol)")
    return parser


def _configured_delta(claimed_epsilon: float) -> float:
    """The parsed config's budget.delta: the audit claims the delta the run would claim."""
    try:
        return accounting.Budget(epsilon=claimed_epsilon).delta
    except (TypeError, RuntimeError, ValueError) as e:  # gin: budget.delta left unbound
        raise config.ConfigError(f"the config binds no budget.delta ({e}); bind it (e.g. "
                                 "--gin_bindings='DELTA = 1e-5') or give --audit_delta") from e


def _audit_one(gin_files, bindings, claimed_epsilon: float, delta, out, trials: int,
               seed: int) -> bool:
    """One pipeline's audit: parses its config, runs it, writes (``out``) and prints the
    report; returns whether it flagged. Bad input raises (``audit_main`` exits 2)."""
    config.parse_config(list(gin_files), list(bindings) + list(AUDIT_BINDINGS))
    name, stages = config.pipeline_stages()
    result = run_audit(stages, claimed_epsilon=claimed_epsilon,
                       delta=_configured_delta(claimed_epsilon) if delta is None else delta,
                       trials=trials, seed=seed)
    report = dict(pipeline=name, gin_files=list(gin_files), gin_bindings=list(bindings),
                  audit_settings=list(AUDIT_BINDINGS), **result.to_dict(),
                  versions=numerics.versions())
    text = records.to_json(report)
    if out:
        records.atomic_write_text(out, text)
    print(text)
    logging.info("audit of %s: claimed epsilon %.3f, eps_lb %.3f (confidence %.2f), "
                 "parametric epsilon %.3f (lower bound %.3f)%s", name, result.claimed_epsilon,
                 result.epsilon_lb, result.confidence, result.parametric_epsilon,
                 result.parametric_epsilon_lb,
                 ": FLAGGED: " + "; ".join(result.reasons) if result.flagged else "")
    if result.flagged:  # the report is written first: it is the evidence
        print(f"dpbench: audit of {name} FLAGGED (its measured epsilon exceeds the claim "
              f"{result.claimed_epsilon:.3f}): " + "; ".join(result.reasons), file=sys.stderr)
    return result.flagged


def audit_main(args) -> None:
    """``dpbench audit --gin_file=pipelines/X.gin [--gin_bindings=...]``: prints (and with
    --out writes) the report; ``dpbench audit --board``: the board's column (audit_board.py).
    Exits 1 when an audit flags, 2 on bad input."""
    bad = (config.ConfigError, PipelineError, accounting.BudgetError, ValueError)
    if args.board:
        from dpbench import audit_board
        protocol = Path(args.protocol)
        try:
            sys.exit(audit_board.run_board(
                protocol, args.audits_dir or protocol.parent / "audits",
                lambda gin_file, bindings, eps, delta, out: _audit_one(
                    [gin_file], bindings, eps, delta, out, args.trials, args.audit_seed)))
        except bad as e:
            print(f"dpbench: error: {e}", file=sys.stderr)
            sys.exit(2)
    if not args.gin_file:
        print("dpbench: error: give --gin_file, e.g. pipelines/dpsgd/pipeline.gin (or --board)",
              file=sys.stderr)
        sys.exit(cli_args.BAD_INPUT_EXIT)
    try:
        flagged = _audit_one(args.gin_file, args.gin_bindings, args.claimed_epsilon,
                             args.audit_delta, args.out, args.trials, args.audit_seed)
    except bad as e:
        print(f"dpbench: error: {e}", file=sys.stderr)
        sys.exit(2)
    if flagged:
        sys.exit(1)


def run(argv=None) -> None:
    """``dpbench audit [flags]`` (``argv``: its flags, default the process's)."""
    args = flag_parser().parse_args(sys.argv[1:] if argv is None else argv)
    cli_args.start_logging()
    audit_main(args)


if __name__ == "__main__":
    run()
