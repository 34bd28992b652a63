"""Command line: ``dpbench COMMAND [flags]`` (``dpbench help`` lists the commands);
``dpbench --gin_file=pipelines/dpsgd/pipeline.gin --gin_bindings=... --workdir=...`` trains."""

from __future__ import annotations

import sys
from pathlib import Path


from dpbench import accounting, checkpoint, cli_args, config
from dpbench.compiler.rules import PipelineError, validate_pipeline
from dpbench.run import loop as run_loop
from dpbench.run import start as run_start
from dpbench.run import launch
from dpbench.run import trials as run_trials


def _train_parser() -> cli_args.FlagParser:
    parser = cli_args.FlagParser("dpbench train", COMMANDS["train"])
    cli_args.add_gin_flags(parser)
    parser.add_argument("--workdir", default=None,
                        help="where the run writes its config, checkpoints, metrics and "
                             "record; an unfinished run there is resumed (required)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start again in a --workdir that holds a finished run (the old "
                             "run is moved to <workdir>/superseded/, never deleted)")
    parser.add_argument("--trials", default=None,
                        help="a JSON list of {workdir, gin_files, bindings}: every trial "
                             "trained as --workdir/--gin_file/--gin_bindings would train it, "
                             "trials that differ only in their numbers as one compiled step "
                             "(what a sweep launches; replaces --workdir and --gin_file)")
    parser.add_argument("--outcomes", default=None,
                        help="with --trials: write each trial's outcome (finished, or "
                             "diverged with its message) to this JSON file at the end")
    return parser


def _check_parser() -> cli_args.FlagParser:
    parser = cli_args.FlagParser("dpbench check", COMMANDS["check"])
    cli_args.add_gin_flags(parser)
    return parser


def _train_trials_file(args) -> None:
    if args.workdir or args.gin_file or args.gin_bindings:
        _bad_input("--trials names every trial's workdir, gin files and bindings: drop "
                   "--workdir, --gin_file and --gin_bindings")
    try:
        outcomes = run_trials.run_trials_file(Path(args.trials), args.outcomes and
                                              Path(args.outcomes), overwrite=args.overwrite)
    except (config.ConfigError, PipelineError, accounting.BudgetError, FileNotFoundError,
            FileExistsError, ValueError, checkpoint.CheckpointError) as e:
        print(f"dpbench: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"dpbench: interrupted; rerun the same command to resume the trials of "
              f"{args.trials} from their checkpoints", file=sys.stderr)
        sys.exit(130)
    diverged = sum(o["outcome"] == launch.DIVERGED for o in outcomes)
    print(f"{len(outcomes)} trials: {len(outcomes) - diverged} finished, {diverged} diverged")


def main(args) -> None:
    if args.trials:
        _train_trials_file(args)
        return
    if not args.workdir:
        _bad_input("--workdir is required (where the run writes its record)")
    if not args.gin_file:
        _bad_input("give at least one --gin_file, e.g. pipelines/dpsgd/pipeline.gin")
    try:
        config.parse_config(args.gin_file, args.gin_bindings)
        run_trials.train(args.workdir, gin_files=args.gin_file, overwrite=args.overwrite)
    except (config.ConfigError, PipelineError, accounting.BudgetError, FileNotFoundError,
            FileExistsError, ValueError, checkpoint.CheckpointError,
            run_loop.TrainingDiverged) as e:
        print(f"dpbench: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        # Ctrl-C: every checkpoint and record is written atomically, so what was saved is
        # intact; say how to go on, not where Python was (128 + SIGINT, as shells report it)
        saved = run_start.saved_steps(Path(args.workdir))
        print("dpbench: interrupted; " + (
            f"rerun the same command to resume {args.workdir} from its checkpoint at step "
            f"{saved[-1]}" if saved else "nothing was saved yet: rerun the same command to "
            f"start {args.workdir} again"), file=sys.stderr)
        sys.exit(130)


def _bad_input(message: str) -> None:
    print(f"dpbench: error: {message}", file=sys.stderr)
    sys.exit(cli_args.BAD_INPUT_EXIT)


def check_main(args) -> None:
    """``dpbench check --gin_file=...``: verifies the declaration of every stage of the pipeline
    that is not dpbench's own (dpbench/compiler/check.py) and says what each passed."""
    if not args.gin_file:
        _bad_input("give at least one --gin_file, e.g. my_methods/mine/pipeline.gin")
    from dpbench.compiler import check as stage_check
    try:
        config.parse_config(args.gin_file, args.gin_bindings)
        name, stages = config.pipeline_stages()
        validate_pipeline(stages)
        outside = {s.name for s in stage_check.unverified_stages(stages)}
        for stage in stages:
            passed = stage_check.verify_stage(stage) if stage.name in outside else None
            print(f"{stage.name}: " + ("dpbench's own (verified by its tests)" if passed is None
                                       else f"passed {', '.join(passed)}"))
    except (config.ConfigError, PipelineError, ValueError) as e:
        print(f"dpbench: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"pipeline {name}: every declaration holds; `dpbench train` runs these checks too")


COMMANDS = {
    "train": "train one pipeline and write its run record (the default: `dpbench --gin_file=...` "
             "is `dpbench train --gin_file=...`)",
    "audit": "audit a pipeline's compiled step with a canary: an empirical epsilon lower bound",
    "check": "verify the privacy declarations of a pipeline's own stages on synthetic data "
             "(train and sweep run it first)",
    "sweep": "run the board's tuning protocol on Ray Tune (the [sweep] extra); modes: run, "
             "prepare, secret, progress, cost",
    "board": "render the leaderboard from run records (also `dpbench leaderboard`)",
}


def usage() -> str:
    rows = "\n".join(f"  {name:<8} {text}" for name, text in COMMANDS.items())
    return ("usage: dpbench COMMAND [flags]   (dpbench COMMAND --help: its flags, with their "
            f"defaults)\n\ncommands:\n{rows}\n\nexample: dpbench train "
            "--gin_file=pipelines/dpsgd/pipeline.gin --workdir=runs/dpsgd\n")


def _command(argv: list) -> tuple:
    """(command, its arguments): the first argument names the command unless it is a flag,
    in which case the command is train (``dpbench --gin_file=...`` keeps working)."""
    if argv and not argv[0].startswith("-"):
        return ("board" if argv[0] == "leaderboard" else argv[0]), argv[1:]
    return "train", argv


def run():
    """The console script: ``dpbench COMMAND [flags]``, see ``usage``. Every command runs as
    an absl main (``cli_args.absl_main``): its own flags and absl's standard ones."""
    if sys.argv[1:] in ([], ["-h"], ["--help"], ["help"]):
        print(usage(), file=sys.stdout if sys.argv[1:] else sys.stderr)
        sys.exit(0 if sys.argv[1:] else 2)
    command, rest = _command(sys.argv[1:])
    if command not in COMMANDS:
        print(f"dpbench: error: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        sys.exit(2)
    if command in ("train", "check") and {"-h", "--help"} & set(rest):
        (_check_parser() if command == "check" else _train_parser()).print_help()
        print()
        sys.exit(_registered_help(rest))
    parse, execute = _entry(command)
    cli_args.absl_main(f"dpbench {command}", parse, execute, rest)


def _entry(command: str) -> tuple:
    """(parse, execute) of a command: its flags to a namespace, the namespace to an exit code.
    Imported on demand: each command's module is slow to import (matplotlib, Ray, the audit's
    checks), and none of them imports this module (no cycle)."""
    if command == "board":
        from dpbench import board
        return board.parse_args, board.run_board
    if command == "sweep":
        from dpbench import sweep
        return sweep.parse_args, sweep.run_sweep
    if command == "audit":
        from dpbench import audit
        return audit.flag_parser().parse_args, audit.audit_main
    if command == "check":
        return _check_parser().parse_args, check_main
    return _train_parser().parse_args, main


def _registered_help(rest: list) -> int:
    """The models, datasets and stages a gin file may name: dpbench's own, and, with
    --gin_file given, those its ``import`` lines register (a user's plug-ins)."""
    from dpbench import data, models
    from dpbench.stages.base import registered_stage_names
    gin_files = [a.split("=", 1)[1] for a in rest if a.startswith("--gin_file=")]
    if gin_files:
        try:
            config.parse_config(gin_files, [])
        except config.ConfigError as e:
            print(f"dpbench: error: {e}", file=sys.stderr)
            return cli_args.BAD_INPUT_EXIT
    print("models (model.name):", ", ".join(models.registered_models()))
    print("datasets (dataset.name):", ", ".join(data.registered_datasets()))
    print("stages:", ", ".join(registered_stage_names()))
    return 0


if __name__ == "__main__":
    run()
