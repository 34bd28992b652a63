"""The leaderboard: run records in, leaderboard/README.md + index.html + plots out.

``dpbench leaderboard [--records=leaderboard/records] [--audits=leaderboard/audits]
[--out=leaderboard]`` reads run records only. Records live in group directories named
``<dataset>__<model>__eps<epsilon>__delta<delta>`` (anywhere below --records); a record that
lacks a field, or whose dataset, model, target (epsilon, delta) differ from its group's, or whose
reported epsilon exceeds the target, or that failed or diverged (``unrankable_reason``), is
rejected with its path.

Per group and method (the record's ``pipeline`` name), configurations are the distinct settings
apart from the seed. ``choose_configuration`` picks the one with the best mean VALIDATION
accuracy over the seeds that every configuration of the method has run (so extra seeds of one
configuration cannot tilt the choice); its test accuracy is reported as mean +- std over all its
seeds, with the number of configurations tried. Board v1's sweep used the same function to
decide which configuration gets the extra seeds.
The same records always give the same bytes (sorted order, fixed formats, SVG without dates).
``<records>/NOTE.md``, when present, is shown at the top of the board (its caveats).

The package: ``results`` (load, validate, choose on validation, summarize), ``render`` (a
page's blocks to Markdown and HTML; one table per group), ``plots``, ``paired`` and
``v3_page`` (a paired board's labels and page), ``v4`` and ``v4_page`` (a registered board's),
``build`` (the command).
"""

from dpbench.board.build import INPUTS_FILE, board_inputs, build, main, parse_args, run_board
from dpbench.board.plots import plot_expected_best, plot_groups
from dpbench.board.render import SELECTION_RULE
from dpbench.board.results import (BASELINE, LeaderboardError, choose_configuration, config_key,
                                   config_label, load_audits, load_perf, load_records,
                                   searches_in_progress, summarize, unrankable_reason)
from dpbench.board.verdicts import earlier_gains

__all__ = ["BASELINE", "INPUTS_FILE", "LeaderboardError", "SELECTION_RULE", "board_inputs",
           "build", "choose_configuration", "config_key", "config_label", "earlier_gains",
           "load_audits", "load_perf", "load_records", "main", "parse_args",
           "plot_expected_best", "plot_groups", "run_board", "searches_in_progress",
           "summarize", "unrankable_reason"]
