"""Board v4's page: ``dpbench board`` on a board folder that holds an ``analysis.json`` renders
it with that registered analysis (board/v4.py) and nothing else, or refuses, saying why (an
analysis changed after its registration, a record older than it, a record not committed).

The page answers first (per method and group: the label, the gain, its interval), then the
figures, each with a legend for every colour and mark, then the tables. It prints the
registration's commit and date.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from dpbench import records as records_lib
from dpbench.board import v4
from dpbench.search import methods as methods_lib
from dpbench.search import registration
from dpbench.search import tuning

PAGE = "README.md"


def _plans(records_dir: Path) -> dict:
    plans = {p.parent.name: json.loads(p.read_text())
             for p in sorted(Path(records_dir).glob(f"*/{tuning.SEARCH_FILE}"))}
    if not plans:
        raise tuning.SearchRecordError(f"{records_dir} holds no <group>/{tuning.SEARCH_FILE}: "
                                       "run the board's sweep (dpbench sweep) first")
    return plans


def _pts(x: float) -> str:
    return f"{x:+.2f}"


def _interval(row: dict) -> str:
    return f"[{_pts(row['low'])}, {_pts(row['high'])}]"


def _gain_text(row: dict) -> str:
    text = f"{row['label']}, {_pts(row['point'])} {_interval(row)}"
    if row["label"] == "inconclusive":
        text += f"; could have detected {row['mde']:.2f}"
    return text


def answer_lines(out: dict, epsilons: dict, checks: dict) -> list:
    """The answer, one line per (group, method), then one per method on the ladder."""
    lines = []
    for (group, method), row in sorted(out["cells"].items()):
        tuned = row["tuned"]
        parts = [f"**{method}**, {group.replace('__', ' ')}: tuned gain {_gain_text(tuned)}"]
        parts.append(f"ε {epsilons[(group, method)]:.2f} for all it publishes, tuning "
                     "included")
        if caveat(checks[group]):
            parts.append("**" + caveat(checks[group]) + "**")
        parts.append("paired: unpaired (its space shares no knob with DP-SGD's)"
                     if row["unpaired"] else f"paired gain {_gain_text(row['paired'])}")
        if "claim" in tuned:
            parts.append(f"the paper's claim (>= {tuned['claim']['low']:+.1f}): "
                         f"{tuned['claim']['label']}")
        lines.append("- " + "; ".join(parts))
    for method, slope in sorted(out["slopes"].items()):
        lines.append(f"- **{method}** on the dimension ladder: {slope['label']}, "
                     f"{_pts(slope['point'])} points per doubling of the parameters "
                     f"{_interval(slope)}")
    return lines


def _plot_gains(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    matplotlib.rcParams["svg.hashsalt"] = "dpbench"
    rows = sorted(out["cells"].items())
    colours = {"better": "tab:green", "worse": "tab:red", "equivalent": "tab:blue",
               "inconclusive": "tab:gray"}
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
    for y, ((group, method), row) in enumerate(rows):
        t = row["tuned"]
        colour = colours.get(t["label"], "black")
        ax.errorbar(t["point"], y, xerr=[[t["point"] - t["low"]], [t["high"] - t["point"]]],
                    fmt="o", color=colour, capsize=3)
    for label, colour in [*colours.items(), ("undecided", "black")]:
        ax.plot([], [], "o", color=colour, label=label)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(range(len(rows)), [f"{m} · {g.replace('__', ' ')}" for (g, m), _ in rows],
                  fontsize=7)
    ax.set_xlabel("tuned gain over DP-SGD (test accuracy points); bar: the interval at the "
                  "Holm level that decided the label")
    ax.legend(fontsize=7, title="label (colour)", loc="best")
    _save(fig, path)


def _plot_ladder(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    matplotlib.rcParams["svg.hashsalt"] = "dpbench"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, slope in sorted(out["slopes"].items()):
        params, gains = zip(*slope["rungs"])
        line, = ax.plot(params, gains, "o-", label=f"{method}: slope {_pts(slope['point'])}/"
                        f"doubling, {slope['label']}")
        x = np.log2(params)
        ax.plot(params, np.mean(gains) + slope["point"] * (x - x.mean()), ":",
                color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xlabel("model parameters (log scale)")
    ax.set_ylabel("tuned gain over DP-SGD (points)")
    ax.set_title("The dimension ladder: dots, each rung's gain; dotted, the fitted slope")
    ax.legend(fontsize=7)
    _save(fig, path)


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt
    buffer = io.StringIO()
    fig.tight_layout()
    fig.savefig(buffer, format="svg", metadata={"Date": None})
    plt.close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    records_lib.atomic_write_text(path, buffer.getvalue())


def published_epsilons(records_dir: Path, plans: dict, cells: list) -> dict:
    """(group, method) -> the epsilon of everything the board publishes for the method in the
    group, tuning included: its K trials and its retrains, each distinct run once, composed
    with PLD (board/paired.published_epsilon)."""
    from dpbench.board import paired
    out = {}
    for cell in cells:
        plan = plans[cell.group]
        runs = paired.method_runs(Path(records_dir) / cell.group, plan, cell.method,
                                  cell.mine.winner)["runs"]
        out[(cell.group, cell.method)] = paired.published_epsilon(runs, plan["delta"])
    return out


def baseline_checks(cells: list, history=()) -> dict:
    """group -> the baseline check (board/verdicts.baseline_check): is DP-SGD's row at least
    the best other DP-SGD configuration on record (``history``: earlier boards' record
    folders), seeds 1 and up? A row against a weaker baseline says so in the row."""
    from dpbench.board.results import load_records
    from dpbench.board.verdicts import baseline_check, best_recorded_baseline
    from dpbench.search.tuning import GROUP_PATTERN
    known = [dict(r, _set=str(d)) for d in history for r in load_records(Path(d))]
    checks = {}
    for cell in cells:
        if cell.group in checks:
            continue
        m = GROUP_PATTERN.match(cell.group)
        best = best_recorded_baseline(known, m["dataset"], m["model"], float(m["eps"]),
                                      float(m["delta"]))
        checks[cell.group] = baseline_check(cell.base.retrains, best)
    return checks


def caveat(check: dict) -> str:
    if check["status"] != "weaker":
        return ""
    return (f"against a DP-SGD row below its best on record ({100 * check['row']:.2f} vs "
            f"{100 * check['best']:.2f}, {check['best_where']})")


def table_lines(out: dict, cells: list, epsilons: dict, checks: dict) -> list:
    by_key = {(c.group, c.method): c for c in cells}
    lines = ["| group | method | K | winner: retrain mean (DP-SGD's) | tuned gain | interval | "
             "label | MDE | paired gain | interval | label | claim | ε, all published "
             "(tuning included) | baseline |", "|" + "---|" * 14]
    for key, row in sorted(out["cells"].items()):
        cell, t = by_key[key], row["tuned"]
        p = row.get("paired")
        lines.append("| " + " | ".join([
            key[0], key[1], str(len(cell.mine.validation)),
            f"t{cell.mine.winner}: {100 * np.mean(cell.mine.retrains):.2f} "
            f"({100 * np.mean(cell.base.retrains):.2f})", _pts(t["point"]), _interval(t),
            t["label"], f"{t['mde']:.2f}", "unpaired" if p is None else _pts(p["point"]),
            "" if p is None else _interval(p), "" if p is None else p["label"],
            t["claim"]["label"] if "claim" in t else "no claim",
            f"{epsilons[key]:.2f}", caveat(checks[key[0]]) or "ok"]) + " |")
    return lines


def render(out: dict, cells: list, registered: dict, board_dir: Path,
           epsilons: dict, checks: dict) -> Path:
    """Writes ``board_dir``/README.md and its plots; returns the page's path."""
    analysis = registered["analysis"]
    plots = {}
    if out["cells"]:
        _plot_gains(out, board_dir / "plots" / "v4-gains.svg")
        plots["gains"] = "plots/v4-gains.svg"
    if out["slopes"]:
        _plot_ladder(out, board_dir / "plots" / "v4-ladder.svg")
        plots["ladder"] = "plots/v4-ladder.svg"
    mc = analysis["monte_carlo"]
    lines = [
        "# Board v4: each method against DP-SGD, tuned alike", "",
        f"Analysis registered in commit `{registered['commit'][:10]}` on {registered['date']} "
        "(`analysis.json`); every record under `records/` was committed after it, checked "
        "when this page was built (`dpbench board`).", "", "## The answer", "",
        *answer_lines(out, epsilons, checks), "",
        f"Labels: one Holm family of {out['comparisons']} hypotheses at "
        f"{analysis['family']['alpha']} over the whole board; 'equivalent' is within "
        f"+-{analysis['margin_points']} point; 'inconclusive' prints the gain the board could "
        f"have detected (80% power, at the level that cell was judged); a label is settled by "
        f"the Monte Carlo rule (draws up to {mc['schedule'][-1]:,}; it differs from the "
        f"infinite-draw label with probability <= {mc['flip_probability']}), else 'undecided "
        "at N draws'. Intervals: the percentile bootstrap at the Holm level of the hypothesis "
        "that decided the label (the selection of both winners resampled, each arm's seeds "
        "with its own variance).", "", "## Figures", ""]
    if "gains" in plots:
        lines += [f"![tuned gains]({plots['gains']})", "",
                  "Each dot a method's tuned gain in one group, its bar the interval; colour: "
                  "the label (green better, red worse, blue equivalent, grey inconclusive, "
                  "black undecided).", ""]
    if "ladder" in plots:
        lines += [f"![the dimension ladder]({plots['ladder']})", ""]
    lines += ["## Tables", "", *table_lines(out, cells, epsilons, checks), ""]
    page = board_dir / PAGE
    records_lib.atomic_write_text(page, "\n".join(lines))
    return page


def build_v4(records_dir, methods_dirs, seed: int = 0, history=()) -> Path:
    """The registered board whose records are ``records_dir``: checked (registration), analysed
    (v4.analyse) and rendered beside them; ``history``: earlier boards' record folders, for
    the baseline check. Raises RegistrationError or SearchRecordError."""
    board_dir = Path(records_dir).resolve().parent
    registered = registration.registration(board_dir)
    plans = _plans(records_dir)
    cells = v4.read_cells(records_dir, plans, methods_lib.claims(methods_dirs))
    out = v4.analyse(cells, registered["analysis"], seed)
    return render(out, cells, registered, board_dir,
                  published_epsilons(records_dir, plans, cells),
                  baseline_checks(cells, history))
