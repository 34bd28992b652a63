"""Every committed pipeline parses, validates, and trains end to end on a small real dataset."""

from pathlib import Path

import pytest

from dpbench import main, train
from tests.conftest import REPO_ROOT

PIPELINES = sorted(p.name for p in (REPO_ROOT / "pipelines").glob("*.gin"))


def test_there_are_pipelines():
    assert "dpsgd.gin" in PIPELINES


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_pipeline_trains_on_digits(pipeline, tmp_path):
    files = [f"pipelines/{pipeline}", "gin/data/digits.gin"]
    main.parse_config(files, ["train.epochs = 2", "train.log_every_steps = 5",
                              "dataset.public_size = 64", "gep.embed_and_clip.num_anchors = 64",
                              "gep.embed_and_clip.num_basis = 48"])
    record = train.train(tmp_path / "run", gin_files=files)
    assert record["pipeline"] == Path(pipeline).stem
    assert record["epsilon"] <= record["target_epsilon"]
    assert record["test_accuracy"] > 0.2


def test_dpssgd_synflow_variant_by_binding(tmp_path):
    files = ["pipelines/dpssgd.gin", "gin/data/digits.gin"]
    main.parse_config(files, ["train.epochs = 2", "PRUNE = @prune.synflow()",
                              "prune.synflow.iterations = 10"])
    record = train.train(tmp_path / "run", gin_files=files)
    assert [s["name"] for s in record["stages"]][1] == "prune.synflow"
    assert record["test_accuracy"] > 0.2


def test_dpssgd_dp_snip_variant_accounts_its_release(tmp_path):
    files = ["pipelines/dpssgd.gin", "gin/data/digits.gin"]
    main.parse_config(files, ["train.epochs = 2", "PRUNE = @prune.dp_snip()",
                              "prune.dp_snip.epsilon_fraction = 0.1"])
    record = train.train(tmp_path / "run", gin_files=files)
    statement = record["privacy_statement"]
    assert [r["stage"] for r in statement["one_off_releases"]] == ["prune.dp_snip"]
    assert "prune.dp_snip release before training" in statement["statement"]
    assert record["target_epsilon"] - 1e-3 < record["epsilon"] <= record["target_epsilon"]
