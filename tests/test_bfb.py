"""Herring's balanced fusion buffers: the layout (hand-checked), the production order,
atomic placement, and `bfb_allreduce` against the all-reduce mean, simulated and under
mpiexec. Dedicated servers need W + S ranks: `test_dedicated_servers` starts its own
``mpiexec -n 6`` job (tests/jobs/bfb_servers.py)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from harness import UNDER_MPI, mpiexec, mpiexec_per_rank, my_ranks, n_workers, run_workers, world

from shoal.comms import (
    AxisCollective,
    atomic_placement,
    broadcast_order,
    gradient_order,
    plan_fusion,
    wire_bytes,
)
from shoal.optim import bfb_allreduce
from shoal.optim._bfb import server_bytes_per_step

N = n_workers()
RNG = np.random.default_rng(3)
# Mixed shapes and dtypes; 'big' spans several buffers at the sizes used below.
TREE = {
    "big": RNG.normal(size=(5, 7)).astype(np.float32),
    "empty": np.zeros((0, 4), np.float32),
    "half": RNG.normal(size=(3,)).astype(ml_dtypes.bfloat16),
    "one": np.float32(2.5),
    "vec": RNG.normal(size=(11,)).astype(np.float32),
}
# Leaves in jax.tree.leaves order: big, empty, half, one, vec.
GRADS = jax.tree.map(lambda a: np.stack([a * (r + 1) - r for r in range(N)]), TREE)


def test_layout_by_hand():
    # Production order vec, one, big, half, empty; buffers of 12 float32 = 48 bytes, S = 3.
    plan = plan_fusion(TREE, buffer_bytes=48, num_shards=3, order=[4, 3, 0, 2, 1])
    assert plan.dtype == np.float32  # bfloat16 + float32 -> float32, exact
    # 11 + 1 + 35 + 3 = 50 elements -> 12, 12, 12, 12, 2
    assert plan.buffer_sizes == (12, 12, 12, 12, 2)
    assert plan.shard_sizes == (4, 4, 4, 4, 1)
    assert plan.shard_bytes == (16, 16, 16, 16, 4)
    assert plan.num_buffers == 5 and plan.padding == 1
    # vec fills 0..10 and one sits at 11; big spans buffers 1-3 (big[24:35] in buffer 3,
    # followed by half[0:1]); half[1:3] is the last buffer, padded with one zero.
    assert plan.segments[0] == ((4, 0, 11, 0), (3, 0, 1, 11))
    assert plan.segments[3] == ((0, 24, 35, 0), (2, 0, 1, 11))
    assert plan.segments[4] == ((2, 1, 3, 0),)
    # A dedicated server gets one shard of every buffer from every worker: 4 x 68 bytes.
    assert server_bytes_per_step(plan, num_workers=4) == 4 * (4 * 16 + 4)
    bufs = plan.fuse(TREE)
    assert [b.shape for b in bufs] == [(3, 4)] * 4 + [(3, 1)]
    np.testing.assert_array_equal(bufs[0].ravel(), np.r_[TREE["vec"], TREE["one"]])
    np.testing.assert_array_equal(bufs[4].ravel(), np.r_[TREE["half"][1:].astype(np.float32), 0])


@pytest.mark.parametrize("buffer_bytes", [4, 20, 48, 1000, None])
@pytest.mark.parametrize("shards", [1, 3, 4])
def test_fuse_unfuse_round_trip_is_exact(buffer_bytes, shards):
    tree = dict(TREE, neg0=np.array([-0.0, np.inf, np.nan, 1e-40], np.float32))
    order = list(range(len(jax.tree.leaves(tree))))[::-1]
    plan = plan_fusion(tree, buffer_bytes=buffer_bytes, num_shards=shards, order=order)
    bufs = plan.fuse(tree)
    # Every shard of a buffer has the same size; full buffers hold buffer_bytes exactly.
    assert all(b.shape == (shards, k) for b, k in zip(bufs, plan.shard_sizes))
    assert all(n == plan.buffer_elements for n in plan.buffer_sizes[:-1])
    assert sum(plan.buffer_sizes) == sum(np.size(x) for x in jax.tree.leaves(tree))
    back = plan.unfuse(bufs)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(back)):
        assert np.asarray(a).dtype == b.dtype and np.shape(a) == b.shape
        np.testing.assert_array_equal(
            np.atleast_1d(a).view(np.uint8), np.atleast_1d(np.asarray(b)).view(np.uint8)
        )  # bit-exact, -0.0 and NaN included


def test_shapes_only_and_auto_buffer():
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), TREE)
    assert plan_fusion(shapes, num_shards=2, buffer_bytes=20) == plan_fusion(
        TREE, num_shards=2, buffer_bytes=20
    )
    big = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float16)}  # 32 MiB
    plan = plan_fusion(big, num_shards=8)
    # About 8 buffers, each a whole number of elements per shard.
    assert plan.num_buffers == 8 and plan.padding == 0
    assert plan.buffer_elements * 2 == 32 * 2**20 // 8


def test_gradient_order_follows_the_backward_pass():
    def loss(p, x):
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.sum(jax.nn.gelu(h @ p["w2"] + p["b2"]))

    params = {k: jnp.ones(s) for k, s in
              {"b1": (4,), "b2": (2,), "w1": (3, 4), "w2": (4, 2)}.items()}  # fmt: skip
    order = gradient_order(loss, params, jax.ShapeDtypeStruct((5, 3), jnp.float32))
    names = ["b1", "b2", "w1", "w2"]
    # Output layer first (its bias, then its weight, as jax transposes them), input last.
    assert [names[i] for i in order] == ["b2", "w2", "b1", "w1"]


def test_atomic_placement_by_hand():
    shapes = {"a": np.zeros(10, np.float16), "b": np.zeros(3), "c": np.zeros(1), "d": np.zeros(7)}
    placed = atomic_placement(shapes, num_servers=2, order=[3, 0, 2, 1])
    # order d, a, c, b -> servers 0, 1, 0, 1
    assert placed.server == (1, 1, 0, 0)
    assert placed.leaf_bytes == (20, 24, 8, 56)
    assert placed.server_bytes == (64, 44)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_shards": 0}, "num_shards"),
        ({"num_shards": 2, "buffer_bytes": 3}, "smaller than one element"),
        ({"num_shards": 2, "order": [0, 1]}, "permutation"),
        ({"num_shards": 2, "buffer_bytes": 4.0}, "buffer_bytes"),
    ],
)
def test_bad_layout_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_fusion(TREE, **kwargs)
    with pytest.raises(ValueError, match="num_servers"):
        atomic_placement(TREE, num_servers=0)
    with pytest.raises(TypeError, match="integer and floating"):
        plan_fusion({"i": np.zeros(2, np.int32), "f": np.zeros(2)}, num_shards=1)


@pytest.mark.mpi
def test_worker_zeros_order_wins():
    leaves = len(jax.tree.leaves(TREE))
    base = np.arange(leaves)[::-1]
    # Every worker derives a different local order; worker 0's is the one everyone uses.
    local = np.stack([np.roll(base, r) for r in range(N)]).astype(np.int32)
    if UNDER_MPI:
        r = world()._rank
        agreed = {r: np.asarray(broadcast_order(local[r], world()))}
    else:  # simulated workers: the same broadcast, traced
        agreed = run_workers(lambda c, o: c.broadcast(o, root=0), local)
    plans = {
        r: plan_fusion(TREE, num_shards=2, buffer_bytes=20, order=o) for r, o in agreed.items()
    }
    for r in my_ranks():
        np.testing.assert_array_equal(agreed[r], base)
        assert plans[r] == plan_fusion(TREE, num_shards=2, buffer_bytes=20, order=base)


def _mean(tree):
    return jax.tree.map(lambda a: np.asarray(a, np.float32).mean(0), tree)


def _check_mean(out, grads, ranks):
    mean = _mean(grads)
    for r in ranks:
        for got, want in zip(jax.tree.leaves(out[r]), jax.tree.leaves(mean)):
            tol = 1e-2 if got.dtype == jnp.bfloat16 else 1e-6
            assert got.dtype == (want.dtype if got.dtype != jnp.bfloat16 else jnp.bfloat16)
            np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)


@pytest.mark.mpi
@pytest.mark.parametrize("buffer_bytes", [12, 40, None])
def test_colocated_equals_all_reduce_mean(buffer_bytes):
    def worker(coll, g):
        tx = optax.chain(bfb_allreduce(collective=coll, buffer_bytes=buffer_bytes))
        u, s = tx.update(g, tx.init(g))
        return u, wire_bytes(s, "step")

    out = run_workers(worker, GRADS)
    _check_mean({r: u for r, (u, _) in out.items()}, GRADS, my_ranks())
    one = jax.tree.map(lambda a: a[0], GRADS)
    plan = plan_fusion(one, buffer_bytes=buffer_bytes, num_shards=N)
    # all-to-all of each buffer (P-1)/P of it, all-gather of one shard to P-1 peers.
    expect = sum(2 * (N - 1) * b // N for b in plan.buffer_bytes)
    for _, w in out.values():
        assert (int(w.sent), int(w.received)) == (expect, expect)


@pytest.mark.mpi
def test_hierarchical_equals_all_reduce_mean():
    local = 2

    def worker(intra, inter, g):
        tx = bfb_allreduce(collective=inter, intra=intra, buffer_bytes=40)
        u, s = tx.update(g, tx.init(g))
        return u, s.wire.step

    if UNDER_MPI:
        intra, inter = world().split(local)
        r = world()._rank
        out = {r: jax.jit(lambda g: worker(intra, inter, g))(jax.tree.map(lambda a: a[r], GRADS))}
    else:
        intra, inter = AxisCollective("workers", N).split(local)
        nested = jax.vmap(jax.vmap(lambda g: worker(intra, inter, g), axis_name="member"),
                          axis_name="group")  # fmt: skip
        u, w = jax.jit(nested)(jax.tree.map(lambda a: a.reshape(N // local, local, *a.shape[1:]),
                                            GRADS))  # fmt: skip
        out = {r: jax.tree.map(lambda a, r=r: a[r // local, r % local], (u, w)) for r in range(N)}
    _check_mean({r: u for r, (u, _) in out.items()}, GRADS, my_ranks())
    plan = plan_fusion(jax.tree.map(lambda a: a[0], GRADS), buffer_bytes=40, num_shards=N)
    nodes = N // local
    expect = 0
    for b in plan.buffer_bytes:
        m = b // local  # this worker's slice after the in-node reduce-scatter
        expect += (local - 1) * b // local  # reduce-scatter in the node
        expect += 2 * (nodes - 1) * m // nodes  # colocated across nodes
        expect += (local - 1) * m  # all-gather in the node
    assert plan.shard_sizes[0] == 3  # 10 elements over 4 shards: every buffer padded to 12
    for _, w in out.values():
        assert (int(w.sent), int(w.received)) == (expect, expect)


class _Unsimulated(AxisCollective):
    """An `AxisCollective` that says it is not simulated: bfb then runs its fusion
    buffers under vmap, as it does on devices and MPI ranks."""

    def simulated(self) -> bool:
        return False


@pytest.mark.skipif(UNDER_MPI, reason="compares two simulated runs")
@pytest.mark.parametrize("two_tier", [False, True])
def test_simulated_leaf_by_leaf_equals_the_fusion_buffers(two_tier):
    # Simulated workers sum leaf by leaf; the buffers' layout changes the cost, not the
    # sums: the same values (mixed dtypes, padding, a leaf split over buffers) and bytes.
    def run(cls):
        if two_tier:
            intra, inter = cls("member", 2), cls("group", N // 2)
            tx = bfb_allreduce(collective=inter, intra=intra, buffer_bytes=40)
            step = lambda g: (lambda u, s: (u, s.wire.step))(*tx.update(g, tx.init(g)))
            f = jax.vmap(jax.vmap(step, axis_name="member"), axis_name="group")
            grads = jax.tree.map(lambda a: a.reshape(N // 2, 2, *a.shape[1:]), GRADS)
            return jax.jit(f)(grads)
        coll = cls("workers", N)
        tx = bfb_allreduce(collective=coll, buffer_bytes=12)
        step = lambda g: (lambda u, s: (u, s.wire.step))(*tx.update(g, tx.init(g)))
        return jax.jit(jax.vmap(step, axis_name="workers"))(GRADS)

    (leafwise, wire_a), (fused, wire_b) = run(AxisCollective), run(_Unsimulated)
    for a, b in zip(jax.tree.leaves(leafwise), jax.tree.leaves(fused)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    np.testing.assert_array_equal(np.asarray(wire_a.sent), np.asarray(wire_b.sent))
    np.testing.assert_array_equal(np.asarray(wire_a.received), np.asarray(wire_b.received))


def test_bad_bfb_arguments():
    coll = AxisCollective("workers", 4)
    with pytest.raises(TypeError, match="ParameterServers"):
        bfb_allreduce(collective=coll, servers=object())
    with pytest.raises(TypeError, match="Collective"):
        bfb_allreduce(collective=lambda: 0)
    tx = bfb_allreduce(collective=coll, order=[0, 0, 1])
    with pytest.raises(ValueError, match="permutation"):
        jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="workers")(GRADS)
    with pytest.raises(ValueError, match="floating"):
        tx = bfb_allreduce(collective=coll)
        jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="workers")(
            {"i": np.zeros((4, 3), np.int32)}
        )


JOB = Path(__file__).parent / "jobs" / "bfb_servers.py"


@pytest.mark.skipif(UNDER_MPI, reason="starts its own mpiexec job")
def test_dedicated_servers(tmp_path):
    """4 workers + 2 servers: flat and hierarchical means (float32 and bfloat16), wire
    bytes per worker and per server, errors for layouts inconsistent with the
    communicator, a clean shutdown (the job checks everything and exits 0)."""
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    args = [sys.executable, str(JOB), "check"]
    proc, stdout = mpiexec_per_rank(6, args, tmp_path, timeout=300, env=env)
    assert proc.returncode == 0, "".join(stdout)[-3000:] + proc.stderr[-3000:]
    said = "".join(stdout)
    assert said.count("server ok") == 2 and said.count("worker ok") == 4


@pytest.mark.skipif(UNDER_MPI, reason="starts its own mpiexec job")
def test_servers_do_not_hang_when_workers_never_shut_down():
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [mpiexec(), "-n", "3", sys.executable, str(JOB), "orphan"]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    # Exit code 3 is the job's TimeoutError handler (MPI_Abort(3)); the abort may cut off
    # the forwarded stderr, so the message is checked only when it arrived.
    assert proc.returncode != 0
    assert "waited 2 s" in proc.stderr or proc.returncode == 3, proc.stderr[-3000:]
    assert time.monotonic() - start < 60
