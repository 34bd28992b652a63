"""``dpbench leaderboard``: records -> the board (README.md, index.html, plots), regenerated
byte-identical from the same inputs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


from dpbench.search import methods, registration
from dpbench import records as records_lib
from dpbench.search import tuning
from dpbench.board import frozen, paired
from dpbench.board.plots import plot_expected_best, plot_forest, plot_groups
from dpbench.board.render import render_html, render_markdown
from dpbench.board.results import (BASELINE, LeaderboardError, config_key,
                                   load_audits, load_perf, load_records, searches_in_progress,
                                   summarize)
from dpbench.search.tuning import GROUP_PATTERN
from dpbench.board.verdicts import (baseline_text, best_recorded_baseline, v1_gains,
                                    v3_table, verdict_tables, verdicts)


def build(records_dir, out_dir, audits_dir=None, perf_json=None, claims_json=None,
          v1_records=None, methods_dirs=(methods.BOARD_METHODS,), history=(),
          earlier_records=None, superseded=None) -> dict:
    """Validates the records and writes README.md, index.html and plots/ into ``out_dir``.
    Each method's paper and claim come from its folder under ``methods_dirs``; ``claims_json``
    adds the hand-written 'what changed' sentences of board groups. A group searched with
    paired trials gets board v3's verdicts (``paired.analyse_group``) and a forest plot at the
    top; ``history`` (earlier boards' record folders) feeds its baseline check and
    ``earlier_records`` (the previous board's) the gains it is compared with; ``superseded``
    (group folders of searches a group's space was revised after) joins each such group's
    published epsilons."""
    out_dir = Path(out_dir)
    running = searches_in_progress(Path(records_dir))
    finished = [r for r in load_records(Path(records_dir)) if r["_group"] not in running]
    table = summarize(finished, load_audits(audits_dir), out_dir, load_perf(perf_json),
                      selection_seed_out=_paired_groups(finished))
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
    older = [dict(r, _set=str(d)) for d in history for r in load_records(Path(d))]
    headline = _paired_verdicts(table, finished, older, claims, out_dir, earlier_records,
                                superseded)
    if headline:
        headline[0]["totals"] = totals_text(dataset_totals(headline, older))
    v2_table = {g: rows for g, rows in table.items() if g not in {h["group"] for h in headline}}
    v2_verdicts = verdicts(v2_table, claims, v1_gains(v1_records))
    tables = verdict_tables(v2_verdicts)
    shown = {v["method"] for rows in v2_verdicts.values() for v in rows} | {
        m for h in headline for m, r in h["analysis"]["methods"].items() if "interval" in r}
    for method in sorted(shown - set(claims["methods"])):
        print(f"dpbench board: warning: no method folder for '{method}' in "
              f"{[str(d) for d in methods_dirs]}: its paper and claim show as n/a; pass the "
              "folder holding it with --methods_dirs", file=sys.stderr)
    records_lib.atomic_write_text(out_dir / "README.md", render_markdown(
        table, plots, note, trial_plots, tables, headline))
    records_lib.atomic_write_text(out_dir / "index.html", render_html(
        table, plots, note, trial_plots, tables, headline))
    return table


def _paired_groups(finished) -> set:
    """The finished groups whose search.json pairs its trials and retrains each winner on 2 or
    more seeds besides the selected one (board v3's: the seed part of an interval needs two)."""
    out = set()
    for group, group_dir in {r["_group"]: Path(r["_path"]).parent.parent
                             for r in finished}.items():
        plan_path = group_dir / tuning.SEARCH_FILE
        if not plan_path.exists():
            continue
        plan = json.loads(plan_path.read_text())
        if len(plan["seeds"]) >= 3 and paired.is_paired(plan):
            out.add(group)
    return out


THIS_BOARD = "this board"  # the _set of the board's own records (the baseline check's)


def _own_baseline_key(finished, group):
    """(set, configuration key) of the group's DP-SGD row: its winner's retrains (seeds >= 1)."""
    keys = {config_key(r) for r in finished if r["_group"] == group
            and r["pipeline"] == BASELINE and r.get("seed") not in (0, None)}
    return (THIS_BOARD, keys.pop()) if len(keys) == 1 else None


def _paired_verdicts(table, finished, older, claims, out_dir, earlier_records,
                     superseded=None) -> list:
    """[{group, forest, baseline, table}] for every finished group whose search is paired; the
    verdicts Holm-corrected over every comparison of the board."""
    group_dirs = {r["_group"]: Path(r["_path"]).parent.parent for r in finished}
    known = [dict(r, _set=THIS_BOARD) for r in finished] + list(older)
    earlier = v1_gains(earlier_records)
    analyses = []
    for group in sorted(_paired_groups(finished) & set(table)):
        m = GROUP_PATTERN.match(group)
        best = best_recorded_baseline(known, m["dataset"], m["model"], float(m["eps"]),
                                      float(m["delta"]), _own_baseline_key(finished, group))
        if best is not None:  # named relative to the board: the same bytes on every checkout
            best["where"] = os.path.relpath(best["where"], out_dir.resolve())
        earlier_search = None if superseded is None else Path(superseded) / group
        if earlier_search is not None and not earlier_search.is_dir():
            earlier_search = None
        try:
            analysis = paired.analyse_group(group_dirs[group], claims["methods"], best,
                                            superseded_dir=earlier_search)
        except (tuning.SearchRecordError, ValueError) as e:
            raise LeaderboardError(f"{group}: {e}") from e
        analyses.append((analysis, earlier_search))
    paired.apply_rule([a for a, _ in analyses])  # one family: every comparison on the board
    out = []
    for analysis, earlier_search in analyses:
        out.append(dict(group=analysis["group"], forest=plot_forest(analysis, out_dir),
                        baseline=baseline_text(analysis["baseline"]) + " "
                        + junk_text(analysis["junk_breakdown"])
                        + _superseded_text(analysis, earlier_search, out_dir)
                        + _deployment_text(analysis) + _seed_text(analysis),
                        table=v3_table(analysis, earlier), analysis=analysis))
    return out


def _seed_text(analysis: dict) -> str:
    """How the seed part was estimated, and any run published twice that composes once."""
    text = (" Seed part: Welch per comparison (the rule's variance model: each arm's own "
            "variance, no data-dependent gate).")
    twice = {m: r["duplicate_runs"] for m, r in sorted(analysis["methods"].items())
             if r.get("duplicate_runs")}
    if twice:
        text += (" Published twice, composed once: " + ", ".join(
            f"{m} {n}" for m, n in twice.items()) + " run(s).")
    return text


def dataset_totals(headline, older=()) -> list:
    """Per dataset: the PLD epsilon of every distinct run the board publishes about its images
    (every paired group's runs, superseded searches included), and with the earlier boards'
    runs (``older``: their records) too; each run once, composed as if its noise were fresh."""
    runs, deltas = {}, {}
    for h in headline:
        match = GROUP_PATTERN.match(h["group"])
        deltas.setdefault(match["dataset"], set()).add(float(match["delta"]))
        for r in h["analysis"]["methods"].values():
            runs.setdefault(match["dataset"], []).extend(r["published_runs"])
    out = []
    for dataset, board_runs in sorted(runs.items()):
        delta = max(deltas[dataset])
        earlier = [(paired.run_identity(r, r["_path"]), r["dp_event"]) for r in older
                   if r["dataset"] == dataset and r.get("dp_event") is not None]
        mine, everything = (paired.distinct_events(board_runs),
                            paired.distinct_events(board_runs + earlier))
        out.append(dict(dataset=dataset, delta=delta, runs=len(mine),
                        epsilon=paired.coarse_epsilon(mine, delta),
                        runs_with_history=len(everything),
                        epsilon_with_history=paired.coarse_epsilon(everything, delta)
                        if earlier else None))
    return out


def totals_text(totals) -> str:
    return "".join(
        f" Everything this board publishes about {t['dataset']} ({t['runs']} distinct runs, "
        f"each composed once as if its noise were fresh) is ({t['epsilon']:.1f}, "
        f"{t['delta']:g})-DP for its images"
        + ("" if t["epsilon_with_history"] is None else
           f"; with the earlier boards' runs ({t['runs_with_history']} in all), "
           f"({t['epsilon_with_history']:.1f}, {t['delta']:g})-DP")
        + ": what these tables compare spent that much privacy." for t in totals)


def _deployment_text(analysis: dict) -> str:
    """Why a method has no 'K secret' epsilon (paired.analyse_group's deployment_note)."""
    notes = {m: r["deployment_note"] for m, r in sorted(analysis["methods"].items())
             if r.get("deployment_note")}
    return "".join(f" {m} has no 'ε, K secret': {note}." for m, note in notes.items())


def junk_text(breakdown: dict) -> str:
    """The group's junk sentence: the count, the methods it falls on, and the count against
    each trial's own method's best (paired.junk_breakdown)."""
    where = ", ".join(f"{m} {n}" for m, n in sorted(breakdown["by_method"].items(),
                                                     key=lambda kv: (-kv[1], kv[0])) if n)
    return ("Junk: {} of {} random trials end more than 5 points below the group's best (or "
            "diverged){}; {} of {} end more than 5 points below their own method's best."
            .format(breakdown["junk"], breakdown["random"], f": {where}" if where else "",
                    breakdown["own_best"], breakdown["random"]))


def _superseded_text(analysis: dict, earlier_search, out_dir: Path) -> str:
    if earlier_search is None:
        return ""
    runs = sum(r["superseded_runs"] for r in analysis["methods"].values())
    where = os.path.relpath(earlier_search.resolve(), out_dir.resolve())
    return (f" This group's space was revised after a first search ({runs} runs, published "
            f"in `{where}`, never ranked): each method's 'ε, all published' composes its runs "
            "of that search too.")


BOARD = methods.REPO_ROOT / "leaderboard"
# A committed board's inputs besides its records, paths relative to its folder: the board and
# every archived board keep one, so each regenerates from what it was built with.
INPUTS_FILE = "board.json"
_PATH_INPUTS = ("audits", "claims", "v1_records", "perf", "earlier_records", "superseded")


def board_inputs(board_dir) -> dict:
    """The inputs ``board_dir``/board.json names ({} when it has none: a user's board), as
    absolute paths: audits, claims, v1_records, perf, earlier_records (one each) and history
    (earlier boards' record folders), superseded (searches a group's space was revised
    after, in group folders). A name it does not know, or a path that is missing, is
    an error: a board is never rebuilt without an input it was built with."""
    path = Path(board_dir) / INPUTS_FILE
    if not path.exists():
        return {}
    spec = json.loads(path.read_text())
    unknown = set(spec) - set(_PATH_INPUTS) - {"history", "frozen"}
    if unknown:
        raise LeaderboardError(f"{path}: unknown inputs {sorted(unknown)}; known: "
                               f"{', '.join((*_PATH_INPUTS, 'history'))}")
    out = {k: None if spec.get(k) is None else (path.parent / spec[k]).resolve()
           for k in _PATH_INPUTS}
    out["history"] = [(path.parent / h).resolve() for h in spec.get("history", [])]
    missing = [str(p) for p in [*out.values(), *out["history"]]
               if isinstance(p, Path) and not p.exists()]
    if missing:
        raise LeaderboardError(f"{path} names inputs that are missing: {', '.join(missing)}")
    return out


def resolve_paths(args) -> str | None:
    """Fills the defaults: --out is the folder holding --records (its README links to
    records/...); every input not given on the command line comes from board.json in that
    folder (the committed boards have one; a user's board has none, so nothing of the
    committed board's is mixed in). A path given but missing is an error (returned)."""
    args.out = args.out or str(Path(args.records).resolve().parent)
    try:
        inputs = board_inputs(Path(args.records).resolve().parent)
    except LeaderboardError as e:
        return str(e)
    for name in ("audits", "claims", "v1_records", "perf"):
        given = getattr(args, name)
        if given is None:
            setattr(args, name, None if inputs.get(name) is None else str(inputs[name]))
        elif not Path(given).exists():
            return f"--{name}={given}: no such file or folder"
    # board v3's baseline check reads every earlier board's records; its gains sit beside v2's
    args.history = [str(p) for p in inputs.get("history", [])]
    args.earlier_records = None if inputs.get("earlier_records") is None else str(
        inputs["earlier_records"])
    args.superseded = None if inputs.get("superseded") is None else str(inputs["superseded"])
    return None


def parse_args(argv=None):
    """``dpbench board``'s flags (``argv``: default the process's)."""
    from dpbench.cli_args import FlagParser
    parser = FlagParser("dpbench board", "The leaderboard: run records in, README.md + "
                        "index.html + plots out.")
    parser.add_argument("--records", default=str(BOARD / "records"),
                        help="the run records, in group directories "
                             "<dataset>__<model>__eps<E>__delta<D>")
    parser.add_argument("--out", default=None,
                        help="where README.md, index.html and plots/ are written (default: the "
                             "folder holding --records)")
    parser.add_argument("--audits", default=None,
                        help="audit reports (dpbench audit --out=...), matched per pipeline and "
                             "epsilon (default: the board folder's board.json)")
    parser.add_argument("--claims", default=None,
                        help="the sentences on what changed per group and method, for the "
                             "verdicts (default: the board folder's board.json; each paper's "
                             "claim comes from its method folder)")
    parser.add_argument("--v1_records", default=None,
                        help="board v1's records: its gains go next to v2's in the verdicts "
                             "(default: the board folder's board.json)")
    parser.add_argument("--perf", default=None,
                        help="the speed benchmark's JSON (python -m benchmarks.speed "
                             "--out=X.md; default: the board folder's board.json)")
    parser.add_argument("--methods_dirs", nargs="+", default=[],
                        help="your folders holding method folders (<name>/method.json: paper "
                             "and claim), searched before dpbench's own pipelines/")
    parser.add_argument("--freeze", action="store_true",
                        help="after building, freeze the board: board.json records the hashes "
                             "of its README.md, index.html and records, and later code never "
                             "re-renders it (an archive)")
    return parser.parse_args(sys.argv[1:] if argv is None else argv)


def main(argv=None) -> int:
    """``dpbench board [flags]`` called as a function: the exit code."""
    return run_board(parse_args(argv))


def run_board(args) -> int:
    """Builds (and with --freeze freezes) the board the parsed flags name; the exit code."""
    problem = resolve_paths(args)
    if problem:
        print(f"dpbench: error: {problem}", file=sys.stderr)
        return 2
    if frozen.frozen_spec(args.out) is not None:
        problems = frozen.check_frozen(args.out)
        print(f"dpbench: error: {args.out} is a frozen board (an archive: board.json holds "
              "the hashes of its files and records, and today's code would render it "
              "differently); it is never rebuilt. " + ("Its files still match." if not problems
                                                       else "; ".join(problems) + "."),
              file=sys.stderr)
        return 2
    if registration.analysis_path(args.records).exists():  # a registered board (v4 on)
        return _run_registered(args)
    try:
        table = build(args.records, args.out, args.audits, args.perf, args.claims,
                      args.v1_records, [*args.methods_dirs, methods.BOARD_METHODS],
                      history=args.history, earlier_records=args.earlier_records,
                      superseded=args.superseded)
    except (LeaderboardError, methods.MethodError) as e:
        print(f"dpbench: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}/README.md and {args.out}/index.html "
          f"({sum(len(r) for r in table.values())} rows in {len(table)} groups)")
    if args.freeze:
        frozen.freeze(args.out)
        print(f"froze {args.out}: {INPUTS_FILE} holds the hashes of its files and records")
    return 0


def _run_registered(args) -> int:
    """A board with a registered analysis: rendered with it (board/v4_page.py) beside its
    records, or refused, saying why."""
    from dpbench.board import v4_page
    if Path(args.out).resolve() != Path(args.records).resolve().parent:
        print("dpbench: error: a registered board is rendered beside its records (leave out "
              "--out)", file=sys.stderr)
        return 2
    try:
        page = v4_page.build_v4(args.records, [*args.methods_dirs, methods.BOARD_METHODS],
                                history=args.history)
    except (registration.RegistrationError, tuning.SearchRecordError, LeaderboardError,
            methods.MethodError) as e:
        print(f"dpbench: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {page} with the analysis registered in {page.parent / registration.ANALYSIS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
