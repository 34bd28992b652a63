"""The search, as data (pure: no compiler, no run, no Ray): what a tuning protocol says and
what a search's published records mean.

- ``protocol.py``: the protocol file (families, methods, search spaces, trials), loaded and
  checked;
- ``methods.py``: a method is a folder (pipeline.gin, method.json, README.md);
- ``space.py``: the search space, how trials are drawn and paired, the privacy support;
- ``tuning.py``: the trial law, the search's epsilon, a group's published outcomes, and the one
  place that writes AND parses group and run folder names.

The board imports this package, never ``dpbench.sweep`` (which runs a protocol) or the compiler.
"""
