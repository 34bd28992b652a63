"""Board v3's verdicts, for a group searched with paired trials: per method, its gain over DP-SGD
labelled by the rule board v4 first registered (board/v3_rule.py), the paired win rate (a
description), the epsilon of what the board publishes; per group, the baseline check and what
the verdicts rest on (K, the seeds, the devices).

A group qualifies when its ``search.json`` pairs its trials: every method that keeps a shared
knob binds the same value for it in trial j (``is_paired`` checks the bindings themselves, so a
group is never taken for paired on a flag's word).

What is read, per method (board/arms.py, the one reader of a method's runs): the K search
trials on seed 0 (validation selects; test is what the selection gain reads), the winner's
retrains on the other seeds (the reported accuracy; seed 0, the selected seed, is biased upward
and left out) and every run's DpEvent: the epsilon of everything the board publishes for the
method (PLD composition of its distinct runs, each trajectory once, as if each had drawn fresh
noise; ``arms.published_epsilon``), beside the Papernot-Steinke epsilon of a deployment that keeps K
secret (``tuning.search_summary``). A group whose space was revised after a first search (the
board's ``superseded`` folder) composes the method's superseded runs in too: the search that
ranks was chosen after seeing them.

``analyse_group`` reads a group; ``apply_rule`` labels every group of a board in one family,
once (the rule's bootstrap draws from streams seeded by the group and method names: the same
records give the same bytes).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dpbench import records
from dpbench.board import arms, uncertainty, v3_rule
from dpbench.board.results import BASELINE
from dpbench.board.verdicts import baseline_check
from dpbench.search import junk as search_junk
from dpbench.search import methods
from dpbench.search import space as search_space
from dpbench.search import tuning
from dpbench.search.tuning import GROUP_PATTERN


def is_paired(plan: dict) -> bool:
    """True when trial j >= 1 of every method binds the same values of the shared knobs it
    keeps (at least two methods, at least one random trial, at least one shared knob)."""
    protocol = {"families": {plan["family"]: plan["family_spec"]}}
    names = sorted(plan["methods"])
    if len(names) < 2 or plan["num_trials"] < 2 or not plan["family_spec"].get("space"):
        return False
    for j in range(1, plan["num_trials"]):
        draws = [search_space.shared_draw(plan["methods"][m]["trials"][j], protocol,
                                          plan["family"], m) for m in names]
        for a in draws:
            for b in draws:
                if any(a[k] != b[k] for k in set(a) & set(b)):
                    return False
    return True


def superseded_runs(superseded_dir, method: str) -> list:
    """(identity, DpEvent) of ``method``'s runs in a superseded search of the group (every
    published run record under ``superseded_dir``, any trial and seed; none without the
    folder)."""
    if superseded_dir is None:
        return []
    out = []
    for run_dir in tuning.method_run_dirs(superseded_dir, method):
        path = run_dir / records.RECORD_NAME
        if not path.exists():
            continue
        record = json.loads(path.read_text())
        out.append((arms.run_identity(record, str(path)), record["dp_event"]))
    return out


# The rule board v4 first registered (commit 305f934), which every paired board's labels
# follow (board v3's own, a Bartlett-gated pooled variance, Holm over better/worse only and a
# 3-error Monte Carlo guard, was chosen after its data; its page carries this one and says so)
RULE = methods.REPO_ROOT / "leaderboard" / "v3-rule.json"


def apply_rule(analyses, rule: dict | None = None, seed: int = 0) -> dict:
    """Labels every comparison of ``analyses`` (analyse_group's dicts: the whole board) by the
    rule (board/v3_rule.py on the tuned gain; ``rule``: an analysis, default :data:`RULE`'s):
    better / worse / equivalent within the margin, and the paper's claim, one Holm family over
    all of them, each label settled by decide.py's Monte Carlo rule or 'undecided at N draws'.
    Each row gets v3_rule's description of its tuned gain (``verdict``: its label; the
    interval at the family's one simultaneous level). ``seed``: another Monte Carlo stream (a
    label must not depend on it). Returns {"comparisons", "draws", "level", "margin"}."""
    rule = rule or json.loads(RULE.read_text())
    cells = []
    for a in analyses:
        base = a["methods"][BASELINE]["arm"]
        model = GROUP_PATTERN.match(a["group"])["model"]
        cells += [v3_rule.Cell(a["group"], m, a["epsilon"], model, base, r["arm"], r["shares"],
                               v3_rule.claim_low(r["claim_range"]))
                  for m, r in sorted(a["methods"].items()) if m != BASELINE]
    out = v3_rule.analyse(cells, rule, seed, estimands=("tuned",))
    for a in analyses:
        for method, r in a["methods"].items():
            if (a["group"], method) in out["cells"]:
                tuned = out["cells"][(a["group"], method)]["tuned"]
                r.update(verdict=tuned["label"], tuned=tuned)
    return dict(comparisons=out["comparisons"], draws=out["draws"], level=out["level"],
                margin=float(rule["margin_points"]))


def analyse_group(group_dir, claims: dict, baseline_best=None, superseded_dir=None) -> dict:
    """One finished paired group, read (not yet labelled: ``apply_rule`` labels a board's
    groups together): {"methods": {method: {...}}, "baseline": baseline_check's dict,
    "design": {"trials", "seeds", "devices"}, "junk", "junk_breakdown", "epsilon", "group"}.
    ``superseded_dir``: the runs of an earlier search of this group whose results its space was
    revised after (their runs join each method's published epsilon)."""
    group_dir = Path(group_dir)
    plan = json.loads((group_dir / tuning.SEARCH_FILE).read_text())
    summary = tuning.search_summary(group_dir)
    if BASELINE not in summary:
        raise tuning.SearchRecordError(f"{group_dir}: no {BASELINE} search to compare against")
    epsilon = float(GROUP_PATTERN.match(group_dir.name)["eps"])
    read = {m: arms.read_arm(group_dir, plan, m) for m in summary}
    base = read[BASELINE]
    out = {}
    for method, s in summary.items():
        mine = read[method]
        earlier = superseded_runs(superseded_dir, method)
        published = list(mine.runs) + earlier
        row = dict(winner=mine.winner, num_trials=s["num_trials"],
                   retrains=mine.retrains, mean=float(np.mean(mine.retrains)),
                   published_epsilon=arms.published_epsilon(published, plan["delta"]),
                   published_runs=published, superseded_runs=len(earlier),
                   duplicate_runs=len(published) - len(arms.distinct_events(published)),
                   deployment_epsilon=s.get("deployment_epsilon"),
                   deployment_note=s.get("deployment_note"),
                   claim=claims.get(method, {}),
                   claim_range=methods.claim_range(claims.get(method, {}).get("claim_gain"),
                                                   epsilon),
                   arm=mine, shares=arms.shares_keys(plan, method))
        if method != BASELINE:  # a method whose trials share no knob with DP-SGD's: none
            row["paired_gains"] = uncertainty.paired_trial_gains(
                base.test, mine.test, range(1, plan["num_trials"])) if row["shares"] else None
        out[method] = row
    junk = search_junk.junk_breakdown(group_dir)
    devices = sorted({kind for arm in read.values() for kind, _ in arm.devices})
    return dict(methods=out, baseline=baseline_check(base.retrains, baseline_best),
                epsilon=epsilon, group=group_dir.name, junk=(junk["junk"], junk["random"]),
                junk_breakdown=junk,
                design=dict(trials=plan["num_trials"], seeds=list(plan["seeds"]),
                            devices=devices))
