"""End to end: the CLI on real (small) data, and bad input failing before training."""

import json
import subprocess
import sys

import pytest

from dpbench import accounting, compiler, config
from dpbench import run as run_lib
from tests.conftest import HANG_GUARD_S, REPO_ROOT, run_guarded, wait_guarded

DIGITS = ["pipelines/dpsgd/pipeline.gin", "gin/data/digits.gin"]
QUICK = ["train.epochs = 2", "train.log_every_steps = 5"]


def run_in_process(tmp_path, files=DIGITS, bindings=()):
    config.parse_config(files, list(QUICK) + list(bindings))
    return run_lib.train(tmp_path / "run", gin_files=files)


def test_cli_trains_and_writes_a_record_with_a_privacy_statement(tmp_path):
    workdir = tmp_path / "run"
    proc = run_guarded(
        [sys.executable, "-m", "dpbench.main", *[f"--gin_file={f}" for f in DIGITS],
         "--gin_bindings=train.epochs = 3", "--gin_bindings=EPSILON = 2.0",
         f"--workdir={workdir}"], cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((workdir / "run_record.json").read_text())
    statement = record["privacy_statement"]
    assert record["epsilon"] <= 2.0 and 2.0 - record["epsilon"] < 1e-3
    (gaussian,) = statement["mechanisms"]
    assert gaussian["noise_multiplier"] == record["noise_multiplier"] > 0
    clip = next(s for s in record["stages"] if s["name"] == "clip.global_l2")
    assert gaussian["l2_sensitivity"] == clip["l2_bound"] and statement["poisson_accounted"]
    assert statement["accountant"] == "pld" and "dp-accounting" in statement["accountant_version"]
    assert record["test_accuracy"] > 0.3  # far above chance (0.1) after 3 epochs
    assert (workdir / "operative_config.gin").exists() and (workdir / "config.gin").exists()
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    eps = [entry["epsilon"] for entry in lines if "epsilon" in entry]
    assert eps == sorted(eps) and eps[-1] == pytest.approx(record["epsilon"])
    assert "steps/s" in proc.stderr and "epsilon spent" in proc.stderr
    assert "compilation included" in proc.stderr and "steps left" in proc.stderr
    # a finished run is never overwritten
    again = run_guarded(
        [sys.executable, "-m", "dpbench.main", *[f"--gin_file={f}" for f in DIGITS],
         f"--workdir={workdir}"], cwd=REPO_ROOT)
    assert again.returncode == 2 and "finished run" in again.stderr


def test_a_run_that_diverges_exits_2_with_the_error_and_no_record(tmp_path):
    """Runtime faults (here a divergence; a corrupt checkpoint takes the same path) reach the
    user as `dpbench: error: ...` and exit status 2, not a traceback; no record is written."""
    workdir = tmp_path / "run"
    proc = run_guarded(
        [sys.executable, "-m", "dpbench.main", *[f"--gin_file={f}" for f in DIGITS],
         "--gin_bindings=optimize.optax.learning_rate = 1e38",
         "--gin_bindings=optimize.optax.momentum = 0.0", "--gin_bindings=train.epochs = 1",
         "--gin_bindings=train.checkpoint_every_steps = 1", f"--workdir={workdir}"],
        cwd=REPO_ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "dpbench: error: " in proc.stderr and "last good checkpoint is step" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (workdir / "run_record.json").exists()


@pytest.mark.parametrize("args,message", [
    (["train", "--bogus=1", "--workdir=unused"], "dpbench: error: unrecognized arguments: --bogus"),
    (["audit", "--bogus=1"], "dpbench: error: unrecognized arguments: --bogus"),  # 1: flagged
    (["check"], "give at least one --gin_file"),
])
def test_a_bad_or_missing_flag_exits_2_naming_it(args, message, tmp_path):
    proc = run_guarded([sys.executable, "-m", "dpbench.main", *args], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_shuffled_batches_are_flagged_in_the_record(tmp_path):
    record = run_in_process(tmp_path, bindings=["sampler.allow_shuffled_batches = True",
                                                "train.epochs = 1"])
    assert not record["privacy_statement"]["poisson_accounted"]
    assert "does NOT hold" in record["privacy_statement"]["statement"]


@pytest.mark.parametrize("bindings,error,match", [
    (["EPSILON = 0.0"], accounting.BudgetError, "budget.epsilon"),
    (["EPSILON = -2.0"], accounting.BudgetError, "budget.epsilon"),
    (["EPSILON = 1e999"], accounting.BudgetError, "budget.epsilon must be a finite"),
    (["DELTA = 0.0"], accounting.BudgetError, "budget.delta"),
    (["DELTA = 0.01"], accounting.BudgetError, r"budget.delta must lie in \(0, 1/N\)"),
    (["train.batch_size = 100000"], ValueError, r"q = batch_size / N"),
    (["clip.global_l2.l2_bound = 0.0"], ValueError, "l2_bound must be a positive"),
    (["clip.global_l2.l2_bound = -1.0"], ValueError, "l2_bound must be a positive"),
    (["dataset.name = 'imagenette'"], ValueError, "unknown dataset 'imagenette'"),
    (["model.name = 'resnet9000'"], ValueError, "unknown model 'resnet9000'"),
    (["STAGES = [@grad.per_example(), @clip.global_l3(), @noise.gaussian(), "
      "@optimize.optax()]"], config.ConfigError, "known stages: .*clip.global_l2"),
    (["clip.global_l2.l2_bond = 1.0"], config.ConfigError, "l2_bond"),
    (["STAGES = [@grad.per_example(), @noise.gaussian(), @clip.global_l2(), "
      "@optimize.optax()]"], compiler.PipelineError, "'noise.gaussian'"),
])
def test_bad_input_fails_before_training_with_what_to_change(tmp_path, bindings, error, match):
    with pytest.raises(error, match=match):
        run_in_process(tmp_path, bindings=bindings)
    assert not (tmp_path / "run").exists()  # nothing trained, no empty workdir left behind


def test_missing_fashion_mnist_files_name_the_install_command(tmp_path, monkeypatch):
    from dpbench import data
    monkeypatch.setattr(data, "_load_via_tfds", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("no network")))
    with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"):
        run_in_process(tmp_path, files=["pipelines/dpsgd/pipeline.gin"],
                       bindings=[f"dataset.data_dir = '{tmp_path}'"])


def test_missing_gin_file_is_a_clear_error():
    with pytest.raises(config.ConfigError, match="not found.*pipelines/<name>/pipeline.gin"):
        config.parse_config(["pipelines/nope.gin"], [])


@pytest.mark.parametrize("files,bindings,hint", [
    (["pipelines/dpsgd"], ["train.epoch = 3"], "did you mean 'epochs'? train takes: batch_size"),
    (["pipelines/dpsgd"], ["clip.global_l2.l2_bond = 1.0"],
     "did you mean 'l2_bound'? clip.global_l2 takes: l2_bound"),
    (["pipelines/dpsgd"], ["tran.epochs = 3"], "did you mean 'train'?"),
    (["pipelines/dpsdg"], [], "did you mean 'pipelines/dpsgd'?"),
    (["pipelines/dpsgd"], ["wrn.depth = 10"], "wrn.* moved: the WRN reads model.*"),
])
def test_a_misspelt_name_gets_the_nearest_real_one(files, bindings, hint):
    """A typo in a parameter, a configurable or a method folder names the nearest real name;
    a parameter's error lists that configurable's parameters, not every stage."""
    with pytest.raises(config.ConfigError) as error:
        config.parse_config(files, bindings)
    assert hint in str(error.value)
    if "takes:" in hint:
        assert "known stages" not in str(error.value)


def test_a_method_folder_stands_for_its_pipeline_file():
    config.parse_config(["pipelines/rs", "gin/data/digits.gin"], [])
    assert config.pipeline_stages()[0] == "rs"


def _cli(monkeypatch, *args) -> int:
    from dpbench import main
    monkeypatch.setattr(sys, "argv", ["dpbench", *args])
    with pytest.raises(SystemExit) as done:
        main.run()
    return done.value.code


@pytest.mark.parametrize("args,code", [((), 2), (("help",), 0), (("--help",), 0)])
def test_the_cli_lists_its_commands(args, code, monkeypatch, capsys):
    assert _cli(monkeypatch, *args) == code
    out = capsys.readouterr()
    text = out.out + out.err
    for command in ("train", "audit", "sweep", "board"):
        assert f"\n  {command} " in text
    assert "dpbench COMMAND --help" in text


def test_an_unknown_command_says_which_exist(monkeypatch, capsys):
    assert _cli(monkeypatch, "trian", "--workdir=x") == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and "\n  train " in err


@pytest.mark.parametrize("command,flag,default", [
    ("train", "--workdir", None), ("train", "--gin_file", "(default: [])"),
    ("board", "--records", f"(default: {REPO_ROOT / 'leaderboard' / 'v4' / 'records'})"),
    ("board", "--out", "(default: the folder holding --records)"),
    ("audit", "--claimed_epsilon", "(default: 3.0)"), ("sweep", "--runs_dir", "(default: "),
    ("check", "--gin_bindings", "(default: [])")])
def test_each_commands_help_gives_its_flags_with_their_defaults(command, flag, default,
                                                                 monkeypatch, capsys):
    assert _cli(monkeypatch, command, "--help") == 0
    text = " ".join(capsys.readouterr().out.split())
    assert flag in text
    if default:
        assert default in text


@pytest.fixture
def absl_standard_flags():
    """absl's standard flags as they were: a test that sets -v or --alsologtostderr restores
    them (they are process-wide)."""
    from absl import flags, logging
    saved = {name: flags.FLAGS[name].value for name in ("verbosity", "alsologtostderr")}
    yield flags.FLAGS
    for name, value in saved.items():
        flags.FLAGS[name].value = value
    logging.set_verbosity(logging.INFO)


@pytest.mark.parametrize("command,more", [
    ("train", ["--workdir=somewhere"]), ("check", []), ("audit", ["--trials=7"]),
    ("sweep", ["--cpus=3"]), ("board", ["--records=recs"])])
def test_every_command_takes_absls_standard_flags(command, more, tmp_path, absl_standard_flags):
    """An absl main: --flagfile (its lines expanded into the command line), --alsologtostderr
    and -v reach every command's parser; an unknown flag still exits 2 naming it."""
    from dpbench import main
    flagfile = tmp_path / "flags.txt"
    flagfile.write_text("# a comment\n" + "".join(f"{line}\n" for line in more))
    parse, _ = main._entry(command)
    args = parse([f"--flagfile={flagfile}", "--alsologtostderr", "-v", "1"])
    assert absl_standard_flags.verbosity == 1 and absl_standard_flags.alsologtostderr
    expected = {"train": ("workdir", "somewhere"), "check": ("gin_file", []),
                "audit": ("trials", 7), "sweep": ("cpus", 3), "board": ("records", "recs")}
    name, value = expected[command]
    assert getattr(args, name) == value
    with pytest.raises(SystemExit) as done:
        parse(["--no_such_flag=1"])
    assert done.value.code == 2


def test_a_flagfile_holds_a_pipeline_for_the_cli(tmp_path):
    """`dpbench check --flagfile=F` with F holding --gin_file lines, as a launcher passes it,
    next to absl's logging flags: the pipeline is read from F; a missing F exits 2."""
    flagfile = tmp_path / "flags.txt"
    flagfile.write_text("".join(f"--gin_file={REPO_ROOT / f}\n" for f in DIGITS))
    proc = run_guarded([sys.executable, "-m", "dpbench.main", "check", f"--flagfile={flagfile}",
                        "--alsologtostderr", "-v", "1"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "pipeline dpsgd: every declaration holds" in proc.stdout
    missing = run_guarded([sys.executable, "-m", "dpbench.main", "check",
                           f"--flagfile={tmp_path / 'nowhere.txt'}"], cwd=tmp_path)
    assert missing.returncode == 2 and "Unable to open flagfile" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_a_pipeline_run_from_a_users_own_folder_logs_no_error(tmp_path, monkeypatch, caplog):
    """Run from a researcher's folder, a pipeline's includes (gin/base.gin, ...) resolve under
    the repository after gin's reader misses them under the cwd; that miss was logged as
    'ERROR:root:Path not found' on every run, a false alarm, and each path tried as an INFO
    line. An include missing everywhere is still the clear error."""
    import logging
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO)
    config.parse_config(["pipelines/dpsgd", "gin/data/digits.gin"], [])
    assert config.pipeline_stages()[0] == "dpsgd"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "system_path_file_exists" not in caplog.text  # gin's search, path by path
    (tmp_path / "broken.gin").write_text("include 'gin/nowhere.gin'\n")
    with pytest.raises(config.ConfigError, match="nowhere.gin"):
        config.parse_config(["broken.gin"], [])


@pytest.mark.parametrize("where", ["repository", "elsewhere"])
def test_a_missing_include_exits_2_naming_the_file_for_train_and_audit(where, tmp_path):
    """An include of a file that does not exist, under a folder that does (`pipelines/`: from
    the repository root gin's package-path reader took it for a namespace package and failed
    with a TypeError traceback, exit 1, which `dpbench audit` reserves for 'flagged'): exit 2
    and the missing file named, from the repository root and from anywhere else."""
    (tmp_path / "broken.gin").write_text("include 'pipelines/no_such_method.gin'\n")
    cwd = REPO_ROOT if where == "repository" else tmp_path
    gin_file = f"--gin_file={tmp_path / 'broken.gin'}"
    for args in ([gin_file, f"--workdir={tmp_path / 'run'}"], ["audit", gin_file]):
        proc = run_guarded([sys.executable, "-m", "dpbench.main", *args], cwd=cwd)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert "pipelines/no_such_method.gin" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_an_include_that_exists_is_found_when_the_repository_is_importable(tmp_path,
                                                                             monkeypatch):
    """The repository root on sys.path (PYTHONPATH=<checkout>, or `python -m` from the root)
    makes `pipelines/` an importable namespace package: gin's package-path reader crashed on
    it before looking in the next search path, so an include of a file that exists was
    reported missing. From any other folder, the include is found."""
    import gin
    (tmp_path / "mine.gin").write_text("include 'pipelines/rs/pipeline.gin'\n"
                                       "include 'gin/data/digits.gin'\n")
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    monkeypatch.chdir(tmp_path)
    config.parse_config(["mine.gin"], [])
    assert gin.query_parameter("pipeline.name") == "rs"
    (tmp_path / "broken.gin").write_text("include 'pipelines/no_such_method.gin'\n")
    with pytest.raises(config.ConfigError, match="pipelines/no_such_method.gin"):
        config.parse_config(["broken.gin"], [])


def test_ctrl_c_says_how_to_resume_instead_of_a_traceback(tmp_path):
    """SIGINT (Ctrl-C) in the middle of training: exit 130 with one line saying how to go on
    (the same command resumes from the last checkpoint), not a KeyboardInterrupt traceback."""
    import signal
    import time
    from dpbench import checkpoint
    workdir = tmp_path / "run"
    # the run starts as a terminal's foreground command does, Ctrl-C at its default: a test
    # process may have inherited or set SIGINT ignored (an ignored signal stays ignored across
    # exec, and dpbench rightly leaves an ignored SIGINT ignored: a background job)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpbench.main", *[f"--gin_file={f}" for f in DIGITS],
         "--gin_bindings=train.epochs = 50", "--gin_bindings=train.log_every_steps = 1",
         "--gin_bindings=train.checkpoint_every_steps = 2", f"--workdir={workdir}"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    start = time.monotonic()
    while not checkpoint.manifested_steps(workdir / "checkpoints"):  # a checkpoint is saved
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        if time.monotonic() - start > HANG_GUARD_S:
            proc.kill()
            pytest.fail(f"hung: no checkpoint in {HANG_GUARD_S} s")
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out = wait_guarded(proc, "the interrupted run")
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert "interrupted; rerun the same command to resume" in out and "at step " in out
    assert not (workdir / "run_record.json").exists()


def test_a_background_job_starts_with_ctrl_c_ignored_and_the_ctrl_c_test_undoes_it():
    """Why the Ctrl-C test once failed by test order: a non-interactive shell starts an
    asynchronous command (``cmd &``: a CI harness, ``nohup ... &``) with SIGINT ignored (POSIX),
    an ignored signal stays ignored across exec, and so the pytest process, its xdist workers
    and every child they start ignore Ctrl-C. The test's child restores the default (its
    ``preexec_fn``); dpbench leaves an inherited SIG_IGN alone, as a background job should."""
    probe = ("import signal; print('ignored' if signal.getsignal(signal.SIGINT) == "
             "signal.SIG_IGN else 'default')")
    launcher = ("import signal, subprocess, sys; subprocess.run([sys.executable, '-c', "
                f"{probe!r}], preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))")

    def in_background(code: str) -> str:
        return subprocess.run(["bash", "-c", f'"$0" -c "$1" & wait', sys.executable, code],
                              capture_output=True, text=True, timeout=60).stdout.strip()

    assert in_background(probe) == "ignored"  # the inherited state (the check can fail)
    assert in_background(launcher) == "default"  # what the Ctrl-C test's child starts with


def test_ctrl_c_before_the_first_checkpoint_says_nothing_was_saved(tmp_path, monkeypatch,
                                                                   capsys):
    """Interrupted before any checkpoint, the message does not promise a resume."""
    from types import SimpleNamespace
    from dpbench import main
    from dpbench.run import trials

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trials, "train", interrupted)
    args = SimpleNamespace(workdir=str(tmp_path / "run"), gin_file=DIGITS, gin_bindings=[],
                           overwrite=False, trials=None)
    with pytest.raises(SystemExit) as done:
        main.main(args)
    assert done.value.code == 130
    assert "nothing was saved yet: rerun the same command to start" in capsys.readouterr().err
