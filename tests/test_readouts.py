"""The per-step figures a training loop reads (`shoal.optim.readouts`): one table of
readouts, and every readout of it the same on a state stacked over workers (one or two
tiers) as each worker reads inside vmap, against a NumPy oracle, and combined over the
workers as the Readout says."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from shoal.comms import AxisCollective
from shoal.optim import (
    allreduce_gradients,
    bmuf_gtc,
    gradient_noise_scale,
    gtc,
    readouts,
    skip_nonfinite,
)

N = 4


def test_density_of_a_stacked_state_is_the_workers_not_divided_by_them():
    # 64 elements per worker; threshold 1 with values 0, 2, 0, 2, ... sends half of them.
    tx = optax.chain(gtc(1.0, collective=AxisCollective("w", N), capacity=1.0), optax.sgd(0.1))
    params = jnp.zeros((N, 64))
    grads = jnp.tile(jnp.array([0.0, 2.0] * 32), (N, 1))
    step = jax.vmap(lambda g, s, p: tx.update(g, s, p), axis_name="w")
    _, state = step(grads, jax.vmap(tx.init)(params), params)
    inside = jax.vmap(lambda s: readouts.step_figures(s)["density"])(state)
    outside = readouts.step_figures(state)["density"]  # the docstring's "stacked" case
    np.testing.assert_allclose(np.asarray(inside), 0.5)
    np.testing.assert_allclose(np.asarray(outside), 0.5)  # was 0.125: 0.5 / N


def test_every_readout_is_in_the_table_once():
    names = [r.name for r in readouts.READOUTS]
    assert names == ["density", "noise_scale", "skipped"]
    assert all(r.by_device in ("mean", "first") for r in readouts.READOUTS)
    assert all(r.over_workers in ("mean", "max") for r in readouts.READOUTS)
    # A state without any of them has no figures.
    assert readouts.step_figures(optax.sgd(0.1).init(jnp.zeros(3))) == {}


# Every row of READOUTS, read on several workers: the state of a real transformation that
# holds the figure, and a NumPy oracle of each worker's value. Flat: 4 workers over one
# collective; tiers: 2 groups of 2 (two nested vmaps, a state stacked [group, member]).
STEPS = 3
TAU = 1.0
LOCAL_BATCH = 8
BAD = ((1, 1), (2, 3))  # (step, worker) of a NaN in the gradient: two skipped steps


def grads_of(name):
    rng = np.random.default_rng(3)
    g = {"b": rng.normal(size=(STEPS, N, 5)), "w": rng.normal(size=(STEPS, N, 3, 4))}
    g = {k: v.astype(np.float32) for k, v in g.items()}
    if name == "skipped":
        for step, worker in BAD:
            g["w"][step, worker, 0, 0] = np.nan
    return g


def density_oracle(g, groups):
    # GTC with capacity 1.0 sends every |g + r| > tau; the residual keeps the rest.
    flat = np.concatenate([g["b"].reshape(STEPS, N, -1), g["w"].reshape(STEPS, N, -1)], -1)
    residual = np.zeros_like(flat[0])
    for t in range(STEPS):
        a = flat[t] + residual
        sent = np.abs(a) > TAU
        residual = np.where(sent, a - np.sign(a) * TAU, a)
    return sent.sum(1) / flat.shape[-1]


def noise_scale_oracle(g, groups):
    # ema = 0: the last step's B_simple over each group of n workers (float64).
    flat = np.concatenate([g["b"][-1], g["w"][-1].reshape(N, -1)], -1).astype(np.float64)
    out = np.empty(N)
    for members in np.split(np.arange(N), N // groups):
        n, rows = len(members), flat[members]
        small = np.mean(np.sum(rows**2, 1))
        big = np.sum(rows.mean(0) ** 2)
        out[members] = LOCAL_BATCH * n * (small - big) / (n * big - small)
    return out


def skipped_oracle(g, groups):
    return np.full(N, len(BAD))


def sgd_after(tx):
    return optax.chain(tx, optax.sgd(0.1))


# name -> (its transformation on one collective, on (intra, inter), each worker's oracle).
READOUT_CASES = {
    "density": (
        lambda c: sgd_after(gtc(TAU, collective=c, capacity=1.0)),
        lambda i, o: bmuf_gtc(
            optax.sgd(0.1), intra=i, inter=o, block_size=10, threshold=TAU, capacity=1.0
        ),
        density_oracle,
    ),
    "noise_scale": (
        lambda c: sgd_after(
            gradient_noise_scale(collective=c, local_batch_size=LOCAL_BATCH, ema=0.0)
        ),
        lambda i, o: sgd_after(
            gradient_noise_scale(collective=i, local_batch_size=LOCAL_BATCH, ema=0.0)
        ),
        noise_scale_oracle,
    ),
    "skipped": (
        lambda c: skip_nonfinite(sgd_after(allreduce_gradients(collective=c)), collective=c),
        lambda i, o: skip_nonfinite(
            sgd_after(allreduce_gradients(collective=i)), collective=(i, o)
        ),
        skipped_oracle,
    ),
}


def train_stacked(tx, grads, tiers):
    """The optimizer states of every worker after STEPS updates, stacked: [N] or [2, 2]."""

    def run(g):
        params = jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), g)
        state = tx.init(params)
        for t in range(STEPS):
            grads_t = jax.tree.map(lambda a, t=t: a[t], g)
            updates, state = tx.update(grads_t, state, params)
            params = optax.apply_updates(params, updates)
        return state

    per_worker = jax.tree.map(lambda a: jnp.asarray(np.moveaxis(a, 1, 0)), grads)  # [N, T, ...]
    if not tiers:
        return jax.jit(jax.vmap(run, axis_name="w"))(per_worker)
    grouped = jax.tree.map(lambda a: a.reshape(2, 2, *a.shape[1:]), per_worker)
    nested = jax.vmap(jax.vmap(run, axis_name="member"), axis_name="group")
    return jax.jit(nested)(grouped)


@pytest.mark.parametrize("tiers", [False, True], ids=["flat", "tiers"])
@pytest.mark.parametrize("readout", readouts.READOUTS, ids=lambda r: r.name)
def test_a_stacked_read_is_the_workers_reads(readout, tiers):
    assert readout.name in READOUT_CASES, f"add a case for the readout {readout.name!r}"
    flat, two_tier, oracle = READOUT_CASES[readout.name]
    grads = grads_of(readout.name)
    if tiers:
        intra, inter = AxisCollective("member", 2), AxisCollective("group", 2)
        tx = two_tier(intra, inter)
    else:
        tx = flat(AxisCollective("w", N))
    state = train_stacked(tx, grads, tiers)
    # Each worker's own figure, read inside vmap (one vmap per worker axis).
    read = lambda s: readouts.step_figures(s)[readout.name]
    inside = jax.vmap(jax.vmap(read))(state) if tiers else jax.vmap(read)(state)
    outside = readouts.step_figures(state)[readout.name]  # the state stacked, outside vmap
    np.testing.assert_array_equal(np.asarray(outside), np.asarray(inside))
    assert np.shape(outside) == ((2, 2) if tiers else (N,))
    want = oracle(grads, 2 if tiers else N)
    np.testing.assert_allclose(np.asarray(inside).reshape(-1), want, rtol=2e-5)
    # And the run's record: the workers' values combined as the Readout says.
    combined = readout.combine(np.asarray(outside))
    assert combined == readout.combine(np.asarray(inside).reshape(-1))
    reference = np.max(want) if readout.over_workers == "max" else np.mean(want)
    np.testing.assert_allclose(combined, reference, rtol=2e-5)
