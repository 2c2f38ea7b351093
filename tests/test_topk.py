"""shoal.optim.topk against a NumPy oracle of top-k with error feedback, on simulated
workers and under mpiexec -n 4 (tests marked mpi are rank-agnostic)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import UNDER_MPI, n_workers, run_workers, world
from topk_oracle import np_topk

from shoal.comms import wire_bytes
from shoal.comms.wire import all_gather_bytes
from shoal.optim import allreduce_gradients, topk

N = n_workers()
STEPS = 4
RNG = np.random.default_rng(5)
# A matrix, a vector and a scalar leaf (the scalar is one chunk on its own).
GRADS = {
    "b": RNG.normal(size=(STEPS, N, 3)).astype(np.float32),
    "s": RNG.normal(size=(STEPS, N)).astype(np.float32),
    "w": RNG.normal(size=(STEPS, N, 6, 5)).astype(np.float32),
}
LEAVES = ("b", "s", "w")  # jax.tree.leaves order


def run(tx):
    """Every worker's updates and error after each of STEPS updates: {rank: (u, e)}."""

    def worker(coll, grads):
        state = tx.init(jax.tree.map(lambda g: g[0], grads))

        def body(state, g):
            u, state = tx.update(g, state)
            return state, (u, state.error, wire_bytes(state, "step").sent)

        _, out = jax.lax.scan(body, state, grads)
        return out

    stacked = jax.tree.map(lambda g: jnp.asarray(np.swapaxes(g, 0, 1)), GRADS)
    return run_workers(worker, stacked)


def oracle(fraction, chunk, bits):
    """Per-leaf (chunk None) or per-chunk top-k with error feedback in NumPy."""
    out, errors = {k: [] for k in LEAVES}, {}
    for key in LEAVES:
        g = GRADS[key].reshape(STEPS, N, -1)
        n = g.shape[-1]
        length = chunk or n
        n_pad = -(-n // length) * length
        e = np.zeros((N, n_pad), np.float32)
        for t in range(STEPS):
            total = np.zeros(n_pad, np.float32)
            for i in range(N):
                v = np.pad(g[t, i], (0, n_pad - n)) + e[i]
                d = np_topk(v, fraction, length, bits)
                e[i] = v - d
                total = total + d
            out[key].append((total / np.float32(N))[:n])
        errors[key] = e
    return {k: np.stack(v) for k, v in out.items()}, errors


@pytest.mark.mpi
@pytest.mark.parametrize("fraction,chunk,bits", [(0.3, None, None), (0.25, 4, None), (0.5, 4, 2)])
def test_topk_matches_oracle(fraction, chunk, bits):
    want, errors = oracle(fraction, chunk, bits)
    for rank, (updates, error, _) in run(topk(fraction, collective=world(), chunk_size=chunk,
                                               value_bits=bits)).items():  # fmt: skip
        for key in LEAVES:
            got = np.asarray(updates[key]).reshape(STEPS, -1)
            np.testing.assert_allclose(got, want[key], rtol=1e-6, atol=1e-6)
        if chunk is None:  # one error vector per leaf, in a tree like the params
            for key in LEAVES:
                np.testing.assert_allclose(np.asarray(error[key][-1]), errors[key][rank], atol=1e-6)
        else:  # one vector: each leaf padded to whole chunks
            fused = np.concatenate([errors[key][rank] for key in LEAVES])
            np.testing.assert_allclose(np.asarray(error[-1]), fused, atol=1e-6)


@pytest.mark.mpi
def test_full_fraction_is_ssgd():
    sparse = run(topk(1.0, collective=world(), chunk_size=4))
    dense = {}
    tx = allreduce_gradients(collective=world())
    for rank, (updates, _) in run_dense(tx).items():
        dense[rank] = updates
    for rank, (updates, error, _) in sparse.items():
        for key in LEAVES:
            np.testing.assert_allclose(updates[key], dense[rank][key], rtol=1e-6, atol=1e-7)
        assert not np.asarray(error).any()


def run_dense(tx):
    def worker(coll, grads):
        state = tx.init(jax.tree.map(lambda g: g[0], grads))

        def body(state, g):
            u, state = tx.update(g, state)
            return state, (u, wire_bytes(state, "step").sent)

        return jax.lax.scan(body, state, grads)[1]

    stacked = jax.tree.map(lambda g: jnp.asarray(np.swapaxes(g, 0, 1)), GRADS)
    return run_workers(worker, stacked)


@pytest.mark.mpi
def test_nothing_is_dropped():
    """Per worker and step: the updates summed over steps plus the mean of the final
    errors equal the gradients' mean summed over steps (the error feedback keeps it)."""
    out = run(topk(0.2, collective=world(), chunk_size=4))
    for updates, error, _ in out.values():
        if UNDER_MPI:  # every rank's error
            from mpi4py import MPI

            errors = MPI.COMM_WORLD.allgather(np.asarray(error[-1], np.float64))
        else:
            errors = [np.asarray(out[r][1][-1], np.float64) for r in range(N)]
        left = np.mean(errors, axis=0)
        offset = 0
        for key in LEAVES:
            n = GRADS[key][0, 0].size
            sent = np.asarray(updates[key], np.float64).reshape(STEPS, -1).sum(0)
            want = GRADS[key].astype(np.float64).reshape(STEPS, N, -1).mean(1).sum(0)
            np.testing.assert_allclose(sent + left[offset : offset + n], want, atol=1e-5)
            offset += -(-n // 4) * 4


@pytest.mark.mpi
def test_wire_bytes():
    # chunk 4, fraction 0.5: b (3 -> 1 chunk), s (1 -> 1 chunk), w (30 -> 8 chunks): 10
    # chunks of 2 float32 values and 2 uint16 indices, all-gathered from N - 1 others.
    for *_, sent in run(topk(0.5, collective=world(), chunk_size=4)).values():
        assert np.asarray(sent).tolist() == [all_gather_bytes(10 * 2 * 6, N)[0]] * STEPS
    # Per leaf (no chunks): k = ceil(0.5 n): 2, 1 and 15 values, one all-gather each.
    per_leaf = sum(all_gather_bytes(k * 6, N)[0] for k in (2, 1, 15))
    for *_, sent in run(topk(0.5, collective=world())).values():
        assert np.asarray(sent).tolist() == [per_leaf] * STEPS


def test_chains_with_an_optimizer():
    coll = world()
    tx = optax.chain(topk(0.5, collective=coll, chunk_size=4), optax.sgd(0.1))
    assert tx.init({"w": jnp.zeros(8)}) is not None


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(fraction=0.0), "fraction"),
        (dict(fraction=1.01), "fraction"),
        (dict(fraction=0.1, chunk_size=0), "chunk_size"),
        (dict(fraction=0.1, chunk_size=2.5), "chunk_size"),
        (dict(fraction=0.1, value_bits=1), "value_bits"),
    ],
)
def test_bad_input(kwargs, words):
    with pytest.raises(ValueError, match=words):
        topk(collective=world(), **kwargs)
