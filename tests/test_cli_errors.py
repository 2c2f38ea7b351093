"""``shoal-run`` configuration and command-line errors: exit status 2 and exactly one line
on stderr, ``shoal-run: error: ...`` naming the bad key or value, never a traceback.

In-process through `cli.main` (fast), plus a few end-to-end runs of the console script in
a subprocess, where an uncaught exception would really print a traceback."""

import os
import subprocess
import sys

import harness
import pytest

from shoal.experiments.runner.cli import main

QUICKSTART = str(harness.QUICKSTART)
PREFIX = "shoal-run: error:"

# (argv after the config, words the error line must contain)
CASES = {
    "unknown key": (["--set", "stepz=5"], ["'stepz'", "did you mean 'steps'"]),
    "unknown nested entry key": (["--set", "algorithms=gtc[foo=1]"], ["'foo'"]),
    "malformed --set": (["--set", "steps"], ["key=value", "'steps'"]),
    "wrong type int": (["--set", "steps=abc"], ["steps", "'abc'", "int"]),
    "wrong type float in entry": (
        ["--set", "algorithms=gtc[threshold=abc]"],
        ["threshold", "'abc'", "float"],
    ),
    "wrong type bool": (["--set", "bmuf.nesterov=maybe"], ["bmuf.nesterov", "'maybe'"]),
    "not a choice": (["--set", "task=foo"], ["task", "'foo'", "mixture"]),
    "invalid value": (["--set", "steps=0"], ["steps=0", "'steps'", ">= 1"]),
    "invalid float range": (["--set", "gtc.capacity=2"], ["'gtc'", "capacity", "(0, 1]"]),
    "old flat key": (["--set", "gtc_threshold=0.2"], ["'gtc_threshold'", "gtc.threshold"]),
    "old flat key in entry": (
        ["--set", "algorithms=gtc[gtc_threshold=0.2]"],
        ["'gtc_threshold'", "gtc[threshold=...]"],
    ),
    "unknown algorithm": (["--set", "algorithms=nope"], ["'nope'", "registered"]),
    "group_size does not divide workers": (
        ["--set", "algorithms=bmuf_gtc", "bmuf_gtc.group_size=3", "--workers", "4"],
        ["bmuf_gtc", "group_size = 3", "workers 4"],
    ),
    "entry group_size does not divide workers": (
        ["--set", "algorithms=bmuf_gtc[group_size=3]", "--workers", "4"],
        ["bmuf_gtc[group_size=3]", "group_size = 3", "workers 4"],
    ),
    "peer averaging needs two workers": (
        ["--set", "algorithms=peer_averaging", "--workers", "1"],
        ["peer_averaging", "at least 2 workers"],
    ),
    "zero workers": (["--workers", "0"], ["--workers", "0"]),
    "zero workers via --set": (["--set", "workers=0"], ["workers=0", "'workers'"]),
    "servers without mpi": (["--servers", "2"], ["--servers", "--backend mpi"]),
    "devices per worker without jax": (
        ["--devices-per-worker", "2"],
        ["--devices-per-worker 2", "--backend jax", "--backend sim"],
    ),
    "devices per worker with mpi": (
        ["--devices-per-worker", "2", "--backend", "mpi"],
        ["--devices-per-worker 2", "--backend jax", "--backend mpi"],
    ),
    "zero devices per worker": (["--devices-per-worker", "0"], ["--devices-per-worker 0", ">= 1"]),
    "seeds and --set seed": (["--seeds", "0,1", "--set", "seed=3"], ["--seeds 0,1", "seed=3"]),
    "sweep of a missing path": (
        ["--sweep", "outer.learning_rate=0.1,0.7", "--set", "algorithms=ssgd"],
        ["--sweep outer.learning_rate", "ssgd has no"],
    ),
    "sweep with resume": (
        ["--sweep", "learning_rate=0.1,0.2", "--resume"],
        ["--resume", "--sweep"],
    ),
    "sweep fraction": (["--sweep", "learning_rate=0.1,0.2", "--sweep-fraction", "0"], ["(0, 1]"]),
    "validation larger than the training set": (
        ["--set", "validation_size=9000"],
        ["validation_size", "train_size = 8192"],
    ),
}


def run_main(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, out, err, words):
    assert "Traceback" not in out + err
    assert code == 2
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(PREFIX), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.mark.parametrize("name", list(CASES))
def test_config_error_is_one_line(name, capsys, tmp_path):
    args, words = CASES[name]
    code, out, err = run_main([QUICKSTART, *args, "--out", str(tmp_path / "run")], capsys)
    assert_one_line_error(code, out, err, words)
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written


def test_missing_config_file_is_one_line(capsys, tmp_path):
    missing = str(tmp_path / "nope.py")
    code, out, err = run_main([missing], capsys)
    assert_one_line_error(code, out, err, [missing, "not found"])


def test_study_rejects_workers_in_one_line(capsys):
    code, out, err = run_main(["acoustic_study", "--workers", "4"], capsys)
    assert_one_line_error(code, out, err, ["study", "--workers"])


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--workers", "abc"], ["--workers", "'abc'"]),
        (["--seeds", "0,a"], ["--seeds", "'a'"]),
        (["--seeds", "1,2,1"], ["--seeds", "distinct", "repeated: 1"]),
        (["--sweep", "learning_rate"], ["--sweep", "KEY=V1,V2"]),
    ],
)
def test_argparse_type_error_names_the_option(args, words, capsys):
    """argparse's own errors (``--workers abc``) print the usage first, then one
    ``shoal-run: error:`` line: exit status 2, no traceback."""
    code, out, err = run_main([QUICKSTART, *args], capsys)
    assert code == 2 and "Traceback" not in out + err
    assert err.startswith("usage: shoal-run")
    last = err.strip().splitlines()[-1]
    assert last.startswith(PREFIX) and all(w in last for w in words), last


@pytest.mark.parametrize(
    "name", ["unknown key", "wrong type int", "group_size does not divide workers"]
)
def test_console_script_prints_no_traceback(name, tmp_path):
    args, words = CASES[name]
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.experiments.runner.cli", QUICKSTART, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, words)
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------ never lose work

TINY = ["--workers", "2", "--no-progress", "--set", "steps=2", "eval_every=2",
        "algorithms=ssgd", "project_workers=0"]  # fmt: skip


def test_non_empty_output_folder_is_refused(capsys, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "report.md").write_text("an earlier run's report")
    code, stdout, err = run_main([QUICKSTART, *TINY, "--out", str(out)], capsys)
    assert_one_line_error(code, stdout, err, [str(out), "not empty", "--overwrite", "--resume"])
    assert (out / "report.md").read_text() == "an earlier run's report"
    assert sorted(p.name for p in out.iterdir()) == ["report.md"]


def test_overwrite_replaces_an_earlier_run(capsys, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "report.md").write_text("an earlier run's report")
    code, _, err = run_main([QUICKSTART, *TINY, "--out", str(out), "--overwrite"], capsys)
    assert code == 0, err
    assert "an earlier run" not in (out / "report.md").read_text()
    # The same command again: the folder now holds results, so it needs --overwrite again.
    code, stdout, err = run_main([QUICKSTART, *TINY, "--out", str(out)], capsys)
    assert_one_line_error(code, stdout, err, [str(out), "not empty"])


def test_empty_output_folder_is_fine(capsys, tmp_path):
    code, _, err = run_main([QUICKSTART, *TINY, "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert (tmp_path / "metrics.jsonl").exists()


def test_output_path_that_is_a_file(capsys, tmp_path):
    out = tmp_path / "file"
    out.write_text("x")
    code, stdout, err = run_main([QUICKSTART, *TINY, "--out", str(out), "--overwrite"], capsys)
    assert_one_line_error(code, stdout, err, [str(out), "is a file"])


def test_resume_and_overwrite_together(capsys, tmp_path):
    argv = [QUICKSTART, *TINY, "--out", str(tmp_path), "--resume", "--overwrite"]
    code, stdout, err = run_main(argv, capsys)
    assert_one_line_error(code, stdout, err, ["--resume", "--overwrite"])


def test_study_output_folder_is_refused(capsys, tmp_path):
    (tmp_path / "summary.md").write_text("an earlier study")
    code, stdout, err = run_main(["acoustic_study", "--out", str(tmp_path)], capsys)
    assert_one_line_error(code, stdout, err, [str(tmp_path), "not empty", "--overwrite"])
    assert "--resume" not in err  # a study cannot resume
    assert (tmp_path / "summary.md").read_text() == "an earlier study"


def test_resume_without_checkpoint_names_the_folder(capsys, tmp_path):
    out = tmp_path / "run"
    code, stdout, err = run_main([QUICKSTART, *TINY, "--out", str(out), "--resume"], capsys)
    assert_one_line_error(code, stdout, err, [str(out / "checkpoints"), "no checkpoint"])
    # A finished run that saved no checkpoints has nothing to resume either.
    assert run_main([QUICKSTART, *TINY, "--out", str(out)], capsys)[0] == 0
    code, stdout, err = run_main([QUICKSTART, *TINY, "--out", str(out), "--resume"], capsys)
    assert_one_line_error(code, stdout, err, [str(out / "checkpoints"), "--resume"])


def test_missing_bundled_name_lists_the_bundled_configs(capsys):
    code, out, err = run_main(["quickstrat"], capsys)
    assert_one_line_error(code, out, err, ["quickstrat", "not found", "quickstart", "kungfu"])


def test_help_lists_the_bundled_configs(capsys):
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0
    for name in ("quickstart", "acoustic_study", "gtc_sweep", "kungfu"):
        assert name in out, name
    assert "__init__" not in out and "--overwrite" in out


def _alone(args, tmp_path, devices=1):
    """The console script with a multi-process backend but no launcher."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "shoal.experiments.runner.cli",
            "quickstart",
            *args,
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )


@pytest.mark.skipif(harness.UNDER_MPI, reason="needs a process outside mpiexec")
def test_mpi_backend_without_mpiexec(tmp_path):
    pytest.importorskip("mpi4py")
    # bmuf_gtc used to fail here on its group size, ssgd to train one worker silently.
    proc = _alone(["--backend", "mpi", "--set", "algorithms=bmuf_gtc"], tmp_path)
    sim = "shoal-run quickstart --set algorithms=bmuf_gtc --no-progress --workers 4"
    words = ["--backend mpi", "single MPI process", "mpiexec -n 4 shoal-run quickstart", sim]
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, words)
    assert not (tmp_path / "runs").exists()


@pytest.mark.skipif(harness.UNDER_MPI, reason="needs a process outside mpiexec")
def test_jax_backend_on_one_device(tmp_path):
    pytest.importorskip("mpi4py")
    proc = _alone(["--backend", "jax"], tmp_path)
    words = ["--backend jax", "one process with one device", "mpiexec -n 4", "--workers 4"]
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, words)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("key", ["seed=1", "steps=10", "batch_size=8", "hidden=16", "workers=2"])
def test_brackets_refuse_fields_of_the_whole_run(key, capsys):
    # They used to train with the run's values under a label that claimed otherwise.
    code, stdout, err = run_main([QUICKSTART, "--set", f"algorithms=ssgd,ssgd[{key}]"], capsys)
    name = key.split("=")[0]
    assert_one_line_error(code, stdout, err, [f"ssgd[{key}]", f"'{name}'", "whole run"])
