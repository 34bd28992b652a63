"""The Python API, for a notebook or a script: the same runs as the ``dpbench`` command.

    from dpbench import api
    record = api.train("runs/mine", gin_files=["pipelines/dpsgd", "gin/data/digits.gin"],
                       gin="train.epochs = 1")
    print(record["epsilon"], record["test_accuracy"], record["privacy_statement"]["statement"])

A pipeline comes from gin files (a method folder stands for its pipeline.gin) and/or gin text
(any gin, ``include`` and ``import`` lines too), applied in that order. A stage module of your
own may be edited and re-imported (``importlib.reload``) in the same session: its stages
re-register under their names. Every call parses its configuration afresh, so calls do not
leak settings into each other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from dpbench import cli_args, config, records
from dpbench.compiler import check as stage_check
from dpbench.compiler.rules import validate_pipeline
from dpbench.run import trials as run_trials


def _parse(gin_files: Sequence[str], gin: str | Sequence[str]) -> None:
    config.parse_config(list(gin_files), [gin] if isinstance(gin, str) else list(gin))


def configure(gin_files: Sequence[str] = (), gin: str | Sequence[str] = ()) -> tuple:
    """Parses the configuration and checks the pipeline's rules; returns (name, stages)."""
    _parse(gin_files, gin)
    name, stages = config.pipeline_stages()
    validate_pipeline(stages)
    return name, stages


def check(gin_files: Sequence[str] = (), gin: str | Sequence[str] = ()) -> dict:
    """``dpbench check``: stage name -> the declaration checks it passed, for every stage that
    is not dpbench's own (raises ``stage_check.StageCheckError`` naming a failing one)."""
    _, stages = configure(gin_files, gin)
    return stage_check.verify_pipeline(stages)


def train(workdir, gin_files: Sequence[str] = (), gin: str | Sequence[str] = (),
          overwrite: bool = False, progress: bool = True) -> dict:
    """``dpbench train``: trains the configured pipeline into ``workdir`` (an unfinished run
    there is resumed) and returns its run record. ``progress``: the run's progress lines on
    stderr (absl logging at INFO, as the command shows them)."""
    if progress:
        cli_args.start_logging()
    _parse(gin_files, gin)  # the train loop validates the pipeline, once
    return run_trials.train(Path(workdir), config.TrainConfig(), gin_files=list(gin_files),
                           overwrite=overwrite)


def load_record(workdir) -> dict:
    """The run record a finished run left in ``workdir``."""
    return json.loads((Path(workdir) / records.RECORD_NAME).read_text())
