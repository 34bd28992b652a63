"""The board's plots (matplotlib, SVG): accuracy vs epsilon per group, expected best validation
accuracy vs the number of trials, and each paired group's gains. One set-up for every plot of
every board (``figure``, ``legend_outside``, ``save_svg``): the same inputs give the same bytes,
every colour and mark has a legend entry, and the legend sits outside the axes, so it covers no
data, and the saved box holds every label, so none is cut."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib
import numpy as np

from dpbench import records as records_lib
from dpbench.search import tuning
from dpbench.search.tuning import GROUP_PATTERN

matplotlib.use("Agg")  # files only, never a window
matplotlib.rcParams["svg.hashsalt"] = "dpbench"  # deterministic ids in the SVG
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

# A label's colour on every board (board v3's page and board v4's).
LABEL_COLOURS = {"better": "tab:green", "worse": "tab:red", "equivalent": "tab:blue",
                 "inconclusive": "tab:gray"}


def figure(width: float, height: float):
    """A new (figure, axes) of the given size in inches."""
    return plt.subplots(figsize=(width, height))


def legend_outside(ax, handles=None, where: str = "below", ncol: int = 1):
    """The axes' legend outside them: below (centred) or to the right."""
    kwargs = dict(fontsize=8, ncol=ncol, frameon=False)
    if handles is not None:
        kwargs["handles"] = handles
    if where == "below":
        return ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), **kwargs)
    return ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), **kwargs)


def save_svg(fig, path: Path) -> None:
    """The figure as SVG without a date, its box grown to hold every label and the legend
    (nothing cut), written atomically."""
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    records_lib.atomic_write_text(path, buffer.getvalue())


def _finish(fig, ax, labels: tuple, path: Path) -> None:
    xlabel, ylabel, title = labels
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title.replace("__", ", "))
    ax.grid(alpha=0.3)
    legend_outside(ax, where="right")
    save_svg(fig, path)


def plot_groups(table: dict, out_dir: Path) -> dict:
    """One SVG per (dataset, model, delta): test accuracy vs epsilon per method, with spread.
    Returns group -> plot path for the first group of each family only: a plot covers every
    epsilon of its family, so the board shows it once."""
    by_family, family_of = {}, {}
    for group, rows in table.items():
        match = GROUP_PATTERN.match(group)
        family = f"{match['dataset']}__{match['model']}__delta{match['delta']}"
        family_of[group] = family
        for row in rows:
            by_family.setdefault(family, {}).setdefault(row["method"], []).append(
                (float(match["eps"]), row["test_mean"], row["test_std"]))
    for family, methods in sorted(by_family.items()):
        fig, ax = figure(7, 4.5)
        for method, points in sorted(methods.items()):
            points.sort()
            eps, mean, std = (np.array(v) for v in zip(*points))
            ax.errorbar(eps, 100 * mean, yerr=100 * std, marker="o", capsize=3,
                        label=f"{method} (mean ± std over seeds)")
        _finish(fig, ax, ("epsilon", "test accuracy (%)", family),
                out_dir / "plots" / f"{family}.svg")
    first_group = {}
    for group, family in family_of.items():
        first_group.setdefault(family, group)
    return {group: f"plots/{family}.svg" for family, group in first_group.items()}


def plot_expected_best(table: dict, out_dir: Path) -> dict:
    """One SVG per searched group: each method's expected best validation accuracy against the
    number of trials n = 1..K (tuning.expected_best over its K seed-0 trials; a diverged trial
    counts as 0). A flat curve: the method needs little tuning. Returns group -> plot path."""
    out = {}
    for group, rows in table.items():
        searched = [r for r in rows if r["search"] is not None]
        if not searched:
            continue
        fig, ax = figure(7, 4.5)
        for row in sorted(searched, key=lambda r: r["method"]):
            scores = [0.0 if v is None else v for v in row["search"]["validation"].values()]
            trials = np.arange(1, len(scores) + 1)
            ax.plot(trials, [100 * tuning.expected_best(scores, n) for n in trials],
                    marker="o", label=row["method"])
        _finish(fig, ax, ("number of trials", "expected best validation accuracy (%)",
                          group), out_dir / "plots" / f"{group}__trials.svg")
        out[group] = f"plots/{group}__trials.svg"
    return out


def plot_forest(analysis: dict, title: str, coverage: float, out_dir: Path) -> str:
    """One SVG per paired (v3) group: each method's gain over DP-SGD (points, the mean over the
    winners' retrain seeds) with its simultaneous interval (``coverage``: two-sided, the same
    for every row), coloured by its label; the median paired per-trial gain as a hollow diamond
    (descriptive); the paper's claimed range as a shaded band on the method's row (an open end
    runs to the axis). Every colour and mark present has a legend entry. Returns the plot's
    path relative to ``out_dir``."""
    rows = sorted(((m, r) for m, r in analysis["methods"].items() if "tuned" in r),
                  key=lambda item: item[0], reverse=True)
    ends = [v for _, r in rows for v in (r["tuned"]["low"], r["tuned"]["high"])]
    ends += [v for _, r in rows for v in (r["claim_range"] or ()) if v is not None]
    ends += [100 * r["paired_gains"]["median"] for _, r in rows
             if (r.get("paired_gains") or {}).get("median") is not None]
    lo, hi = min(ends + [0.0]) - 0.5, max(ends + [0.0]) + 0.5
    fig, ax = figure(7, 0.45 * len(rows) + 1.4)
    present, diamond, band = set(), False, False
    for y, (method, r) in enumerate(rows):
        claim = r["claim_range"]
        if claim is not None:  # a point claim gets a visible sliver
            left = lo if claim[0] is None else claim[0]
            right = hi if claim[1] is None else claim[1]
            ax.fill_betweenx([y - 0.3, y + 0.3], left, max(right, left + 0.04),
                             color="tab:orange", alpha=0.3, linewidth=0)
            band = True
        t = r["tuned"]
        colour = LABEL_COLOURS.get(t["label"], "black")  # black: undecided
        present.add(t["label"] if t["label"] in LABEL_COLOURS else "undecided")
        ax.errorbar(t["point"], y, xerr=[[t["point"] - t["low"]], [t["high"] - t["point"]]],
                    fmt="o", color=colour, capsize=4)
        gains = r.get("paired_gains")
        if gains is not None and gains["median"] is not None:
            ax.plot(100 * gains["median"], y + 0.22, marker="D", markerfacecolor="none",
                    color=colour, linestyle="none")
            diamond = True
    handles = [Line2D([], [], color=LABEL_COLOURS.get(label, "black"), marker="o",
                      label=f"{label}: gain, seeds 1-4, {100 * coverage:.2f}% simultaneous interval")
               for label in [*LABEL_COLOURS, "undecided"] if label in present]
    if diamond:
        handles.append(Line2D([], [], color="black", marker="D", markerfacecolor="none",
                              linestyle="none", label="median paired per-trial gain "
                              "(descriptive; the row's colour)"))
    if band:
        handles.append(Patch(color="tab:orange", alpha=0.3, label="paper's claimed gain"))
    ax.axvline(0.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [m for m, _ in rows])
    ax.set_xlim(lo, hi)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_xlabel("gain over DP-SGD (test accuracy points)")
    ax.set_title(title + ("\n(DP-SGD's row below its best recorded configuration)"
                          if analysis["baseline"]["status"] == "weaker" else ""))
    ax.grid(alpha=0.3, axis="x")
    legend_outside(ax, handles)
    path = f"plots/{analysis['group']}__forest.svg"
    save_svg(fig, out_dir / path)
    return path
