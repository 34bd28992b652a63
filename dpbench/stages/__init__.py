"""Pipeline stages. Importing this package registers every built-in stage with gin."""

from dpbench.stages.base import (  # noqa: F401
    Kind, Stage, StageInfo, StepContext, register_stage, registered_stage_names)
from dpbench.stages import clip, drop, grad, noise, optimize, prune, select, sparsify  # noqa: F401,E501
