"""The one flag system of the ``dpbench`` command: every command (train, check, audit, sweep,
board) parses its flags with :class:`FlagParser` (argparse), so each has ``--help`` with its
defaults, and bad input is reported one way: ``dpbench: error: ...`` and exit status 2."""

from __future__ import annotations

import argparse
import sys

from absl import flags, logging

BAD_INPUT_EXIT = 2  # every dpbench command's exit status on bad input (audit's 1 is 'flagged')


class FlagParser(argparse.ArgumentParser):
    """argparse with dpbench's bad-input report (``dpbench: error: ...``, exit 2) and the
    defaults shown in ``--help``."""

    def __init__(self, prog: str, description: str = "", **kwargs):
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(prog=prog, description=description, **kwargs)

    def error(self, message):
        print(f"dpbench: error: {message} ({self.prog} --help lists the flags)", file=sys.stderr)
        sys.exit(BAD_INPUT_EXIT)


def add_gin_flags(parser: argparse.ArgumentParser) -> None:
    """--gin_file and --gin_bindings, each repeatable, applied in order."""
    parser.add_argument("--gin_file", action="append", default=[],
                        help="a gin file or a method folder; repeat for more, applied in order "
                             "(later ones override)")
    parser.add_argument("--gin_bindings", action="append", default=[],
                        help="a gin binding ('train.epochs = 3'); repeat for more, applied "
                             "after the files")


def start_logging() -> None:
    """absl logging at INFO on stderr, as absl's app.run set it up (the run's progress lines);
    absl's own flags keep their defaults."""
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    logging.use_absl_handler()
    logging.set_verbosity(logging.INFO)
