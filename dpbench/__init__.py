"""dpbench: a benchmark of differentially private deep learning methods in JAX."""

__version__ = "0.2.0"
