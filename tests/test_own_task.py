"""Your own model and data in ``shoal-run``: a task from ``--task module:factory`` or a
config file's ``get_task`` trains with every runner feature (simulated and MPI workers
that agree, checkpoints and a bitwise ``--resume``, named test metrics), and a task that
breaks the contract is refused in one line naming what is wrong."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from harness import QUICKSTART, UNDER_MPI, assert_same_run, mpiexec, read_jsonl

from shoal.experiments.runner.cli import main

OWN = Path(__file__).resolve().parents[1] / "examples" / "own_model.py"
# The example at a size that trains in seconds, S-SGD and DiLoCo (the example's MuLoCo is
# DiLoCo with another inner optimizer: tests/test_muloco.py); evaluations at steps 5, 10, 15.
SMALL_OWN = ["--no-progress", "--set", "steps=15", "eval_every=5", "algorithms=ssgd,diloco",
             "diloco.sync_every=5", "width=32", "depth=1", "heads=2", "context=16",
             "train_size=512", "test_size=128", "batch_size=8"]  # fmt: skip
LINE = [str(QUICKSTART), "--task", "own_tasks:line", "--workers", "2", "--no-progress",
        "--set", "algorithms=ssgd", "ssgd.local.momentum=0", "ssgd.local.learning_rate=0.1",
        "project_workers=0"]  # fmt: skip


def test_a_task_from_a_module_trains_and_records_its_own_metrics(tmp_path, capsys):
    out = tmp_path / "run"
    sets = ["steps=40", "eval_every=40", "project_workers=16"]  # projected on 2 nodes of 8
    assert main([*LINE, "--set", *sets, "--out", str(out)]) == 0
    assert "projected" in (out / "summary.md").read_text()
    (last,) = [r for r in read_jsonl(out / "metrics.jsonl") if "test_loss" in r]
    # The weights reach 2 (least squares on y = 2 x): the task's own metric says how near.
    assert last["test_loss"] < 1e-3 and last["test_accuracy"] == 1.0
    assert last["test_distance"] == pytest.approx(last["test_loss"] ** 0.5)
    assert "test_distance" in (out / "metrics.csv").read_text().splitlines()[0]


def test_a_study_of_an_own_task(tmp_path, capsys):
    study = tmp_path / "line_study.py"
    study.write_text(
        "from shoal.experiments.config import Config\n"
        "from shoal.experiments.runner.study import Row, Study, Table\n"
        "def get_config():\n"
        "    local = {'local': {'momentum': 0.0, 'learning_rate': 0.1}}\n"
        "    cfg = Config(name='line_study', batch_size=8, train_size=64,\n"
        "                 params={'ssgd': local, 'sma': local})\n"
        "    rows = (Row(('S-SGD',), 2, 'ssgd'), Row(('model averaging',), 2, 'sma'))\n"
        "    return Study(cfg, (Table('line', ('method',), rows),), epochs=2,\n"
        "                 baseline=Row(('SGD',), 1, 'ssgd'))\n"
    )
    out = tmp_path / "out"
    assert main([str(study), "--task", "own_tasks:line", "--no-progress", "--out", str(out)]) == 0
    summary = (out / "summary.md").read_text()
    assert "| S-SGD |" in summary and "| model averaging |" in summary
    assert "misfit" in summary  # the task's error_name heads the error column
    # The baseline (1 worker, 16 steps) fits exactly: no relative reduction is defined.
    assert "| 100.00% | n/a |" in summary


@pytest.mark.parametrize(
    "factory, words",
    [
        ("no_worker_axis", ["batch(0, 2)", "leading axis must be over the 2 workers"]),
        ("integer_params", ["init_params()", "int32", "floating point"]),
        ("not_a_task", ["has no init_params, loss, batch, evaluate"]),
        ("missing", ["own_tasks defines no callable missing"]),
    ],
)
def test_a_broken_task_is_refused_in_one_line(factory, words, tmp_path, capsys):
    args = [LINE[0], "--task", f"own_tasks:{factory}", *LINE[3:], "--set", "steps=2"]
    assert main([*args, "--out", str(tmp_path / "run")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("shoal-run: error: task own_tasks:") or "'own_tasks:" in line
    for w in words:
        assert w in line, line


def test_resume_of_an_own_task_is_bitwise(tmp_path, capsys):
    base = [str(OWN), "--workers", "2", *SMALL_OWN, "checkpoint_every=5"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main([*base, "--out", str(whole)]) == 0
    assert main([*base, "--out", str(parts), "--stop-after", "20"]) == 0  # mid-diloco
    assert main([*base, "--out", str(parts), "--resume"]) == 0
    assert (parts / "metrics.jsonl").read_bytes() == (whole / "metrics.jsonl").read_bytes()
    # The config file's own fields are compared on resume like the others.
    assert main([*base, "--set", "width=16", "--out", str(parts), "--resume"]) == 2
    assert "config field 'width' is 16 now but 32" in capsys.readouterr().err


@pytest.mark.skipif(UNDER_MPI, reason="starts its own mpiexec job")
def test_own_model_under_mpi_agrees_with_simulated_workers(tmp_path):
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    sim = tmp_path / "sim"
    assert main([str(OWN), "--workers", "2", *SMALL_OWN, "--out", str(sim)]) == 0
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [exe, "-n", "2", sys.executable, "-m", "shoal.experiments.runner.cli", str(OWN),
           "--backend", "mpi", *SMALL_OWN, "--out", str(tmp_path / "mpi")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    mpi_records = read_jsonl(tmp_path / "mpi" / "metrics.jsonl")
    sim_records = read_jsonl(sim / "metrics.jsonl")
    assert_same_run(mpi_records, sim_records, runs=2)
    np.testing.assert_allclose([r["test_perplexity"] for r in mpi_records if "test_loss" in r],
                               [r["test_perplexity"] for r in sim_records if "test_loss" in r],
                               rtol=1e-5)  # fmt: skip
