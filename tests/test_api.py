"""The Python API (dpbench/api.py): the README's example runs as written, calls do not leak
settings into each other, and a re-imported stage module re-registers its stages."""

import importlib
import json
import sys
import textwrap

import pytest

from dpbench import api, config
from dpbench.compiler import check as stage_check
from tests.conftest import REPO_ROOT, run_guarded


def readme_example() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    section = text[text.index("## Python API"):]
    return section[section.index("```python") + 9:section.index("```\n", 20)]


def test_the_readmes_example_runs_as_written(tmp_path):
    done = run_guarded([sys.executable, "-c", readme_example()], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "runs" / "api-example" / "run_record.json").read_text())
    assert record["pipeline"] == "dpsgd" and record["dataset"] == "digits"
    assert record["epsilon"] <= record["target_epsilon"]
    assert f"{record['epsilon']}" in done.stdout


def test_configure_starts_afresh_and_check_names_a_lying_stage(tmp_path, monkeypatch):
    name, _ = api.configure(["pipelines/rs"], "train.epochs = 3")
    assert name == "rs" and config.TrainConfig().epochs == 3
    name, _ = api.configure(["pipelines/dpsgd"])
    assert name == "dpsgd" and config.TrainConfig().epochs == 30  # nothing left from the last
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "api_liar.py").write_text(textwrap.dedent('''
        from dpbench import ops
        from dpbench.stages import Kind, Privacy, Stage, register_stage, stateless

        @register_stage("apiliar.clip")
        def clip() -> Stage:
            return Stage(name="apiliar.clip", kind_in=Kind.PER_EXAMPLE, kind_out=Kind.BOUNDED,
                         make=stateless(lambda g, s, ctx: (ops.clip_to_l2(g, 1.0), s)),
                         privacy=Privacy(l2_bound=0.1))
    '''))
    gin_text = ("import api_liar\ninclude 'pipelines/dpsgd/pipeline.gin'\nSTAGES = ["
                "@grad.per_example(), @apiliar.clip(), @noise.gaussian(), @optimize.optax()]")
    with pytest.raises(stage_check.StageCheckError, match="'apiliar.clip' fails the 'bound'"):
        api.check(gin=gin_text)


def scale_stage_source(name: str) -> str:
    """A user's stage module registering ``name``, a per-example scale whose default factor is
    the placeholder FACTOR (the tests edit it, as a user edits a module in a notebook)."""
    return textwrap.dedent('''
        import jax
        from dpbench.stages import Kind, Stage, register_stage, stateless

        @register_stage("NAME")
        def scale(factor: float = FACTOR) -> Stage:
            return Stage(name="NAME", kind_in=Kind.PER_EXAMPLE,
                         kind_out=Kind.PER_EXAMPLE, options=dict(factor=factor),
                         make=stateless(lambda g, s, ctx: (jax.tree.map(lambda v: factor * v, g),
                                                           s)))
    ''').replace("NAME", name)


def test_a_reimported_stage_module_re_registers_and_a_stolen_name_is_refused(
        tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "reloaded_stages.py"
    source = scale_stage_source("reloaded.scale")
    module.write_text(source.replace("FACTOR", "0.5"))
    stages_module = importlib.import_module("reloaded_stages")
    module.write_text(source.replace("FACTOR", "0.25"))  # edited in the notebook, re-imported
    importlib.reload(stages_module)
    _, stages = api.configure(["pipelines/dpsgd"], "STAGES = [@grad.per_example(), "
                              "@reloaded.scale(), @clip.global_l2(), @noise.gaussian(), "
                              "@optimize.optax()]")
    assert stages[1].options == {"factor": 0.25}
    (tmp_path / "thief_stages.py").write_text(source.replace("FACTOR", "1.0").replace(
        "def scale(", "def other_scale("))
    with pytest.raises(ValueError, match="'reloaded.scale' is registered twice"):
        importlib.import_module("thief_stages")


def test_a_stage_module_reloads_after_a_run(tmp_path, monkeypatch, caplog):
    """The README's promise: after api.train (whose parse leaves gin's configuration locked),
    the user's stage module, edited, re-imports (importlib.reload) and the next call runs the
    edited stage. The run shows its progress; a finished workdir is refused naming the API's
    own knob."""
    monkeypatch.syspath_prepend(str(tmp_path))
    source = scale_stage_source("afterrun.scale")
    (tmp_path / "afterrun_stages.py").write_text(source.replace("FACTOR", "0.5"))
    stages_gin = ("import afterrun_stages\nSTAGES = [@grad.per_example(), @afterrun.scale(), "
                  "@clip.global_l2(), @noise.gaussian(), @optimize.optax()]")
    record = api.train(tmp_path / "run", ["pipelines/dpsgd", "gin/data/digits.gin"],
                       [stages_gin, "train.epochs = 1"])
    assert record["stages"][1] == {"name": "afterrun.scale", "factor": 0.5}
    assert any("epsilon spent" in r.getMessage() for r in caplog.records)  # INFO: shown
    with pytest.raises(ValueError, match=r"overwrite=True"):
        api.train(tmp_path / "run", ["pipelines/dpsgd", "gin/data/digits.gin"],
                  [stages_gin, "train.epochs = 1"])
    (tmp_path / "afterrun_stages.py").write_text(source.replace("FACTOR", "0.25"))
    importlib.reload(sys.modules["afterrun_stages"])
    _, stages = api.configure(["pipelines/dpsgd"], stages_gin)
    assert stages[1].options == {"factor": 0.25}


def test_a_digits_run_with_the_data_files_defaults_learns(tmp_path):
    """The README's "another dataset: add gin/data/digits.gin" on DP-SGD's pipeline, nothing else
    bound, at eps 1: the data file sets its own length (5 epochs: 51 steps), so the training loss
    falls. With the pipeline's Fashion-MNIST length (30 epochs: 305 steps) it climbed from 2.3 to
    13 (seed 0). The seed is the record's fixed benchmark seed, so this is one fixed run, not a
    statistical claim: measured 2.35 -> 0.64 here; the bound leaves room for another host."""
    record = api.train(tmp_path / "run", ["pipelines/dpsgd", "gin/data/digits.gin"],
                       ["EPSILON = 1.0", "train.log_every_steps = 1"])
    assert (record["epochs"], record["steps"]) == (5, 51)
    losses = [line["train_loss"] for line in map(
        json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if "train_loss" in line]
    assert len(losses) == 51 and losses[0] > 2.0
    assert max(losses[-5:]) < 0.5 * losses[0], losses
