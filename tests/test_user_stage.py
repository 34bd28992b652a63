"""Adding a stage from OUTSIDE the package: one decorated function in the user's own module,
pulled in by an ``import`` line of the user's gin file, trains with the ``dpbench`` command;
a mis-declared one is rejected with its name."""

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import run_guarded

USER_MODULE = textwrap.dedent('''
    import jax

    from dpbench import ops
    from dpbench.stages import Kind, Privacy, Stage, register_stage, stateless


    @register_stage("user.scale")
    def scale(factor: float = 0.5) -> Stage:
        """Scales one example's gradient before the clip (the clip bounds whatever it does)."""
        return Stage(name="user.scale", kind_in=Kind.PER_EXAMPLE, kind_out=Kind.PER_EXAMPLE,
                     make=stateless(lambda grads, state, ctx: (jax.tree.map(
                         lambda g: factor * g, grads), state)),
                     options=dict(factor=factor))


    @register_stage("user.loose_clip")
    def loose_clip() -> Stage:
        """Lies: declares clip bound 0.1 but clips at 1.0."""
        return Stage(name="user.loose_clip", kind_in=Kind.PER_EXAMPLE, kind_out=Kind.BOUNDED,
                     make=stateless(lambda g, state, ctx: (ops.clip_to_l2(g, 1.0), state)),
                     privacy=Privacy(l2_bound=0.1))


    @register_stage("user.peek")
    def peek() -> Stage:
        """Mis-declared: reads the private aggregate before the release with no DP cost."""
        return Stage(name="user.peek", kind_in=Kind.AGGREGATE, kind_out=Kind.AGGREGATE,
                     privacy=Privacy(lipschitz=1.0),
                     make=stateless(lambda value, state, ctx: (value, state)))
''')

GIN = textwrap.dedent('''
    import user_stages
    include 'pipelines/dpsgd/pipeline.gin'
    include 'gin/data/digits.gin'
    STAGES = [@grad.per_example(), {extra}@clip.global_l2(), {late}@noise.gaussian(),
              @optimize.optax()]
    pipeline.name = 'user'
    user.scale.factor = 0.25
    train.epochs = 1
''')


def _dpbench(tmp_path: Path, gin_text: str, name: str) -> subprocess.CompletedProcess:
    (tmp_path / f"{name}.gin").write_text(gin_text)
    command = Path(sys.executable).parent / "dpbench"  # the installed console script
    return run_guarded([str(command), f"--gin_file={name}.gin", f"--workdir={name}-run"],
                       cwd=tmp_path)


def test_a_users_own_stage_trains_and_a_misdeclared_one_is_rejected(tmp_path):
    (tmp_path / "user_stages.py").write_text(USER_MODULE)
    good = _dpbench(tmp_path, GIN.format(extra="@user.scale(), ", late=""), "good")
    assert good.returncode == 0, good.stderr[-3000:]
    record = json.loads((tmp_path / "good-run" / "run_record.json").read_text())
    assert record["stages"][1] == {"name": "user.scale", "factor": 0.25}
    assert record["epsilon"] <= record["target_epsilon"]
    # provenance: the user's stage module by path and sha256 (dpbench's own stages are pinned
    # by git_commit, with git_dirty saying whether the checkout had uncommitted changes)
    module = tmp_path / "user_stages.py"
    assert record["stage_sources"] == [dict(
        stage="user.scale", module="user_stages", path=str(module.resolve()),
        sha256=hashlib.sha256(module.read_bytes()).hexdigest(),
        checks_passed=["jit", "bound", "state"])]  # verified before training
    assert isinstance(record["git_dirty"], bool)
    # the statement's sentence, the one a reader quotes, names the outside stage too: its
    # epsilon rests on that stage's declaration, which dpbench checked but cannot prove
    statement = record["privacy_statement"]
    assert "user.scale (module user_stages" in statement["statement"]
    assert "checked on synthetic data: jit, bound, state" in statement["statement"]
    assert statement["outside_stages"] == record["stage_sources"]
    # the stage check's own calibration is quiet: no dp_accounting convergence warnings
    assert "failed to converge" not in good.stderr
    bad = _dpbench(tmp_path, GIN.format(extra="", late="@user.peek(), "), "bad")
    assert bad.returncode == 2
    assert "stage #2 'user.peek' reads the private aggregate" in bad.stderr
    assert "DP cost" in bad.stderr
    assert not (tmp_path / "bad-run" / "run_record.json").exists()


def test_a_stage_that_lies_about_its_bound_is_refused_before_training(tmp_path):
    """`dpbench check` and `dpbench train` verify a user's stage before any private training:
    one that declares clip bound 0.1 but clips at 1.0 is refused naming the stage and the
    check, and no record is written; an honest one passes `dpbench check`."""
    (tmp_path / "user_stages.py").write_text(USER_MODULE)
    liar = GIN.format(extra="", late="").replace("@clip.global_l2()", "@user.loose_clip()")
    trained = _dpbench(tmp_path, liar, "liar")
    assert trained.returncode == 2
    assert "stage 'user.loose_clip' fails the 'bound' check" in trained.stderr
    for written in ("run_record.json", "metrics.jsonl", "checkpoints"):  # nothing trained
        assert not (tmp_path / "liar-run" / written).exists(), written
    command = Path(sys.executable).parent / "dpbench"
    checked = run_guarded([str(command), "check", "--gin_file=liar.gin"], cwd=tmp_path)
    assert checked.returncode == 2 and "'bound' check" in checked.stderr
    (tmp_path / "good.gin").write_text(GIN.format(extra="@user.scale(), ", late=""))
    checked = run_guarded([str(command), "check", "--gin_file=good.gin"], cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert "user.scale: passed jit, bound, state" in checked.stdout
    assert "clip.global_l2: dpbench's own" in checked.stdout


def test_a_stage_in_the_previous_contracts_spelling_gets_one_error_naming_the_new_one(
        tmp_path):
    """A researcher's stage written against contract version 1 (`Stage(..., l2_bound=0.1,
    lipschitz=1.0)`) exits 2 with one `dpbench: error:` line naming where each keyword went,
    not a TypeError traceback from inside gin."""
    (tmp_path / "old_stages.py").write_text(textwrap.dedent('''
        from dpbench import ops
        from dpbench.stages import Kind, Stage, register_stage, stateless

        @register_stage("old.clip")
        def clip() -> Stage:
            return Stage(name="old.clip", kind_in=Kind.PER_EXAMPLE, kind_out=Kind.BOUNDED,
                         make=stateless(lambda g, s, ctx: (ops.clip_to_l2(g, 0.1), s)),
                         l2_bound=0.1)
    '''))
    (tmp_path / "old.gin").write_text(GIN.format(extra="", late="").replace(
        "import user_stages", "import old_stages").replace("@clip.global_l2()", "@old.clip()")
        .replace("user.scale.factor = 0.25\n", ""))
    command = Path(sys.executable).parent / "dpbench"
    for args in (["check", "--gin_file=old.gin"],
                 ["train", "--gin_file=old.gin", f"--workdir={tmp_path / 'run'}"]):
        done = run_guarded([str(command), *args], cwd=tmp_path)
        assert done.returncode == 2, done.stderr[-2000:]
        assert "Traceback" not in done.stderr and done.stderr.count("dpbench: error:") == 1
        assert "l2_bound= moved to privacy=Privacy(l2_bound=...)" in done.stderr
        assert "contract version 2" in done.stderr
