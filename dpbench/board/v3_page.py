"""Board v3's page (a board whose groups were searched with paired trials, labelled by
board/paired.py): the answer first (per method and setting, the label, the gain and its one
simultaneous interval, in words), then what it rests on (K, the recipe trial, the seeds, the
devices, the rule), the figures, the tables, how to read them, and the price in privacy.

Each column has one meaning at one level, said once: every interval is the simultaneous one;
a label Holm's step-down decided at a looser level than that interval shows is marked ‡ with
its interval at that level; descriptive columns say so in their heads; a p at the least its
draws can show is printed as that floor; one privacy number per row, the rest under Privacy.
Blocks out (board/render.py writes them as Markdown and HTML).
"""

from __future__ import annotations

import math

from dpbench.board import render
from dpbench.board.results import BASELINE
from dpbench.search.tuning import GROUP_PATTERN

ORDER = ("better", "worse", "equivalent", "inconclusive")


_pts, _interval = render.points, render.interval_text


def _percent(one_sided: float) -> str:
    """A one-sided level as its two-sided interval's coverage."""
    return f"{100 * (1 - 2 * one_sided):.2f}%"


def _rows(analyses) -> list:
    """[(analysis, method, row)] of every labelled comparison, by setting then method."""
    return [(a, m, r) for a in analyses for m, r in sorted(a["methods"].items())
            if m != BASELINE and "tuned" in r]


def _and(items: list) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def answer_sentences(analyses) -> list:
    """The findings in words, from the labels (never written by hand)."""
    settings = [a["group"] for a in analyses]
    where: dict = {}
    for a, method, r in _rows(analyses):
        label = r["tuned"]["label"]
        where.setdefault(method, {}).setdefault(
            label if label in ORDER else "undecided", []).append(a["group"])
    n = len(settings)
    out = []
    better = {m: g for m, w in where.items() for k, g in w.items() if k == "better"}
    if better:
        out += [f"{m} beats DP-SGD in {_and([render.setting_words(x) for x in g])}."
                for m, g in sorted(better.items())]
    else:
        out.append(f"No method beats DP-SGD in any of the {n} settings.")
    worse_all = sorted(m for m, w in where.items() if len(w.get("worse", [])) == n)
    if worse_all:
        out.append(f"{_and(worse_all)} {'is' if len(worse_all) == 1 else 'are'} worse than "
                   f"DP-SGD in all {n}.")
    for m, w in sorted(where.items()):
        if 0 < len(w.get("worse", [])) < n:
            out.append(f"{m} is worse in "
                       f"{_and([render.setting_words(x) for x in w['worse']])}.")
        if w.get("equivalent"):
            out.append(f"{m} is within the margin of DP-SGD (equivalent) in "
                       f"{_and([render.setting_words(x) for x in w['equivalent']])}.")
        if w.get("undecided"):
            out.append(f"{m}'s label is undecided in "
                       f"{_and([render.setting_words(x) for x in w['undecided']])}.")
    if any(w.get("inconclusive") for w in where.values()):
        out.append("Every other comparison is inconclusive: the board could not tell, which "
                   "is not 'no difference'.")
    weak = [a["group"] for a in analyses if a["baseline"]["status"] == "weaker"]
    if weak:
        out.append(f"In {_and([render.setting_words(g) for g in weak])}, DP-SGD's row is "
                   "below its best recorded configuration: gains there are against a weak "
                   "baseline.")
    return out


def _answer_cell(r: dict) -> str:
    t = r["tuned"]
    mark = "‡" if "step" in t else ""
    return f"{t['label']}{mark} {_pts(t['point'])} {_interval(t['low'], t['high'])}"


def answer_blocks(analyses, board: dict) -> list:
    """The answer: the findings, then one row per method, one column per setting."""
    groups = [a["group"] for a in analyses]
    methods = sorted({m for _, m, _ in _rows(analyses)})
    cells = {(a["group"], m): r for a, m, r in _rows(analyses)}
    rows = [[m] + [_answer_cell(cells[(g, m)]) if (g, m) in cells else "-" for g in groups]
            for m in methods]
    return [("h", 2, "The answer"), ("p", " ".join(answer_sentences(analyses))),
            ("p", f"Each cell: the label, then the gain over DP-SGD in test-accuracy points "
                  f"(each tuned winner's mean over retrain seeds 1-4) and its "
                  f"{_percent(board['level'])} simultaneous interval, the search's luck "
                  "included."),
            ("table", ["method", *[render.setting_words(g) for g in groups]], rows, {})]


def _devices(analyses) -> str:
    kinds = {tuple(a["design"]["devices"]) for a in analyses}
    if len(kinds) == 1:
        (only,) = kinds
        return (f"{_and(list(only))} in every setting" if len(only) > 1 else
                f"{only[0]} everywhere") + " (each record names its device)"
    by_devices: dict = {}
    for a in analyses:
        by_devices.setdefault(", ".join(a["design"]["devices"]) or "unknown", []).append(
            render.setting_words(a["group"]))
    return "; ".join(f"{devices} ({_and(settings)})"
                     for devices, settings in sorted(by_devices.items()))


def _seeds(seeds: list) -> str:
    later = seeds[1:]
    if later == list(range(later[0], later[0] + len(later))):
        return f"{later[0]}-{later[-1]}"
    return ", ".join(map(str, later))


def design_blocks(analyses, board: dict) -> list:
    """What the answer rests on, in words."""
    designs = {(a["design"]["trials"], tuple(a["design"]["seeds"])) for a in analyses}
    trials, seeds = sorted(designs)[0]
    same = len(designs) == 1
    own = sorted({m for _, m, r in _rows(analyses) if not r["shares"]})
    apart = (f" ({_and(own)}'s space shares none of them: {'its' if len(own) == 1 else 'their'}"
             " rows are unpaired)") if own else ""
    return [("h", 2, "What it rests on"), ("ul", [
        f"Each setting: {trials} trials per method{'' if same else ' (in the first; the '}"
        f"{'' if same else 'tables give each)'}: trial 0 the method's recipe from its paper, "
        f"trials 1-{trials - 1} random points at which every method takes the same values of "
        f"the shared knobs{apart}, a method's own knobs drawn apart; each method's winner is "
        "chosen on validation, then retrained on seeds "
        f"{_seeds(list(seeds))}, whose test accuracies make its gain (seed 0, the selected "
        f"one, is biased upward and left out). Trained on: {_devices(analyses)}.",
        f"Labels: the rule board v4 first registered (commit 305f934, `v3-rule.json`), applied "
        f"to this board after its data (this board's own rule was chosen after seeing them): "
        f"one Holm family of {board['comparisons']} hypotheses at α 0.05 over the whole board "
        f"(better, worse, equivalent within ±{board['margin']:g} point, and each paper's "
        "claim); each p a bootstrap proportion bounded with its Monte Carlo error, more draws "
        f"taken until every label was settled ({board['draws']:,} at most), so no label "
        "depends on the random stream that computed it.",
        f"Every interval on this page is simultaneous, {_percent(board['level'])} (α/m a side, "
        "the strictest level any test uses). Holm steps down, so a label may be decided at a "
        "looser level than its interval shows: such a label is marked ‡, and the tables give "
        "its interval at the level that decided it. Board v4's design study found that this "
        "rule's percentile bootstraps reject too often on simulated boards with no true gain "
        "(`v4/study/README.md`): read a lone 'better' or 'worse' near its bound with care.",
        "Inconclusive means the board could not tell, not that the methods are alike; the "
        "tables give the gain each test could have detected (MDE)."])]


def figure_blocks(analyses, forests: dict) -> list:
    blocks = [("h", 2, "Figures")]
    for a in analyses:
        blocks += [("h", 3, render.setting_words(a["group"])),
                   ("img", forests[a["group"]],
                    f"gains over DP-SGD, {render.setting_words(a['group'])}")]
    return blocks


def _p_upper(p: float) -> str:
    """An upper bound on a p, rounded up (never printed below what it bounds)."""
    if p >= 1:
        return "1"
    digits = max(2, -int(math.floor(math.log10(p))) + 1)
    return f"{math.ceil(p * 10 ** digits) / 10 ** digits:.{digits}f}"


def _p_lower(p: float) -> str:
    return f"{math.floor(p * 100) / 100:.2f}"


def p_text(bounds: tuple, decided: bool, floor: bool) -> str:
    """A Holm-adjusted p as its bounds say: decided, at most the upper bound ('<' and 'floor'
    where no draw fell on the null's side: the least those draws can show); not decided, at
    least the lower bound."""
    low, high = bounds
    if not decided:
        return "1" if low >= 1 else f"≥ {_p_lower(low)}"
    return f"< {_p_upper(high)} (Monte Carlo floor)" if floor else f"≤ {_p_upper(high)}"


def _label_cell(t: dict) -> str:
    if "step" not in t:
        return t["label"]
    s = t["step"]
    return (f"{t['label']}‡ (its Holm step's {_percent(s['level'])} interval: "
            f"{_interval(s['low'], s['high'])})")


def _claim_cell(t: dict) -> str:
    c = t.get("claim")
    if c is None:
        return "-"
    text = {"claim excluded": "excluded", "consistent": "not excluded"}.get(c["label"],
                                                                            c["label"])
    text += f" (≥ {_pts(c['low'])}; p {p_text(c['p_adjusted'], c['label'] == 'claim excluded', c['floor'])})"
    if not c["shown"]:
        text += (f"‡ (its Holm step's {_percent(c['step_level'])} interval: gain ≤ "
                 f"{_pts(c['step_high'])})")
    return text


def sign_text(gains) -> str:
    """The shared trials' sign test: median gain, wins-losses, its two-sided p (marked as the
    floor where no smaller p is possible with that many pairs)."""
    if gains is None:
        return "n/a"
    median = "n/a" if gains["median"] is None else f"{100 * gains['median']:+.2f}"
    pairs = gains["wins"] + gains["losses"]
    floor = pairs and math.isclose(gains["sign_p"], min(1.0, 2 * 0.5 ** pairs))
    p = f"{gains['sign_p']:.3f}" + (f", floor for {pairs}" if floor and pairs > 1 else "")
    return f"{median} ({gains['wins']}-{gains['losses']}, p {p})"


def columns(board: dict) -> list:
    return ["method", "paper", "paper's claim", "gain, seeds 1-4",
            f"{_percent(board['level'])} simultaneous interval", "label (Holm)",
            "adjusted p", "the claim (Holm)", "MDE (80% power, same level)",
            "shared trials, descriptive (unadjusted): median (W-L, sign p)",
            "ε, this row's runs", "earlier board's gain"]


def verdict_rows(analysis: dict, earlier: dict) -> list:
    match = GROUP_PATTERN.match(analysis["group"])
    rows = []
    for method, r in sorted(analysis["methods"].items()):
        if "tuned" not in r:
            continue
        t = r["tuned"]
        before = earlier.get((match["model"], float(match["eps"]), method))
        rows.append([
            method, r["claim"].get("paper", "n/a"), r["claim"].get("claim", "n/a"),
            _pts(t["point"]), _interval(t["low"], t["high"]), _label_cell(t),
            p_text(t["p_adjusted"], t["label"] in ("better", "worse", "equivalent"),
                   t["floor"]),
            _claim_cell(t), f"{t['mde']:.2f}",
            "unpaired: no shared knob" if not r["shares"] else sign_text(r["paired_gains"]),
            f"{r['published_epsilon']:.3f}",
            "n/a" if before is None else render.gain_text(*before)])
    return rows


def table_blocks(analyses, board: dict, earlier: dict, notes: dict) -> list:
    """Per setting: its verdict table and the sentences on its baseline, junk and runs."""
    blocks = [("h", 2, "Tables")]
    for a in analyses:
        blocks += [("h", 3, f"{render.setting_words(a['group'])} ({a['group']})"),
                   ("table", columns(board), verdict_rows(a, earlier), {}),
                   ("p", notes[a["group"]])]
    return blocks + [("h", 3, "How to read the tables"), ("ul", READING)]


READING = [
    "'gain, seeds 1-4': the method's tuned winner's mean test accuracy over its retrain seeds "
    "minus DP-SGD's, in points.",
    "The interval: percentiles of bootstrap draws of that gain with the search's luck (trial 0 "
    "kept, the random trials resampled in pairs, both winners re-chosen on validation) and "
    "each arm's seed noise (Welch's standard error times Student t draws), at the one "
    "simultaneous level of the column's head (two-sided; α/m on each side).",
    "'label (Holm)': better, worse, or equivalent within the margin (two one-sided tests), "
    "each a hypothesis rejected in the board's one Holm family; ‡ marks a label decided at a "
    "later Holm step, whose level (α/(m - k) on a side) is looser, with the interval at that "
    "level. 'adjusted p': the bound on the Holm-adjusted p of the test that decided the label "
    "(of the side the data lean to when none did: then a lower bound, '1' where it is 1); "
    "'(Monte Carlo floor)': no bootstrap draw fell on the null's side, so the bound is the "
    "least that many draws can show, not a measure of the evidence.",
    "'the claim (Holm)': 'excluded' where the gain is shown below the smallest gain the paper "
    "claims (the number after ≥), else 'not excluded' (which is not support for it); its p "
    "as above. A paper's claim is tested at this board's settings, which are often not the "
    "paper's own (its dataset and ε are in the claim's text).",
    "'MDE': the gain the label's test would call with 80% power at the simultaneous level, "
    "read off the same draws as the interval (so never inside it).",
    "'shared trials' (descriptive, outside the family, unadjusted): over the random trials, "
    "which share their draws across methods, the median of the method's test accuracy minus "
    "DP-SGD's in the same trial, wins-losses, and the two-sided sign test's p ('floor for n': "
    "the smallest p n pairs can give). It is not a test of the label: a method can win 7 of 7 "
    "shared trials by margins that its winner's seed noise and the search's luck swamp.",
    "'ε, this row's runs': the price of the row, see Privacy. 'paper' and 'paper's claim': "
    "from the method's folder (its method.json). 'earlier board's gain': board v2's gain ± "
    "s.e. for the same model and epsilon. Under each table, 'published twice, composed once': "
    "records of one trajectory (the same final parameters) that count as one release.",
]


def privacy_blocks(analyses, totals: str) -> list:
    """Each row's price, the deployment epsilons and the board's total."""
    groups = [a["group"] for a in analyses]
    methods = sorted({m for a in analyses for m in a["methods"]})
    rows = [[m] + [_deployment(a["methods"][m]) if m in a["methods"] else "-"
                   for a in analyses] for m in methods]
    return [("h", 2, "Privacy"), (
        "p", "'ε, this row's runs' prices the comparison a row reports: every distinct run "
        "the board publishes for the method in that setting (its K trials and retrains, a "
        "superseded search's runs included), composed with PLD as if each had drawn fresh "
        "noise. It is the price of publishing that many independent runs, not a guarantee for "
        "the runs as they ran: a group's seeded runs share seed 0's noise stream, which "
        "composition does not cover (runs that share noise can reveal more together). The "
        "setting's ε is each run's own target. A deployment that keeps K secret (`dpbench sweep --secret_trial_count`: J "
        "drawn in secret from the declared law, every trial on its own OS-drawn seed, only "
        "the winner released) pays the Papernot-Steinke ε below instead; the board's runs are "
        "benchmarks with recorded seeds, not that deployment." + totals),
        ("table", ["method, ε of a K-secret deployment",
                   *[render.setting_words(g) for g in groups]], rows, {})]


def _deployment(row: dict) -> str:
    if row["deployment_epsilon"] is not None:
        return f"{row['deployment_epsilon']:.3f}"
    if row.get("deployment_note"):
        return "none: truncated-batch overflow uses up δ in RDP (see the setting's notes)"
    return "n/a"


def blocks(analyses, board: dict, forests: dict, earlier: dict, notes: dict,
           totals: str, note: str) -> list:
    """The page's paired part, in reading order (the configuration tables follow it)."""
    return [*answer_blocks(analyses, board), *design_blocks(analyses, board),
            *render.note_blocks(note), *figure_blocks(analyses, forests),
            *table_blocks(analyses, board, earlier, notes), *privacy_blocks(analyses, totals)]
