"""The last step of ``DPBENCH_CUDA=N bash tools/install.sh``: exit 0 when the installed JAX
sees a GPU, else exit 1 with one line saying what JAX sees and what to change. Why: JAX falls
back to the CPU with a warning when its CUDA backend cannot start, so an install that printed
its devices and exited 0 let a GPU machine's first run train on its CPU for hours.

  .venv/bin/python tools/check_jax_gpu.py 12
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def refusal(devices: Sequence, cuda: str, backend_error: str = "") -> Optional[str]:
    """None when ``devices`` hold a GPU; else why the CUDA install is refused, and what to do."""
    if any(getattr(d, "platform", "") in GPU_PLATFORMS for d in devices):
        return None
    why = f" (JAX's CUDA backend: {backend_error.splitlines()[0]})" if backend_error else ""
    return (f"install.sh: DPBENCH_CUDA={cuda} installed jax[cuda{cuda}], but JAX sees only "
            f"{[str(d) for d in devices]}{why}. Check the NVIDIA driver (`nvidia-smi` shows the "
            f"CUDA version it supports: it must be {cuda}.x or newer); set DPBENCH_CUDA to that "
            "major version, or leave DPBENCH_CUDA unset for a CPU-only install.")


def main(argv: Sequence[str]) -> int:
    import jax
    cuda = argv[1] if len(argv) > 1 else "?"
    try:
        jax.devices("cuda")
        backend_error = ""
    except RuntimeError as e:  # the backend's own reason, e.g. no driver or a too old one
        backend_error = str(e)
    devices = jax.devices()
    reason = refusal(devices, cuda, backend_error)
    if reason:
        print(reason, file=sys.stderr)
        return 1
    print(f"install.sh: JAX sees {devices}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
