"""The one place that decides how arrays are laid out over devices (and which threads run a
step on the host's CPU cores).

One 1-D mesh over all devices with axis 'data'. Batches arrive as [micro_steps, micro_batch, ...]
and are sharded over the micro-batch axis, so every micro-batch of the scan is spread over all
devices; parameters, optimizer and stage states are replicated. Because the step is one jitted
global computation, noise drawn from the step key is generated once for the whole mesh.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from threadpoolctl import ThreadpoolController

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


def limit_lapack_threads() -> None:
    """Makes OpenBLAS single-threaded in this process (numpy's and scipy's; jaxlib's CPU LAPACK
    kernels, i.e. the QR, Cholesky and eigh inside a step such as GEP's basis, call scipy's).

    Why: a step already runs on XLA's own thread pool over every core; a LAPACK call inside it
    that starts OpenBLAS's threads makes two pools spin on the same cores. GEP's step on 2 CPU
    cores (Fashion-MNIST, tanh CNN, m=512, k=200) took 200 -> 170 ms at B=256 and 301 -> 225 ms
    at B=1024 with one OpenBLAS thread (alternate steps of one run, quiet machine), and
    1200 -> 360 ms with two other jobs on the cores (docs/speed.md). Process-wide
    because XLA runs the step asynchronously: a limit scoped to the dispatch would not hold
    while the LAPACK call runs. Only OpenBLAS: the speed benchmark's torch rows (MKL, OpenMP) in
    the same process keep their threads. No effect on a GPU, where LAPACK is cuSOLVER."""
    import scipy.linalg.cython_lapack  # noqa: F401  (loads the OpenBLAS jaxlib will call)
    ThreadpoolController().select(internal_api="openblas").limit(limits=1)
