"""Closed-loop adaptation: the noise-scale policy, carrying optimizer state across a
switch, and the runner applying a switch mid-run (checked against a hand-made run)."""

import dataclasses

import harness
import jax
import numpy as np
import optax
import pytest
from harness import QUICKSTART

from shoal.comms import tree_nbytes
from shoal.experiments.algorithms.adaptive import noise_scale_switch
from shoal.experiments.overrides import apply_overrides, load_config
from shoal.experiments.runner.backends import SimBackend
from shoal.experiments.runner.train import carry_state, train
from shoal.experiments.tasks import GaussianMixtureTask
from shoal.optim import gradient_noise_scale, partial_exchange
from shoal.optim.helpers import partial_exchange_bins

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="single-process runner tests")

WORKERS, STEPS, EVERY = 4, 10, 4


def test_noise_scale_switch_uses_the_median_of_the_last_window():
    cfg = apply_overrides(load_config(QUICKSTART), ["adaptive.every=3", "adaptive.threshold=100"])
    p = cfg.params["adaptive"]
    recs = [{"noise_scale": v} for v in (500, 500, 500, 90, 120, 95)]
    assert noise_scale_switch(recs, p) is None  # median of 90, 120, 95 is 95
    recs[-1]["noise_scale"] = 130
    assert noise_scale_switch(recs, p) == {"sync": "partial"}
    switched = apply_overrides(cfg, ["adaptive.sync=partial"]).params["adaptive"]
    assert switched == dataclasses.replace(p, sync="partial")
    assert noise_scale_switch(recs, switched) is None  # once
    assert noise_scale_switch([{"loss": 1.0}] * 5, p) is None  # nothing measured


def test_carry_state_keeps_what_fits():
    params = {"w": np.ones((3, 2), np.float32), "b": np.zeros(2, np.float32)}
    sgd = optax.sgd(0.1, momentum=0.9)
    old = (optax.EmptyState(), sgd.init(params))
    old = (old[0], jax.tree.map(lambda a: a + 7.0, old[1]))  # a used momentum
    new = (optax.scale(2.0).init(params), sgd.init(params))
    got = carry_state(old, new)
    assert jax.tree.all(jax.tree.map(lambda a: np.all(a == 7.0), got[1]))
    # Different structure: the fresh state wins, whole.
    fresh = {"x": np.zeros(4)}
    assert carry_state({"y": np.ones(4)}, fresh) is fresh


def test_runner_switches_from_full_to_partial_exchange():
    cfg = apply_overrides(
        load_config(QUICKSTART),
        [
            f"workers={WORKERS}",
            f"steps={STEPS}",
            f"adaptive.every={EVERY}",
            "adaptive.threshold=0",
            "adaptive.after=0",
            "project_workers=0",
        ],  # fmt: skip
    )
    p = cfg.params["adaptive"]
    task = GaussianMixtureTask(cfg)
    result = train(cfg, task, SimBackend(WORKERS), "adaptive", progress=False)
    recs = result.records
    # The policy first looks after step EVERY; a positive noise scale beats threshold 0.
    switch = [None] * (EVERY - 1) + ["sync=partial"] + [None] * (STEPS - EVERY)
    assert [r.get("policy") for r in recs] == switch
    assert all("noise_scale" in r for r in recs[:EVERY])
    assert not any("noise_scale" in r for r in recs[EVERY:])

    # Oracle: the same two stages by hand, the local SGD state carried over the switch.
    params0 = task.init_params()
    n = tree_nbytes(params0)
    # The gradient and its squared norm; every step also the non-finite flag (one int32).
    flag = 2 * (WORKERS - 1) * 4 // WORKERS
    full = 2 * (WORKERS - 1) * (n + 4) // WORKERS + flag
    bins = partial_exchange_bins(params0, p.fraction)
    leaf_bytes = {
        jax.tree_util.keystr(k): v.size * 4 for k, v in jax.tree_util.tree_leaves_with_path(params0)
    }
    bin_bytes = [sum(leaf_bytes[p] for p in b) for b in bins]
    partial = [2 * (WORKERS - 1) * bin_bytes[t % len(bins)] // WORKERS + flag for t in range(STEPS)]
    assert [r["bytes_sent"] for r in recs] == [full] * EVERY + partial[: STEPS - EVERY]

    coll = SimBackend(WORKERS).collective
    sgd = optax.sgd(p.local.learning_rate, momentum=p.local.momentum)
    first = optax.chain(gradient_noise_scale(collective=coll, local_batch_size=cfg.batch_size,
                                             ema=p.ema), sgd)  # fmt: skip
    second = optax.chain(partial_exchange(p.fraction, collective=coll), sgd)

    def run(tx, params, state, steps):
        def step(p, s, x, y):
            g = jax.grad(task.loss)(p, x, y)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        f = jax.jit(jax.vmap(step, axis_name=coll.axis_name))
        for t in steps:
            x, y = task.batch(t, WORKERS)
            params, state = f(params, state, x, y)
        return params, state

    params = jax.tree.map(lambda a: np.broadcast_to(a, (WORKERS, *a.shape)), params0)
    state = jax.vmap(first.init)(params)
    params, state = run(first, params, state, range(EVERY))
    state = (jax.vmap(second.init)(params)[0], state[1])
    params, _ = run(second, params, state, range(EVERY, STEPS))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), result.params, params
    )


def test_no_switch_below_the_threshold():
    cfg = apply_overrides(
        load_config(QUICKSTART),
        [
            f"workers={WORKERS}",
            "steps=6",
            "adaptive.every=2",
            "adaptive.threshold=1e12",
            "project_workers=0",
        ],  # fmt: skip
    )
    recs = train(cfg, GaussianMixtureTask(cfg), SimBackend(WORKERS), "adaptive",
                 progress=False).records  # fmt: skip
    assert not any("policy" in r for r in recs)
    assert len({r["bytes_sent"] for r in recs}) == 1
    assert all(r["noise_scale"] > 0 for r in recs)


def test_kungfu_config_runs_every_entry(tmp_path):
    """The experiment's ten entries build and train (3 steps, the policy forced to switch)."""
    from shoal.experiments.runner.cli import main

    config = QUICKSTART.parent / "kungfu.py"
    sets = ["workers=2", "steps=3", "eval_every=3", "train_size=512", "test_size=64",
            "adaptive.after=0", "adaptive.every=1", "adaptive.threshold=0"]  # fmt: skip
    assert main([str(config), "--set", *sets, "--no-progress", "--out", str(tmp_path)]) == 0
    recs = [r for r in map(__import__("json").loads, (tmp_path / "metrics.jsonl").open())]
    assert len(recs) == 3 * 10
    switched = [r for r in recs if r["algorithm"] == "adaptive" and "policy" in r]
    # Once, as soon as an estimate is positive (with 2 workers one step may not be).
    assert len(switched) == 1 and switched[0]["step"] < 3
    assert "## Policy changes" in (tmp_path / "summary.md").read_text()
