"""The leaderboard: validation-based choice, byte-identical regeneration, rejected records."""

import json
import math
import re
import shutil

import numpy as np
import pytest

from dpbench import board, config
from dpbench import run as run_lib
from tests import browser

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
    table = board.build(records, tmp_path / "board")
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
    table = board.build(records, tmp_path / "board", perf_json=perf)
    rows = {r["method"]: r for r in table[GROUP]}
    assert rows["rs"]["step_ratio"] == pytest.approx(1.5) and rows["rs"]["step_source"] == "bench"
    assert "| 1.50x |" in (tmp_path / "board" / "README.md").read_text()
    # with an interleaved run in the JSON, its medians (the benchmark's ratios) win over the
    # separate runs'; a member that compiled during a timed step is not used
    members = [dict(perf_row("dpsgd", 1024, 80.0), ok=True, recompiles=0, ms_median=80.0),
               dict(perf_row("rs", 1024, 96.0), ok=True, recompiles=0, ms_median=96.0),
               dict(perf_row("dpsgd", 256, 5.0), ok=True, recompiles=1, ms_median=5.0)]
    rows_json = json.loads(perf.read_text())["rows"]
    perf.write_text(json.dumps({"rows": rows_json + [{
        "spec": {"kind": "interleaved", "group": "interleaved", "batch_size": 1024},
        "result": {"ok": True, "members": members}}]}))
    assert board.load_perf(perf) == {("dpsgd", 1024): 80.0, ("rs", 1024): 96.0}
    table = board.build(records, tmp_path / "board", perf_json=perf)
    assert {r["method"]: r for r in table[GROUP]}["rs"]["step_ratio"] == pytest.approx(1.2)
    # without the benchmark: the runs' own step times, marked
    table = board.build(records, tmp_path / "board")
    assert {r["method"]: r for r in table[GROUP]}["rs"]["step_source"] == "runs"
    assert "| 1.20x† |" in (tmp_path / "board" / "README.md").read_text()


@pytest.mark.parametrize("rs_devices,compared", [(["cpu:0"], True), (["cuda:0"], False)])
def test_step_times_are_compared_only_on_one_kind_of_device(tmp_path, rs_devices, compared):
    """Board v3's trap: RS's runs on a GPU against DP-SGD's on a CPU gave a step-time ratio
    that was the devices', not the methods'. Runs' own step times are compared only where both
    methods' runs ran on one kind of device."""
    root = tmp_path / "board" / "records"
    for seed in range(2):
        write(root, GROUP, f"dpsgd-s{seed}", dict(fake_record("dpsgd", seed, 0.86, 0.86),
                                                  devices=["cpu:0"]))
        write(root, GROUP, f"rs-s{seed}", dict(fake_record("rs", seed, 0.85, 0.85, step_s=0.12),
                                               devices=rs_devices))
    rows = {r["method"]: r for r in board.build(root, tmp_path / "board")[GROUP]}
    assert (rows["rs"]["step_ratio"] == pytest.approx(1.2)) is compared
    assert (rows["rs"]["step_ratio"] is None) is not compared


def test_two_regenerations_give_identical_bytes(records, tmp_path):
    outputs = []
    for name in ("one", "two"):
        out = tmp_path / name
        shutil.copytree(records, out / "records")
        board.build(out / "records", out)
        outputs.append({p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*"))
                        if p.is_file() and "records" not in p.parts})
    assert outputs[0] == outputs[1]
    assert {str(p) for p in outputs[0]} >= {"README.md", "index.html"}
    html = outputs[0][next(p for p in outputs[0] if str(p) == "index.html")].decode()
    assert "<img src='plots/" in html and "rs" in html


@pytest.mark.parametrize("damage,match", [
    (lambda r: r.pop("validation_accuracy"), "missing field"),
    (lambda r: r.update(target_epsilon=1.0, epsilon=0.9), "does not match its group"),
    (lambda r: r.update(epsilon=3.0 + 1e-6), "exceeds its target"),  # target 3.0
    (lambda r: r["privacy_statement"].update(poisson_accounted=False), "not Poisson"),
])
def test_malformed_records_are_rejected_with_their_path(records, tmp_path, damage, match):
    path = records / GROUP / "rs-a-s1" / "run_record.json"
    record = json.loads(path.read_text())
    damage(record)
    path.write_text(json.dumps(record))
    with pytest.raises(board.LeaderboardError, match=match) as error:
        board.build(records, tmp_path / "board")
    assert str(path) in str(error.value)


def test_a_record_at_exactly_its_target_epsilon_is_accepted(records, tmp_path):
    path = records / GROUP / "rs-a-s1" / "run_record.json"
    record = json.loads(path.read_text())
    assert record["target_epsilon"] == 3.0
    path.write_text(json.dumps(dict(record, epsilon=3.0)))
    board.build(records, tmp_path / "board")


def test_cli_exit_code_and_message(tmp_path, capsys):
    assert board.main([f"--records={tmp_path / 'none'}", f"--out={tmp_path}"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_users_board_is_written_beside_its_records_without_the_committed_boards_inputs(
        records, capsys):
    """`dpbench board --records=DIR`: the board lands in DIR's parent (its links to records/
    hold), the committed board's audits and PERF.json are not mixed in (its rows have no audit
    and no step ratio), and an input given but missing is refused before anything is written."""
    assert board.main([f"--records={records}", "--audits=nope"]) == 2
    assert "--audits=nope: no such file" in capsys.readouterr().err
    assert not (records.parent / "README.md").exists()
    assert board.main([f"--records={records}"]) == 0
    by_cli = (records.parent / "README.md").read_text()
    plain = board.build(records, records.parent)  # no audits, no PERF.json
    assert by_cli == (records.parent / "README.md").read_text()
    official = board.build(records, records.parent / "official",
                           audits_dir=config.REPO_ROOT / "leaderboard" / "audits")
    assert any(r["audit_epsilon_lb"] is not None for r in official[GROUP])  # what it left out
    assert all(r["audit_epsilon_lb"] is None for r in plain[GROUP])


def test_a_real_run_record_is_accepted(tmp_path):
    """The builder reads what run.train writes (guards against schema drift)."""
    group = tmp_path / "records" / "digits__mlp__eps3.0__delta0.0001"
    config.parse_config(["pipelines/dpsgd/pipeline.gin", "gin/data/digits.gin"],
                      ["train.epochs = 1", "EPSILON = 3.0"])
    run_lib.train(group / "dpsgd-seed0")
    table = board.build(tmp_path / "records", tmp_path)
    (row,) = table["digits__mlp__eps3.0__delta0.0001"]
    assert row["method"] == "dpsgd" and row["gain"] == 0.0


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
    key, seeds, score = board.choose_configuration(configs)
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
    assert board.choose_configuration({"A": a, "B": b})[0] == "A"


def test_the_board_names_what_sets_the_chosen_configuration_apart(records, tmp_path):
    table = board.build(records, tmp_path / "board")
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
    assert board.config_label(synflow, [random_prune, magnitude]) == (
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


def test_each_group_shows_the_audit_made_at_its_own_epsilon(records, tmp_path):
    audits = tmp_path / "audits"
    audits.mkdir()
    (audits / "rs-eps3.json").write_text(json.dumps(
        {"pipeline": "rs", "claimed_epsilon": 2.9999994, "epsilon_lb": 0.305}))
    (audits / "dpsgd-eps1.json").write_text(json.dumps(
        {"pipeline": "dpsgd", "claimed_epsilon": 0.99999, "epsilon_lb": 0.1}))
    table = board.build(records, tmp_path / "board", audits_dir=audits)
    eps3 = {r["method"]: r for r in table[GROUP]}
    (eps1,) = table["fashion_mnist__tanh_cnn__eps1.0__delta1e-05"]
    assert eps3["rs"]["audit_epsilon_lb"] == 0.305
    assert eps3["dpsgd"]["audit_epsilon_lb"] is None  # its only audit is at epsilon 1
    assert eps1["audit_epsilon_lb"] == 0.1
    (audits / "rs-again.json").write_text(json.dumps(
        {"pipeline": "rs", "claimed_epsilon": 3.0, "epsilon_lb": 0.2}))
    with pytest.raises(board.LeaderboardError, match="a second audit of rs"):
        board.build(records, tmp_path / "board", audits_dir=audits)


def _committed_boards() -> list:
    from tests.conftest import REPO_ROOT
    found = [p.parent.relative_to(REPO_ROOT).as_posix()
             for p in [REPO_ROOT / "leaderboard" / board.INPUTS_FILE,
                       *sorted((REPO_ROOT / "leaderboard" / "archive").glob(
                           f"*/{board.INPUTS_FILE}"))] if p.exists()]
    assert "leaderboard" in found and "leaderboard/archive/v1" in found
    return found


@pytest.mark.parametrize("board_dir", _committed_boards())
def test_every_committed_board_is_frozen_and_still_what_was_frozen(board_dir):
    """Boards v1-v3 are archives: each one's files and records still hash to what `dpbench
    board --freeze` wrote into its board.json when its bytes were what the code then rendered
    from those records, so later code never rewrites a published page (board v3's was frozen
    once its page read right; the tests below read its page as committed)."""
    from tests.conftest import REPO_ROOT
    from dpbench.board import frozen
    assert frozen.frozen_spec(REPO_ROOT / board_dir) is not None, board_dir
    assert frozen.check_frozen(REPO_ROOT / board_dir) == []


STREAMS = 5


def test_the_committed_boards_verdicts_do_not_depend_on_the_bootstrap_seed():
    """Board v3's verdicts under the registered rule (paired.apply_rule, decide.py): every
    label of the committed board is the same on its own Monte Carlo stream and on STREAMS
    others, an 'undecided' one on all of them (decide.py: a label differs from the
    infinite-draw one with probability <= 1e-6 per stream, so this fails with probability
    <= 6e-6)."""
    from tests.conftest import REPO_ROOT
    from dpbench.board import paired
    board_dir = REPO_ROOT / "leaderboard"
    superseded = board_dir / json.loads((board_dir / board.INPUTS_FILE).read_text())[
        "superseded"]
    groups = sorted(p for p in (board_dir / "records").iterdir() if p.is_dir())
    assert len(groups) == 4
    analyses = [paired.analyse_group(
        g, {}, superseded_dir=superseded / g.name if (superseded / g.name).is_dir()
        else None) for g in groups]

    assert not any("tuned" in r for a in analyses for r in a["methods"].values())  # read only

    def verdicts(seed):
        out = paired.apply_rule(analyses, seed=seed)  # one family: the whole board's
        cells = [r for a in analyses for r in a["methods"].values() if "tuned" in r]
        assert out["comparisons"] == 3 * 28 + sum("claim" in r["tuned"] for r in cells)
        return {(a["group"], m): r["verdict"] for a in analyses
                for m, r in a["methods"].items() if "tuned" in r}
    board_verdicts = verdicts(0)
    assert len(board_verdicts) == 28
    for seed in range(1, STREAMS + 1):
        assert verdicts(seed) == board_verdicts, seed


def test_a_frozen_board_is_never_rebuilt_and_a_changed_one_is_caught(records, tmp_path,
                                                                     capsys):
    from dpbench.board import frozen
    assert board.main([f"--records={records}", "--freeze"]) == 0
    board_dir = records.parent
    spec = json.loads((board_dir / board.INPUTS_FILE).read_text())["frozen"]
    assert spec == frozen.freeze_spec(board_dir) and frozen.check_frozen(board_dir) == []
    before = (board_dir / "README.md").read_bytes()
    assert board.main([f"--records={records}"]) == 2  # an archive: never re-rendered
    assert "is a frozen board" in capsys.readouterr().err
    assert (board_dir / "README.md").read_bytes() == before
    (board_dir / "README.md").write_bytes(before + b"edited by hand\n")
    assert frozen.check_frozen(board_dir) == ["README.md changed since the board was frozen"]
    (board_dir / "README.md").write_bytes(before)
    next(records.rglob("run_record.json")).write_text("{}")
    assert frozen.check_frozen(board_dir) == ["its records changed since the board was frozen"]


def test_board_json_names_only_known_inputs_that_exist(tmp_path, capsys):
    """A board folder's board.json is read for every input not given on the command line; an
    unknown name or a missing path is refused before anything is written."""
    records = tmp_path / "records"
    records.mkdir()
    (tmp_path / board.INPUTS_FILE).write_text(json.dumps({"audit": "audits"}))
    assert board.main([f"--records={records}"]) == 2
    assert "unknown inputs ['audit']" in capsys.readouterr().err
    (tmp_path / board.INPUTS_FILE).write_text(json.dumps({"history": ["old/records"]}))
    assert board.main([f"--records={records}"]) == 2
    assert "missing" in capsys.readouterr().err and not (tmp_path / "README.md").exists()


def test_the_note_renders_as_html_paragraphs_with_escaping(records, tmp_path):
    (records / "NOTE.md").write_text("**Caveat** one\nline `x<y`.\n\nSecond & last.\n")
    board.build(records, tmp_path / "board")
    page = (tmp_path / "board" / "index.html").read_text()
    assert ("<p class='note'><strong>Caveat</strong> one line <code>x&lt;y</code>.</p>"
            in page)
    assert "<p class='note'>Second &amp; last.</p>" in page
    assert "**Caveat** one" in (tmp_path / "board" / "README.md").read_text()


def test_a_plot_shared_by_several_epsilons_is_shown_once(records, tmp_path):
    assert (records / "fashion_mnist__tanh_cnn__eps1.0__delta1e-05").is_dir()  # two epsilons
    board.build(records, tmp_path / "board")
    page = (tmp_path / "board" / "index.html").read_text()
    readme = (tmp_path / "board" / "README.md").read_text()
    assert page.count("<h3>") == 2 and page.count("<img ") == 1  # one (dataset, model, delta)
    assert readme.count("![accuracy vs epsilon for ") == 1


def test_a_run_without_a_step_time_is_summarized_from_the_others(tmp_path):
    """A resumed run whose last segment had no steady steps records median_step_s = None (a
    sweep interrupted near a run's end): the board averages the runs that have one, and
    without any it shows no step ratio instead of failing."""
    root = tmp_path / "records"
    for seed in range(2):
        write(root, GROUP, f"dpsgd-s{seed}", fake_record("dpsgd", seed, 0.86, 0.86,
                                                         step_s=None if seed else 0.1))
        write(root, GROUP, f"rs-s{seed}", fake_record("rs", seed, 0.87, 0.85, step_s=None))
    rows = {r["method"]: r for r in board.build(root, tmp_path / "board")[GROUP]}
    assert rows["dpsgd"]["step_s"] == pytest.approx(0.1)
    assert rows["rs"]["step_s"] is None and rows["rs"]["step_ratio"] is None


def test_the_runs_own_step_ratio_is_per_example_when_batch_sizes_differ(tmp_path):
    """Board v2 tunes the batch size per method: a winner at B=8192 against DP-SGD's at
    B=4096 takes about twice as long a step for the same cost per example. The runs' own
    ratio (x†) compares time per example, so it says the method's cost, not its batch."""
    root = tmp_path / "records"
    for seed in range(2):
        write(root, GROUP, f"dpsgd-s{seed}", dict(fake_record("dpsgd", seed, 0.86, 0.86,
                                                              step_s=0.4), batch_size=4096))
        write(root, GROUP, f"rs-s{seed}", dict(fake_record("rs", seed, 0.87, 0.85,
                                                           step_s=0.96), batch_size=8192))
    rows = {r["method"]: r for r in board.build(root, tmp_path / "board")[GROUP]}
    assert rows["rs"]["step_ratio"] == pytest.approx(1.2)
    assert rows["rs"]["step_source"] == "runs"
    assert "| 1.20x† |" in (tmp_path / "board" / "README.md").read_text()


def admits_all_but_a_refit(record):
    """Broken twin of board.unrankable_reason: refuses only a refit, so a failed run's
    record reaches the selection, which takes the best validation accuracy."""
    return "refit" if record["validation_accuracy"] is None else None


# How a failed or diverged run's record can look; each also has the group's best validation
# accuracy (0.95; NaN compares as no worse than anything, and its record is read first).
FAILED_RUNS = {
    "stop_reason diverged": dict(stop_reason="training diverged at step 3 (train loss nan)"),
    "test accuracy nan": dict(test_accuracy="nan"),  # as records.to_json writes a NaN
    "validation accuracy NaN": dict(validation_accuracy=math.nan),  # JSON's NaN
    "validation accuracy inf": dict(validation_accuracy=math.inf),
}


def check_a_failed_run_is_never_chosen_or_ranked(root, failed_path, out_dir):
    """The board refuses the failed run's record naming its path, or ranks without it: its
    configuration is not the one chosen for its method."""
    try:
        table = board.summarize(board.load_records(root), {}, out_dir)
    except board.LeaderboardError as error:
        assert str(failed_path) in str(error), f"refused, but not naming {failed_path}"
        return
    failed_config = board.config_key(json.loads(failed_path.read_text()))
    chosen = {r["method"]: r for r in table[GROUP]}["rs"]
    assert chosen["config"] != failed_config, f"the failed run {failed_path} was chosen"


@pytest.mark.parametrize("failure", FAILED_RUNS)
@pytest.mark.parametrize("unrankable", [board.unrankable_reason, admits_all_but_a_refit],
                         ids=["unrankable_reason", "broken_twin_admits_failed_runs"])
def test_a_failed_or_diverged_run_is_never_chosen_or_ranked(records, tmp_path, monkeypatch,
                                                            unrankable, failure):
    """Guarantee 8 (the board): a record of a failed or diverged run (non-finite validation
    or test accuracy, a stop_reason that is not a finished run's) with the highest validation
    accuracy of its method is neither chosen nor ranked; admitting it, the selection takes the
    max and ranks it."""
    record = dict(fake_record("rs", 0, 0.95, 0.90, lr=3.0), **FAILED_RUNS[failure])
    failed_path = write(records, GROUP, "rs-0-failed-s0", record)  # sorts first in its group
    monkeypatch.setattr(board.results, "unrankable_reason", unrankable)
    if unrankable is admits_all_but_a_refit:
        with pytest.raises(AssertionError):
            check_a_failed_run_is_never_chosen_or_ranked(records, failed_path, tmp_path)
    else:
        check_a_failed_run_is_never_chosen_or_ranked(records, failed_path, tmp_path)


def _dpsgd_runs(lr, tests, eps=1.0):
    return [fake_record("dpsgd", seed, 0.8, t, lr=lr, eps=eps) for seed, t in enumerate(tests)]


def test_the_baseline_check_fires_on_a_weaker_dpsgd_row_and_only_then():
    """Board v2's case: its DP-SGD row scored 82.02 +- 0.41 while an archived DP-SGD
    configuration of the same group scored 83.15 +- 0.03: 'weaker'. A row as good as the best
    recorded one (or within its seed noise) passes."""
    from dpbench.board.verdicts import baseline_check, best_recorded_baseline

    rng = np.random.default_rng()
    # the archived mean (sd 1.7e-4) sits >= 11 sds inside every verdict below: false failures
    # < 1e-28 (the 'weaker' and 'ok' intervals' edges need it 26 and 33 sds off)
    archived = _dpsgd_runs(2.0, 0.8315 + rng.normal(0, 3e-4, 3))
    noise = _dpsgd_runs(9.0, [0.70, 0.71, 0.72]) + _dpsgd_runs(1.0, [0.84], eps=3.0)  # not best
    best = best_recorded_baseline(archived + noise, "fashion_mnist", "tanh_cnn", 1.0,
                                           1e-5)
    assert best["label"] == "optimize.optax.learning_rate=2.0"
    # v2's spread (sd ~0.4 points) with a random offset: a free normal draw of 4 seeds had its
    # sd above 0.7 points ~2% of the time, where the check rightly cannot call it weaker
    weaker = baseline_check(0.8202 + rng.uniform(-1e-3, 1e-3)
                            + np.array([-4e-3, 4e-3, -2e-3, 2e-3]), best)
    assert weaker["status"] == "weaker" and weaker["best"] == pytest.approx(0.8315, abs=2e-3)
    # as good as the best: a mean at or above it (a free draw around the same mean is called
    # weaker ~2.5% of the time, as a 95% interval should; CI once drew one)
    level = np.mean(best["scores"]) + rng.uniform(0, 1e-3)
    assert baseline_check(level + np.array([-3e-4, 3e-4, -1e-4, 1e-4]), best)["status"] == "ok"
    assert baseline_check([0.826, 0.836, 0.831, 0.829], best)["status"] == "ok"
    assert baseline_check([0.82, 0.83], None)["status"] == "ok"


def test_the_baseline_check_compares_with_another_configuration_never_the_rows_own():
    """Board v3's vacuous check: the 'best recorded configuration' was the row's own (its
    selected seed 0 included). Now: the row's own configuration is excluded, seed 0 of every
    configuration is left out, and one configuration's seeds from two boards are not pooled."""
    from dpbench.board.results import config_key
    from dpbench.board.verdicts import best_recorded_baseline

    def runs(lr, tests, board):
        return [dict(r, _set=board) for r in _dpsgd_runs(lr, tests)]
    own = runs(2.0, [0.95, 0.84, 0.84, 0.84], "v3")  # the row: the best, seed 0 the highest
    other = runs(1.0, [0.99, 0.80, 0.81], "v3")  # its seed 0 would make it the best
    earlier = runs(1.0, [0.10, 0.97], "v2")  # one seed besides 0: not a candidate alone
    best = best_recorded_baseline(own + other + earlier, "fashion_mnist", "tanh_cnn", 1.0,
                                  1e-5, exclude=("v3", config_key(own[1])))
    assert best["label"] == "optimize.optax.learning_rate=1.0"
    assert sorted(best["scores"]) == [0.80, 0.81]  # seeds 1-2 of v3 only: no seed 0, no v2
    assert best_recorded_baseline(own, "fashion_mnist", "tanh_cnn", 1.0, 1e-5,
                                  exclude=("v3", config_key(own[1]))) is None


def _write_seed0_outcomes(group, outcomes: dict) -> None:
    """(method, trial) -> seed-0 test accuracy, or None for a diverged run."""
    from dpbench.search import tuning
    for (method, trial), accuracy in outcomes.items():
        run = group / tuning.run_dir_name(method, trial, 0)
        run.mkdir()
        if accuracy is None:
            (run / tuning.DIVERGED).write_text("{}")
        else:
            (run / "run_record.json").write_text(json.dumps({"test_accuracy": accuracy}))


def test_the_junk_rate_counts_diverged_and_far_below_random_trials_only(tmp_path):
    """Junk: a random trial (j >= 1, seed 0) more than 5 points below the group's best seed-0
    trial, or diverged; trial 0 and unpublished trials are not counted."""
    from dpbench.search import tuning
    from dpbench.search import junk as search_junk
    group = tmp_path / GROUP
    group.mkdir()
    (group / tuning.SEARCH_FILE).write_text(json.dumps(
        {"seeds": [0, 1], "num_trials": 4, "methods": {"dpsgd": {}, "rs": {}}}))
    outcomes = {("dpsgd", 0): 0.90, ("dpsgd", 1): 0.851, ("dpsgd", 2): 0.849,
                ("dpsgd", 3): None, ("rs", 0): 0.70, ("rs", 1): 0.86, ("rs", 3): 0.70}
    _write_seed0_outcomes(group, outcomes)  # rs trial 2: not published yet
    assert search_junk.junk_rate(group) == (3, 5)  # dpsgd t2 and t3, rs t3; not rs t0 (trial 0)


def test_the_junk_breakdown_names_each_methods_junk_and_measures_it_against_its_own_best(
        tmp_path):
    """Where junk lives: per method, its random trials > 5 points below the group's best (or
    diverged); and the count against each trial's own method's best seed-0 trial, which tells a
    weak method (all of whose trials sit far below the group) from a badly drawn space."""
    from dpbench.search import tuning
    from dpbench.search import junk as search_junk
    group = tmp_path / GROUP
    group.mkdir()
    (group / tuning.SEARCH_FILE).write_text(json.dumps(
        {"seeds": [0, 1], "num_trials": 3, "methods": {"dpsgd": {}, "bgep": {}, "rs": {}}}))
    rng = np.random.default_rng()
    top = rng.uniform(0.80, 0.90)
    outcomes = {("dpsgd", 0): top, ("dpsgd", 1): top - 0.01, ("dpsgd", 2): top - 0.06,
                ("bgep", 0): top - 0.07, ("bgep", 1): top - 0.08, ("bgep", 2): top - 0.065,
                ("rs", 0): top - 0.02, ("rs", 1): None}  # rs t2 not published yet
    _write_seed0_outcomes(group, outcomes)
    breakdown = search_junk.junk_breakdown(group)
    assert (breakdown["junk"], breakdown["random"]) == search_junk.junk_rate(group) == (4, 5)
    assert breakdown["by_method"] == {"dpsgd": 1, "bgep": 2, "rs": 1}
    # against its own method's best: dpsgd t2 (6 below its t0) and rs t1 (diverged) only;
    # bgep's trials sit within 5 points of bgep's best
    assert breakdown["own_best"] == 2


def _marks(ax) -> set:
    """What a plot draws that a reader must decode: each error bar's (marker, colour), a
    hollow diamond, a shaded band."""
    from matplotlib.collections import PolyCollection
    from matplotlib.colors import to_hex
    out = {("o", to_hex(c.lines[0].get_color())) for c in ax.containers}
    out |= {("D",) for line in ax.lines if line.get_marker() == "D"}
    out |= {("band",) for c in ax.collections if isinstance(c, PolyCollection)}
    return out


def _legend_marks(legend) -> set:
    from matplotlib.colors import to_hex
    from matplotlib.patches import Patch
    out = set()
    for handle in legend.legend_handles:
        if isinstance(handle, Patch):
            out.add(("band",))
        elif not hasattr(handle, "get_marker"):  # a group plot's error-bar lines
            continue
        elif handle.get_marker() == "D":
            out.add(("D",))
        else:
            out.add(("o", to_hex(handle.get_color())))
    return out


@pytest.mark.parametrize("status", ["ok", "weaker"])
def test_every_plot_has_a_legend_entry_for_every_mark_and_nothing_cut_or_covered(
        tmp_path, monkeypatch, status, records):
    """The forest plot (fresh random gains, labels and claims; the weaker-baseline title) and
    the group plots: every colour and mark drawn has a legend entry, the legend lies outside
    the axes (it covers no data), and the saved SVG is at least as large as everything drawn
    (its title, axis labels and legend: nothing cut)."""
    import re
    from dpbench.board import plots
    rng = np.random.default_rng()
    methods = {}
    for method in ("bgep", "dpssgd", "gep", "gip", "nasr", "randomk", "rs"):
        point = rng.uniform(-5, 2)
        label = str(rng.choice(["better", "worse", "equivalent", "inconclusive"]))
        methods[method] = dict(tuned=dict(point=point, low=point - 1, high=point + 1,
                                          label=label),
                               claim_range=(0.1, 3.0) if rng.random() < 0.5 else None,
                               paired_gains=dict(median=point / 100) if method != "nasr"
                               else None)
    analysis = dict(group="fashion_mnist__scatter_linear__eps1.0__delta1e-05",
                    methods=methods, baseline=dict(status=status))
    saved, save = [], plots.save_svg

    def keep(fig, path):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        renderer = FigureCanvasAgg(fig).get_renderer()
        ax = fig.axes[0]
        saved.append(dict(marks=_marks(ax), legend=_legend_marks(ax.get_legend()),
                          legend_box=ax.get_legend().get_window_extent(renderer),
                          axes_box=ax.get_window_extent(renderer),
                          drawn=fig.get_tightbbox(renderer), path=path,
                          title=ax.get_title()))
        save(fig, path)

    monkeypatch.setattr(plots, "save_svg", keep)
    plots.plot_forest(analysis, "ScatterNet + linear, Fashion-MNIST, ε 1", 0.999, tmp_path)
    table = board.summarize(board.load_records(records), {}, tmp_path)
    plots.plot_groups(table, tmp_path)
    plots.plot_expected_best(table, tmp_path)
    assert ("below its best recorded" in saved[0]["title"]) == (status == "weaker")
    assert saved[0]["marks"] <= saved[0]["legend"] and ("o", "#d62728") not in (
        saved[0]["legend"] - saved[0]["marks"])  # no entry for a colour not drawn
    for plot in saved:
        assert not plot["legend_box"].overlaps(plot["axes_box"]), plot["path"]
        head = plot["path"].read_text()[:2000]
        width, height = (float(re.search(rf'{k}="([\d.]+)pt"', head)[1]) for k in
                         ("width", "height"))
        assert width >= plot["drawn"].width * 0.99 and height >= plot["drawn"].height * 0.99, (
            plot["path"], width, height, plot["drawn"])


def test_a_searched_groups_table_shows_the_searchs_winner_on_a_validation_tie(
        tmp_path, monkeypatch):
    """Two trials tie on seed 0's validation accuracy: the search (ties to the smaller trial)
    retrains one of them, and the configuration table must show that one with its retrain
    seeds, not the other with seed 0 alone (board v3's first build showed ScatterNet eps 1's
    DP-SSGD t3 with 1 seed beside a verdict on t0's seeds 1-4)."""
    from dpbench.board import results
    rng = np.random.default_rng()
    tie = round(float(rng.uniform(0.80, 0.90)), 4)
    root = tmp_path / "records"
    lrs = {0: 1.0, 1: 2.0, 2: 3.0}
    vals = {0: tie - 0.01, 1: tie, 2: tie}
    for trial, lr in lrs.items():
        write(root, GROUP, f"dpsgd-t{trial}-seed0", fake_record("dpsgd", 0, vals[trial], 0.8,
                                                                 lr=lr))
    for seed in (1, 2):
        write(root, GROUP, f"dpsgd-t1-seed{seed}", fake_record("dpsgd", seed, tie, 0.8, lr=2.0))
    records = results.load_records(root)
    configs = {}
    for r in records:
        configs.setdefault(results.config_key(r), []).append(r)
    assert len(configs) == 3
    # the rule must not lean on the keys' order: make the tied loser the smaller key (a
    # tie-break on keys then picks the loser)
    monkeypatch.setattr(results, "config_key", lambda r, real=results.config_key: (
        "!" + real(r) if "-t2-" in str(r["_path"]) else real(r)))
    monkeypatch.setattr(results, "_search_of", lambda methods: {"dpsgd": {"winner": 1}})
    (row,) = results.summarize(results.load_records(root), {}, tmp_path)[GROUP]
    assert row["seeds"] == 3 and "dpsgd-t1-" in str(row["statement"])
    assert row["validation_mean"] == pytest.approx(tie)
    # a search whose winner is not even tied for best on the records: refused, not shown
    monkeypatch.setattr(results, "_search_of", lambda methods: {"dpsgd": {"winner": 0}})
    with pytest.raises(board.LeaderboardError, match="dpsgd-t0"):
        results.summarize(results.load_records(root), {}, tmp_path)


def _committed_page() -> str:
    from tests.conftest import REPO_ROOT
    return (REPO_ROOT / "leaderboard" / "README.md").read_text()


def _tables(page: str) -> dict:
    """The v3 page's verdict tables: setting heading -> (columns, rows of cells)."""
    out = {}
    tables = page.split("## Tables")[1].split("### How to read")[0]
    for part in tables.split("### ")[1:]:
        lines = [line for line in part.splitlines() if line.startswith("|")]
        split = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
        out[part.splitlines()[0]] = (split[0], split[2:])
    return out


def _ends(text: str) -> tuple:
    return tuple(float(x) for x in re.findall(r"[-+]\d+\.\d+", text)[:2])


def test_the_committed_page_prints_one_level_and_labels_that_agree_with_it():
    """Board v3's page, as committed (the test above holds that it is what the code renders):
    every interval of every verdict table (and of the answer) is at one stated level; each
    label is the one its interval shows (better: above 0; worse: below 0; equivalent: inside
    the ±1 margin), or it is marked ‡ with its interval at the Holm step that decided it,
    which shows it; each claim 'excluded' exactly where the interval lies below the claim, or
    ‡ with the bound at its step; the MDE is not inside the interval it goes with (it is read
    off the same draws); a sign test at its floor says so; no 'p ≤ 1'."""
    page = _committed_page()
    tables = _tables(page)
    assert len(tables) == 4
    levels = {c for columns, _ in tables.values() for c in columns if "simultaneous" in c}
    (level,) = levels
    assert f"its {level.split()[0]} simultaneous interval" in page.split("## What it")[0]
    for setting, (columns, rows) in tables.items():
        for cells in rows:
            row = dict(zip(columns, cells))
            low, high = _ends(row[level])
            label = row["label (Holm)"]
            shows = ("better" if low > 0 else "worse" if high < 0 else
                     "equivalent" if -1 < low and high < 1 else "inconclusive")
            if "‡" in label:
                step_low, step_high = _ends(label.split(":", 1)[1])
                step_shows = ("better" if step_low > 0 else "worse" if step_high < 0 else
                              "equivalent" if -1 < step_low and step_high < 1 else
                              "inconclusive")
                assert label.startswith(step_shows) and shows != step_shows, (setting, row)
            else:
                assert label == shows, (setting, row)
            claim = row["the claim (Holm)"]
            if claim != "-":
                claimed = float(re.search(r"≥ ([-+]\d+\.\d+)", claim)[1])
                excluded = claim.startswith("excluded")
                if "‡" in claim:
                    bound = float(re.search(r"gain ≤ ([-+]\d+\.\d+)", claim)[1])
                    assert excluded and bound < claimed <= high, (setting, row)
                else:
                    assert excluded == (high < claimed), (setting, row)
            assert "p ≤ 1 " not in row["adjusted p"] + " "
            point = float(row["gain, seeds 1-4"])
            mde = float(row["MDE (80% power, same level)"])
            assert mde > max(point - low, high - point) - 0.05, (setting, row)
            sign = row[next(c for c in columns if c.startswith("shared trials"))]
            if re.search(r"\((7-0|0-7), p", sign):
                assert "floor for 7" in sign, row


def test_the_committed_page_answers_first_in_words():
    """The answer leads (before what it rests on, the figures and the tables), in at most
    about 150 words of prose besides its table, with every setting's model in words; what it
    rests on names K, the recipe trial, the retrain seeds and the devices."""
    page = _committed_page()
    order = [page.index(h) for h in ("## The answer", "## What it rests on", "## Figures",
                                     "## Tables", "## Privacy")]
    assert order == sorted(order)
    answer = page.split("## The answer")[1].split("## What it rests on")[0]
    prose = " ".join(line for line in answer.splitlines() if not line.startswith("|"))
    assert len(prose.split()) <= 150, len(prose.split())
    assert "No method beats DP-SGD in any of the 4 settings" in prose
    assert "bgep and nasr are worse than DP-SGD in all 4" in prose
    for words in ("ScatterNet + linear, ε 1", "the tanh CNN, ε 3"):
        assert words in answer.splitlines()[[line.startswith("| method") for line in
                                              answer.splitlines()].index(True)]
    rests = page.split("## What it rests on")[1].split("##")[0]
    for fact in ("8 trials per method", "trial 0 the method's recipe", "seeds 1-4",
                 "Trained on: cpu and cuda"):
        assert fact in rests, fact


@pytest.mark.skipif(browser.CHROMIUM is None, reason="needs Debian's chromium "
                    "(tools/install.sh installs it with the test extras)")
def test_no_number_wraps_at_1400_px_in_chromium(tmp_path):
    """The committed board's index.html laid out by headless Chromium at 1,400 px: no number
    is broken across lines. The probe itself is checked on a page that does break one (a
    narrow cell that may break anywhere) and on the same number kept whole."""
    from tests.conftest import REPO_ROOT
    assert browser.wrapped_numbers(REPO_ROOT / "leaderboard" / "index.html") == []
    cell = "<td style='max-width:4em;overflow-wrap:{}'>sigma 1.9078144078144078e-07</td>"
    broken, whole = tmp_path / "broken.html", tmp_path / "whole.html"
    broken.write_text(f"<html><body><table><tr>{cell.format('anywhere')}</tr></table>"
                      "</body></html>")
    assert browser.wrapped_numbers(broken) == ["1.9078144078144078"]
    from dpbench.board import render
    whole.write_text(render.html_page("t", [("table", ["x"], [["sigma 1.9e-07 and 2.5e-07"]],
                                             {})]))
    assert browser.wrapped_numbers(whole, width=60) == []


def test_the_readme_says_what_the_board_finds():
    """The repository README's sentence on the board is the committed page's answer in words
    (a hand-written sentence, held to the generated one)."""
    from tests.conftest import REPO_ROOT
    answer = _committed_page().split("## The answer")[1].split("##")[0]
    readme = " ".join((REPO_ROOT / "README.md").read_text().split())
    assert "No method beats DP-SGD in any of the 4 settings." in answer
    assert "no method beats DP-SGD in any of the four settings" in readme
    assert "bgep and nasr are worse than DP-SGD in all 4." in answer
    assert "B-GEP and Nasr et al. are worse in all four" in readme
    assert "Every other comparison is inconclusive" in answer
    assert "every other comparison is inconclusive" in readme
