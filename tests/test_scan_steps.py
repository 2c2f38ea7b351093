"""``scan_steps``: the runner trains several steps in one compiled program (a
``jax.lax.scan``; 0: as many as divide ``eval_every``, up to 10). A scanned run is
the step-by-step run, record for record (values to float32 rounding, bytes exact) with a
policy, a skipped NaN, chunked gradients, held state, checkpoints and resumption; a
program ends where the host needs the state (evaluation, policy, checkpoint, the last
step); a raised NaN names its very step; MPI ranks and ``jax.distributed`` processes scan
their own steps and give the simulated run's metrics."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import harness
import numpy as np
import pytest
from harness import QUICKSTART, assert_same_run, mpiexec, read_jsonl

from shoal.experiments.config import ConfigError
from shoal.experiments.overrides import apply_overrides, load_config
from shoal.experiments.runner import train as train_module
from shoal.experiments.runner.backends import SimBackend
from shoal.experiments.runner.checkpoint import Checkpointer
from shoal.experiments.runner.cli import main
from shoal.experiments.tasks import GaussianMixtureTask
from shoal.optim import NonFiniteGradientError

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="these tests start their own MPI")

WORKERS = 4
SETS = [
    f"workers={WORKERS}",
    "steps=12",
    "eval_every=5",
    "bmuf_gtc.block_size=4",
    "bmuf_gtc.group_size=2",
    "diloco.sync_every=4",
    "streaming_diloco.sync_every=4",
    "streaming_diloco.fragments=2",
    "streaming_diloco.overlap=1",
    "onebit_lamb.freeze_step=4",
    "adaptive.every=4",
    "adaptive.after=0",
    "adaptive.threshold=0",
    "project_workers=0",
    "inject_nonfinite=3:1",
]
# A flat exchange, a two-tier one, a staged optimizer, a policy that rebuilds the step,
# and state held once.
ALGORITHMS = ("ssgd", "bmuf_gtc", "onebit_lamb", "adaptive", "diloco", "streaming_diloco")


@pytest.fixture(scope="module")
def setup():
    cfg = apply_overrides(load_config(QUICKSTART), SETS)
    return cfg, GaussianMixtureTask(cfg)


def assert_same_records(a: list[dict], b: list[dict]) -> None:
    assert [(r["algorithm"], r["step"]) for r in a] == [(r["algorithm"], r["step"]) for r in b]
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x.keys() - {"time_s"}:
            if isinstance(x[key], float):
                np.testing.assert_allclose(y[key], x[key], rtol=1e-5, atol=1e-6, err_msg=key)
            else:
                assert y[key] == x[key], key


def chunks_of(monkeypatch) -> list[tuple[int, int]]:
    """The (first, last) steps of every program `train` runs from now on."""
    seen = []
    original = train_module._Run.run_steps

    def spy(self, first, last):
        seen.append((first, last))
        return original(self, first, last)

    monkeypatch.setattr(train_module._Run, "run_steps", spy)
    return seen


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_scanned_run_is_the_step_by_step_run(setup, algorithm, monkeypatch):
    cfg, task = setup
    backend = SimBackend(WORKERS)
    plain = train_module.train(
        dataclasses.replace(cfg, scan_steps=1), task, backend, algorithm, progress=False
    )
    chunks = chunks_of(monkeypatch)
    scanned = train_module.train(
        dataclasses.replace(cfg, scan_steps=4), task, backend, algorithm, progress=False
    )
    assert_same_records(plain.records, scanned.records)
    assert scanned.records[2]["skipped"] == 1  # the NaN of step 3, inside a program
    # Evaluations after steps 5 and 10; adaptive's policy asked after steps 4 and 8.
    ends = [4, 5, 8, 10, 12] if algorithm == "adaptive" else [4, 5, 9, 10, 12]
    assert [last for _, last in chunks] == ends
    assert [first for first, _ in chunks] == [1, *(e + 1 for e in ends[:-1])]


def test_chunked_gradients_scan_too(setup):
    cfg, task = setup
    backend = SimBackend(WORKERS)
    runs = [
        train_module.train(
            dataclasses.replace(cfg, grad_chunk=2, scan_steps=k),
            task,
            backend,
            "bmuf_gtc",
            progress=False,
        )  # fmt: skip
        for k in (1, 6)
    ]
    assert_same_records(runs[0].records, runs[1].records)


def test_programs_end_at_checkpoints_and_resume_alike(setup, tmp_path, monkeypatch):
    cfg, task = setup
    cfg = dataclasses.replace(cfg, scan_steps=4, checkpoint_every=6)
    backend = SimBackend(WORKERS)
    whole = train_module.train(
        dataclasses.replace(cfg, scan_steps=1), task, backend, "diloco", progress=False
    )
    chunks = chunks_of(monkeypatch)
    ckpt = Checkpointer(tmp_path, "diloco", cfg, backend)
    first = train_module.train(cfg, task, backend, "diloco", progress=False, checkpoints=ckpt,
                               max_steps=7)  # fmt: skip
    # Hand-computed: 1-4, 5 (evaluation), 6 (checkpoint), 7 (the stop: max_steps).
    assert chunks == [(1, 4), (5, 5), (6, 6), (7, 7)]
    assert not first.finished and ckpt.steps() == [7, 6]
    chunks.clear()
    rest = train_module.train(cfg, task, backend, "diloco", progress=False, checkpoints=ckpt,
                              resume=True)  # fmt: skip
    assert chunks == [(8, 10), (11, 12)]
    assert_same_records(whole.records, rest.records)


def test_nonfinite_raise_names_the_very_step(setup, monkeypatch):
    """The NaN of step 3 stops the program of steps 1-4; the runner runs them again one
    program each, from the same state, and names step 3."""
    cfg, task = setup
    cfg = dataclasses.replace(cfg, scan_steps=4, nonfinite="raise")
    chunks = chunks_of(monkeypatch)
    with pytest.raises(NonFiniteGradientError, match="^step 3: NaN/Inf in the gradient of 1 of"):
        train_module.train(cfg, task, SimBackend(WORKERS), "ssgd", progress=False)
    assert chunks == [(1, 4), (1, 1), (2, 2), (3, 3)]


def test_automatic_scan_steps_divide_eval_every():
    auto = dataclasses.replace(load_config(QUICKSTART), scan_steps=0)
    steps = lambda **kw: dataclasses.replace(auto, **kw).steps_per_program()
    assert steps(eval_every=25) == 5  # the quickstart's: 200 steps in programs of 5
    assert steps(eval_every=100) == 10 and steps(eval_every=7) == 7 and steps(eval_every=11) == 1
    assert steps(eval_every=100, scan_steps=3) == 3
    assert load_config(QUICKSTART).steps_per_program() == 1  # the default: a program per step


def test_negative_scan_steps_are_refused(tmp_path, capsys):
    with pytest.raises(ConfigError, match="'scan_steps' must be an int >= 0"):
        apply_overrides(load_config(QUICKSTART), ["scan_steps=-1"])
    args = [str(QUICKSTART), "--no-progress", "--out", str(tmp_path), "--set", "scan_steps=-2"]
    assert main(args) == 2
    assert "scan_steps" in capsys.readouterr().err


SMALL = ["--workers", str(WORKERS), "--no-progress", "--set", *SETS[1:],
         "algorithms=ssgd,bmuf_gtc,diloco"]  # fmt: skip


@pytest.mark.parametrize("backend", ["mpi", "jax"])
def test_ranks_and_processes_scan_their_own_steps(backend, tmp_path):
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    sim_out, out = tmp_path / "sim", tmp_path / backend
    assert main([str(QUICKSTART), *SMALL, "scan_steps=1", "--out", str(sim_out)]) == 0
    cli = [sys.executable, "-m", "shoal.experiments.runner.cli", str(QUICKSTART)]
    cmd = [exe, "-n", str(WORKERS), *cli, "--backend", backend, *SMALL, "scan_steps=4",
           "--out", str(out)]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    sim, other = read_jsonl(sim_out / "metrics.jsonl"), read_jsonl(out / "metrics.jsonl")
    assert_same_run(other, sim, 3)
    assert [r.get("skipped") for r in other if r["step"] == 3] == [1, 1, 1]
