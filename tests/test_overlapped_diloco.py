"""shoal.optim.overlapped_diloco against a NumPy float64 oracle of Kale et al.'s delayed and
eager outer updates, on simulated workers and under mpiexec -n 4 (the tests marked mpi are
rank-agnostic); and shoal.costmodel.overlapped, the time the overlap would save."""

import jax
import numpy as np
import optax
import pytest
from block_cases import block_worker, flat, linear_problem, loss, nesterov_outer_step
from harness import n_workers, run_workers
from jax import lax

from shoal.comms import AxisCollective
from shoal.costmodel import Projection, overlapped
from shoal.optim import OverlappedDiLoCoState, diloco, overlapped_diloco

N = n_workers()
PROBLEM = linear_problem(seed=5, n=N)
X, Y, P0, grad_np = PROBLEM.x, PROBLEM.y, PROBLEM.p0, PROBLEM.grad
LR, MU = 0.1, 0.9  # inner SGD with momentum
OUTER_LR, OUTER_MU = 0.7, 0.9
H, ROUNDS = 3, 4
TOL = dict(rtol=2e-5, atol=2e-5)


def oracle(workers, variant):
    """Float64: every worker's inner momentum SGD; every H steps ``Delta_m = start_m -
    theta_m``, its mean in flight, and each worker's outer Nesterov step (its own
    momentum) on the last round's mean (delayed) or on that mean with this worker's
    stale share swapped for its fresh one (eager); the round restarts from the new
    start. Returns every worker's params and start after every step."""
    theta0 = flat(P0)[0].astype(np.float64)
    local = np.tile(theta0, (workers, 1))
    start, trace = local.copy(), np.zeros_like(local)
    mean_prev, own_prev = np.zeros_like(theta0), np.zeros_like(local)
    mom = np.zeros_like(local)
    params, starts = [], []
    for step in range(H * ROUNDS):
        g = np.stack([grad_np(local[i], i) for i in range(workers)])
        mom = MU * mom + g
        local = local - LR * mom
        if (step + 1) % H == 0:
            delta = start - local
            for m in range(workers):
                if variant == "eager":
                    gm = mean_prev + (delta[m] - own_prev[m]) / workers
                else:
                    gm = mean_prev
                # nesterov_outer_step takes the mean model: theta_g - delta_used.
                start[m], trace[m] = nesterov_outer_step(
                    start[m], trace[m], start[m] - gm, OUTER_LR, OUTER_MU
                )
            mean_prev, own_prev = delta.mean(0), delta
            local = start.copy()
        params.append(local.copy())
        starts.append(start.copy())
    return np.stack(params), np.stack(starts), mean_prev


def make(variant):
    outer = optax.sgd(OUTER_LR, momentum=OUTER_MU, nesterov=True)
    return lambda c: overlapped_diloco(
        optax.sgd(LR, momentum=MU), collective=c, sync_every=H, outer=outer, variant=variant
    )


def worker_fn(make_tx):
    """`block_worker`: the params, the rounds' starts and this step's wire bytes after every
    step, and the final state."""
    return block_worker(make_tx, H * ROUNDS, reference=lambda s: s.start)


@pytest.mark.mpi
@pytest.mark.parametrize("variant", ["eager", "delayed"])
def test_matches_oracle(variant):
    expect, expect_start, in_flight = oracle(N, variant)
    out = run_workers(worker_fn(make(variant)), P0, X, Y)
    ring = 2 * (N - 1) * PROBLEM.n_bytes // N
    for rank, ((params, start, wire), state) in out.items():
        assert isinstance(state, OverlappedDiLoCoState)
        np.testing.assert_allclose(flat(params), expect[:, rank], **TOL)
        np.testing.assert_allclose(flat(start), expect_start[:, rank], **TOL)
        assert np.asarray(wire.sent).tolist() == [0, 0, ring] * ROUNDS
        assert int(state.rounds) == ROUNDS
        # The last round's mean is kept, not applied: the next round would use it.
        np.testing.assert_allclose(flat(state.mean_delta), in_flight, **TOL)
    if variant == "delayed":  # one outer model for all
        np.testing.assert_allclose(expect_start, expect_start[:, :1].repeat(N, 1), atol=1e-12)
    else:  # each worker's fresh share differs
        assert np.abs(expect_start[-1] - expect_start[-1, 0]).max() > 1e-3


def test_variants_differ_and_delayed_lags_one_round():
    """The delayed variant does not move in round 1 (nothing has arrived); the eager one
    does, and differs from DiLoCo, which applies the fresh mean at once."""
    eager, _, _ = oracle(N, "eager")
    delayed, delayed_start, _ = oracle(N, "delayed")
    theta0 = flat(P0)[0]
    np.testing.assert_allclose(delayed_start[H - 1], np.tile(theta0, (N, 1)), atol=1e-12)
    assert np.abs(eager - delayed).max() > 1e-3


def test_eager_with_one_worker_is_diloco():
    """M = 1: the fresh share is the whole mean, ``g = Delta^(t)``: DiLoCo."""
    coll = AxisCollective("one", 1)
    outer = optax.sgd(OUTER_LR, momentum=OUTER_MU, nesterov=True)
    inner = optax.sgd(LR, momentum=MU)
    args = jax.tree.map(lambda a: a[:1], (P0, X, Y))

    def run(tx):
        def worker(p0, x, y):
            def body(carry, _):
                p, s = carry
                u, s = tx.update(jax.grad(loss)(p, x, y), s, p)
                p = optax.apply_updates(p, u)
                return (p, s), p

            _, traj = lax.scan(body, (p0, tx.init(p0)), None, length=H * ROUNDS)
            return traj

        return jax.vmap(worker, axis_name="one")(*args)

    a = run(overlapped_diloco(inner, collective=coll, sync_every=H, outer=outer))
    b = run(diloco(inner, collective=coll, sync_every=H, outer=outer))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6), a, b)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(variant="lazy"), "variant must be one of"),
        (dict(sync_every=0), "sync_every must be an int >= 1"),
        (dict(outer=optax.sgd), "outer must be an optax.GradientTransformation"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    args = dict(collective=AxisCollective("w", 2), sync_every=2, outer=optax.sgd(0.7)) | kwargs
    with pytest.raises(ValueError, match=match):
        overlapped_diloco(optax.sgd(0.1), **args)


def test_costmodel_overlapped_hides_what_fits():
    blocking = Projection(comm_s=3.0, step_s=4.0)  # 1 s of compute, 3 s all-reduce
    assert overlapped(blocking, 2.0).step_s == 2.0  # 1 s of it exposed
    assert overlapped(blocking, 5.0).step_s == 1.0  # all of it hidden
    assert overlapped(blocking, 0.0).step_s == 4.0
    assert overlapped(blocking, 5.0).comm_s == 3.0
    with pytest.raises(ValueError, match="window_s must be >= 0"):
        overlapped(blocking, -1.0)
