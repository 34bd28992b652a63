"""Every committed pipeline parses, validates, and trains end to end on a small real dataset."""

import json
import os
from pathlib import Path

import pytest

from dp_accounting import dp_event
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from dpbench import config, records, train
from tests.conftest import REPO_ROOT

PIPELINES = sorted(p.name for p in (REPO_ROOT / "pipelines").glob("*.gin"))


def test_there_are_pipelines():
    assert "dpsgd.gin" in PIPELINES


GOLDEN = REPO_ROOT / "tests" / "golden_pipelines.json"
GOLDEN_PACKAGES = ("jax", "jaxlib", "numpy", "flax", "optax", "dp-accounting", "scipy")


def check_golden(key: str, record: dict) -> None:
    """Sigma, epsilon and the final parameters' hash equal, bit for bit, what main computed
    when the golden file was written (before the compiler redesign, issue 16). Set
    DPBENCH_WRITE_GOLDEN=1 to rewrite it, only for a change meant to alter the numbers."""
    got = {k: record[k] for k in ("noise_multiplier", "epsilon", "final_params_sha256")}
    versions = {k: v for k, v in records.versions(GOLDEN_PACKAGES).items()}
    if os.environ.get("DPBENCH_WRITE_GOLDEN"):
        golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"runs": {}}
        golden["versions"] = versions
        golden["runs"][key] = got
        GOLDEN.write_text(json.dumps(golden, indent=2, sort_keys=True) + "\n")
        return
    golden = json.loads(GOLDEN.read_text())
    assert versions == golden["versions"], (
        "the numerical stack differs from the golden file's; install with tools/install.sh "
        "(which pins tools/constraints.txt)")
    assert got == golden["runs"][key]


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
    covered = [item["what"] for item in statement["not_covered"]]
    for what in covered:
        assert what in text
    assert any("validation split" in w for w in covered)
    assert any("hyperparameter tuning" in w for w in covered)
    assert any("diagnostics" in w for w in covered)
    assert any("public split" in w for w in covered) == (record["public_size"] > 0)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_pipeline_trains_on_digits(pipeline, tmp_path):
    files = [f"pipelines/{pipeline}", "gin/data/digits.gin"]
    config.parse_config(files, ["train.epochs = 2", "train.log_every_steps = 5",
                              "dataset.public_size = 64", "gep.embed_and_clip.num_anchors = 64",
                              "gep.embed_and_clip.num_basis = 48"])
    record = train.train(tmp_path / "run", gin_files=files)
    assert record["pipeline"] == Path(pipeline).stem
    assert record["epsilon"] <= record["target_epsilon"]
    assert record["test_accuracy"] > 0.2
    check_statement(record)
    check_golden(pipeline, record)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_pipeline_trains_on_scatter_linear(pipeline, tmp_path):
    """Every pipeline on the second model family: ScatterNet features + linear (digits)."""
    files = [f"pipelines/{pipeline}", "gin/data/digits.gin", "gin/model/scatter_linear.gin"]
    config.parse_config(files, ["train.epochs = 2", "train.log_every_steps = 5",
                              "dataset.public_size = 64", "gep.embed_and_clip.num_anchors = 64",
                              "gep.embed_and_clip.num_basis = 48"])
    record = train.train(tmp_path / "run", gin_files=files)
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
    files = ["pipelines/dpsgd.gin", "gin/data/digits.gin", "gin/model/scatter_cnn.gin"]
    config.parse_config(files, ["train.epochs = 2"])
    record = train.train(tmp_path / "run", gin_files=files)
    assert record["model"] == "scatter_cnn" and record["test_accuracy"] > 0.2
    assert record["per_example_strategy"] == "bookkeeping"  # GroupNorm without parameters
    config.parse_config(files, ["train.epochs = 2", "dataset.features = 'pixels'"])
    with pytest.raises(ValueError, match="bind dataset.features = 'scattering'"):
        train.train(tmp_path / "pixels", gin_files=files)
    assert not (tmp_path / "pixels" / records.RECORD_NAME).exists()


@pytest.mark.parametrize("prune", ["synflow", "dp_snip"])
def test_dpssgd_prune_variants_by_binding(prune, tmp_path):
    files = ["pipelines/dpssgd.gin", "gin/data/digits.gin"]
    config.parse_config(files, ["train.epochs = 2", f"PRUNE = @prune.{prune}()",
                              "prune.synflow.iterations = 10"])
    record = train.train(tmp_path / "run", gin_files=files)
    assert record["stages"][1]["name"] == f"prune.{prune}"
    check_statement(record)
    check_golden(f"dpssgd.gin+{prune}", record)
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
    from dpbench import leaderboard
    files = ["pipelines/dpsgd.gin", "gin/data/digits.gin"]
    config.parse_config(files, ["train.epochs = 2", "dataset.validation_size = 0"])
    record = train.train(tmp_path / "run", gin_files=files)
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
    with pytest.raises(leaderboard.LeaderboardError, match="refit") as e:
        leaderboard.build(tmp_path / "records", tmp_path / "board")
    assert str(group / "run_record.json") in str(e.value)
