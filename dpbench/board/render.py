"""The board rendered: one table per group, to Markdown (README.md) and HTML (index.html)."""

from __future__ import annotations

import html
import re

from dpbench.board.verdicts import V3_COLUMNS, VERDICT_COLUMNS, gain_text




def _fmt(value, spec, missing="n/a"):
    return missing if value is None else format(value, spec)


def _step_ratio(row) -> str:
    return _fmt(row["step_ratio"], ".2f") + ("" if row["step_ratio"] is None else
                                             "x" if row["step_source"] == "bench" else "x†")


# The group table, one column per entry: (header, the cell's text from the table row).
GROUP_COLUMNS = (
    ("method", lambda r: r["method"]),
    ("configuration (chosen on validation)", lambda r: r["config_label"]),
    ("test acc (mean ± std)",
     lambda r: f"{100 * r['test_mean']:.2f} ± {100 * r['test_std']:.2f}"),
    ("gain vs DP-SGD (± s.e.)", lambda r: gain_text(r["gain"], r["gain_se"])),
    ("seeds", lambda r: str(r["seeds"])),
    ("configs tried", lambda r: str(r["configs_tried"])),
    ("trials K (law)", lambda r: _trials_cell(r["search"])),
    ("ε incl. tuning", lambda r: _fmt(None if r["search"] is None else
                                      r["search"]["search_epsilon"], ".3f")),
    ("σ", lambda r: f"{r['noise_multiplier']:.4f}"),
    ("steps", lambda r: str(r["steps"])),
    ("batch", lambda r: str(r["batch_size"])),
    ("epochs", lambda r: f"{r['epochs']:g}"),
    ("ε (reported)", lambda r: f"{r['epsilon']:.4f}"),
    ("accountant", lambda r: r["accountant"]),
    ("sampling", lambda r: r["sampling"]),
    ("step time vs DP-SGD", _step_ratio),
    ("audit ε_lb", lambda r: _fmt(r["audit_epsilon_lb"], ".3f")),
    ("cos(release, clean)", lambda r: _fmt(r["fidelity_cosine"], ".3f")),
    ("noise/signal", lambda r: _fmt(r["noise_to_signal"], ".2f")),
    ("privacy statement", lambda r: str(r["statement"])),  # a link to the record
)
COLUMNS = tuple(header for header, _ in GROUP_COLUMNS)


SELECTION_RULE = (
    "- **Selection.** Per method, the configuration with the best mean validation accuracy "
    "over the seeds all its configurations ran (a search's first seed) is shown; test accuracy "
    "is the mean ± std over that configuration's seeds (percent) and never picks anything; in "
    "a paired group (board v3's) over the seeds it was not selected on, as the retrains' seeds "
    "1-4 (seed 0's accuracy is biased upward by the selection). 'configuration' names what sets "
    "the chosen one apart from the method's others.\n"
    "- **Gain.** Its ± is the standard error of the difference of the two means (Welch), shown "
    "once both rows have 2 or more seeds.\n"
    "- **Tuning** ('trials K', 'ε incl. tuning': groups run by `dpbench sweep`, each with the "
    "`search.json` its protocol wrote): every method of a group ran the same K trials (trial 0 "
    "its recipe, the others drawn from the group's search space); 'ε incl. tuning' is the "
    "epsilon of releasing the search's winner, recomputed from the records: for a random K the "
    "RDP epsilon of trial 0 composed with dp_accounting's RepeatAndSelectDpEvent over the "
    "space's worst run, for a fixed K the PLD composition of the K runs. The first covers a "
    "release of the one selected model with K and "
    "the other trials kept secret: this board publishes them all, for research; the winner's "
    "retrainings on the other seeds (the spread) are further runs it does not cover either.")


def _cells(row) -> list[str]:
    return [cell(row) for _, cell in GROUP_COLUMNS]


def markdown_table(columns, rows, link_last: bool = False) -> list:
    """A table's Markdown lines (header, rule, one line per row of cell texts); ``link_last``:
    the last cell is a path shown as a [record] link."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for cells in rows:
        cells = list(cells)
        if link_last:
            cells[-1] = f"[record]({cells[-1]})"
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def html_table(columns, rows, link_last: bool = False, fold: int = 0) -> list:
    """The same table's HTML lines ('<table><tr>' + headers, one line per row, '</table>'),
    every text escaped; ``fold``: a second cell longer than this many characters is folded
    (details/summary), so the table stays one screen wide."""
    lines = ["<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in columns) + "</tr>"]
    for raw in rows:
        cells = [html.escape(c) for c in raw]
        if link_last:
            cells[-1] = f"<a href='{cells[-1]}'>record</a>"
        if fold and len(raw[1]) > fold:
            short = html.escape(raw[1][:fold - 10])  # never cut an entity
            cells[1] = f"<details><summary>{short}…</summary>{cells[1]}</details>"
        lines.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return lines + ["</table>"]


LAWS = {0: "logarithmic", 1: "geometric", "inf": "Poisson"}
LONG = 60  # characters of a configuration shown before the HTML folds it


def _trials_cell(search) -> str:
    """'K (1 + J, J ~ law with mean m)' for a v2 search; 'n/a' for a v1 group."""
    if search is None:
        return "n/a"
    law = search["law"]
    if "fixed" in law:
        return f"{search['num_trials']} (fixed K; ε composes the K runs)"
    name = LAWS.get(law["shape"], f"truncated neg. binomial, shape {law['shape']}")
    return f"{search['num_trials']} (1 + J, J ~ {name}, mean {law['mean_random']:g})"


HEADLINE = (
    "One sentence per column of the verdict tables. 'gain, seeds 1-4': the method's mean test "
    "accuracy over its chosen configuration's retrain seeds minus DP-SGD's, in points (seed 0, "
    "the selected one, is biased upward and left out). 'interval (incl. search)': the "
    "percentiles of bootstrap draws of that gain with the search's luck (trial 0 kept, the "
    "random trials resampled in pairs, both winners re-selected on validation) and each arm's "
    "seed noise (Welch, Student t), at the level of the Holm step that decided the verdict. "
    "'verdict': the rule board v4 first registered before its data (commit 305f934, kept as "
    "leaderboard/v3-rule.json; board v4 has since replaced it after a design study, "
    "leaderboard/v4/study/), applied to this board after its data (this board's own rule was "
    "chosen after seeing it): "
    "better, worse, or equivalent within ±1 point (two one-sided tests), each a hypothesis "
    "rejected under one Holm correction over every hypothesis on the board (the papers' claims "
    "included); each bootstrap p bounded by Clopper-Pearson and more draws taken until every "
    "verdict is settled, so no verdict depends on the random stream that computed it (else "
    "'undecided at N draws'); p shown: the bound that decided it. Inconclusive means the "
    "board could not tell, not that the methods are alike. 'the claim': 'claim excluded' "
    "where the gain is shown below the smallest gain the paper claims, else 'consistent'. "
    "'min. detectable gain': the gain the verdict's test would call at its Holm level with "
    "80% power. 'paired per-trial gain': over the random trials, which share their draws across methods, the median of the method's test "
    "accuracy minus DP-SGD's in the same trial, wins-losses, and the two-sided sign test's p. "
    "'ε, K secret (deployment)': the Papernot-Steinke epsilon of a deployment that runs "
    "`dpbench sweep --secret_trial_count` (J drawn in secret from the declared law, every "
    "trial on its own OS-drawn seed, only the winner released); the board's own runs are "
    "benchmarks with recorded seeds, not that deployment. 'ε, all published': every distinct "
    "run the board publishes for the method (each trajectory once), composed with PLD as if "
    "each had drawn fresh noise; the board's seeded runs of a group share seed 0's stream, "
    "which composition does not model. 'paper' and 'paper's claim': from the method's folder "
    "(its method.json). 'earlier board's gain': board v2's gain ± s.e. for the same model and "
    "epsilon. The shaded band of each plot is the paper's own claim, the hollow diamond the "
    "paired per-trial median.")


def _headline_markdown(headline) -> list:
    if not headline:
        return []
    lines = ["## Headline: gains over DP-SGD, with the search's luck included", "",
             HEADLINE + headline[0].get("totals", ""), ""]
    for h in headline:
        lines += [f"### {h['group']}", "", f"![gains over DP-SGD]({h['forest']})", "",
                  h["baseline"], ""]
    for h in headline:
        title, cells = h["table"]
        lines += [f"## {title}", "", *markdown_table(V3_COLUMNS, cells), ""]
    return lines


def _headline_html(headline) -> list:
    if not headline:
        return []
    parts = ["<h2>Headline: gains over DP-SGD, with the search's luck included</h2>",
             f"<p class='note'>{html.escape(HEADLINE + headline[0].get('totals', ''))}</p>"]
    for h in headline:
        parts += [f"<h3>{html.escape(h['group'])}</h3>",
                  f"<img src='{html.escape(h['forest'])}' alt='gains over DP-SGD for "
                  f"{html.escape(h['group'])}'>",
                  f"<p class='note'>{_inline_markdown(h['baseline'])}</p>"]
    for h in headline:
        title, cells = h["table"]
        parts += _titled_html(title, html_table(V3_COLUMNS, cells))
    return parts


def _titled_html(title: str, table: list) -> list:
    return [f"<h2>{html.escape(title)}</h2>" + table[0], *table[1:]]


def render_markdown(table: dict, plots: dict, note: str = "", trial_plots=None,
                    verdicts=None, headline=None) -> str:
    lines = ["# dpbench leaderboard", "",
             "Generated by `dpbench board` from the run records under `records/` (do not "
             "edit by hand).", "", *_headline_markdown(headline), SELECTION_RULE,
             "- **Other columns.** 'configs tried' counts that method's configurations (tuning "
             "is not free in privacy terms). cos(release, clean) and noise/signal are "
             "non-private diagnostics (means over training) where the runs recorded them. Step "
             "time vs DP-SGD is the speed benchmark's ratio at the run's batch size "
             "(`PERF.md`); x† marks a ratio of the runs' own median step times per example (no "
             "benchmark row; the batch sizes may differ), given only where both methods' runs "
             "ran on one kind of device (else n/a).", ""]
    if note:
        lines += [note.strip(), ""]
    for title, cells in verdicts or []:
        lines += [f"## {title}", "", *markdown_table(VERDICT_COLUMNS, cells), ""]
    for group, rows in table.items():
        lines += [f"## {group}", ""]
        if group in plots:
            lines += [f"![accuracy vs epsilon]({plots[group]})", ""]
        if group in (trial_plots or {}):
            lines += [f"![expected best validation accuracy vs trials]({trial_plots[group]})",
                      ""]
        lines += markdown_table(COLUMNS, [_cells(row) for row in rows], link_last=True)
        lines.append("")
    return "\n".join(lines)


def _inline_markdown(text: str) -> str:
    """The note's markdown as HTML: escaped, lines joined, **bold**, `code` and [text](url)."""
    text = html.escape(" ".join(line.strip() for line in text.splitlines()))
    text = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", text)
    text = re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", r"<a href='\2'>\1</a>", text)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", text)


def render_html(table: dict, plots: dict, note: str = "", trial_plots=None,
                verdicts=None, headline=None) -> str:
    parts = ["<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
             "<title>dpbench leaderboard</title>",
             "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #999;padding:4px 8px;text-align:right}"
             "td:first-child{text-align:left}img{max-width:720px}"
             "td{max-width:28em;overflow-wrap:anywhere}"  # text columns wrap, never overflow
             ".note{max-width:60em}</style></head><body>",
             "<h1>dpbench leaderboard</h1>", *_headline_html(headline),
             "<ul class='note'>" + "".join(f"<li>{_inline_markdown(line[2:])}</li>"
                                           for line in SELECTION_RULE.splitlines()) + "</ul>",
             "<p>Generated from run records by <code>dpbench board</code>. Step time vs "
             "DP-SGD: the speed benchmark's ratio at the run's batch size (PERF.md); x† marks "
             "the runs' own step times per example, given only where both methods' runs ran "
             "on one kind of device.</p>"]
    if note:
        parts += [f"<p class='note'>{_inline_markdown(paragraph)}</p>"
                  for paragraph in re.split(r"\n\s*\n", note.strip())]
    for title, cells in verdicts or []:
        parts += _titled_html(title, html_table(VERDICT_COLUMNS, cells))
    for group, rows in table.items():
        parts.append(f"<h2>{html.escape(group)}</h2>")
        if group in plots:
            parts.append(f"<img src='{html.escape(plots[group])}' alt='accuracy vs epsilon "
                         f"for {html.escape(group)}'>")
        if group in (trial_plots or {}):
            parts.append(f"<img src='{html.escape(trial_plots[group])}' alt='expected best "
                         f"validation accuracy vs trials for {html.escape(group)}'>")
        parts += html_table(COLUMNS, [_cells(row) for row in rows], link_last=True, fold=LONG)
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
