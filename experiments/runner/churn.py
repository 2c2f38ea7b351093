"""Churn in the runner (config ``churn``, `shoal.experiments.churn`): each step's presence
fed to the workers' program, and the step that honours it (`churned`).

Every step gets a row per worker, ``(weight, joining, source)`` (`step_rows`). Inside the
compiled step:

1. a worker that joins takes the global model of worker ``source`` (present at the step
   before) and its optimizer state, but keeps its own error feedback and byte meters
   (the rule of `shoal.experiments.churn`); the runner counts that copy's bytes
   (`join_bytes`), received by the joiner and sent by the source;
2. the step runs with `shoal.comms.presence.present`: the reductions leave the absent
   workers out and weigh the present ones by tokens, and the byte counts are those of
   the present workers;
3. an absent worker's model and per-worker state stay as they were; rank-uniform state
   (held once: DiLoCo's global model and outer state, the step counters) moves on.

Simulated workers only, and algorithms registered with ``churn=True`` only
(`shoal.experiments.algorithms.register`); an exchange that cannot leave absent workers
out (an all-gather of compressed values, a gossip ppermute) is refused when it is traced.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shoal.comms.presence import present
from shoal.comms.wire import WireMeter, tree_nbytes
from shoal.experiments.churn import Schedule
from shoal.experiments.fields import ConfigError
from shoal.optim._inplace import run_if
from shoal.optim.helpers import error_feedback_mask, rank_uniform_mask
from shoal.optim.readouts import evaluation_params

__all__ = ["check_run", "churned", "join_bytes", "schedule_of", "step_rows", "window"]


def check_run(cfg: Any, backend: str, entry: Any) -> None:
    """`ConfigError` unless ``entry`` can run with ``cfg.churn`` on the backend named
    ``backend`` (``"sim"``, ``"mpi"``, ``"jax"``)."""
    if backend != "sim":
        raise ConfigError(
            f"churn = {cfg.churn!r} needs simulated workers (--backend sim), not --backend "
            f"{backend}: MPI ranks and devices are running or gone; drop churn"
        )
    if entry.group_size is not None:
        raise ConfigError(
            f"{entry.label}: churn covers one collective of all workers, not a two-tier "
            f"algorithm's groups"
        )
    if not entry.algorithm.churn:
        from shoal.experiments.algorithms import ALGORITHMS

        able = sorted(name for name, a in ALGORITHMS.items() if a.churn)
        raise ConfigError(
            f"{entry.label} cannot run with churn = {cfg.churn!r}: it is registered without "
            f"churn=True (an exchange other than a plain all-reduce, or a rule that counts "
            f"the workers); these can: {', '.join(able)}"
        )


def window(entry: Any) -> int:
    """Steps per round of ``entry``: its ``sync_every`` (DiLoCo family) or ``block_size``
    (BMUF), else 1: how many steps a token weight counts at most."""
    for name in ("sync_every", "block_size"):
        value = getattr(entry.params, name, None)
        if isinstance(value, int) and value >= 1:
            return value
    return 1


def schedule_of(cfg: Any) -> Schedule:
    """The run's `Schedule` (every worker present without ``churn``)."""
    return Schedule.parse(cfg.churn, steps=cfg.steps, workers=cfg.workers)


def step_rows(schedule: Schedule, window: int) -> np.ndarray:
    """``[steps, workers, 3]`` float32: each step's ``(weight, joining, source)`` per
    worker (row ``t`` for step ``t + 1``), token weights counted over ``window`` steps."""
    weights = schedule.weights(window)
    joining = schedule.joining().astype(np.float32)
    source = np.broadcast_to(schedule.sources()[:, None], weights.shape).astype(np.float32)
    return np.stack([weights, joining, source], axis=-1)


def join_bytes(params: Any, opt_state: Any, workers: int) -> int:
    """Bytes a worker that joins receives from its source, and the source sends: one
    worker's model and the optimizer state it copies (its per-worker leaves but error
    feedback and meters), from ``params`` of one worker and ``opt_state`` as the simulated
    workers hold it (per-worker leaves stacked over ``workers``, rank-uniform ones once)."""
    kept = jax.tree.leaves(_kept_own(opt_state))
    leaves = zip(jax.tree.leaves(opt_state), kept, strict=True)
    copied = sum(tree_nbytes(x) // workers for x, keep in leaves if not keep)
    return tree_nbytes(params) + copied


def _kept_own(state: Any) -> Any:
    """True at the leaves a joiner keeps: rank-uniform (held once), error feedback, meters."""
    uniform = rank_uniform_mask(state)
    ef = error_feedback_mask(state)
    meters = jax.tree.map(
        lambda node: jax.tree.map(lambda _: True, node) if isinstance(node, WireMeter) else False,
        state,
        is_leaf=lambda node: isinstance(node, WireMeter),
    )
    return jax.tree.map(lambda a, b, c: a or b or c, uniform, ef, meters)


def churned(step: Any, collective: Any) -> Any:
    """``step(params, opt_state, x, y, *fault)`` of one worker (`train.make_step`) as a
    step that takes one more argument, this worker's ``(weight, joining, source)`` row
    (the module's rule)."""

    def run(params, opt_state, x, y, *rest):
        *fault, row = rest
        weight, joining = row[0], row[1] > 0
        source = row[2].astype(jnp.int32)
        weights = collective.all_gather(weight)  # every worker's, unbatched under vmap
        kept = _kept_own(opt_state)

        def join(carry):
            params, state = carry
            model = evaluation_params(params, state)
            take = lambda x: collective.all_gather(x)[source]  # noqa: E731
            params = jax.tree.map(
                lambda p, g: jnp.where(joining, take(g).astype(p.dtype), p), params, model
            )
            state = jax.tree.map(
                lambda s, keep: s if keep else jnp.where(joining, take(s), s), state, kept
            )
            return params, state

        # Joins are rare: the pass over the model and state runs in place, only on a step
        # that has one (`run_if`: a lax.cond would copy them every step).
        anyone = collective.uniform(jnp.any(collective.all_gather(joining)))
        params, opt_state = run_if(anyone, join, (params, opt_state))
        with present(collective, weights):
            new_params, new_state, metrics = step(params, opt_state, x, y, *fault)
        here = weight > 0
        uniform = rank_uniform_mask(new_state)
        new_params = jax.tree.map(lambda n, o: jnp.where(here, n, o), new_params, params)
        new_state = jax.tree.map(
            lambda n, o, u: n if u else jnp.where(here, n, o), new_state, opt_state, uniform
        )
        return new_params, new_state, metrics

    return run
