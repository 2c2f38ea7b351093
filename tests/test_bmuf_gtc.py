"""shoal.optim.bmuf_gtc (two-tier: GTC inside groups, BMUF across) against a NumPy oracle,
on 4 simulated workers as nested vmap axes ("group", "member") and under mpiexec -n 4
(MPICollective.split)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from block_cases import BMUF_VARIANTS, bmuf_block_update, flat, linear_problem, loss
from harness import n_workers, run_two_tier, run_workers, tiers, world
from jax import lax

from shoal.comms import two_tier, wire_bytes
from shoal.comms.wire import all_gather_bytes, all_reduce_bytes
from shoal.optim import GTCState, bmuf, bmuf_gtc, gtc

N = n_workers()
PROBLEM = linear_problem(seed=1, n=N)
X, Y, P0, grad_np = PROBLEM.x, PROBLEM.y, PROBLEM.p0, PROBLEM.grad
N_ELEM = PROBLEM.n_elements  # fused GTC buffer: b, then w (jax.tree.leaves order)
N_BYTES = PROBLEM.n_bytes
LR, TAU, CAP = 0.1, 0.3, 4  # CAP < N_ELEM: the capacity rule is exercised
VARIANTS = BMUF_VARIANTS


def oracle(steps, block_size, group_size, variant, mu=0.0, reset=False):
    """Ladkat et al.'s two-tier procedure: per step, Strom's GTC inside each group (first
    CAP qualifying elements in cyclic order from ``offset``) and inner SGD with momentum
    ``mu`` on the group mean; every ``block_size`` steps eqs. (1)-(4) over the group
    models with zeta = 1, eta = 1 - 1 / n_groups. Returns every worker's params after
    every step, [steps, N, n]."""
    n_groups = N // group_size
    zeta, eta = 1.0, 1.0 - 1.0 / n_groups
    theta0 = flat(P0)[0].astype(np.float64)
    models = np.tile(theta0, (n_groups, 1))
    mom = np.zeros_like(models)
    residual = np.zeros((N, N_ELEM))
    w_g, w_filtered, delta, offset = theta0.copy(), theta0.copy(), np.zeros(N_ELEM), 0
    out = []
    for step in range(steps):
        agg = np.zeros_like(models)
        for i in range(N):
            g = i // group_size
            a = grad_np(models[g], i) + residual[i]
            cyclic = (offset + np.arange(N_ELEM)) % N_ELEM
            sent = cyclic[np.abs(a[cyclic]) > TAU][:CAP]
            q = np.zeros(N_ELEM)
            q[sent] = np.where(a[sent] > 0, TAU, -TAU)
            residual[i] = a - q
            agg[g] += q / group_size
        offset = (offset + CAP) % N_ELEM
        mom = mu * mom + agg
        models = models - LR * mom
        if (step + 1) % block_size == 0:
            w_g, w_filtered, delta = bmuf_block_update(
                w_g, w_filtered, delta, models.mean(0), zeta, eta, eta, variant
            )
            models = np.tile(w_g, (n_groups, 1))
            if reset:
                mom[:] = 0.0
        out.append(models[np.arange(N) // group_size])
    return np.stack(out)


def scan_steps(opt, params, x, y, steps, extra=lambda p: ()):
    state = opt.init(params)

    def body(carry, _):
        p, s = carry
        u, s = opt.update(jax.grad(loss)(p, x, y), s, p)
        p = optax.apply_updates(p, u)
        return (p, s), (p, wire_bytes(s, "step"), extra(p))

    (_, state), traj = lax.scan(body, (params, state), None, length=steps)
    return traj, state


def train_two_tier(group_size, steps, inner=None, **kwargs):
    """bmuf_gtc on every worker; per step its params, wire bytes and the spread of the
    group's params (max - min over ``intra``: 0 iff the group's models are identical)."""
    inner = optax.sgd(LR) if inner is None else inner

    def worker(intra, inter, p0, x, y):
        # Rank 0's params for all: from group 0 to every group, then from member 0.
        params = intra.broadcast(inter.broadcast(p0, 0), 0)
        opt = bmuf_gtc(inner, intra=intra, inter=inter, threshold=TAU, capacity=CAP, **kwargs)

        def spread(p):
            return jax.tree.map(
                jnp.subtract, intra.all_reduce(p, "max"), intra.all_reduce(p, "min")
            )

        return scan_steps(opt, params, x, y, steps, spread)

    return run_two_tier(worker, group_size, P0, X, Y)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "variant,mu,reset",
    [("seed", 0.0, False), ("chen_huo", 0.9, False), ("classic", 0.0, False), ("seed", 0.9, True)],
    ids=["seed", "chen_huo-momentum", "classic", "seed-momentum-reset"],
)
def test_two_tier_matches_oracle(variant, mu, reset):
    group_size, block_size, blocks = 2, 3, 3
    steps = block_size * blocks
    inner = optax.sgd(LR, momentum=mu) if mu else optax.sgd(LR)
    out = train_two_tier(
        group_size, steps, inner, block_size=block_size, reset_inner_state=reset,
        **VARIANTS[variant],
    )  # fmt: skip
    expect = oracle(steps, block_size, group_size, variant, mu=mu, reset=reset)
    n_groups = N // group_size
    intra_bytes = all_gather_bytes(4 * (CAP + 1), group_size)[0]
    inter_bytes = all_reduce_bytes(N_BYTES, n_groups)[0]
    expect_wire = ([intra_bytes] * (block_size - 1) + [intra_bytes + inter_bytes]) * blocks
    for rank, ((params, wire, spread), state) in out.items():
        np.testing.assert_allclose(flat(params), expect[:, rank], rtol=2e-5, atol=2e-5)
        # A group's models are identical after every step, bit for bit.
        assert all(np.all(np.asarray(s) == 0) for s in jax.tree.leaves(spread))
        assert np.asarray(wire.sent).tolist() == expect_wire
        assert np.asarray(wire.received).tolist() == expect_wire
        assert int(wire_bytes(state, "total").sent) == sum(expect_wire)  # GTC's and BMUF's
        assert isinstance(state.inner_state[0], GTCState)
        assert int(state.block) == blocks


@pytest.mark.mpi
@pytest.mark.parametrize("variant", ["seed", "chen_huo"])
def test_group_size_one_is_bmuf(variant):
    block_size, steps = 3, 9
    two = train_two_tier(1, steps, block_size=block_size, **VARIANTS[variant])

    def worker(coll, p0, x, y):
        opt = bmuf(optax.sgd(LR), collective=coll, block_size=block_size, **VARIANTS[variant])
        return scan_steps(opt, coll.broadcast(p0, 0), x, y, steps)

    one = run_workers(worker, P0, X, Y)
    for rank, ((params, wire, _), _) in two.items():
        (want, want_wire, _), _ = one[rank]
        np.testing.assert_allclose(flat(params), flat(want), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(wire.sent, want_wire.sent)
        np.testing.assert_array_equal(wire.received, want_wire.received)


@pytest.mark.mpi
def test_one_group_is_gtc_with_inner():
    block_size, steps = 3, 9
    two = train_two_tier(N, steps, block_size=block_size)

    def worker(coll, p0, x, y):
        opt = optax.chain(gtc(TAU, collective=coll, capacity=CAP), optax.sgd(LR))
        return scan_steps(opt, coll.broadcast(p0, 0), x, y, steps)

    one = run_workers(worker, P0, X, Y)
    gtc_bytes = all_gather_bytes(4 * (CAP + 1), N)[0]
    for rank, ((params, wire, _), _) in two.items():
        (want, want_wire, _), _ = one[rank]
        np.testing.assert_allclose(flat(params), flat(want), rtol=1e-6, atol=1e-6)
        # One group: the inter all-reduce is among one worker and moves nothing.
        assert np.asarray(wire.sent).tolist() == [gtc_bytes] * steps
        assert np.asarray(want_wire.sent).tolist() == [gtc_bytes] * steps


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(threshold=0.0), "threshold must be a finite number > 0"),
        (dict(capacity=1.5), r"capacity as a fraction must lie in \(0, 1\]"),
        (dict(block_size=0), "block_size must be an int >= 1"),
        (dict(block_momentum=1.0), r"block_momentum must lie in \[0, 1\)"),
        (dict(block_lr=-0.5), "block_lr must be a finite number > 0"),
        (dict(nbm="fairseq"), "nbm must be one of"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    intra, inter = tiers(2)
    kwargs = {"block_size": 2, "threshold": 0.1, **kwargs}
    with pytest.raises(ValueError, match=match):
        bmuf_gtc(optax.sgd(0.1), intra=intra, inter=inter, **kwargs)


def test_group_size_must_divide_workers():
    with pytest.raises(ValueError, match="group_size=3 must divide"):
        two_tier(world(), 3)
