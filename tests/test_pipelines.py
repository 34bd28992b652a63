"""Every committed pipeline parses, validates, and trains end to end on a small real dataset."""

import dataclasses
import fcntl
import json
import os
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest

from dp_accounting import dp_event
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from dpbench import config, numerics, records
from dpbench.search import methods
from dpbench import run as run_lib
from dpbench.run import build as run_build
from tests.conftest import REPO_ROOT

PIPELINES = sorted(methods.discover())  # every method folder under pipelines/


def test_there_are_pipelines():
    assert "dpsgd" in PIPELINES


GOLDEN = REPO_ROOT / "tests" / "golden_pipelines.json"
GOLDEN_PACKAGES = ("jax", "jaxlib", "numpy", "flax", "optax", "dp-accounting", "scipy")
# Tolerances of the golden check across x86-64 hosts (WORKSPACE.md "The golden check"), from a
# measurement between one machine's numerics and a simulated other host (tools/
# run_golden_other_host.sh): sigma and epsilon moved by <= 1e-11 relative, the parameters by
# <= 3.7e-7 (fingerprint distance; GEP, the largest); the smallest real change tested (clip bound
# or learning rate +1%) moves them by 1.3e-2.
ACCOUNTING_RTOL = 1e-9
PARAMS_TOL = 1e-5


def _versions() -> dict:
    """The versions of the packages that compute (not Python's: no bit depends on it)."""
    return {k: v for k, v in numerics.versions(GOLDEN_PACKAGES).items() if k != "python"}


def golden_mismatches(key: str, record: dict, golden: dict) -> list:
    """What in ``record`` differs from the golden run ``key`` beyond the cross-host tolerances,
    plus the exact hash where this host's numerics are one that wrote a hash for it."""
    want, out = golden["runs"][key], []
    if record["steps"] != want["steps"]:
        out.append(f"steps {record['steps']} != {want['steps']}")
    for name in ("noise_multiplier", "epsilon"):
        if not record[name] == pytest.approx(want[name], rel=ACCOUNTING_RTOL, abs=0):
            out.append(f"{name} {record[name]!r} != {want[name]!r} (rel {ACCOUNTING_RTOL})")
    distance = numerics.fingerprint_distance(record["final_params_fingerprint"],
                                             want["params_fingerprint"])
    if not distance <= PARAMS_TOL:
        out.append(f"params: fingerprint distance {distance:.3g} > {PARAMS_TOL}")
    exact = golden["exact"].get(numerics.numerics_digest(record["host_numerics"]))
    if exact is not None and key in exact["final_params_sha256"]:
        if record["final_params_sha256"] != exact["final_params_sha256"][key]:
            out.append("params: final_params_sha256 differs from the one this host's numerics "
                       "wrote")
    return out


def test_golden_mismatches_applies_each_tolerance_and_the_hash_only_on_its_own_host():
    """Both directions, on a synthetic golden run: within tolerance passes, just outside fails;
    the exact hash counts only where the host's numerics wrote it."""
    params = {"w": np.random.default_rng(np.random.randint(1 << 30)).standard_normal((50, 7))}
    host = {"cpu": {"vendor": "x"}, "env": {}}
    want = dict(steps=20, noise_multiplier=1.1, epsilon=3.0,
                params_fingerprint=numerics.params_fingerprint(params))
    golden = {"runs": {"k": want}, "exact": {numerics.numerics_digest(host): {
        "host_numerics": host, "final_params_sha256": {"k": "abc"}}}}
    record = dict(steps=20, noise_multiplier=1.1 * (1 + 1e-10), epsilon=3.0 * (1 - 1e-10),
                  final_params_fingerprint=numerics.params_fingerprint(
                      {"w": params["w"] * (1 + 1e-6)}),
                  host_numerics=host, final_params_sha256="abc")
    assert golden_mismatches("k", record, golden) == []
    assert golden_mismatches("k", dict(record, final_params_sha256="abd"), golden) == [
        "params: final_params_sha256 differs from the one this host's numerics wrote"]
    other_host = dict(record, host_numerics={"cpu": {"vendor": "y"}, "env": {}})
    assert golden_mismatches("k", dict(other_host, final_params_sha256="abd"), golden) == []
    for name, value in [("noise_multiplier", 1.1 * (1 + 1e-8)), ("epsilon", 3.0 * (1 + 1e-8)),
                        ("steps", 21), ("final_params_fingerprint", numerics.params_fingerprint(
                            {"w": params["w"] * (1 + 1e-4)}))]:
        assert len(golden_mismatches("k", dict(other_host, **{name: value}), golden)) == 1


def _write_golden(key: str, record: dict, mode: str) -> None:
    """DPBENCH_WRITE_GOLDEN=1 rewrites run ``key`` (a change meant to alter the numbers: every
    other host's hash of it is dropped); =host adds this host's exact hash to a run that
    already passes within tolerance. Locked: pytest-xdist workers write the file together."""
    with open(Path(tempfile.gettempdir()) / "dpbench_golden.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"runs": {}, "exact": {}}
        numerics_now = record["host_numerics"]
        if mode == "host":
            mismatches = golden_mismatches(key, record, golden)
            assert not mismatches, f"{key}: {mismatches}"
        else:
            golden["versions"] = _versions()
            golden["runs"][key] = {k: record[k] for k in ("steps", "noise_multiplier", "epsilon")}
            golden["runs"][key]["params_fingerprint"] = record["final_params_fingerprint"]
            for host in golden["exact"].values():
                host["final_params_sha256"].pop(key, None)
        host = golden["exact"].setdefault(numerics.numerics_digest(numerics_now), {
            "host_numerics": numerics_now, "final_params_sha256": {}})
        host["final_params_sha256"][key] = record["final_params_sha256"]
        golden["exact"] = {k: v for k, v in golden["exact"].items() if v["final_params_sha256"]}
        records.atomic_write_text(GOLDEN, json.dumps(golden, indent=1, sort_keys=True) + "\n")


def check_golden(key: str, record: dict) -> None:
    """The run computes what main computed when the golden file was written: sigma, epsilon
    and the step count within ACCOUNTING_RTOL, the trained parameters within PARAMS_TOL on any
    host, and bit for bit on a host whose numerics wrote a hash. Rewrite it only for a change
    meant to alter the numbers (DPBENCH_WRITE_GOLDEN=1, see _write_golden)."""
    mode = os.environ.get("DPBENCH_WRITE_GOLDEN")
    if mode:
        _write_golden(key, record, mode)
        return
    golden = json.loads(GOLDEN.read_text())
    assert _versions() == golden["versions"], (
        "the numerical stack differs from the golden file's; install with tools/install.sh "
        "(which pins tools/constraints.txt)")
    if os.environ.get("DPBENCH_GOLDEN_OTHER_HOST"):  # CI's simulated host: tolerances only
        assert numerics.numerics_digest(record["host_numerics"]) not in golden["exact"], (
            "DPBENCH_GOLDEN_OTHER_HOST is set but this host's numerics wrote the hashes")
    mismatches = golden_mismatches(key, record, golden)
    assert not mismatches, f"{key}: {mismatches}"


def rebuild_epsilon(statement: dict) -> float:
    """Epsilon from the statement's machine-readable fields alone, with dp_accounting's own
    constructors (not dpbench's event builder): one PLD per mechanism, composed."""
    assert statement["accountant"] == "pld"
    vdi = statement["accountant_settings"]["value_discretization_interval"]
    mechanisms = statement["mechanisms"]
    if all(m["kind"] == "gaussian" for m in mechanisms):
        accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=vdi)
        for m in mechanisms:
            event = (dp_event.TruncatedSubsampledGaussianDpEvent(
                m["dataset_size"], m["sampling_probability"], m["truncated_batch_size"],
                m["effective_noise_multiplier"]) if m["truncated_batch_size"] is not None else
                dp_event.PoissonSampledDpEvent(m["sampling_probability"], dp_event.GaussianDpEvent(
                    m["effective_noise_multiplier"])))
            accountant.compose(event, m["count"])
        return accountant.get_epsilon(statement["delta"])
    total = None
    for m in mechanisms:
        if m["kind"] == "pure":  # T pure releases by basic composition: one pure event
            pld = pld_lib.from_privacy_parameters(pld_common.DifferentialPrivacyParameters(
                m["epsilon_total"], 0.0), value_discretization_interval=vdi)
        else:
            assert m["truncated_batch_size"] is not None
            pld = pld_lib.from_truncated_subsampled_gaussian_mechanism(
                dataset_size=m["dataset_size"], sampling_probability=m["sampling_probability"],
                truncated_batch_size=m["truncated_batch_size"],
                noise_multiplier=m["effective_noise_multiplier"],
                value_discretization_interval=vdi).self_compose(m["count"])
        total = pld if total is None else total.compose(pld)
    return total.get_epsilon_for_delta(statement["delta"])


def check_statement(record: dict) -> None:
    """The statement's epsilon is rebuilt from its own fields, and its text names every
    mechanism of the ledger and everything it does not cover."""
    statement = record["privacy_statement"]
    assert rebuild_epsilon(statement) == pytest.approx(record["epsilon"], rel=1e-6)
    assert statement["epsilon"] == record["epsilon"]
    text = statement["statement"]
    for m in statement["mechanisms"]:
        assert m["name"] in text and m["source"] in text
        if m["kind"] == "gaussian":
            assert f"{m['noise_multiplier']:.6g}" in text
    # the sentence people read carries the record's own numbers: (epsilon, delta), N, the
    # step count, each Gaussian's rate q = B / N (from the run's settings, not the statement;
    # B parts / N within a part of cyclic Poisson sampling over that many parts)
    assert f"({record['epsilon']:.6g}, {record['delta']:g})-DP" in text
    assert f"for the {record['dataset_size']} private training examples" in text
    assert f" {record['steps']} training steps in all." in text
    for m in statement["mechanisms"]:
        if m["kind"] == "gaussian" and m.get("sampling_probability") is not None:
            parts = record["sampling"].get("parts", 1)
            assert parts == m.get("sampler_parts", 1)
            assert m["sampling_probability"] == pytest.approx(
                record["batch_size"] * parts / record["dataset_size"], rel=1e-12)
            assert f"rate q = {m['sampling_probability']:.6g}" in text
    covered = [item["what"] for item in statement["not_covered"]]
    for what in covered:
        assert what in text
    assert any("validation split" in w for w in covered)
    assert any("hyperparameter tuning" in w for w in covered)
    assert any("diagnostics" in w for w in covered)
    assert any("public split" in w for w in covered) == (record["public_size"] > 0)


DIGITS_BINDINGS = ("train.epochs = 2", "train.log_every_steps = 5", "dataset.public_size = 64",
                   "gep.embed_and_clip.num_anchors = 64", "gep.embed_and_clip.num_basis = 48")


def golden_run(key: str) -> tuple:
    """(gin files, bindings) of golden run ``key``: a method's name, or
    'dpssgd+<prune>' (tools/golden_drift.py trains the same runs)."""
    pipeline, _, prune = key.partition("+")
    files = [f"pipelines/{pipeline}/pipeline.gin", "gin/data/digits.gin"]
    if not prune:
        return files, list(DIGITS_BINDINGS)
    return files, ["train.epochs = 2", f"PRUNE = @prune.{prune}()", "prune.synflow.iterations = 10"]


GOLDEN_KEYS = PIPELINES + ["dpssgd+synflow", "dpssgd+dp_snip"]


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_pipeline_trains_on_digits(pipeline, tmp_path):
    files, bindings = golden_run(pipeline)
    config.parse_config(files, bindings)
    record = run_lib.train(tmp_path / "run", gin_files=files)
    assert record["pipeline"] == Path(pipeline).stem
    assert record["epsilon"] <= record["target_epsilon"]
    assert record["test_accuracy"] > 0.2
    check_statement(record)
    check_golden(pipeline, record)


def _new_noise_key(monkeypatch):
    """The same run with another noise key (the parameters' key and the sampler's unchanged)."""
    build = run_build.build_run  # run.start builds the run
    monkeypatch.setattr(run_build, "build_run", lambda *a, **k: dataclasses.replace(
        build(*a, **k), run_key=jax.random.key(20261125)))


# Each a real change to what dpsgd computes on digits; its golden check must fail.
REAL_CHANGES = {
    "clip bound +1%": ["clip.global_l2.l2_bound = 0.101"],
    "learning rate +1%": ["optimize.optax.learning_rate = 4.04"],
    "one extra step": ["train.epochs = 2.1"],  # 20 -> 21 steps on digits,
    "another noise key": _new_noise_key,
}


@pytest.mark.skipif(bool(os.environ.get("DPBENCH_WRITE_GOLDEN")), reason="writing the file")
@pytest.mark.parametrize("change", REAL_CHANGES)
def test_the_golden_check_fails_on_a_real_change(change, tmp_path, monkeypatch):
    """The cross-host tolerances still catch a 1% change of a setting, one more step and
    another noise key, each in the trained parameters themselves (test_pipeline_trains_on_digits
    [dpsgd] is the other direction: the unchanged run passes)."""
    files = ["pipelines/dpsgd/pipeline.gin", "gin/data/digits.gin"]
    bindings = list(DIGITS_BINDINGS)
    if callable(REAL_CHANGES[change]):
        REAL_CHANGES[change](monkeypatch)
    else:
        bindings += REAL_CHANGES[change]
    config.parse_config(files, bindings)
    record = run_lib.train(tmp_path / "run", gin_files=files)
    golden = json.loads(GOLDEN.read_text())
    mismatches = golden_mismatches("dpsgd", record, golden)
    assert any(m.startswith("params: fingerprint distance") for m in mismatches), mismatches
    if change == "one extra step":
        assert record["steps"] == golden["runs"]["dpsgd"]["steps"] + 1
        assert any(m.startswith("steps") for m in mismatches)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_pipeline_trains_on_scatter_linear(pipeline, tmp_path):
    """Every pipeline on the second model family: ScatterNet features + linear (digits)."""
    files = [f"pipelines/{pipeline}", "gin/data/digits.gin", "gin/model/scatter_linear.gin"]
    config.parse_config(files, DIGITS_BINDINGS)
    record = run_lib.train(tmp_path / "run", gin_files=files)
    assert record["model"] == "scatter_linear" and record["features"]["kind"] == "scattering"
    assert record["epsilon"] <= record["target_epsilon"]
    assert record["test_accuracy"] > 0.2
    check_statement(record)
    inputs = [item["what"] for item in record["privacy_statement"]["inputs"]]
    assert any("scattering features" in w for w in inputs)
    assert any("GroupNorm over each example's own" in w for w in inputs)
    for what in inputs:
        assert what in record["privacy_statement"]["statement"]


def test_the_scatter_linear_recipe_binds_its_model_features_and_settings():
    import gin
    from dpbench import models
    config.parse_config(["gin/recipes/dpsgd_scatter_linear.gin"], [])
    assert models.ModelConfig().name == "scatter_linear"
    assert gin.query_parameter("dataset.features") == "scattering"
    assert config.TrainConfig().batch_size == 16384
    assert gin.query_parameter("pipeline.name") == "dpsgd"


def test_scatter_cnn_trains_and_a_scatter_model_refuses_pixels(tmp_path):
    files = ["pipelines/dpsgd/pipeline.gin", "gin/data/digits.gin", "gin/model/scatter_cnn.gin"]
    config.parse_config(files, ["train.epochs = 2"])
    record = run_lib.train(tmp_path / "run", gin_files=files)
    assert record["model"] == "scatter_cnn" and record["test_accuracy"] > 0.2
    assert record["per_example_strategy"] == "bookkeeping"  # GroupNorm without parameters
    config.parse_config(files, ["train.epochs = 2", "dataset.features = 'pixels'"])
    with pytest.raises(ValueError, match="bind dataset.features = 'scattering'"):
        run_lib.train(tmp_path / "pixels", gin_files=files)
    assert not (tmp_path / "pixels" / records.RECORD_NAME).exists()


@pytest.mark.parametrize("prune", ["synflow", "dp_snip"])
def test_dpssgd_prune_variants_by_binding(prune, tmp_path):
    files, bindings = golden_run(f"dpssgd+{prune}")
    config.parse_config(files, bindings)
    record = run_lib.train(tmp_path / "run", gin_files=files)
    assert record["stages"][1]["name"] == f"prune.{prune}"
    check_statement(record)
    check_golden(f"dpssgd+{prune}", record)
    once = [m["source"] for m in record["privacy_statement"]["mechanisms"]
            if m["schedule"] == "once before training"]
    assert once == (["prune.dp_snip"] if prune == "dp_snip" else [])
    assert record["target_epsilon"] - 1e-3 < record["epsilon"] <= record["target_epsilon"]


def test_a_refit_without_validation_reports_its_last_step_and_says_so(tmp_path):
    """dataset.validation_size = 0 (retraining a configuration chosen on validation on every
    training example): the last step's model is reported, every example is private and
    counted in N, the statement names the choice of settings as not covered, and the board
    refuses to rank the run (it chooses on validation)."""
    import gin
    from dpbench import board
    files = ["pipelines/dpsgd/pipeline.gin", "gin/data/digits.gin"]
    config.parse_config(files, ["train.epochs = 2", "dataset.validation_size = 0"])
    record = run_lib.train(tmp_path / "run", gin_files=files)
    config.parse_config(files, ["train.epochs = 2"])
    held_out = gin.query_parameter("dataset.validation_size")
    assert record["validation_accuracy"] is None and record["validation_size"] == 0
    assert record["best_step"] == record["steps"] and record["test_accuracy"] > 0.2
    assert record["dataset_size"] == record["privacy_statement"]["mechanisms"][0][
        "dataset_size"] > held_out
    text = record["privacy_statement"]["statement"]
    assert "dataset.validation_size = 0" in text and "hyperparameter tuning" in text
    assert "the validation split (" not in text
    group = tmp_path / "records" / "digits__mlp__eps3.0__delta0.0001" / "refit"
    group.mkdir(parents=True)
    (group / "run_record.json").write_text(json.dumps(record))
    with pytest.raises(board.LeaderboardError, match="refit") as e:
        board.build(tmp_path / "records", tmp_path / "board")
    assert str(group / "run_record.json") in str(e.value)
