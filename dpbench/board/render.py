"""The board rendered: a page is a list of blocks (headings, paragraphs, lists, tables,
images), written once to Markdown (README.md) and to HTML (index.html) by the same code; the
per-group configuration tables are this module's own blocks.

Blocks: ("h", level, text), ("p", markdown), ("ul", [markdown, ...]), ("img", path, alt) and
("table", columns, rows, {"link_last": bool, "fold": int}); markdown text may use **bold**,
`code` and [text](url).
"""

from __future__ import annotations

import html
import re

from dpbench.search.tuning import GROUP_PATTERN


DATASET_WORDS = {"fashion_mnist": "Fashion-MNIST", "mnist": "MNIST", "cifar10": "CIFAR-10",
                 "svhn_cropped": "SVHN"}
MODEL_WORDS = {"tanh_cnn": "the tanh CNN", "scatter_linear": "ScatterNet + linear",
               "scatter_cnn": "ScatterNet + CNN", "wrn": "WRN-16-4"}


def setting_words(group: str, dataset: bool = False) -> str:
    """A group in words: its model and epsilon (and its dataset when asked)."""
    m = GROUP_PATTERN.match(group)
    if m is None:
        return group
    model = MODEL_WORDS.get(m["model"], m["model"])
    where = f", {DATASET_WORDS.get(m['dataset'], m['dataset'])}" if dataset else ""
    return f"{model}{where}, ε {float(m['eps']):g}"


def points(x: float) -> str:
    """A gain in points, signed, two decimals (every board page's one format)."""
    return f"{x:+.2f}"


def interval_text(low: float, high: float) -> str:
    return f"[{points(low)}, {points(high)}]"


def gain_text(gain, se) -> str:
    if gain is None:
        return "n/a"
    return f"{100 * gain:+.2f}" + ("" if se is None else f" ± {100 * se:.2f}")


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
    ("paper", lambda r: r.get("paper") or "n/a"),
    ("paper's claim", lambda r: r.get("claim") or "n/a"),
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
    "once both rows have 2 or more seeds: a description (seeds only, the search's luck left "
    "out), no verdict; 'paper' and 'paper's claim' come from the method's folder (its "
    "method.json).\n"
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
        cells = [_keep_numbers(html.escape(c)) for c in raw]
        if link_last:
            cells[-1] = f"<a href='{html.escape(raw[-1])}'>record</a>"
        if fold and len(raw[1]) > fold:
            short = _keep_numbers(html.escape(raw[1][:fold - 10]))  # never cut an entity
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


def group_blocks(table: dict, plots: dict, trial_plots: dict) -> list:
    """Every group's configuration table (with its plots), after the selection rule."""
    blocks = [("h", 2, "Each group's configurations"),
              ("ul", [line[2:] for line in SELECTION_RULE.splitlines()] + [OTHER_COLUMNS])]
    for group, rows in table.items():
        blocks.append(("h", 3, group))
        if group in plots:
            blocks.append(("img", plots[group], f"accuracy vs epsilon for {group}"))
        if group in trial_plots:
            blocks.append(("img", trial_plots[group],
                           f"expected best validation accuracy vs trials for {group}"))
        blocks.append(("table", COLUMNS, [_cells(row) for row in rows],
                       dict(link_last=True, fold=LONG)))
    return blocks


OTHER_COLUMNS = (
    "**Other columns.** 'configs tried' counts that method's configurations (tuning is not free "
    "in privacy terms). cos(release, clean) and noise/signal are non-private diagnostics (means "
    "over training) where the runs recorded them. Step time vs DP-SGD is the speed benchmark's "
    "ratio at the run's batch size (`PERF.md`); x† marks a ratio of the runs' own median step "
    "times per example (no benchmark row; the batch sizes may differ), given only where both "
    "methods' runs ran on one kind of device (else n/a).")


def markdown(blocks: list) -> str:
    lines = []
    for block in blocks:
        kind = block[0]
        if kind == "h":
            lines += ["#" * block[1] + " " + block[2], ""]
        elif kind == "p":
            lines += [block[1].strip(), ""]
        elif kind == "ul":
            lines += [f"- {item}" for item in block[1]] + [""]
        elif kind == "img":
            lines += [f"![{block[2]}]({block[1]})", ""]
        elif kind == "table":
            lines += markdown_table(block[1], block[2], block[3].get("link_last", False)) + [""]
        else:
            raise ValueError(f"unknown block {kind!r}")
    return "\n".join(lines)


# Numbers never break: a cell wraps only at its spaces (no overflow-wrap: anywhere), and a
# number's characters (digits, sign, point, %) give the browser no break opportunity.
STYLE = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
         "td,th{border:1px solid #999;padding:4px 8px;text-align:right}"
         "td:first-child{text-align:left}img{max-width:100%}"
         "td{max-width:28em}.note{max-width:60em}.n{white-space:nowrap}")


def html_page(title: str, blocks: list) -> str:
    parts = ["<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
             f"<title>{html.escape(title)}</title>", f"<style>{STYLE}</style></head><body>"]
    for block in blocks:
        kind = block[0]
        if kind == "h":
            parts.append(f"<h{block[1]}>{html.escape(block[2])}</h{block[1]}>")
        elif kind == "p":
            parts.append(f"<p class='note'>{_inline_markdown(block[1])}</p>")
        elif kind == "ul":
            parts.append("<ul class='note'>" + "".join(
                f"<li>{_inline_markdown(item)}</li>" for item in block[1]) + "</ul>")
        elif kind == "img":
            parts.append(f"<img src='{html.escape(block[1])}' alt='{html.escape(block[2])}'>")
        elif kind == "table":
            parts += html_table(block[1], block[2], block[3].get("link_last", False),
                                block[3].get("fold", 0))
        else:
            raise ValueError(f"unknown block {kind!r}")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


# A number in scientific notation (1.9e-07) is the one a browser may break: after its hyphen.
_SCIENTIFIC = re.compile(r"\d[\d.]*e[-+]?\d+")


def _keep_numbers(text: str) -> str:
    """Escaped text with each number in scientific notation kept on one line."""
    return _SCIENTIFIC.sub(lambda m: f"<span class='n'>{m[0]}</span>", text)


def note_blocks(note: str) -> list:
    """The board's caveats (records/NOTE.md), one paragraph block each."""
    return [("p", paragraph) for paragraph in re.split(r"\n\s*\n", note.strip()) if note.strip()]


def _inline_markdown(text: str) -> str:
    """Markdown text as HTML: escaped, lines joined, **bold**, `code` and [text](url)."""
    text = _keep_numbers(html.escape(" ".join(line.strip() for line in text.splitlines())))
    text = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", text)
    text = re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", r"<a href='\2'>\1</a>", text)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", text)
