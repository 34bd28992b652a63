"""Command line: ``dpbench --gin_file=pipelines/dpsgd.gin --gin_bindings=... --workdir=...``."""

from __future__ import annotations

import sys
from pathlib import Path

import gin
from absl import app, flags, logging

import dpbench.stages  # noqa: F401  (registers the stages with gin)
from dpbench import accounting, checkpoint, compiler, train
from dpbench.stages.base import registered_stage_names

REPO_ROOT = Path(__file__).resolve().parents[1]

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("gin_file", [], "Gin files, applied in order (later ones override).")
flags.DEFINE_multi_string("gin_bindings", [], "Gin bindings, applied after the files.")
flags.DEFINE_string("workdir", None, "Where the run writes its config, checkpoints, metrics "
                    "and record. An unfinished run there is resumed.")
flags.DEFINE_bool("overwrite", False, "Start again in a --workdir that holds a finished run "
                  "(the old run is moved to <workdir>/superseded/, never deleted).")


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


def parse_config(gin_files, gin_bindings) -> None:
    """Parses gin files and bindings with the repo root and cwd as include search paths.

    Gin's own errors (unknown configurable, misspelled parameter, missing file) are re-raised as
    ConfigError with the list of known stages, so a typo says what the valid names are.
    """
    gin.clear_config()
    for path in (str(Path.cwd()), str(REPO_ROOT)):
        if path not in gin.config._LOCATION_PREFIXES:  # noqa: SLF001 (gin has no getter)
            gin.add_config_file_search_path(path)
    resolved = []
    for gin_file in gin_files:
        found = [Path(root) / gin_file for root in (Path.cwd(), REPO_ROOT)
                 if (Path(root) / gin_file).is_file()]
        if not found:
            raise ConfigError(f"gin file {gin_file!r} not found (looked in {Path.cwd()} and "
                              f"{REPO_ROOT}); pipelines live in pipelines/*.gin")
        resolved.append(str(found[0].absolute()))  # gin finds only cwd-relative top files
    try:
        gin.parse_config_files_and_bindings(resolved, gin_bindings)
    except (ValueError, KeyError, SyntaxError, IOError) as e:
        raise ConfigError(f"gin configuration error: {e}\nknown stages: "
                          f"{', '.join(registered_stage_names())}; check the spelling of "
                          "configurable and parameter names") from e


def main(argv) -> None:
    del argv
    if not FLAGS.workdir:
        raise app.UsageError("--workdir is required (where the run writes its record)")
    if not FLAGS.gin_file:
        raise app.UsageError("give at least one --gin_file, e.g. pipelines/dpsgd.gin")
    try:
        parse_config(FLAGS.gin_file, FLAGS.gin_bindings)
        train.train(FLAGS.workdir, gin_files=FLAGS.gin_file, overwrite=FLAGS.overwrite)
    except (ConfigError, compiler.PipelineError, accounting.BudgetError, FileNotFoundError,
            FileExistsError, ValueError, checkpoint.CheckpointError,
            train.TrainingDiverged) as e:
        logging.error("%s: %s", type(e).__name__, e)
        print(f"dpbench: error: {e}", file=sys.stderr)
        sys.exit(2)


def run():
    """The console script: ``dpbench [flags]`` trains; ``dpbench audit [flags]`` audits;
    ``dpbench leaderboard [flags]`` renders the board from run records."""
    if len(sys.argv) > 1 and sys.argv[1] == "leaderboard":
        from dpbench import leaderboard
        sys.exit(leaderboard.main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "audit":
        from dpbench import audit
        sys.argv = [f"{sys.argv[0]} audit"] + sys.argv[2:]
        audit.run()
        return
    app.run(main)


if __name__ == "__main__":
    run()
