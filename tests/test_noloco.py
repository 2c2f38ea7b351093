"""shoal.optim.noloco against a NumPy float64 oracle of NoLoCo's modified Nesterov step
with random pairs (Kolehmainen et al. 2025), on simulated workers and under mpiexec -n 4
(the tests marked mpi are rank-agnostic)."""

import jax
import numpy as np
import optax
import pytest
from block_cases import block_worker, flat, linear_problem
from harness import n_workers, run_workers

from shoal.comms import AxisCollective
from shoal.optim import NoLoCoState, diloco, noloco
from shoal.optim.helpers import pairing

N = n_workers()
PROBLEM = linear_problem(seed=13, n=N)
X, Y, P0, grad_np = PROBLEM.x, PROBLEM.y, PROBLEM.p0, PROBLEM.grad
LR, MU = 0.1, 0.9
ALPHA, BETA, GAMMA, SEED = 0.6, 0.8, 0.3, 2
H, ROUNDS = 3, 5
TOL = dict(rtol=2e-5, atol=2e-5)


def oracle(workers, gamma=GAMMA):
    """Float64: inner momentum SGD on each worker; every H steps the round's pairing
    (`pairing`, the shared draw), each worker's ``Delta`` and slow-weight mean over its
    pair, ``delta <- alpha delta - beta Delta - gamma (phi - mean phi)``, ``phi += delta``
    and a restart from ``phi``. Returns the fast and slow weights after every step."""
    x = np.tile(flat(P0)[0].astype(np.float64), (workers, 1))
    phi, delta, mom = x.copy(), np.zeros_like(x), np.zeros_like(x)
    fast, slow = [], []
    for step in range(H * ROUNDS):
        g = np.stack([grad_np(x[i], i) for i in range(workers)])
        mom = MU * mom + g
        x = x - LR * mom
        if (step + 1) % H == 0:
            p = pairing(workers, step // H, SEED)
            pseudo = phi - x
            big = (pseudo + pseudo[list(p)]) / 2
            mean_phi = (phi + phi[list(p)]) / 2
            delta = ALPHA * delta - BETA * big - gamma * (phi - mean_phi)
            phi = phi + delta
            x = phi.copy()
        fast.append(x.copy())
        slow.append(phi.copy())
    return np.stack(fast), np.stack(slow)


def make(gamma=GAMMA):
    return lambda c: noloco(
        optax.sgd(LR, momentum=MU), collective=c, sync_every=H, alpha=ALPHA, beta=BETA,
        gamma=gamma, seed=SEED,
    )  # fmt: skip


def slow_weights(state):
    """NoLoCo's slow weights, or DiLoCo's global model (the comparison's)."""
    return state.slow if isinstance(state, NoLoCoState) else state.global_params


def worker_fn(make_tx):
    """`block_worker`: the params, the slow weights and this step's wire bytes after every
    step, and the final state."""
    return block_worker(make_tx, H * ROUNDS, reference=slow_weights)


@pytest.mark.mpi
def test_matches_oracle():
    fast, slow = oracle(N)
    out = run_workers(worker_fn(make()), P0, X, Y)
    for rank, ((params, phi, wire), state) in out.items():
        assert isinstance(state, NoLoCoState) and int(state.rounds) == ROUNDS
        np.testing.assert_allclose(flat(params), fast[:, rank], **TOL)
        np.testing.assert_allclose(flat(phi), slow[:, rank], **TOL)
        # One peer exchange per round: slow weights and outer gradient, sent and received.
        per_round = 2 * PROBLEM.n_bytes
        assert np.asarray(wire.sent).tolist() == [0, 0, per_round] * ROUNDS
        assert np.asarray(wire.received).tolist() == [0, 0, per_round] * ROUNDS
    if N > 2:  # pairs, not all: the workers' slow weights stay apart
        assert np.ptp(slow[-1], axis=0).max() > 1e-4


def test_three_workers_one_sits_out():
    """An odd number of workers: each round one worker is alone, G = {i}, and steps on
    its own outer gradient."""
    workers = 3
    coll = AxisCollective("three", workers)
    args = jax.tree.map(lambda a: a[:workers], (P0, X, Y))
    (params, phi, _), _ = jax.vmap(
        lambda *a: worker_fn(make())(coll, *a), axis_name="three"
    )(*args)  # fmt: skip
    fast, slow = oracle(workers)
    np.testing.assert_allclose(np.moveaxis(flat(params), 0, 1), fast, **TOL)
    np.testing.assert_allclose(np.moveaxis(flat(phi), 0, 1), slow, **TOL)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7, 8])
def test_pairings_are_random_pairs(size):
    seen = set()
    for r in range(20):
        p = pairing(size, r, SEED)
        assert sorted(p) == list(range(size))
        assert all(p[p[i]] == i for i in range(size))
        assert sum(p[i] == i for i in range(size)) == size % 2  # one alone if odd
        seen.add(p)
    assert len(seen) > 1 or size <= 3  # 1, 2 and 3 workers have one or three pairings


def test_two_workers_without_gamma_is_diloco_with_heavy_ball():
    """One pair is all the workers; gamma = 0 drops the pull: DiLoCo's outer step with
    heavy-ball momentum ``optax.sgd(beta, momentum=alpha)``."""
    coll = AxisCollective("two", 2)
    args = jax.tree.map(lambda a: a[:2], (P0, X, Y))
    run = lambda make_tx: jax.vmap(  # noqa: E731
        lambda *a: worker_fn(make_tx)(coll, *a)[0][0], axis_name="two"
    )(*args)
    a = run(make(gamma=0.0))
    outer = optax.sgd(BETA, momentum=ALPHA)
    b = run(lambda c: diloco(optax.sgd(LR, momentum=MU), collective=c, sync_every=H, outer=outer))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5), a, b)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(alpha=1.0), r"alpha must be a number in \[0, 1\)"),
        (dict(beta=0.0), "beta must be a finite number > 0"),
        (dict(gamma=-0.1), "gamma must be a finite number >= 0"),
        (dict(gamma=True), "gamma must be a finite number >= 0"),
        (dict(sync_every=0), "sync_every must be an int >= 1"),
        (dict(seed=-1), "seed must be an int >= 0"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    args = dict(collective=AxisCollective("w", 2), sync_every=2) | kwargs
    with pytest.raises(ValueError, match=match):
        noloco(optax.sgd(0.1), **args)
