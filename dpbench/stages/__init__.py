"""Pipeline stages. Importing this package registers every built-in stage with gin."""

from dpbench.stages.base import (  # noqa: F401
    Kind, Stage, StageInfo, StepContext, register_stage, registered_stage_names)
from dpbench.stages import (  # noqa: F401  (registers the built-in stages)
    clip, drop, gep, grad, nasr, noise, optimize, prune, select, sparsify)
