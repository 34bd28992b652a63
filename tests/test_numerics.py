"""Host numerics and the cross-host parameter fingerprint (dpbench/numerics.py)."""

from importlib import metadata

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

from dpbench import numerics


def _params(key, scale=1.0):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"dense": {"kernel": scale * jax.random.normal(k1, (37, 11)),
                      "bias": scale * jax.random.normal(k2, (11,))},
            "out": {"kernel": scale * jax.random.normal(k3, (11, 3))}}


def test_a_fingerprint_is_deterministic_and_zero_distance_from_itself():
    params = _params(jax.random.key(np.random.randint(1 << 30)))
    a, b = numerics.params_fingerprint(params), numerics.params_fingerprint(
        jax.tree_util.tree_map(np.asarray, params))
    assert a == b and numerics.fingerprint_distance(a, b) == 0.0
    assert a["size"] == 37 * 11 + 11 + 11 * 3 and len(a["projections"]) == numerics.PROJECTIONS
    assert set(a["leaf_norms"]) == {"['dense']['bias']", "['dense']['kernel']", "['out']['kernel']"}


@pytest.mark.parametrize("relative", [1e-7, 1e-4, 1e-2])
def test_the_distance_is_about_the_relative_change_of_the_parameters(relative):
    """A change delta of the whole vector shows as about ||delta|| / ||p|| (at most ~3x more,
    the projections' Gaussian tail; at least the norms' share of it)."""
    key = jax.random.key(np.random.randint(1 << 30))
    params = _params(key)
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    flat = np.asarray(flat, np.float64)
    direction = np.random.default_rng(np.random.randint(1 << 30)).standard_normal(flat.size)
    moved = flat + relative * np.linalg.norm(flat) * direction / np.linalg.norm(direction)
    d = numerics.fingerprint_distance(numerics.params_fingerprint(unravel(moved)),
                                      numerics.params_fingerprint(unravel(flat)))
    # d / relative is the largest of 8 |projections| of a random unit direction on the fixed
    # Gaussian ones (~|N(0, 1)|, their exact sphere law): false failures 6.5e-6 above 5, 5e-12
    # below 0.05; up to 4e-5 at 1e-7, where float32 rounding adds up to 7% to the change
    assert 0.05 * relative < d < 5 * relative


def test_a_change_of_one_leaf_or_of_the_structure_is_seen():
    params = _params(jax.random.key(np.random.randint(1 << 30)))
    want = numerics.params_fingerprint(params)
    swapped = dict(params, out={"kernel": params["out"]["kernel"][::-1]})  # same norms
    # a ~0.4 relative change: all 8 projections under 1e-3 has probability ~1e-20
    assert numerics.fingerprint_distance(numerics.params_fingerprint(swapped), want) > 1e-3
    bigger = dict(params, out={"kernel": jnp.zeros((12, 3))})
    assert numerics.fingerprint_distance(numerics.params_fingerprint(bigger), want) == np.inf
    renamed = dict(params, head=params.pop("out"))
    assert numerics.fingerprint_distance(numerics.params_fingerprint(renamed), want) == np.inf


def test_host_numerics_names_the_cpu_and_every_knob(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n"
                       "model\t\t: 17\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw amx_tile\n"
                       "\nprocessor\t: 1\nvendor_id\t: AuthenticAMD\n")
    for knob in ("XLA_FLAGS", "NPY_DISABLE_CPU_FEATURES", "OPENBLAS_CORETYPE"):
        monkeypatch.delenv(knob, raising=False)
    host = numerics.host_numerics(cpuinfo)
    assert host["cpu"] == {"vendor": "AuthenticAMD", "family": "25", "model": "17",
                           "isa_flags": ["amx_tile", "avx", "avx2", "avx512bw", "avx512f", "fma"]}
    assert host["versions"]["jaxlib"] == metadata.version("jaxlib")
    assert host["cores"] >= 1 and host["devices"] == jax.device_count()
    assert set(host["numpy_simd"]["dispatch_enabled"]) <= set(np._core._multiarray_umath
                                                              .__cpu_dispatch__)
    digest = numerics.numerics_digest(host)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX2")
    other = numerics.host_numerics(cpuinfo)
    assert other["env"] == {"XLA_FLAGS": "--xla_cpu_max_isa=AVX2"}
    assert numerics.numerics_digest(other) != digest
    cpuinfo.write_text(cpuinfo.read_text().replace("model\t\t: 17", "model\t\t: 143"))
    assert numerics.numerics_digest(numerics.host_numerics(cpuinfo)) != numerics.numerics_digest(
        other)
    assert numerics.host_numerics(tmp_path / "missing")["cpu"] == {}


@pytest.mark.parametrize("flags,isa", [(["avx2", "avx512f", "fma"], "AVX2"),
                                       (["avx", "avx2", "fma"], "SSE4_2")])
def test_the_simulated_other_host_is_one_level_below_this_one_everywhere(flags, isa):
    host = {"cpu": {"isa_flags": flags},
            "numpy_simd": {"dispatch_enabled": ["X86_V3", "X86_V4", "AVX512_ICL"]},
            "blas": ["openblas 0.3.31 Haswell"]}
    env = numerics.other_host_env(host)
    assert env["XLA_FLAGS"] == (f"--xla_cpu_max_isa={isa} "
                                "--xla_cpu_experimental_ynn_fusion_type=")
    assert env["NPY_DISABLE_CPU_FEATURES"] == "X86_V4 AVX512_ICL"
    assert env["OPENBLAS_CORETYPE"] == "Sandybridge"
    host.update(blas=["openblas 0.3.31 Sandybridge"], numpy_simd={"dispatch_enabled": ["X86_V3"]})
    env = numerics.other_host_env(host)
    assert env["OPENBLAS_CORETYPE"] == "Nehalem" and env["NPY_DISABLE_CPU_FEATURES"] == ""

def test_host_numerics_names_the_cores_a_taskset_leaves(monkeypatch):
    """A run pinned to fewer cores (as the sweep pins trials) sums in another order: its
    numerics must not share a digest with the unpinned host's."""
    monkeypatch.setattr(numerics.os, "sched_getaffinity", lambda pid: {0, 1})
    both = numerics.host_numerics()
    monkeypatch.setattr(numerics.os, "sched_getaffinity", lambda pid: {1})
    pinned = numerics.host_numerics()
    assert (both["usable_cores"], pinned["usable_cores"]) == (2, 1)
    assert numerics.numerics_digest(both) != numerics.numerics_digest(pinned)


def test_the_accelerator_precision_policy_sets_full_float32_and_refuses_a_lower_one():
    """On an accelerator (its backend named), the policy runs float32 products at full
    precision and the record says so and why; a lower precision set before (TF32, bfloat16,
    an accelerator's 'default') is refused, naming the variable; a CPU is left alone."""
    import jax
    before = jax.config.jax_default_matmul_precision
    try:
        for lower in ("tensorfloat32", "bfloat16", "default", "high", "TF32_TF32_F32"):
            jax.config.update("jax_default_matmul_precision", lower)
            with pytest.raises(ValueError, match="JAX_DEFAULT_MATMUL_PRECISION"):
                numerics.use_precision_policy("gpu")
            assert numerics.matmul_precision("gpu")["why"].startswith("not dpbench's policy")
        jax.config.update("jax_default_matmul_precision", None)
        numerics.use_precision_policy("cpu")
        assert jax.config.jax_default_matmul_precision is None
        assert numerics.matmul_precision("cpu")["precision"] == "float32"
        numerics.use_precision_policy("gpu")
        assert jax.config.jax_default_matmul_precision == numerics.ACCELERATOR_PRECISION
        said = numerics.matmul_precision("gpu")
        assert said == {"precision": "highest", "why": numerics.PRECISION_WHY}
        assert numerics.host_numerics()["matmul_precision"] == numerics.matmul_precision()
    finally:
        jax.config.update("jax_default_matmul_precision", before)
