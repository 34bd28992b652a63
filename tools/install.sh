#!/usr/bin/env bash
# Installs everything dpbench needs on a fresh machine: Debian's Fashion-MNIST files and a
# virtual environment (.venv) with the package and its dependencies. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
# DPBENCH_CUDA=12 or 13: also install the CUDA build of the pinned JAX (jax[cudaN], NVIDIA's
# libraries from PyPI; needs an NVIDIA driver for that CUDA major version)
cuda="${DPBENCH_CUDA:-}"
case "$cuda" in
  ""|12|13) ;;
  *) echo "install.sh: DPBENCH_CUDA must be 12 or 13 (the CUDA major version of the" \
       "machine's driver), got '$cuda'" >&2; exit 2 ;;
esac

PY="${PYTHON:-python3}"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
packages=()
[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] \
  || packages+=(dataset-fashion-mnist)
# Debian's python3 makes venvs only with python3-venv (ensurepip); without it `venv` fails
# after creating a half venv with no pip
"$PY" -c "import ensurepip" 2>/dev/null || packages+=(python3-venv)
# the tests lay the board's page out in a real browser (tests/browser.py): Debian's Chromium
case "$extras" in *test*) command -v chromium >/dev/null || packages+=(chromium) ;; esac
if [ "${#packages[@]}" -gt 0 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${packages[@]}" >/dev/null
fi

# a venv without pip is an earlier failed attempt: make it again
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  "$PY" -m venv --clear .venv
fi
# pip's own failures stop the script (pipefail); only grep's "nothing left to print" is ignored.
quiet_pip() { .venv/bin/python -m pip "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
quiet_pip install -q --upgrade pip
# Exact versions from tools/constraints.txt: results (and the golden test) are bit-reproducible.
quiet_pip install -q -c tools/constraints.txt -e ".${extras}"
if [ -n "$cuda" ]; then
  jax_version=$(grep -E '^jax==' tools/constraints.txt | cut -d= -f3)
  quiet_pip install -q "jax[cuda${cuda}]==${jax_version}"
  # refused (exit 1, one line) when JAX fell back to the CPU: a GPU run would train on it
  .venv/bin/python tools/check_jax_gpu.py "$cuda"
fi
.venv/bin/python -c "import dpbench, jax, dp_accounting, gin, optax, flax" \
  || { echo "install.sh: dpbench did not install" >&2; exit 1; }
