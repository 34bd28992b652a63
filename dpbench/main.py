"""Command line: ``dpbench --gin_file=pipelines/dpsgd.gin --gin_bindings=... --workdir=...``."""

from __future__ import annotations

import sys

from absl import app, flags, logging

from dpbench import accounting, checkpoint, compiler, config, train

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Where the run writes its config, checkpoints, metrics "
                    "and record. An unfinished run there is resumed.")
flags.DEFINE_bool("overwrite", False, "Start again in a --workdir that holds a finished run "
                  "(the old run is moved to <workdir>/superseded/, never deleted).")


def main(argv) -> None:
    del argv
    if not FLAGS.workdir:
        raise app.UsageError("--workdir is required (where the run writes its record)")
    if not FLAGS.gin_file:
        raise app.UsageError("give at least one --gin_file, e.g. pipelines/dpsgd.gin")
    try:
        config.parse_config(FLAGS.gin_file, FLAGS.gin_bindings)
        train.train(FLAGS.workdir, gin_files=FLAGS.gin_file, overwrite=FLAGS.overwrite)
    except (config.ConfigError, compiler.PipelineError, accounting.BudgetError, FileNotFoundError,
            FileExistsError, ValueError, checkpoint.CheckpointError,
            train.TrainingDiverged) as e:
        logging.error("%s: %s", type(e).__name__, e)
        print(f"dpbench: error: {e}", file=sys.stderr)
        sys.exit(2)


def run():
    """The console script: ``dpbench [flags]`` trains; ``dpbench audit [flags]`` audits;
    ``dpbench leaderboard [flags]`` renders the board from run records; ``dpbench sweep
    [flags]`` runs the board's tuning protocol on Ray Tune."""
    # Imported on demand: each subcommand's module is slow to import (matplotlib, the audit's
    # flags), and none of them imports this module (no cycle).
    if len(sys.argv) > 1 and sys.argv[1] == "leaderboard":
        from dpbench import board
        sys.exit(board.main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "sweep":
        from dpbench import sweep
        sys.exit(sweep.main(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "audit":
        from dpbench import audit
        sys.argv = [f"{sys.argv[0]} audit"] + sys.argv[2:]
        audit.run()
        return
    app.run(main)


if __name__ == "__main__":
    run()
