# Sourced by tools/sweep_on_device.sh and tools/perf_on_device.sh: what a lent accelerator
# machine (one GPU, 16 cores, no network, JAX preinstalled) lacks, and how it gets it.

# the wheels of tools/constraints.txt that the machine's image lacks or has at other versions
WHEELS=(appdirs==1.4.4 attrs==23.2.0 chex==0.1.92 configparser==7.3.0 dm-tree==0.1.10
        dp-accounting==0.6.0 flax==0.12.8 gin-config==0.5.0 kymatio==0.3.0 optax==0.2.8
        orbax-checkpoint==0.12.8)

# here: .device/whl (those wheels) and .device/fmnist (Debian's Fashion-MNIST files); .device/
# is git-ignored and travels when a call carries it
device_fill() {
  grep -qx "/.device/" .git/info/exclude 2>/dev/null || echo "/.device/" >> .git/info/exclude
  rm -rf .device && mkdir -p .device/whl .device/fmnist
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d .device/whl "${WHEELS[@]}"
  cp /usr/share/datasets/fashion-mnist/*.gz .device/fmnist/
}

# there: the GPU named, the wheels installed into /tmp/site (on PYTHONPATH), the data in place
device_install() {
  export PYTHONPATH=/tmp/site
  [ -f /tmp/site/.installed ] && return 0  # a second script of the same call
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .device/whl/*.whl
  mkdir -p /usr/share/datasets/fashion-mnist
  cp .device/fmnist/*.gz /usr/share/datasets/fashion-mnist/
  python3 -c "import jax, flax, numpy, scipy; print(jax.__version__, jax.devices(),
              flax.__version__, numpy.__version__, scipy.__version__)"
  touch /tmp/site/.installed
}
