"""Board v3's verdicts, for a group searched with paired trials: per method, its gain over DP-SGD
with an interval that includes the search, the verdict word, the paired win rate, both epsilons;
per group, the baseline check.

A group qualifies when its ``search.json`` pairs its trials: every method that keeps a shared
knob binds the same value for it in trial j (``is_paired`` checks the bindings themselves, so a
group is never taken for paired on a flag's word). Otherwise the v2 verdicts apply.

What is read, per method (all from published records):
- the K search trials on seed 0: validation (selects) and test (what the selection gain reads);
- the winner's retrains on the other seeds: the reported accuracy and the seed part (seed 0, the
  selected seed, is left out: its accuracy is biased upward by the selection);
- every run's DpEvent: the epsilon of everything the board publishes for the method (PLD
  composition of its distinct runs, the K trials and the retrains, each trajectory once, as if
  each run had drawn fresh noise; ``published_epsilon``), beside the
  Papernot-Steinke epsilon of a deployment that keeps K secret (``tuning.search_summary``);
  a group whose space was revised after a first search (the board's ``superseded`` folder
  holds that search's runs) composes the method's superseded runs in too: the search that
  ranks was chosen after seeing them.
The bootstrap's generator is seeded from the group and method names: the same records give the
same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dpbench import records
from dpbench.search import junk as search_junk
from dpbench.search import methods
from dpbench.search import space as search_space
from dpbench.search import tuning
from dpbench.board import uncertainty, v3_rule
from dpbench.board.results import BASELINE
from dpbench.search.tuning import GROUP_PATTERN
from dpbench.board.verdicts import baseline_check

DRAWS = 100_000  # bootstrap draws per gain; each interval prints its ends' Monte Carlo error


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


def _outcome(group_dir: Path, method: str, trial: int, seed) -> dict | None:
    record, _ = tuning.trial_outcome(group_dir, method, trial, seed)
    return record


def run_identity(record: dict, where: str) -> str:
    """A run's trajectory: its final parameters' sha256 (two records with the same one are one
    run published twice); a record without one is its own run."""
    return record.get("final_params_sha256") or f"record:{where}"


def method_runs(group_dir: Path, plan: dict, method: str, winner: int) -> dict:
    """validation/test of the K seed-0 trials (None: diverged), the winner's retrain test
    accuracies, and every published run as (identity, DpEvent) (``run_identity``): a trial that
    diverged counts at the event search.json planned for it (it ran on private data, and that
    it diverged is published)."""
    seeds = plan["seeds"]
    trials = [_outcome(group_dir, method, t, seeds[0]) for t in range(plan["num_trials"])]
    retrains = [_outcome(group_dir, method, winner, s) for s in seeds[1:]]
    if any(r is None for r in retrains):
        raise tuning.SearchRecordError(f"{group_dir}: a retrain of {method}'s winner diverged; "
                                       "its seed part is undefined")
    return dict(validation=[None if r is None else r["validation_accuracy"] for r in trials],
                test=[None if r is None else r["test_accuracy"] for r in trials],
                retrains=[r["test_accuracy"] for r in retrains],
                runs=[(f"diverged:{method}-t{t}", tuning.planned_event(plan, method, t))
                      if r is None else (run_identity(r, f"{method}-t{t}"), r["dp_event"])
                      for t, r in enumerate(trials)] + [
                    (run_identity(r, f"{method}-retrain{i}"), r["dp_event"])
                    for i, r in enumerate(retrains)])


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
        out.append((run_identity(record, str(path)), record["dp_event"]))
    return out


def distinct_events(runs) -> list:
    """The DpEvents of ``runs`` ((identity, event) pairs), each run once: one trajectory
    published twice (the same final parameters, e.g. a superseded search's run that the new
    search repeated byte for byte) is one release. Two records of one trajectory with
    different events contradict each other and are refused."""
    seen = {}
    for identity, event in runs:
        if identity in seen and seen[identity] != event:
            raise tuning.SearchRecordError(
                f"two records of the run {identity[:16]} state different DpEvents; one of "
                "them is not what ran: remove it")
        seen.setdefault(identity, event)
    return list(seen.values())


def published_epsilon(runs, delta: float) -> float:
    """The PLD epsilon of everything published about a method: its distinct runs
    (``distinct_events``) composed as independent mechanisms, i.e. as if each had drawn fresh
    secret noise (a benchmark's seeded runs that share a seed share a noise stream, which
    composition does not model; the board says so)."""
    return tuning.composition_epsilon(distinct_events(runs), delta)


def coarse_epsilon(events, delta: float) -> float:
    """A dataset's total over hundreds of distinct runs' events: PLD on a 3x coarser grid, an
    upper bound all the same (board v3: 98.07 against 97.37 at 1e-3, in 3.5 s instead of
    8.6)."""
    return tuning.published_epsilon([tuning.composed_event(events)], delta,
                                    discretization=3e-3)


# The rule board v4 first registered (commit 305f934), which every paired board's labels
# follow (board v3's own, a Bartlett-gated pooled variance, Holm over better/worse only and a
# 3-error Monte Carlo guard, was chosen after its data; its page carries this one and says so)
RULE = methods.REPO_ROOT / "leaderboard" / "v3-rule.json"


def apply_rule(analyses, rule: dict | None = None, seed: int = 0) -> None:
    """Labels every comparison of ``analyses`` (analyse_group's dicts: one group, or a whole
    board) by the rule (board/v3_rule.py on the tuned gain; ``rule``: an analysis, default
    :data:`RULE`'s): better / worse / equivalent within the margin, and the paper's claim, one
    Holm family over all of them, each label settled by decide.py's Monte Carlo rule or
    'undecided at N draws'. Each row's interval becomes the one at the Holm level that decided
    its label, its MDE the gain that level detects with 80% power. ``seed``: another Monte
    Carlo stream (a label must not depend on it)."""
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
            if (a["group"], method) not in out["cells"]:
                continue
            t = out["cells"][(a["group"], method)]["tuned"]
            r.update(verdict=t["label"], p_adjusted=t["p_adjusted"],
                     comparisons=out["comparisons"], draws=out["draws"],
                     claim_label=t.get("claim", {}).get("label"),
                     interval=dict(r["interval"], gain=t["point"] / 100, low=t["low"] / 100,
                                   high=t["high"] / 100, mde=t["mde"] / 100,
                                   level=1 - 2 * t["level"], decided_by=t["decided_by"]))


def analyse_group(group_dir, claims: dict, baseline_best=None, draws: int = DRAWS,
                  superseded_dir=None, bootstrap_seed: int = 0) -> dict:
    """The v3 verdicts of one finished paired group: {"methods": {method: {...}}, "baseline":
    baseline_check's dict, "paired": True}, labelled by the registered rule over the group's own
    comparisons (a board relabels over all of its groups: ``apply_rule``). ``superseded_dir``:
    the runs of an earlier search of this group whose results its space was revised after
    (their runs join each method's published epsilon). ``bootstrap_seed`` picks another
    Monte Carlo stream (0: the board's; a verdict must not depend on it)."""
    group_dir = Path(group_dir)
    plan = json.loads((group_dir / tuning.SEARCH_FILE).read_text())
    summary = tuning.search_summary(group_dir)
    if BASELINE not in summary:
        raise tuning.SearchRecordError(f"{group_dir}: no {BASELINE} search to compare against")
    epsilon = float(GROUP_PATTERN.match(group_dir.name)["eps"])
    runs = {m: method_runs(group_dir, plan, m, s["winner"]) for m, s in summary.items()}
    base, base_winner = runs[BASELINE], summary[BASELINE]["winner"]
    out = {}
    for method, s in summary.items():
        mine = runs[method]
        earlier = superseded_runs(superseded_dir, method)
        published = mine["runs"] + earlier
        row = dict(winner=s["winner"], num_trials=s["num_trials"],
                   retrains=mine["retrains"], mean=float(np.mean(mine["retrains"])),
                   published_epsilon=published_epsilon(published, plan["delta"]),
                   published_runs=published, superseded_runs=len(earlier),
                   duplicate_runs=len(published) - len(distinct_events(published)),
                   deployment_epsilon=s.get("deployment_epsilon"),
                   deployment_note=s.get("deployment_note"),
                   claim=claims.get(method, {}),
                   claim_range=methods.claim_range(claims.get(method, {}).get("claim_gain"),
                                                   epsilon),
                   arm=v3_rule.Arm(mine["validation"], mine["test"], s["winner"], mine["retrains"],
                              None), shares=v3_rule.shares_keys(plan, method))
        if method != BASELINE:
            stream = ("boot",) if bootstrap_seed == 0 else ("boot", bootstrap_seed)
            rng = np.random.default_rng(search_space.stable_seed(group_dir.name, method,
                                                                 *stream))
            selection = uncertainty.selection_draws(
                base["validation"], base["test"], mine["validation"], mine["test"],
                draws=draws, rng=rng)
            realized = mine["test"][s["winner"]] - base["test"][base_winner]
            interval = uncertainty.gain_interval(base["retrains"], mine["retrains"], selection,
                                                 realized, rng=rng)
            row.update(interval=interval, paired_gains=uncertainty.paired_trial_gains(
                base["test"], mine["test"], range(1, plan["num_trials"])))
        out[method] = row
    check = baseline_check(base["retrains"], baseline_best)
    junk = search_junk.junk_breakdown(group_dir)
    analysis = dict(methods=out, baseline=check, paired=True, epsilon=epsilon,
                    group=group_dir.name, junk=(junk["junk"], junk["random"]),
                    junk_breakdown=junk)
    apply_rule([analysis], seed=bootstrap_seed)
    return analysis
