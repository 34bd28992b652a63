"""Where a run's stages come from: the provenance of every stage that is not dpbench's own
(the run record lists it; the compiler verifies those stages' declarations before training)."""

from __future__ import annotations

from dpbench import records
from dpbench.stages.base import registered_stage


def stage_sources(stage_names) -> list:
    """Provenance of every stage of a run that is not one of dpbench's own: its registered
    name, the module that defines it, that module's file and the file's sha256 (a user's stage
    lives outside the repo, so the git commit does not pin it)."""
    out = []
    for name in dict.fromkeys(stage_names):
        source = records.outside_source(registered_stage(name))
        if source is not None:
            out.append(dict(stage=name, **source))
    return out
