"""The leaderboard: validation-based choice, byte-identical regeneration, rejected records."""

import json
import shutil

import numpy as np
import pytest

from dpbench import config, leaderboard, train

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
    # Welch's standard error of the gain: rs-a's std is 0, dpsgd's 0.001, 3 seeds each
    assert rows["rs"]["gain_se"] == pytest.approx(np.sqrt(0.001 ** 2 / 3))
    assert rows["dpsgd"]["gain_se"] is None
    assert "| -1.10 ± 0.06 |" in (tmp_path / "board" / "README.md").read_text()


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
    config.parse_config(["pipelines/dpsgd.gin", "gin/data/digits.gin"],
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
    sweep.POLL_S = 0.05  # the fake runs take a fraction of a second
    return sweep


def test_every_sweep_configuration_parses_and_names_its_method():
    sweep = _load_sweep()
    for method, configs in sweep.GRID.items():
        for gin_file, bindings in configs.values():
            config.parse_config([gin_file], [*sweep.SWEEP_BINDINGS, *bindings])
            name, stages = train.pipeline_stages()
            assert name == method and stages
    jobs = sweep.jobs([3.0, 1.0], [0, 1, 2], list(sweep.GRID))
    grid = sum(len(c) for c in sweep.GRID.values())
    lr_steps = [m for m in sweep.GRID if not sweep.varies_learning_rate(m)]
    assert lr_steps == [m for m in sweep.GRID if m != "dpsgd"]  # DP-SGD's grid is its lr axis
    assert len(jobs) == 2 * (grid + len(lr_steps) + 2 * len(sweep.GRID))
    assert jobs[0][0] == 3.0 and jobs[-1][0] == 1.0  # epsilon by epsilon, as given
    seed_jobs = [(m, s) for e, m, c, s in jobs if e == 3.0 and c is None]
    assert seed_jobs[:4] == [("dpsgd", 1), ("dpsgd", 2), ("rs", 1), ("rs", 2)]  # whole rows
    names = {sweep.run_name(m, c, s) for _, m, c, s in jobs
             if c is not None and c != sweep.HALF_LR}
    assert len(names) == grid  # no two configurations share a workdir


@pytest.mark.parametrize("method,label,halved", [("nasr", "tau1e-3", 19.2),
                                                 ("rs", "r0.9", 2.0)])
def test_a_halved_learning_rate_config_binds_exactly_that_rate(method, label, halved, tmp_path):
    sweep = _load_sweep()
    command = sweep.command_for(method, label + sweep.HALF_LR, 3.0, 0, tmp_path, halved)
    gin_file = command[1].removeprefix("--gin_file=")
    bindings = [a.removeprefix("--gin_bindings=") for a in command if "--gin_bindings=" in a]
    config.parse_config([gin_file], bindings)
    import gin
    assert gin.query_parameter("optimize.optax.learning_rate") == halved
    assert command[:-1] == sweep.command_for(method, label, 3.0, 0, tmp_path)[:-1] + [
        f"--gin_bindings=optimize.optax.learning_rate = {halved!r}"]
    with pytest.raises(ValueError, match="learning rate"):
        sweep.command_for(method, label + sweep.HALF_LR, 3.0, 0, tmp_path)  # rate missing
    with pytest.raises(ValueError, match="learning rate"):
        sweep.command_for(method, label, 3.0, 0, tmp_path, 2.0)  # rate without the suffix


def _runs(val_by_seed, lr):
    return [fake_record("rs", seed, val, 0.5, lr=lr) for seed, val in val_by_seed.items()]


@pytest.mark.parametrize("a_vals,b_vals,expected", [
    # A wins on the shared seed 0; its extra seeds are worse, but they are not compared
    ({0: 0.86, 1: 0.80, 2: 0.80}, {0: 0.85}, "A"),
    # B wins on seed 0; A's extra seeds are better, but they cannot tilt the choice either
    ({0: 0.84, 1: 0.95, 2: 0.95}, {0: 0.85}, "B"),
    # every configuration has every seed: the mean over all of them decides
    ({0: 0.84, 1: 0.90}, {0: 0.85, 1: 0.85}, "A"),
])
def test_the_choice_compares_only_the_seeds_every_configuration_ran(a_vals, b_vals, expected):
    configs = {"A": _runs(a_vals, 1.0), "B": _runs(b_vals, 2.0)}
    key, seeds, score = leaderboard.choose_configuration(configs)
    assert key == expected
    shared = sorted(set(map(str, a_vals)) & set(map(str, b_vals)))
    assert seeds == shared
    wanted = configs[expected]
    assert score == pytest.approx(np.mean([r["validation_accuracy"] for r in wanted
                                           if str(r["seed"]) in shared]))


def test_the_choice_never_reads_test_accuracy():
    a, b = _runs({0: 0.86}, 1.0), _runs({0: 0.85}, 2.0)
    for r in a:
        r["test_accuracy"] = 0.1
    assert leaderboard.choose_configuration({"A": a, "B": b})[0] == "A"


def test_the_board_names_what_sets_the_chosen_configuration_apart(records, tmp_path):
    table = leaderboard.build(records, tmp_path / "board")
    rows = {r["method"]: r for r in table[GROUP]}
    assert rows["rs"]["config_label"] == "optimize.optax.learning_rate=1.0"
    assert rows["dpsgd"]["config_label"] == "default"  # its only configuration
    assert "| rs | optimize.optax.learning_rate=1.0 |" in (
        tmp_path / "board" / "README.md").read_text()
    synflow = fake_record("dpssgd", 0, 0.8, 0.8)
    synflow["stages"] = [{"name": "prune.synflow", "sparsity": 0.5},
                         {"name": "drop.gradients", "criterion": "random"}]
    random_prune = json.loads(json.dumps(synflow))
    random_prune["stages"][0] = {"name": "prune.random", "sparsity": 0.5}
    magnitude = json.loads(json.dumps(synflow))
    magnitude["stages"][1]["criterion"] = "magnitude"
    assert leaderboard.config_label(synflow, [random_prune, magnitude]) == (
        "prune.synflow, drop.gradients.criterion=random")


FAKE_RUN = """
import json, sys, pathlib
workdir, config, seed = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
lr = float(sys.argv[4]) if len(sys.argv) > 4 else {"lr2": 2.0}.get(config, 4.0)
if config == "broken":
    sys.exit(3)
val = json.loads(sys.argv[5] if len(sys.argv) > 5 else '{"lr4": 0.80, "lr2": 0.90}')[config]
workdir.mkdir(parents=True, exist_ok=True)
record = dict(seed=seed, validation_accuracy=val + seed / 1000, test_accuracy=0.5,
              batch_size=1024, epochs=30, ema_decay=0.0, accountant="pld",
              stages=[{"name": "optimize.optax", "learning_rate": lr},
                      {"name": "fake.knob", "config": config.removesuffix("-halflr")}])
(workdir / "run_record.json").write_text(json.dumps(record))
"""


@pytest.mark.parametrize("halved_val,chosen", [(0.88, "b-halflr"), (0.84, "b")])
def test_sweep_halves_the_grid_winners_learning_rate_and_seeds_the_better_on_validation(
        halved_val, chosen, tmp_path, monkeypatch):
    import sys
    sweep = _load_sweep()
    monkeypatch.setitem(sweep.GRID, "rs", {"a": sweep.GRID["rs"]["r0.7"],
                                           "b": sweep.GRID["rs"]["r0.9"]})
    vals = json.dumps({"a": 0.80, "b": 0.85, "b-halflr": halved_val})
    started = []

    def fake_command(method, config, eps, seed, workdir, learning_rate=None):
        started.append((config, seed, learning_rate))
        lr = [] if learning_rate is None else [str(learning_rate)]
        return [sys.executable, "-c", FAKE_RUN, str(workdir), config, str(seed), *(lr or ["4.0"]),
                vals]

    monkeypatch.setattr(sweep, "command_for", fake_command)
    args = ["--epsilons", "3", "--seeds", "0", "1", "--methods", "rs", "--workers", "2",
            f"--runs_dir={tmp_path / 'runs'}", f"--records={tmp_path / 'records'}"]
    assert sweep.main(args) == 0
    assert ("b-halflr", 0, 2.0) in started and ("a-halflr", 0, 2.0) not in started
    group = tmp_path / "records" / sweep.group_name(3.0)
    assert sorted(p.name for p in group.iterdir()) == sorted(
        ["rs-a-seed0", "rs-b-seed0", "rs-b-halflr-seed0", f"rs-{chosen}-seed1"])
    halved = json.loads((group / "rs-b-halflr-seed0" / "run_record.json").read_text())
    assert halved["stages"][0]["learning_rate"] == 2.0
    # the board's own rule, over every record of the method, agrees with the sweep
    by_key = {}
    for path in group.glob("*-seed0/run_record.json"):
        record = json.loads(path.read_text())
        by_key.setdefault(path.parent.name, []).append(record)
    assert leaderboard.choose_configuration(by_key)[0] == f"rs-{chosen}-seed0"


def test_sweep_gives_the_extra_seeds_only_to_the_configuration_chosen_on_validation(
        tmp_path, monkeypatch):
    import sys
    sweep = _load_sweep()
    started = []

    def fake_command(method, config, eps, seed, workdir, learning_rate=None):
        started.append((config, seed))
        return [sys.executable, "-c", FAKE_RUN, str(workdir), config, str(seed)]

    monkeypatch.setattr(sweep, "command_for", fake_command)
    args = ["--epsilons", "3", "--seeds", "0", "1", "2", "--methods", "dpsgd", "--workers", "2",
            f"--runs_dir={tmp_path / 'runs'}", f"--records={tmp_path / 'records'}"]
    assert sweep.main(args) == 0
    group = tmp_path / "records" / sweep.group_name(3.0)
    assert sorted(p.name for p in group.iterdir()) == [
        "dpsgd-lr2-seed0", "dpsgd-lr2-seed1", "dpsgd-lr2-seed2", "dpsgd-lr4-seed0"]
    assert sorted(started[:2]) == [("lr2", 0), ("lr4", 0)]  # the grid first
    assert not list(group.rglob("*.tmp"))
    started.clear()
    assert sweep.main(args) == 0 and started == []  # published runs are never redone


def test_sweep_does_not_seed_a_method_whose_grid_failed(tmp_path, monkeypatch, capsys):
    import sys
    sweep = _load_sweep()
    monkeypatch.setitem(sweep.GRID, "dpsgd", {"lr4": sweep.GRID["dpsgd"]["lr4"],
                                              "broken": sweep.GRID["dpsgd"]["lr4"]})
    monkeypatch.setattr(sweep, "command_for", lambda method, config, eps, seed, workdir, lr=None: [
        sys.executable, "-c", FAKE_RUN, str(workdir), config, str(seed)])
    assert sweep.main(["--epsilons", "3", "--seeds", "0", "1", "--methods", "dpsgd",
                       "--workers", "1", f"--runs_dir={tmp_path / 'runs'}",
                       f"--records={tmp_path / 'records'}"]) == 1
    group = tmp_path / "records" / sweep.group_name(3.0)
    assert sorted(p.name for p in group.iterdir()) == ["dpsgd-lr4-seed0"]
    assert "FAILED" in capsys.readouterr().err


def test_each_group_shows_the_audit_made_at_its_own_epsilon(records, tmp_path):
    audits = tmp_path / "audits"
    audits.mkdir()
    (audits / "rs-eps3.json").write_text(json.dumps(
        {"pipeline": "rs", "claimed_epsilon": 2.9999994, "epsilon_lb": 0.305}))
    (audits / "dpsgd-eps1.json").write_text(json.dumps(
        {"pipeline": "dpsgd", "claimed_epsilon": 0.99999, "epsilon_lb": 0.1}))
    table = leaderboard.build(records, tmp_path / "board", audits_dir=audits)
    eps3 = {r["method"]: r for r in table[GROUP]}
    (eps1,) = table["fashion_mnist__tanh_cnn__eps1.0__delta1e-05"]
    assert eps3["rs"]["audit_epsilon_lb"] == 0.305
    assert eps3["dpsgd"]["audit_epsilon_lb"] is None  # its only audit is at epsilon 1
    assert eps1["audit_epsilon_lb"] == 0.1
    (audits / "rs-again.json").write_text(json.dumps(
        {"pipeline": "rs", "claimed_epsilon": 3.0, "epsilon_lb": 0.2}))
    with pytest.raises(leaderboard.LeaderboardError, match="a second audit of rs"):
        leaderboard.build(records, tmp_path / "board", audits_dir=audits)


def test_the_committed_board_is_what_its_committed_records_give(tmp_path):
    """leaderboard/README.md and index.html are regenerated, never edited by hand: rebuilding
    them from the committed records, audits and PERF.json gives the same bytes. (The SVG plots
    are only checked to exist: their bytes depend on the matplotlib version.)"""
    from tests.conftest import REPO_ROOT
    board = REPO_ROOT / "leaderboard"
    copy = tmp_path / "leaderboard"
    shutil.copytree(board / "records", copy / "records")
    shutil.copytree(board / "audits", copy / "audits")
    shutil.copy(board / "PERF.json", copy / "PERF.json")
    leaderboard.build(copy / "records", copy, copy / "audits", copy / "PERF.json")
    for name in ("README.md", "index.html"):
        assert (copy / name).read_text() == (board / name).read_text(), (
            f"leaderboard/{name} is stale: run .venv/bin/dpbench leaderboard")
    for plot in (copy / "plots").iterdir():
        assert (board / "plots" / plot.name).is_file()


def test_the_note_renders_as_html_paragraphs_with_escaping(records, tmp_path):
    (records / "NOTE.md").write_text("**Caveat** one\nline `x<y`.\n\nSecond & last.\n")
    leaderboard.build(records, tmp_path / "board")
    page = (tmp_path / "board" / "index.html").read_text()
    assert ("<p class='note'><strong>Caveat</strong> one line <code>x&lt;y</code>.</p>"
            in page)
    assert "<p class='note'>Second &amp; last.</p>" in page
    assert "**Caveat** one" in (tmp_path / "board" / "README.md").read_text()


def test_sweep_dry_run_prints_the_grid_and_writes_nothing(tmp_path, capsys):
    sweep = _load_sweep()
    assert sweep.main(["--dry_run", "--epsilons", "3", f"--runs_dir={tmp_path / 'runs'}",
                       f"--records={tmp_path / 'records'}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == sum(len(c) for c in sweep.GRID.values())
    assert all("--gin_bindings=EPSILON = 3.0" in line for line in lines)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "records").exists()


def test_sweep_refuses_two_grid_entries_that_ran_the_same_settings(tmp_path, monkeypatch):
    sweep = _load_sweep()
    monkeypatch.setitem(sweep.GRID, "rs", {"a": sweep.GRID["rs"]["r0.7"],
                                           "b": sweep.GRID["rs"]["r0.7"]})
    for config, val in (("a", 0.80), ("b", 0.85)):
        record = fake_record("rs", 0, val, 0.5)
        path = sweep.published(tmp_path, 3.0, "rs", config, 0)
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="configs a and b ran the same settings"):
        sweep.choose(tmp_path, 3.0, "rs", ["a", "b"], 0)


def test_sweep_publishes_a_run_that_finished_while_no_sweep_was_watching(tmp_path, monkeypatch):
    import sys
    sweep = _load_sweep()
    started = []
    monkeypatch.setattr(sweep, "command_for", lambda method, config, eps, seed, workdir, lr=None: (
        started.append(config) or [sys.executable, "-c", FAKE_RUN, str(workdir), config,
                                   str(seed)]))
    finished = tmp_path / "runs" / sweep.group_name(3.0) / "dpsgd-lr4-seed0"
    finished.mkdir(parents=True)
    (finished / "run_record.json").write_text(json.dumps(dict(
        seed=0, validation_accuracy=0.95, test_accuracy=0.5, batch_size=1024, epochs=30,
        ema_decay=0.0, accountant="pld", stages=[{"name": "optimize.optax", "learning_rate": 4.0}])))
    assert sweep.main(["--epsilons", "3", "--seeds", "0", "1", "--methods", "dpsgd",
                       "--workers", "1", f"--runs_dir={tmp_path / 'runs'}",
                       f"--records={tmp_path / 'records'}"]) == 0
    assert "lr4" not in started[:1] and started.count("lr4") == 1  # only its seed 1 trained
    group = tmp_path / "records" / sweep.group_name(3.0)
    assert sorted(p.name for p in group.iterdir()) == [
        "dpsgd-lr2-seed0", "dpsgd-lr4-seed0", "dpsgd-lr4-seed1"]  # 0.95 beat lr2's 0.90


def test_a_plot_shared_by_several_epsilons_is_shown_once(records, tmp_path):
    assert (records / "fashion_mnist__tanh_cnn__eps1.0__delta1e-05").is_dir()  # two epsilons
    leaderboard.build(records, tmp_path / "board")
    page = (tmp_path / "board" / "index.html").read_text()
    readme = (tmp_path / "board" / "README.md").read_text()
    assert page.count("<h2>") == 2 and page.count("<img ") == 1  # one (dataset, model, delta)
    assert readme.count("![accuracy vs epsilon]") == 1
