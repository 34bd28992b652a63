"""The canary audit: correct pipelines stay under their claim, broken ones are flagged."""

import json
import math
import sys

import numpy as np
import pytest

from dpbench import audit, config, stages
from dpbench.stages.base import Kind, Privacy, Stage, stateless
from dpbench.ops import add_gaussian_noise
from dpbench.config import pipeline_stages
from tests.conftest import REPO_ROOT, run_guarded


def pipeline(gin_file, bindings=()):
    config.parse_config([gin_file], list(bindings) + list(audit.AUDIT_BINDINGS))
    return list(pipeline_stages()[1])


def no_clip(l2_bound):
    """Declares a clip bound but never clips."""
    return Stage(name="broken.no_clip", kind_in=Kind.PER_EXAMPLE, kind_out=Kind.BOUNDED,
                 make=stateless(lambda value, state, ctx: (value, state)),
                 privacy=Privacy(l2_bound=l2_bound))


def scaled_noise(factor):
    """Adds noise with standard deviation factor * sigma * sensitivity."""
    def apply(value, state, ctx):
        return add_gaussian_noise(value, ctx.key, factor * ctx.noise_stddev), state
    return Stage(name="broken.scaled_noise", kind_in=Kind.AGGREGATE, kind_out=Kind.RELEASED,
                 make=stateless(apply))


def sgd():
    return stages.optimize.optax_optimizer(optimizer="sgd", learning_rate=1.0)


@pytest.mark.parametrize("gin_file,claimed", [
    ("pipelines/rs", 2.0), ("pipelines/gip", 3.0), ("pipelines/gep", 4.0),
    ("pipelines/bandmf", 3.0)])
def test_correct_pipelines_stay_under_their_claim(gin_file, claimed):
    # fewer GEP anchors than the pipeline's 512 keep the test fast; the mechanism is the same
    bindings = ["gep.embed_and_clip.num_anchors = 128", "gep.embed_and_clip.num_basis = 40"]
    seed = int(np.random.default_rng().integers(1 << 30))
    # False-failure rate <= 1e-4 per case, in two parts. (1) These mechanisms sit exactly at
    # their claim (calibrated sigma, a Dirac canary), so at the audit's own alpha = 0.05 a
    # correct pipeline is flagged by chance ~1-2% of the time; its bounds at alpha hold with
    # probability >= 1 - 1.5 alpha together (4 Clopper-Pearson bounds at alpha / 4 and the
    # canary shift's 2 at alpha / 4: union bound), so alpha = 6e-5 flags a correct pipeline
    # with probability <= 9e-5. The broken pipelines below are still flagged at 0.05.
    result = audit.run_audit(pipeline(gin_file, bindings), claimed_epsilon=claimed, trials=1000,
                             seed=seed, alpha=6e-5)
    assert abs(result.claimed_epsilon - claimed) < 1e-3
    assert not result.flagged, (seed, result.reasons)
    # (2) The canary is visible: its mean shift over the 1000 runs (half with it, half without)
    # is more than 3.5 standard errors of a mean difference, so the audit is not vacuous (a
    # canary the release does not carry passes this with probability 2.3e-4). The shift over
    # its standard error is ~ N(sqrt(1000 / 4) / sigma_eff, 1); at the calibrated sigma (RS at
    # epsilon 2: 1.994, GIP at 3: 1.392, GEP at 4: 1.529, BandMF at 3: 1.391, its one-step
    # strategy being one band; measured z 7.6-11.8) its mean is
    # >= 7.9, so a correct pipeline fails this with probability <= Phi(3.5 - 7.9) = 5e-6.
    # (The former 5 standard errors failed RS ~1.7e-3 of the time: Phi(5 - 7.93).)
    z = result.mean_shift / (result.pooled_std * math.sqrt(4 / 1000))
    assert z > 3.5, (seed, z, result)


@pytest.mark.parametrize("broken", ["no_clip", "noise_over_batch", "sigma_halved"])
def test_broken_pipelines_are_flagged(broken):
    clip_bound, batch = 0.1, 256
    stage_list = [stages.grad.per_example(),
                  no_clip(clip_bound) if broken == "no_clip" else
                  stages.clip.global_l2(clip_bound),
                  scaled_noise({"no_clip": 1.0, "noise_over_batch": 1.0 / batch,
                                "sigma_halved": 0.5}[broken]),
                  sgd()]
    # Each break moves the canary's effective noise multiplier to at most half the claim's
    # (1.39 at epsilon 3): its shift over noise std, ~1.43 or more, is then more than 10
    # standard errors (0.058 at 1200 runs) above the 0.72 the claim allows, so a broken
    # pipeline escapes the flag with probability < 1e-9.
    result = audit.run_audit(stage_list, claimed_epsilon=3.0, trials=1200,
                             seed=int(np.random.default_rng().integers(1 << 30)))
    assert result.flagged, result
    if broken != "sigma_halved":  # a shift of many noise stddevs: even the nonparametric bound
        assert result.epsilon_lb > result.claimed_epsilon


def test_clopper_pearson_bound_matches_hand_values():
    # 500/500 true positives and 0/500 false positives: the exact one-sided bounds at
    # alpha=0.05 are TPR >= 0.05**(1/500) and FPR <= 1 - 0.05**(1/500)
    lb = audit.clopper_pearson_epsilon_lb(500, 500, 0, 500, delta=0.0, alpha=0.1)
    p = 0.05 ** (1 / 500)
    assert lb == pytest.approx(math.log(p / (1 - p)), rel=1e-6)
    assert audit.clopper_pearson_epsilon_lb(250, 500, 250, 500, 1e-5, 0.05) == 0.0
    # delta comes off the true-positive bound: TPR <= e^eps FPR + delta
    lb = audit.clopper_pearson_epsilon_lb(500, 500, 0, 500, delta=0.1, alpha=0.1)
    assert lb == pytest.approx(math.log((p - 0.1) / (1 - p)), rel=1e-6)
    # and a true-positive bound at or below delta proves nothing
    assert audit.clopper_pearson_epsilon_lb(30, 500, 0, 500, delta=0.1, alpha=0.1) == 0.0


def test_cli_audits_dpsgd_and_writes_a_report(tmp_path):
    out = tmp_path / "audit.json"
    proc = run_guarded(
        [sys.executable, "-c", "from dpbench.main import run; run()", "audit",
         "--gin_file=pipelines/dpsgd/pipeline.gin", "--gin_file=gin/data/digits.gin",
         "--trials=1000", "--claimed_epsilon=3.0", f"--out={out}"], cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["pipeline"] == "dpsgd" and not report["flagged"], report
    assert report["delta"] == 1e-4  # the config's delta (digits' DELTA), not a flag default
    assert 0 <= report["epsilon_lb"] <= report["claimed_epsilon"] < 3.0 + 1e-9
    # the canary shift is the clip bound and the noise std is sigma * C (within 10%)
    assert report["mean_shift"] == pytest.approx(0.1, rel=0.1)
    assert report["pooled_std"] == pytest.approx(report["noise_multiplier"] * 0.1, rel=0.1)


def test_perfectly_separated_scores_reach_the_largest_bound_the_trials_allow():
    # regression: a threshold with one false positive used to tie with a clean one
    rng = np.random.default_rng()
    scores_in, scores_out = 1.0 + 0.01 * rng.normal(size=600), 0.01 * rng.normal(size=600)
    best = audit.clopper_pearson_epsilon_lb(450, 450, 0, 450, 1e-5, 0.05 / 4)
    assert audit.nonparametric_epsilon_lb(scores_in, scores_out, 1e-5, 0.05) == pytest.approx(
        best)


HALF_NOISE_MODULE = """
from dpbench.ops import add_gaussian_noise
from dpbench.stages import Kind, Stage, register_stage, stateless


@register_stage("broken.half_noise")
def half_noise() -> Stage:
    \"\"\"Declares the Gaussian release but adds half its noise.\"\"\"
    return Stage(name="broken.half_noise", kind_in=Kind.AGGREGATE, kind_out=Kind.RELEASED,
                 make=stateless(lambda value, state, ctx: (add_gaussian_noise(
                     value, ctx.key, 0.5 * ctx.noise_stddev), state)))
"""


def test_cli_exits_non_zero_when_the_audit_flags_and_still_writes_the_report(tmp_path):
    (tmp_path / "half_noise_stage.py").write_text(HALF_NOISE_MODULE)
    (tmp_path / "half_noise.gin").write_text(
        "import half_noise_stage\ninclude 'pipelines/dpsgd/pipeline.gin'\n"
        "STAGES = [@grad.per_example(), @clip.global_l2(), @broken.half_noise(), "
        "@optimize.optax()]\n")
    out = tmp_path / "audit.json"
    proc = run_guarded(
        [sys.executable, "-c", "from dpbench.main import run; run()", "audit",
         f"--gin_file={tmp_path / 'half_noise.gin'}", "--trials=1000",
         "--claimed_epsilon=3.0", "--audit_delta=1e-6", f"--out={out}"], cwd=REPO_ROOT)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "FLAGGED" in proc.stderr and "dpbench: audit of dpsgd" in proc.stderr
    report = json.loads(out.read_text())
    assert report["flagged"] is True and report["delta"] == 1e-6  # the flag overrides


def test_the_board_audit_reads_its_methods_and_epsilons_from_the_protocol(tmp_path):
    """`dpbench audit --board`: every method the protocol lists (a researcher's own from its
    method_dirs too), at every epsilon it declares and at its delta, one report each; a method
    whose method.json says "skip" is named and left out. Nothing is written twice: the
    epsilons come from the protocol."""
    from tests.test_method_folder import METHOD, make_method
    make_method(tmp_path)
    protocol = json.loads((tmp_path / "protocol.json").read_text())
    protocol["epsilons"] = [2.0]
    (tmp_path / "protocol.json").write_text(json.dumps(protocol))
    proc = run_guarded(
        [sys.executable, "-c", "from dpbench.main import run; run()", "audit", "--board",
         f"--protocol={tmp_path / 'protocol.json'}", "--trials=200"], cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = sorted(p.name for p in (tmp_path / "audits").iterdir())
    assert written == ["dpsgd-eps2.json", "halfclip-eps2.json"]
    for name in ("dpsgd", "halfclip"):
        report = json.loads((tmp_path / "audits" / f"{name}-eps2.json").read_text())
        assert report["pipeline"] == name and report["delta"] == protocol["delta"]
        assert report["claimed_epsilon"] <= 2.0 + 1e-9 and not report["flagged"]
    (tmp_path / "my_methods" / "halfclip" / "method.json").write_text(json.dumps(dict(
        METHOD, audit={"skip": "made up for this test"})))
    proc = run_guarded(
        [sys.executable, "-c", "from dpbench.main import run; run()", "audit", "--board",
         f"--protocol={tmp_path / 'protocol.json'}", "--trials=200",
         f"--audits_dir={tmp_path / 'again'}"], cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not audited: halfclip (made up for this test)" in proc.stdout
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["dpsgd-eps2.json"]

