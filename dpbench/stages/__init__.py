"""Pipeline stages. Importing this package registers every built-in stage with gin."""
from dpbench.stages.base import (  # noqa: F401
    Hooks, Kind, Mask, OneOffRelease, Privacy, Stage, StageFns, StepContext, apply_mask,
    register_stage, registered_stage_names, stateless)
from dpbench.stages import (  # noqa: F401  (registers the built-in stages)
    clip, drop, gep, grad, nasr, noise, optimize, prune, select, sparsify)
