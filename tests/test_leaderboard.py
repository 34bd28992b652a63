"""The leaderboard: validation-based choice, byte-identical regeneration, rejected records."""

import json
import shutil

import pytest

from dpbench import leaderboard, main, train

GROUP = "fashion_mnist__tanh_cnn__eps3.0__delta1e-05"


def fake_record(pipeline, seed, val, test, *, lr=1.0, eps=3.0, delta=1e-5, step_s=0.1,
                fidelity=None):
    return dict(
        pipeline=pipeline, dataset="fashion_mnist", model="tanh_cnn", target_epsilon=eps,
        epsilon=eps - 1e-4, delta=delta, test_accuracy=test, validation_accuracy=val,
        noise_multiplier=1.2, steps=100, batch_size=1024, epochs=30, accountant="pld",
        sampling={"sampling": "poisson"}, seed=seed, median_step_s=step_s,
        privacy_statement={"poisson_accounted": True, "statement": "..."},
        stages=[{"name": "optimize.optax", "learning_rate": lr}], ema_decay=0.0,
        fidelity=fidelity)


def write(root, group, name, record):
    path = root / group / name / "run_record.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(record))
    return path


@pytest.fixture
def records(tmp_path):
    root = tmp_path / "board" / "records"
    for seed in range(3):
        write(root, GROUP, f"dpsgd-s{seed}", fake_record("dpsgd", seed, 0.86, 0.860 + seed / 1e3))
        # config A: best on validation, worse on test; config B: the reverse
        write(root, GROUP, f"rs-a-s{seed}", fake_record("rs", seed, 0.87, 0.850, lr=1.0,
                                                        step_s=0.12))
        write(root, GROUP, f"rs-b-s{seed}", fake_record("rs", seed, 0.85, 0.880, lr=2.0,
                                                        fidelity={"cosine_mean": 0.5,
                                                                  "noise_to_signal_mean": 2}))
    write(root, "fashion_mnist__tanh_cnn__eps1.0__delta1e-05", "dpsgd-s0",
          fake_record("dpsgd", 0, 0.8, 0.8, eps=1.0))
    return root


def test_the_configuration_is_chosen_on_validation_not_test(records, tmp_path):
    table = leaderboard.build(records, tmp_path / "board")
    rows = {r["method"]: r for r in table[GROUP]}
    assert rows["rs"]["test_mean"] == pytest.approx(0.850)  # config A, despite B's test score
    assert rows["rs"]["configs_tried"] == 2 and rows["rs"]["seeds"] == 3
    assert rows["rs"]["gain"] == pytest.approx(0.850 - 0.861)
    assert rows["rs"]["step_ratio"] == pytest.approx(1.2)
    assert rows["dpsgd"]["test_std"] == pytest.approx(0.001)


def test_step_ratio_comes_from_the_speed_benchmark_at_the_runs_batch_size(records, tmp_path):
    def perf_row(pipeline, b, ms, setting=None, ok=True):
        return {"spec": {"group": "dpbench", "pipeline": pipeline, "batch_size": b,
                         "setting": setting}, "result": {"ok": ok, "ms_median": ms}}
    perf = tmp_path / "PERF.json"
    perf.write_text(json.dumps({"rows": [
        perf_row("dpsgd", 1024, 100.0), perf_row("rs", 1024, 150.0),
        perf_row("dpsgd", 256, 10.0), perf_row("rs", 256, 99.0),  # another batch size
        perf_row("rs", 1024, 500.0, setting="paper")]}))  # not the pipeline's own setting
    table = leaderboard.build(records, tmp_path / "board", perf_json=perf)
    rows = {r["method"]: r for r in table[GROUP]}
    assert rows["rs"]["step_ratio"] == pytest.approx(1.5) and rows["rs"]["step_source"] == "bench"
    assert "| 1.50x |" in (tmp_path / "board" / "README.md").read_text()
    # without the benchmark: the runs' own step times, marked
    table = leaderboard.build(records, tmp_path / "board")
    assert {r["method"]: r for r in table[GROUP]}["rs"]["step_source"] == "runs"
    assert "| 1.20x† |" in (tmp_path / "board" / "README.md").read_text()


def test_two_regenerations_give_identical_bytes(records, tmp_path):
    outputs = []
    for name in ("one", "two"):
        out = tmp_path / name
        shutil.copytree(records, out / "records")
        leaderboard.build(out / "records", out)
        outputs.append({p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*"))
                        if p.is_file() and "records" not in p.parts})
    assert outputs[0] == outputs[1]
    assert {str(p) for p in outputs[0]} >= {"README.md", "index.html"}
    html = outputs[0][next(p for p in outputs[0] if str(p) == "index.html")].decode()
    assert "<img src='plots/" in html and "rs" in html


@pytest.mark.parametrize("damage,match", [
    (lambda r: r.pop("validation_accuracy"), "missing field"),
    (lambda r: r.update(target_epsilon=1.0, epsilon=0.9), "does not match its group"),
    (lambda r: r.update(epsilon=3.5), "exceeds its target"),
    (lambda r: r["privacy_statement"].update(poisson_accounted=False), "not Poisson"),
])
def test_malformed_records_are_rejected_with_their_path(records, tmp_path, damage, match):
    path = records / GROUP / "rs-a-s1" / "run_record.json"
    record = json.loads(path.read_text())
    damage(record)
    path.write_text(json.dumps(record))
    with pytest.raises(leaderboard.LeaderboardError, match=match) as error:
        leaderboard.build(records, tmp_path / "board")
    assert str(path) in str(error.value)


def test_cli_exit_code_and_message(tmp_path, capsys):
    assert leaderboard.main([f"--records={tmp_path / 'none'}", f"--out={tmp_path}"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_real_run_record_is_accepted(tmp_path):
    """The builder reads what train.py writes (guards against schema drift)."""
    group = tmp_path / "records" / "digits__mlp__eps3.0__delta0.0001"
    main.parse_config(["pipelines/dpsgd.gin", "gin/data/digits.gin"],
                      ["train.epochs = 1", "EPSILON = 3.0"])
    train.train(group / "dpsgd-seed0")
    table = leaderboard.build(tmp_path / "records", tmp_path)
    (row,) = table["digits__mlp__eps3.0__delta0.0001"]
    assert row["method"] == "dpsgd" and row["gain"] == 0.0


def _load_sweep():
    import importlib.util
    from tests.conftest import REPO_ROOT
    spec = importlib.util.spec_from_file_location("sweep", REPO_ROOT / "tools" / "sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    return sweep


def test_every_sweep_configuration_parses_and_names_its_method():
    sweep = _load_sweep()
    for method, configs in sweep.GRID.items():
        for gin_file, bindings in configs.values():
            main.parse_config([gin_file], [*sweep.SWEEP_BINDINGS, *bindings])
            name, stages = train.pipeline_stages()
            assert name == method and stages
    jobs = sweep.jobs([3.0, 1.0], [0, 1, 2], list(sweep.GRID))
    grid = sum(len(c) for c in sweep.GRID.values())
    assert len(jobs) == 2 * (grid + 2 * len(sweep.GRID))
    assert jobs[0][0] == 3.0 and jobs[-1][0] == 1.0  # epsilon by epsilon, as given
    names = {sweep.run_name(m, c, s) for _, m, c, s in jobs if c is not None}
    assert len(names) == grid  # no two configurations share a workdir
