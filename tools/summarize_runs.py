"""Prints a markdown table of run records: one row per workdir given (or found under a root).

Usage: .venv/bin/python tools/summarize_runs.py runs/methods-eps3/*
Step time is reported relative to the dpsgd run in the same set (same machine, same session).
"""

import json
import sys
from pathlib import Path


def main(paths):
    records = []
    for path in paths:
        record_path = Path(path) / "run_record.json"
        if record_path.exists():
            records.append(json.loads(record_path.read_text()))
    base = next((r["median_step_s"] for r in records if r["pipeline"] == "dpsgd"), None)
    print("| pipeline | test acc | val acc | sigma | steps | epsilon (target) | accountant | "
          "step time vs DP-SGD |")
    print("|---|---|---|---|---|---|---|---|")
    for r in records:
        ratio = f"{r['median_step_s'] / base:.2f}x" if base else "n/a"
        print(f"| {r['pipeline']} | {r['test_accuracy']:.4f} | {r['validation_accuracy']:.4f} | "
              f"{r['noise_multiplier']:.4f} | {r['steps']} | {r['epsilon']:.4f} "
              f"({r['target_epsilon']}) | {r['accountant']} | {ratio} |")


if __name__ == "__main__":
    main(sys.argv[1:])
