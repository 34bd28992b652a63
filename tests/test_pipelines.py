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


@pytest.mark.parametrize("prune", ["synflow", "dp_snip"])
def test_dpssgd_prune_variants_by_binding(prune, tmp_path):
    files = ["pipelines/dpssgd.gin", "gin/data/digits.gin"]
    main.parse_config(files, ["train.epochs = 2", f"PRUNE = @prune.{prune}()",
                              "prune.synflow.iterations = 10"])
    record = train.train(tmp_path / "run", gin_files=files)
    assert record["stages"][1]["name"] == f"prune.{prune}"
    statement = record["privacy_statement"]
    releases = [r["stage"] for r in statement["one_off_releases"]]
    assert releases == (["prune.dp_snip"] if prune == "dp_snip" else [])
    assert ("prune.dp_snip release before training" in statement["statement"]) == bool(releases)
    assert record["target_epsilon"] - 1e-3 < record["epsilon"] <= record["target_epsilon"]
