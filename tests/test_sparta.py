"""shoal.optim.sparta against a NumPy float64 oracle of SPARTA (a random subset of the
parameters averaged after every step, indices from a shared seed), alone and around
DiLoCo, on simulated workers and under mpiexec -n 4 (the tests marked mpi are
rank-agnostic)."""

import math

import jax
import numpy as np
import optax
import pytest
from block_cases import block_worker, flat, linear_problem, nesterov_outer_step
from harness import n_workers, run_workers

from shoal.comms import AxisCollective
from shoal.optim import SpartaState, diloco, sparta

N = n_workers()
PROBLEM = linear_problem(seed=11, n=N)
X, Y, P0, grad_np = PROBLEM.x, PROBLEM.y, PROBLEM.p0, PROBLEM.grad
LR, MU = 0.1, 0.9
FRACTION, SEED = 0.3, 4
STEPS, H = 9, 3
OUTER_LR, OUTER_MU = 0.7, 0.9
TOL = dict(rtol=2e-5, atol=2e-5)
LEAVES = [("b", P0["b"][0].size), ("w", P0["w"][0].size)]  # jax.tree.leaves order = flat's


def drawn(t):
    """The flat indices SPARTA averages after update t (0-based): per leaf, the shared
    draw of ceil(FRACTION n) indices, offset to the leaf's place in `flat`'s order."""
    key, out, offset = jax.random.fold_in(jax.random.PRNGKey(SEED), t), [], 0
    for j, (_, n) in enumerate(LEAVES):
        k = math.ceil(FRACTION * n)
        out.append(offset + np.asarray(jax.random.randint(jax.random.fold_in(key, j), (k,), 0, n)))
        offset += n
    return np.concatenate(out)


def oracle(workers, with_diloco=False):
    """Float64: inner momentum SGD on each worker; with DiLoCo, every H updates the outer
    Nesterov step on the mean model and a restart from it; then the drawn entries are
    set to their mean over the workers. Returns every worker's params after each update."""
    theta_g = flat(P0)[0].astype(np.float64)
    x = np.tile(theta_g, (workers, 1))
    mom, trace = np.zeros_like(x), np.zeros_like(theta_g)
    out = []
    for t in range(STEPS):
        g = np.stack([grad_np(x[i], i) for i in range(workers)])
        mom = MU * mom + g
        x = x - LR * mom
        if with_diloco and (t + 1) % H == 0:
            theta_g, trace = nesterov_outer_step(theta_g, trace, x.mean(0), OUTER_LR, OUTER_MU)
            x = np.tile(theta_g, (workers, 1))
        idx = drawn(t)
        x[:, idx] = x[:, idx].mean(0)
        out.append(x.copy())
    return np.stack(out)


def make(with_diloco=False):
    def build(c):
        inner = optax.sgd(LR, momentum=MU)
        if with_diloco:
            outer = optax.sgd(OUTER_LR, momentum=OUTER_MU, nesterov=True)
            inner = diloco(inner, collective=c, sync_every=H, outer=outer)
        return sparta(inner, collective=c, fraction=FRACTION, seed=SEED)

    return build


def worker_fn(make_tx):
    """`block_worker`: the params, the step count and this step's wire bytes after every
    step, and the final state."""
    return block_worker(make_tx, STEPS, reference=lambda s: s.step)


@pytest.mark.mpi
@pytest.mark.parametrize("with_diloco", [False, True])
def test_matches_oracle(with_diloco):
    expect = oracle(N, with_diloco)
    out = run_workers(worker_fn(make(with_diloco)), P0, X, Y)
    k = sum(math.ceil(FRACTION * n) for _, n in LEAVES)
    assert k == 1 + 3  # b: ceil(0.6), w: ceil(2.4)
    ring = 2 * (N - 1) * 4 * k // N
    diloco_ring = 2 * (N - 1) * PROBLEM.n_bytes // N
    for rank, ((params, _, wire), state) in out.items():
        assert isinstance(state, SpartaState) and int(state.step) == STEPS
        np.testing.assert_allclose(flat(params), expect[:, rank], **TOL)
        # SPARTA's every update, plus DiLoCo's on its syncing ones (its meter is in the
        # inner state, and wire_bytes counts every meter of the state).
        outer = [diloco_ring * (with_diloco and (t + 1) % H == 0) for t in range(STEPS)]
        assert np.asarray(wire.sent).tolist() == [ring + o for o in outer]
        assert int(state.wire.total.sent) == ring * STEPS


def test_the_draw_is_shared_and_moves_each_step():
    """Every update draws other indices, and the drawn entries agree on every worker
    while the others differ."""
    assert not np.array_equal(drawn(0), drawn(1))
    expect = oracle(N)
    if N > 1:
        for t in range(STEPS):
            idx = drawn(t)
            spread = np.ptp(expect[t], axis=0)
            assert spread[idx].max() < 1e-12
            rest = np.setdiff1d(np.arange(spread.size), idx)
            assert spread[rest].min() > 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(fraction=0.0), r"fraction must be a number in \(0, 1\]"),
        (dict(fraction=1.5), r"fraction must be a number in \(0, 1\]"),
        (dict(fraction=True), r"fraction must be a number in \(0, 1\]"),
        (dict(seed=1.5), "seed must be an int"),
        (dict(inner=optax.sgd), "inner must be an optax.GradientTransformation"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    args = dict(inner=optax.sgd(0.1), collective=AxisCollective("w", 2)) | kwargs
    with pytest.raises(ValueError, match=match):
        sparta(**args)
