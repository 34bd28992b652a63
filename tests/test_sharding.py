from threadpoolctl import ThreadpoolController

from tests.conftest import compile_small, dpsgd_stages


def _openblas():
    return ThreadpoolController().select(internal_api="openblas")


def test_compiling_a_step_leaves_openblas_one_thread():
    """jaxlib's CPU LAPACK (GEP's QR) calls scipy's OpenBLAS: after compile, none of the
    process's OpenBLAS libraries may start threads that compete with XLA's pool."""
    _openblas().limit(limits=2)  # as a fresh process on 2 cores starts
    assert {c.num_threads for c in _openblas().lib_controllers} == {2}
    compile_small(dpsgd_stages(), n=32, batch_size=8, micro=8, noise_multiplier=1.0)
    libs = _openblas().lib_controllers
    assert any("scipy" in c.filepath for c in libs)  # the one jaxlib's LAPACK calls
    assert {c.num_threads for c in libs} == {1}
