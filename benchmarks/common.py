"""What the speed benchmark's modules share: paths, the method families, names, and the
fixed-size (and augmented) batches of the non-private rows."""

from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
PIPELINE_DIR = REPO_ROOT / "pipelines"
OPACUS_MODES = ("hooks", "ew", "functorch", "ghost")
# The GEP settings: pipelines/gep/pipeline.gin as is (light), and the paper's MNIST setting
# (pipelines/gep/README.md section 5: m = 2000 anchors, k picked from {250, 500, 750, 1000}, one
# power iteration, basis recomputed every step).
GEP_FAMILY = ("gep", "bgep")
FLOOR_LABEL = "GEP light's floor (its matrix products alone)"
BOUND_LABEL = "GEP light's bound (floor + plain anchor gradients + JAX non-private step)"
# The lower bounds for any GEP light step: {row group: label}, the report's order.
GEP_BOUNDS = {"floor": FLOOR_LABEL, "bound": BOUND_LABEL}
VERSION_PACKAGES = ("jax", "jaxlib", "flax", "optax", "dp-accounting", "numpy", "torch",
                    "opacus")
COMMAND_ENV = "DPBENCH_BENCH_COMMAND"  # set by tools/bench.sh: the shell command to record
ONCE = ("calibration", "main_job", "interleaved")
# the kinds with a step time
TIMED = ("jax_nonprivate", "torch_nonprivate", "opacus", "dp", "gep_floor", "gep_bound")
SPEC_KEYS = ("label", "group", "kind", "batch_size", "pipeline", "setting", "mode")


def fixed_size_batches(n: int, b: int, seed: int, count: int) -> list:
    """count batches of exactly b distinct indices (the non-private rows' batches)."""
    return [np.random.default_rng([seed, t]).choice(n, size=b, replace=False)
            for t in range(count)]


def augmented_batch(grad_options: dict):
    """(images, labels, key) -> the B x K images and labels the pipeline's gradient stage
    (grad.per_example) sees: K augmented copies of each example, as it draws them."""
    import jax
    import jax.numpy as jnp

    from dpbench.stages.grad import augment_image

    copies, augmentation = grad_options["augmult"], grad_options["augmentation"]
    if copies == 1 and augmentation == "none":
        return lambda images, labels, key: (images, labels)

    def augment(images, labels, key):
        keys = jax.random.split(key, images.shape[0] * copies).reshape(images.shape[0], copies)
        out = jax.vmap(lambda ks, image: jax.vmap(lambda k: augment_image(
            k, image, augmentation, grad_options["crop_padding"]))(ks))(keys, images)
        return out.reshape((-1,) + images.shape[1:]), jnp.repeat(labels, copies)
    return augment
