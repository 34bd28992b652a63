"""Phase 3 of the compiler: the step function (begin-step, clipped sum, batch stages and
release, normalize, optimizer, public masks, EMA) and the initial state."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dpbench import sharding
from dpbench.stages.base import Kind, Mask, StepContext, apply_mask
from dpbench.ops import add_gaussian_noise, clip_to_l2, zero_if_nonfinite
from dpbench.compiler.plan import Plan, StepOptions
from dpbench.compiler.ledger import Accounting
from dpbench.compiler.per_example import clipped_sum_fn, masked_sum


# Keys for stage initialization and for steps come from disjoint subtrees of the run key, so no
# step's noise key can coincide with a stage's initialization key.
_STEP_DOMAIN, _INIT_DOMAIN, _RELEASE_DOMAIN = 0, 1, 2
STAGE_INPUTS = sharding.STAGE_INPUTS  # the batch entry with the stages' host randomness


class TrainState(NamedTuple):
    params: Any
    stage_states: tuple
    ema_params: Any
    step: jax.Array   # int32 scalar: number of steps taken (empty batches count)
    key: jax.Array    # the run's base key; step keys are fold_in(key, step), never reused


def _post_release(plan: Plan, value, states, ctx, upto: int):
    """Public post-processing declared by stages before position ``upto``, in pipeline order:
    their public masks (Mask.RELEASED) and after_release hooks (GEP's reconstruction)."""
    for j in range(upto):
        if Mask.RELEASED in plan.stages[j].privacy.public_mask:
            value = apply_mask(value, states[j]["mask"])
        if plan.fns[j].hooks.after_release is not None:
            value = plan.fns[j].hooks.after_release(value, states[j], ctx)
    return value


class Lowered(NamedTuple):
    step: Callable        # (TrainState, batch) -> (TrainState, metrics), not yet jitted
    init_state: Callable  # (params, key, release_batch=None) -> TrainState
    # (TrainState, batch) -> (the noise-free clipped sum at the step's begin-step state, its aux
    # {"loss", "nonfinite"}), exactly as the step computes them: the sum is what the release's
    # sensitivity bounds (for tests and audits; never released as is).
    clipped_sum: Callable
    # TrainState -> the parameters a run evaluates and reports: the debiased EMA, or the params
    evaluation_params: Callable


def lower(plan: Plan, acct: Accounting, *, ema_decay: float = 0.0,
          fidelity_diagnostics: bool = False, options: StepOptions = StepOptions()) -> Lowered:
    """The step function and the initial state of a bound, accounted pipeline, its clipped sum
    lowered as ``options`` say."""
    loss_fn = plan.run_facts.get("loss_fn")
    expected_batch_size = float(plan.run_facts.get("expected_batch_size"))
    step = _make_step(plan, acct, loss_fn, expected_batch_size, ema_decay, fidelity_diagnostics,
                      options)
    begin_step, clipped_sum = begin_step_fn(plan), clipped_sum_fn(plan, options)

    def clipped_sum_at(state: TrainState, batch: dict):
        key = _step_key(state)
        return clipped_sum(state.params, begin_step(state, key), state.step, key, batch)

    return Lowered(step=step, init_state=_make_init_state(plan, acct, loss_fn, ema_decay),
                   clipped_sum=clipped_sum_at, evaluation_params=_evaluation_params_fn(ema_decay))


def _evaluation_params_fn(ema_decay: float) -> Callable:
    """The parameter EMA is optax's, started at zero and debiased (Adam's correction): its
    weights over the steps taken sum to one and none is on the initial parameters. Why: an EMA
    started AT the initial parameters without correction keeps decay^t of its weight on them
    (58% for decay 0.999 after 538 steps), which made board v2's long-memory trials junk."""
    if ema_decay == 0:
        return lambda state: state.params
    return lambda state: optax.tree_utils.tree_bias_correction(
        state.ema_params.ema, ema_decay, state.ema_params.count)


def _step_key(state: TrainState) -> jax.Array:
    return jax.random.fold_in(jax.random.fold_in(state.key, _STEP_DOMAIN), state.step)


def _make_step(plan, acct, loss_fn, expected_batch_size, ema_decay, fidelity_diagnostics,
               options):
    begin_step = begin_step_fn(plan)
    clipped_sum = clipped_sum_fn(plan, options)
    batch_stages = _batch_stages_fn(plan, acct, expected_batch_size)

    def step_fn(state: TrainState, batch: dict):
        key = _step_key(state)
        states = begin_step(state, key)                     # public inputs only, once per step
        clipped, aux = clipped_sum(state.params, states, state.step, key, batch)
        updates, states, released, ctx = batch_stages(clipped, state, states, key,
                                                      batch.get(STAGE_INPUTS, {}))
        for j, stage in enumerate(plan.stages):             # masked coordinates do not move
            if Mask.UPDATES in stage.privacy.public_mask:
                updates = apply_mask(updates, states[j]["mask"])
        params = optax.apply_updates(state.params, updates)
        ema = state.ema_params if ema_decay == 0 else optax.ema(ema_decay).update(
            params, state.ema_params)[1]
        metrics = _diagnostics(aux, batch["mask"], updates)
        if fidelity_diagnostics:
            metrics.update(_fidelity(plan, clipped, released, states, ctx, expected_batch_size))
        return TrainState(params, tuple(states), ema, state.step + 1, state.key), metrics

    return step_fn


def begin_step_fn(plan: Plan):
    """Per-example stages' begin_step, once per step, from public inputs only (params, public
    data, the step key): GEP's basis, DP-SSGD's drop mask, RS's epoch mask."""
    # Its key: position `padded` in the stage's per-example key space, which no example uses.
    padded = plan.run_facts.get("padded_batch_size")

    def begin_step(state: TrainState, step_key) -> list:
        states = list(state.stage_states)
        for i in range(plan.num_per_example):
            fn = plan.fns[i].hooks.begin_step
            if fn is not None:
                ctx = StepContext(params=state.params, step=state.step,
                                  key=jax.random.fold_in(jax.random.fold_in(step_key, i), padded))
                states[i] = fn(states[i], ctx)
        return states

    return begin_step


def _batch_stages_fn(plan: Plan, acct: Accounting, expected_batch_size: float):
    """The stages after the per-example ones, in order: aggregate stages, the release (then
    the public post-processing of earlier stages), released stages, the division by the
    EXPECTED batch size, the optimizer. Returns (updates, states, released, release ctx)."""
    first = plan.num_per_example
    # 0 for the non-private baseline (sigma 0), where the sensitivity may be infinite (no clip)
    noise_stddev = 0.0 if acct.noise_multiplier == 0 else acct.noise_multiplier * plan.sensitivity

    def batch_stages(value, state: TrainState, states: list, step_key, host_inputs):
        released = release_ctx = None
        for i in range(first, len(plan.stages)):
            stage = plan.stages[i]
            if stage.kind_out == Kind.UPDATES and released is None:
                # Divide by the EXPECTED batch size: the realized one is private.
                value = jax.tree.map(lambda v: v / expected_batch_size, value)
                released = value
            ctx = StepContext(params=state.params, step=state.step,
                              key=jax.random.fold_in(step_key, i),
                              noise_stddev=noise_stddev,
                              host_inputs=host_inputs.get(str(i)))
            value, states[i] = plan.fns[i].apply(value, state.stage_states[i], ctx)
            if stage.is_release:
                release_ctx = ctx
                value = _post_release(plan, value, states, ctx, upto=i)
        return value, states, released, release_ctx

    return batch_stages


def _diagnostics(aux: dict, mask, updates) -> dict:
    """Non-private diagnostics computed from the private batch; never fed back into training."""
    count = jnp.sum(mask)
    nonfinite = aux["nonfinite"]
    return {
        "train_loss": aux["loss"] / jnp.maximum(count - nonfinite, 1),
        # True when every real example of the batch had a non-finite gradient.
        "all_nonfinite": (count > 0) & (nonfinite >= count),
        "update_norm": optax.tree.norm(updates),
        "nonfinite_examples": nonfinite,  # per-example gradients zeroed before the clip
    }


def _fidelity(plan: Plan, clean, released, states, ctx, expected_batch_size: float) -> dict:
    """Cosine between the released update and the clean mean of clipped per-example gradients,
    and the norm of their difference relative to the clean one (NON-PRIVATE benchmark output:
    the clean sum never leaves this function except through them). The clean sum is mapped to
    parameter space by the per-example stages' public post-processing (masks, GEP's
    reconstruction); selection and noise are excluded."""
    clean = _post_release(plan, clean, states, ctx, upto=plan.num_per_example)
    clean = jax.tree.map(lambda v: v / expected_batch_size, clean)
    flat_clean = jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(clean)])
    flat_released = jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(released)])
    clean_norm = jnp.linalg.norm(flat_clean)
    tiny = jnp.finfo(flat_clean.dtype).tiny
    return {
        "fidelity_cosine": jnp.dot(flat_clean, flat_released) / jnp.maximum(
            clean_norm * jnp.linalg.norm(flat_released), tiny),
        "noise_to_signal": jnp.linalg.norm(flat_released - flat_clean) / jnp.maximum(
            clean_norm, tiny),
    }


def one_off_release(plan: Plan, acct: Accounting, loss_fn, i: int, params, key, batch):
    """Stage i's one-off release: each example's declared value (OneOffRelease.value of its
    gradient, e.g. DP-SNIP's connection scores) clipped, the masked sum, Gaussian noise."""
    release = plan.stages[i].privacy.one_off_release

    def per_example(example, position):
        del position
        grads = jax.grad(loss_fn)(params, example["image"], example["label"])
        value = clip_to_l2(release.value(params, grads), release.l2_bound)
        return zero_if_nonfinite(value)[0]  # a non-finite value is zeroed, as in the step

    total = masked_sum(per_example, batch)
    return add_gaussian_noise(total, key, acct.init_noise_multiplier * release.l2_bound)


def _make_init_state(plan: Plan, acct: Accounting, loss_fn: Callable, ema_decay: float):
    def init_state(params, key, release_batch=None) -> TrainState:
        init_root = jax.random.fold_in(key, _INIT_DOMAIN)
        states = []
        for i, (stage, fns) in enumerate(zip(plan.stages, plan.fns)):
            stage_key = jax.random.fold_in(init_root, i)
            if stage.privacy.one_off_release is None:
                states.append(fns.init(params, stage_key))
                continue
            if release_batch is None:
                raise ValueError(f"stage '{stage.name}' releases private data before "
                                 "training: pass init_state(..., release_batch=...) with a "
                                 "batch drawn by the run's sampler")
            release_key = jax.random.fold_in(jax.random.fold_in(key, _RELEASE_DOMAIN), i)
            released = one_off_release(plan, acct, loss_fn, i, params, release_key,
                                        release_batch)
            states.append(stage.privacy.one_off_release.init(params, released, stage_key))
        for stage, state in zip(plan.stages, states):
            if Mask.PARAMS in stage.privacy.public_mask:  # e.g. pre-pruning zeroes its weights once
                params = apply_mask(params, state["mask"])
        return TrainState(params=params, stage_states=tuple(states),
                          ema_params=optax.ema(ema_decay).init(params) if ema_decay > 0 else (),
                          step=jnp.zeros((), jnp.int32), key=key)

    return init_state
