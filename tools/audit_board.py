"""The leaderboard's audit column: `dpbench audit` (Dirac canary, 2000 one-step runs) of every
board method at every epsilon, one JSON report per (method, epsilon) in
leaderboard/audits/<method>-eps<E>.json; the board matches a report to a group by its claimed
epsilon. Each method folder's method.json says how it is audited: extra bindings ("audit":
{"bindings": [...], "why": ...}) or none at all ("audit": {"skip": why}).

Usage: .venv/bin/python tools/audit_board.py [EPSILON ...]   (default: 1 3)
"""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dpbench import methods  # noqa: E402


def main(argv) -> int:
    epsilons = argv or ["1", "3"]
    out = REPO / "leaderboard" / "audits"
    out.mkdir(parents=True, exist_ok=True)
    dpbench = Path(sys.executable).parent / "dpbench"
    for eps in epsilons:
        for name, method in methods.discover().items():
            if "skip" in method.audit:
                print(f"not audited: {name} ({method.audit['skip']})")
                continue
            report = out / f"{name}-eps{eps}.json"
            subprocess.run([str(dpbench), "audit", f"--gin_file={method.gin_file}",
                            *[f"--gin_bindings={b}" for b in method.audit.get("bindings", [])],
                            "--trials=2000", f"--claimed_epsilon={eps}", f"--out={report}"],
                           cwd=REPO, check=True, stdout=subprocess.DEVNULL)
            print(f"audited {name} at epsilon {eps} -> {report.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
