"""The optimizer stage: RELEASED (already divided by the expected batch size) -> UPDATES."""

from __future__ import annotations

import optax

from dpbench.stages.base import Kind, Stage, StageFns, register_stage

OPTIMIZERS = ("sgd", "momentum", "adam")
SCHEDULES = ("constant", "cosine", "warmup_cosine", "linear")


def make_schedule(schedule: str, learning_rate: float, total_steps: int, warmup_steps: int):
    if schedule == "constant":
        return optax.constant_schedule(learning_rate)
    if schedule == "cosine":
        return optax.cosine_decay_schedule(learning_rate, decay_steps=max(total_steps, 1))
    if schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, learning_rate, warmup_steps=warmup_steps, decay_steps=max(total_steps, 1))
    if schedule == "linear":
        return optax.linear_schedule(learning_rate, 0.0, transition_steps=max(total_steps, 1))
    raise ValueError(f"optimize.optax.schedule must be one of {SCHEDULES}, got {schedule!r}")


def make_optimizer(optimizer: str, schedule, momentum: float, nesterov: bool):
    if optimizer == "sgd":
        return optax.sgd(schedule)
    if optimizer == "momentum":
        return optax.sgd(schedule, momentum=momentum, nesterov=nesterov)
    if optimizer == "adam":
        return optax.adam(schedule)
    raise ValueError(f"optimize.optax.optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")


@register_stage("optimize.optax")
def optax_optimizer(optimizer: str = "momentum", learning_rate: float = 1.0,
                    momentum: float = 0.9, nesterov: bool = False, schedule: str = "constant",
                    warmup_steps: int = 0) -> Stage:
    """An optax optimizer on the released, normalized gradient; its state is public."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimize.optax.optimizer must be one of {OPTIMIZERS}, "
                         f"got {optimizer!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"optimize.optax.schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not learning_rate > 0:
        raise ValueError(f"optimize.optax.learning_rate must be > 0, got {learning_rate!r}")
    options = dict(optimizer=optimizer, learning_rate=learning_rate, momentum=momentum,
                   nesterov=nesterov, schedule=schedule, warmup_steps=warmup_steps)

    def make(facts) -> StageFns:
        transform = make_optimizer(
            optimizer, make_schedule(schedule, learning_rate, facts.total_steps, warmup_steps),
            momentum, nesterov)

        def init(params, key):
            del key
            return transform.init(params)

        def apply(grads, state, ctx):
            return transform.update(grads, state, ctx.params)

        return StageFns(apply=apply, init=init)

    return Stage(name="optimize.optax", kind_in=Kind.RELEASED, kind_out=Kind.UPDATES,
                 make=make, needs={"total_steps"}, options=options)
