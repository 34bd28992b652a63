"""dpbench/board/v4.py: board v4's decisions as its registered analysis (leaderboard/v4/
analysis.json, chosen by the design study leaderboard/v4/study/) fixes them: the paired gain's
surface-adjusted t, 'better' / 'worse' and the claims above 0 in one Holm family, Welch for a
method of its own space, the ladder's slope in its own family with the edge rule, and the
descriptive tuned gain. Fresh random boards each run; every asserted label sits far from its
threshold, or is decided by an exactly-zero difference."""

import json

import numpy as np
import pytest

from dpbench.board import board_model as bm
from dpbench.board import v4
from tests.conftest import REPO_ROOT

ANALYSIS = json.loads((REPO_ROOT / "leaderboard" / "v4" / "analysis.json").read_text())
SPACE = bm.Space((0.1, 1.6), (0.02, 0.2), {"train.batch_size": [1024, 2048],
                                          "train.epochs": [30, 40],
                                          "train.ema_decay": [0.0, 0.99, 0.995]})


def arm(rng, quality, shift, points, parameters=26_010, noise=0.002, retrains=3):
    """K trials of mean accuracies ``quality`` (fractions) moved by ``shift``, seed noise
    ``noise``; the winner's retrains."""
    q = np.asarray(quality) + shift
    validation = list(q + rng.normal(0, noise, len(q)))
    test = list(np.round(q + rng.normal(0, noise, len(q)), 4))
    winner = int(np.argmax(validation))
    seeds = list(np.round(q[winner] + rng.normal(0, noise, retrains), 4))
    return v4.Arm(validation, test, winner, seeds, parameters, points)


def group(rng, gains, model="tanh_cnn", epsilon=3.0, k=33, claims=None, own=(),
          parameters=26_010, retrains=3, edge=False):
    """One group: DP-SGD on a smooth surface over SPACE and each method of ``gains`` (points;
    None: DP-SGD's own runs under another name, a difference of exactly zero)."""
    points = SPACE.draw(k, rng)
    if edge:
        points[:, 0] = 0.5
        points[int(np.argmax(points[:, 1])), 0] = 0.02  # DP-SGD's winner placed at the edge
    u, v = points[:, 0], points[:, 1]
    quality = 0.84 - 0.3 * (u - 0.5) ** 2 + 0.01 * v  # DP-SGD's best well inside lr x C
    if edge:
        quality = quality + 0.2 * (points[:, 0] < 0.1)
    name = f"fashion_mnist__{model}__eps{epsilon}__delta1e-05"
    base = arm(rng, quality, 0.0, points, parameters, retrains=retrains)
    return [v4.Cell(name, m, epsilon, model, base,
                    base if g is None else arm(rng, quality, g / 100, points, parameters,
                                               retrains=retrains),
                    m not in own, (claims or {}).get(m), SPACE) for m, g in gains.items()]


def test_clear_gains_get_their_labels_and_the_claims_theirs():
    rng = np.random.default_rng()
    cells = group(rng, {"up": 3.0, "same": None, "down": -3.0},
                  claims={"up": 1.0, "down": 0.5, "same": 0.0})
    out = v4.analyse(cells, ANALYSIS)
    rows = {m: out["cells"][(cells[0].group, m)] for m in ("up", "same", "down")}
    assert {m: r["paired"]["label"] for m, r in rows.items()} == {
        "up": "better", "same": "inconclusive", "down": "worse"}
    up = rows["up"]["paired"]
    assert up["low"] < up["point"] < up["high"] and 2.5 < up["point"] < 3.5
    assert up["claim"]["label"] == "consistent"  # +3 is no evidence against a +1 claim
    assert rows["down"]["paired"]["claim"]["label"] == "claim excluded"
    assert "claim" not in rows["same"]["paired"]  # 'at least 0' is 'worse': not tested twice
    assert out["families"]["main"] == 3 * 2 + 2
    assert rows["same"]["paired"]["mde"] > 0 and rows["same"]["sign"]["wins"] == 0
    assert rows["up"]["tuned"]["low"] < rows["up"]["tuned"]["point"] < rows["up"]["tuned"][
        "high"]


def test_a_method_of_its_own_space_is_judged_on_its_mean_by_welch():
    rng = np.random.default_rng()
    cells = group(rng, {"nasr": -2.0}, own=("nasr",))
    row = v4.analyse(cells, ANALYSIS)["cells"][(cells[0].group, "nasr")]
    base, mine = cells[0].base, cells[0].mine
    assert row["unpaired"] and row["sign"] is None and row["paired"]["label"] == "worse"
    want = 100 * (np.mean(mine.test[1:]) - np.mean(base.test[1:]))
    assert row["paired"]["point"] == pytest.approx(want, rel=1e-9)


def test_the_surface_adjustment_narrows_the_interval_where_the_surface_explains_the_gain():
    """A method whose gain moves with DP-SGD's smooth surface: the adjusted standard error is
    below the plain paired t's; a flat surface leaves them alike."""
    from dpbench.board.gains import TLaw
    rng = np.random.default_rng()
    cells = group(rng, {"m": 0.0})
    base, mine = cells[0].base, cells[0].mine
    a, b = 100 * np.array(base.test), 100 * np.array(mine.test)
    d = (b - a)[1:] + 3.0 * (a[1:] - a[1:].mean())  # the gain moves with DP-SGD's accuracy
    adjusted = TLaw.adjusted(d, a[1:], SPACE.features(base.coordinates[1:]), 0.04)
    assert adjusted.se < TLaw.paired(d).se and adjusted.df == len(d) - 1


def test_the_ladder_slope_grows_shrinks_or_is_not_judged_at_the_space_edge():
    rng = np.random.default_rng()
    cells = []
    for model, params, scale in (("tanh_cnn", 26_010, 0), ("tanh_cnn_x2", 101_162, 1),
                                 ("tanh_cnn_x4", 398_922, 2)):
        k, retrains = (33, 3) if model == "tanh_cnn" else (17, 0)
        cells += group(rng, {"grow": 2.0 * scale, "shrink": -2.0 * scale, "flat": None},
                       model=model, k=k, parameters=params, retrains=retrains)
    out = v4.analyse(cells, ANALYSIS)
    slopes = out["slopes"]
    assert slopes["grow"]["label"] == "grows" and 0.8 < slopes["grow"]["point"] < 1.2
    assert slopes["shrink"]["label"] == "shrinks" and slopes["flat"]["label"] == "no trend shown"
    assert [p for p, _ in slopes["grow"]["rungs"]] == [26_010, 101_162, 398_922]
    assert out["families"]["ladder"] == 6
    assert {g for g, _ in out["cells"]} == {cells[0].group}  # a rung's gains label nothing
    assert out["families"]["main"] == 3 * 2
    edged = [c for c in cells if c.model != "tanh_cnn_x2"] + group(
        rng, {"grow": 2.0, "shrink": -2.0, "flat": None}, model="tanh_cnn_x2", k=17,
        parameters=101_162, retrains=0, edge=True)
    label = v4.analyse(edged, ANALYSIS)["slopes"]["grow"]["label"]
    assert label.startswith("not judged") and "tanh_cnn_x2" in label


def test_the_same_records_give_the_same_decisions():
    rng = np.random.default_rng()
    cells = group(rng, {"up": 0.3, "down": -0.2})
    assert v4.analyse(cells, ANALYSIS) == v4.analyse(cells, ANALYSIS)


def _event():
    import dp_accounting
    from dpbench import accounting
    return accounting.event_to_json(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.0)), 500))


EVENT = _event()


def _write_group(records, group_name, k, rng, gain, device_of=lambda method: "cpu"):
    """search.json and the records of DP-SGD and 'up' (``gain`` points better)."""
    plan = dict(group=group_name, family="fashion_mnist__tanh_cnn", num_trials=k, delta=1e-5,
                seeds=[0, 1, 2, 3],
                family_spec=dict(space={"clip.global_l2.l2_bound": {"log_uniform": [0.1, 1]}},
                                 methods={"dpsgd": {}, "up": {}}),
                methods={m: dict(trials=[[f"clip.global_l2.l2_bound = {0.1 + t / 100}"]
                                         for t in range(k)]) for m in ("dpsgd", "up")})
    (records / group_name).mkdir(parents=True)
    (records / group_name / "search.json").write_text(json.dumps(plan))
    quality = rng.uniform(0.80, 0.85, k)
    for method, shift in (("dpsgd", 0.0), ("up", gain / 100)):
        a = arm(rng, quality, shift, None)
        runs = {(t, 0): (a.validation[t], a.test[t]) for t in range(k)}
        runs.update({(a.winner, s): (a.validation[a.winner], r)
                     for s, r in zip((1, 2, 3), a.retrains)})
        for (t, s), (val, test) in runs.items():
            path = records / group_name / f"{method}-t{t}-seed{s}" / "run_record.json"
            path.parent.mkdir(parents=True)
            path.write_text(json.dumps(dict(
                validation_accuracy=val, test_accuracy=test, seed=s, model_parameters=26_010,
                final_params_sha256=f"{method}{t}{s}", dp_event=EVENT,
                device_kind=device_of(method), versions={"jax": "0.11.2"})))


def test_dpbench_board_renders_a_registered_board_with_its_analysis_or_refuses(tmp_path,
                                                                              capsys):
    """End to end: an analysis committed, then the records; ``dpbench board`` writes the page
    (decisions first, then what they rest on, the registration's commit) from that analysis.
    The analysis changed after the records: refused, exit 2, naming the registration."""
    import importlib
    from tests.test_registration import _commit, _git
    build = importlib.import_module("dpbench.board.build")  # the package exports build()
    rng = np.random.default_rng()
    _git(tmp_path, "init", "-q")
    board_dir = tmp_path / "leaderboard" / "v4"
    board_dir.mkdir(parents=True)
    (board_dir / "analysis.json").write_text(json.dumps(ANALYSIS, indent=1))
    _commit(tmp_path, "register")
    _write_group(board_dir / "records", "fashion_mnist__tanh_cnn__eps3.0__delta1e-05", 9, rng,
                 6.0)
    _commit(tmp_path, "records")
    assert build.main([f"--records={board_dir / 'records'}"]) == 0, capsys.readouterr().err
    page = (board_dir / "README.md").read_text()
    decisions = page.split("## Decisions")[1].split("##")[0]
    assert "**up**" in decisions and "**better**" in decisions
    from dpbench.board import arms
    want = arms.published_epsilon([(str(i), EVENT) for i in range(12)], 1e-5)
    assert f"ε {want:.2f} for all it publishes" in decisions
    rests = page.split("## What they rest on")[1].split("##")[0]
    assert "Descriptive, outside both families" in rests and "JAX 0.11.2" in rests
    assert "Analysis registered in commit" in page and (board_dir / "plots" /
                                                        "v4-gains.svg").exists()
    changed = dict(ANALYSIS, family=dict(ANALYSIS["family"], alpha=0.1))  # after the data
    (board_dir / "analysis.json").write_text(json.dumps(changed, indent=1))
    assert build.main([f"--records={board_dir / 'records'}"]) == 2
    assert "differs from its registration" in capsys.readouterr().err


def test_a_group_whose_arms_trained_on_two_device_kinds_is_refused(tmp_path):
    rng = np.random.default_rng()
    name = "fashion_mnist__tanh_cnn__eps3.0__delta1e-05"
    _write_group(tmp_path, name, 5, rng, 1.0,
                 device_of=lambda m: "cpu" if m == "dpsgd" else "NVIDIA H100 80GB HBM3")
    plans = {name: json.loads((tmp_path / name / "search.json").read_text())}
    from dpbench.search import tuning
    with pytest.raises(tuning.SearchRecordError, match="one device kind per group"):
        v4.read_cells(tmp_path, plans, {}, "0.11.2")
    with pytest.raises(tuning.SearchRecordError, match="JAX 0.12"):
        v4.read_cells(tmp_path, plans, {}, "0.12")


def test_the_v4_protocols_are_the_registered_design():
    """leaderboard/v4's two protocols load, name the board's analysis and hold its design: K
    and R on the four present groups; the ladder's wider rungs at K, no retrains, the main
    board's tanh-CNN space at eps 3 on each; BandMF a main-board method only; every (batch,
    bands) of BandMF's support a valid cyclic Poisson sampler on Fashion-MNIST."""
    from dpbench import sampling
    from dpbench.search.protocol import load_protocol
    from dpbench.search.space import privacy_support
    main = load_protocol(REPO_ROOT / "leaderboard" / "v4" / "protocol.json")
    ladder = load_protocol(REPO_ROOT / "leaderboard" / "v4" / "ladder.json")
    design = ANALYSIS["design"]
    assert main["analysis"] == ladder["analysis"] == "analysis.json"
    assert (main["trials"]["fixed"], len(main["seeds"]) - 1) == (
        design["trials_per_method"], design["retrains"])
    assert sorted(main["epsilons"]) == [1.0, 3.0] and len(main["families"]) == 2
    spec = design["ladder"]
    assert (ladder["trials"]["fixed"], ladder["seeds"], ladder["epsilons"]) == (
        spec["trials"], [0], [spec["x1"]["epsilon"]])
    assert sorted(f.split("__")[1] for f in ladder["families"]) == sorted(
        r for r in spec["rungs"] if r != "tanh_cnn_x1")
    x1 = main["families"]["fashion_mnist__tanh_cnn"]["space"]
    for family in ladder["families"].values():
        assert family["space"]["clip.global_l2.l2_bound"] == x1["clip.global_l2.l2_bound"]
        assert family["space"]["train.batch_size"] == x1["train.batch_size"]
        assert list(family["methods"]) == design["ladder"]["methods"]
    ratios = [p / spec["rungs"]["tanh_cnn_x1"] for p in spec["rungs"].values()]
    assert len(ratios) >= 3 and max(ratios) >= 15
    for family, spec_main in main["families"].items():
        assert "bandmf" in spec_main["methods"], family
        for point in privacy_support(main, family, "bandmf"):
            bound = dict(b.split(" = ") for b in point)
            sampling.CyclicPoissonSampler(55_000, int(bound["train.batch_size"]), seed=0,
                                          parts=int(bound["BANDS"]))


def test_a_row_against_a_weak_baseline_says_so_in_the_row():
    """The baseline check on the v4 page: DP-SGD's row below the best DP-SGD configuration on
    an earlier board puts the caveat in the decision line and the table row; none without a
    better one."""
    from dpbench.board import v4_page
    from dpbench.board.verdicts import baseline_check
    rng = np.random.default_rng()
    cells = group(rng, {"up": 5.0})
    base = cells[0].base
    better = dict(scores=[float(np.mean(base.retrains)) + 0.10 + d for d in (0.001, -0.001)],
                  label="lr 2", where="archive/x/run_record.json", key=("v3", "k"))
    check = baseline_check(base.retrains, better)
    assert check["status"] == "weaker"
    out = v4.analyse(cells, ANALYSIS)
    eps = {(cells[0].group, "up"): 3.0}
    checks = {cells[0].group: check}
    answer = "\n".join(v4_page.answer_lines(out, eps, checks))
    table = "\n".join(v4_page.table_lines(out, cells, eps, checks))
    assert "against a DP-SGD row below its best on record" in answer
    assert "archive/x/run_record.json" in table.splitlines()[-1]
    fine = {cells[0].group: baseline_check(base.retrains, None)}
    assert "below its best" not in "\n".join(v4_page.answer_lines(out, eps, fine))


def test_the_page_on_a_simulated_board_separates_decisions_from_descriptions(tmp_path):
    """study_example renders the real page code on one simulated board: decisions first (each
    label one the analysis defines), what they rest on, and the descriptive columns marked."""
    from dpbench.board import study_example
    page = study_example.render(tmp_path, seed=3).read_text()
    assert page.index("## Decisions") < page.index("## What they rest on") < page.index(
        "## Tables")
    assert page.startswith("# Board v4") and "A simulated board, not a result" in page
    decisions = page.split("## Decisions")[1].split("##")[0]
    labels = {"better", "worse", "inconclusive", "grows", "shrinks", "no trend shown"}
    for line in decisions.strip().splitlines():
        label = line.split(": **")[1].split("**")[0]
        assert label in labels or label.startswith("not judged"), line
    assert "tuned gain (descriptive)" in page and "sign test (descriptive)" in page
