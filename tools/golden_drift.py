"""How far this host's golden runs are from tests/golden_pipelines.json: per run, sigma's and
epsilon's relative difference and the parameters' fingerprint distance (the numbers behind the
golden check's tolerances, WORKSPACE.md "The golden check"). On the host that wrote the file
every number is 0; as a simulated other host:

    eval "$(.venv/bin/python -m dpbench.numerics)" && .venv/bin/python tools/golden_drift.py
"""

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpbench import config, numerics  # noqa: E402
from dpbench import run as run_lib  # noqa: E402
from tests.test_pipelines import GOLDEN, GOLDEN_KEYS, golden_run  # noqa: E402


def main() -> None:
    golden = json.loads(GOLDEN.read_text())["runs"]
    print(f"{'run':22s} {'sigma rel':>10s} {'eps rel':>10s} {'params':>10s}")
    for key in GOLDEN_KEYS:
        files, bindings = golden_run(key)
        config.parse_config(files, bindings)
        with tempfile.TemporaryDirectory() as tmp:
            record = run_lib.train(Path(tmp) / "run", gin_files=files)
        want = golden[key]
        rel = [abs(record[k] / want[k] - 1) for k in ("noise_multiplier", "epsilon")]
        distance = numerics.fingerprint_distance(record["final_params_fingerprint"],
                                                 want["params_fingerprint"])
        print(f"{key:22s} {rel[0]:10.1e} {rel[1]:10.1e} {distance:10.1e}", flush=True)


if __name__ == "__main__":
    main()
