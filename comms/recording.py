"""Record what a transformation puts on the wire, step by step, without running workers.

`RecordingCollective` is a stand-in `Collective` of any size for one process (no ``vmap``,
no MPI): every call returns what worker 0 would receive if all workers held worker 0's
values, and, when it executes, logs an `Event` ``(kind, group, nbytes)``. The log is
written by a host callback at run time, so a ``lax.cond``/``lax.switch`` branch that is
not taken logs nothing: `record_events` gives the real per-step sequence of collectives of
BMUF's block steps, PGX's partitions or 1-bit LAMB's two stages, for any number of
workers, at the cost of one worker's steps. `shoal.costmodel` turns the sequence into
time on a `Cluster`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from shoal.comms.collective import check_all_to_all, check_op, check_perm, check_root, check_size
from shoal.comms.wire import tree_nbytes
from shoal.dtypes import apply_updates

_LOGS: dict[int, list] = {}
_LOCK = threading.Lock()
_IDS = itertools.count()


@dataclasses.dataclass(frozen=True)
class RecordingCollective:
    """A stand-in `Collective` of ``size`` identical workers, seen from worker 0, that logs calls.

    Every call returns what worker 0 would receive if all workers held worker 0's
    values (a mean is the value itself, a sum ``size`` times it), and, when it executes,
    logs an `Event` ``(kind, group, nbytes)``; a branch not taken logs nothing. Runs in
    one process, without ``vmap`` or MPI. `record_events` drives it.

    Args:
      size: int ``>= 1``, the number of workers.
      group: ``"world"``, ``"intra"`` or ``"inter"``, the group events are logged under.
      log: the log id events go to (from ``shoal.comms.recording.new_log``).

    Example:
      >>> import jax.numpy as jnp
      >>> from shoal.comms import RecordingCollective
      >>> coll = RecordingCollective(4)
      >>> print(coll.all_reduce(jnp.full(3, 2.0), op="sum"))  # 4 workers holding 2.0
      [8. 8. 8.]
      >>> coll.all_gather(jnp.ones(2)).shape
      (4, 2)
    """

    size: int
    group: str = "world"
    log: int = -1

    def __post_init__(self):
        # Stored as a Python int even when given a NumPy one (the repr shows it).
        object.__setattr__(self, "size", check_size(self.size))
        if self.group not in ("world", "intra", "inter"):
            raise ValueError(f"group must be 'world', 'intra' or 'inter', got {self.group!r}")

    def _emit(self, kind: str, nbytes: int) -> None:
        if self.size > 1:  # one worker talks to nobody
            event = (kind, self.group, int(nbytes))
            jax.debug.callback(functools.partial(_append, self.log, event), ordered=True)

    def rank(self) -> jax.Array:
        return jnp.int32(0)

    def uniform(self, x: Any) -> Any:
        return x

    def all_reduce(self, tree: Any, op: str = "mean") -> Any:
        check_op(op)
        self._emit("all_reduce", tree_nbytes(tree))
        scale = self.size if op == "sum" else 1
        return jax.tree.map(lambda x: x * scale if scale != 1 else x, tree)

    def all_gather(self, x: jax.Array) -> jax.Array:
        self._emit("all_gather", tree_nbytes(x))
        return jnp.broadcast_to(x, (self.size, *jnp.shape(x)))

    def all_to_all(self, x: jax.Array) -> jax.Array:
        check_all_to_all(x, self.size)
        self._emit("all_to_all", tree_nbytes(x))
        return jnp.broadcast_to(x[0], x.shape)  # row 0 of every (identical) worker

    def broadcast(self, tree: Any, root: int = 0) -> Any:
        check_root(root, self.size)
        self._emit("broadcast", tree_nbytes(tree))
        return tree

    def ppermute(self, x: jax.Array, perm: Sequence[tuple[int, int]]) -> jax.Array:
        pairs = check_perm(perm, self.size)
        self._emit("ppermute", tree_nbytes(x))
        return x if any(d == 0 for _, d in pairs) else jnp.zeros_like(x)

    def host_allgather(self, obj: Any) -> list[Any]:
        return [obj] * self.size  # identical workers

    def host_broadcast(self, obj: Any, root: int = 0) -> Any:
        check_root(root, self.size)
        return obj

    def split(self, group_size: int) -> tuple[RecordingCollective, RecordingCollective]:
        from shoal.comms.groups import check_group_size

        groups = check_group_size(self.size, group_size)
        return (
            RecordingCollective(group_size, "intra", self.log),
            RecordingCollective(groups, "inter", self.log),
        )


def _append(log: int, event: tuple) -> None:
    with _LOCK:
        _LOGS.setdefault(log, []).append(event)


def new_log() -> int:
    """A fresh log id for `RecordingCollective`."""
    log = next(_IDS)
    _LOGS[log] = []
    return log


def take(log: int) -> list:
    """The events logged so far (after `jax.effects_barrier`), emptying the log."""
    jax.effects_barrier()
    with _LOCK:
        events, _LOGS[log] = _LOGS.get(log, []), []
    return events


_STEP = ("step",)  # marks the start of a step in the log


def record_events(
    make_tx: Callable[[Any], optax.GradientTransformation],
    params: Any,
    *,
    workers: int,
    steps: int,
    group_size: int | None = None,
    seed: int = 0,
) -> list[list]:
    """The collectives that ``steps`` updates of ``make_tx(comms)`` on ``workers`` workers perform.

    ``comms`` is a world `RecordingCollective`, or its ``(intra, inter)`` split when
    ``group_size`` is given. Only worker 0's steps run, in one jitted scan; the
    gradients are seeded normal noise of scale 0.01 (what a transformation sends may
    depend on values only through its capacities, which are static). Branches of
    ``lax.cond`` not taken log nothing, so the result is the real per-step sequence.

    Args:
      make_tx: builds the transformation from its collective(s).
      params: the parameter pytree.
      workers: the number of workers simulated.
      steps: the number of updates.
      group_size: when given, ``make_tx`` receives ``(intra, inter)`` collectives for
        groups of ``group_size`` consecutive workers.
      seed: seed of the gradient noise.

    Returns:
      one list of `Event` per step (empty when ``steps <= 0``); feed a step to
      `step_comm_time` or `project`.

    Example:
      >>> import jax.numpy as jnp
      >>> from shoal.comms import record_events
      >>> from shoal.optim import allreduce_gradients
      >>> make_tx = lambda c: allreduce_gradients(collective=c)
      >>> events = record_events(make_tx, {"w": jnp.zeros(1000)}, workers=8, steps=2)
      >>> events[1]
      [Event(kind='all_reduce', group='world', nbytes=4000)]
    """
    from shoal.costmodel import Event

    if steps <= 0:
        return []
    log = new_log()
    world = RecordingCollective(workers, "world", log)
    tx = make_tx(world if group_size is None else world.split(group_size))
    key = jax.random.key(seed)

    def step(carry, t):
        params, state = carry
        jax.debug.callback(functools.partial(_append, log, _STEP), ordered=True)
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.fold_in(key, t), len(leaves))
        grads = jax.tree.unflatten(
            treedef,
            [0.01 * jax.random.normal(k, jnp.shape(p), jnp.result_type(p)) for k, p in
             zip(keys, leaves)],
        )  # fmt: skip
        updates, state = tx.update(grads, state, params)
        return (apply_updates(params, updates), state), None

    run = jax.jit(lambda p: lax.scan(step, (p, tx.init(p)), jnp.arange(steps))[0])
    try:
        jax.block_until_ready(run(params))
        logged = take(log)
    finally:
        _LOGS.pop(log, None)
    out: list[list] = []
    for entry in logged:
        if entry == _STEP:
            out.append([])
        else:
            out[-1].append(Event(*entry))
    return out
