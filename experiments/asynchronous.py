"""Asynchronous outer steps, simulated on a clock: async DiLoCo with Delayed Nesterov
and dynamic local updates (Liu et al. 2024), and a quorum that fires when ``q`` workers
have delivered or a grace window has passed (the mechanism of Decoupled DiLoCo).

Each worker runs its inner steps from the global model it last pulled, at its own speed
(seconds per step), then pushes its pseudo-gradient ``Delta = theta_start - theta_i`` to
a server and pulls the new global model. `simulate` plays these events in the order of
the simulated clock (ties: by worker), so a run is deterministic, bit for bit:

* ``quorum=None`` (async): every arrival is one outer step (``outer``, e.g.
  `delayed_nesterov`), and the worker starts its next round at once.
* ``quorum=q``: arrivals wait at the server; the outer step fires with the
  token-weighted mean of the waiting pseudo-gradients when ``q`` have arrived or
  ``grace`` seconds after the first of them, and every waiting worker pulls its result.
  ``q = workers`` with an infinite grace is synchronous DiLoCo.
* ``dynamic=True`` (DyLU, the paper's eq. 6): worker ``i`` runs
  ``max(1, floor(v_i / v_max * H))`` steps per round, ``v`` its speed (steps per second,
  from its mean step time over the run), so slow workers deliver as often as fast ones.

* ``present`` (churn, `shoal.experiments.churn`): worker ``i`` trains its ``k``-th inner
  step only where ``present[k, i]``. Away at the start of a round, it is gone for those
  steps' seconds, then pulls the global model and starts a round; leaving inside a round,
  it loses the round (its steps so far are computed and never pushed; its inner state
  stays as before the round). It keeps its own inner state while away.

Bytes are exact: a push sends the model's bytes, a pull receives them (float32
pseudo-gradient and model). A push or pull takes ``latency + bytes / bandwidth`` on the
link given.

References:
  Liu, Chhaparia, Douillard, Kale, Rusu, Shen, Szlam & Ranzato, "Asynchronous Local-SGD
  Training for Language Modeling", arXiv:2401.09135, 2024 (Algorithm 3, eq. 6).
  "Decoupled DiLoCo", arXiv:2604.21428, 2026 (the quorum and its grace window).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shoal.checks import check_int
from shoal.dtypes import promote_types
from shoal.optim._validation import check_hyper

__all__ = ["DelayedNesterovState", "Arrival", "Plan", "Simulation", "delayed_nesterov",
           "dynamic_steps", "simulate"]  # fmt: skip


class DelayedNesterovState(NamedTuple):
    """``momentum`` (``m``) and ``buffer`` (``b``, the pseudo-gradients since the last
    momentum update), both float32 or wider, and ``count``, the arrivals so far."""

    momentum: Any
    buffer: Any
    count: jax.Array


def delayed_nesterov(
    learning_rate: float | Callable[[jax.Array], jax.Array],
    momentum: float = 0.9,
    period: int = 1,
) -> optax.GradientTransformation:
    """Delayed Nesterov momentum: Nesterov on the mean of every ``period`` updates.

    Each call of ``update`` is one arrival ``Delta_t`` (a pseudo-gradient: the model
    minus a worker's)::

        b <- b + Delta_t
        if t mod N == 0:  m <- beta m + b / N;  u = -eta (Delta_t / N + beta m);  b <- 0
        else:             u = -eta Delta_t / N

    with ``t`` counted from 1 and ``N = period``.

    Args:
      learning_rate: ``eta``, or a schedule of the arrival count.
      momentum: ``beta``, in [0, 1).
      period: ``N >= 1``: arrivals per momentum update (Liu et al. use the number of
        workers). 1: Nesterov SGD.

    Returns:
      an `optax.GradientTransformation` whose updates are added to the model.

    Example:
      >>> import jax.numpy as jnp
      >>> tx = delayed_nesterov(1.0, momentum=0.5, period=2)
      >>> state = tx.init(jnp.zeros(1))
      >>> u1, state = tx.update(jnp.array([2.0]), state)  # plain: -2 / 2
      >>> u2, state = tx.update(jnp.array([4.0]), state)  # m = 3: -(4 / 2 + 0.5 * 3)
      >>> print(u1, u2)
      [-1.] [-3.5]

    References:
      Liu, Chhaparia, Douillard, Kale, Rusu, Shen, Szlam & Ranzato, "Asynchronous
      Local-SGD Training for Language Modeling", arXiv:2401.09135, 2024, Algorithm 3.
    """
    if not callable(learning_rate):
        check_hyper("learning_rate", learning_rate, 0, open_low=True, why=" or a schedule")
    check_hyper("momentum", momentum, 0, 1, open_high=True)
    n = check_int("period", period, 1)
    wide = lambda x: jnp.zeros_like(x, promote_types(x.dtype, jnp.float32))  # noqa: E731

    def init_fn(params):
        return DelayedNesterovState(
            jax.tree.map(wide, params), jax.tree.map(wide, params), jnp.zeros((), jnp.int32)
        )

    def update_fn(updates, state, params=None):
        del params
        count = state.count + 1
        eta = learning_rate(state.count) if callable(learning_rate) else learning_rate
        milestone = count % n == 0
        buffer = jax.tree.map(lambda b, d: b + d.astype(b.dtype), state.buffer, updates)
        moment = jax.tree.map(
            lambda m, b: jnp.where(milestone, momentum * m + b / n, m), state.momentum, buffer
        )

        def step(d, m):  # in the momentum's (wide) dtype, cast back to the update's
            pull = jnp.where(milestone, momentum * m, jnp.zeros_like(m))
            return (-eta * (d.astype(m.dtype) / n + pull)).astype(d.dtype)

        out = jax.tree.map(step, updates, moment)
        buffer = jax.tree.map(lambda b: jnp.where(milestone, jnp.zeros_like(b), b), buffer)
        return out, DelayedNesterovState(moment, buffer, count)

    return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True)
class Plan:
    """An asynchronous algorithm's server, as `simulate` takes it: the ``outer``
    optimizer, inner steps per round ``sync_every``, ``quorum`` (None: async),
    ``grace`` seconds and DyLU's ``dynamic`` steps."""

    outer: optax.GradientTransformation
    sync_every: int
    quorum: int | None = None
    grace: float = math.inf
    dynamic: bool = False


def dynamic_steps(step_seconds: Sequence[float], sync_every: int) -> tuple[int, ...]:
    """DyLU's inner steps per round: ``max(1, floor(v_i / v_max * H))`` with ``v_i =
    1 / step_seconds[i]`` (Liu et al. 2024, eq. 6).

    Example:
      >>> dynamic_steps([1.0, 2.0, 4.0], 10)
      (10, 5, 2)
    """
    v = 1.0 / np.asarray(step_seconds, np.float64)
    return tuple(max(1, math.floor(x / v.max() * sync_every + 1e-9)) for x in v)


@dataclasses.dataclass(frozen=True)
class Arrival:
    """One pseudo-gradient's delivery: ``worker``, its round's first step (``first``,
    counted per worker) and ``steps``, when the round ``started``, the seconds it
    ``computed``, when the push ``arrived``, the global model ``version`` it started
    from, the outer step that applied it (``applied``, counted from 1) and the mean inner
    loss of its round."""

    worker: int
    first: int
    steps: int
    started: float
    computed: float
    arrived: float
    version: int
    applied: int
    loss: float


@dataclasses.dataclass
class Simulation:
    """What `simulate` returns: the final global ``params``, every `Arrival` in the
    order applied, each outer step's time (``updates``), each worker's ``busy``
    (computing), ``comm`` (pushing and pulling) and ``idle`` (waiting for a quorum)
    seconds, the bytes of one push or pull (``push_bytes``), each worker's exact
    ``bytes_sent`` and ``bytes_received``, the ``evaluations``: ``(the multiple of
    evaluate_every crossed, time, evaluate's value)``, and the last at the run's end, and
    under churn the seconds each worker was ``away`` and its ``gaps``: ``(worker, start,
    seconds, kind)`` of each absence (``"absent"``) and lost round (``"compute"``)."""

    params: Any
    arrivals: list[Arrival]
    updates: list[float]
    busy: np.ndarray
    comm: np.ndarray
    idle: np.ndarray
    push_bytes: int
    bytes_sent: np.ndarray
    bytes_received: np.ndarray
    evaluations: list[tuple[int, float, Any]]
    away: np.ndarray | None = None  # seconds each worker was away (``present``)
    # (worker, start, seconds, kind) of each absence ("absent") and lost round ("compute")
    gaps: list[tuple[int, float, float, str]] = dataclasses.field(default_factory=list)


class _Worker(NamedTuple):
    start: Any  # the global model it pulled
    version: int
    first: int  # its next step
    steps: int  # this round's
    started: float
    computed: float


def simulate(
    loss_fn: Callable[[Any, Any, Any], jax.Array],
    params: Any,
    batch: Callable[[int, int], tuple[Any, Any]],
    *,
    workers: int,
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    sync_every: int,
    total_steps: int,
    step_seconds: np.ndarray,
    link: tuple[float, float] = (0.0, math.inf),
    quorum: int | None = None,
    grace: float = math.inf,
    dynamic: bool = False,
    evaluate: Callable[[Any], Any] | None = None,
    evaluate_every: int = 0,
    present: np.ndarray | None = None,
) -> Simulation:
    """Async DiLoCo (``quorum=None``) or its quorum variant, on a simulated clock.

    Every worker starts from ``params`` at time 0 with a fresh ``inner`` state, which it
    keeps across its rounds. A round of worker ``i`` is ``H_i`` inner steps (``H_i =
    sync_every``, or `dynamic_steps` with ``dynamic``); its ``k``-th step overall takes
    ``step_seconds[k, i]`` seconds and trains on ``batch(k, i)``. The server applies
    ``outer`` to the pseudo-gradient (async) or to the token-weighted mean of a quorum's::

        Delta_i = theta_start - theta_i
        theta  <- theta + outer.update(Delta, state)      (in the order of the clock)

    The run ends when ``total_steps`` inner steps have been assigned to rounds, over all
    workers, and every round has been applied.

    Args:
      loss_fn: ``loss_fn(params, x, y)``, a scalar.
      params: the initial global model.
      batch: ``batch(k, i)``: worker ``i``'s ``(x, y)`` for its ``k``-th step.
      workers: how many.
      inner, outer: optax transformations (``outer``: e.g. `delayed_nesterov`).
      sync_every: ``H``, inner steps per round.
      total_steps: inner steps of all workers together.
      step_seconds: ``[steps, workers]`` seconds (rows past a worker's steps are not
        read; a worker's ``k``-th step reads row ``k``).
      link: ``(latency s, bandwidth bytes/s)`` of a worker's link to the server.
      quorum: None (async), or ``q`` in [1, workers].
      grace: seconds a quorum waits after its first arrival.
      dynamic: DyLU's steps per round.
      evaluate: called with the global model after outer steps that cross a multiple of
        ``evaluate_every`` inner steps (``workers`` per synchronous step), and at the end.
      evaluate_every: inner steps between evaluations (0: only at the end).
      present: None (every worker at every step) or ``[steps, workers]`` bools: whether
        worker ``i`` trains its ``k``-th inner step (row ``k``; rows past the end repeat
        the last), the module's churn rule.

    Returns:
      a `Simulation`.

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax
      >>> loss = lambda p, x, y: jnp.mean((p * x - y) ** 2)
      >>> sim = simulate(loss, jnp.zeros(()), lambda k, i: (1.0, 1.0), workers=2,
      ...                inner=optax.sgd(0.1), outer=delayed_nesterov(1.0, 0.0),
      ...                sync_every=2, total_steps=8, step_seconds=np.ones((8, 2)))
      >>> [a.worker for a in sim.arrivals], round(float(sim.params), 4)
      ([0, 1, 0, 1], 1.0512)

    References:
      Liu et al., "Asynchronous Local-SGD Training for Language Modeling",
      arXiv:2401.09135, 2024.
    """
    n = check_int("workers", workers, 1)
    h = check_int("sync_every", sync_every, 1)
    budget = check_int("total_steps", total_steps, 1)
    if quorum is not None:
        check_int("quorum", quorum, 1, n)
    if math.isfinite(grace):
        check_hyper("grace", grace, 0)
    seconds = np.asarray(step_seconds, np.float64)
    if seconds.ndim != 2 or seconds.shape[1] != n or not np.all(seconds > 0):
        raise ValueError(f"step_seconds must be [steps, {n}] positive seconds, got {seconds.shape}")
    here = None if present is None else np.asarray(present, bool)
    if here is not None and (here.ndim != 2 or here.shape[1] != n or not len(here)):
        raise ValueError(f"present must be [steps, {n}] bools, got {np.shape(present)}")
    rounds = dynamic_steps(seconds.mean(0), h) if dynamic else (h,) * n
    nbytes = sum(4 * int(np.size(x)) for x in jax.tree.leaves(params))
    latency, bandwidth = link
    transfer = latency + nbytes / bandwidth
    round_fn = _round(loss_fn, inner)

    theta, version = params, 0
    outer_state = outer.init(params)
    inner_states = [inner.init(params) for _ in range(n)]
    busy, comm, idle = np.zeros(n), np.zeros(n), np.zeros(n)
    sent, received = np.zeros(n, np.int64), np.zeros(n, np.int64)
    arrivals: list[Arrival] = []
    updates: list[float] = []
    evaluations: list[tuple[int, float, Any]] = []
    assigned, applied_steps = 0, 0
    running: dict[int, _Worker] = {}
    # (time, kind, worker): kind 0 a worker's push arrives, 1 a quorum's grace ends, 2 a
    # worker comes back (churn), 3 a worker leaves inside its round.
    events: list[tuple[float, int, int]] = []
    pending: list[tuple[Arrival, Any]] = []
    deadline = math.inf
    next_eval = evaluate_every or math.inf
    away = np.zeros(n)
    gaps: list[tuple[int, float, float, str]] = []
    resume: dict[int, int] = {}  # a worker away or leaving: the step it goes on from

    def on(k: int, i: int) -> bool:
        return here is None or bool(here[min(k, len(here) - 1), i])

    def start(i: int, now: float, first: int) -> None:
        nonlocal assigned
        if not on(first, i):  # away: gone for these steps' seconds (kind 2: back)
            back = first
            while back < len(seconds) and not on(back, i):
                back += 1
            if back < len(seconds) and assigned < budget:
                gap = float(seconds[first:back, i].sum())
                away[i] += gap
                gaps.append((i, now, gap, "absent"))
                resume[i] = back
                heapq.heappush(events, (now + gap, 2, i))
            return
        steps = min(rounds[i], budget - assigned)
        if steps <= 0:
            return
        if first + steps > len(seconds):
            raise ValueError(
                f"step_seconds has {len(seconds)} rows; worker {i} needs {first + steps}"
            )
        kept = next((k for k in range(steps) if not on(first + k, i)), steps)
        if kept < steps:  # it leaves inside this round: the steps so far are lost (kind 3)
            assigned += kept
            lost = float(seconds[first : first + kept, i].sum())
            busy[i] += lost
            gaps.append((i, now, lost, "compute"))
            resume[i] = first + kept
            heapq.heappush(events, (now + lost, 3, i))
            return
        assigned += steps
        compute = float(seconds[first : first + steps, i].sum())
        busy[i] += compute
        comm[i] += transfer
        running[i] = _Worker(theta, version, first, steps, now, compute)
        heapq.heappush(events, (now + compute + transfer, 0, i))

    def apply(delta: Any, when: float, group: list[tuple[Arrival, Any]]) -> None:
        nonlocal theta, outer_state, version, applied_steps, next_eval
        u, outer_state = outer.update(delta, outer_state, theta)
        theta = optax.apply_updates(theta, u)
        version += 1
        updates.append(when)
        for a, _ in group:
            arrivals.append(dataclasses.replace(a, applied=version))
            applied_steps += a.steps
        if evaluate is not None and applied_steps >= next_eval:
            value = evaluate(theta)
            while applied_steps >= next_eval:  # every multiple crossed, one evaluation
                evaluations.append((next_eval, when, value))
                next_eval += evaluate_every

    def pull(i: int, now: float) -> None:
        received[i] += nbytes
        comm[i] += transfer
        w = running.pop(i)
        start(i, now + transfer, w.first + w.steps)

    def fire(now: float) -> None:
        nonlocal pending, deadline
        group, pending, deadline = pending, [], math.inf
        weights = [a.steps for a, _ in group]  # tokens: every step is one batch
        deltas = [d for _, d in group]
        if len(set(weights)) == 1:
            mean = jax.tree.map(lambda *d: sum(d[1:], d[0]) / len(d), *deltas)
        else:
            total = float(sum(weights))
            mean = jax.tree.map(
                lambda *d: sum((w / total * x for w, x in zip(weights[1:], d[1:])),
                               weights[0] / total * d[0]),
                *deltas,
            )  # fmt: skip
        apply(mean, now, group)
        for a, _ in group:
            idle[a.worker] += now - a.arrived
            pull(a.worker, now)

    for i in range(n):
        start(i, 0.0, 0)
    while events:
        now, kind, i = heapq.heappop(events)
        if kind == 1:  # a grace window ends: fire the quorum it belongs to, if waiting
            if pending and now >= deadline:
                fire(now)
            continue
        if kind == 2:  # back from away: pull the global model, start a round
            received[i] += nbytes
            comm[i] += transfer
            start(i, now + transfer, resume.pop(i))
            continue
        if kind == 3:  # left inside a round: away from its next step
            start(i, now, resume.pop(i))
            continue
        w = running[i]
        xs, ys = _stack([batch(w.first + k, i) for k in range(w.steps)])
        local, inner_states[i], losses = round_fn(w.start, inner_states[i], xs, ys)
        delta = jax.tree.map(jnp.subtract, w.start, local)
        sent[i] += nbytes
        arrival = Arrival(i, w.first, w.steps, w.started, w.computed, now, w.version, 0,
                          float(jnp.mean(losses)))  # fmt: skip
        if quorum is None:
            apply(delta, now, [(arrival, delta)])
            pull(i, now)
            continue
        if not pending:
            deadline = now + grace
            if math.isfinite(deadline):
                heapq.heappush(events, (deadline, 1, -1))
        pending.append((arrival, delta))
        # Fire at q, or when no other push is on its way (the rest wait or are done).
        if len(pending) >= quorum or not any(k == 0 for _, k, _ in events):
            fire(now)

    if evaluate is not None and (not evaluations or evaluations[-1][0] != applied_steps):
        evaluations.append((applied_steps, updates[-1] if updates else 0.0, evaluate(theta)))
    return Simulation(theta, arrivals, updates, busy, comm, idle, nbytes, sent, received,
                      evaluations, away, gaps)  # fmt: skip


def _stack(pairs: list[tuple[Any, Any]]) -> tuple[Any, Any]:
    xs, ys = zip(*pairs)
    return jnp.stack([jnp.asarray(x) for x in xs]), jnp.stack([jnp.asarray(y) for y in ys])


def _round(loss_fn: Callable, inner: optax.GradientTransformation) -> Callable:
    """One worker's round as one compiled program: a scan of its inner steps from the
    global model it pulled (compiled once per round length)."""

    @jax.jit
    def run(params, state, xs, ys):
        def body(carry, batch):
            p, s = carry
            loss, grads = jax.value_and_grad(loss_fn)(p, *batch)
            u, s = inner.update(grads, s, p)
            return (optax.apply_updates(p, u), s), loss

        (params, state), losses = jax.lax.scan(body, (params, state), (xs, ys))
        return params, state, losses

    return run
