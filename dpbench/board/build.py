"""``dpbench leaderboard``: records -> the board (README.md, index.html, plots), regenerated
byte-identical from the same inputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path


from dpbench import records as records_lib
from dpbench.board.plots import plot_expected_best, plot_groups
from dpbench.board.render import render_html, render_markdown
from dpbench.board.results import (LeaderboardError, load_audits, load_perf, load_records,
                                   searches_in_progress, summarize)
from dpbench.board.verdicts import v1_gains, verdict_tables, verdicts


def build(records_dir, out_dir, audits_dir=None, perf_json=None, claims_json=None,
          v1_records=None) -> dict:
    """Validates the records and writes README.md, index.html and plots/ into ``out_dir``."""
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
    claims = json.loads(Path(claims_json).read_text()) if claims_json and Path(
        claims_json).is_file() else {}
    tables = verdict_tables(verdicts(table, claims, v1_gains(v1_records)))
    records_lib.atomic_write_text(out_dir / "README.md",
                                  render_markdown(table, plots, note, trial_plots, tables))
    records_lib.atomic_write_text(out_dir / "index.html",
                                  render_html(table, plots, note, trial_plots, tables))
    return table


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="dpbench board", description=(
        "The leaderboard: run records in, leaderboard/README.md + index.html + plots out."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--records", default="leaderboard/records",
                        help="the run records, in group directories "
                             "<dataset>__<model>__eps<E>__delta<D>")
    parser.add_argument("--audits", default="leaderboard/audits",
                        help="audit reports (dpbench audit --out=...), matched per pipeline and "
                             "epsilon")
    parser.add_argument("--out", default="leaderboard",
                        help="where README.md, index.html and plots/ are written")
    parser.add_argument("--claims", default="leaderboard/claims.json",
                        help="each paper's claim, for the verdicts of v2 groups")
    parser.add_argument("--v1_records", default="leaderboard/archive/v1/records",
                        help="board v1's records: its gains go next to v2's in the verdicts")
    parser.add_argument("--perf", default="leaderboard/PERF.json",
                        help="the speed benchmark's JSON (python -m benchmarks.speed --out=X.md)")
    args = parser.parse_args(argv)
    try:
        same = Path(args.v1_records).resolve() == Path(args.records).resolve()
        table = build(args.records, args.out, args.audits, args.perf, args.claims,
                      None if same else args.v1_records)
    except LeaderboardError as e:
        print(f"dpbench: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}/README.md and {args.out}/index.html "
          f"({sum(len(r) for r in table.values())} rows in {len(table)} groups)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
