"""The board's results: run records loaded and validated (a record that cannot be ranked is
refused with its path), configurations chosen on validation, per-group summaries, audits and
speed ratios attached."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import numpy as np

from dpbench import records as records_lib
from dpbench.search import tuning
from dpbench.search.tuning import GROUP_PATTERN


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


# How the train loop's stop_reason of a run that finished begins (the budget stop is a finish).
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


def selection_scores(configs: dict) -> tuple:
    """(selection seeds, {config key: score}): the score is the mean validation accuracy over
    the seeds that every configuration has run (typically the sweep's seed 0, before the
    winner gets more seeds); when no seed is shared, each configuration's mean over all its
    seeds. The selection seeds are a sorted list, or None when none is shared."""
    seed_sets = [{str(r["seed"]) for r in runs} for runs in configs.values()]
    shared = set.intersection(*seed_sets) if seed_sets else set()

    def score(runs):
        chosen = [r for r in runs if str(r["seed"]) in shared] if shared else runs
        return float(np.mean([r["validation_accuracy"] for r in chosen]))

    return (sorted(shared) if shared else None), {k: score(v) for k, v in configs.items()}


def choose_configuration(configs: dict) -> tuple:
    """The configuration chosen on validation: ``configs`` maps a config key to its records.

    The score is selection_scores'. Ties go to the smaller key, so the choice is
    deterministic (a searched group's table then follows its search: _searched_winner).
    Test accuracy is never read.
    Returns (key, selection seeds (sorted list, or None when none is shared), score)."""
    shared, scores = selection_scores(configs)
    best = min(configs, key=lambda key: (-scores[key], key))
    return best, shared, scores[best]


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
    --claimed_epsilon=E --out=<dir>/<pipeline>-eps<E>.json``, see ``dpbench audit --board``). The
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


def device_kinds(runs) -> tuple:
    """The kinds of device ('cpu', 'cuda', ...) the runs' records name ('unknown' for a record
    without ``devices``)."""
    return tuple(sorted({str(d).split(":")[0] for r in runs
                         for d in (r.get("devices") or ["unknown"])}))


def _step_ratio(row: dict, base: Optional[dict], perf: dict) -> tuple:
    """The method's step time over DP-SGD's: from the speed benchmark at the run's batch size
    (measured side by side on a quiet machine) when it has both, else from the runs' own median
    step times (which may have shared the machine) per example, since v2's winners tune their
    batch size (the same ratio as per step when the batch sizes agree), and only where both
    methods' runs ran on one kind of device (a GPU's step against a CPU's is no method's
    cost). Returns (ratio, source)."""
    b = row["batch_size"]
    if (row["method"], b) in perf and (BASELINE, b) in perf:
        return perf[(row["method"], b)] / perf[(BASELINE, b)], "bench"
    if base is None or row["step_s"] is None or base["step_s"] is None:
        return None, None
    if len(row["devices"]) != 1 or row["devices"] != base["devices"]:
        return None, None
    return (row["step_s"] / row["batch_size"]) / (base["step_s"] / base["batch_size"]), "runs"


def _mean_or_none(values: list) -> Optional[float]:
    """The mean of the values that exist (a resumed run whose last segment had no steady step
    records no median step time), None when none does."""
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None


def summarize(records: list[dict], audits: dict, out_dir: Path,
              perf: Optional[dict] = None, selection_seed_out=frozenset()) -> dict:
    """group -> list of method rows (sorted by test accuracy, best first). In the groups of
    ``selection_seed_out`` (board v3's) a row's accuracy leaves out the seeds it was selected
    on, where it has others: the selected seed's accuracy is biased upward."""
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
            key, selection_seeds, val_mean = choose_configuration(configs)
            key = _searched_winner(configs, search.get(method), method, key)
            runs = sorted(configs[key], key=lambda r: (str(r["seed"]), str(r["_path"])))
            if group in selection_seed_out and selection_seeds:
                runs = [r for r in runs if str(r["seed"]) not in selection_seeds] or runs
            others = [sorted(v, key=lambda r: str(r["_path"]))[0]
                      for k, v in sorted(configs.items()) if k != key]
            test_mean, test_std = _mean_std([r["test_accuracy"] for r in runs])
            first = runs[0]
            fidelity = [r["fidelity"] for r in runs if r.get("fidelity")]
            audit = audits.get((method, group_epsilon))  # an audit at this group's epsilon
            rows.append(dict(
                method=method, config=key, config_label=config_label(runs[0], others),
                configs_tried=len(configs), seeds=len(runs),
                test_scores=[float(r["test_accuracy"]) for r in runs],
                test_mean=test_mean, test_std=test_std, validation_mean=val_mean,
                noise_multiplier=first["noise_multiplier"], steps=first["steps"],
                batch_size=first["batch_size"], epochs=first["epochs"],
                accountant=first["accountant"], sampling=first["sampling"]["sampling"],
                epsilon=max(r["epsilon"] for r in runs),
                step_s=_mean_or_none([r["median_step_s"] for r in runs]),
                devices=device_kinds(runs),
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


def _searched_winner(configs: dict, summary: Optional[dict], method: str, chosen: str) -> str:
    """The configuration a search's winner ran (the one its retrains and verdicts use), where
    the group has a search; ``chosen`` otherwise. The two can differ only by a tie on the
    selection seeds (the search ties to the smaller trial, choose_configuration to the
    smaller key); anything else is a contradiction between the records and the search."""
    if not summary or "winner" not in summary:
        return chosen
    prefix = tuning.run_dir_name(method, summary["winner"], 0)[:-1]  # <method>-t<winner>-seed

    def winner_run(path) -> bool:
        parsed = tuning.parse_run_dir(Path(path).parent.name)
        return parsed is not None and parsed[:2] == (method, summary["winner"])
    keys = {k for k, runs in configs.items() for r in runs if winner_run(r["_path"])}
    if len(keys) != 1:
        raise LeaderboardError(
            f"{method}: the search's winner, trial {summary['winner']}, has {len(keys)} "
            f"configurations among the records ({prefix}*)")
    (key,) = keys
    scores = selection_scores(configs)[1]
    if scores[key] != scores[chosen]:
        raise LeaderboardError(
            f"{method}: the search's winner ({prefix}*) scores {scores[key]:.4f} on validation, "
            f"below another configuration's {scores[chosen]:.4f}: the records and the group's "
            "search.json disagree")
    return key


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
