"""dpbench/board/v4.py: board v4's labels as its registered analysis fixes them: the tuned and
paired gains, Holm over the whole board, labels settled by the Monte Carlo rule, the papers'
claims, and the dimension ladder's slope. Fresh random boards each run; every label asserted
sits far from its threshold (or is the boundary case, which must not be decided wrongly)."""

import numpy as np
import pytest

from dpbench.board import v4

ANALYSIS = dict(margin_points=1.0, family=dict(correction="holm", alpha=0.05),
                mde=dict(power=0.8),
                monte_carlo=dict(schedule=[2000, 8000, 32000], flip_probability=1e-6))


def arm(rng, quality, shift, parameters=None, noise=0.001):
    """K trials of qualities ``quality`` (fractions) moved by ``shift``; the winner's 4
    retrains around its quality."""
    q = np.asarray(quality) + shift
    validation = list(q + rng.normal(0, noise, len(q)))
    test = list(q + rng.normal(0, noise, len(q)))
    winner = int(np.argmax(validation))
    retrains = list(q[winner] + rng.normal(0, 0.0005, 4))
    return v4.Arm(validation, test, winner, retrains, parameters)


def board(rng, gains, model="tanh_cnn", parameters=None, claims=None, group=None, k=16):
    """A group of K trials: DP-SGD and each method of ``gains`` (points; None: DP-SGD's own
    runs under another name, a gain of exactly zero)."""
    quality = rng.uniform(0.70, 0.85, k)
    group = group or f"fashion_mnist__{model}__eps3.0__delta1e-05"
    base = arm(rng, quality, 0.0, parameters)
    return [v4.Cell(group, m, 3.0, model, base,
                    base if g is None else arm(rng, quality, g / 100, parameters), True,
                    (claims or {}).get(m)) for m, g in gains.items()]


def test_clear_gains_get_their_labels_and_the_claims_theirs():
    rng = np.random.default_rng()
    cells = board(rng, {"up": 5.0, "same": None, "down": -5.0},
                  claims={"up": 2.0, "down": 1.0})
    out = v4.analyse(cells, ANALYSIS, seed=int(rng.integers(1 << 30)))
    group = cells[0].group
    labels = {m: out["cells"][(group, m)]["tuned"]["label"] for m in ("up", "same", "down")}
    assert labels == {"up": "better", "same": "equivalent", "down": "worse"}
    assert {m: out["cells"][(group, m)]["paired"]["label"] for m in labels} == labels
    up = out["cells"][(group, "up")]["tuned"]
    assert up["low"] < up["point"] < up["high"] and 4 < up["point"] < 6
    assert up["claim"]["label"] == "consistent"  # +5 is no evidence against a +2 claim
    assert out["cells"][(group, "down")]["tuned"]["claim"]["label"] == "claim excluded"
    assert out["comparisons"] == 3 * 2 * 3 + 2
    same = out["cells"][(group, "same")]["tuned"]
    assert 0 < same["mde"] < 1 and same["level"] <= 0.05


def test_a_decided_label_does_not_depend_on_the_stream_that_computed_it():
    """Noisy retrains (a gain near no threshold in particular, whatever the draw): on three
    streams every label that is decided is the same one (decide.py: a label differs from the
    infinite-draw one with probability <= 1e-6 per stream, so this fails with probability
    <= 3e-6); 'undecided' is the only other answer."""
    rng = np.random.default_rng()
    cells = board(rng, {"edge": float(rng.uniform(-1.5, 1.5))})
    noisy = cells[0].mine._replace(retrains=list(np.array(cells[0].mine.retrains)
                                                 + rng.normal(0, 0.01, 4)))
    cells = [cells[0]._replace(mine=noisy)]
    labels = set()
    for seed in rng.integers(1 << 30, size=3):
        out = v4.analyse(cells, ANALYSIS, seed=int(seed))
        labels.add(out["cells"][(cells[0].group, "edge")]["tuned"]["label"])
    assert len({label for label in labels if not label.startswith("undecided")}) <= 1, labels


def test_the_ladder_slope_says_grows_only_when_the_gain_grows_with_the_parameters():
    rng = np.random.default_rng()
    cells = []
    for rung, (params, model) in enumerate([(26_000, "tanh_cnn_x1"), (100_000, "tanh_cnn_x2"),
                                             (400_000, "tanh_cnn_x4")]):
        cells += board(rng, {"grow": 2.0 * rung, "flat": -0.5 + 0.5 * (rung % 2)},
                       model=model, parameters=params)
    out = v4.analyse(cells, ANALYSIS, seed=int(rng.integers(1 << 30)))
    grow, flat = out["slopes"]["grow"], out["slopes"]["flat"]
    assert grow["label"] == "grows" and 0.8 < grow["point"] < 1.2  # 2 points per 4x = 1/doubling
    assert flat["label"] != "grows"
    assert [p for p, _ in grow["rungs"]] == [26_000, 100_000, 400_000]


def test_an_unpaired_method_has_no_paired_gain():
    rng = np.random.default_rng()
    cells = board(rng, {"nasr": 1.0})
    cells = [cells[0]._replace(paired=False)]
    out = v4.analyse(cells, ANALYSIS, seed=1)
    row = out["cells"][(cells[0].group, "nasr")]
    assert row["unpaired"] and "paired" not in row and "tuned" in row


def test_the_same_records_give_the_same_bytes():
    rng = np.random.default_rng()
    cells = board(rng, {"up": 1.5})
    a, b = v4.analyse(cells, ANALYSIS, seed=7), v4.analyse(cells, ANALYSIS, seed=7)
    assert a == b


def _event():
    import dp_accounting
    from dpbench import accounting
    return accounting.event_to_json(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.0)), 500))


EVENT = _event()


def _write_group(records, group, k, rng, gain):
    """search.json and the records of DP-SGD and 'up' (``gain`` points better) in ``group``."""
    import json
    plan = dict(group=group, family="fashion_mnist__tanh_cnn", num_trials=k, delta=1e-5,
                seeds=[0, 1, 2, 3, 4],
                family_spec=dict(space={"clip.global_l2.l2_bound": {"log_uniform": [0.1, 1]}},
                                 methods={"dpsgd": {}, "up": {}}),
                methods={m: dict(trials=[[f"clip.global_l2.l2_bound = {0.1 + t / 100}"]
                                         for t in range(k)]) for m in ("dpsgd", "up")})
    (records / group).mkdir(parents=True)
    (records / group / "search.json").write_text(json.dumps(plan))
    quality = rng.uniform(0.70, 0.85, k)
    for method, shift in (("dpsgd", 0.0), ("up", gain / 100)):
        a = arm(rng, quality, shift)
        runs = {(t, 0): (a.validation[t], a.test[t]) for t in range(k)}
        runs.update({(a.winner, s): (a.validation[a.winner], r)
                     for s, r in zip((1, 2, 3, 4), a.retrains)})
        for (t, s), (val, test) in runs.items():
            path = records / group / f"{method}-t{t}-seed{s}" / "run_record.json"
            path.parent.mkdir(parents=True)
            path.write_text(json.dumps(dict(validation_accuracy=val, test_accuracy=test,
                                            seed=s, model_parameters=26_000,
                                            final_params_sha256=f"{method}{t}{s}",
                                            dp_event=EVENT)))


def test_dpbench_board_renders_a_registered_board_with_its_analysis_or_refuses(tmp_path,
                                                                              capsys):
    """End to end: an analysis committed, then the records; ``dpbench board`` writes the page
    (answer first, the registration's commit) from that analysis. The analysis changed after
    the records: refused, exit 2, naming the registration."""
    import importlib
    import json
    from tests.conftest import REPO_ROOT
    from tests.test_registration import _commit, _git
    build = importlib.import_module("dpbench.board.build")  # the package exports build()
    rng = np.random.default_rng()
    _git(tmp_path, "init", "-q")
    board_dir = tmp_path / "leaderboard" / "v4"
    board_dir.mkdir(parents=True)
    analysis = json.loads((REPO_ROOT / "leaderboard" / "v4" / "analysis.json").read_text())
    analysis["monte_carlo"]["schedule"] = [2000, 8000]
    (board_dir / "analysis.json").write_text(json.dumps(analysis, indent=1))
    _commit(tmp_path, "register")
    _write_group(board_dir / "records", "fashion_mnist__tanh_cnn__eps3.0__delta1e-05", 8, rng,
                 6.0)
    _commit(tmp_path, "records")
    assert build.main([f"--records={board_dir / 'records'}"]) == 0, capsys.readouterr().err
    page = (board_dir / "README.md").read_text()
    answer = page.split("## The answer")[1].split("##")[0]
    assert "**up**" in answer and "tuned gain better" in answer
    # one tuning-inclusive epsilon per row: the 8 trials and 4 retrains (each a distinct run)
    from dpbench.board import paired
    want = paired.published_epsilon([(str(i), EVENT) for i in range(12)], 1e-5)
    assert f"ε {want:.2f} for all it publishes, tuning included" in answer
    assert "Analysis registered in commit" in page and (board_dir / "plots" /
                                                        "v4-gains.svg").exists()
    analysis["margin_points"] = 2.0  # chosen after the data
    (board_dir / "analysis.json").write_text(json.dumps(analysis, indent=1))
    assert build.main([f"--records={board_dir / 'records'}"]) == 2
    assert "differs from its registration" in capsys.readouterr().err


def test_the_v4_protocols_are_the_registered_design():
    """leaderboard/v4's two protocols load, name the board's analysis, and hold the design it
    registered: K 32 and 8 retrains on the four present groups; K 16 and 4 retrains on every
    ladder rung, each rung a model v4.ladders reads as one, the widest >= 8x the parameters of
    the narrowest, every rung searched in the same space."""
    import jax
    import jax.numpy as jnp
    from dpbench.models import registry
    from dpbench.search.protocol import load_protocol
    from tests.conftest import REPO_ROOT
    main = load_protocol(REPO_ROOT / "leaderboard" / "v4" / "protocol.json")
    ladder = load_protocol(REPO_ROOT / "leaderboard" / "v4" / "ladder.json")
    assert main["analysis"] == ladder["analysis"] == "analysis.json"
    assert (main["trials"]["fixed"], len(main["seeds"]) - 1) == (32, 8)
    assert sorted(main["epsilons"]) == [1.0, 3.0] and len(main["families"]) == 2
    assert (ladder["trials"]["fixed"], len(ladder["seeds"]) - 1, ladder["epsilons"]) == (
        16, 4, [3.0])
    counts = {}
    for family, spec in ladder["families"].items():
        model = family.split("__")[1]
        assert v4.LADDER_RUNG.fullmatch(model), family
        shape = jax.eval_shape(registry.make_model(10, model).init, jax.random.key(0),
                               jnp.zeros((1, 28, 28, 1)))
        counts[model] = sum(x.size for x in jax.tree.leaves(shape))
    assert max(counts.values()) >= 8 * min(counts.values()), counts
    spaces = [spec["space"] for spec in ladder["families"].values()]
    assert all(space == spaces[0] for space in spaces)
    # BandMF is a v4 method of the main board; every (batch, bands) it can draw is a cyclic
    # Poisson sampler over Fashion-MNIST's 55,000 private examples (a part's rate <= 1)
    from dpbench import sampling
    from dpbench.search.space import privacy_support
    for family, spec in main["families"].items():
        assert "bandmf" in spec["methods"], family
        for point in privacy_support(main, family, "bandmf"):
            bound = dict(b.split(" = ") for b in point)
            sampling.CyclicPoissonSampler(55_000, int(bound["train.batch_size"]), seed=0,
                                          parts=int(bound["BANDS"]))
    assert all("bandmf" not in spec["methods"] for spec in ladder["families"].values())


def test_a_row_against_a_weak_baseline_says_so_in_the_row(tmp_path):
    """The baseline check on the v4 page: DP-SGD's row below the best DP-SGD configuration on
    an earlier board (2+ retrain seeds, 10 points better) puts the caveat in the answer line
    and the table row of every method of that group; none without a better one."""
    from dpbench.board import v4_page
    rng = np.random.default_rng()
    cells = board(rng, {"up": 5.0})
    base = cells[0].base
    from dpbench.board.verdicts import baseline_check
    better = dict(scores=[float(np.mean(base.retrains)) + 0.10 + d for d in (0.001, -0.001)],
                  label="lr 2", where="archive/x/run_record.json", key=("v3", "k"))
    check = baseline_check(base.retrains, better)
    assert check["status"] == "weaker"
    out = v4.analyse(cells, ANALYSIS, seed=1)
    eps = {(cells[0].group, "up"): 3.0}
    checks = {cells[0].group: check}
    answer = "\n".join(v4_page.answer_lines(out, eps, checks))
    table = "\n".join(v4_page.table_lines(out, cells, eps, checks))
    assert "against a DP-SGD row below its best on record" in answer
    assert "archive/x/run_record.json" in table.splitlines()[-1]
    fine = {cells[0].group: baseline_check(base.retrains, None)}
    assert "below its best" not in "\n".join(v4_page.answer_lines(out, eps, fine))
