"""A method is a folder (dpbench.search.methods): a researcher adds one, in a folder of their
own, with one stage module beside its pipeline, and puts it on a board next to DP-SGD through
`dpbench sweep` and `dpbench board` without touching a file of the repository."""

import json
import subprocess
import textwrap

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant

from dpbench import accounting
from dpbench.search import methods
from dpbench.search import protocol
from dpbench.search import tuning
from dpbench.search.protocol import load_protocol
from tests.conftest import REPO_ROOT

STAGE_MODULE = textwrap.dedent('''
    import jax

    from dpbench.stages import Kind, Stage, register_stage, stateless


    @register_stage("halfclip.scale")
    def scale(factor: float = 0.5) -> Stage:
        """Scales each example's gradient before the clip (the clip bounds what it does)."""
        return Stage(name="halfclip.scale", kind_in=Kind.PER_EXAMPLE,
                     kind_out=Kind.PER_EXAMPLE, options=dict(factor=factor),
                     make=stateless(lambda grads, state, ctx: (jax.tree.map(
                         lambda g: factor * g, grads), state)))
''')
PIPELINE = textwrap.dedent('''
    import halfclip_stages
    include 'pipelines/dpsgd/pipeline.gin'
    STAGES = [@grad.per_example(), @halfclip.scale(), @clip.global_l2(), @noise.gaussian(),
              @optimize.optax()]
    pipeline.name = 'halfclip'
''')
METHOD = {"paper": "A. Researcher, 2026", "claim": "+9 over DP-SGD (made up for this test)",
          "search": {"*": {"space": {"halfclip.scale.factor": {"uniform": [0.2, 0.8]}}}}}
def documented_protocol() -> dict:
    """The example protocol of docs/board-protocol.md ("Writing your own protocol"): the test
    runs what the documentation shows."""
    text = (REPO_ROOT / "docs" / "board-protocol.md").read_text()
    section = text[text.index("## Writing your own protocol"):]
    return json.loads(section[section.index("```json") + 7:section.index("```\n", 10)])


PROTOCOL = documented_protocol()
GROUP = "digits__logistic__eps3.0__delta1e-05"


def make_method(root):
    folder = root / "my_methods" / "halfclip"
    folder.mkdir(parents=True)
    (folder / "halfclip_stages.py").write_text(STAGE_MODULE)
    (folder / "pipeline.gin").write_text(PIPELINE)
    (folder / "method.json").write_text(json.dumps(METHOD))
    (folder / "README.md").write_text("# halfclip\n\nHalves each gradient before the clip.\n")
    (root / "protocol.json").write_text(json.dumps(PROTOCOL))
    return folder


def repo_status() -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True,
                          text=True, check=True).stdout


def test_every_board_method_is_a_folder_with_its_three_files():
    found = methods.discover()
    assert set(found) >= {"dpsgd", "rs", "dpssgd", "gip", "randomk", "nasr", "gep", "bgep"}
    for name, method in found.items():
        assert method.gin_file == f"pipelines/{name}/pipeline.gin"
        assert method.paper
    # GEP's embedding bound takes the clip's paired draw under its own name
    assert found["gep"].search_entry("fashion_mnist__tanh_cnn")["shared_as"] == {
        "clip.global_l2.l2_bound": "gep.embed_and_clip.embedding_bound"}


@pytest.mark.parametrize("damage,match", [
    (lambda f: (f / "README.md").unlink(), "missing README.md"),
    (lambda f: (f / "method.json").write_text('{"claim": "x"}'), 'needs "paper"'),
    (lambda f: (f / "method.json").write_text('{"paper": "x", "serch": {}}'), "only the keys"),
    (lambda f: (f / "method.json").write_text(
        '{"paper": "x", "search": {"*": {"spcae": {}}}}'), "search.\\* takes only"),
    (lambda f: (f / "method.json").write_text('{"paper": "x", "claim_gain": [2, 1]}'),
     "claim_gain"),
    (lambda f: (f / "method.json").write_text('{"paper": "x", "claim_gain": {"one": [1, 2]}}'),
     "claim_gain"),
])
def test_a_broken_method_folder_is_refused_naming_the_file(tmp_path, damage, match):
    folder = make_method(tmp_path)
    damage(folder)
    with pytest.raises(protocol.ProtocolError, match=match) as e:
        load_protocol(tmp_path / "protocol.json")
    assert str(folder) in str(e.value)


def test_a_protocol_names_methods_by_folder_and_refuses_an_unknown_or_doubled_one(tmp_path):
    make_method(tmp_path)
    loaded = load_protocol(tmp_path / "protocol.json")
    entries = loaded["families"]["digits__logistic"]["methods"]
    assert entries["dpsgd"] == {"gin_file": "pipelines/dpsgd/pipeline.gin"}
    assert entries["halfclip"] == {
        "gin_file": str(tmp_path / "my_methods" / "halfclip" / "pipeline.gin"),
        "space": METHOD["search"]["*"]["space"]}
    bad = dict(PROTOCOL, families={"digits__logistic": dict(
        PROTOCOL["families"]["digits__logistic"], methods=["dpsgd", "halfclp"])})
    (tmp_path / "protocol.json").write_text(json.dumps(bad))
    with pytest.raises(protocol.ProtocolError, match=r"no method folder \['halfclp'\]"
                                                     r".*did you mean 'halfclip' for 'halfclp'"):
        load_protocol(tmp_path / "protocol.json")
    (tmp_path / "my_methods" / "dpsgd").mkdir()
    for name in ("pipeline.gin", "method.json", "README.md"):
        (tmp_path / "my_methods" / "dpsgd" / name).write_text("{\"paper\": \"x\"}")
    with pytest.raises(protocol.ProtocolError, match="'dpsgd' is in both"):
        load_protocol(tmp_path / "protocol.json")


def test_a_methods_knobs_resolve_in_a_new_family_or_the_protocol_is_refused(tmp_path):
    """dpbench's own methods keep their search knobs in any family ("*"): GEP's num_basis and
    Nasr's regime do not vanish in a new model family (e.g. the WRN's). A method whose
    method.json lists knobs for some families, none for this one and no "*", is refused at
    load, naming the method and the family."""
    found = methods.discover()
    for name, method in found.items():
        entry = method.search_entry("fashion_mnist__wrn16_4")
        assert entry["gin_file"] == f"pipelines/{name}/pipeline.gin"
    assert "gep.embed_and_clip.num_basis" in found["gep"].search_entry(
        "fashion_mnist__wrn16_4")["space"]
    assert found["nasr"].search_entry("fashion_mnist__wrn16_4")["space"][
        "optimize.optax.optimizer"] == {"value": "sgd"}
    make_method(tmp_path)
    only_tanh = dict(METHOD, search={"fashion_mnist__tanh_cnn": METHOD["search"]["*"]})
    (tmp_path / "my_methods" / "halfclip" / "method.json").write_text(json.dumps(only_tanh))
    with pytest.raises(protocol.ProtocolError,
                       match="method 'halfclip' has no search knobs for family "
                             r"'digits__logistic'.*fashion_mnist__tanh_cnn.*\"\*\""):
        load_protocol(tmp_path / "protocol.json")


@pytest.mark.parametrize("q,sigma,steps", [
    (0.01, 1.0, 200),
    (0.197, 1.19, 6),  # a run whose RDP is infinite at small orders (0 x inf once gave eps 0)
])
def test_a_fixed_trial_count_composes_its_runs(q, sigma, steps):
    """K public: the search's epsilon is dp_accounting's PLD composition of its K runs (two
    different runs here, as a group's trials are); one run alone falls short of it."""
    event = dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    other = dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(1.1 * sigma)), steps)
    stored = [accounting.event_to_json(e) for e in (event, other)]
    for fixed in (0, 2):
        runs = [stored[0]] + [stored[j % 2] for j in range(1, 1 + fixed)]
        pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
        pld.compose(dp_event.ComposedDpEvent(
            [event] + [(event, other)[j % 2] for j in range(1, 1 + fixed)]))
        got = tuning.composition_epsilon(runs, 1e-5)
        assert got == pytest.approx(pld.get_epsilon(1e-5), rel=1e-6)
        assert got > 0.5  # never the 0 a NaN order once read as
        if fixed:
            assert got > 1.3 * tuning.composition_epsilon(runs[:1], 1e-5)
    with pytest.raises(protocol.ProtocolError, match="fixed"):
        protocol._check_trial_law("p.json", {"fixed": 0})


# The researcher's whole path (this folder run through `dpbench sweep` and `dpbench board` from
# the researcher's own folder) is tests/test_sweep.py's tiny sweep, which every sweep and board
# test reads: test_a_researchers_method_goes_from_its_folder_to_the_board there.


LYING_STAGES = textwrap.dedent('''
    from dpbench import ops
    from dpbench.stages import Kind, Privacy, Stage, register_stage, stateless


    @register_stage("liar.clip")
    def clip() -> Stage:
        """Declares clip bound 0.1 but clips at 1.0."""
        return Stage(name="liar.clip", kind_in=Kind.PER_EXAMPLE, kind_out=Kind.BOUNDED,
                     make=stateless(lambda g, state, ctx: (ops.clip_to_l2(g, 1.0), state)),
                     privacy=Privacy(l2_bound=0.1))
''')


def test_a_method_whose_stage_lies_is_refused_by_the_sweep_before_anything_is_written(
        tmp_path, capsys):
    from dpbench import sweep
    make_method(tmp_path)
    folder = tmp_path / "my_methods" / "liar"
    folder.mkdir()
    (folder / "liar_stages.py").write_text(LYING_STAGES)
    (folder / "pipeline.gin").write_text(
        "import liar_stages\ninclude 'pipelines/dpsgd/pipeline.gin'\nSTAGES = "
        "[@grad.per_example(), @liar.clip(), @noise.gaussian(), @optimize.optax()]\n"
        "pipeline.name = 'liar'\n")
    (folder / "method.json").write_text('{"paper": "nobody"}')
    (folder / "README.md").write_text("# liar\n")
    protocol = json.loads((tmp_path / "protocol.json").read_text())
    protocol["families"]["digits__logistic"]["methods"] = ["liar"]
    (tmp_path / "protocol.json").write_text(json.dumps(protocol))
    records = tmp_path / "records"
    assert sweep.main([f"--protocol={tmp_path / 'protocol.json'}", f"--records={records}",
                       f"--runs_dir={tmp_path / 'runs'}", "--prepare_only", "--cpus=1"]) == 2
    err = capsys.readouterr().err
    assert "method 'liar': stage 'liar.clip' fails the 'bound' check" in err
    assert not records.exists()
