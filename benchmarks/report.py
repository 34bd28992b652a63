"""The speed benchmark's report: ratios measured side by side, the targets, the machine and
versions, rendered to Markdown (and JSON)."""

from __future__ import annotations

import json
from typing import Optional, Sequence

import numpy as np

from benchmarks.common import BOUND_LABEL, FLOOR_LABEL, GEP_BOUNDS, GEP_FAMILY, ONCE
from benchmarks.machine import extensions_text
from benchmarks.trial_cost import trial_cost_section


def _ms(row) -> Optional[float]:
    if row is None or not row["result"].get("ok"):
        return None
    return row["result"]["ms_median"]


def _ratio(a, b) -> Optional[float]:
    return a / b if (a is not None and b) else None


def compute_ratios(rows: list, batch_sizes: Sequence[int]) -> dict:
    """Ratios of median step times (and the memory ratio), all from this run's rows."""
    def find(group, b=None, label=None, pipeline=None, setting=None):
        for r in rows:
            s = r["spec"]
            if s["group"] == group and (b is None or s["batch_size"] == b) and \
                    (label is None or s["label"] == label) and \
                    (pipeline is None or s.get("pipeline") == pipeline) and \
                    (setting is None or s.get("setting") == setting):
                return r
        return None

    out = {"per_batch": {}, "memory": None}
    for b in batch_sizes:
        dpsgd = _ms(find("dpbench", b, pipeline="dpsgd"))
        opacus = [(r["spec"]["mode"], _ms(r)) for r in rows
                  if r["spec"]["group"] == "opacus" and r["spec"]["batch_size"] == b]
        good = [(m, t) for m, t in opacus if t is not None]
        best = min(good, key=lambda x: x[1]) if good else None
        entry = dict(
            dpsgd_ms=dpsgd,
            opacus_best_mode=best[0] if best else None,
            opacus_best_ms=best[1] if best else None,
            dpsgd_over_opacus_best=_ratio(dpsgd, best[1] if best else None),
            dpsgd_over_torch_nonprivate=_ratio(dpsgd, _ms(find("nonprivate_torch", b))),
            dpsgd_over_jax_nonprivate=_ratio(dpsgd, _ms(find("nonprivate_jax", b))),
            methods={})
        for group in GEP_BOUNDS:  # e.g. gep_floor_over_dpsgd
            row = find(group, b)
            if row is not None:
                entry[f"gep_{group}_over_dpsgd"] = _ratio(_ms(row), dpsgd)
        for r in rows:
            s = r["spec"]
            if s["group"] == "dpbench" and s["batch_size"] == b and s["pipeline"] != "dpsgd":
                entry["methods"][s["label"]] = dict(
                    pipeline=s["pipeline"], setting=s.get("setting"),
                    ratio=_ratio(_ms(r), dpsgd))
        out["per_batch"][str(b)] = entry
    logical = find("logical")
    if logical is not None and logical["result"].get("ok"):
        base_b = 256 if 256 in batch_sizes else min(batch_sizes)
        base = find("dpbench", base_b, pipeline="dpsgd")
        if base is not None and base["result"].get("ok"):
            out["memory"] = dict(
                logical_batch=logical["spec"]["batch_size"], base_batch=base_b,
                logical_peak_mib=logical["result"]["peak_rss_mib"],
                base_peak_mib=base["result"]["peak_rss_mib"],
                ratio=logical["result"]["peak_rss_mib"] / base["result"]["peak_rss_mib"])
    return out


def targets(ratios: dict, calibration: Optional[dict], main_job: Optional[dict] = None) -> list:
    """(target, measured, holds) lines; holds is None when it could not be measured."""
    lines = []

    def add(name, value, limit, unit="x"):
        holds = None if value is None else value <= limit
        lines.append(dict(target=name, limit=limit, measured=value, unit=unit, holds=holds))

    for b, entry in ratios["per_batch"].items():
        # The honest limit on this stack: JAX's own non-private step (same model, examples,
        # XLA). Opacus and torch rows are information (another framework's kernels).
        add(f"B={b}: dpbench DP-SGD <= 1.05x JAX non-private",
            entry["dpsgd_over_jax_nonprivate"], 1.05)
        gep_limit = 2.5 if int(b) >= 1024 else 4.0  # the basis costs the same at any B
        for label, m in entry["methods"].items():
            if m["pipeline"] in GEP_FAMILY:
                if m["setting"] == "light":
                    add(f"B={b}: {label} <= {gep_limit:g}x DP-SGD", m["ratio"], gep_limit)
                continue  # the paper's setting and the r-step variant: reported, no target
            add(f"B={b}: {label} <= 1.15x DP-SGD", m["ratio"], 1.15)
        for group, label in GEP_BOUNDS.items():  # when one fails, so must every GEP step here
            if f"gep_{group}_over_dpsgd" in entry:
                add(f"B={b}: {label} <= {gep_limit:g}x DP-SGD",
                    entry[f"gep_{group}_over_dpsgd"], gep_limit)
    memory = ratios.get("memory")
    add(f"peak memory, logical batch {memory['logical_batch'] if memory else '?'} <= 1.5x that "
        f"of B={memory['base_batch'] if memory else '?'}",
        memory["ratio"] if memory else None, 1.5)
    cal = (calibration or {}).get("calibration", {})
    add("sigma calibration with RDP <= 1 s", cal.get("rdp", {}).get("seconds_median"), 1.0, "s")
    add("sigma calibration with PLD <= 3 s", cal.get("pld", {}).get("seconds_median"), 3.0, "s")
    job = main_job if main_job and main_job.get("ok") else {}
    add("main job (30 epochs) wall time <= 240 s", job.get("wall_time_s"), 240.0, "s")
    return lines


def _fmt(x, digits=1) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def _notes(row) -> str:
    s, r = row["spec"], row["result"]
    if not r.get("ok"):
        return "FAILED: " + r.get("error", "?").replace("|", "/").replace("\n", " ")[:300]
    notes = []
    if s["kind"] == "dp":
        notes.append(f"{r['micro_steps']} micro-batches of {r['micro_batch_size']}, "
                     f"{r['nonempty_micro_batches_mean']:.1f} non-empty on average")
        notes.append(f"realized batch {r['realized_mean']:.0f} on average")
        notes.append(f"sigma {r['noise_multiplier']:.4g}"
                     + (" (calibrated)" if r["sigma_calibrated"] else ""))
        for st in r["stages"]:
            if st["name"] == "gep.embed_and_clip":
                k = sum(st.get("basis_per_group", {}).values())
                notes.append(f"m={st['num_anchors']} anchors, k={k} basis "
                             f"({st['power_iterations']} power iteration, every step)")
        notes.append(f"N={r['dataset_size']}")
    elif s["kind"] == "gep_floor":
        notes.append(f"{r['flops'] / 1e9:.2f} GFLOP a step ({r['gflop_per_s']:.0f} GFLOP/s): "
                     f"the power iteration over m={r['num_anchors']} anchor gradients and the "
                     f"embedding of B={r['expected_batch_size']} examples, "
                     f"k={sum(r['basis_per_group'].values())} over "
                     f"{len(r['basis_per_group'])} groups; random inputs; no gradients, QR, "
                     "noise or update")
    elif s["kind"] == "gep_bound":
        notes.append(f"the floor's products, a plain (not per-example) gradient of the "
                     f"m={r['num_anchors']} anchors and JAX's non-private step on "
                     f"B={r['expected_batch_size']} examples, as one jitted function; no "
                     "per-example gradients or norms, QR, residual or noise")
    elif s["kind"] == "opacus":
        notes.append(f"realized batch {r['realized_mean']:.0f} on average (Poisson, same "
                     "batches as dpbench)")
        notes.append(f"{r['torch_threads']} threads")
    elif s["kind"] == "torch_nonprivate":
        notes.append(f"exactly B examples; {r['torch_threads']} threads")
    elif s["kind"] == "jax_nonprivate":
        notes.append("exactly B examples, one jitted step, the gradient accumulated over "
                     "micro-batches of the dpbench rows' size")
    notes.append(f"first step {r['first_step_s']:.1f}s")
    return "; ".join(notes)


def _ratio_tables(ratios: dict) -> list:
    lines = ["| B | DP-SGD / Opacus best (mode) | DP-SGD / torch non-private | "
             "DP-SGD / JAX non-private |", "|---|---|---|---|"]
    for b, e in ratios["per_batch"].items():
        lines.append(f"| {b} | {_fmt(e['dpsgd_over_opacus_best'], 2)}"
                     f"{' (' + e['opacus_best_mode'] + ')' if e['opacus_best_mode'] else ''} | "
                     f"{_fmt(e['dpsgd_over_torch_nonprivate'], 2)} | "
                     f"{_fmt(e['dpsgd_over_jax_nonprivate'], 2)} |")
    lines += ["", "| B | method | method / DP-SGD |", "|---|---|---|"]
    for b, e in ratios["per_batch"].items():
        for label, mm in e["methods"].items():
            lines.append(f"| {b} | {label} | {_fmt(mm['ratio'], 2)} |")
        for group, label in GEP_BOUNDS.items():
            if f"gep_{group}_over_dpsgd" in e:
                lines.append(f"| {b} | {label} | {_fmt(e[f'gep_{group}_over_dpsgd'], 2)} |")
    return lines


def _interleaved_section(report: dict) -> list:
    runs = [r for r in report.get("rows", []) if r["spec"]["kind"] == "interleaved"]
    if not runs:
        return []
    first = runs[0]["result"]
    lines = ["", "## Interleaved run (where the ratios come from)", "",
             "Per batch size, every configuration above runs in ONE process, built and warmed "
             "up as when it runs alone, and their timed steps alternate: step t gives each "
             "configuration one turn, starting from a different one each time; a turn is an "
             "untimed step then the timed one on the same batch (so the timed step starts from "
             "its own caches and thread pools, not the previous configuration's), with "
             f"{first.get('pause_s', 0) * 1e3:.0f} ms of untimed pause between two turns (spinning "
             "thread pools go idle). A noisy minute of the machine so lands on every "
             "configuration alike. A configuration that compiles during a timed step is "
             "flagged and gets no ratio.", "",
             "| configuration | B | ms/step (median) | block medians | min–max ms | "
             "compilations in timed steps | notes |", "|---|---|---|---|---|---|---|"]
    for run in runs:
        r = run["result"]
        if not r.get("ok"):
            lines.append(f"| {run['spec']['label']} | {run['spec']['batch_size']} | failed | — "
                         f"| — | — | {r.get('error', '?')[:300]} |")
            continue
        for m in r["members"]:
            times = m["times_ms"]
            lines.append("| " + " | ".join([
                m["label"], str(m["spec"]["batch_size"]),
                _fmt(m["ms_median"]) if m["ok"] else "failed",
                ", ".join(_fmt(v) for v in m["block_medians"]) or "—",
                f"{min(times):,.1f}–{max(times):,.1f}" if times else "—",
                str(m["recompiles"]),
                (m["error"] or "").replace("|", "/")[:300]]) + " |")
    return lines


def render(report: dict) -> str:
    o = report["options"]
    m = report["machine"]
    lines = ["# dpbench speed benchmark", ""]
    if report.get("incomplete"):
        lines += [f"**Incomplete: {report['incomplete']}**", ""]
    lines += ["## Command", "", "```", report["command"], "```", "",
              f"Started {report['started']}, finished {report.get('finished') or '(running)'}; "
              f"wall time {_fmt(report.get('wall_s'), 0)} s.", "",
              "## Machine", "",
              f"- CPU: {m['cpu_model']}; vector extensions: {extensions_text(m)}",
              f"- cores: {m['cores']} (available to this process: {m['cores_available']})",
              f"- RAM: {_fmt(m['ram_gib'])} GiB",
              "- JAX device: " + (", ".join(sorted({r["result"]["jax_device"] for r in
                                  report["rows"] if r["result"].get("jax_device")})) or "—"),
              f"- platform: {m['platform']}",
              f"- load average at start: {m['load_average']}; at end: "
              f"{report.get('load_average_end')}",
              "", "## Versions", "",
              ", ".join(f"{k} {v or 'not installed'}" for k, v in report["versions"].items()),
              "", "## Settings", "",
              f"- data: `{o['data_gin']}`, model: `{o['model_gin'] or '(from the gin files)'}`; "
              f"{o['steps']} timed steps after {o['warmup']} warm-up steps per configuration; "
              f"median reported.",
              "- dpbench: every pipeline compiled as `run.train` compiles it, micro-batch "
              + ", ".join(f"{size} at B={b}" if b else f"{size} otherwise"
                          for b, size in o["micro_batch_sizes"]) + ", sigma "
              f"{'calibrated' if o['noise_multiplier'] is None else o['noise_multiplier']} "
              "(pipelines with a budgeted mechanism of their own, GIP, are calibrated); Poisson "
              "sampling, padded batch P (8 stddevs above B, rounded up to the micro-batch); "
              "empty micro-batches are skipped by the step.",
              "- every configuration runs in its own fresh process; peak RSS is that process's "
              "VmHWM (includes the Python runtime, the library, the dataset in memory, "
              "compilation).",
              "- batches are sampled before the loop; each step's batch is gathered from the "
              "in-memory dataset and placed on the device (blocked until ready) before that "
              "step's timer starts; the timer covers the step and `block_until_ready`.",
              "- non-private rows (JAX, torch) use batches of exactly B examples; dpbench and "
              "Opacus use the same realized Poisson batches (mean B); examples/s = B / median "
              "step time for every row.",
              f"- torch rows: {report['torch_note']}",
              "", "## Step times", "",
              "| configuration | B | padded P | ms/step (median of rounds) | round medians | "
              "min–max ms (one round) | examples/s | peak RSS (MiB) | notes |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        s, r = row["spec"], row["result"]
        if s["kind"] in ONCE:
            continue
        ok = r.get("ok")
        eps = (s["batch_size"] / (r["ms_median"] / 1e3)) if ok else None
        lines.append("| " + " | ".join([
            s["label"], str(s["batch_size"]), _fmt(r.get("padded_batch_size")),
            _fmt(r.get("ms_median")) if ok else "failed",
            ", ".join(_fmt(v) for v in r.get("round_medians", [])) if ok else "—",
            f"{r['ms_min']:,.1f}–{r['ms_max']:,.1f}" if ok else "—",
            _fmt(eps, 0), _fmt(r.get("peak_rss_mib"), 0), _notes(row)]) + " |")
    cal = report.get("calibration")
    lines += ["", "## Sigma calibration", ""]
    if cal and cal.get("ok"):
        lines += [f"DP-SGD run: epsilon={cal['epsilon']}, delta={cal['delta']}, "
                  f"{cal['epochs']} epochs, B={cal['expected_batch_size']} (padded "
                  f"{cal['padded_batch_size']}), N={cal['dataset_size']}, "
                  f"{cal['total_steps']} steps; `accounting.calibrate_noise_multiplier` on the "
                  "compiled pipeline's run event, as `compile_pipeline` calls it.", "",
                  "| accountant | sigma | seconds (median) | first call | all |",
                  "|---|---|---|---|---|"]
        for acc, c in cal["calibration"].items():
            lines.append(f"| {acc} | {c['sigma']:.5f} | {c['seconds_median']:.3f} | "
                         f"{c['seconds_first']:.3f} | "
                         f"{', '.join(f'{t:.3f}' for t in c['seconds_all'])} |")
    elif cal:
        lines.append("FAILED: " + cal.get("error", "?"))
    else:
        lines.append("not run")
    job = report.get("main_job")
    lines += ["", "## Main job", ""]
    if job and job.get("ok"):
        lines.append(f"`pipelines/dpsgd` on Fashion-MNIST, trained by `run.train` (the "
                     f"README's main job): {job['steps']} steps in {job['wall_time_s']:.0f} s of "
                     f"wall time (run record), median step {job['median_step_s'] * 1e3:.0f} ms, "
                     f"sigma {job['noise_multiplier']:.4f} calibrated in "
                     f"{job['calibration_s']:.1f} s; epsilon {job['epsilon']:.4f}, test accuracy "
                     f"{job['test_accuracy']:.4f} (validation {job['validation_accuracy']:.4f}).")
    else:
        lines.append("FAILED: " + job.get("error", "?") if job else "not run")
    lines += trial_cost_section(report)
    lines += _interleaved_section(report)
    ratios = report.get("ratios") or {"per_batch": {}, "memory": None}
    interleaved = ratios.get("source") == "interleaved"
    lines += ["", "## Ratios (" + ("median step times of the interleaved run" if interleaved
                                  else "median step times of this run") + ")", ""]
    lines += _ratio_tables(ratios)
    if interleaved and report.get("ratios_separate"):
        lines += ["", "The same ratios from the separate runs' medians (one configuration per "
                      "process, different minutes of the machine), for comparison:", ""]
        lines += _ratio_tables(report["ratios_separate"])
    mem = ratios.get("memory")
    if mem:
        lines += ["", f"Peak RSS, logical batch {mem['logical_batch']}: "
                      f"{mem['logical_peak_mib']:,.0f} MiB vs {mem['base_peak_mib']:,.0f} MiB at "
                      f"B={mem['base_batch']}: ratio {mem['ratio']:.2f} (separate processes)."]
    how = (f"Ratios from the interleaved run (its medians over {o.get('interleaved_steps')} "
           f"steps per configuration); the spread is the same ratio's min-max within each of "
           f"its {o.get('rounds', 1)} blocks of consecutive steps." if interleaved else
           f"Measured on the medians over {o.get('rounds', 1)} round-robin rounds; the spread "
           "is the same ratio's min-max within single rounds.")
    lines += ["", "## Targets", "", how, "",
              "| target | measured | spread | holds |", "|---|---|---|---|"]
    for t in report.get("targets", []):
        unit = t["unit"] if t["unit"] == "x" else " s"
        measured = "not measured" if t["measured"] is None else f"{t['measured']:.2f}{unit}"
        spread = "—" if not t.get("spread") else \
            f"{t['spread'][0]:.2f}–{t['spread'][1]:.2f}{unit}"
        holds = {True: "yes", False: "**no**", None: "n/a"}[t["holds"]]
        lines.append(f"| {t['target']} | {measured} | {spread} | {holds} |")
    lines += ["", "DP-SGD's target is JAX's own non-private step (same model, same examples, "
                  "same XLA); the torch and Opacus rows are information. GEP and B-GEP are the "
                  "exception to the 1.15x rule: their light setting (basis every step, the "
                  "paper's) has the 4x target at B=256 and 2.5x at B=1024 (the basis costs the "
                  "same at any B); the paper's anchor count and the r-step variant (basis every "
                  "r steps, timed r steps at a time) are reported without one. "
                  f"\"{FLOOR_LABEL}\" times only the matrix products GEP's light step "
                  "cannot avoid (the power iteration over the anchor gradients and the "
                  "embedding of the batch, on random inputs of the pipeline's shapes): a lower "
                  "bound for any GEP step on this machine, so where it fails its target, every "
                  f"GEP implementation here does. \"{BOUND_LABEL}\" adds, in the same jitted "
                  "function, the least the step's two gradients cost: one plain backward pass "
                  "over the anchors and JAX's own non-private step on the batch.", ""]
    return "\n".join(lines)


def summary_line(spec: dict, result: dict) -> str:
    if spec["kind"] == "main_job" and result.get("ok"):
        return "ok: %d steps in %.0f s of wall time, test accuracy %.4f" % (
            result["steps"], result["wall_time_s"], result["test_accuracy"])
    if spec["kind"] == "interleaved" and result.get("ok"):
        return "ok: " + ", ".join(
            f"{m['label']} {_fmt(m['ms_median'])} ms" if m["ok"] else f"{m['label']} failed "
            f"({m['error']})" for m in result["members"])
    if spec["kind"] in ONCE:
        return json.dumps(result.get("calibration") or result.get("error"))
    if not result.get("ok"):
        return "failed: " + result.get("error", "?")
    return "ok: %.1f ms/step, peak %.0f MiB" % (result["ms_median"], result["peak_rss_mib"])


def aggregate_rounds(results: list) -> dict:
    """One row's result over the rounds: the median of the round medians (and their min-max
    spread); other fields from the round closest to that median. A row run once (no step
    times: calibration, the main job) is returned as run."""
    good = [r for r in results if r.get("ok")]
    if not good or any("ms_median" not in r for r in good):
        return results[-1] if results else dict(ok=False, error="not run")
    medians = [r["ms_median"] for r in good]
    middle = float(np.median(medians))
    closest = min(good, key=lambda r: abs(r["ms_median"] - middle))
    return dict(closest, ms_median=middle, round_medians=medians,
                peak_rss_mib=max(r["peak_rss_mib"] for r in good), rounds_ok=len(good),
                rounds_run=len(results))


def interleaved_rows(rows: list, block: Optional[int] = None) -> list:
    """The interleaved runs' members as rows ({spec, result}) that compute_ratios reads: the
    median step time over all their timed steps, or over one block of them. A member that
    failed or compiled during a timed step has no time."""
    out = []
    for row in rows:
        if row["spec"]["kind"] != "interleaved" or not row["result"].get("ok"):
            continue
        for m in row["result"]["members"]:
            good = m["ok"] and m["recompiles"] == 0
            ms = m["ms_median"] if block is None else (m["block_medians"][block] if good
                                                       else None)
            out.append(dict(spec=m["spec"], result=dict(ok=good and ms is not None,
                                                        ms_median=ms)))
    return out
