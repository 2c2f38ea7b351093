"""shoal.optim.diloco against a NumPy oracle of DiLoCo's equations, on simulated workers
and under mpiexec -n 4 (the tests marked mpi are rank-agnostic)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from block_cases import (
    block_worker,
    flat,
    linear_problem,
    loss,
    nesterov_outer_step,
    optax_outer_reference,
)
from harness import adam, adamw, n_workers, run_workers, world
from jax import lax

from shoal.comms import AxisCollective, Quantized, TopK
from shoal.comms.wire import all_reduce_bytes
from shoal.optim import DiLoCoState, allreduce_gradients, bmuf, diloco

N = n_workers()
# Different initial params per worker: the workers must broadcast rank 0's before init.
PROBLEM = linear_problem(seed=1, n=N)
X, Y, P0, grad_np = PROBLEM.x, PROBLEM.y, PROBLEM.p0, PROBLEM.grad
N_BYTES = PROBLEM.n_bytes
LR, MU = 0.1, 0.9  # inner SGD with momentum
OUTER_LR, OUTER_MU = 0.7, 0.9  # DiLoCo's outer Nesterov SGD
TOL = dict(rtol=2e-5, atol=2e-5)
QTOL = dict(rtol=0, atol=0.05)  # int8 blocks of 2 values: 1/254 of the block's larger


def nesterov_outer():
    return optax.sgd(OUTER_LR, momentum=OUTER_MU, nesterov=True)


def oracle(workers, steps, sync_every):
    """DiLoCo in float64: inner SGD with momentum MU on each worker (its momentum kept
    across rounds), then every ``sync_every`` steps the outer Nesterov SGD step on
    ``delta = theta_g - mean_i theta_i``. Returns every worker's params and theta_g
    after every step, [steps, workers, n] and [steps, n]."""
    theta_g = flat(P0)[0].astype(np.float64)
    theta = np.tile(theta_g, (workers, 1))
    mom = np.zeros_like(theta)
    trace = np.zeros_like(theta_g)
    params, glob = [], []
    for step in range(steps):
        g = np.stack([grad_np(theta[i], i) for i in range(workers)])
        mom = MU * mom + g
        theta = theta - LR * mom
        if (step + 1) % sync_every == 0:
            theta_g, trace = nesterov_outer_step(theta_g, trace, theta.mean(0), OUTER_LR, OUTER_MU)
            theta = np.tile(theta_g, (workers, 1))
        params.append(theta.copy())
        glob.append(theta_g.copy())
    return np.stack(params), np.stack(glob)


def worker_fn(tx, steps, apply=False):
    """`block_worker`: the params, theta_g and this step's wire bytes after every step,
    and the final state. ``apply``: each step by `update_and_apply` (the params in the
    outer step's branch)."""
    return block_worker(tx, steps, apply=apply)


def dilo(sync_every, **kwargs):
    kwargs.setdefault("outer", nesterov_outer())
    return lambda c: diloco(
        optax.sgd(LR, momentum=MU), collective=c, sync_every=sync_every, **kwargs
    )


def check_against_oracle(out, workers, steps, sync_every):
    expect, expect_g = oracle(workers, steps, sync_every)
    for rank, ((params, theta_g, _), state) in out.items():
        np.testing.assert_allclose(flat(params), expect[:, rank], **TOL)
        np.testing.assert_allclose(flat(theta_g), expect_g, **TOL)
        assert int(state.step) == steps and int(state.rounds) == steps // sync_every
        # The inner momentum was never reset: it is not zero after the last outer step.
        assert all(np.abs(np.asarray(m)).max() > 0 for m in jax.tree.leaves(state.inner_state))


@pytest.mark.mpi
@pytest.mark.parametrize("path", ["update", "apply"])
def test_matches_oracle(path):
    sync_every, steps = 3, 10  # the last step is an inner step after the third round
    out = run_workers(worker_fn(dilo(sync_every), steps, apply=path == "apply"), P0, X, Y)
    check_against_oracle(out, N, steps, sync_every)
    if path == "apply":  # after an outer step every worker sits at theta_g itself
        for (params, theta_g, _), _ in out.values():
            synced = slice(sync_every - 1, None, sync_every)
            np.testing.assert_array_equal(flat(params)[synced], flat(theta_g)[synced])


def test_matches_oracle_three_workers():
    sync_every, steps, workers = 3, 10, 3
    coll = AxisCollective("three", workers)
    args = jax.tree.map(lambda a: a[:workers], (P0, X, Y))
    run = jax.jit(
        jax.vmap(lambda *a: worker_fn(dilo(sync_every), steps)(coll, *a), axis_name="three")
    )
    out = run(*args)
    out = {r: jax.tree.map(lambda a, r=r: a[r], out) for r in range(workers)}
    check_against_oracle(out, workers, steps, sync_every)


def test_sync_every_one_unit_outer_lr_averages_the_inner_steps():
    """sync_every=1, outer=sgd(1): after every update each worker's model is the mean of
    the workers' models after their own inner step, ``theta + mean_i u_i`` (for a
    nonlinear inner such as Adam, each worker keeps its own moments)."""
    workers, steps = 3, 5
    coll = AxisCollective("w", workers)
    inner = adam(0.05)
    tx = diloco(inner, collective=coll, sync_every=1, outer=optax.sgd(1.0))
    args = jax.tree.map(lambda a: a[:workers], (P0, X, Y))

    def run(p0, x, y):
        params = coll.broadcast(p0, 0)

        def body(carry, _):
            p, s = carry
            u, s = tx.update(jax.grad(loss)(p, x, y), s, p)
            p = optax.apply_updates(p, u)
            return (p, s), p

        return lax.scan(body, (params, tx.init(params)), None, length=steps)[1]

    got = jax.jit(jax.vmap(run, axis_name="w"))(*args)
    # Reference without collectives: per-worker Adam from the common model, then the mean.
    theta = jax.tree.map(lambda a: a[0], args[0])
    states = jax.vmap(inner.init)(jax.tree.map(lambda a: jnp.stack([a] * workers), theta))
    for step in range(steps):
        grads = jax.vmap(jax.grad(loss), (None, 0, 0))(theta, *args[1:])
        u, states = jax.vmap(inner.update, (0, 0, None))(grads, states, theta)
        theta = jax.tree.map(lambda t, v: t + v.mean(0), theta, u)
        for r in range(workers):
            np.testing.assert_allclose(flat(got)[r, step], flat(theta), rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
def test_sync_every_one_unit_outer_lr_with_linear_inner_is_ssgd():
    """For an inner optimizer linear in the gradient (SGD with momentum), the mean of the
    workers' inner steps is the inner step on the mean gradient: S-SGD."""
    steps = 6
    got = run_workers(worker_fn(dilo(1, outer=optax.sgd(1.0)), steps), P0, X, Y)

    def ssgd(coll, p0, x, y):
        tx = optax.chain(allreduce_gradients(collective=coll), optax.sgd(LR, momentum=MU))
        params = coll.broadcast(p0, 0)

        def body(carry, _):
            p, s = carry
            u, s = tx.update(jax.grad(loss)(p, x, y), s, p)
            p = optax.apply_updates(p, u)
            return (p, s), p

        return lax.scan(body, (params, tx.init(params)), None, length=steps)[1]

    want = run_workers(ssgd, P0, X, Y)
    for rank, ((params, theta_g, _), _) in got.items():
        np.testing.assert_allclose(flat(params), flat(want[rank]), **TOL)
        np.testing.assert_allclose(flat(theta_g), flat(want[rank]), **TOL)


@pytest.mark.mpi
@pytest.mark.parametrize("inner", ["sgd_momentum", "adamw"])
def test_equals_bmuf_chen_huo_without_reset(inner):
    """bmuf(block_lr=zeta, block_momentum=eta, nesterov=True, nbm="chen_huo",
    reset_inner_state=False) is diloco(outer=sgd(zeta, momentum=eta, nesterov=True)):
    the same parameters, no reparametrisation."""
    sync_every, steps = 3, 9
    make = {
        "sgd_momentum": lambda: optax.sgd(LR, momentum=MU),
        "adamw": lambda: adamw(0.05, weight_decay=0.1),
    }[inner]
    got = run_workers(
        worker_fn(
            lambda c: diloco(make(), collective=c, sync_every=sync_every, outer=nesterov_outer()),
            steps,
        ),
        P0, X, Y,
    )  # fmt: skip
    want = run_workers(
        worker_fn(
            lambda c: bmuf(
                make(), collective=c, block_size=sync_every, block_lr=OUTER_LR,
                block_momentum=OUTER_MU, nesterov=True, nbm="chen_huo", reset_inner_state=False,
            ),
            steps,
        ),
        P0, X, Y,
    )  # fmt: skip
    for rank, ((params, theta_g, wire), _) in got.items():
        (b_params, b_global, b_wire), _ = want[rank]
        np.testing.assert_allclose(flat(params), flat(b_params), **TOL)
        np.testing.assert_allclose(flat(theta_g), flat(b_global), **TOL)
        assert np.asarray(wire.sent).tolist() == np.asarray(b_wire.sent).tolist()


def test_outer_adam_matches_optax_reference():
    """Any optax outer optimizer: theta_g steps with outer.update(theta_g - mean theta_i)."""
    workers, sync_every, rounds = 3, 2, 3
    outer = adam(0.3)
    coll = AxisCollective("w", workers)
    args = jax.tree.map(lambda a: a[:workers], (P0, X, Y))
    tx = lambda c: diloco(optax.sgd(LR), collective=c, sync_every=sync_every, outer=outer)
    run = jax.jit(jax.vmap(lambda *a: worker_fn(tx, sync_every * rounds)(coll, *a), axis_name="w"))
    (params, theta_g, _), _ = run(*args)
    restarts = optax_outer_reference(PROBLEM, outer, LR, sync_every, rounds, workers)
    for r, theta in enumerate(restarts):
        at = sync_every * (r + 1) - 1
        np.testing.assert_allclose(flat(theta_g)[:, at], np.tile(theta, (workers, 1)), **TOL)
        np.testing.assert_allclose(flat(params)[:, at], np.tile(theta, (workers, 1)), **TOL)


@pytest.mark.mpi
def test_wire_bytes_only_on_sync_steps():
    sync_every, rounds = 3, 2
    out = run_workers(worker_fn(dilo(sync_every), sync_every * rounds), P0, X, Y)
    sync = all_reduce_bytes(N_BYTES, N)[0]  # one all-reduce of the params
    assert sync == 2 * (N - 1) * N_BYTES // N
    for (_, _, wire), state in out.values():
        expect = ([0] * (sync_every - 1) + [sync]) * rounds  # inner steps send nothing
        assert np.asarray(wire.sent).tolist() == expect
        assert np.asarray(wire.received).tolist() == expect
        total = rounds * sync
        assert (int(state.wire.total.sent), int(state.wire.total.received)) == (total, total)
        assert isinstance(state, DiLoCoState)
        assert state.step.dtype == jnp.int32 and state.rounds.dtype == jnp.int32


@pytest.mark.mpi
def test_exchange_compressor():
    """exchange=TopK(1.0) sends everything: DiLoCo's oracle exactly, TopK's bytes; int8
    blocks of 2: the oracle up to the quantization, its error feedback kept in state."""
    sync_every, steps = 3, 6
    n = N_BYTES // 4
    cases = ((TopK(fraction=1.0, chunk_size=4), TOL), (Quantized("int8", block=2), QTOL))
    for exchange, tol in cases:
        out = run_workers(worker_fn(dilo(sync_every, exchange=exchange), steps), P0, X, Y)
        expect, expect_g = oracle(N, steps, sync_every)
        sync = exchange.wire_bytes(n, N)[0]
        for rank, ((params, theta_g, wire), state) in out.items():
            np.testing.assert_allclose(flat(params), expect[:, rank], **tol)
            np.testing.assert_allclose(flat(theta_g), expect_g, **tol)
            assert np.asarray(wire.sent).tolist() == [0, 0, sync] * 2
            memory = state.exchange_memory
            assert len(memory) == 2 if isinstance(exchange, Quantized) else len(memory) == 1
            if isinstance(exchange, Quantized):
                assert np.abs(np.asarray(memory[0])).max() > 0
            else:
                assert not np.asarray(memory[0]).any()


def test_exchange_must_be_a_compressor():
    with pytest.raises(ValueError, match="exchange must be None or a shoal.comms.Compressor"):
        dilo(3, exchange="fp4")(world())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(sync_every=0), "sync_every must be an int >= 1"),
        (dict(sync_every=2.0), "sync_every must be an int >= 1"),
        (dict(sync_every=True), "sync_every must be an int >= 1"),
        (dict(sync_every=None), "sync_every must be an int >= 1"),
        (dict(inner=optax.adamw), r"inner must be an optax.GradientTransformation.*called"),
        (dict(inner=None), "inner must be an optax.GradientTransformation"),
        (dict(outer=0.7), "outer must be an optax.GradientTransformation"),
        (dict(outer=optax.sgd), r"outer must be an optax.GradientTransformation.*called"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    kwargs = {"inner": optax.sgd(0.1), "sync_every": 2, "outer": nesterov_outer(), **kwargs}
    inner = kwargs.pop("inner")
    with pytest.raises(ValueError, match=match):
        diloco(inner, collective=world(), **kwargs)


def test_the_runner_evaluates_the_global_model():
    """Mid-round the workers' params are local: the runner tests ``theta_g`` instead."""
    from shoal.optim.readouts import evaluation_params

    tx = diloco(optax.sgd(0.1), collective=AxisCollective("workers", 1), sync_every=3,
                outer=optax.sgd(0.7))  # fmt: skip
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    state = state._replace(global_params={"w": jnp.full(3, 2.0)})
    local = {"w": jnp.zeros(3)}
    chained = (optax.EmptyState(), state)  # found inside a chain's state too
    np.testing.assert_array_equal(evaluation_params(local, chained)["w"], [2.0, 2.0, 2.0])
