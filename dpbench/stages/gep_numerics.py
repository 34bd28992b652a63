"""GEP's numerics: the power iteration's random start, orthonormal rows, and the rigorous float32
bound on the residual's norm that keeps the S2 clip from ever being under-applied."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _cholesky_pass(rows):
    """One CholeskyQR pass: L L^T = Y Y^T, Q = L^-1 Y (the k x k inverse, then one product:
    matrix products instead of a triangular solve against all p columns). Also whether the
    factorization succeeded (it fails when Y's condition number nears u^-1/2)."""
    chol = jnp.linalg.cholesky(rows @ rows.T)
    eye = jnp.eye(rows.shape[0], dtype=rows.dtype)
    inverse = jax.scipy.linalg.solve_triangular(chol, eye, lower=True)
    return inverse @ rows, jnp.all(jnp.isfinite(jnp.diagonal(chol)))


def _householder_rows(rows):
    q, _ = jnp.linalg.qr(rows.T)
    return q.T


def orthonormal_rows(rows):
    """Orthonormal rows spanning the rows of ``rows`` (k x p, k <= p): CholeskyQR2 (two
    Cholesky passes, Yamamoto et al. 2015), or Householder QR when a pass fails (rows too
    ill-conditioned for float32 Cholesky). Why not Householder always: XLA's CPU QR runs on
    one thread, 18 ms a step for the tanh CNN's four groups against 11 for CholeskyQR2 with
    this check (tools: python -m benchmarks.profile_ops --pipeline=gep). Privacy never rests
    on the rows being orthonormal: the residual bound uses the measured ||B B^T - I||."""
    once, first_ok = _cholesky_pass(rows)
    twice, second_ok = _cholesky_pass(once)
    return jax.lax.cond(first_ok & second_ok, lambda _: twice, _householder_rows, rows)


def random_start(key, k: int, p: int):
    """The power iteration's random start: k x p independent uniform random signs (any random
    start with independent entries does). Each 32-bit random word gives 32 signs, one per bit:
    for the tanh CNN's 2.2M start entries 1 ms a step, against 34 ms for one word per sign
    (jax.random.rademacher) and 30 for Gaussians; threefry's bits are what costs."""
    words = jax.random.bits(key, (k, -(-p // 32)), jnp.uint32)
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return 2.0 * bits.reshape(k, -1)[:, :p].astype(jnp.float32) - 1.0


_UNIT = 2.0 ** -24  # float32 unit roundoff


def _gamma(n: int) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of an n-term float32 dot product or
    sum of squares, in any summation order (Higham, Accuracy and Stability, 3.1)."""
    return n * _UNIT / (1 - n * _UNIT)


def orthonormality_error(basis):
    """An upper bound on ||B B^T - I||_2 for the float32 basis B (k x p), from its computed
    Gram matrix G plus G's own rounding bound (|G_ij - fl(G_ij)| <= gamma_p max_i G_ii)."""
    k, p = basis.shape
    gram = basis @ basis.T
    rounding = k * _gamma(p) * jnp.max(jnp.diagonal(gram)) * (1 + 2 * _gamma(p))
    off = jnp.sqrt(jnp.sum(jnp.square(gram - jnp.eye(k, dtype=gram.dtype))))
    return (off + rounding) * (1 + 4 * _gamma(k * k + 2))


def basis_orthonormality_error(basis: dict):
    """The eps that enters the residual bound (``residual_sq_upper``) for a basis with one block
    per parameter group: B B^T is block-diagonal, so ||B B^T - I|| is the largest block's."""
    return jnp.max(jnp.stack([orthonormality_error(b) for b in basis.values()]))


def residual_sq_upper(a, b, k: int, p: int, p_max: int, eps):
    """A rigorous upper bound on ||v - B^T w||^2 from float32 a = fl(||v||^2) (p coordinates)
    and b = fl(||w||^2) (k coordinates), w = fl(B v), ||B B^T - I|| <= eps, groups of at most
    p_max coordinates. In exact arithmetic ||v - B^T w||^2 = ||v||^2 - ||w||^2 + 2 w.e
    + w^T (B B^T - I) w with e = w - Bv, ||e|| <= sqrt(k (1 + eps)) gamma_{p_max} ||v||; every
    term is bounded on the safe side, with 8 spare roundings for forming the bound itself.
    Catastrophic cancellation (a residual far smaller than the gradient) can only make the
    bound loose, never small: the S2 clip is never under-applied."""
    a_hi = a * (1 + 2 * _gamma(p + 8))
    b_lo = b * (1 - _gamma(k + 8))
    b_hi = b * (1 + 2 * _gamma(k + 8))
    e_norm = jnp.sqrt(k * (1 + eps)) * _gamma(p_max + 8) * jnp.sqrt(a_hi)
    bound = a_hi - b_lo + 2 * jnp.sqrt(b_hi) * e_norm + eps * b_hi
    return jnp.maximum(bound * (1 + 8 * _UNIT), 0.0)
