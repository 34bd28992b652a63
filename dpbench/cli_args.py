"""The one flag system of the ``dpbench`` command, absl's: every command (train, check, audit,
sweep, board) parses its flags with :class:`FlagParser` (``absl.flags.argparse_flags``) and
runs under ``absl.app.run`` (:func:`absl_main`). absl's standard flags work for every command
(``--flagfile``, ``--alsologtostderr``, ``-v``/``--verbosity``, ``--helpfull``), each command
has ``--help`` with its defaults, and bad input is reported one way: ``dpbench: error: ...``
and exit status 2.

Why argparse_flags rather than module-level ``flags.DEFINE_*``: the commands share one
process-wide ``FLAGS``, so one command's ``--out`` would clash with another's (and with a
benchmark's); argparse_flags is absl's own way to give each command its flags while keeping
absl's standard ones.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, NoReturn, Sequence

from absl import app, flags, logging
from absl.flags import argparse_flags

BAD_INPUT_EXIT = 2  # every dpbench command's exit status on bad input (audit's 1 is 'flagged')
# absl's own flags: logging's (--alsologtostderr, -v, ...) and app.run's (--pdb, ...)
_STANDARD_MODULES = ("absl.logging", "absl.app")


def standard_absl_flags() -> flags.FlagValues:
    """absl's standard flags alone, the same flag objects as in ``flags.FLAGS`` (so ``-v 1``
    sets the logging verbosity): a command inherits these, never a flag some other imported
    module defined in the global ``FLAGS`` (a benchmark's ``--out``)."""
    standard = flags.FlagValues()
    for module in _STANDARD_MODULES:
        for flag in flags.FLAGS.flags_by_module_dict().get(module, []):
            standard[flag.name] = flag
    return standard


class FlagParser(argparse_flags.ArgumentParser):
    """argparse with absl's standard flags (``--flagfile`` expands into the command line),
    dpbench's bad-input report (``dpbench: error: ...``, exit 2) and the defaults shown in
    ``--help``."""

    def __init__(self, prog: str, description: str = "", **kwargs):
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(prog=prog, description=description,
                         inherited_absl_flags=standard_absl_flags(), **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        try:
            parsed = super().parse_known_args(args, namespace)
        except flags.Error as e:  # e.g. a --flagfile that does not exist
            self.error(str(e).removeprefix("ERROR:: "))
        flags.FLAGS.mark_as_parsed()  # the standard flags live there too (app.run reads them)
        return parsed

    def error(self, message) -> NoReturn:
        print(f"dpbench: error: {message} ({self.prog} --help lists the flags)", file=sys.stderr)
        sys.exit(BAD_INPUT_EXIT)


def add_gin_flags(parser: argparse.ArgumentParser) -> None:
    """--gin_file and --gin_bindings, each a multi-string flag, applied in order."""
    parser.add_argument("--gin_file", action="append", default=[],
                        help="a gin file or a method folder; repeat for more, applied in order "
                             "(later ones override)")
    parser.add_argument("--gin_bindings", action="append", default=[],
                        help="a gin binding ('train.epochs = 3'); repeat for more, applied "
                             "after the files")


def absl_main(prog: str, parse: Callable[[Sequence[str]], argparse.Namespace],
              execute: Callable[[argparse.Namespace], object], argv: Sequence[str]) -> NoReturn:
    """Runs one command as an absl main: ``app.run`` parses ``argv`` with ``parse`` (its
    flags and absl's), sets up absl logging (INFO on stderr unless ``-v``/``--verbosity``
    says otherwise) and exits with ``execute(args)``'s return value."""
    app.run(execute, argv=[prog, *argv], flags_parser=lambda full: parse(full[1:]))
    raise AssertionError("app.run returned")  # it always exits


def start_logging() -> None:
    """absl logging at INFO on stderr, as ``app.run`` sets it up, for an entry point that is
    called as a function (``audit.run``); a verbosity given on the command line is kept."""
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    logging.use_absl_handler()
    if flags.FLAGS["verbosity"].using_default_value:
        logging.set_verbosity(logging.INFO)
