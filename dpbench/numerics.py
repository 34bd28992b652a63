"""Which host numerics produced a number, and how to compare numbers across hosts.

XLA's CPU code (LLVM for the host's ISA, YNNPACK's run-time dispatched dot kernels), numpy's
run-time SIMD dispatch (dp_accounting's PLD arithmetic) and OpenBLAS round differently on
different x86-64 CPUs. A run is bit-reproducible only on a host with the same ``host_numerics()``;
across hosts, ``params_fingerprint`` summarizes a trained model compactly enough to store and
``fingerprint_distance`` says how far two such summaries are, in units of the parameters' norm.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from importlib import metadata
from pathlib import Path

import numpy as np

# CPU flags that change the code XLA, YNNPACK, numpy or OpenBLAS run (the vector ISA and the
# matrix units); the vendor, family and model name the LLVM tuning target on top of them.
_ISA_FLAG_PREFIXES = ("avx", "fma", "f16c", "amx", "sse4", "bmi")
_ENV_KNOBS = ("XLA_FLAGS", "NPY_DISABLE_CPU_FEATURES", "NPY_ENABLE_CPU_FEATURES",
              "OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS")
PACKAGES = ("jax", "jaxlib", "flax", "optax", "dp-accounting", "gin-config", "orbax-checkpoint",
            "numpy")  # a run record's versions
PROJECTIONS = 8  # random directions in the fingerprint (numpy PCG64: the same on every host)


def _cpuinfo(path: Path = Path("/proc/cpuinfo")) -> dict:
    """The first processor's vendor, family, model and ISA flags ({} where unreadable)."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = sorted(f for f in fields.get("flags", "").split() if f.startswith(_ISA_FLAG_PREFIXES))
    return {"vendor": fields.get("vendor_id"), "family": fields.get("cpu family"),
            "model": fields.get("model"), "isa_flags": flags}


def _numpy_simd() -> dict:
    from numpy._core import _multiarray_umath as umath  # numpy 2's dispatch tables
    enabled = [t for t in umath.__cpu_dispatch__ if umath.__cpu_features__.get(t, False)]
    return {"baseline": list(umath.__cpu_baseline__), "dispatch_enabled": enabled}


def _blas() -> list:
    try:
        import threadpoolctl
    except ImportError:
        return []
    import scipy.linalg  # noqa: F401  (loads scipy's own OpenBLAS: the list must not depend on
    #                      what the caller happened to import before)
    return sorted(f"{i.get('internal_api')} {i.get('version')} {i.get('architecture')}"
                  for i in threadpoolctl.threadpool_info() if i.get("user_api") == "blas")


# The accelerator numerics policy. An accelerator's default float32 product is TF32 (inputs
# rounded to 10 mantissa bits): a per-example gradient norm computed that way is off by about
# 1e-3 relative, so clipping to it can leave an example's contribution above the bound C that
# the sensitivity, and so the accountant, assumes. dpbench runs float32 matrix products and
# convolutions at full precision on accelerators; a CPU always does.
ACCELERATOR_PRECISION = "highest"
FULL_PRECISIONS = ("highest", "float32", "f32_f32_f32", "f64_f64_f64")  # its names, lower case
PRECISION_WHY = ("float32 products at full precision: the per-example norms the clip relies "
                 "on are exact to float32 rounding (TF32 or bfloat16 would round them to "
                 "about 1e-3, beyond what the sensitivity bound allows)")


def use_precision_policy(backend: str | None = None) -> None:
    """Applies the accelerator numerics policy to this process (``ACCELERATOR_PRECISION`` on a
    GPU or TPU; nothing on a CPU). A lower precision set by the caller (JAX_DEFAULT_MATMUL_
    PRECISION or jax.config) is refused: it would round the norms the clip relies on."""
    import jax

    backend = jax.default_backend() if backend is None else backend
    if backend == "cpu":
        return
    setting = jax.config.jax_default_matmul_precision
    if setting is not None and str(setting).lower() not in FULL_PRECISIONS:
        raise ValueError(
            f"the matmul precision is set to {setting!r} (JAX_DEFAULT_MATMUL_PRECISION or "
            "jax_default_matmul_precision): it rounds the per-example gradient norms the clip "
            "relies on, so the sensitivity would not hold; unset it (dpbench runs float32 "
            f"products at {ACCELERATOR_PRECISION!r} on accelerators)")
    jax.config.update("jax_default_matmul_precision", ACCELERATOR_PRECISION)


def matmul_precision(backend: str | None = None) -> dict:
    """The precision this process's float32 matrix products and convolutions run at, and why
    (a run record's ``host_numerics.matmul_precision``)."""
    import jax

    backend = jax.default_backend() if backend is None else backend
    if backend == "cpu":
        return {"precision": "float32", "why": "a CPU computes float32 products at full "
                                               "precision whatever the setting"}
    setting = jax.config.jax_default_matmul_precision
    return {"precision": str(setting or "default (TF32 on a recent GPU)"),
            "why": PRECISION_WHY if str(setting).lower() in FULL_PRECISIONS
            else "not dpbench's policy (numerics.use_precision_policy was not applied)"}


def host_numerics(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """Everything known to change the bits a run computes on this host's CPU: the package
    versions that compute, the CPU (vendor, family, model, ISA flags), the core count (XLA and
    OpenBLAS split reductions by thread), numpy's enabled SIMD targets, OpenBLAS's core type and
    the environment knobs that override any of them. Two hosts with equal ``host_numerics`` give
    bit-identical runs; unequal ones agree only within the measured tolerance."""
    import jax  # imported here: only a caller that trains pays for it

    computing = versions(("jax", "jaxlib", "numpy", "scipy", "dp-accounting"))
    computing.pop("python")  # no bit depends on it
    return {"versions": computing,
            **host_numerics_without_jax(cpuinfo),
            "matmul_precision": matmul_precision(),
            # under taskset XLA's thread pool follows the affinity mask, and its reductions
            # split by thread: GEP's parameters differed between 1 and 2 usable cores
            "usable_cores": len(os.sched_getaffinity(0)),
            "devices": jax.device_count()}


def versions(packages=PACKAGES) -> dict:
    """Python's version and each package's installed version (None where not installed): what
    a run record names as the software that computed it."""
    out = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def host_numerics_without_jax(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """The part of ``host_numerics`` that numpy, scipy and OpenBLAS read (dp_accounting's
    arithmetic), found without importing JAX: the CPU, the core count, numpy's SIMD dispatch,
    OpenBLAS and the environment knobs."""
    return {"cpu": _cpuinfo(cpuinfo), "cores": os.cpu_count(), "numpy_simd": _numpy_simd(),
            "blas": _blas(), "env": {k: os.environ[k] for k in _ENV_KNOBS if k in os.environ}}


def numerics_digest(numerics: dict) -> str:
    """A short stable name for one ``host_numerics()`` value."""
    return hashlib.sha256(json.dumps(numerics, sort_keys=True).encode()).hexdigest()[:16]


def params_fingerprint(tree) -> dict:
    """A compact, host-independent summary of a pytree of parameters, in float64: the whole
    vector's L2 norm, each leaf's L2 norm (by its jax key path) and its projections on
    PROJECTIONS fixed Gaussian directions, scaled by 1/sqrt(size) so that each projection is
    of the order of the parameters' RMS. Two parameter vectors p, p' give entries that differ by
    at most about ||p - p'|| (norms) and ||p - p'|| / sqrt(size) * |N(0, 1)| (projections)."""
    import jax

    leaves = [(jax.tree_util.keystr(path), np.asarray(leaf, np.float64).ravel())
              for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))]
    size = sum(leaf.size for _, leaf in leaves)
    rng = np.random.default_rng(20261125)
    projections = np.zeros(PROJECTIONS)
    for _, leaf in leaves:  # the directions are drawn leaf by leaf, in the tree's order
        projections += rng.standard_normal((PROJECTIONS, leaf.size)) @ leaf
    flat = np.concatenate([leaf for _, leaf in leaves]) if leaves else np.zeros(0)
    return {"size": int(size), "norm": float(np.linalg.norm(flat)),
            "leaf_norms": {name: float(np.linalg.norm(leaf)) for name, leaf in leaves},
            "projections": [float(v) for v in projections / np.sqrt(max(size, 1))]}


def fingerprint_distance(got: dict, want: dict) -> float:
    """How far two fingerprints are, relative to ``want``'s norm: the largest difference of a
    leaf norm or of the total norm over ||want||, and of a projection over ||want|| / sqrt(size)
    (its natural scale). About ||p - p'|| / ||p'||; inf where the trees differ in structure."""
    if got["size"] != want["size"] or set(got["leaf_norms"]) != set(want["leaf_norms"]):
        return float("inf")
    scale = max(want["norm"], np.finfo(np.float64).tiny)
    norms = [abs(got["norm"] - want["norm"])] + [
        abs(got["leaf_norms"][k] - v) for k, v in want["leaf_norms"].items()]
    projections = np.abs(np.subtract(got["projections"], want["projections"]))
    return float(max(max(norms) / scale,
                     float(np.max(projections)) * np.sqrt(want["size"]) / scale))


def other_host_env(host: dict) -> dict:
    """Environment variables that make this machine compute like another x86-64 host, for a CI
    job that keeps every golden expectation host-independent: XLA's code for one ISA level
    below this CPU's (AVX2 on an AVX-512 host, SSE4.2 on an AVX2 one) with its dots off
    YNNPACK's run-time dispatched kernels (onto Eigen's), numpy's SIMD dispatch cut to its
    lowest enabled target, and OpenBLAS forced to another core type."""
    flags = set(host["cpu"].get("isa_flags", []))
    isa = "AVX2" if "avx512f" in flags else "SSE4_2"
    enabled = host["numpy_simd"]["dispatch_enabled"]
    blas = " ".join(host["blas"])
    return {"XLA_FLAGS": f"--xla_cpu_max_isa={isa} --xla_cpu_experimental_ynn_fusion_type=",
            "NPY_DISABLE_CPU_FEATURES": " ".join(enabled[1:]),
            "OPENBLAS_CORETYPE": "Nehalem" if "Sandybridge" in blas else "Sandybridge"}


if __name__ == "__main__":  # tools/run_golden_other_host.sh: `eval` these exports
    import shlex
    for name, value in other_host_env(host_numerics()).items():
        print(f"export {name}={shlex.quote(value)}")
