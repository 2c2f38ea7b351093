"""shoal.optim.peer_averaging against a NumPy oracle of Algorithm 4 (KungFu thesis), on 4
simulated workers and under mpiexec -n 4 (same file, rank-agnostic)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from averaging_cases import INNERS, LR, N_BYTES, flat, make_case
from averaging_cases import train as train_workers
from harness import n_workers, run_workers
from jax import lax
from parabola_cases import TARGET, descend, different_starts

from shoal.comms import AxisCollective
from shoal.optim import PeerAveragingState, peer_averaging
from shoal.optim.helpers import peer_permutation

N = n_workers()
STEPS = 3
LONG = 7  # enough steps for the ring buffer of staleness 3 to wrap around twice
P0, GRADS = make_case(seed=0, steps=LONG)


def oracle(strategy, staleness, mu, wd, steps=STEPS, seed=0):
    """Algorithm 4 in float64: v_r <- (v_r + v_src(r)[t - s]) / 2 + u_r, with u_r the
    heavy-ball SGD step at the pre-averaging v_r. Returns params after every step."""
    v = flat(P0).astype(np.float64)
    g_all = flat({"b": GRADS["b"].swapaxes(0, 1), "w": GRADS["w"].swapaxes(0, 1)})
    models = [v.copy()]  # models[j]: every worker's model before step j
    mom = np.zeros_like(v)
    out = []
    for t in range(steps):
        perm = peer_permutation(strategy, N, t, seed)
        src = np.empty(N, int)
        src[list(perm)] = np.arange(N)  # worker perm[r] receives from r
        stale = models[max(t - staleness, 0)]
        mom = mu * mom + g_all[t] + wd * v
        v = (v + stale[src]) / 2 - LR * mom
        models.append(v.copy())
        out.append(v.copy())
    return np.stack(out)


def train(make_tx, steps=STEPS):
    return train_workers(make_tx, P0, jax.tree.map(lambda g: g[:, :steps], GRADS))


@pytest.mark.parametrize("size", range(2, 9))
@pytest.mark.parametrize("strategy", ["round_robin", "random"])
def test_permutations_are_derangements(strategy, size):
    for seed in (0, 3):
        for step in range(25):
            perm = peer_permutation(strategy, size, step, seed)
            assert sorted(perm) == list(range(size))
            assert all(perm[r] != r for r in range(size))


@pytest.mark.parametrize("size", range(2, 9))
def test_round_robin_cycles_the_shifts(size):
    for step in range(3 * (size - 1)):
        k = 1 + step % (size - 1)
        assert peer_permutation("round_robin", size, step) == tuple(
            (r + k) % size for r in range(size)
        )


def test_random_draws_every_derangement_of_small_worlds():
    # 3 workers have 2 derangements, 4 have 9: the shared draws must reach all of them.
    for size, count in ((3, 2), (4, 9)):
        seen = {peer_permutation("random", size, t, seed=1) for t in range(200)}
        assert len(seen) == count
    seq = [peer_permutation("random", 6, t, seed=0) for t in range(20)]
    assert seq != [peer_permutation("random", 6, t, seed=1) for t in range(20)]
    assert len(set(seq)) > 10  # not a fixed cycle


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["round_robin", "random"])
def test_exchange_follows_peer_permutation(strategy):
    # Params hold the rank and stay fixed; with a zero gradient the update is
    # (v_peer - v) / 2, so v + 2 u is the rank this worker received from.
    steps, seed = 24, 5

    def worker(coll, p):
        tx = peer_averaging(optax.sgd(LR), collective=coll, strategy=strategy, seed=seed)

        def body(s, _):
            u, s = tx.update(jnp.zeros_like(p), s, p)
            return s, p + 2 * u

        return lax.scan(body, tx.init(p), None, length=steps)[1]

    out = run_workers(worker, jnp.arange(N, dtype=jnp.float32))
    for rank, got in out.items():
        expect = [peer_permutation(strategy, N, t, seed).index(rank) for t in range(steps)]
        np.testing.assert_array_equal(np.asarray(got), expect)


@pytest.mark.mpi
@pytest.mark.parametrize("inner", list(INNERS))
@pytest.mark.parametrize("staleness", [0, 1, 2])
@pytest.mark.parametrize("strategy", ["round_robin", "random"])
def test_matches_oracle(strategy, staleness, inner):
    make, mu, wd = INNERS[inner]
    out = train(
        lambda c: peer_averaging(make(), collective=c, strategy=strategy, staleness=staleness)
    )
    expect = oracle(strategy, staleness, mu, wd)
    for rank, ((params, wire), state) in out.items():
        np.testing.assert_allclose(flat(params), expect[:, rank], rtol=1e-5, atol=1e-5)
        # One model out and one in per step, whatever the strategy.
        assert np.asarray(wire.sent).tolist() == [N_BYTES] * STEPS
        assert np.asarray(wire.received).tolist() == [N_BYTES] * STEPS
        assert int(state.wire.total.sent) == N_BYTES * STEPS
        assert isinstance(state, PeerAveragingState)
        assert state.step.dtype == jnp.int32 and int(state.step) == STEPS
        if staleness:
            assert state.history["w"].shape == (staleness, 2, 3)
        else:
            assert state.history is None


@pytest.mark.mpi
@pytest.mark.parametrize("staleness", [1, 2, 3])
def test_stale_models_over_a_longer_run(staleness):
    out = train(
        lambda c: peer_averaging(
            optax.sgd(LR, momentum=0.9), collective=c, strategy="random", staleness=staleness
        ),
        steps=LONG,
    )
    expect = oracle("random", staleness, 0.9, 0.0, steps=LONG)
    for rank, ((params, _), state) in out.items():
        np.testing.assert_allclose(flat(params), expect[:, rank], rtol=1e-5, atol=1e-5)
        # The ring buffer holds the models before the last `staleness` updates.
        held = np.concatenate([flat(P0)[rank][None], flat(params)[:-1]])[-staleness:]
        slots = [(LONG - staleness + i) % staleness for i in range(staleness)]
        np.testing.assert_allclose(flat(state.history)[slots], held, rtol=1e-5, atol=1e-5)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["round_robin", "random"])
def test_staleness_changes_the_trajectory(strategy):
    fresh = oracle(strategy, 0, 0.0, 0.0)
    stale = oracle(strategy, 1, 0.0, 0.0)
    # Step 0 averages with the initial model either way; later steps differ.
    np.testing.assert_allclose(fresh[0], stale[0])
    assert all(np.abs(fresh[t] - stale[t]).max() > 1e-2 for t in range(1, STEPS))
    out0 = train(lambda c: peer_averaging(optax.sgd(LR), collective=c, strategy=strategy))
    out1 = train(
        lambda c: peer_averaging(optax.sgd(LR), collective=c, strategy=strategy, staleness=1)
    )
    for rank in out0:
        got0, got1 = flat(out0[rank][0][0]), flat(out1[rank][0][0])
        np.testing.assert_allclose(got0, fresh[:, rank], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got1, stale[:, rank], rtol=1e-5, atol=1e-5)


@pytest.mark.mpi
@pytest.mark.parametrize("staleness", [0, 2])
def test_prefetched_exchange_is_the_same_step(staleness):
    # The exchange made apart (`prefetch`, as skip_nonfinite makes it before its branch)
    # and handed to `update` gives the step `update` takes by itself, bit for bit: the
    # same received models, updates and state, over steps that wrap the ring buffer.
    def worker(coll, p, grads):
        tx = peer_averaging(
            optax.sgd(LR, momentum=0.9), collective=coll, strategy="random", staleness=staleness
        )

        def body(carry, g):
            p, s = carry
            received = tx.prefetch(s, p)
            u, s_alone = tx.update(g, s, p)
            u_pre, s_pre = tx.update(g, s, p, prefetched=received)
            return (optax.apply_updates(p, u), s_alone), (received, u, s_alone, u_pre, s_pre)

        return lax.scan(body, (p, tx.init(p)), grads)[1]

    out = run_workers(worker, P0, GRADS)
    expect = oracle("random", staleness, 0.9, 0.0, steps=LONG)
    for rank, (received, u, s_alone, u_pre, s_pre) in out.items():
        jax.tree.map(np.testing.assert_array_equal, (u_pre, s_pre), (u, s_alone))
        # What it received at step t is its source's model before step t - staleness.
        models = np.concatenate([flat(P0)[None], expect[:-1]])  # [t] = before step t
        for t in range(LONG):
            perm = peer_permutation("random", N, t)
            src = perm.index(rank)
            want = models[max(t - staleness, 0)][src]
            np.testing.assert_allclose(flat(received)[t], want, rtol=1e-5, atol=1e-5)


def test_a_prefetched_exchange_of_the_wrong_tree_is_named():
    tx = peer_averaging(optax.sgd(LR), collective=AxisCollective("w", 2))
    p = {"b": jnp.zeros((2, 3)), "w": jnp.zeros((2, 2, 3))}

    def step(p):
        return tx.update(p, tx.init(p), p, prefetched={"b": p["b"]})

    with pytest.raises(ValueError, match=r"peer_averaging: prefetched does not have the tree"):
        jax.vmap(step, axis_name="w")(p)


@pytest.mark.mpi
def test_zero_gradients_keep_the_mean_model():
    # Averaging along a permutation conserves the sum of the models.
    def worker(coll, p):
        tx = peer_averaging(optax.sgd(LR), collective=coll, strategy="random")
        state = tx.init(p)
        for _ in range(STEPS):
            u, state = tx.update(jax.tree.map(jnp.zeros_like, p), state, p)
            p = optax.apply_updates(p, u)
        return coll.all_reduce(p, "mean")

    for mean in run_workers(worker, P0).values():
        np.testing.assert_allclose(flat(mean), flat(P0).mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(strategy="ring"), "strategy must be one of"),
        (dict(staleness=-1), "staleness must be an int >= 0"),
        (dict(staleness=1.5), "staleness must be an int >= 0"),
        (dict(staleness=True), "staleness must be an int >= 0"),
        (dict(seed=-1), "seed must be an int >= 0"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        peer_averaging(optax.sgd(0.1), collective=AxisCollective("w", 4), **kwargs)


def test_one_worker_is_rejected():
    with pytest.raises(ValueError, match="collective: peer averaging needs at least 2 workers"):
        peer_averaging(optax.sgd(0.1), collective=AxisCollective("w", 1))


def test_peer_permutation_rejects_bad_input():
    with pytest.raises(ValueError, match="strategy must be one of"):
        peer_permutation("ring", 4, 0)
    with pytest.raises(ValueError, match="size must be an int >= 2"):
        peer_permutation("random", 1, 0)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        peer_permutation("random", 4, -1)


@pytest.mark.parametrize("strategy,staleness", [("round_robin", 0), ("random", 2)])
def test_optimises_parabola_from_different_starts(strategy, staleness):
    # optax's contract test, from a different start on every worker: averaging must not
    # stop the local descent, and the workers must agree at the optimum.
    def worker(coll, p):
        tx = peer_averaging(
            optax.sgd(0.05), collective=coll, strategy=strategy, staleness=staleness
        )
        return descend(tx, p, 500)

    for p in run_workers(worker, different_starts(N)).values():
        np.testing.assert_allclose(p, TARGET, rtol=1e-4, atol=1e-4)
