"""``shoal-run``'s simulated workers hold rank-uniform state once (`SimBackend`): DiLoCo's,
Streaming DiLoCo's and MuLoCo's global model and outer state, BMUF's global model and
block momentum. A run equals the run of a backend that stacks every leaf per worker (the
layout before), records and final params, to float32 rounding (XLA fuses the unbatched
arithmetic otherwise; BMUF's stays bitwise); the compiled step's arguments shrink by
``N - 1`` copies of what is held; checkpoints save it once, and a checkpoint of the
stacked layout is refused naming the change."""

from __future__ import annotations

import dataclasses

import harness
import jax
import numpy as np
import pytest
from harness import QUICKSTART

from shoal.experiments import algorithms
from shoal.experiments.overrides import apply_overrides, load_config
from shoal.experiments.runner.backends import AXIS, SimBackend
from shoal.experiments.runner.checkpoint import Checkpointer, CheckpointError
from shoal.experiments.runner.train import compile_step, train
from shoal.experiments.tasks import GaussianMixtureTask
from shoal.optim.helpers import uniform_axes

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="simulated workers only")

WORKERS = 4
SETS = [
    f"workers={WORKERS}",
    "steps=8",
    "eval_every=4",
    "bmuf.block_size=4",
    "diloco.sync_every=4",
    "diloco.exchange.codec=fp4",
    "muloco.sync_every=4",
    "streaming_diloco.sync_every=4",
    "streaming_diloco.fragments=2",
    "streaming_diloco.overlap=1",
    "sparseloco.sync_every=4",
    "sparseloco.topk.chunk_size=64",
    "project_workers=0",
]
HELD = ("diloco", "streaming_diloco", "muloco", "sparseloco", "bmuf")


class StackedBackend(SimBackend):
    """Simulated workers that hold every leaf per worker: one plain ``jax.vmap``."""

    def spmd(self, fn, group_size=None):
        assert group_size is None
        return jax.jit(jax.vmap(fn, axis_name=AXIS))

    def init_state(self, init, params, group_size=None):
        return self.spmd(init)(params)

    def held(self, tree):
        return []

    def spread(self, tree):
        return tree


@pytest.fixture(scope="module")
def setup():
    cfg = apply_overrides(load_config(QUICKSTART), SETS)
    return cfg, GaussianMixtureTask(cfg)


@pytest.mark.parametrize("algorithm", HELD)
def test_a_run_holding_state_once_is_the_stacked_run(setup, algorithm):
    cfg, task = setup
    stacked, held = (
        train(cfg, task, backend, algorithm, progress=False)
        for backend in (StackedBackend(WORKERS), SimBackend(WORKERS))
    )
    assert [r["step"] for r in held.records] == list(range(1, cfg.steps + 1))
    for a, b in zip(stacked.records, held.records, strict=True):
        assert a.keys() == b.keys()
        for key in a.keys() - {"time_s"}:
            if isinstance(a[key], float):
                np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-6, err_msg=key)
            else:
                assert b[key] == a[key], key  # bytes exact
    assert "test_loss" in held.records[3]  # evaluated from the held global model
    for a, b in zip(jax.tree.leaves(stacked.params), jax.tree.leaves(held.params), strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    if algorithm == "bmuf":  # nothing fused differently: bit for bit
        assert held.records == [
            r | {"time_s": h["time_s"]} for r, h in zip(stacked.records, held.records)
        ]


def _step_and_args(setup, backend, algorithm):
    cfg, task = setup
    tx = algorithms.resolve(algorithm, cfg).build(backend.collective)
    params = backend.replicate(task.init_params())
    state = backend.init_state(tx.init, params)
    x, y = task.batch(0, WORKERS)
    return compile_step(backend, task.loss, tx), (params, state, x, y)


def test_the_compiled_step_takes_the_held_state_once(setup):
    """DiLoCo's step: its arguments are N - 1 copies of the global model and outer
    momentum smaller than the stacked step's, as XLA compiles it."""
    sizes, held_bytes = {}, 0
    for backend in (StackedBackend(WORKERS), SimBackend(WORKERS)):
        step, args = _step_and_args(setup, backend, "diloco")
        compiled = step.lower(*args).compile()
        sizes[type(backend)] = compiled.memory_analysis().argument_size_in_bytes
        if type(backend) is SimBackend:
            state = args[1]
            axes = jax.tree.leaves(uniform_axes(state), is_leaf=lambda a: a is None)
            leaves = jax.tree.leaves(state, is_leaf=lambda a: a is None)
            held = [x for a, x in zip(axes, leaves, strict=True) if a is None and x is not None]
            held_bytes = sum(x.nbytes for x in held)
            model = sum(x.nbytes for x in jax.tree.leaves(args[0])) // WORKERS
            assert held_bytes >= 2 * model  # the global model and the outer momentum
            assert backend.held(state)
    saved = sizes[StackedBackend] - sizes[SimBackend]
    assert saved == (WORKERS - 1) * held_bytes


def test_checkpoints_hold_it_once_and_refuse_the_stacked_layout(setup, tmp_path):
    cfg, task = setup
    cfg = dataclasses.replace(cfg, checkpoint_every=4)
    backend = SimBackend(WORKERS)
    ckpt = Checkpointer(tmp_path / "held", "diloco", cfg, backend)
    train(cfg, task, backend, "diloco", progress=False, checkpoints=ckpt, max_steps=4)
    saved = ckpt.load()
    # Held once: the global model's and the outer momentum's leaves have the model's own
    # shapes, the counters none; what stays per worker has the worker axis.
    model = {np.shape(x) for x in jax.tree.leaves(task.init_params())}
    shapes = {i: a.shape for i, a in saved["opt_state"].items()}
    held = {str(i) for i in saved["held"]}
    assert held and {shapes[i] for i in held} == model | {()}
    assert all(shapes[i][0] == WORKERS for i in shapes.keys() - held)

    old = Checkpointer(tmp_path / "stacked", "diloco", cfg, StackedBackend(WORKERS))
    train(cfg, task, StackedBackend(WORKERS), "diloco", progress=False, checkpoints=old,
          max_steps=4)  # fmt: skip
    again = Checkpointer(tmp_path / "stacked", "diloco", cfg, backend)
    with pytest.raises(CheckpointError, match="once per worker.*--overwrite"):
        train(cfg, task, backend, "diloco", progress=False, checkpoints=again, resume=True)
