"""tools/install.sh with DPBENCH_CUDA: refused (exit 1, one line saying what to change) when the
installed JAX sees no GPU, which is every test host. The script runs for real in a copy whose
.venv/bin/python is a stand-in: pip does nothing, and the GPU check runs on this venv's JAX."""

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import REPO_ROOT, run_guarded

sys.path.insert(0, str(REPO_ROOT / "tools"))
import check_jax_gpu  # noqa: E402


def _sandbox(tmp_path: Path) -> Path:
    (tmp_path / "tools").mkdir()
    for name in ("install.sh", "check_jax_gpu.py", "constraints.txt"):
        shutil.copy(REPO_ROOT / "tools" / name, tmp_path / "tools" / name)
    stub = tmp_path / ".venv" / "bin" / "python"
    stub.parent.mkdir(parents=True)
    stub.write_text(f"""#!/bin/sh
case "$1" in
  tools/check_jax_gpu.py) exec {sys.executable} "$@" ;;
  *) exit 0 ;;  # pip and the import check: nothing to install in this copy
esac
""")
    stub.chmod(0o755)
    return tmp_path


@pytest.mark.skipif(not Path("/usr/share/datasets/fashion-mnist").exists(),
                    reason="the sandboxed install.sh would apt-get Fashion-MNIST first")
def test_a_cuda_install_whose_jax_sees_no_gpu_is_refused_with_what_to_change(tmp_path):
    root = _sandbox(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "DPBENCH_CUDA"}
    refused = run_guarded(["bash", "tools/install.sh"], cwd=root,
                          env=dict(env, DPBENCH_CUDA="12"))
    assert refused.returncode == 1, refused.stdout + refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert "DPBENCH_CUDA=12 installed jax[cuda12], but JAX sees only" in line
    assert "nvidia-smi" in line and "leave DPBENCH_CUDA unset" in line
    cpu_only = run_guarded(["bash", "tools/install.sh"], cwd=root, env=env)
    assert cpu_only.returncode == 0, cpu_only.stderr  # no DPBENCH_CUDA: no GPU asked for
    bad = run_guarded(["bash", "tools/install.sh"], cwd=root, env=dict(env, DPBENCH_CUDA="11"))
    assert bad.returncode == 2 and "must be 12 or 13" in bad.stderr


def test_the_gpu_check_passes_a_jax_that_sees_a_gpu_and_names_the_backends_reason():
    gpu = [SimpleNamespace(platform="gpu"), SimpleNamespace(platform="cpu")]
    assert check_jax_gpu.refusal(gpu, "13") is None
    cpu = [SimpleNamespace(platform="cpu")]
    reason = check_jax_gpu.refusal(cpu, "13", "Unable to initialize backend 'cuda': no driver\n"
                                             "more")
    assert "DPBENCH_CUDA=13" in reason and "no driver" in reason and "more" not in reason


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO_ROOT / "tools").glob("*.sh")))
def test_every_tool_script_parses(script):
    """The device scripts run only where a GPU is lent: a syntax error would cost a window.
    Every tools/*.sh parses (bash -n)."""
    done = run_guarded(["bash", "-n", str(REPO_ROOT / "tools" / script)])
    assert done.returncode == 0, done.stderr


def test_the_gpu_window_script_says_how_to_call_it():
    done = run_guarded(["bash", str(REPO_ROOT / "tools" / "gpu_window.sh")])
    assert done.returncode == 2 and "usage:" in done.stderr and "land FILES_AT" in done.stderr
