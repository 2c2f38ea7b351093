"""``grad_chunk``: the simulation runner computes the workers' gradients K workers at a
time (``jax.lax.map``) and still runs the update, which communicates, on all workers at
once. A run must be the run with all gradients at once; anything but the sim backend, or a
K that does not divide the workers, is refused naming ``grad_chunk``."""

from __future__ import annotations

import dataclasses

import harness
import jax
import numpy as np
import pytest
from harness import QUICKSTART

from shoal.experiments import algorithms
from shoal.experiments.config import ConfigError
from shoal.experiments.overrides import apply_overrides, load_config
from shoal.experiments.runner.backends import SimBackend
from shoal.experiments.runner.cli import main
from shoal.experiments.runner.train import compile_step, train
from shoal.experiments.tasks import GaussianMixtureTask

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="simulated workers only")

WORKERS = 8
CHUNK = 2
# Eight steps of every quickstart algorithm: two BMUF blocks (and DiLoCo rounds), 1-bit
# LAMB compressing from step 5, adaptive's policy asked at step 4 (threshold 0: it switches
# to PGX), and a NaN in worker 5's gradient at step 3 (skipped on every worker), so every
# path of the step runs.
SETS = [
    f"workers={WORKERS}",
    "steps=8",
    "eval_every=4",
    "bmuf.block_size=4",
    "bmuf_gtc.block_size=4",
    "diloco.sync_every=4",
    "muloco.sync_every=4",
    "streaming_diloco.sync_every=4",
    "onebit_lamb.freeze_step=4",
    "adaptive.every=4",
    "adaptive.after=0",
    "adaptive.threshold=0",
    "project_workers=0",
    "inject_nonfinite=3:5",
]


@pytest.fixture(scope="module")
def setup():
    cfg = apply_overrides(load_config(QUICKSTART), SETS)
    return cfg, GaussianMixtureTask(cfg)


# Chunking changes how the gradients are computed, not the update that follows: a flat
# exchange, a two-tier one, a staged optimizer and a policy that rebuilds the step.
@pytest.mark.parametrize("algorithm", ["ssgd", "bmuf_gtc", "onebit_lamb", "adaptive"])
def test_chunked_run_equals_the_run_of_all_workers_at_once(setup, algorithm):
    cfg, task = setup
    backend = SimBackend(WORKERS)
    whole, chunked = (
        train(dataclasses.replace(cfg, grad_chunk=k), task, backend, algorithm, progress=False)
        for k in (0, CHUNK)
    )
    assert [r["step"] for r in chunked.records] == list(range(1, cfg.steps + 1))
    assert chunked.records[2]["skipped"] == 1  # the injected NaN was seen and skipped
    if algorithm == "adaptive":
        assert chunked.records[3]["policy"] == whole.records[3]["policy"]
    for a, b in zip(whole.records, chunked.records):
        assert a.keys() == b.keys()
        for key in a.keys() - {"time_s"}:
            if isinstance(a[key], float):
                np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-6, err_msg=key)
            else:
                assert b[key] == a[key], key
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(chunked.params)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_gradients_run_in_chunks_of_k_workers(setup):
    """The compiled step maps over WORKERS / CHUNK chunks, each CHUNK workers under vmap."""
    cfg, task = setup
    backend = SimBackend(WORKERS)
    tx = algorithms.resolve("ssgd", cfg).build(backend.collective)
    params = backend.replicate(task.init_params())
    x, y = task.batch(0, WORKERS)
    args = (params, backend.spmd(tx.init)(params), x, y)
    step = compile_step(backend, task.loss, tx, grad_chunk=CHUNK)
    jaxpr = jax.make_jaxpr(step)(*args)
    scans = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "scan"]
    assert [s.params["length"] for s in scans] == [WORKERS // CHUNK]
    body = scans[0].params["jaxpr"].jaxpr
    shapes = [v.aval.shape for v in body.outvars]
    assert all(s[0] == CHUNK for s in shapes), shapes  # K workers' loss and gradients
    whole = compile_step(backend, task.loss, tx)
    assert not [e for e in _eqns(jax.make_jaxpr(whole)(*args).jaxpr) if e.primitive.name == "scan"]


def _eqns(jaxpr):
    """Every equation of ``jaxpr``, inside nested jits (pjit) too."""
    for e in jaxpr.eqns:
        yield e
        if e.primitive.name in ("pjit", "jit"):
            yield from _eqns(e.params["jaxpr"].jaxpr)


class _Backend:
    """What `train` reads of a backend before it refuses grad_chunk."""

    def __init__(self, name: str, size: int):
        self.name, self.size = name, size


@pytest.mark.parametrize("name", ["mpi", "jax"])
def test_train_refuses_grad_chunk_off_the_sim_backend(setup, name):
    cfg, task = setup
    with pytest.raises(ConfigError, match=rf"grad_chunk = 2 .*--backend sim.*--backend {name}"):
        train(dataclasses.replace(cfg, grad_chunk=2), task, _Backend(name, WORKERS), "ssgd")


def test_train_refuses_grad_chunk_that_does_not_divide_the_workers(setup):
    cfg, task = setup
    with pytest.raises(ConfigError, match="grad_chunk = 3 must divide the number of workers 8"):
        train(dataclasses.replace(cfg, grad_chunk=3), task, SimBackend(WORKERS), "ssgd")


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--workers", "8", "--set", "grad_chunk=3"], ["grad_chunk = 3", "workers 8"]),
        (["--set", "grad_chunk=-1"], ["'grad_chunk'", ">= 0"]),
    ],
)
def test_cli_error_names_grad_chunk(argv, words, capsys, tmp_path):
    assert main([str(QUICKSTART), *argv, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shoal-run: error:") and len(err.splitlines()) == 1, err
    assert all(w in err for w in words), err
    assert not (tmp_path / "run").exists()


def test_cli_refuses_grad_chunk_with_mpi(monkeypatch, capsys, tmp_path):
    """With ``--backend mpi`` the refusal comes before any training (a stand-in backend of
    four ranks, so no MPI job is needed)."""

    class Ranks(_Backend):
        is_root, is_server, servers = True, False, None

        def agree(self, problem):  # every rank finds the same problem
            return problem

    monkeypatch.setattr(
        "shoal.experiments.runner.cli.make_backend", lambda *a, **k: Ranks("mpi", 4)
    )
    monkeypatch.setattr("shoal.experiments.runner.cli.mpi_world_size", lambda: 4)
    monkeypatch.setattr("shoal.experiments.runner.cli.world_agree", lambda problem: problem)
    argv = [str(QUICKSTART), "--backend", "mpi", "--set", "grad_chunk=2"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "shoal-run: error: grad_chunk = 2 applies to simulated workers only" in err, err
    assert not (tmp_path / "run").exists()


def test_study_refuses_grad_chunk_before_training(capsys, tmp_path):
    """A study's runs are checked (and resolved) once, all before the first one trains."""
    out = tmp_path / "study"
    assert main(["acoustic_study", "--set", "grad_chunk=3", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shoal-run: error:") and len(err.splitlines()) == 1, err
    assert "grad_chunk = 3" in err, err
    assert not out.exists()
