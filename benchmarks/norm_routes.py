"""Book-keeping's two per-example norm routes for one convolution, timed side by side on this
machine (what taps.Tap.ghost_is_cheaper_at decides between): Gram products over positions
(ghost norm, then the weighted sum recomputed as (c a)^T delta) against the materialized
per-example kernel gradient (reused for the weighted sum). Both are dpbench/compiler/
bookkeeping.py's own functions with the rule forced one way; each row says what the rule picks.

  python -m benchmarks.norm_routes [--batch=32] [--repeats=5]
"""

from __future__ import annotations

import argparse
import json
import time

SHAPES = [  # (what, positions T' = copies x T, inputs d, outputs p)
    ("WRN-10-1 stage 1, 3x3 at 32x32", 1024, 144, 16),
    ("WRN-10-1 stage 2, 3x3 at 16x16", 256, 288, 32),
    ("WRN-10-1 stage 3, 3x3 at 8x8", 64, 576, 64),
    ("WRN-10-1 stage 3, 3x3 at 4x4 (16x16 input)", 16, 576, 64),
    ("WRN-10-1 stage 3, 1x1 shortcut at 8x8", 64, 32, 64),
    ("WRN-16-4 stage 2, 3x3 at 16x16", 256, 1152, 128),
    ("WRN-16-4 stage 3, 3x3 at 8x8", 64, 2304, 256),
    ("WRN-16-4 stage 3, 3x3 at 8x8, 2 copies", 128, 2304, 256),
    ("WRN-16-4 stage 3, 3x3 at 8x8, 16 copies", 1024, 2304, 256),
    ("49 positions, d 256, p 32", 49, 256, 32),
    ("few positions, many channels", 4, 256, 32),
    ("32 positions, d 576, p 64", 32, 576, 64),
]


def time_routes(positions: int, inputs: int, outputs: int, batch: int, repeats: int) -> dict:
    """Seconds (best of ``repeats``) of one micro-batch's norms and weighted sum, each route."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dpbench.compiler import bookkeeping
    from dpbench.compiler.taps import Tap

    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(batch, positions, inputs)), jnp.float32)
    delta = jnp.asarray(rng.normal(size=(batch, positions, outputs)), jnp.float32)
    scale = jnp.asarray(rng.uniform(size=batch), jnp.float32)
    tap = Tap(("conv",), positions, inputs, outputs, (positions, outputs))

    def route(ghost: bool):
        def run(a, delta, scale):
            forced = type("Forced", (Tap,), {"ghost_is_cheaper_at": lambda self, n: ghost})
            t = forced(*[getattr(tap, f) for f in ("path", "positions", "inputs", "outputs",
                                                   "output_shape")])
            squares, kernel, bias = bookkeeping._layer_terms(a, delta, None, None, t)
            sums = bookkeeping._weighted_sums({t.path: (a, delta, kernel, bias, None)},
                                              scale, False)
            return squares, sums
        return jax.jit(run)

    out = {}
    for name, ghost in (("ghost_s", True), ("kernel_s", False)):
        fn = route(ghost)
        jax.block_until_ready(fn(a, delta, scale))
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(a, delta, scale))
            best = min(best, time.perf_counter() - t0)
        out[name] = best
    out["rule_picks"] = "ghost" if tap.ghost_is_cheaper_at(positions) else "kernel"
    out["faster"] = "ghost" if out["ghost_s"] < out["kernel_s"] else "kernel"
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32, help="examples per micro-batch")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    import jax
    print(f"| layer (batch {args.batch}, {jax.devices()[0]}) | T' | d | p | ghost ms | "
          "kernel ms | ghost / kernel | rule picks |\n|---|---|---|---|---|---|---|---|")
    rows = []
    for what, positions, inputs, outputs in SHAPES:
        r = time_routes(positions, inputs, outputs, args.batch, args.repeats)
        rows.append(dict(what=what, positions=positions, inputs=inputs, outputs=outputs, **r))
        mark = "" if r["rule_picks"] == r["faster"] else " (slower)"
        print(f"| {what} | {positions} | {inputs} | {outputs} | {r['ghost_s'] * 1e3:.2f} | "
              f"{r['kernel_s'] * 1e3:.2f} | {r['ghost_s'] / r['kernel_s']:.2f} | "
              f"{r['rule_picks']}{mark} |", flush=True)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
