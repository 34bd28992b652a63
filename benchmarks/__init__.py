"""Benchmarks of dpbench (outside the package): ``python -m benchmarks.speed``, via
tools/bench.sh."""
