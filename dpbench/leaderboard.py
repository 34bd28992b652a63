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
"""

from __future__ import annotations

import hashlib
import html
import io
import json
import re
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from dpbench import records as records_lib
from dpbench import tuning

GROUP_PATTERN = re.compile(r"^(?P<dataset>[\w\-]+)__(?P<model>[\w\-]+)__eps(?P<eps>[0-9.e+\-]+)"
                           r"__delta(?P<delta>[0-9.e+\-]+)$")
REQUIRED = ("pipeline", "dataset", "model", "target_epsilon", "epsilon", "delta",
            "test_accuracy", "validation_accuracy", "noise_multiplier", "steps", "batch_size",
            "epochs", "accountant", "sampling", "seed", "median_step_s", "privacy_statement",
            "stages", "ema_decay")
BASELINE = "dpsgd"


class LeaderboardError(ValueError):
    """A record the leaderboard cannot use; the message names its path."""


def _group_of(path: Path, root: Path):
    for parent in path.parents:
        if parent == root.parent:
            break
        match = GROUP_PATTERN.match(parent.name)
        if match:
            return parent, match
    raise LeaderboardError(f"{path}: not inside a group directory named "
                           "<dataset>__<model>__eps<epsilon>__delta<delta>")


# How train.py's stop_reason of a run that finished begins (the budget stop is a finish).
FINISHED_STOP_REASONS = ("completed all steps", "privacy budget reached")


def unrankable_reason(record: dict) -> Optional[str]:
    """Why the board must neither choose nor rank ``record`` (None when it may): a refit
    without validation accuracy (the board chooses on validation), a failed or diverged run
    (validation or test accuracy not a finite number, NaN / infinity also as the strings a run
    record stores them as; a stop_reason that is not a finished run's)."""
    if record["validation_accuracy"] is None:
        return ("no validation accuracy (a dataset.validation_size = 0 refit); the board "
                "chooses on validation, so it cannot rank this run")
    for name in ("validation_accuracy", "test_accuracy"):
        if tuning.finished_score(record[name]) is None:
            return (f"{name} {record[name]!r} is not a finite number: a failed or diverged "
                    "run is never chosen or ranked; rerun it or remove its record")
    stop = record.get("stop_reason")
    if stop is not None and not str(stop).startswith(FINISHED_STOP_REASONS):
        return (f"stop_reason {stop!r} is not a finished run's: a failed or diverged run is "
                "never chosen or ranked; rerun it or remove its record")
    return None


def load_records(root: Path) -> list[dict]:
    """Every run record below ``root``, validated; each gains '_path' and '_group'."""
    root = Path(root)
    if not root.is_dir():
        raise LeaderboardError(f"records directory {root} does not exist")
    out = []
    for path in sorted(root.rglob(records_lib.RECORD_NAME)):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise LeaderboardError(f"{path}: unreadable run record ({e})") from e
        missing = [name for name in REQUIRED if name not in record]
        if missing:
            raise LeaderboardError(f"{path}: missing field(s) {', '.join(missing)}")
        group_dir, match = _group_of(path, root)
        expected = (match["dataset"], match["model"], float(match["eps"]),
                    float(match["delta"]))
        got = (record["dataset"], record["model"], float(record["target_epsilon"]),
               float(record["delta"]))
        if got != expected:
            raise LeaderboardError(
                f"{path}: (dataset, model, epsilon, delta) = {got} does not match its group "
                f"{group_dir.name} = {expected}; move the record to its own group")
        reason = unrankable_reason(record)
        if reason is not None:
            raise LeaderboardError(f"{path}: {reason}")
        if not record["epsilon"] <= record["target_epsilon"] + 1e-9:
            raise LeaderboardError(f"{path}: reported epsilon {record['epsilon']} exceeds its "
                                   f"target {record['target_epsilon']}")
        if not record["privacy_statement"].get("poisson_accounted", False):
            raise LeaderboardError(f"{path}: its batches were not Poisson-sampled, so its "
                                   "epsilon does not hold; it cannot be ranked")
        record["_path"] = path
        record["_group"] = group_dir.name
        out.append(record)
    if not out and not list(root.rglob(tuning.SEARCH_FILE)):
        raise LeaderboardError(f"no {records_lib.RECORD_NAME} below {root}")
    return out


def searches_in_progress(root: Path) -> dict:
    """group -> (runs published, runs expected) for every v2 search below ``root`` that is not
    finished (some trial, or some seed of a winner, unpublished). A finished search's records
    go on the board; an unfinished one's are listed as in progress, never ranked early."""
    out = {}
    for plan_path in sorted(Path(root).rglob(tuning.SEARCH_FILE)):
        done, expected = tuning.search_progress(plan_path.parent)
        if done < expected:
            out[plan_path.parent.name] = (done, expected)
        elif done > expected:
            raise LeaderboardError(f"{plan_path.parent}: {done} published runs, more than the "
                                   f"{expected} its search.json plans; remove the strays")
    return out


# Run-level settings that, with the stages, make a configuration: record field -> the gin name
# the board shows for it.
RUN_SETTINGS = {"batch_size": "train.batch_size", "epochs": "train.epochs",
                "ema_decay": "train.ema_decay", "accountant": "budget.accountant"}


def config_key(record: dict) -> str:
    """What distinguishes two configurations of one method: everything set except the seed."""
    config = dict(stages=record["stages"], **{k: record[k] for k in RUN_SETTINGS})
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]


def choose_configuration(configs: dict) -> tuple:
    """The configuration chosen on validation: ``configs`` maps a config key to its records.

    The score is the mean validation accuracy over the selection seeds: the seeds that every
    configuration has run (typically the sweep's seed 0, before the winner gets more seeds).
    When no seed is shared, each configuration's mean over all its seeds is used. Ties go to
    the smaller key, so the choice is deterministic. Test accuracy is never read.
    Returns (key, selection seeds (sorted list, or None when none is shared), score)."""
    seed_sets = [{str(r["seed"]) for r in runs} for runs in configs.values()]
    shared = set.intersection(*seed_sets) if seed_sets else set()

    def score(runs):
        chosen = [r for r in runs if str(r["seed"]) in shared] if shared else runs
        return float(np.mean([r["validation_accuracy"] for r in chosen]))

    best = min(configs, key=lambda key: (-score(configs[key]), key))
    return best, (sorted(shared) if shared else None), score(configs[best])


def _flat_settings(record: dict) -> dict:
    """'stage' -> True and 'stage.parameter' -> value for every stage, plus the run-level
    settings that config_key compares."""
    flat = {}
    for stage in record["stages"]:
        name = stage["name"]
        flat[name] = True
        flat.update({f"{name}.{k}": v for k, v in stage.items() if k != "name"})
    flat.update({name: record[k] for k, name in RUN_SETTINGS.items()})
    return flat


def config_label(chosen: dict, others: list[dict]) -> str:
    """What sets the chosen configuration apart from the method's other ones ('default' when it
    is the only one): stages that not all of them have, and settings that differ. A stage
    named this way is not followed by its own parameters."""
    mine = _flat_settings(chosen)
    theirs = [_flat_settings(r) for r in others]
    differing = sorted(k for k in mine if any(t.get(k) != mine[k] for t in theirs))
    stages = [k for k in differing if mine[k] is True]
    settings = [f"{k}={mine[k]}" for k in differing
                if mine[k] is not True and k.rsplit(".", 1)[0] not in stages]
    return ", ".join(stages + settings) or "default"


def _mean_std(values):
    values = np.asarray(values, float)
    return float(values.mean()), float(values.std(ddof=1)) if len(values) > 1 else 0.0


def load_audits(directory) -> dict:
    """(pipeline name, claimed epsilon to 2 decimals) -> audit report (``dpbench audit
    --claimed_epsilon=E --out=<dir>/<pipeline>-eps<E>.json``, see tools/audit_board.sh). The
    claim is the compiler's calibrated epsilon, just below the target, hence the rounding."""
    out = {}
    if directory is None or not Path(directory).is_dir():
        return out
    for path in sorted(Path(directory).glob("*.json")):
        report = json.loads(path.read_text())
        key = (report["pipeline"], round(float(report["claimed_epsilon"]), 2))
        if key in out:
            raise LeaderboardError(f"{path}: a second audit of {key[0]} at epsilon {key[1]}; "
                                   "keep one report per pipeline and epsilon")
        out[key] = report
    return out


def load_perf(path) -> dict:
    """(pipeline, batch size) -> median ms/step from the speed benchmark's JSON
    (``leaderboard/PERF.json``, written next to PERF.md); GEP's default (light) setting. From
    the benchmark's interleaved run (every configuration in one process, steps alternating:
    what its ratios come from) where the JSON has one, else from its separate runs."""
    if path is None or not Path(path).is_file():
        return {}
    rows = json.loads(Path(path).read_text())["rows"]
    interleaved = [(m["spec"], dict(ok=m["ok"] and m["recompiles"] == 0,
                                    ms_median=m["ms_median"]))
                   for row in rows if row["spec"].get("kind") == "interleaved"
                   and row["result"].get("ok") for m in row["result"]["members"]]
    out = {}
    for spec, result in interleaved or [(r["spec"], r["result"]) for r in rows]:
        if (spec.get("group") == "dpbench" and spec.get("setting") in (None, "light")
                and result.get("ok")):
            out[(spec["pipeline"], int(spec["batch_size"]))] = float(result["ms_median"])
    return out


def _step_ratio(row: dict, base: Optional[dict], perf: dict) -> tuple:
    """The method's step time over DP-SGD's: from the speed benchmark at the run's batch size
    (measured side by side on a quiet machine) when it has both, else from the runs' own median
    step times (which may have shared the machine) per example, since v2's winners tune their
    batch size (the same ratio as per step when the batch sizes agree). Returns (ratio,
    source)."""
    b = row["batch_size"]
    if (row["method"], b) in perf and (BASELINE, b) in perf:
        return perf[(row["method"], b)] / perf[(BASELINE, b)], "bench"
    if base is None or row["step_s"] is None or base["step_s"] is None:
        return None, None
    return (row["step_s"] / row["batch_size"]) / (base["step_s"] / base["batch_size"]), "runs"


def _mean_or_none(values: list) -> Optional[float]:
    """The mean of the values that exist (a resumed run whose last segment had no steady step
    records no median step time), None when none does."""
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None


def summarize(records: list[dict], audits: dict, out_dir: Path,
              perf: Optional[dict] = None) -> dict:
    """group -> list of method rows (sorted by test accuracy, best first)."""
    groups = {}
    for record in records:
        groups.setdefault(record["_group"], {}).setdefault(record["pipeline"], {}).setdefault(
            config_key(record), []).append(record)
    table = {}
    for group, methods in sorted(groups.items()):
        group_epsilon = round(float(GROUP_PATTERN.match(group)["eps"]), 2)
        search = _search_of(methods)
        rows = []
        for method, configs in sorted(methods.items()):
            key, _, val_mean = choose_configuration(configs)
            runs = sorted(configs[key], key=lambda r: (str(r["seed"]), str(r["_path"])))
            others = [sorted(v, key=lambda r: str(r["_path"]))[0]
                      for k, v in sorted(configs.items()) if k != key]
            test_mean, test_std = _mean_std([r["test_accuracy"] for r in runs])
            first = runs[0]
            fidelity = [r["fidelity"] for r in runs if r.get("fidelity")]
            audit = audits.get((method, group_epsilon))  # an audit at this group's epsilon
            rows.append(dict(
                method=method, config=key, config_label=config_label(runs[0], others),
                configs_tried=len(configs), seeds=len(runs),
                test_mean=test_mean, test_std=test_std, validation_mean=val_mean,
                noise_multiplier=first["noise_multiplier"], steps=first["steps"],
                batch_size=first["batch_size"], epochs=first["epochs"],
                accountant=first["accountant"], sampling=first["sampling"]["sampling"],
                epsilon=max(r["epsilon"] for r in runs),
                step_s=_mean_or_none([r["median_step_s"] for r in runs]),
                audit_epsilon_lb=None if audit is None else audit["epsilon_lb"],
                fidelity_cosine=(float(np.mean([f["cosine_mean"] for f in fidelity]))
                                 if fidelity else None),
                noise_to_signal=(float(np.mean([f["noise_to_signal_mean"] for f in fidelity]))
                                 if fidelity else None),
                statement=Path(first["_path"]).resolve().relative_to(out_dir.resolve())
                if _is_below(first["_path"], out_dir) else Path(first["_path"]),
                search=search.get(method)))
        base = next((r for r in rows if r["method"] == BASELINE), None)
        for row in rows:
            row["gain"] = None if base is None else row["test_mean"] - base["test_mean"]
            # standard error of the difference of two means (Welch), once both have 2+ seeds
            row["gain_se"] = (None if base is None or row is base
                              or min(row["seeds"], base["seeds"]) < 2 else
                              float(np.sqrt(row["test_std"] ** 2 / row["seeds"]
                                            + base["test_std"] ** 2 / base["seeds"])))
            row["step_ratio"], row["step_source"] = _step_ratio(row, base, perf or {})
        rows.sort(key=lambda r: (-r["test_mean"], r["method"]))
        table[group] = rows
    return table


def _search_of(methods: dict) -> dict:
    """method -> tuning.search_summary of the group's search (v2 groups: a search.json next to
    the records); {} for a v1 group."""
    first = next(iter(next(iter(methods.values())).values()))[0]
    group_dir = Path(first["_path"]).parent.parent
    if not (group_dir / tuning.SEARCH_FILE).exists():
        return {}
    try:
        return tuning.search_summary(group_dir)
    except (tuning.SearchRecordError, KeyError) as e:
        raise LeaderboardError(str(e)) from e


def _is_below(path, directory) -> bool:
    try:
        Path(path).resolve().relative_to(Path(directory).resolve())
        return True
    except ValueError:
        return False


def _fmt(value, spec, missing="n/a"):
    return missing if value is None else format(value, spec)


COLUMNS = ("method", "configuration (chosen on validation)", "test acc (mean ± std)",
           "gain vs DP-SGD (± s.e.)", "seeds", "configs tried", "trials K (law)",
           "ε incl. tuning", "σ", "steps", "batch", "epochs", "ε (reported)", "accountant",
           "sampling",
           "step time vs DP-SGD", "audit ε_lb", "cos(release, clean)", "noise/signal",
           "privacy statement")


SELECTION_RULE = ("Per method, the configuration with the best mean validation accuracy over "
                  "the seeds all its configurations ran (the sweep's seed 0) is shown; test "
                  "accuracy is the mean ± std over all of that configuration's seeds (percent); "
                  "test accuracy never picks anything. 'configuration' names what sets the "
                  "chosen one apart from the method's others. The gain's ± is the standard "
                  "error of the difference of the two means (Welch), shown once both rows "
                  "have 2 or more seeds. "
                  "'trials K' and 'ε incl. tuning' (v2 groups, run by `dpbench sweep` from "
                  "leaderboard/protocol.json): every method of a group ran the same K = 1 + J "
                  "trials (trial 0 its paper's recipe, J drawn once per group from the stated "
                  "law); 'ε incl. tuning' is the RDP epsilon of releasing the search's winner "
                  "(trial 0 composed with dp_accounting's RepeatAndSelectDpEvent over the "
                  "space's worst run), recomputed from the records. It covers a release of the "
                  "one selected model with K and the other trials kept secret: this board "
                  "publishes them all, for research; the winner's retrainings on seeds 1 and "
                  "2 (the spread) are further runs it does not cover either.")


def _cells(row) -> list[str]:
    return [row["method"], row["config_label"],
            f"{100 * row['test_mean']:.2f} ± {100 * row['test_std']:.2f}",
            _gain_text(row["gain"], row["gain_se"]),
            str(row["seeds"]), str(row["configs_tried"]), _trials_cell(row["search"]),
            _fmt(None if row["search"] is None else row["search"]["search_epsilon"], ".3f"),
            f"{row['noise_multiplier']:.4f}",
            str(row["steps"]), str(row["batch_size"]), f"{row['epochs']:g}",
            f"{row['epsilon']:.4f}", row["accountant"], row["sampling"],
            _fmt(row["step_ratio"], ".2f") + ("" if row["step_ratio"] is None else
                                               "x" if row["step_source"] == "bench" else "x†"),
            _fmt(row["audit_epsilon_lb"], ".3f"), _fmt(row["fidelity_cosine"], ".3f"),
            _fmt(row["noise_to_signal"], ".2f"), str(row["statement"])]


LAWS = {0: "logarithmic", 1: "geometric", "inf": "Poisson"}


def _trials_cell(search) -> str:
    """'K (1 + J, J ~ law with mean m)' for a v2 search; 'n/a' for a v1 group."""
    if search is None:
        return "n/a"
    law = search["law"]
    name = LAWS.get(law["shape"], f"truncated neg. binomial, shape {law['shape']}")
    return f"{search['num_trials']} (1 + J, J ~ {name}, mean {law['mean_random']:g})"


def render_markdown(table: dict, plots: dict, note: str = "", trial_plots=None,
                    verdicts=None) -> str:
    lines = ["# dpbench leaderboard", "",
             "Generated by `dpbench leaderboard` from the run records under `records/` (do not "
             "edit by hand). " + SELECTION_RULE + " "
             "'configs tried' counts that method's configurations (tuning is not free in "
             "privacy terms). cos(release, clean) and noise/signal are non-private diagnostics "
             "(means over training) where the runs recorded them. Step time vs DP-SGD is the "
             "speed benchmark's ratio at the run's batch size (`PERF.md`); x† marks a ratio "
             "of the runs' own median step times per example (no benchmark row; the batch "
             "sizes may differ).", ""]
    if note:
        lines += [note.strip(), ""]
    for title, cells in verdicts or []:
        lines += [f"## {title}", "", "| " + " | ".join(VERDICT_COLUMNS) + " |",
                  "|" + "---|" * len(VERDICT_COLUMNS)]
        lines += ["| " + " | ".join(row) + " |" for row in cells] + [""]
    for group, rows in table.items():
        lines += [f"## {group}", ""]
        if group in plots:
            lines += [f"![accuracy vs epsilon]({plots[group]})", ""]
        if group in (trial_plots or {}):
            lines += [f"![expected best validation accuracy vs trials]({trial_plots[group]})",
                      ""]
        lines.append("| " + " | ".join(COLUMNS) + " |")
        lines.append("|" + "---|" * len(COLUMNS))
        for row in rows:
            cells = _cells(row)
            cells[-1] = f"[record]({cells[-1]})"
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _inline_markdown(text: str) -> str:
    """The note's markdown as HTML: escaped, lines joined, **bold**, `code` and [text](url)."""
    text = html.escape(" ".join(line.strip() for line in text.splitlines()))
    text = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", text)
    text = re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", r"<a href='\2'>\1</a>", text)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", text)


def render_html(table: dict, plots: dict, note: str = "", trial_plots=None,
                verdicts=None) -> str:
    parts = ["<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
             "<title>dpbench leaderboard</title>",
             "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #999;padding:4px 8px;text-align:right}"
             "td:first-child{text-align:left}img{max-width:720px}"
             "p.note{max-width:60em}</style></head><body>",
             "<h1>dpbench leaderboard</h1>",
             "<p>" + html.escape(SELECTION_RULE) + " Generated from run records by "
             "<code>dpbench leaderboard</code>. Step time vs DP-SGD: the speed benchmark's "
             "ratio at the run's batch size (PERF.md); x† marks the runs' own step times per "
             "example.</p>"]
    if note:
        parts += [f"<p class='note'>{_inline_markdown(paragraph)}</p>"
                  for paragraph in re.split(r"\n\s*\n", note.strip())]
    for title, cells in verdicts or []:
        parts.append(f"<h2>{html.escape(title)}</h2><table><tr>" + "".join(
            f"<th>{html.escape(c)}</th>" for c in VERDICT_COLUMNS) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                  for row in cells]
        parts.append("</table>")
    for group, rows in table.items():
        parts.append(f"<h2>{html.escape(group)}</h2>")
        if group in plots:
            parts.append(f"<img src='{html.escape(plots[group])}' alt='accuracy vs epsilon "
                         f"for {html.escape(group)}'>")
        if group in (trial_plots or {}):
            parts.append(f"<img src='{html.escape(trial_plots[group])}' alt='expected best "
                         f"validation accuracy vs trials for {html.escape(group)}'>")
        parts.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
                     + "</tr>")
        for row in rows:
            cells = [html.escape(c) for c in _cells(row)]
            cells[-1] = f"<a href='{cells[-1]}'>record</a>"
            parts.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


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


def v1_gains(v1_records) -> dict:
    """(model, epsilon, method) -> (gain, s.e.) over DP-SGD on the archived board v1."""
    if v1_records is None or not Path(v1_records).is_dir():
        return {}
    out = {}
    for group, rows in summarize(load_records(Path(v1_records)), {}, Path(v1_records)).items():
        match = GROUP_PATTERN.match(group)
        for row in rows:
            out[(match["model"], float(match["eps"]), row["method"])] = (row["gain"],
                                                                         row["gain_se"])
    return out


def verdicts(table: dict, claims: dict, v1: dict) -> dict:
    """group -> one row per method (but DP-SGD) of a finished v2 search: its paper's claim,
    board v1's gain at the same model and epsilon, v2's gain +- s.e., the search's epsilon,
    and the sentence on what changed (claims["what_changed"][group], written by hand)."""
    out = {}
    for group, rows in table.items():
        if not any(r["search"] for r in rows):
            continue
        match = GROUP_PATTERN.match(group)
        out[group] = [dict(
            method=r["method"], claim=claims.get("methods", {}).get(r["method"], {}),
            v1=v1.get((match["model"], float(match["eps"]), r["method"])),
            gain=r["gain"], gain_se=r["gain_se"], search=r["search"],
            changed=claims.get("what_changed", {}).get(group, {}).get(r["method"], ""))
            for r in sorted(rows, key=lambda r: r["method"]) if r["method"] != BASELINE]
    return out


def _gain_text(gain, se) -> str:
    if gain is None:
        return "n/a"
    return f"{100 * gain:+.2f}" + ("" if se is None else f" ± {100 * se:.2f}")


VERDICT_COLUMNS = ("method", "paper", "paper's claim", "v1 gain", "v2 gain (± s.e.)",
                   "ε incl. tuning", "what changed")


def verdict_tables(verdict_rows: dict) -> list:
    """[(title, rows of cells)] for the verdicts, one table per finished v2 group."""
    tables = []
    for group, rows in verdict_rows.items():
        cells = [[v["method"], v["claim"].get("paper", "n/a"), v["claim"].get("claim", "n/a"),
                  "n/a (not on v1)" if v["v1"] is None else _gain_text(*v["v1"]),
                  _gain_text(v["gain"], v["gain_se"]), f"{v['search']['search_epsilon']:.3f}",
                  v["changed"] or "—"] for v in rows]
        tables.append((f"Verdicts: {group}", cells))
    return tables


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
    parser = argparse.ArgumentParser(prog="dpbench leaderboard", description=__doc__.split(
        "\n")[0])
    parser.add_argument("--records", default="leaderboard/records")
    parser.add_argument("--audits", default="leaderboard/audits")
    parser.add_argument("--out", default="leaderboard")
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
