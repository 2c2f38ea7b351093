"""shoal.optim.desloc against a NumPy float64 oracle of DES-LOC's Algorithm 1 (Iacob et al.
2025), on simulated workers and under mpiexec -n 4 (the tests marked mpi are
rank-agnostic)."""

import jax
import numpy as np
import pytest
from block_cases import block_worker, flat, linear_problem
from harness import n_workers, run_workers
from jax import lax

from shoal.comms import AxisCollective, wire_bytes
from shoal.optim import DESLOCState, desloc

N = n_workers()
PROBLEM = linear_problem(seed=7, n=N)
X, Y, P0, grad_np = PROBLEM.x, PROBLEM.y, PROBLEM.p0, PROBLEM.grad
LR, B1, B2, EPS = 0.05, 0.8, 0.95, 1e-6
STEPS = 13
TOL = dict(rtol=5e-5, atol=5e-5)


def oracle(workers, k_x, k_u, k_v):
    """Float64: every worker's Adam without bias correction; before update t the first
    moment is averaged if K_u divides t, the second if K_v does, the params if K_x does.
    Returns every worker's params after every update."""
    x = np.tile(flat(P0)[0].astype(np.float64), (workers, 1))
    u, v = np.zeros_like(x), np.zeros_like(x)
    out = []
    for t in range(1, STEPS + 1):
        g = np.stack([grad_np(x[i], i) for i in range(workers)])
        if t % k_u == 0:
            u[:] = u.mean(0)
        if t % k_v == 0:
            v[:] = v.mean(0)
        if t % k_x == 0:
            x[:] = x.mean(0)
        u = B1 * u + (1 - B1) * g
        v = B2 * v + (1 - B2) * g * g
        x = x - LR * u / (np.sqrt(v) + EPS)
        out.append(x.copy())
    return np.stack(out)


def make(k_x, k_u, k_v):
    return lambda c: desloc(
        LR, collective=c, sync_every=k_x, moment_every=k_u, second_moment_every=k_v,
        b1=B1, b2=B2, eps=EPS,
    )  # fmt: skip


def worker_fn(make_tx):
    """`block_worker`: the params, the step count and this step's wire bytes after every
    step, and the final state."""
    return block_worker(make_tx, STEPS, reference=lambda s: s.step)


@pytest.mark.mpi
@pytest.mark.parametrize("periods", [(2, 3, 6), (3, 3, 3), (1, 4, 8)])
def test_matches_oracle(periods):
    expect = oracle(N, *periods)
    out = run_workers(worker_fn(make(*periods)), P0, X, Y)
    ring = 2 * (N - 1) * PROBLEM.n_bytes // N  # one param-sized float32 all-reduce
    k_x, k_u, k_v = periods
    want = [ring * sum(t % k == 0 for k in (k_x, k_u, k_v)) for t in range(1, STEPS + 1)]
    for rank, ((params, _, wire), state) in out.items():
        assert isinstance(state, DESLOCState) and int(state.step) == STEPS
        np.testing.assert_allclose(flat(params), expect[:, rank], **TOL)
        assert np.asarray(wire.sent).tolist() == want


def test_the_periods_matter():
    """Each period changes the run: desynced (2, 6, 12) is neither Local Adam at 2 nor
    Adam averaged every step."""
    desynced = oracle(N, 2, 6, 12)
    assert np.abs(desynced - oracle(N, 2, 2, 2)).max() > 1e-4
    assert np.abs(desynced - oracle(N, 2, 6, 6)).max() > 1e-4
    assert np.abs(desynced - oracle(N, 1, 1, 1)).max() > 1e-4


def test_defaults_are_the_papers_periods():
    """K_u = 3 K_x and K_v = 6 K_x when not given: the bytes of each update say so."""
    coll = AxisCollective("workers", 2)
    tx = desloc(LR, collective=coll, sync_every=2)

    def run(p):
        def body(s, _):
            _, s = tx.update(p, s, p)
            return s, wire_bytes(s, "step").sent

        return lax.scan(body, tx.init(p), None, length=12)[1]

    sent = jax.vmap(run, axis_name="workers")(np.ones((2, 5), np.float32))[0]
    ring = 2 * 1 * 20 // 2
    want = [ring * sum(t % k == 0 for k in (2, 6, 12)) for t in range(1, 13)]
    assert np.asarray(sent).tolist() == want


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sync_every=0), "sync_every must be an int >= 1"),
        (dict(sync_every=4, moment_every=2), r"moment_every must be an int >= 4 \(>= sync_every"),
        (dict(moment_every=3, second_moment_every=2), r"second_moment_every must be an int >= 3"),
        (dict(b1=1.0), r"b1 must be a number in \[0, 1\)"),
        (dict(b2=-0.1), r"b2 must be a number in \[0, 1\)"),
        (dict(eps=-1.0), "eps must be a finite number >= 0"),
        (dict(learning_rate=0.0), "learning_rate must be a finite number > 0"),
        (dict(learning_rate=True), "learning_rate must be a finite number > 0"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    args = dict(learning_rate=0.1, collective=AxisCollective("w", 2), sync_every=1) | kwargs
    with pytest.raises(ValueError, match=match):
        desloc(**args)
