"""Asynchronous outer steps (`shoal.experiments.asynchronous`): Delayed Nesterov against
a NumPy oracle of Liu et al.'s Algorithm 3, async DiLoCo on a fixed arrival order against
an event-by-event float64 oracle, the quorum rule (q arrivals, the grace window, token
weights), synchronous DiLoCo as the quorum of all, exact bytes, and determinism."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import UNDER_MPI, adam

from shoal.comms import AxisCollective
from shoal.experiments.asynchronous import delayed_nesterov, dynamic_steps, simulate
from shoal.optim import diloco, update_and_apply

pytestmark = pytest.mark.skipif(UNDER_MPI, reason="one process simulates every worker")

# ------------------------------------------------------------------- Delayed Nesterov


def dn_oracle(deltas, eta, beta, n):
    m, b, out = np.zeros_like(deltas[0]), np.zeros_like(deltas[0]), []
    for t, d in enumerate(deltas, 1):
        b = b + d
        if t % n == 0:
            m = beta * m + b / n
            out.append(-eta * (d / n + beta * m))
            b = np.zeros_like(b)
        else:
            out.append(-eta * d / n)
    return out


@pytest.mark.parametrize("period", [1, 2, 3])
def test_delayed_nesterov_is_algorithm_3(period):
    rng = np.random.default_rng(period)
    deltas = [rng.normal(size=4) for _ in range(7)]
    with jax.enable_x64():
        tx = delayed_nesterov(0.7, 0.9, period)
        state = tx.init(jnp.zeros(4, jnp.float64))
        for d, want in zip(deltas, dn_oracle(deltas, 0.7, 0.9, period), strict=True):
            u, state = tx.update(jnp.asarray(d), state)
            np.testing.assert_allclose(u, want, rtol=1e-12, atol=1e-15)


def test_over_n_arrivals_it_is_one_nesterov_step_on_their_mean():
    deltas = [np.array([1.0, -2.0]), np.array([3.0, 0.5]), np.array([-1.0, 4.0])]
    moved = sum(dn_oracle(deltas, 0.5, 0.8, 3))
    mean = sum(deltas) / 3
    np.testing.assert_allclose(moved, -0.5 * (mean + 0.8 * mean))  # m = mean from m = 0


def test_period_one_is_optax_nesterov_bit_for_bit():
    tx, ref = delayed_nesterov(0.7, 0.9, 1), optax.sgd(0.7, 0.9, nesterov=True)
    s, r = tx.init(jnp.zeros(5)), ref.init(jnp.zeros(5))
    for k in range(6):
        g = jnp.asarray(np.random.default_rng(k).normal(size=5), jnp.float32)
        (u, s), (v, r) = tx.update(g, s), ref.update(g, r)
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(learning_rate=0.0), "learning_rate must be a finite number > 0 or a schedule"),
        (dict(learning_rate=1.0, momentum=1.0), r"momentum must be a number in \[0, 1\)"),
        (dict(learning_rate=1.0, period=0), "period must be an int >= 1"),
    ],
)
def test_delayed_nesterov_names_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        delayed_nesterov(**kwargs)


def test_dynamic_local_updates_follow_speed():
    assert dynamic_steps([1.0, 2.0, 4.0], 10) == (10, 5, 2)
    assert dynamic_steps([1.0, 100.0], 10) == (10, 1)  # at least one step
    assert dynamic_steps([0.3, 0.3, 0.3], 7) == (7, 7, 7)


# -------------------------------------------------------------- async DiLoCo, by oracle

DIM, ROWS, WORKERS = 3, 4, 3
RNG = np.random.default_rng(0)
A = RNG.normal(size=(64, WORKERS, ROWS, DIM))
B = RNG.normal(size=(64, WORKERS, ROWS))


def loss(p, x, y):
    return 0.5 * jnp.mean((x @ p - y) ** 2)


def grad(p, x, y):
    return x.T @ (x @ p - y) / len(y)


def batch(k, i):
    return A[k, i], B[k, i]


def async_oracle(speeds, h, total, lr, eta, beta, period, transfer, present=None):
    """Event by event in float64: the earliest event first (ties: a push before a return
    before a departure, then the lower worker). With ``present`` (churn), a worker away
    at a round's start comes back after those steps' seconds and pulls; one that leaves
    inside a round loses it."""
    theta = np.zeros(DIM)
    m, buf, count = np.zeros(DIM), np.zeros(DIM), 0
    nxt = [0] * WORKERS
    assigned, order = 0, []
    plan = {}  # worker -> (kind, ..., time): "push" (start model, first, steps), "back", "left"
    away = np.zeros(WORKERS)
    on = lambda k, i: present is None or present[min(k, len(present) - 1), i]  # noqa: E731

    def start(i, now):
        nonlocal assigned
        k = nxt[i]
        if not on(k, i):
            back = k
            while back < 64 and not on(back, i):
                back += 1
            if back < 64 and assigned < total:
                away[i] += (back - k) * speeds[i]
                plan[i] = ("back", back, now + (back - k) * speeds[i])
            return
        steps = min(h, total - assigned)
        if steps <= 0:
            return
        kept = next((j for j in range(steps) if not on(k + j, i)), steps)
        if kept < steps:
            assigned += kept
            plan[i] = ("left", k + kept, now + kept * speeds[i])
            return
        assigned += steps
        plan[i] = ("push", theta.copy(), k, steps, now + steps * speeds[i] + transfer)

    kinds = {"push": 0, "back": 2, "left": 3}
    for i in range(WORKERS):
        start(i, 0.0)
    while plan:
        i = min(plan, key=lambda w: (plan[w][-1], kinds[plan[w][0]], w))
        kind, *rest, when = plan.pop(i)
        if kind != "push":
            nxt[i] = rest[0]
            start(i, when + transfer if kind == "back" else when)
            continue
        theta0, first, steps = rest
        p = theta0.copy()
        for k in range(first, first + steps):
            p = p - lr * grad(p, *batch(k, i))
        delta = theta0 - p
        count += 1
        buf = buf + delta
        if count % period == 0:
            m = beta * m + buf / period
            theta = theta - eta * (delta / period + beta * m)
            buf = np.zeros(DIM)
        else:
            theta = theta - eta * delta / period
        order.append((i, when))
        nxt[i] = first + steps
        start(i, when + transfer)
    return (theta, order, away) if present is not None else (theta, order)


def test_churn_a_worker_away_pulls_when_back_and_a_departure_loses_the_round():
    speeds, h, total = [1.0, 2.0, 3.5], 4, 36
    present = np.ones((64, WORKERS), bool)
    present[5:10, 1] = False  # worker 1 away for its steps 5-9: leaves inside round 2
    present[0:3, 2] = False  # worker 2 arrives late, at its step 3
    present[9:, 0] = False  # worker 0 leaves for good at its step 9 (inside round 3)
    want, order, away = async_oracle(speeds, h, total, 0.1, 0.7, 0.9, 3, 0.75, present)
    with jax.enable_x64():
        sim = simulate(loss, jnp.zeros(DIM), batch, workers=WORKERS, inner=optax.sgd(0.1),
                       outer=delayed_nesterov(0.7, 0.9, 3), sync_every=h, total_steps=total,
                       step_seconds=np.tile(speeds, (64, 1)), link=(0.25, 4 * DIM / 0.5),
                       present=present)  # fmt: skip
    assert [(a.worker, a.arrived) for a in sim.arrivals] == order
    np.testing.assert_allclose(sim.params, want, rtol=1e-12)
    np.testing.assert_allclose(sim.away, away)
    assert sum(a.worker == 0 for a in sim.arrivals) == 2  # rounds 0-3 and 4-7, then gone
    assert min(a.first for a in sim.arrivals if a.worker == 2) == 3
    pulls = np.bincount([a.worker for a in sim.arrivals], minlength=WORKERS) + (away > 0)
    np.testing.assert_array_equal(sim.bytes_received, pulls * 4 * DIM)


@pytest.mark.parametrize("period", [1, 3])
def test_async_diloco_on_a_fixed_arrival_order_is_the_oracle(period):
    speeds, h, total = [1.0, 2.0, 3.5], 4, 40
    latency, bandwidth = 0.25, 4 * DIM / 0.5  # a push or pull: 0.25 + 0.5 s
    want, order = async_oracle(speeds, h, total, 0.1, 0.7, 0.9, period, 0.75)
    with jax.enable_x64():
        sim = simulate(loss, jnp.zeros(DIM), batch, workers=WORKERS, inner=optax.sgd(0.1),
                       outer=delayed_nesterov(0.7, 0.9, period), sync_every=h, total_steps=total,
                       step_seconds=np.tile(speeds, (64, 1)),
                       link=(latency, bandwidth))  # fmt: skip
    assert [(a.worker, a.arrived) for a in sim.arrivals] == order  # binary fractions: exact
    assert len(order) == total // h and order[0][0] == 0 and order[-1][0] != 0
    np.testing.assert_allclose(sim.params, want, rtol=1e-12)
    rounds = np.bincount([a.worker for a in sim.arrivals], minlength=WORKERS)
    np.testing.assert_array_equal(sim.bytes_sent, rounds * 4 * DIM)  # float32 on the wire
    np.testing.assert_array_equal(sim.bytes_received, rounds * 4 * DIM)
    np.testing.assert_allclose(sim.busy, rounds * h * np.array(speeds))
    assert not sim.idle.any()  # asynchronous: nobody waits
    assert [a.applied for a in sim.arrivals] == list(range(1, len(order) + 1))
    stale = [a.applied - 1 - a.version for a in sim.arrivals]
    assert max(stale) >= 1  # slow workers' pseudo-gradients arrive stale


def run_quorum(q, grace, speeds, dynamic=False, h=4, total=24):
    return simulate(loss, jnp.zeros(DIM), batch, workers=WORKERS, inner=optax.sgd(0.1),
                    outer=optax.sgd(1.0), sync_every=h, total_steps=total,
                    step_seconds=np.tile(speeds, (64, 1)), quorum=q, grace=grace,
                    dynamic=dynamic)  # fmt: skip


def test_a_quorum_fires_at_q_arrivals_and_the_late_one_joins_the_next():
    sim = run_quorum(2, math.inf, [1.0, 1.0, 3.0])
    # Workers 0 and 1 arrive at 4 s and fire; again at 8 s; worker 2 (12 s) waits for the
    # next: 0 and 1 arrive at 12 s too, so the third quorum is 0 and 1, worker 2 the fourth.
    first = [(a.worker, a.arrived, a.applied) for a in sim.arrivals[:4]]
    assert first == [(0, 4.0, 1), (1, 4.0, 1), (0, 8.0, 2), (1, 8.0, 2)]
    assert sim.updates[:2] == [4.0, 8.0]
    assert sum(a.steps for a in sim.arrivals) == 24


def test_the_grace_window_fires_a_partial_quorum():
    sim = run_quorum(3, 0.5, [1.0, 1.0, 3.0])
    # 0 and 1 arrive at 4 s; worker 2 is 8 s away: the window closes at 4.5 s.
    assert sim.updates[0] == 4.5
    assert [a.worker for a in sim.arrivals if a.applied == 1] == [0, 1]
    # Each worker waited from its arrival to the step that applied it.
    for i in range(WORKERS):
        waits = [sim.updates[a.applied - 1] - a.arrived for a in sim.arrivals if a.worker == i]
        assert sim.idle[i] == pytest.approx(sum(waits))
    assert sim.idle[0] >= 0.5


def test_a_quorum_weights_pseudo_gradients_by_tokens():
    # DyLU: worker 2 (4x slower) runs 1 step per round where the others run 4; one quorum
    # of all three: the outer SGD(1) step is the token-weighted mean.
    sim = run_quorum(3, math.inf, [1.0, 1.0, 4.0], dynamic=True, total=9)
    assert [a.steps for a in sim.arrivals] == [4, 4, 1]
    deltas = []
    for i, steps in ((0, 4), (1, 4), (2, 1)):
        p = np.zeros(DIM)
        for k in range(steps):
            p = p - 0.1 * grad(p, *batch(k, i))
        deltas.append(-p)
    want = -(4 * deltas[0] + 4 * deltas[1] + 1 * deltas[2]) / 9
    np.testing.assert_allclose(sim.params, want, rtol=1e-5, atol=1e-7)


def test_the_quorum_of_all_is_synchronous_diloco():
    h, steps = 4, 12
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    sim = simulate(loss, jnp.zeros(DIM, jnp.float32), batch, workers=WORKERS,
                   inner=adam(0.05), outer=outer, sync_every=h,
                   total_steps=steps * WORKERS, step_seconds=np.ones((64, WORKERS)),
                   quorum=WORKERS)  # fmt: skip
    tx = diloco(adam(0.05), collective=AxisCollective("w", WORKERS), sync_every=h,
                outer=outer)  # fmt: skip
    params = jnp.zeros((WORKERS, DIM), jnp.float32)
    state = jax.vmap(tx.init, axis_name="w")(params)

    def step(p, s, x, y):
        return update_and_apply(tx, jax.grad(loss)(p, x, y), s, p)

    step = jax.vmap(step, axis_name="w")
    for k in range(steps):
        params, state = step(params, state, jnp.asarray(A[k], jnp.float32),
                             jnp.asarray(B[k], jnp.float32))  # fmt: skip
    np.testing.assert_allclose(sim.params, params[0], rtol=2e-5, atol=1e-6)
    assert sim.updates == [4.0, 8.0, 12.0]


def test_same_inputs_same_simulation_bit_for_bit():
    speeds = np.random.default_rng(1).lognormal(0, 0.5, (64, WORKERS))
    kwargs = dict(workers=WORKERS, inner=optax.sgd(0.1), outer=delayed_nesterov(0.7, 0.9, 3),
                  sync_every=4, total_steps=36, step_seconds=speeds, dynamic=True)  # fmt: skip
    a = simulate(loss, jnp.zeros(DIM), batch, **kwargs)
    b = simulate(loss, jnp.zeros(DIM), batch, **kwargs)
    assert a.arrivals == b.arrivals and a.updates == b.updates
    np.testing.assert_array_equal(a.params, b.params)


def test_evaluations_follow_the_inner_steps():
    seen = []
    sim = simulate(loss, jnp.zeros(DIM), batch, workers=WORKERS, inner=optax.sgd(0.1),
                   outer=delayed_nesterov(1.0, 0.0), sync_every=4, total_steps=24,
                   step_seconds=np.ones((64, WORKERS)), evaluate=lambda p: seen.append(p) or 1,
                   evaluate_every=12)  # fmt: skip
    assert [e[0] for e in sim.evaluations] == [12, 24]
    assert len(seen) == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(quorum=4), r"quorum must be an int in \[1, 3\]"),
        (dict(step_seconds=np.ones((64, 2))), r"step_seconds must be \[steps, 3\]"),
        (dict(step_seconds=np.ones((2, 3))), "step_seconds has 2 rows; worker 0 needs 4"),
        (dict(grace=-1.0), "grace must be a finite number >= 0"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    args = dict(workers=WORKERS, inner=optax.sgd(0.1), outer=optax.sgd(1.0), sync_every=4,
                total_steps=12, step_seconds=np.ones((64, WORKERS))) | kwargs  # fmt: skip
    with pytest.raises(ValueError, match=match):
        simulate(loss, jnp.zeros(DIM), batch, **args)


def test_the_modules_examples_run():
    import doctest

    from shoal.experiments import asynchronous

    result = doctest.testmod(asynchronous)
    assert result.attempted >= 3 and result.failed == 0
