"""Benchmark: the overhead of simulating workers, N workers under vmap vs one worker.

Usage: ``.venv/bin/python benchmarks/sim_workers.py [--reps 100] [--block 20]
[--workers 1,2,4,8,16]``

For each N, two jitted steps of the quickstart model (`experiments/configs/quickstart.py`,
an MLP on the Gaussian mixture), timed in the same run:

* (a) ``sim``: the S-SGD step of N simulated workers, as the runner compiles it
  (``SimBackend(N).spmd(make_step(loss, algorithms.build("ssgd", ...)))``: ``jax.vmap``
  over the workers, each on ``batch_size`` examples, the non-finite check, gradients
  averaged by the `AxisCollective` all-reduce, then SGD with momentum on every worker's
  copy of the model);
* (b) ``one``: one worker (plain ``jax.jit``, no vmap, no collective) on the same N x
  ``batch_size`` examples concatenated, with the same SGD with momentum.

Both compute the same model, which the script checks once (untimed) after one step:
S-SGD of N workers is one worker on the concatenated batch. The two are timed
interleaved (a b a b ...); each rep runs ``--block`` consecutive steps on a batch already
on the device and waits for the result, so the median ms per step excludes the input
pipeline. The ratio a/b is what simulating the workers costs over the computation
itself.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import jax
import numpy as np
from run_all import cpu_model  # benchmarks/ is on sys.path when this runs as a script

from shoal.experiments import algorithms
from shoal.experiments.algorithms import local_sgd
from shoal.experiments.backends import SimBackend
from shoal.experiments.config import apply_overrides, load_config
from shoal.experiments.tasks import GaussianMixtureTask
from shoal.experiments.train import make_step

CONFIG = Path(__file__).resolve().parents[1] / "experiments" / "configs" / "quickstart.py"


def _time_block(step_fn, state, x, y, block: int):
    """``block`` consecutive steps from ``state``; returns (seconds, final state)."""
    params, opt_state = state
    start = time.perf_counter()
    for _ in range(block):
        params, opt_state, _ = step_fn(params, opt_state, x, y)
    jax.block_until_ready((params, opt_state))
    return time.perf_counter() - start, (params, opt_state)


def _check_equal(sim_params, one_params, n: int) -> float:
    """Every simulated worker's model after one step is the single worker's model."""
    worst = 0.0
    for a, b in zip(jax.tree.leaves(sim_params), jax.tree.leaves(one_params)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == (n, *b.shape), (a.shape, b.shape)
        np.testing.assert_array_equal(a, np.broadcast_to(a[:1], a.shape))  # workers agree
        np.testing.assert_allclose(a[0], b, rtol=1e-5, atol=1e-6)
        worst = max(worst, float(np.max(np.abs(a[0] - b))))
    return worst


def bench(task, cfg, n: int, reps: int, block: int) -> dict:
    backend = SimBackend(n)
    sim_tx = algorithms.build("ssgd", cfg, backend.collective)  # with the non-finite check
    sim_step = backend.spmd(make_step(task.loss, sim_tx))
    one_tx = local_sgd(cfg)
    one_step = jax.jit(make_step(task.loss, one_tx))

    params0 = task.init_params()
    x, y = task.batch(0, n)  # [n, batch_size, features], [n, batch_size]
    sim_x, sim_y = jax.device_put(x), jax.device_put(y)
    one_x = jax.device_put(x.reshape(n * x.shape[1], *x.shape[2:]))
    one_y = jax.device_put(y.reshape(n * y.shape[1]))

    sim_params = backend.replicate(params0)
    sim_state = (sim_params, backend.spmd(sim_tx.init)(sim_params))
    one_state = (params0, one_tx.init(params0))

    # Compile, and check one step of each against the other (untimed).
    start = time.perf_counter()
    p_sim, _, _ = jax.block_until_ready(sim_step(*sim_state, sim_x, sim_y))
    compile_sim = time.perf_counter() - start
    start = time.perf_counter()
    p_one, _, _ = jax.block_until_ready(one_step(*one_state, one_x, one_y))
    compile_one = time.perf_counter() - start
    max_diff = _check_equal(p_sim, p_one, n)

    # Warm up, then interleave; the state is carried so every step sees fresh inputs.
    for _ in range(5):
        _, sim_state = _time_block(sim_step, sim_state, sim_x, sim_y, block)
        _, one_state = _time_block(one_step, one_state, one_x, one_y, block)
    t_sim, t_one = [], []
    for _ in range(reps):
        t, sim_state = _time_block(sim_step, sim_state, sim_x, sim_y, block)
        t_sim.append(t / block)
        t, one_state = _time_block(one_step, one_state, one_x, one_y, block)
        t_one.append(t / block)
    t_sim, t_one = np.array(t_sim) * 1e3, np.array(t_one) * 1e3
    return {
        "n": n,
        "examples": n * x.shape[1],
        "sim": t_sim,
        "one": t_one,
        "compile_sim": compile_sim,
        "compile_one": compile_one,
        "max_diff": max_diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=100, help="timed reps per variant and N")
    parser.add_argument("--block", type=int, default=20, help="steps per timed rep")
    parser.add_argument("--workers", default="1,2,4,8,16", help="comma-separated N")
    args = parser.parse_args()
    sizes = [int(s) for s in args.workers.split(",") if s.strip()]
    if not sizes or min(sizes) < 1:
        parser.error("--workers must list positive integers")

    load_start = os.getloadavg()
    wall_start = time.perf_counter()
    # The largest N must pass the config's check (N * batch_size <= train_size).
    cfg = apply_overrides(load_config(CONFIG), [f"workers={max(sizes)}"])
    task = GaussianMixtureTask(cfg)
    n_params = sum(int(np.size(a)) for a in jax.tree.leaves(task.init_params()))

    results = [bench(task, cfg, n, args.reps, args.block) for n in sizes]
    load_end = os.getloadavg()
    wall = time.perf_counter() - wall_start

    print(
        f"sim_workers: quickstart MLP {cfg.num_features}-{'-'.join(map(str, cfg.hidden))}-"
        f"{cfg.num_classes} ({n_params} params), batch_size {cfg.batch_size} per worker, "
        f"S-SGD + SGD(lr={cfg.learning_rate}, momentum={cfg.momentum}); "
        f"{args.reps} reps x {args.block} steps, interleaved"
    )
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} cores, backend={jax.default_backend()}, "
        f"jax {jax.__version__}, load average (1 min) {load_start[0]:.2f} at start, "
        f"{load_end[0]:.2f} at end; total {wall:.1f} s"
    )
    print(
        "check: after one step every simulated worker's parameters equal the single "
        "worker's (allclose; max |diff| per N: "
        + ", ".join(f"{r['n']}: {r['max_diff']:.1e}" for r in results)
        + ")"
    )
    print()
    print(
        "| N | examples / step | (a) N sim workers, ms/step | (b) one worker, ms/step "
        "| ratio a/b (medians) | median of paired ratios | a min - max | b min - max |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        a, b = r["sim"], r["one"]
        print(
            f"| {r['n']} | {r['examples']} | {np.median(a):.3f} | {np.median(b):.3f} "
            f"| {np.median(a) / np.median(b):.2f} | {np.median(a / b):.2f} "
            f"| {a.min():.3f} - {a.max():.3f} | {b.min():.3f} - {b.max():.3f} |"
        )
    print()
    print(
        "compile s (a / b): "
        + ", ".join(f"N={r['n']}: {r['compile_sim']:.2f} / {r['compile_one']:.2f}" for r in results)
    )


if __name__ == "__main__":
    main()
