"""Elastic restart (`shoal.experiments.runner.elastic`): a checkpoint of 4 workers resumed
by 2 and by 6, simulated and under mpiexec. The rule by hand on small arrays; in the
runner, the error-feedback total kept exactly, shared state and kept workers bit for bit,
joiners on the global model, 4 -> 6 -> 4 the identity, and a resized run that trains on;
under MPI the same records as the simulated resize."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from harness import QUICKSTART, UNDER_MPI, assert_same_run, mpiexec

from shoal.experiments.config import Config
from shoal.experiments.runner import elastic
from shoal.experiments.runner.backends import SimBackend
from shoal.experiments.runner.checkpoint import Checkpointer
from shoal.experiments.runner.train import _Run, train
from shoal.experiments.tasks import make_task
from shoal.optim.helpers import error_feedback_mask
from shoal.optim.readouts import evaluation_params

pytestmark = pytest.mark.skipif(UNDER_MPI, reason="starts its own runs and mpiexec jobs")

# ---------------------------------------------------------------------------- the rule


def test_shrinking_moves_the_leavers_error_feedback_onto_the_stayers():
    params = [np.arange(5.0)[:, None]]
    ef = np.array([[1.0], [2.0], [4.0], [8.0], [16.0]])
    counter = np.full((5, 1), 7)
    p, (e, c) = elastic.resize(params, [ef, counter], 2, held=set(),
                               error_feedback=[True, False], joined=None)  # fmt: skip
    assert p[0].ravel().tolist() == [0.0, 1.0]  # the leavers' models go with them
    assert e.ravel().tolist() == [1 + 4 + 16, 2 + 8]  # worker i onto i mod 2
    assert e.sum() == ef.sum() and c.ravel().tolist() == [7, 7]


def test_growing_joins_on_the_global_model_with_no_debt():
    params = [np.array([[1.0, 2.0], [3.0, 4.0]])]
    ef, moments, shared = np.array([[0.5], [0.25]]), np.array([[10.0], [20.0]]), np.ones(3)
    joined = [np.array([2.0, 3.0])]
    p, (e, m, s) = elastic.resize(params, [ef, moments, shared], 5, held={2},
                                  error_feedback=[True, False, False], joined=joined)  # fmt: skip
    assert p[0].tolist() == [[1, 2], [3, 4], [2, 3], [2, 3], [2, 3]]
    assert e.ravel().tolist() == [0.5, 0.25, 0, 0, 0]
    assert m.ravel().tolist() == [10, 20, 10, 20, 10]  # a copy of worker i mod 2's
    assert s is shared  # held once: kept as it is


def test_growing_then_shrinking_back_is_the_identity():
    rng = np.random.default_rng(0)
    params, state = [rng.normal(size=(4, 3))], [rng.normal(size=(4, 2)), rng.normal(size=(4,))]
    flags = [True, False]
    joined = [params[0].mean(0)]
    p6, s6 = elastic.resize(params, state, 6, held=set(), error_feedback=flags, joined=joined)
    p4, s4 = elastic.resize(p6, s6, 4, held=set(), error_feedback=flags, joined=None)
    for a, b in zip(params + state, p4 + s4):
        np.testing.assert_array_equal(a, b)


def test_byte_totals_keep_the_jobs_total():
    assert elastic.totals(np.array([5, 6, 7]), 2).tolist() == [12, 6]
    assert elastic.totals(np.array([5, 6]), 3).tolist() == [5, 6, 0]


def test_global_model_is_the_delivered_model():
    """DiLoCo's held global model exactly (a mean of equal copies), else the mean."""
    from shoal.optim import DiLoCoState

    theta = np.array([0.1, 0.7], np.float32)
    local = np.array([[1.0, 2.0], [3.0, 5.0]], np.float32)
    state = DiLoCoState((), (), theta, np.int32(0), np.int32(0), (), ())
    leaves, o_def = jax.tree.flatten(state)
    held = set(range(len(leaves)))
    p_def = jax.tree.structure(np.zeros(2))
    got = elastic.global_model([local], leaves, p_def, o_def, held)
    assert got[0].dtype == np.float32 and got[0].tolist() == theta.tolist()
    plain = elastic.global_model([local], [], p_def, jax.tree.structure(()), set())
    assert plain[0].tolist() == [2.0, 3.5]


# -------------------------------------------------------------------------- the runner

# Saved mid-round (sparseloco syncs every 8): the workers' models differ from the global one.
SAVED_AT, STEPS = 4, 8
# gtc: its residual; sparseloco: DiLoCo's global model and outer state held once, top-k's
# error feedback in its exchange memory; ssgd: nothing but the model.
ALGORITHMS = ("gtc", "sparseloco", "ssgd")


def config(workers: int) -> Config:
    return Config(workers=workers, steps=STEPS, batch_size=8, eval_every=3,
                  checkpoint_every=SAVED_AT, params={"sparseloco": {"sync_every": 8}})  # fmt: skip


def saved_run(folder, algorithm):
    cfg = config(4)
    backend, task = SimBackend(4), make_task(cfg)
    ckpt = Checkpointer(folder, algorithm, cfg, backend)
    train(cfg, task, backend, algorithm, progress=False, checkpoints=ckpt, max_steps=SAVED_AT)
    return resumed(folder, algorithm, 4)


def resumed(folder, algorithm, workers):
    """A fresh process's run of ``workers`` workers, resumed from ``folder``."""
    cfg = config(workers)
    backend = SimBackend(workers)
    run = _Run(cfg, make_task(cfg), backend, _entry(cfg, algorithm))
    run.resume(Checkpointer(folder, algorithm, cfg, backend).load())
    return run


def _entry(cfg, algorithm):
    from shoal.experiments import algorithms

    return algorithms.resolve(algorithm, cfg)


def leaves(run):
    """Per leaf: (is error feedback, is held once, value), stacked layout."""
    state = run.backend.stacked(run.opt_state)
    held = set(run.backend.held(run.opt_state))
    ef = jax.tree.leaves(error_feedback_mask(state))
    return [(f, k in held, np.asarray(x)) for k, (f, x) in
            enumerate(zip(ef, jax.tree.leaves(state), strict=True))]  # fmt: skip


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("workers", [2, 6])
def test_resized_state_follows_the_rule(tmp_path, algorithm, workers):
    before = saved_run(tmp_path, algorithm)
    after = resumed(tmp_path, algorithm, workers)
    assert after.first == SAVED_AT + 1
    keep = min(4, workers)
    for (ef, held, old), (_, _, new) in zip(leaves(before), leaves(after), strict=True):
        if held:
            np.testing.assert_array_equal(new, old)  # shared: kept bit for bit
            continue
        np.testing.assert_array_equal(new.shape[1:], old.shape[1:])
        if ef:  # the total owed is kept (float32 sums: to rounding)
            total = lambda x: x.sum(0, dtype=np.float64)  # noqa: E731
            np.testing.assert_allclose(total(new), total(old), rtol=1e-6, atol=1e-7)
            if workers > 4:
                assert not new[4:].any()  # joiners owe nothing
        if not ef or workers > 4:
            np.testing.assert_array_equal(new[:keep], old[:keep])
    delivered = evaluation_params(before.params, before.backend.spread(before.opt_state))
    global_model = before.backend.mean_params(jax.tree.map(np.asarray, delivered))
    for p_new, p_old, g in zip(jax.tree.leaves(after.params), jax.tree.leaves(before.params),
                               jax.tree.leaves(global_model), strict=True):  # fmt: skip
        p_new, p_old = np.asarray(p_new), np.asarray(p_old)
        np.testing.assert_array_equal(p_new[:keep], p_old[:keep])
        for row in p_new[4:]:  # a joiner starts from the global model
            np.testing.assert_allclose(row, np.asarray(g), rtol=1e-6, atol=1e-7)
    assert after.sent_total.sum() == before.sent_total.sum()
    assert len(after.sent_total) == workers


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_four_to_six_to_four_is_the_identity(tmp_path, algorithm):
    before = saved_run(tmp_path / "a", algorithm)
    six = resumed(tmp_path / "a", algorithm, 6)
    six.save(Checkpointer(tmp_path / "b", algorithm, config(6), six.backend), SAVED_AT)
    back = resumed(tmp_path / "b", algorithm, 4)
    for a, b in zip(jax.tree.leaves((before.params, before.backend.stacked(before.opt_state))),
                    jax.tree.leaves((back.params, back.backend.stacked(back.opt_state))),
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(back.sent_total, before.sent_total)


def cli(out, n, backend, *extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "shoal.experiments.runner.cli", str(QUICKSTART),
           "--backend", backend, "--no-progress", "--out", str(out), *extra, "--set",
           f"steps={STEPS}", f"checkpoint_every={SAVED_AT}", "eval_every=3", "batch_size=8",
           "project_workers=0", "algorithms=sparseloco", "sparseloco.sync_every=8"]  # fmt: skip
    if backend == "mpi":
        exe = mpiexec()
        if exe is None:
            pytest.skip("mpiexec not found")
        cmd = [str(exe), "-n", str(n), *cmd]
    else:
        cmd += [f"workers={n}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def records(out):
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("workers", [2, 6])
def test_mpi_ranks_resume_elastically_as_simulated_workers_do(tmp_path, workers):
    """4 MPI ranks stop at step 4; 2 or 6 ranks finish the run, each reading every saved
    rank's checkpoint; the records are those of simulated workers resized alike."""
    for backend in ("mpi", "sim"):
        out = tmp_path / backend
        cli(out, 4, backend, "--stop-after", str(SAVED_AT))
        proc = cli(out, workers, backend, "--resume")
        if backend == "mpi":
            assert f"on {workers} ranks from a checkpoint of 4 (step {SAVED_AT}" in proc.stderr
    mpi, sim = records(tmp_path / "mpi"), records(tmp_path / "sim")
    assert [r["step"] for r in mpi] == [r["step"] for r in sim] == list(range(1, STEPS + 1))
    assert_same_run(mpi, sim, runs=1)


def test_state_whose_shape_follows_the_worker_count_is_refused(tmp_path):
    from shoal.experiments.runner.checkpoint import CheckpointError

    saved_run(tmp_path, "onebit_adam")
    message = (r"cannot resume onebit_adam with 2 workers from a checkpoint of 4: its "
               r"optimizer state leaf .* is \[\d+\] per worker there and \[\d+\] here \(its "
               r"shape follows the worker count\)")  # fmt: skip
    with pytest.raises(CheckpointError, match=message):
        resumed(tmp_path, "onebit_adam", 2)


def test_the_modules_examples_run():
    import doctest

    result = doctest.testmod(elastic)
    assert result.attempted >= 2 and result.failed == 0
