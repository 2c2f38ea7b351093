"""Project a run to a cluster: the step time an algorithm would have on ``project_workers``
workers of a preset `shoal.costmodel.Cluster`.

The run's collectives are replayed step by step for that many workers
(`shoal.comms.record_events`: one worker's steps with a recording stand-in collective, so
only the branches taken are counted, and a policy's changes apply from the step after
they were made), timed with `shoal.costmodel.step_comm_time`, and added to the compute time of
one worker's step measured on this machine (forward and backward of one local batch; no
overlap of compute and communication). The numbers answer "how would this algorithm's
communication scale", not "how fast is this model on that cluster's GPUs".
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from shoal.comms import record_events
from shoal.costmodel import PRESETS, Cluster, step_comm_time
from shoal.experiments import algorithms
from shoal.experiments.config import Config

_COMPUTE: dict[int, float] = {}


def target(cfg: Config) -> Cluster:
    per_node = PRESETS[cfg.project_cluster]["workers_per_node"]
    return Cluster.preset(cfg.project_cluster, cfg.project_workers // per_node)


def describe(cfg: Config) -> str:
    c = target(cfg)
    return (
        f"{c.workers} workers, {c.workers_per_node} per node, "
        f"{c.inter_bandwidth * 8 / 1e9:g} Gbps between nodes ({c.name})"
    )


def compute_seconds(task: Any) -> float:
    """Median seconds of one worker's forward and backward pass on one local batch, here."""
    key = id(task)
    if key not in _COMPUTE:
        x, y = task.batch(0, 1)
        grad = jax.jit(jax.value_and_grad(task.loss))
        params = task.init_params()
        jax.block_until_ready(grad(params, x[0], y[0]))
        times = []
        for _ in range(20):
            start = time.perf_counter()
            jax.block_until_ready(grad(params, x[0], y[0]))
            times.append(time.perf_counter() - start)
        _COMPUTE[key] = float(np.median(times))
    return _COMPUTE[key]


def step_events(
    cfg: Config,
    entry: algorithms.Entry,
    task: Any,
    policy_changes: list[tuple[int, dict[str, Any]]],
    workers: int,
) -> list[list[Any]]:
    """Per step of the run, the collectives ``entry`` performs on ``workers`` workers
    (`shoal.comms.record_events`), with ``policy_changes`` (``(step, changes)`` made after
    those steps) applied from the step after each."""
    params = task.init_params()
    bounds = [0, *(s for s, _ in policy_changes), cfg.steps]
    changes: dict[str, Any] = {"workers": workers}
    out: list[list[Any]] = []
    for i, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        if i:
            changes.update(policy_changes[i - 1][1])

        make = lambda comms, changes=dict(changes): entry.build(comms, task=task, changes=changes)

        out += map(list, record_events(
            make, params, workers=workers, steps=stop - start, group_size=entry.group_size
        ))  # fmt: skip
    return out


def project_run(
    cfg: Config,
    algorithm: str | algorithms.Entry,
    task: Any,
    policy_changes: list[tuple[int, dict[str, Any]]],
) -> dict[str, float]:
    """``projected_ms`` (compute + communication per step, mean over the run),
    ``projected_comm_ms`` and ``compute_ms`` of ``algorithm`` (an `Entry`, or an entry of
    ``cfg.algorithms``) on `target` ``(cfg)``; ``policy_changes`` are ``(step, changes)``
    made after those steps."""
    cluster = target(cfg)
    entry = (
        algorithm if isinstance(algorithm, algorithms.Entry) else algorithms.resolve(algorithm, cfg)
    )
    events = step_events(cfg, entry, task, policy_changes, cluster.workers)
    comm = [step_comm_time(e, cluster, group_size=entry.group_size) for e in events]
    comm_s = float(np.mean(comm))
    compute_s = compute_seconds(task)
    return {
        "projected_ms": 1e3 * (compute_s + comm_s),
        "projected_comm_ms": 1e3 * comm_s,
        "compute_ms": 1e3 * compute_s,
    }
