"""The one place that decides how arrays are laid out over devices.

One 1-D mesh over all devices with axis 'data'. Batches arrive as [micro_steps, micro_batch, ...]
and are sharded over the micro-batch axis, so every micro-batch of the scan is spread over all
devices; parameters, optimizer and stage states are replicated. Because the step is one jitted
global computation, noise drawn from the step key is generated once for the whole mesh.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"
# The batch entry with the stages' public host randomness (GIP): replicated, never sharded.
STAGE_INPUTS = "stage_inputs"


def make_mesh(devices=None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    return Mesh(np.asarray(devices), (DATA_AXIS,))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """For arrays shaped [micro_steps, micro_batch, ...]: shard the micro-batch axis."""
    return NamedSharding(mesh, PartitionSpec(None, DATA_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def put_batch(batch: dict, mesh: Mesh) -> dict:
    """Examples sharded over the micro-batch axis; the stages' host inputs replicated."""
    return {name: jax.device_put(value, replicated(mesh) if name == STAGE_INPUTS
                                 else batch_sharding(mesh))
            for name, value in batch.items()}


def put_replicated(tree, mesh: Mesh):
    return jax.device_put(tree, replicated(mesh))
