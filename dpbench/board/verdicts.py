"""The board's verdicts: each method's gain over the baseline next to its paper's claim and
v1's gain."""

from __future__ import annotations

from pathlib import Path

from dpbench.board.results import BASELINE, GROUP_PATTERN, load_records, summarize




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


def gain_text(gain, se) -> str:
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
                  "n/a (not on v1)" if v["v1"] is None else gain_text(*v["v1"]),
                  gain_text(v["gain"], v["gain_se"]), f"{v['search']['search_epsilon']:.3f}",
                  v["changed"] or "—"] for v in rows]
        tables.append((f"Verdicts: {group}", cells))
    return tables
