"""A run's simulated wall clock (config ``speeds``): what its steps would take on
``project_cluster``'s links with the run's own workers, each at its own speed.

The run's collectives are replayed step by step (`projection.step_events`, for
``cfg.workers`` workers) and timed by `shoal.costmodel.clock.simulate`, with each
worker's compute time: one worker's step (``compute_ms``, or measured here when 0) times
its factor from `shoal.costmodel.speeds`. Workers of a synchronous algorithm still train
in lock-step: speeds change the clock, not the numbers. Under ``churn`` the absent
workers compute nothing and wait for no one (`simulate`'s ``present``); the collectives
are timed for all ``workers``. With ``compute_ms`` given the clock is deterministic, bit
for bit; measured, it varies with this machine's load.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.costmodel import PRESETS, Cluster
from shoal.costmodel.clock import Timeline, simulate
from shoal.costmodel.speeds import speed_factors
from shoal.experiments import algorithms
from shoal.experiments.churn import Schedule
from shoal.experiments.config import Config
from shoal.experiments.runner import projection
from shoal.experiments.runner.summary import time_to_target

# The timeline plot shows the steps up to the one after this many exchanges, at most
# PLOT_STEPS steps.
PLOT_ROUNDS, PLOT_STEPS = 3, 120


def cluster_of(cfg: Config) -> Cluster:
    """``project_cluster``'s links with the run's ``workers`` (checked to fill its nodes)."""
    per_node = PRESETS[cfg.project_cluster]["workers_per_node"]
    # (Config checks workers fill the nodes when speeds is set; an asynchronous entry's
    # clock runs without speeds too, on as many nodes as its workers take.)
    return Cluster.preset(cfg.project_cluster, max(1, -(-cfg.workers // per_node)))


def step_seconds(cfg: Config, task: Any) -> float:
    """One worker's step on the clock: ``compute_ms``, or measured here when 0."""
    return cfg.compute_ms / 1e3 if cfg.compute_ms else projection.compute_seconds(task)


def _plotted_steps(events: list[list[Any]]) -> int:
    exchanges = [s for s, e in enumerate(events) if e]
    last = exchanges[PLOT_ROUNDS - 1] if len(exchanges) >= PLOT_ROUNDS else len(events) - 1
    return min(last + 1, PLOT_STEPS)


def clock_run(
    cfg: Config,
    entry: algorithms.Entry,
    task: Any,
    policy_changes: list[tuple[int, dict[str, Any]]],
    records: list[dict[str, Any]],
) -> dict[str, Any]:
    """The summary's clock fields; adds ``sim_time_s`` (the clock when each step ended)
    to every record of ``records`` (one per step, ``"step"`` from 1).

    Returns ``sim_time_s`` (the run's simulated seconds), ``sim_to_target_s`` (the clock
    at the first evaluation with ``test_loss <= target_loss``; None when none reached it
    or no target is set), the mean ``busy_share``, ``comm_share`` and ``idle_share`` over
    workers, and ``clock``: each worker's shares and the first rounds' segments (for the
    timeline plot)."""
    cluster = cluster_of(cfg)
    events = projection.step_events(cfg, entry, task, policy_changes, cfg.workers)
    step_s = step_seconds(cfg, task)
    factors = speed_factors(cfg.speeds, steps=cfg.steps, workers=cfg.workers, seed=cfg.seed)
    present = Schedule.parse(cfg.churn, steps=cfg.steps, workers=cfg.workers).present
    timeline = simulate(events, step_s * factors, cluster, group_size=entry.group_size,
                        keep_steps=_plotted_steps(events), present=present)  # fmt: skip
    for r in records:
        r["sim_time_s"] = float(timeline.end[r["step"] - 1])
    return _summary(cfg, timeline, records, step_s)


def _summary(
    cfg: Config, timeline: Timeline, records: list[dict[str, Any]], step_s: float
) -> dict[str, Any]:
    shares = timeline.shares()
    return {
        "sim_time_s": float(timeline.end[-1]),
        "sim_to_target_s": time_to_target(records, cfg.target_loss),
        "busy_share": float(np.mean(shares["busy"])),
        "comm_share": float(np.mean(shares["comm"])),
        "idle_share": float(np.mean(shares["idle"])),
        "absent_share": float(np.mean(shares["absent"])),
        "clock": {
            "step_ms": 1e3 * step_s,
            "shares": {k: [float(x) for x in v] for k, v in shares.items()},
            "segments": [list(s) for s in timeline.segments],
        },
    }
