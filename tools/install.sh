#!/usr/bin/env bash
# Installs everything dpbench needs on a fresh machine: Debian's Fashion-MNIST files and a
# virtual environment (.venv) with the package and its dependencies. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"

if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null
fi

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# pip's own failures stop the script (pipefail); only grep's "nothing left to print" is ignored.
quiet_pip() { .venv/bin/python -m pip "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
quiet_pip install -q --upgrade pip
# Exact versions from tools/constraints.txt: results (and the golden test) are bit-reproducible.
quiet_pip install -q -c tools/constraints.txt -e ".${extras}"
.venv/bin/python -c "import dpbench, jax, dp_accounting, gin, optax, flax" \
  || { echo "install.sh: dpbench did not install" >&2; exit 1; }
