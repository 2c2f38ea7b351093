"""``in_turn``: simulated workers take their local steps one after another.

With config ``in_turn`` (and ``scan_steps > 1``) a program of steps holds at most one of
the entry's exchange steps, at its end (`Plan.chunk_end`): the steps before it, where
every ``sync_every`` steps only the last exchanges, run for one worker at a time
(`shoal.optim.helpers.take_turns`), the exchange step for all workers under ``vmap``.
Each worker's local steps then touch one worker's model and state, not ``N`` workers' at
once (``benchmarks/sim_vs_jax_peer.py``). The records are those of the vmapped run to
float32 rounding.

The entries registered with ``turns=True`` (DiLoCo, MuLoCo, SparseLoCo) take turns; the
others run as without ``in_turn``. DiLoCo leaves its outer step out of a turn
(`shoal.comms.turns`); an entry whose local steps exchange after all raises
`shoal.comms.turns.TurnError` when its program is traced, which the runner reports as a
config error naming the entry.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from shoal.experiments.config import ConfigError
from shoal.optim._nonfinite import skipped_steps
from shoal.optim.helpers import take_turns


def check_run(cfg: Any, backend_name: str) -> None:
    """`ConfigError` where ``cfg.in_turn`` cannot apply to this run, before any entry
    trains."""
    if not cfg.in_turn:
        return
    if backend_name != "sim":
        raise ConfigError(
            f"in_turn applies to simulated workers (--backend sim), not --backend "
            f"{backend_name}: its ranks and devices already run their own steps"
        )
    if cfg.steps_per_program() < 2:
        raise ConfigError("in_turn runs the local steps of a program: set scan_steps >= 2")
    for field, why in (
        ("churn", "an absent worker's steps are masked under vmap"),
        ("grad_chunk", "it computes the gradients in chunks of workers under vmap"),
    ):
        if getattr(cfg, field):
            raise ConfigError(f"in_turn does not combine with {field} ({why})")


def period(cfg: Any, backend_name: str, entry: Any) -> int | None:
    """The steps per round of ``entry`` if its workers take turns (``cfg.in_turn`` and an
    entry registered with ``turns=True``), else None (the others run as without
    ``in_turn``); `ConfigError` where the run cannot take turns."""
    check_run(cfg, backend_name)
    if not cfg.in_turn or not entry.algorithm.turns:
        return None
    if entry.policy is not None:
        raise ConfigError(f"{entry.label}: in_turn does not combine with a policy")
    return entry.params.sync_every


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where programs end and which of their steps are local, for rounds of ``every``
    steps of the algorithm's own count: the run's steps less the ``skipped`` ones (a step
    `shoal.optim.skip_nonfinite` skipped moved no counter inside)."""

    every: int

    def chunk_end(self, step: int, last: int, skipped: int) -> int:
        """``last``, or the first exchange step from ``step`` on if it comes earlier."""
        return min(last, step + (skipped - step) % self.every)

    def local_steps(self, first: int, last: int, skipped: int) -> int:
        """How many of steps ``first`` to ``last`` run in turn: all but an exchange step
        at the end."""
        return last - first + ((last - skipped) % self.every != 0)


def compile_turns(backend: Any, step: Any, local: int, total: int) -> Any:
    """One program of ``total`` steps for all of ``backend``'s workers: the first
    ``local`` in turn, the rest (an exchange step or none) under ``backend.spmd``.
    ``step`` is `shoal.experiments.runner.train.make_step`'s; batches and metrics have
    the steps on axis 1, after the workers'. It also returns whether to run the steps
    again with the workers together: a worker skipped a step for a non-finite gradient
    (`shoal.optim.skip_nonfinite` in a turn skips on the worker's gradient alone, where
    all must skip alike). An exchange left out that was due raises instead
    (`shoal.comms.turns.take_due`)."""
    together = backend.spmd(step) if total > local else None

    def program(params, opt_state, *batches):
        before = skipped(opt_state)
        outs = []
        if local:
            now = tuple(b[:, :local] for b in batches)
            params, opt_state, out = take_turns(step, backend.collective, params, opt_state, *now)
            outs.append(out)
        if together is not None:
            params, opt_state, out = together(params, opt_state, *(b[:, local] for b in batches))
            outs.append(jax.tree.map(lambda a: jnp.expand_dims(a, 1), out))
        metrics = jax.tree.map(lambda *parts: jnp.concatenate(parts, axis=1), *outs)
        return params, opt_state, metrics, skipped(opt_state) > before

    return jax.jit(program)


def skipped(opt_state: Any) -> jax.Array:
    """The most steps a worker skipped so far (0 without `skip_nonfinite`)."""
    count = skipped_steps(opt_state)
    return jnp.zeros((), jnp.int32) if count is None else jnp.max(count)
