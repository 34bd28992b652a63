"""``dpbench leaderboard``: records -> the board (README.md, index.html, plots), regenerated
byte-identical from the same inputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path


from dpbench import methods
from dpbench import records as records_lib
from dpbench.board.plots import plot_expected_best, plot_groups
from dpbench.board.render import render_html, render_markdown
from dpbench.board.results import (LeaderboardError, load_audits, load_perf, load_records,
                                   searches_in_progress, summarize)
from dpbench.board.verdicts import v1_gains, verdict_tables, verdicts


def build(records_dir, out_dir, audits_dir=None, perf_json=None, claims_json=None,
          v1_records=None, methods_dirs=(methods.BOARD_METHODS,)) -> dict:
    """Validates the records and writes README.md, index.html and plots/ into ``out_dir``.
    Each method's paper and claim come from its folder under ``methods_dirs``; ``claims_json``
    adds the hand-written 'what changed' sentences of board groups."""
    out_dir = Path(out_dir)
    running = searches_in_progress(Path(records_dir))
    finished = [r for r in load_records(Path(records_dir)) if r["_group"] not in running]
    table = summarize(finished, load_audits(audits_dir), out_dir, load_perf(perf_json))
    plots = plot_groups(table, out_dir)
    trial_plots = plot_expected_best(table, out_dir)
    note_path = Path(records_dir) / "NOTE.md"  # the board's caveats, part of its inputs
    note = note_path.read_text() if note_path.exists() else ""
    if running:
        note += "\n\n" + "Searches still running (`dpbench sweep`; not ranked until every " \
            "trial and every winner's seed is published): " + "; ".join(
                f"`{group}` {done} of {expected} runs" for group, (done, expected)
                in sorted(running.items())) + ".\n"
    claims = dict(what_changed=json.loads(Path(claims_json).read_text()).get(
        "what_changed", {}) if claims_json else {}, methods=methods.claims(methods_dirs))
    tables = verdict_tables(verdicts(table, claims, v1_gains(v1_records)))
    records_lib.atomic_write_text(out_dir / "README.md",
                                  render_markdown(table, plots, note, trial_plots, tables))
    records_lib.atomic_write_text(out_dir / "index.html",
                                  render_html(table, plots, note, trial_plots, tables))
    return table


BOARD = methods.REPO_ROOT / "leaderboard"
# Inputs only the committed board has: read by default when --records is its records.
OFFICIAL_INPUTS = dict(audits=BOARD / "audits", claims=BOARD / "claims.json",
                       v1_records=BOARD / "archive" / "v1" / "records", perf=BOARD / "PERF.json")


def resolve_paths(args) -> str | None:
    """Fills the defaults: --out is the folder holding --records (its README links to
    records/...); the committed board's audits, claims, v1 records and PERF.json are read only
    when --records is the committed board's. A path given but missing is an error (returned)."""
    official = Path(args.records).resolve() == (BOARD / "records").resolve()
    args.out = args.out or str(Path(args.records).resolve().parent)
    for name, default in OFFICIAL_INPUTS.items():
        given = getattr(args, name)
        if given is None:
            setattr(args, name, str(default) if official else None)
        elif not Path(given).exists():
            return f"--{name}={given}: no such file or folder"
    if args.v1_records and Path(args.v1_records).resolve() == Path(args.records).resolve():
        args.v1_records = None
    return None


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="dpbench board", description=(
        "The leaderboard: run records in, README.md + index.html + plots out."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--records", default=str(BOARD / "records"),
                        help="the run records, in group directories "
                             "<dataset>__<model>__eps<E>__delta<D>")
    parser.add_argument("--out", default=None,
                        help="where README.md, index.html and plots/ are written (default: the "
                             "folder holding --records)")
    parser.add_argument("--audits", default=None,
                        help="audit reports (dpbench audit --out=...), matched per pipeline and "
                             "epsilon (default: leaderboard/audits for the committed board)")
    parser.add_argument("--claims", default=None,
                        help="the sentences on what changed per group and method, for the "
                             "verdicts (default: leaderboard/claims.json for the committed "
                             "board; each paper's claim comes from its method folder)")
    parser.add_argument("--v1_records", default=None,
                        help="board v1's records: its gains go next to v2's in the verdicts "
                             "(default: leaderboard/archive/v1/records for the committed board)")
    parser.add_argument("--perf", default=None,
                        help="the speed benchmark's JSON (python -m benchmarks.speed "
                             "--out=X.md; default: leaderboard/PERF.json for the committed "
                             "board)")
    parser.add_argument("--methods_dirs", nargs="+", default=[],
                        help="your folders holding method folders (<name>/method.json: paper "
                             "and claim), searched before dpbench's own pipelines/")
    args = parser.parse_args(argv)
    problem = resolve_paths(args)
    if problem:
        print(f"dpbench: error: {problem}", file=sys.stderr)
        return 2
    try:
        table = build(args.records, args.out, args.audits, args.perf, args.claims,
                      args.v1_records, [*args.methods_dirs, methods.BOARD_METHODS])
    except (LeaderboardError, methods.MethodError) as e:
        print(f"dpbench: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}/README.md and {args.out}/index.html "
          f"({sum(len(r) for r in table.values())} rows in {len(table)} groups)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
