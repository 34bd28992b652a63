"""Configuration in one place: gin parsing with clear errors, the ``pipeline`` and ``train``
configurables, and the repository root (the flags for gin files and bindings are
``cli_args.add_gin_flags``).

Every entry point (``dpbench``, ``dpbench audit``, the speed benchmark, the sweep) parses gin
through :func:`parse_config`. This module imports only the modules that declare configurables
(stages, budget, dataset, model, sampler), none of which imports it back, so importing it
registers every configurable a gin file may bind and no import cycle exists.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
import os
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

import gin

# Imported for their gin configurables (budget, dataset, model, sampler, the stages).
from dpbench import accounting, data, models, sampling  # noqa: F401
import dpbench.stages  # noqa: F401
from dpbench.stages.base import Stage, registered_stage_names

REPO_ROOT = Path(__file__).resolve().parents[1]

class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


@gin.configurable("pipeline")
def pipeline_stages(stages: Sequence[Stage] = gin.REQUIRED, name: str = "unnamed") -> tuple:
    """The pipeline's name and stages, as listed in its gin file (``pipeline.stages = %STAGES``)."""
    return name, tuple(stages)


@gin.configurable("train")
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Run-level settings (bind as ``train.batch_size = 2048`` etc.).

    batch_size is the EXPECTED batch size B; the sampling rate is q = B / N.
    seed=None draws every key from the OS and writes none of them anywhere (for a run that is
    meant to be released); an integer seed makes a benchmark run reproducible.
    noise_multiplier=None calibrates sigma to the budget. A given number is used as is and the
    run stops at the last step whose epsilon fits the budget (the record says why), unless
    enforce_budget=False (a non-private baseline; the record then says the budget was ignored).
    A checkpoint (with the privacy ledger) is written every checkpoint_every_steps steps and at
    the end; the newest checkpoints_to_keep are kept.
    fidelity_every_steps > 0 records, every that many steps, the cosine between the released
    update and the clean mean of clipped gradients and the noise-to-signal norm ratio: they read
    private data, so the record lists them as NON-PRIVATE benchmark output (off by default).
    branch_free_step=True compiles the clipped sum without data-dependent conditionals (a
    release run, seed=None, always is, so its step time does not tell its batch size): every
    micro-batch runs (one of padding only adds zeros) and book-keeping always takes its weighted
    sum that zeroes non-finite examples (a stage may keep its own, as GEP's does). The same
    sums; a speed knob for GPUs, where XLA reads a conditional's predicate back on the host.
    conv_grads='convolution' has book-keeping form each example's convolution kernel gradient
    by XLA's convolution of the layer's input with its output gradient instead of from the
    input's image patches ('patches', the default): the same gradients, no patches in memory.
    accelerator_micro_batch_size, on a GPU or TPU only, replaces micro_batch_size in the step:
    0 for the whole padded batch (one micro-step a step), else a divisor of the padded batch.
    The padded batch stays the one micro_batch_size plans, so the sampler, its DpEvent, sigma
    and the accounting are those of the same run on a CPU; only the summation order differs.
    None (the default) uses micro_batch_size everywhere.
    """

    batch_size: int = 256
    epochs: float = 30.0
    micro_batch_size: int = 32
    seed: Optional[int] = 0
    ema_decay: float = 0.0
    eval_every_steps: int = 0  # 0: once per epoch
    log_every_steps: int = 50
    eval_batch_size: int = 1000
    noise_multiplier: Optional[float] = None
    enforce_budget: bool = True
    checkpoint_every_steps: int = 200
    checkpoints_to_keep: int = 2
    fidelity_every_steps: int = 0
    branch_free_step: bool = False
    conv_grads: str = "patches"
    accelerator_micro_batch_size: Optional[int] = None

    def validate(self):
        if not isinstance(self.batch_size, int) or self.batch_size <= 0:
            raise ValueError(f"train.batch_size must be a positive integer, got "
                             f"{self.batch_size!r}")
        if not isinstance(self.epochs, (int, float)) or not self.epochs > 0:
            raise ValueError(f"train.epochs must be > 0, got {self.epochs!r}")
        if not isinstance(self.fidelity_every_steps, int) or self.fidelity_every_steps < 0:
            raise ValueError(f"train.fidelity_every_steps must be an integer >= 0 (0: off), got "
                             f"{self.fidelity_every_steps!r}")
        if not isinstance(self.branch_free_step, bool):
            raise ValueError(f"train.branch_free_step must be True or False, got "
                             f"{self.branch_free_step!r}")
        accelerator = self.accelerator_micro_batch_size
        if accelerator is not None and (not isinstance(accelerator, int) or accelerator < 0):
            raise ValueError(f"train.accelerator_micro_batch_size must be None, 0 (the whole "
                             f"padded batch) or a positive integer, got {accelerator!r}")
        for name in ("checkpoint_every_steps", "log_every_steps", "checkpoints_to_keep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"train.{name} must be a positive integer, got {value!r}")


def _drop_gin_search_misses(record: logging.LogRecord) -> bool:
    """False for gin's logs of its search for an include: the 'Path not found' of an include
    it misses under one search path before finding it under the next (the cwd, then the
    repository), a false alarm on every run from a user's own folder, and the line it logs for
    every path it tries. An include found nowhere still raises, as ConfigError."""
    return not (record.msg in ("Path not found: %s", "system_path_file_exists:%s")
                and record.pathname.endswith(os.path.join("gin", "resource_reader.py")))


def _search_paths() -> list[Path]:
    return [Path.cwd(), REPO_ROOT]


def _package_file_exists(config_path: str) -> bool:
    """gin's package-path existence check, except that a namespace package (a folder such as
    ``pipelines/`` importable because the repository root is on sys.path) holds no file: gin
    fails on its missing file location with a TypeError instead of trying the next search
    path, so an include that exists under another search path would be reported missing."""
    from gin import resource_reader
    try:
        return resource_reader.system_path_file_exists(config_path)
    except TypeError:
        return False


def _guard_gin_package_reader() -> None:
    """Swap gin's package-path check for :func:`_package_file_exists` (gin has no public way
    to replace a registered reader; its reader list is private)."""
    from gin import resource_reader
    readers = gin.config._FILE_READERS  # noqa: SLF001
    for i, (reader, exists) in enumerate(readers):
        if exists is resource_reader.system_path_file_exists:
            readers[i] = (reader, _package_file_exists)


_NO_PARAMETER = re.compile(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'")
_NO_CONFIGURABLE = re.compile(r"No configurable matching (?:reference )?'@?([\w.]+)")


# Configurables that dpbench 0.2 removed, and where their knobs went (CHANGELOG.md).
_MOVED = {"wrn": "the WRN reads model.* like every model: model.depth, model.width, "
                 "model.group_norm_groups, model.activation, model.input_size"}


def _configurables() -> dict:
    """The name a gin file writes -> the function or class, for every configurable."""
    registry = gin.config._REGISTRY  # noqa: SLF001 (gin has no public listing)
    return {(selector.rsplit(".", 1)[-1] if selector.startswith("dpbench.") else selector):
            configurable.wrapped for selector, configurable in registry.items()
            if not selector.startswith("gin.")}


def _close(name: str, candidates) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def _what_to_change(message: str) -> str:
    """A gin error's remedy: the nearest parameter of the configurable it names, or the
    nearest configurable, and what exists (never a list of every stage for a parameter)."""
    configurables = _configurables()
    unknown_parameter = _NO_PARAMETER.search(message)
    if unknown_parameter:
        name, parameter = unknown_parameter.groups()
        wrapped = configurables.get(name) or configurables.get(name.rsplit(".", 1)[-1])
        if wrapped is not None:
            parameters = list(inspect.signature(wrapped).parameters)
            return (f"{_close(parameter, parameters)}{name} takes: {', '.join(parameters)}")
    unknown = _NO_CONFIGURABLE.search(message)
    prefix = unknown.group(1).split(".")[0] if unknown else None
    if prefix in _MOVED:
        return f"{prefix}.* moved: {_MOVED[prefix]}"
    hint = _close(unknown.group(1), configurables) if unknown else ""
    return (f"{hint}known stages: {', '.join(registered_stage_names())}; check the spelling "
            "of configurable and parameter names")


def parse_config(gin_files: Sequence[str], gin_bindings: Sequence[str]) -> None:
    """Parses gin files and bindings with the cwd and the repo root as include search paths.

    A method's folder (``pipelines/dpsgd``) stands for its ``pipeline.gin``. A gin file may
    pull in a user's own stages with an ``import my_stages`` line: the
    directories of the given gin files and the cwd are importable for that (a console script
    does not put the cwd on sys.path by itself). Gin's own errors (unknown configurable,
    misspelled parameter, missing file, a failing ``import`` line) are re-raised as ConfigError
    with the list of known stages, so a typo says what the valid names are.
    """
    gin.clear_config()
    _guard_gin_package_reader()
    for path in map(str, _search_paths()):
        if path not in gin.config._LOCATION_PREFIXES:  # noqa: SLF001 (gin has no getter)
            gin.add_config_file_search_path(path)
    resolved = []
    for gin_file in gin_files:
        # a method folder stands for its pipeline file (dpbench.search.methods)
        found = [path for path in (root / gin_file for root in _search_paths())
                 for path in (path, path / "pipeline.gin") if path.is_file()]
        if not found:
            near = _close(gin_file, [f"pipelines/{p.name}" for p in
                                     sorted((REPO_ROOT / "pipelines").iterdir()) if p.is_dir()])
            raise ConfigError(f"gin file {gin_file!r} not found (looked in {Path.cwd()} and "
                              f"{REPO_ROOT}); {near}a method's pipeline is pipelines/<name>/"
                              "pipeline.gin (or give the method's folder, pipelines/<name>)")
        resolved.append(str(found[0].absolute()))  # gin finds only cwd-relative top files
    for directory in [str(Path.cwd())] + [str(Path(f).parent) for f in resolved]:
        if directory not in sys.path:
            sys.path.append(directory)
    root_logger = logging.getLogger()
    root_logger.addFilter(_drop_gin_search_misses)
    try:
        gin.parse_config_files_and_bindings(resolved, gin_bindings)
    except (ValueError, KeyError, SyntaxError, IOError, ImportError) as e:
        raise ConfigError(f"gin configuration error: {e}\n{_what_to_change(str(e))}") from e
    finally:
        root_logger.removeFilter(_drop_gin_search_misses)
