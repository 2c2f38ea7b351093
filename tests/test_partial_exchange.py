"""shoal.optim.partial_exchange (KungFu PGX) against hand-computed packings and a NumPy
oracle, on 4 simulated workers and under mpiexec -n 4 (same file, rank-agnostic)."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import UNDER_MPI, my_ranks, n_workers, run_workers, world

from shoal.comms import AxisCollective, wire_bytes
from shoal.optim import PartialExchangeState, allreduce_gradients, partial_exchange
from shoal.optim.helpers import partial_exchange_bins

N = n_workers()

# Gradient tree for the exchange tests: float32 leaves of 12, 32, 20, 16 and 8 bytes
# (88 in all), in jax.tree.leaves order a, b, c, d, e.
SHAPES = {"a": (3,), "b": (2, 4), "c": (5,), "d": (4,), "e": (2,)}
LEAVES = list(SHAPES)
# By hand, budget 0.4: capacity floor(0.4 * 88) = 35 bytes. FFD order b32 c20 d16 a12 e8:
# b -> bin 0 (32); c -> bin 1 (20); d fits neither (48, 36) -> bin 2 (16);
# a -> bin 1 (32); e fits neither bin 0 (40) nor bin 1 (40) -> bin 2 (24).
BINS_04 = [["b"], ["a", "c"], ["d", "e"]]
BIN_BYTES_04 = [32, 32, 24]
ALL = [LEAVES]  # budget 1: one bin of everything


def make_grads(steps, seed=0, workers=N):
    """Per-worker, per-step gradients: leaves [workers, steps, *shape]."""
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=(workers, steps, *s)).astype(np.float32) for k, s in SHAPES.items()}


def ring_bytes(nbytes):
    return 2 * (N - 1) * nbytes // N


def run_steps(make_tx, grads):
    """Apply ``make_tx(collective)`` for every step; {rank: (updates[T], bins, fractions,
    wire sent[T], wire received[T])}."""

    def worker(coll, g):
        tx = make_tx(coll)
        state = tx.init(jax.tree.map(lambda x: x[0], g))
        assert isinstance(state, PartialExchangeState)

        def body(s, g_t):
            u, s = tx.update(g_t, s)
            w = wire_bytes(s, "step")
            return s, (u, s.bin, s.fraction, w.sent, w.received)

        return jax.lax.scan(body, state, g)[1]

    return run_workers(worker, grads)


def check_against_oracle(out, grads, schedule_bins):
    """``schedule_bins[t]`` = (flat bin index, leaves exchanged at step t, fraction)."""
    for rank, (u, bins, fractions, sent, received) in out.items():
        for t, (flat_bin, exchanged, fraction) in enumerate(schedule_bins):
            assert int(bins[t]) == flat_bin, (rank, t)
            assert float(fractions[t]) == np.float32(fraction)
            nbytes = sum(4 * math.prod(SHAPES[k]) for k in exchanged)
            assert (int(sent[t]), int(received[t])) == (ring_bytes(nbytes),) * 2
            for k in LEAVES:
                if k in exchanged:
                    mean = grads[k][:, t].astype(np.float64).mean(0)
                    np.testing.assert_allclose(u[k][t], mean, rtol=1e-6, atol=1e-7)
                else:
                    np.testing.assert_array_equal(u[k][t], grads[k][rank, t])


def test_first_fit_decreasing_packing():
    # Bytes, not elements: b is 10 float32 (40 bytes), the rest float16.
    tree = {
        "a": jax.ShapeDtypeStruct((5,), jnp.float16),  # 10 bytes
        "b": jax.ShapeDtypeStruct((10,), jnp.float32),  # 40
        "c": jax.ShapeDtypeStruct((15,), jnp.float16),  # 30
        "d": {"x": jax.ShapeDtypeStruct((10,), jnp.float16)},  # 20
        "e": jax.ShapeDtypeStruct((2, 5), jnp.float16),  # 20
        "f": jax.ShapeDtypeStruct((3, 5), jnp.float16),  # 30
    }
    # Total 150, budget 0.4: capacity 60. Sorted: b40 c30 f30 d20 e20 a10 (ties in leaf
    # order). b -> bin 0; c -> bin 1 (70 > 60 in bin 0); f -> bin 1 (60); d -> bin 0 (60);
    # e -> bin 2; a -> bin 2 (30). Within a bin, paths are in leaf order.
    assert partial_exchange_bins(tree, 0.4) == (
        ("['b']", "['d']['x']"),
        ("['c']", "['f']"),
        ("['a']", "['e']"),
    )
    # Budget 1: one bin with every leaf.
    assert partial_exchange_bins(tree, 1.0) == (
        ("['a']", "['b']", "['c']", "['d']['x']", "['e']", "['f']"),
    )
    # Budget 0.5: capacity 75. b -> bin 0; c -> bin 0 (70); f -> bin 1 (100 > 75);
    # d -> bin 1 (50); e -> bin 1 (70); a fits neither (80, 80) -> bin 2.
    assert partial_exchange_bins(tree, 0.5) == (
        ("['b']", "['c']"),
        ("['d']['x']", "['e']", "['f']"),
        ("['a']",),
    )
    arrays = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    assert partial_exchange_bins(arrays, 0.4) == tuple(
        tuple(f"['{k}']" for k in b) for b in BINS_04
    )


def test_too_small_budget_names_the_smallest_fraction():
    tree = {"big": jnp.zeros(10), "small": jnp.zeros((5,))}  # 40 of 60 bytes
    with pytest.raises(ValueError, match=r"budget_fraction.*\['big'\] has 40 bytes") as e:
        partial_exchange_bins(tree, 0.5)  # capacity 30
    named = float(re.search(r"smallest fraction that fits it is ([0-9.e-]+)", str(e.value))[1])
    assert named == pytest.approx(40 / 60, rel=1e-15)
    assert partial_exchange_bins(tree, named) == (("['big']",), ("['small']",))
    with pytest.raises(ValueError):
        partial_exchange_bins(tree, math.nextafter(named, 0.0))


def test_too_small_budget_raises_at_update_naming_the_schedule_entry():
    coll = AxisCollective("w", 1)
    grads = {k: jnp.zeros((1, *s)) for k, s in SHAPES.items()}  # 32 of 88 bytes is b
    tx = partial_exchange(1.0, collective=coll, schedule={5: 0.3})
    with pytest.raises(ValueError, match=r"schedule\[5\]=0.3.*smallest fraction"):
        jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name="w")(grads)


@pytest.mark.mpi
def test_round_robin_over_two_rounds():
    steps = 2 * len(BINS_04)
    grads = make_grads(steps)
    out = run_steps(lambda c: partial_exchange(0.4, collective=c), grads)
    expect = [(t % 3, BINS_04[t % 3], 0.4) for t in range(steps)]
    check_against_oracle(out, grads, expect)
    # The wire bytes by hand, too: bins of 32, 32, 24 bytes.
    for _, (_, _, _, sent, _) in out.items():
        assert np.asarray(sent).tolist() == [ring_bytes(b) for b in BIN_BYTES_04] * 2


@pytest.mark.mpi
def test_budget_one_is_allreduce_gradients_bit_for_bit():
    grads = make_grads(3, seed=1)

    def worker(coll, g):
        pgx, ar = partial_exchange(1.0, collective=coll), allreduce_gradients(collective=coll)
        s, s_ar = pgx.init(g), ar.init(g)
        outs = []
        for t in range(3):
            g_t = jax.tree.map(lambda x, t=t: x[t], g)
            u, s = pgx.update(g_t, s)
            u_ar, s_ar = ar.update(g_t, s_ar)
            outs.append((u, u_ar, wire_bytes(s, "step"), wire_bytes(s_ar, "step"), s.bin))
        return outs

    for _, outs in run_workers(worker, grads).items():
        for u, u_ar, w, w_ar, b in outs:
            jax.tree.map(np.testing.assert_array_equal, u, u_ar)
            assert (int(w.sent), int(w.received)) == (int(w_ar.sent), int(w_ar.received))
            assert int(b) == 0


def jitted_workers(make_tx, traces):
    """One jitted step for this process's workers (stacked under simulation), counting
    traces of the update."""
    coll = world()
    tx = make_tx(coll)

    def step(g, s):
        traces.append(1)
        return tx.update(g, s)

    if UNDER_MPI:
        at_step = lambda tree, t: jax.tree.map(lambda x: x[coll._rank, t], tree)
        return jax.jit(step), jax.jit(tx.init), at_step, lambda tree, r: tree
    at_step = lambda tree, t: jax.tree.map(lambda x: x[:, t], tree)
    pick = lambda tree, r: jax.tree.map(lambda x: x[r], tree)
    stacked_step = jax.jit(jax.vmap(step, axis_name=coll.axis_name))
    return stacked_step, jax.jit(jax.vmap(tx.init)), at_step, pick


# name -> (budget_fraction, schedule, the segments by hand: (start step, bins, fraction)).
# Switches at step 4 or 5, not a multiple of P = 3, so a missed restart would show.
SCHEDULES = {
    "spec-example": (0.4, {0: 1.0, 3: 0.4}, [(0, ALL, 1.0), (3, BINS_04, 0.4)]),
    "key-0": (0.4, {0: 1.0, 4: 0.4}, [(0, ALL, 1.0), (4, BINS_04, 0.4)]),
    "no-key-0": (1.0, {4: 0.4}, [(0, ALL, 1.0), (4, BINS_04, 0.4)]),
    "three-segments": (
        0.4,
        {0: 0.4, 4: 1.0, 5: 0.4},
        [(0, BINS_04, 0.4), (4, ALL, 1.0), (5, BINS_04, 0.4)],
    ),
}


def schedule_oracle(name, steps):
    """Per step: (flat bin index, leaves exchanged, fraction). Segment k's bins are numbered
    after those of the segments before it; its round robin starts at its first step."""
    segments = SCHEDULES[name][2]
    out = []
    for t in range(steps):
        k = max(j for j, (start, _, _) in enumerate(segments) if start <= t)
        start, bins, fraction = segments[k]
        b = (t - start) % len(bins)
        out.append((sum(len(s[1]) for s in segments[:k]) + b, bins[b], fraction))
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_switches_restarts_at_bin_zero_and_never_retraces(name):
    budget, schedule, _ = SCHEDULES[name]
    steps = 10
    grads = make_grads(steps, seed=2)
    traces = []
    step, init, at_step, pick = jitted_workers(
        lambda c: partial_exchange(budget, collective=c, schedule=schedule), traces
    )
    state = init(at_step(grads, 0))
    assert np.all(np.asarray(state.bin) == -1)
    assert np.allclose(state.fraction, schedule_oracle(name, steps)[0][2])
    per_step = []
    for t in range(steps):
        u, state = step(at_step(grads, t), state)
        w = wire_bytes(state, "step")
        per_step.append((u, state.bin, state.fraction, w.sent, w.received))
    assert len(traces) == 1 and step._cache_size() == 1
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs, axis=-1), *per_step)
    out = {}
    for r in my_ranks():
        u, b, f, s, rcv = pick(stacked, r)
        out[r] = (jax.tree.map(lambda x: jnp.moveaxis(x, -1, 0), u), b, f, s, rcv)
    check_against_oracle(out, grads, schedule_oracle(name, steps))


def test_schedule_bins_are_bitwise_allreduce_in_a_budget_one_segment():
    # Inside the lax.switch the budget-1 branch is still the whole-tree mean.
    coll = AxisCollective("w", 4)
    grads = make_grads(1, seed=3, workers=4)
    pgx = partial_exchange(0.4, collective=coll, schedule={0: 1.0, 1: 0.4})
    ar = allreduce_gradients(collective=coll)

    def worker(g):
        g0 = jax.tree.map(lambda x: x[0], g)
        return pgx.update(g0, pgx.init(g0))[0], ar.update(g0, ar.init(g0))[0]

    u, u_ar = jax.jit(jax.vmap(worker, axis_name="w"))(grads)
    jax.tree.map(np.testing.assert_array_equal, u, u_ar)


@pytest.mark.parametrize("bad", [0, 0.0, 1.5, -0.1, float("nan"), True, "0.5", None])
def test_bad_budget_fraction(bad):
    coll = AxisCollective("w", 4)
    with pytest.raises(ValueError, match="budget_fraction"):
        partial_exchange(bad, collective=coll)
    with pytest.raises(ValueError, match="budget_fraction"):
        partial_exchange_bins({"a": jnp.zeros(3)}, bad)


@pytest.mark.parametrize(
    "schedule",
    [
        {0: 1.0, 3: 1.5},
        {0: 0.0},
        {2: -0.5},
        {-1: 0.5},
        {1.5: 0.5},
        {"3": 0.5},
        {True: 0.5},
        {},
        [(0, 0.5)],
    ],
)
def test_bad_schedule(schedule):
    with pytest.raises(ValueError, match="schedule"):
        partial_exchange(0.5, collective=AxisCollective("w", 4), schedule=schedule)


def test_accepts_numpy_steps_and_fractions():
    schedule = {np.int64(0): np.float64(0.5), 2: 1}
    tx = partial_exchange(np.float32(1.0), collective=AxisCollective("w", 1), schedule=schedule)
    assert float(tx.init(None).fraction) == 0.5


def test_rejects_integer_gradients():
    coll = AxisCollective("w", 1)
    tx = partial_exchange(1.0, collective=coll)
    g = {"w": jnp.zeros((1, 3), jnp.int32)}
    with pytest.raises(ValueError, match=r"floating point.*\['w'\]"):
        jax.vmap(lambda g: tx.update(g, tx.init(g)), axis_name="w")(g)


def test_empty_tree_is_passed_through():
    tx = partial_exchange(0.5, collective=AxisCollective("w", 2))
    u, s = tx.update({}, tx.init({}))
    assert u == {} and int(s.bin) == -1 and int(s.step) == 1
    assert (int(s.wire.step.sent), int(s.wire.step.received)) == (0, 0)
    assert (int(s.wire.total.sent), int(s.wire.total.received)) == (0, 0)


def test_inject_hyperparams_with_static_budget():
    coll = AxisCollective("w", 4)
    grads = {k: v[:, 0] for k, v in make_grads(1, seed=4, workers=4).items()}
    plain = partial_exchange(0.4, collective=coll)
    injected = optax.inject_hyperparams(partial_exchange, static_args=("budget_fraction",))(
        0.4, collective=coll
    )
    run = lambda tx: jax.jit(jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="w"))
    jax.tree.map(np.testing.assert_array_equal, run(plain)(grads), run(injected)(grads))
    # A traced fraction cannot fix a packing: say how to fix it.
    traced = optax.inject_hyperparams(partial_exchange)(0.4, collective=coll)
    with pytest.raises(ValueError, match="static_args"):
        run(traced)(grads)
