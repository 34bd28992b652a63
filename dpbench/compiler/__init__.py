"""The compiler: (pipeline, model, sampler, budget, mesh) -> one jitted, sharded, accounted step.

Four named phases over a frozen plan:

0. rules (``rules.py``, run once): :func:`validate_pipeline` checks the stages' declarations (kinds,
   bounds, costs; errors name the stage and the rule) and derives the sensitivity.
1. bind (``bind.py``): each stage's ``make`` gets the public run facts it names in ``needs``
   (``facts.py``: the one record of run facts, derived from :class:`RunInputs`) and returns
   its step functions; the per-example strategy (materialized or book-keeping) is chosen from
   the stage chain. Host only, no jit.
2. account (``ledger.py``): the run's privacy ledger (one-off releases, the per-step Gaussian
   release, stage mechanisms such as GIP's index release) and the noise multipliers calibrated
   to the target (epsilon, delta). Host only, no jit; testable on its own.
3. lower (``lower.py``; the clipped sum of either strategy in ``per_example.py`` and
   ``bookkeeping.py``): the step function (begin-step, clipped sum, batch stages and release,
   normalize, optimizer, public masks, EMA) and the initial state; :func:`compile_pipeline`
   (``pipeline.py``) checks their shapes with jax.eval_shape and jits the step on the mesh.

One clipped-sum function (:func:`masked_sum`) serves the step and the one-off release.
"""

from dpbench.compiler.bind import bind
from dpbench.compiler.facts import RUN_FACTS, RunFacts, RunInputs
from dpbench.compiler.plan import Plan, StepOptions
from dpbench.compiler.ledger import Accounting, account, step_mechanisms_of
from dpbench.compiler.lower import STAGE_INPUTS, Lowered, TrainState, lower, one_off_release
from dpbench.compiler.per_example import EXAMPLE_KEYS, masked_sum
from dpbench.compiler.pipeline import CompiledPipeline, account_only, compile_pipeline
from dpbench.compiler.rules import PipelineError, ValidatedPipeline, validate_pipeline

__all__ = ["Accounting", "CompiledPipeline", "EXAMPLE_KEYS", "Lowered", "PipelineError", "Plan",
           "StepOptions",
           "RUN_FACTS", "RunFacts", "RunInputs", "STAGE_INPUTS", "TrainState",
           "ValidatedPipeline", "account", "account_only", "bind",
           "compile_pipeline", "lower", "masked_sum", "one_off_release", "step_mechanisms_of",
           "validate_pipeline"]
