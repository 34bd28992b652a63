"""Phase 2 of the compiler (host only, no jit): the run's privacy ledger (one-off releases,
the per-step Gaussian release, stage mechanisms) and the noise multipliers calibrated to the
target (epsilon, delta)."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

from dp_accounting import dp_event

from dpbench import accounting
from dpbench.stages.base import Stage
from dpbench.compiler.plan import Plan
from dpbench.compiler.rules import PipelineError, describe_stage


def _ledger(pre_mechanisms, step_mechanisms, steps: int,
            participations: Callable[[int], int]) -> list:
    """One-off releases, then every per-step mechanism once per step (EVERY_STEP) or once per
    participation of an example (EVERY_PARTICIPATION: the sampler's ``participations``);
    composition commutes, so a step's mechanisms are grouped by kind (accounting.Mechanism)."""
    return list(pre_mechanisms) + [dataclasses.replace(
        m, count=participations(steps) if m.schedule == accounting.EVERY_PARTICIPATION else steps)
        for m in step_mechanisms if steps > 0]


def check_sampler(plan: Plan, sampler) -> None:
    """A release whose noise has memory (``Privacy.correlation``) runs only on a sampler its
    privacy is proven for: one of its ``samplers`` whose ``min_separation`` is its bands."""
    for i in plan.validated.release_indices:
        stage, correlation = plan.stages[i], plan.stages[i].privacy.correlation
        if correlation is None or correlation.bands == 1:
            continue
        name = getattr(sampler, "name", type(sampler).__name__)
        separation = getattr(sampler, "min_separation", 1)
        if name not in correlation.samplers or separation != correlation.bands:
            raise PipelineError(
                f"{describe_stage(i, stage)} correlates its noise over {correlation.bands} "
                f"steps (bands), which is private only on {' or '.join(sorted(correlation.samplers))} "
                f"sampling over {correlation.bands} parts (an example drawn at most once every "
                f"{correlation.bands} steps); this run's sampler is {name} with "
                f"{separation} part(s): bind sampler.parts = {correlation.bands}. The proof it "
                f"relies on: {correlation.equivalence or 'none stated'}")


def _correlation_details(plan: Plan, releases: list) -> dict:
    """The correlated noise of the release(s) that declare it, for the statement (one band is
    independent noise: nothing to state)."""
    out = {}
    for i in releases:
        correlation = plan.stages[i].privacy.correlation
        if correlation is not None and correlation.bands > 1:
            out = dict(stage=plan.stages[i].name, bands=correlation.bands,
                       equivalence=correlation.equivalence,
                       **{k: v for k, v in plan.fns[i].derived.items()
                          if k.startswith("strategy_")})
    return {"correlated_noise": out} if out else {}


def _stage_costs(plan: Plan) -> list:
    """(stage, facts, DpEvent per step) for every stage that declares a cost."""
    out = []
    for stage, fns in zip(plan.stages, plan.fns):
        if stage.privacy.cost is None:
            continue
        event = stage.privacy.cost(plan.run_facts.for_stage(stage))
        if not isinstance(event, dp_event.DpEvent):
            raise PipelineError(f"stage '{stage.name}' declares a DP cost, but its cost "
                                f"returned {event!r} instead of a dp_accounting DpEvent")
        if isinstance(event, dp_event.NoOpDpEvent):  # declared to read no private value
            continue
        out.append((stage, dict(stage.options, **fns.derived), event))
    return out


def step_mechanisms_of(plan: Plan, sampler) -> Callable[[float], list]:
    """sigma -> one step's ledger lines: the Gaussian release(s) of the clipped sum, then the
    per-step cost of every other mechanism a stage declares (e.g. GIP's index release)."""
    validated = plan.validated
    clip = validated.stages[validated.clip_index]
    releases = [validated.stages[i] for i in validated.release_indices]
    # each example is in the clipped sum only at the steps that can sample it
    schedule, parts_fact = ((accounting.EVERY_STEP, {}) if sampler.min_separation == 1 else
                       (accounting.EVERY_PARTICIPATION, {"sampler_parts": sampler.min_separation}))
    correlated = _correlation_details(plan, validated.release_indices)
    # Each release adds noise to every separately bounded part of the clipped value (GEP: 2):
    # k Gaussians of one batch with one sigma, each scaled to its own sensitivity, compose to
    # one Gaussian with multiplier sigma / sqrt(k).
    parts = len(releases) * clip.privacy.parts
    lipschitz = {s.name: s.privacy.lipschitz for s in validated.stages[validated.clip_index + 1:]
                 if s.privacy.lipschitz is not None and not s.is_release}
    clip_facts = dict(clip.options, **plan.fns[validated.clip_index].derived)
    others = _stage_costs(plan)
    note = clip_facts.get("statement_note")  # public inputs of the clip, in words (GEP's basis)

    def mechanisms(sigma: float) -> list:
        effective = sigma / math.sqrt(parts)
        gaussian = accounting.Mechanism(
            name="Gaussian release of the clipped per-example gradient sum",
            source=" + ".join([clip.name] + [r.name for r in releases]),
            schedule=schedule, event=sampler.dp_event(effective), count=1,
            details=dict(noise_multiplier=sigma, parts=parts,
                         effective_noise_multiplier=effective, clip_stage=clip.name,
                         clip_l2_bound=clip.privacy.l2_bound,
                         part_bounds=clip_facts.get("part_bounds"),
                         lipschitz_factors=lipschitz, l2_sensitivity=validated.sensitivity,
                         noise_stddev=sigma * validated.sensitivity,
                         **({"clip_note": note} if note else {}), **correlated, **parts_fact))
        return [gaussian] + [accounting.Mechanism(
            name=facts.get("mechanism", f"private selection by {stage.name}"),
            source=stage.name, schedule=accounting.EVERY_STEP, event=event, count=1,
            details=facts) for stage, facts, event in others]

    return mechanisms


def _pre_mechanisms(stage: Optional[Stage], sigma: Optional[float], sampler) -> tuple:
    """The ledger line of a one-off release before training (DP-SNIP), if the pipeline has one."""
    if stage is None:
        return ()
    release = stage.privacy.one_off_release
    return (accounting.Mechanism(
        name=f"Gaussian release of {release.released}", source=stage.name,
        schedule=accounting.ONCE, event=sampler.dp_event(sigma), count=1,
        details=dict(noise_multiplier=sigma, l2_sensitivity=release.l2_bound,
                     noise_stddev=sigma * release.l2_bound,
                     epsilon_fraction=release.epsilon_fraction)),)


@dataclasses.dataclass(frozen=True)
class Accounting:
    """The run's noise and ledger; the same object answers every epsilon question."""

    noise_multiplier: float
    init_noise_multiplier: Optional[float]   # the one-off release's (DP-SNIP), if any
    pre_mechanisms: tuple
    step_mechanisms: Callable[[float], list]
    budget: accounting.Budget
    total_steps: int
    participations: Callable[[int], int]  # the sampler's: an example's steps among the first

    def ledger(self, steps: Optional[int] = None) -> list:
        """The run's privacy ledger after ``steps`` steps: every mechanism with its count."""
        steps = self.total_steps if steps is None else steps
        return _ledger(self.pre_mechanisms, self.step_mechanisms(self.noise_multiplier), steps,
                       self.participations)

    def run_event(self, steps: Optional[int] = None) -> dp_event.DpEvent:
        return accounting.ledger_event(self.ledger(steps))

    def event_at(self, sigma: float) -> dp_event.DpEvent:
        """The whole run's DpEvent had the training noise multiplier been ``sigma``: the
        function calibration solves (the one-off releases keep their own noise)."""
        return accounting.ledger_event(_ledger(self.pre_mechanisms, self.step_mechanisms(sigma),
                                               self.total_steps, self.participations))

    def epsilon_after(self, steps: int) -> float:
        if steps == 0 and not self.pre_mechanisms:
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf
        return accounting.epsilon_of(self.run_event(steps), self.budget)

    def steps_within_budget(self) -> int:
        """The largest number of steps (<= total_steps) whose epsilon is <= the target: with a
        calibrated sigma, total_steps; with a given one the run stops there (-1: the one-off
        release alone exceeds the budget)."""
        if self.epsilon_after(self.total_steps) <= self.budget.epsilon:
            return self.total_steps
        if self.epsilon_after(0) > self.budget.epsilon:
            return -1
        low, high = 0, self.total_steps  # epsilon_after(low) <= target < epsilon_after(high)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self.epsilon_after(mid) <= self.budget.epsilon else (
                low, mid)
        return low


def account(plan: Plan, sampler, budget: accounting.Budget, total_steps: int,
            noise_multiplier: Optional[float] = None) -> Accounting:
    """The ledger and the noise. ``noise_multiplier=None`` calibrates sigma to the budget: a
    one-off release (DP-SNIP) first gets the noise that alone spends its share of epsilon, then
    the training sigma is calibrated on the composition of everything. A given sigma is used as
    is (tests, non-private baselines); its epsilon may then exceed the target."""
    check_sampler(plan, sampler)
    step_mechanisms = step_mechanisms_of(plan, sampler)
    one_off = next((s for s in plan.stages if s.privacy.one_off_release is not None), None)
    if noise_multiplier is not None:
        sigma = float(noise_multiplier)
        if sigma < 0 or (sigma > 0 and math.isinf(plan.sensitivity)):
            raise ValueError(f"noise multiplier {sigma} with sensitivity {plan.sensitivity} "
                             "gives no valid noise scale")
        init_sigma = sigma if one_off is not None else None
        return Accounting(sigma, init_sigma, _pre_mechanisms(one_off, init_sigma, sampler),
                          step_mechanisms, budget, total_steps, sampler.participations)
    if math.isinf(plan.sensitivity):
        raise PipelineError("the clip bound is infinite, so no noise can make the release "
                            "private; set clip.global_l2.l2_bound to a finite value")
    budget.validate(sampler.dataset_size)
    init_sigma = None
    if one_off is not None:
        share = one_off.privacy.one_off_release.epsilon_fraction
        init_sigma = accounting.calibrate_noise_multiplier(
            sampler.dp_event, dataclasses.replace(budget, epsilon=share * budget.epsilon))
    draft = Accounting(math.nan, init_sigma, _pre_mechanisms(one_off, init_sigma, sampler),
                       step_mechanisms, budget, total_steps, sampler.participations)
    sigma = accounting.calibrate_noise_multiplier(draft.event_at, budget)
    return dataclasses.replace(draft, noise_multiplier=sigma)
