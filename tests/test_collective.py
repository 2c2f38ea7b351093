"""Every Collective member against NumPy, on simulated workers and under mpiexec -n 4."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import UNDER_MPI, my_ranks, n_workers, run_workers, world

from shoal.comms import AxisCollective, two_tier
from shoal.comms.collective import ppermute_switch, reduce_scatter

pytestmark = pytest.mark.mpi

N = n_workers()
RNG = np.random.default_rng(0)
X = RNG.normal(size=(N, 3, 5)).astype(np.float32)


def test_size_and_rank():
    out = run_workers(lambda c, x: (c.rank(), jnp.int32(c.size)), X)
    for r, (rank, size) in out.items():
        assert int(rank) == r and int(size) == N


@pytest.mark.parametrize("op", ["mean", "sum", "max", "min"])
def test_all_reduce(op):
    expect = {"mean": X.mean(0), "sum": X.sum(0), "max": X.max(0), "min": X.min(0)}[op]
    tree = {"a": X, "b": X[:, 0, :2] * 3}
    out = run_workers(lambda c, t: c.all_reduce(t, op=op), tree)
    for y in out.values():
        np.testing.assert_allclose(y["a"], expect, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(y["b"], getattr(tree["b"], op)(0), rtol=1e-6, atol=1e-6)


def test_all_reduce_integer_sum_is_exact():
    xi = (np.arange(N * 4).reshape(N, 4) * 7).astype(np.int32)
    out = run_workers(lambda c, x: c.all_reduce(x, op="sum"), xi)
    for y in out.values():
        np.testing.assert_array_equal(y, xi.sum(0))


def test_all_gather():
    out = run_workers(lambda c, x: c.all_gather(x), X)
    for y in out.values():
        assert y.shape == (N, 3, 5)
        np.testing.assert_array_equal(y, X)


def test_all_to_all():
    xs = RNG.normal(size=(N, N, 2, 3)).astype(np.float32)
    out = run_workers(lambda c, x: c.all_to_all(x), xs)
    for r, y in out.items():
        # worker r receives chunk r of every worker, stacked by source
        np.testing.assert_array_equal(y, xs[:, r])


@pytest.mark.parametrize("root", [0, N - 1])
def test_broadcast_is_bit_exact(root):
    x = X.copy()
    x[root, 0, 0] = -0.0
    x[root, 0, 1] = np.nan
    tree = {"f": x, "i": np.arange(N * 2, dtype=np.int32).reshape(N, 2), "b": np.eye(N, dtype=bool)}
    out = run_workers(lambda c, t: c.broadcast(t, root=root), tree)
    for y in out.values():
        assert np.array_equal(np.asarray(y["f"]).view(np.uint32), x[root].view(np.uint32))
        np.testing.assert_array_equal(y["i"], tree["i"][root])
        np.testing.assert_array_equal(y["b"], tree["b"][root])


@pytest.mark.parametrize("kind", ["shift", "partial"])
def test_ppermute(kind):
    if kind == "shift":
        perm = [(i, (i + 1) % N) for i in range(N)]
    else:
        perm = [(0, 2), (2, 1)]
    out = run_workers(lambda c, x: c.ppermute(x, perm), X)
    src_of = {d: s for s, d in perm}
    for r, y in out.items():
        expect = X[src_of[r]] if r in src_of else np.zeros_like(X[0])
        np.testing.assert_array_equal(y, expect)


@pytest.mark.parametrize("index", [0, 1, 2, 7, -1])
def test_ppermute_switch_sends_along_the_chosen_permutation(index):
    # Worker r sends to perms[k][r]; the index is clamped to the list, as lax.switch's.
    perms = [tuple((r + 1) % N for r in range(N)), tuple(reversed(range(N))), tuple(range(N))]
    out = run_workers(lambda c, x: ppermute_switch(c, x, perms, jnp.int32(index)), X)
    perm = perms[min(max(index, 0), len(perms) - 1)]
    src_of = {d: s for s, d in enumerate(perm)}
    for r, y in out.items():
        np.testing.assert_array_equal(y, X[src_of[r]])  # a copy: bit-identical


def test_ppermute_switch_refuses_what_is_not_a_permutation():
    with pytest.raises(ValueError, match=r"perms: each must be a permutation of range\(4\)"):
        run_workers(lambda c, x: ppermute_switch(c, x, [(0, 0, 1, 2)], 0), X)
    with pytest.raises(ValueError, match="at least one permutation"):
        run_workers(lambda c, x: ppermute_switch(c, x, [], 0), X)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reduce_scatter_sums_each_row_over_the_workers(dtype):
    # Worker j holds x_j of shape [N, 2, 3]; worker r gets sum_j x_j[r], in float32.
    x = RNG.normal(size=(N, N, 2, 3)).astype(np.float32)
    xd = jnp.asarray(x, dtype)
    out = run_workers(lambda c, v: reduce_scatter(c, v), xd)
    oracle = np.asarray(xd.astype(jnp.float32)).sum(0)  # [N, 2, 3]: row r for worker r
    for r, y in out.items():
        assert y.dtype == jnp.float32 and y.shape == (2, 3)
        np.testing.assert_allclose(y, oracle[r], rtol=1e-5, atol=1e-5)


def test_reduce_scatter_refuses_a_bad_x():
    with pytest.raises(
        ValueError, match=rf"reduce_scatter needs x.shape\[0\] == collective size {N}"
    ):
        run_workers(lambda c, v: reduce_scatter(c, v[:1]), X)
    with pytest.raises(TypeError, match="reduce_scatter needs a floating x"):
        run_workers(lambda c, v: reduce_scatter(c, jnp.zeros((N, 2), jnp.int32)), X)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_round_trips(dtype):
    x = jnp.asarray(X, dtype)
    out = run_workers(lambda c, v: (c.all_gather(v), c.broadcast(v, 1), c.all_reduce(v, "sum")), x)
    x32 = np.asarray(x.astype(jnp.float32))
    for y_gather, y_bcast, y_sum in out.values():
        assert y_gather.dtype == dtype and y_sum.dtype == dtype
        np.testing.assert_array_equal(np.asarray(y_gather, np.float32), x32)
        np.testing.assert_array_equal(np.asarray(y_bcast, np.float32), x32[1])
        np.testing.assert_allclose(np.asarray(y_sum, np.float32), x32.sum(0), rtol=1e-2, atol=1e-2)


def test_two_tier_groups():
    group_size = 2
    groups = N // group_size
    intra, inter = two_tier(world(), group_size)
    assert intra.size == group_size and inter.size == groups

    def fn(x):
        return intra.all_reduce(x, "sum"), inter.all_reduce(x, "sum"), intra.rank(), inter.rank()

    if UNDER_MPI:
        r = my_ranks()[0]
        outs = {r: jax.jit(fn)(X[r])}
    else:
        nested = jax.vmap(jax.vmap(fn, axis_name=intra.axis_name), axis_name=inter.axis_name)
        y = jax.jit(nested)(X.reshape(groups, group_size, 3, 5))
        outs = {
            w: jax.tree.map(lambda a, w=w: a[w // group_size, w % group_size], y) for w in range(N)
        }
    for w, (s_intra, s_inter, r_intra, r_inter) in outs.items():
        g, m = divmod(w, group_size)
        np.testing.assert_allclose(
            s_intra, X[g * group_size : (g + 1) * group_size].sum(0), rtol=1e-6
        )
        np.testing.assert_allclose(s_inter, X[m::group_size].sum(0), rtol=1e-6)
        assert int(r_intra) == m and int(r_inter) == g


def test_bad_group_size():
    with pytest.raises(ValueError, match="group_size=3 must divide"):
        two_tier(world(), 3)
    with pytest.raises(ValueError, match="group_size"):
        two_tier(world(), 0)


def test_unknown_op():
    with pytest.raises(ValueError, match="op must be one of"):
        run_workers(lambda c, x: c.all_reduce(x, op="avg"), X)


def test_all_to_all_shape_error():
    with pytest.raises(ValueError, match=r"x.shape\[0\] == collective size"):
        run_workers(lambda c, x: c.all_to_all(x[:, :1]), X)


def test_bad_perm():
    with pytest.raises(ValueError, match="repeat"):
        run_workers(lambda c, x: c.ppermute(x, [(0, 1), (2, 1)]), X)
    with pytest.raises(ValueError, match="out of range"):
        run_workers(lambda c, x: c.ppermute(x, [(0, N)]), X)


def test_collectives_are_frozen_hashable_not_callable():
    c = world()
    assert not callable(c)
    hash(c)
    with pytest.raises((AttributeError, TypeError)):
        c.size = 3


@pytest.mark.skipif(UNDER_MPI, reason="simulation engine only")
def test_axis_collective_wrong_axis_size():
    c = AxisCollective("workers", 4)
    with pytest.raises(ValueError, match="size=4.*axis of size 3"):
        jax.vmap(lambda x: c.all_reduce(x), axis_name="workers")(jnp.ones((3, 2)))
    with pytest.raises(ValueError, match="outside a vmap"):
        c.rank()
    with pytest.raises(ValueError, match="size must be an int >= 1"):
        AxisCollective("workers", 0)


@pytest.mark.skipif(not UNDER_MPI, reason="the MPI collective's refusal")
def test_mpi_collective_refuses_churn():
    from shoal.comms.presence import present

    with pytest.raises(ValueError, match="not MPICollective.*--backend sim"):
        with present(world(), jnp.ones(N)):
            pass
