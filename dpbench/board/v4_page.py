"""Board v4's page: ``dpbench board`` on a board folder that holds an ``analysis.json`` renders
it with that registered analysis (board/v4.py) and nothing else, or refuses, saying why (an
analysis changed after its registration, a record older than it, a record not committed).

The page gives the decisions first (per method and group: the label, the paired gain, its
simultaneous interval, the claim), then what they rest on (K, the recipe trial, the seeds, the
device, the families), then the figures, each with a legend for every colour and mark, then
the tables, where descriptive columns say so. It prints the registration's commit and date.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dpbench import records as records_lib
from dpbench.board import arms, plots, v4
from dpbench.board.render import interval_text, points, setting_words
from dpbench.board.results import load_records
from dpbench.board.verdicts import baseline_check, best_recorded_baseline
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


_pts = points


def _interval(row: dict) -> str:
    return interval_text(row["low"], row["high"])


def _eps(x: float) -> str:
    return f"{x:.2f}" if np.isfinite(x) else "-"


def _group_words(group: str) -> str:
    return setting_words(group, dataset=True)


def _decision(row: dict) -> str:
    p = row["paired"]
    text = f"**{p['label']}** ({_pts(p['point'])} points {_interval(p)})"
    if p["label"] == "inconclusive":
        text += f"; the board could have detected {p['mde']:.2f}"
    if "claim" in p:
        text += f"; the paper's claim (>= {p['claim']['low']:+.1f}): {p['claim']['label']}"
    return text


def answer_lines(out: dict, epsilons: dict, checks: dict) -> list:
    """The decisions, one line per (method, group), then one per method on the ladder."""
    lines = []
    for (group, method), row in sorted(out["cells"].items(), key=lambda kv: (kv[0][1],
                                                                              kv[0][0])):
        parts = [f"**{method}**, {_group_words(group)}: {_decision(row)}"]
        if row["unpaired"]:
            parts.append("its space is its own: the gain of its mean over its trials")
        if caveat(checks[group]):
            parts.append("**" + caveat(checks[group]) + "**")
        parts.append(f"ε {_eps(epsilons[(group, method)])} for all it publishes")
        lines.append("- " + "; ".join(parts))
    for method, slope in sorted(out["slopes"].items()):
        lines.append(f"- **{method}** on the dimension ladder: **{slope['label']}**, "
                     f"{_pts(slope['point'])} points per doubling of the parameters "
                     f"{_interval(slope)}")
    return lines


def device_cost(board_dir: Path, runs_left: int = 0) -> str:
    """The board's cost line: its landed lent-GPU windows (windows.json, written by
    ``dpbench sweep land``), their device time and runs, and, with ``runs_left``, how many
    more windows those need at the rate measured."""
    path = Path(board_dir) / records_lib.WINDOWS_NAME
    entries = json.loads(path.read_text()) if path.exists() else []
    if not entries:
        return "No lent-GPU window has landed yet."
    seconds, runs = sum(e["device_s"] for e in entries), sum(e["runs"] for e in entries)
    kinds = ", ".join(sorted({str(e["device"]) for e in entries}))
    text = (f"{len(entries)} lent-GPU window(s) ({kinds}): {seconds / 60:.1f} device minutes, "
            f"{runs} runs" + (f", {60 * runs / seconds:.2f} per device minute" if seconds
                              else "") + ".")
    if runs_left and runs:
        text += (f" At {runs / len(entries):.0f} runs a window, the {runs_left} runs left "
                 f"need about {-(-runs_left * len(entries) // runs)} more.")
    return text


def design_lines(analysis: dict, out: dict) -> list:
    """What the decisions rest on, in words, from the registered analysis."""
    d = analysis["design"]
    return [
        f"Each group: {d['trials_per_method']} trials per method (trial 0 the method's own "
        f"recipe, then {d['trials_per_method'] - 1} quasirandom points shared by every "
        f"method), the winner chosen on validation and retrained on seeds 1-{d['retrains']}; "
        f"{d['device']['rule']}",
        f"Decided: the paired gain in one Holm family of {out['families']['main']} at "
        f"{analysis['family']['alpha']} ('better', 'worse', the papers' claims above 0); its "
        f"interval is simultaneous: each end at the family's first Holm level; "
        "'inconclusive' prints the gain the board could have detected (80% power). The "
        f"ladder's slopes: their own family of {out['families']['ladder']}.",
        f"Descriptive, outside both families: the tuned gain (winners' retrain means) and "
        f"its {100 * analysis['intervals']['tuned_level']:g}% bootstrap interval "
        f"({analysis['intervals']['tuned_coverage']}); the shared trials' sign test "
        "(wins-losses, unadjusted p)."]


def _plot_gains(out: dict, path: Path) -> None:
    rows = sorted(out["cells"].items())
    colours = {k: plots.LABEL_COLOURS[k] for k in ("better", "worse", "inconclusive")}
    fig, ax = plots.figure(9, 0.35 * len(rows) + 2.0)
    for y, ((group, method), row) in enumerate(rows):
        p = row["paired"]
        ax.errorbar(p["point"], y, xerr=[[p["point"] - p["low"]], [p["high"] - p["point"]]],
                    fmt="o", color=colours[p["label"]], capsize=3)
        if row["tuned"] is not None:
            ax.plot(row["tuned"]["point"], y + 0.25, "D", mfc="none", color="black", ms=5)
    for label, colour in colours.items():
        ax.errorbar([], [], xerr=[], fmt="o", color=colour, capsize=3,
                    label=f"paired gain, {label} (bar: simultaneous interval)")
    ax.plot([], [], "D", mfc="none", color="black", label="tuned gain (descriptive)")
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(range(len(rows)), [f"{m} · {_group_words(g)}" for (g, m), _ in rows],
                  fontsize=7)
    ax.set_xlabel("gain over DP-SGD (test accuracy points)")
    plots.legend_outside(ax, ncol=2)
    plots.save_svg(fig, path)


def _plot_ladder(out: dict, path: Path) -> None:
    fig, ax = plots.figure(7, 5)
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
    ax.set_ylabel("paired gain over DP-SGD (points)")
    ax.set_title("The dimension ladder: dots, each rung's gain; dotted, the fitted slope")
    plots.legend_outside(ax)
    plots.save_svg(fig, path)


def published_epsilons(plans: dict, cells: list) -> dict:
    """(group, method) -> the epsilon of everything the board publishes for the method in the
    group, tuning included: its K trials and its retrains (the arm's runs), each distinct run
    once, composed with PLD (board/arms.published_epsilon)."""
    return {(c.group, c.method): arms.published_epsilon(c.mine.runs, plans[c.group]["delta"])
            for c in cells}


def baseline_checks(cells: list, history=()) -> dict:
    """group -> the baseline check (board/verdicts.baseline_check): is DP-SGD's row at least
    the best other DP-SGD configuration on record (``history``: earlier boards' record
    folders), seeds 1 and up? A row against a weaker baseline says so in the row."""
    known = [dict(r, _set=str(d)) for d in history for r in load_records(Path(d))]
    checks = {}
    for cell in cells:
        if cell.group in checks:
            continue
        m = tuning.GROUP_PATTERN.match(cell.group)
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
    lines = ["| method | group | K | paired gain | simultaneous interval | label | MDE | claim | "
             "tuned gain (descriptive) | its interval | sign test (descriptive) | ε, all "
             "published | baseline |", "|" + "---|" * 13]
    for key, row in sorted(out["cells"].items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cell, p, t, sign = by_key[key], row["paired"], row["tuned"], row["sign"]
        tuned = ["-", "-"] if t is None else [_pts(t["point"]), _interval(t)]
        lines.append("| " + " | ".join([
            key[1], _group_words(key[0]), str(len(cell.mine.validation)),
            _pts(p["point"]) + (" (own space)" if row["unpaired"] else ""), _interval(p),
            p["label"], f"{p['mde']:.2f}", p["claim"]["label"] if "claim" in p else "-",
            *tuned,
            "-" if sign is None else f"{sign['wins']}-{sign['losses']}, p {sign['sign_p']:.2g}",
            _eps(epsilons[key]), caveat(checks[key[0]]) or "ok"]) + " |")
    return lines


def ladder_lines(out: dict) -> list:
    if not out["slopes"]:
        return []
    lines = ["| method | slope per doubling | interval | label | DP-SGD's winner per rung "
             "(retrain mean) |", "|---|---|---|---|---|"]
    for method, s in sorted(out["slopes"].items()):
        dpsgd = ", ".join(f"{p:,}: {a:.2f}" for p, a in s["dpsgd"] if a is not None)
        lines.append(f"| {method} | {_pts(s['point'])} | {_interval(s)} | {s['label']} | "
                     f"{dpsgd} |")
    return lines


def page_lines(out: dict, cells: list, analysis: dict, head: list, epsilons: dict,
               checks: dict, plots: dict, cost: str = "") -> list:
    """The page's markdown: the decisions first, what they rest on, the figures, the
    tables."""
    lines = ["# Board v4: each method against DP-SGD, tuned alike", "", *head, "",
             "## Decisions", "", *answer_lines(out, epsilons, checks), "",
             "## What they rest on", "", *[f"- {x}" for x in design_lines(analysis, out)],
             *([f"- Its runs' device time: {cost}"] if cost else []), ""]
    if plots:
        lines += ["## Figures", ""]
    if "gains" in plots:
        lines += [f"![gains]({plots['gains']})", "",
                  "Each row a method in one group: the dot and bar its paired gain and "
                  "simultaneous interval, coloured by the decision (green better, red worse, "
                  "grey inconclusive); the hollow diamond its tuned gain (descriptive).", ""]
    if "ladder" in plots:
        lines += [f"![the dimension ladder]({plots['ladder']})", ""]
    lines += ["## Tables", "", "Decisions (paired gain, label, claim) and descriptions "
              "(tuned gain, sign test) side by side; the descriptive columns say so in "
              "their heads.", "", *table_lines(out, cells, epsilons, checks), ""]
    if out["slopes"]:
        lines += ["## The dimension ladder", "", *ladder_lines(out), ""]
    return lines


def render(out: dict, cells: list, registered: dict, board_dir: Path,
           epsilons: dict, checks: dict) -> Path:
    """Writes ``board_dir``/README.md and its plots; returns the page's path."""
    plots = {}
    if out["cells"]:
        _plot_gains(out, board_dir / "plots" / "v4-gains.svg")
        plots["gains"] = "plots/v4-gains.svg"
    if out["slopes"]:
        _plot_ladder(out, board_dir / "plots" / "v4-ladder.svg")
        plots["ladder"] = "plots/v4-ladder.svg"
    head = [f"Analysis registered in commit `{registered['commit'][:10]}` on "
            f"{registered['date']} (`analysis.json`); every record under `records/` was "
            "committed after it, checked when this page was built (`dpbench board`)."]
    page = board_dir / PAGE
    records_lib.atomic_write_text(page, "\n".join(page_lines(
        out, cells, registered["analysis"], head, epsilons, checks, plots,
        device_cost(board_dir))))
    return page


def build_v4(records_dir, methods_dirs, history=()) -> Path:
    """The registered board whose records are ``records_dir``: checked (registration), analysed
    (v4.analyse) and rendered beside them; ``history``: earlier boards' record folders, for
    the baseline check. Raises RegistrationError or SearchRecordError."""
    board_dir = Path(records_dir).resolve().parent
    registered = registration.registration(board_dir)
    plans = _plans(records_dir)
    analysis = registered["analysis"]
    cells = v4.read_cells(records_dir, plans, methods_lib.claims(methods_dirs),
                          analysis["design"]["device"]["jax"])
    out = v4.analyse(cells, analysis)
    return render(out, cells, registered, board_dir,
                  published_epsilons(plans, cells),
                  baseline_checks(cells, history))
