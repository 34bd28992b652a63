"""The layers dpbench's models are built from: image patches times a matrix for convolutions
(fast per-example gradients on CPU, docs/speed.md), the 2x2 stride-1 max pool as four shifted
maxima, and the per-example input GroupNorm. Never BatchNorm: it mixes examples and breaks
per-example sensitivity; GroupNorm is the only normalization offered."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

# "identity" builds the linearized twin of a model (SynFlow scores: data-free, no nonlinearity).
ACTIVATIONS = {"tanh": nn.tanh, "relu": nn.relu, "identity": lambda x: x}


def _patches_by_slices(x, kernel_size: tuple, strides: tuple, padding: str):
    """(kh, kw, C)-ordered patches as kh * kw strided slices of the padded input."""
    kh, kw = kernel_size
    sh, sw = strides
    pads = lax.padtype_to_pads(x.shape[-3:-1], (kh, kw), (sh, sw), padding)
    if any(lo or hi for lo, hi in pads):
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 3) + list(pads) + [(0, 0)])
    out_h = (x.shape[-3] - kh) // sh + 1
    out_w = (x.shape[-2] - kw) // sw + 1
    return jnp.concatenate(
        [x[..., i:i + sh * (out_h - 1) + 1:sh, j:j + sw * (out_w - 1) + 1:sw, :]
         for i in range(kh) for j in range(kw)], axis=-1)


def _patches_by_blocks(x, kernel_size: tuple, strides: tuple, padding: str):
    """The same patches (same values, same order) through space-to-depth: the padded input cut
    into sh x sw blocks, each patch ceil(kh/sh) x ceil(kw/sw) whole blocks (a few offsets past
    the kernel are dropped). Slower forward than the slices for these small images, but its
    transpose (the input gradient) adds ceil(kh/sh) * ceil(kw/sw) block-shifted arrays instead
    of kh * kw padded ones: 4 instead of 16 for the tanh CNN's second layer (4.4x faster)."""
    kh, kw = kernel_size
    sh, sw = strides
    (top, bottom), (left, right) = lax.padtype_to_pads(x.shape[-3:-1], (kh, kw), (sh, sw),
                                                       padding)
    out_h = (x.shape[-3] + top + bottom - kh) // sh + 1
    out_w = (x.shape[-2] + left + right - kw) // sw + 1
    qh, qw = -(-kh // sh), -(-kw // sw)                    # patch size in blocks
    rows, cols = sh * (out_h - 1 + qh), sw * (out_w - 1 + qw)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 3) + [(top, max(0, rows - x.shape[-3] - top)),
                                               (left, max(0, cols - x.shape[-2] - left)),
                                               (0, 0)])[..., :rows, :cols, :]
    lead, c = x.shape[:-3], x.shape[-1]
    blocks = jnp.swapaxes(x.reshape(lead + (rows // sh, sh, cols // sw, sw, c)), -4, -3)
    blocks = blocks.reshape(lead + (rows // sh, cols // sw, sh * sw * c))
    p = jnp.stack([blocks[..., a:a + out_h, b:b + out_w, :]
                   for a in range(qh) for b in range(qw)], axis=-2)
    p = p.reshape(lead + (out_h, out_w, qh, qw, sh, sw, c))
    n = len(lead) + 2
    p = jnp.transpose(p, tuple(range(n)) + (n, n + 2, n + 1, n + 3, n + 4))
    p = p.reshape(lead + (out_h, out_w, qh * sh, qw * sw, c))[..., :kh, :kw, :]
    return p.reshape(lead + (out_h, out_w, kh * kw * c))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def image_patches(x, kernel_size: tuple, strides: tuple, padding: str):
    """The (kh, kw, C)-ordered patches of NHWC images x.

    Same values as lax.conv_general_dilated_patches (up to the feature order). Computed as
    strided slices of the padded input; differentiated through ``_patches_by_blocks``, the
    same linear map written with fewer, larger pieces. Why not XLA's own: its CPU transpose of
    conv_general_dilated_patches is a convolution that made the tanh CNN's backward pass
    about 20x slower; the slices' transpose is kh * kw pads and adds, the blocks' fewer.
    """
    return _patches_by_slices(x, kernel_size, strides, padding)


@image_patches.defjvp
def _image_patches_jvp(kernel_size, strides, padding, primals, tangents):
    # Linear: the tangent is the same map; reverse mode transposes this form.
    (x,), (t,) = primals, tangents
    by_blocks = _patches_by_blocks if strides != (1, 1) else _patches_by_slices
    return (_patches_by_slices(x, kernel_size, strides, padding),
            by_blocks(t, kernel_size, strides, padding))


class PatchConv(nn.Module):
    """A 2-D convolution computed as image patches times a matrix; same parameters as nn.Conv.

    XLA's CPU convolutions are slow under vmap for per-example gradients; as patches + matmul
    the per-example gradient is a batched outer product. Outputs equal nn.Conv's to float
    rounding.
    """

    features: int
    kernel_size: tuple
    strides: tuple = (1, 1)
    padding: str = "SAME"

    @nn.compact
    def __call__(self, x):
        kh, kw = self.kernel_size
        cin = x.shape[-1]
        kernel = self.param("kernel", nn.initializers.lecun_normal(),
                            (kh, kw, cin, self.features))
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        patches = image_patches(x, self.kernel_size, self.strides, self.padding)
        return patches @ kernel.reshape(kh * kw * cin, self.features) + bias


def max_pool_2x2_stride_1(x):
    """nn.max_pool(x, (2, 2), strides=(1, 1), padding='VALID') as the maximum of four shifted
    views: same values, and a gradient of selects instead of XLA's slow CPU select-and-scatter."""
    return jnp.maximum(jnp.maximum(x[..., :-1, :-1, :], x[..., 1:, :-1, :]),
                       jnp.maximum(x[..., :-1, 1:, :], x[..., 1:, 1:, :]))


def conv_layer(conv_impl: str, features: int, kernel_size: tuple, strides: tuple, padding: str,
               name: str) -> nn.Module:
    if conv_impl == "patches":
        return PatchConv(features, kernel_size, strides, padding, name=name)
    if conv_impl == "xla":
        return nn.Conv(features, kernel_size, strides=strides, padding=padding, name=name)
    raise ValueError(f"model.conv_impl must be 'patches' or 'xla', got {conv_impl!r}")


def input_group_norm(groups: int, enabled: bool = True):
    """GroupNorm over each example's own channels with no learned scale or bias (Tramer &
    Boneh's normalization of ScatterNet features): it reads no other example and no statistic
    of the data, so it costs no privacy. Disabled in a linearized twin (a constant input would
    normalize to zero)."""
    if not enabled:
        return lambda x: x
    return nn.GroupNorm(num_groups=groups, use_scale=False, use_bias=False, epsilon=1e-5)

