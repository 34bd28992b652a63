"""The speed benchmark's harness (benchmarks/speed.py) end to end at tiny settings, and its
report logic on synthetic rows. No timing is asserted: only that the report holds the expected
rows and columns with positive finite numbers."""

import dataclasses
import json
import math
import os
import re
import subprocess
import types
from pathlib import Path

import jax
import numpy as np
import pytest

from benchmarks import common, configs, machine, speed, torch_workers, workers
from benchmarks import report as reporting

COLUMNS = ["configuration", "B", "padded P", "ms/step (median of rounds)", "round medians",
           "min–max ms (one round)", "examples/s", "peak RSS (MiB)", "notes"]


def _table(markdown: str, header_start: str) -> list:
    """The rows (lists of cells) of the markdown table whose header starts with header_start."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _number(cell: str) -> float:
    return float(cell.replace(",", ""))


def test_harness_runs_tiny_configurations_and_writes_the_report(tmp_path):
    out = tmp_path / "bench.md"
    options = configs.Options(
        steps=3, warmup=1, batch_sizes=(64,), pipelines="dpsgd", out=str(out), skip_torch=True,
        micro_batch_sizes=((None, 64),), data_gin="gin/data/digits.gin",
        model_gin="gin/model/logistic.gin", logical_batch=0, calibration=False, main_job=False,
        command="pytest tests/test_bench.py", rounds=2, interleaved_steps=4)
    report = speed.run_benchmark(options)

    text = out.read_text()
    for section in ("## Command", "## Machine", "## Versions", "## Step times",
                    "## Interleaved run", "## Ratios", "## Targets"):
        assert section in text
    assert "pytest tests/test_bench.py" in text
    assert re.search(r"- cores: \d+", text) and "jax " in text and "python " in text
    device = jax.devices()[0]  # the rows' device, as their workers saw it (a GPU report's too)
    assert f"- JAX device: {device.platform}: {device.device_kind}" in text

    table = _table(text, "| configuration |")
    assert table[0] == COLUMNS
    body = {row[0]: row for row in table[2:]}
    assert set(body) == {"JAX non-private", "dpbench dpsgd"}
    for label, row in body.items():
        assert row[1] == "64", label
        assert len(row[COLUMNS.index("round medians")].split(",")) == 2  # one per round
        for column in ("ms/step (median of rounds)", "examples/s", "peak RSS (MiB)"):
            value = _number(row[COLUMNS.index(column)])
            assert math.isfinite(value) and value > 0, (label, column, value)
    assert int(body["dpbench dpsgd"][2]) >= 64  # the padded Poisson batch

    # The JSON next to the report holds the same rows with their raw numbers.
    data = json.loads(out.with_suffix(".json").read_text())
    assert [r["spec"]["label"] for r in data["rows"]] == ["JAX non-private", "dpbench dpsgd",
                                                          "interleaved run"]
    # the interleaved run: both configurations in one process, 4 steps each, 2 blocks; the
    # ratios and targets come from it
    inter = data["rows"][-1]["result"]
    assert inter["ok"] and [m["label"] for m in inter["members"]] == [
        "JAX non-private", "dpbench dpsgd"]
    for m in inter["members"]:
        assert m["ok"] and len(m["times_ms"]) == 4 and len(m["block_medians"]) == 2, m
        assert m["recompiles"] == 0 and math.isfinite(m["result"]["final_train_loss"])
    assert report["ratios"]["source"] == "interleaved"
    assert math.isclose(report["ratios"]["per_batch"]["64"]["dpsgd_over_jax_nonprivate"],
                        inter["members"][1]["ms_median"] / inter["members"][0]["ms_median"])
    inter_table = _table(text, "| configuration | B | ms/step (median) |")
    assert [r[0] for r in inter_table[2:]] == ["JAX non-private", "dpbench dpsgd"]
    for row in data["rows"][:2]:
        result = row["result"]
        assert result["ok"], result
        assert result["timed_steps"] == 3
        for key in ("ms_median", "ms_min", "ms_max", "peak_rss_mib"):
            assert math.isfinite(result[key]) and result[key] > 0, key
        assert math.isfinite(result["final_train_loss"])
    ratio = report["ratios"]["per_batch"]["64"]["dpsgd_over_jax_nonprivate"]
    assert math.isfinite(ratio) and ratio > 0
    names = {t["target"] for t in report["targets"]}
    assert any("JAX non-private" in n for n in names) and any("calibration" in n for n in names)
    jax_target = [t for t in report["targets"] if t["measured"] is not None]
    for t in jax_target:  # a spread over the two rounds brackets nothing smaller than 0
        assert t["spread"] is None or 0 < t["spread"][0] <= t["spread"][1]


def test_rounds_aggregate_to_the_median_of_round_medians():
    rounds = [dict(ok=True, ms_median=m, peak_rss_mib=p) for m, p in ((30.0, 1.0), (10.0, 3.0),
                                                                      (20.0, 2.0))]
    row = reporting.aggregate_rounds(rounds)
    assert row["ms_median"] == 20.0 and row["round_medians"] == [30.0, 10.0, 20.0]
    assert row["peak_rss_mib"] == 3.0 and row["rounds_ok"] == 3
    failed = reporting.aggregate_rounds([dict(ok=False, error="x")])
    assert not failed["ok"]
    # a row run once (the main job: wall time, no step times) is kept as run (a KeyError on
    # 'ms_median' here once cost a whole benchmark run), and its log line says what it measured
    job = dict(ok=True, wall_time_s=171.5, steps=1612, test_accuracy=0.86, epsilon=3.0)
    assert reporting.aggregate_rounds([job]) == job
    line = reporting.summary_line(dict(kind="main_job"), job)
    assert "1612 steps" in line and "172 s" in line


def _row(label, group, b, ms, peak=500.0, **spec):
    kind = {"opacus": "opacus", "nonprivate_torch": "torch_nonprivate",
            "nonprivate_jax": "jax_nonprivate"}.get(group, "dp")
    result = dict(ok=ms is not None, ms_median=ms, ms_min=ms, ms_max=ms, peak_rss_mib=peak,
                  first_step_s=1.0, padded_batch_size=b, realized_mean=float(b),
                  torch_threads=2, micro_steps=2, micro_batch_size=128,
                  nonempty_micro_batches_mean=2.0, noise_multiplier=1.0,
                  sigma_calibrated=False, stages=[], dataset_size=55000)
    if ms is None:
        result["error"] = "RuntimeError: unsupported layer"
    return dict(spec=dict(label=label, group=group, kind=kind, batch_size=b, **spec),
                result=result)


def test_ratios_targets_and_failed_rows_from_synthetic_results():
    rows = [
        _row("JAX non-private", "nonprivate_jax", 256, 10.0),
        _row("torch non-private", "nonprivate_torch", 256, 40.0),
        _row("Opacus DP-SGD (hooks)", "opacus", 256, 100.0, mode="hooks"),
        _row("Opacus DP-SGD (ew)", "opacus", 256, None, mode="ew"),
        _row("Opacus DP-SGD (ghost)", "opacus", 256, 80.0, mode="ghost"),
        _row("dpbench dpsgd", "dpbench", 256, 50.0, pipeline="dpsgd", peak=600.0),
        _row("dpbench rs", "dpbench", 256, 60.0, pipeline="rs"),
        _row("dpbench gep (light)", "dpbench", 256, 110.0, pipeline="gep", setting="light"),
        _row("dpbench gep (paper)", "dpbench", 256, 400.0, pipeline="gep", setting="paper"),
        _row("dpbench gep (light, r=10)", "dpbench", 256, 60.0, pipeline="gep",
             setting="light, r=10"),
        _row("dpbench dpsgd, logical batch 4096", "logical", 4096, 700.0, pipeline="dpsgd",
             peak=660.0),
    ]
    ratios = reporting.compute_ratios(rows, (256,))
    entry = ratios["per_batch"]["256"]
    assert entry["opacus_best_mode"] == "ghost"
    assert math.isclose(entry["dpsgd_over_opacus_best"], 50 / 80)
    assert math.isclose(entry["dpsgd_over_torch_nonprivate"], 50 / 40)
    assert math.isclose(entry["dpsgd_over_jax_nonprivate"], 5.0)
    assert math.isclose(entry["methods"]["dpbench rs"]["ratio"], 1.2)
    assert math.isclose(ratios["memory"]["ratio"], 1.1)

    calibration = dict(ok=True, calibration=dict(
        rdp=dict(seconds_median=0.5, seconds_first=0.6, seconds_all=[0.5], sigma=1.1),
        pld=dict(seconds_median=4.0, seconds_first=4.0, seconds_all=[4.0], sigma=1.0)),
        epsilon=3.0, delta=1e-5, epochs=30, expected_batch_size=1024, padded_batch_size=1280,
        dataset_size=55000, total_steps=1612)
    found = {t["target"]: t["holds"] for t in reporting.targets(ratios, calibration)}
    assert found["B=256: dpbench DP-SGD <= 1.05x JAX non-private"] is False  # 5x
    assert not any("Opacus" in name or "torch" in name for name in found)  # information
    assert found["B=256: dpbench rs <= 1.15x DP-SGD"] is False
    assert found["B=256: dpbench gep (light) <= 4x DP-SGD"] is True  # 2.2x
    assert not any("gep (paper)" in name or "r=" in name for name in found)  # no target
    assert found["peak memory, logical batch 4096 <= 1.5x that of B=256"] is True
    assert found["sigma calibration with RDP <= 1 s"] is True
    assert found["sigma calibration with PLD <= 3 s"] is False
    assert found["main job (30 epochs) wall time <= 240 s"] is None  # not run
    job = {t["target"]: t["holds"] for t in reporting.targets(
        ratios, calibration, dict(ok=True, wall_time_s=250.0))}
    assert job["main job (30 epochs) wall time <= 240 s"] is False

    report = dict(command="cmd", started="now", machine=machine.machine_facts(),
                  versions=machine.versions(), options=dataclasses.asdict(configs.Options()),
                  torch_note="synthetic", rows=rows, calibration=calibration, ratios=ratios,
                  targets=reporting.targets(ratios, calibration))
    text = reporting.render(report)
    table = _table(text, "| configuration |")
    assert table[0] == COLUMNS and len(table) == 2 + len(rows)
    failed = [r for r in table[2:] if r[0] == "Opacus DP-SGD (ew)"][0]
    assert failed[3] == "failed" and "RuntimeError: unsupported layer" in failed[-1]
    assert "| rdp | 1.10000 | 0.500 |" in text
    assert "| sigma calibration with PLD <= 3 s | 4.00 s | — | **no** |" in text


def test_torch_twin_computes_the_same_function_as_the_tanh_cnn():
    """The Opacus rows' model is dpbench's TanhCNN layer for layer (weights copied over)."""
    import pytest
    torch = pytest.importorskip("torch")
    import numpy as np

    from dpbench import models

    model = models.make_model(10, name="tanh_cnn")
    images = np.random.default_rng(0).uniform(size=(5, 28, 28, 1)).astype(np.float32)
    params = model.init(jax.random.key(0), images[:1])["params"]
    twin = torch_workers.make_torch_tanh_cnn(10)
    assert sum(p.numel() for p in twin.parameters()) == sum(
        x.size for x in jax.tree.leaves(params)) == 26010

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(np.asarray(a)))

    with torch.no_grad():
        for conv, name in ((twin.conv0, "Conv_0"), (twin.conv1, "Conv_1")):
            conv.weight.copy_(t(np.asarray(params[name]["kernel"]).transpose(3, 2, 0, 1)))
            conv.bias.copy_(t(params[name]["bias"]))
        dense0 = np.asarray(params["Dense_0"]["kernel"])  # rows in (h, w, c) order
        twin.fc0.weight.copy_(t(dense0.reshape(4, 4, 32, 32).transpose(3, 2, 0, 1)
                                .reshape(32, 512)))
        twin.fc0.bias.copy_(t(params["Dense_0"]["bias"]))
        twin.fc1.weight.copy_(t(np.asarray(params["Dense_1"]["kernel"]).T))
        twin.fc1.bias.copy_(t(params["Dense_1"]["bias"]))
        ours = np.asarray(model.apply({"params": params}, images))
        fake = types.SimpleNamespace(train=types.SimpleNamespace(
            images=images, labels=np.zeros(5, np.int32)))
        batch, _ = torch_workers._torch_batch(torch, fake, np.arange(5))
        # NCHW strides, not the channels_last ones a 1-channel transposed view would get (with
        # those, Opacus's hooks-mode conv grad sampler returns wrong per-sample gradients).
        assert batch.stride() == (784, 784, 28, 1)
        theirs = twin(batch).numpy()
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-5)


def test_micro_batch_sizes_per_batch_size_with_a_default():
    sizes = configs.parse_micro_batch_sizes(["256:64", "128"])
    assert sizes == ((256, 64), (None, 128))
    options = configs.Options(micro_batch_sizes=sizes)
    assert configs.micro_batch_size_for(options, 256) == 64
    assert configs.micro_batch_size_for(options, 1024) == 128
    assert "train.micro_batch_size = 64" in configs._bindings(options, 256)


@pytest.mark.parametrize("group", sorted(common.GEP_BOUNDS))
def test_each_gep_bound_gives_its_own_target_line_and_ratio(group):
    """GEP light's lower bounds (its matrix products alone; those plus the plain gradients) are
    reported against DP-SGD at the same batch size and checked against GEP's own target:
    when one fails it, no implementation of the step can meet it on this machine."""
    label = common.GEP_BOUNDS[group]

    def rows(bound_ms):
        return [_row("dpbench dpsgd", "dpbench", 256, 50.0, pipeline="dpsgd"),
                _row(label, group, 256, bound_ms, pipeline="gep", setting="light")]
    name = f"B=256: {label} <= 4x DP-SGD"
    for bound_ms, holds in ((250.0, False), (150.0, True)):
        ratios = reporting.compute_ratios(rows(bound_ms), (256,))
        assert math.isclose(ratios["per_batch"]["256"][f"gep_{group}_over_dpsgd"], bound_ms / 50)
        assert "dpbench gep (light)" not in ratios["per_batch"]["256"]["methods"]
        assert {t["target"]: t["holds"] for t in reporting.targets(ratios, None)}[name] is holds
        assert f"| 256 | {label} | {bound_ms / 50:.2f} |" in reporting._ratio_tables(ratios)
    without = reporting.compute_ratios(rows(100.0)[:1], (256,))
    assert not any(label in t["target"] for t in reporting.targets(without, None))


def test_the_plan_times_both_gep_bounds_only_with_gep():
    options = configs.Options(pipelines="dpsgd,gep", batch_sizes=(256,), interleaved_steps=0)
    kinds = {c["kind"]: c for c in configs.plan(options, {"skip": "no torch"})
             if c.get("group") in common.GEP_BOUNDS}
    assert set(kinds) == {"gep_floor", "gep_bound"}
    assert all(c["pipeline"] == "gep" and c["setting"] == "light" for c in kinds.values())
    without = configs.plan(configs.Options(pipelines="dpsgd", batch_sizes=(256,)),
                           {"skip": "no torch"})
    assert not any(c.get("group") in common.GEP_BOUNDS for c in without)


def test_the_gep_floor_times_the_products_of_the_pipelines_own_shapes():
    """The floor's shapes are the compiled GEP pipeline's: per parameter group its size p_g
    and basis k_g, m anchors, the expected batch B; FLOPs = sum_g (4 m + 2 B) p_g k_g."""
    from dpbench.stages import gep

    bindings = ["train.batch_size = 64", "train.micro_batch_size = 32",
                "dataset.public_size = 48", "gep.embed_and_clip.num_anchors = 48",
                "gep.embed_and_clip.num_basis = 20"]
    spec = dict(gin_files=["pipelines/gep", "gin/data/digits.gin"], bindings=bindings,
                noise_multiplier=1.0, steps=2, warmup=1)
    result = workers.worker_gep_floor(spec)
    params = workers.build_dp_run(spec)["state"].params["params"]
    sizes = {layer: sum(x.size for x in jax.tree.leaves(sub)) for layer, sub in params.items()}
    ks = gep.basis_sizes(sizes, 20, 48)
    assert result["basis_per_group"] == ks and result["num_anchors"] == 48
    assert result["expected_batch_size"] == 64
    assert result["flops"] == sum((4 * 48 + 2 * 64) * sizes[g] * ks[g] for g in sizes)
    assert result["timed_steps"] == 2 and result["ms_median"] > 0
    assert math.isclose(result["gflop_per_s"], result["flops"] / result["ms_median"] / 1e6)
    # the bound: the same products (same FLOPs, shapes) plus the two plain gradients
    bound = workers.worker_gep_floor(dict(spec, kind="gep_bound"))
    assert {k: bound[k] for k in ("flops", "basis_per_group", "num_anchors")} == {
        k: result[k] for k in ("flops", "basis_per_group", "num_anchors")}
    assert bound["timed_steps"] == 2 and bound["ms_median"] > 0


def test_the_jax_non_private_gradient_accumulated_over_micro_batches_is_the_batch_gradient():
    """The JAX non-private row sums its gradient over micro-batches (as dpbench's rows do, so
    XLA's cache cliff on a whole-batch step does not inflate the baseline): the loss and the
    gradient are the whole batch's mean, and a chunk that does not divide B falls back to it."""
    import jax.numpy as jnp

    key = jax.random.PRNGKey(np.random.randint(1 << 30))
    k1, k2, k3 = jax.random.split(key, 3)
    params = {"w": jax.random.normal(k1, (6, 3)), "b": jnp.zeros(3)}
    images = jax.random.normal(k2, (12, 6))
    labels = jax.random.randint(k3, (12,), 0, 3)

    def mean_loss(p, x, y):
        logits = x @ p["w"] + p["b"]
        return jnp.mean(jax.nn.logsumexp(logits, axis=1) - logits[jnp.arange(len(y)), y])

    whole = jax.jit(jax.value_and_grad(mean_loss))(params, images, labels)
    for chunk in (4, 5, 12, 64):
        got = jax.jit(lambda p, x, y: workers.accumulated_value_and_grad(
            mean_loss, p, x, y, chunk))(params, images, labels)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(whole)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # a wrong average (sum of chunk means, not their mean) is caught
    chunked = workers.accumulated_value_and_grad(mean_loss, params, images, labels, 4)
    assert not np.allclose(chunked[0] * 3, whole[0])


def test_cpu_facts_name_the_vector_extensions():
    """Two hosts with the same model name ran matrix products at different speeds: the report
    names the CPU's vector extensions."""
    info = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\n"
            "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_bf16 amx_tile\n"
            "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n")
    assert machine.cpu_facts(info) == ("Intel(R) Xeon(R) Processor",
                                     ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"])
    assert machine.cpu_facts("model name\t: old\nflags\t\t: sse2 avx\n") == ("old", [])


def test_the_r_step_row_times_r_steps_at_a_time_and_reports_per_step():
    """GEP with the basis every r steps: timed r consecutive steps at a time (each unit holds
    one refresh), reported per step; the plan adds the row beside GEP light, outside the
    interleaved run (whose unit is one step)."""
    bindings = ["train.batch_size = 64", "train.micro_batch_size = 32",
                "dataset.public_size = 48", "gep.embed_and_clip.num_anchors = 48",
                "gep.embed_and_clip.num_basis = 20",
                "gep.embed_and_clip.basis_refresh_every = 3"]
    spec = dict(gin_files=["pipelines/gep", "gin/data/digits.gin"], bindings=bindings,
                noise_multiplier=1.0, steps=2, warmup=1, steps_per_timing=3)
    result = workers.worker_dp(spec)
    assert result["steps_per_timing"] == 3 and result["timed_steps"] == 2
    assert 0 < result["ms_min"] <= result["ms_median"] <= result["ms_max"]
    gep_facts = [s for s in result["stages"] if s["name"] == "gep.embed_and_clip"][0]
    assert gep_facts["basis_refresh_every"] == 3
    options = configs.Options(batch_sizes=(64,), pipelines="gep", skip_torch=True,
                              gep_paper_anchors=0, gep_refresh_every=10, calibration=False,
                              main_job=False, logical_batch=0)
    planned = configs.plan(options, {})
    rows = [c for c in planned if c.get("setting") == "light, r=10"]
    assert len(rows) == 1 and rows[0]["steps_per_timing"] == 10
    assert "gep.embed_and_clip.basis_refresh_every = 10" in rows[0]["bindings"]
    assert all("steps_per_timing" not in m for c in planned if c["kind"] == "interleaved"
               for m in c["members"])


def test_trial_cost_per_method_comes_from_the_records(tmp_path):
    """PERF.md's sweep trial cost: per (family, method), the records' wall seconds per epoch."""
    for group, run, wall, epochs, method in (
            ("fm__tanh_cnn__eps1.0__delta1e-05", "gep-t0-seed0", 300.0, 30, "gep"),
            ("fm__tanh_cnn__eps3.0__delta1e-05", "gep-t1-seed0", 200.0, 10, "gep"),
            ("fm__tanh_cnn__eps3.0__delta1e-05", "dpsgd-t0-seed0", 90.0, 30, "dpsgd")):
        (tmp_path / group / run).mkdir(parents=True)
        (tmp_path / group / run / "run_record.json").write_text(json.dumps(
            dict(wall_time_s=wall, epochs=epochs, pipeline=method)))
    from benchmarks import trial_cost

    costs = {c["method"]: c for c in trial_cost.trial_costs(tmp_path)}
    assert costs["gep"]["family"] == "fm__tanh_cnn" and costs["gep"]["runs"] == 2
    assert (costs["gep"]["s_per_epoch_min"], costs["gep"]["s_per_epoch_max"]) == (10.0, 20.0)
    assert costs["gep"]["s_per_epoch_median"] == 15.0 and costs["dpsgd"]["runs"] == 1
    text = "\n".join(trial_cost.trial_cost_section(dict(
        trial_costs=list(costs.values()), records_dir="leaderboard/records")))
    assert "| fm__tanh_cnn | gep | 2 | 15.0 | 10.0–20.0 |" in text


def test_the_non_private_row_sees_the_augmented_copies_the_gradient_stage_declares():
    """With augmentation multiplicity K (the WRN rows: B 256 x 16), JAX's non-private step
    trains on the B x K augmented images dpbench's rows clip per example: each example's K
    copies adjacent, each a crop (and flip) of that example, labels repeated."""
    from dpbench.stages.grad import augment_image

    rng = np.random.default_rng()
    images = jax.numpy.asarray(rng.uniform(size=(3, 8, 8, 1)), jax.numpy.float32)
    labels = jax.numpy.asarray([4, 1, 7])
    options = {"augmult": 2, "augmentation": "crop_flip", "crop_padding": 2}
    key = jax.random.key(int(rng.integers(1 << 30)))
    out, out_labels = jax.jit(common.augmented_batch(options))(images, labels, key)
    assert out.shape == (6, 8, 8, 1) and list(out_labels) == [4, 4, 1, 1, 7, 7]
    keys = jax.random.split(key, 6).reshape(3, 2)
    for i in range(3):
        for k in range(2):
            np.testing.assert_array_equal(out[2 * i + k], augment_image(
                keys[i, k], images[i], "crop_flip", 2))
    plain = {"augmult": 1, "augmentation": "none", "crop_padding": 4}
    same, same_labels = common.augmented_batch(plain)(images, labels, key)
    assert same is images and same_labels is labels


def test_the_step_memory_plan_grows_with_the_micro_batch_gep_materializes():
    """benchmarks/step_memory.py reads XLA's buffer plan of the compiled step without running
    it: GEP's layer form materializes each example's layer gradients of a micro-batch, so its
    plan grows with the micro-batch (what made the 5.8M-parameter MLP run out of memory at
    micro-batch 1024), far above DP-SGD's book-keeping at the same micro-batch (observed at
    these sizes: GEP 1.8 -> 10.0 MiB, DP-SGD 0.6 MiB at 128)."""
    from benchmarks import step_memory

    files = ["pipelines/gep", "gin/data/digits.gin", "gin/model/mlp.gin"]
    bindings = ["model.hidden = (128,)", "dataset.public_size = 64",
                "gep.embed_and_clip.num_anchors = 32", "gep.embed_and_clip.num_basis = 8"]
    small, large = (step_memory.step_memory(files, bindings, 256, m) for m in (16, 128))
    assert small["strategy"] == large["strategy"] == "bookkeeping"
    assert large["temp_gib"] > 3 * small["temp_gib"] > 0
    dpsgd = step_memory.step_memory(["pipelines/dpsgd", *files[1:]], bindings[:1], 256, 128)
    assert dpsgd["temp_gib"] < large["temp_gib"] / 5


def test_perf_on_device_refuses_an_unknown_set_or_a_missing_out_before_any_work(tmp_path):
    """tools/perf_on_device.sh (the GPU rows of leaderboard/PERF-gpu.md, on a lent machine
    whose minutes are few): a misspelt set, or no $OUT to bring the reports back in, stops it
    at once with what to change, before it installs or compiles anything."""
    script = Path(__file__).resolve().parents[1] / "tools" / "perf_on_device.sh"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    bad = subprocess.run(["bash", str(script), "run", "wrn256", "wrn265"], capture_output=True,
                         text=True, env=dict(env, OUT=str(tmp_path)), timeout=60)
    assert bad.returncode == 2 and "unknown set wrn265" in bad.stderr
    assert "wrn256 mlp4096 tanh4096" in bad.stderr  # the known sets, named
    no_out = subprocess.run(["bash", str(script), "run", "tanh4096"], capture_output=True,
                            text=True, env=env, timeout=60)
    assert no_out.returncode != 0 and "set OUT" in no_out.stderr
    for command in (["ab", "mlp4096", "mlp4069"], ["profile", "mlp4069"]):  # the same checks
        bad = subprocess.run(["bash", str(script), *command], capture_output=True, text=True,
                             env=dict(env, OUT=str(tmp_path)), timeout=60)
        assert bad.returncode == 2 and "unknown set mlp4069" in bad.stderr, command
    no_out = subprocess.run(["bash", str(script), "ab"], capture_output=True, text=True,
                            env=env, timeout=60)
    assert no_out.returncode != 0 and "set OUT" in no_out.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_norm_routes_benchmark_times_both_routes_and_says_what_the_rule_picks():
    from benchmarks import norm_routes
    few = norm_routes.time_routes(4, 256, 32, batch=4, repeats=1)
    many = norm_routes.time_routes(64, 8, 4, batch=4, repeats=1)
    assert few["ghost_s"] > 0 and few["kernel_s"] > 0
    assert (few["rule_picks"], many["rule_picks"]) == ("ghost", "kernel")
