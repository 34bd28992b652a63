"""The board's plots (matplotlib, SVG): accuracy vs epsilon per group, expected best
validation accuracy vs the number of trials."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from dpbench import records as records_lib
from dpbench.search import tuning
from dpbench.search.tuning import GROUP_PATTERN


def plot_groups(table: dict, out_dir: Path) -> dict:
    """One SVG per (dataset, model, delta): test accuracy vs epsilon per method, with spread.
    Returns group -> plot path for the first group of each family only: a plot covers every
    epsilon of its family, so the board shows it once."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    matplotlib.rcParams["svg.hashsalt"] = "dpbench"  # deterministic ids in the SVG
    by_family, family_of = {}, {}
    for group, rows in table.items():
        match = GROUP_PATTERN.match(group)
        family = f"{match['dataset']}__{match['model']}__delta{match['delta']}"
        family_of[group] = family
        for row in rows:
            by_family.setdefault(family, {}).setdefault(row["method"], []).append(
                (float(match["eps"]), row["test_mean"], row["test_std"]))
    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    for family, methods in sorted(by_family.items()):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for method, points in sorted(methods.items()):
            points.sort()
            eps, mean, std = (np.array(v) for v in zip(*points))
            ax.errorbar(eps, 100 * mean, yerr=100 * std, marker="o", capsize=3, label=method)
        _finish_plot(fig, ax, ("epsilon", "test accuracy (%)", family),
                     out_dir / "plots" / f"{family}.svg")
    first_group = {}
    for group, family in family_of.items():
        first_group.setdefault(family, group)
    return {group: f"plots/{family}.svg" for family, group in first_group.items()}


def _finish_plot(fig, ax, labels: tuple, path: Path) -> None:
    """Axis labels, title (a group or family name), grid and legend; then the SVG, written
    atomically and without a date (the same inputs give the same bytes)."""
    import matplotlib.pyplot as plt
    xlabel, ylabel, title = labels
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title.replace("__", ", "))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", metadata={"Date": None})
    plt.close(fig)
    records_lib.atomic_write_text(path, buffer.getvalue())


def plot_expected_best(table: dict, out_dir: Path) -> dict:
    """One SVG per v2 group: each method's expected best validation accuracy against the
    number of trials n = 1..K (tuning.expected_best over its K seed-0 trials; a diverged trial
    counts as 0). A flat curve: the method needs little tuning. Returns group -> plot path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    matplotlib.rcParams["svg.hashsalt"] = "dpbench"
    out = {}
    for group, rows in table.items():
        searched = [r for r in rows if r["search"] is not None]
        if not searched:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for row in sorted(searched, key=lambda r: r["method"]):
            scores = [0.0 if v is None else v for v in row["search"]["validation"].values()]
            trials = np.arange(1, len(scores) + 1)
            ax.plot(trials, [100 * tuning.expected_best(scores, n) for n in trials],
                    marker="o", label=row["method"])
        _finish_plot(fig, ax, ("number of trials", "expected best validation accuracy (%)",
                               group), out_dir / "plots" / f"{group}__trials.svg")
        out[group] = f"plots/{group}__trials.svg"
    return out


def plot_forest(analysis: dict, out_dir: Path) -> str:
    """One SVG per paired (v3) group: each method's gain over DP-SGD (points, the mean over the
    winners' retrain seeds) with its interval including the search (at the Holm level that
    decided its verdict), a vertical line at 0, and the paper's claimed range as a shaded band
    on the method's row (an open end runs to the axis). Returns the plot's path relative to
    ``out_dir``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    matplotlib.rcParams["svg.hashsalt"] = "dpbench"
    rows = sorted(((m, r) for m, r in analysis["methods"].items() if "interval" in r),
                  key=lambda item: item[0], reverse=True)
    ends = [100 * v for _, r in rows for v in (r["interval"]["low"], r["interval"]["high"])]
    ends += [v for _, r in rows for v in (r["claim_range"] or ()) if v is not None]
    ends += [100 * r["paired_gains"]["median"] for _, r in rows
             if (r.get("paired_gains") or {}).get("median") is not None]
    lo, hi = min(ends + [0.0]) - 0.5, max(ends + [0.0]) + 0.5
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.4))
    labelled = False
    for y, (method, r) in enumerate(rows):
        claim = r["claim_range"]
        if claim is not None:  # a point claim gets a visible sliver
            left = lo if claim[0] is None else claim[0]
            right = hi if claim[1] is None else claim[1]
            ax.fill_betweenx([y - 0.3, y + 0.3], left, max(right, left + 0.04),
                             color="tab:orange", alpha=0.3, linewidth=0,
                             label=None if labelled else "paper's claim")
            labelled = True
        interval = r["interval"]
        gain = 100 * interval["gain"]
        color = {"better": "tab:green", "worse": "tab:red"}.get(r["verdict"], "tab:gray")
        if r["verdict"].startswith("equivalent"):
            color = "tab:blue"
        ax.errorbar(gain, y, xerr=[[gain - 100 * interval["low"]],
                                   [100 * interval["high"] - gain]],
                    fmt="o", color=color, capsize=4)
        gains = r.get("paired_gains")
        if gains is not None and gains["median"] is not None:  # the paired estimand beside it
            ax.plot(100 * gains["median"], y + 0.22, marker="D", markerfacecolor="none",
                    color=color, linestyle="none")
    ax.axvline(0.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [m for m, _ in rows])
    ax.set_xlim(lo, hi)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    title = analysis["group"]
    if analysis["baseline"]["status"] == "weaker":
        # its own line: on the group's line it ran past both sides of a 7-inch figure
        title += "\n(DP-SGD row below its best recorded configuration)"
    labels = ("gain over DP-SGD, test accuracy points (interval incl. search, at the level "
              "that decided the verdict)", "", title)
    ax.set_xlabel(labels[0])
    ax.set_title(title.replace("__", ", "))
    fig.tight_layout()  # a short figure: keep the x label and title inside it
    _finish_plot(fig, ax, labels, out_dir / "plots" / f"{analysis['group']}__forest.svg")
    return f"plots/{analysis['group']}__forest.svg"
