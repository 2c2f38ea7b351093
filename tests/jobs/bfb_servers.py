"""MPI job for tests/test_bfb.py: Herring's dedicated parameter servers.

``mpiexec -n 6 python bfb_servers.py check``: 4 workers + 2 servers; the workers check
flat and hierarchical `bfb_allreduce` against the NumPy mean and their wire bytes, the
servers check the bytes they moved; every rank prints "<role> ok".
``mpiexec -n 3 python bfb_servers.py orphan``: the workers never shut the server down;
the server must give up (timeout 2 s) and abort the job.
"""

import os
import sys
import traceback

import jax
import ml_dtypes
import numpy as np
from mpi4py import MPI

from shoal.comms import AxisCollective, ParameterServers, plan_fusion, wire_bytes
from shoal.comms.wire import all_reduce_bytes
from shoal.optim import bfb_allreduce, skip_nonfinite

SERVERS = {"check": 2, "orphan": 1}
LOCAL = 2  # workers per node in the hierarchical case


def grads(rank: int, step: int, workers: int):
    rng = np.random.default_rng(100 * step + rank)
    return {
        "a": rng.normal(size=(5, 7)).astype(np.float32),
        "b": rng.normal(size=(3,)).astype(ml_dtypes.bfloat16),
        "c": rng.normal(size=(9,)).astype(np.float32),
    }


def half(rank: int, workers: int):
    return {"h": (np.arange(6) * (rank + 1) / 8).astype(ml_dtypes.bfloat16)}


def mean(fn, workers, *args):
    trees = [fn(r, *args, workers) for r in range(workers)]
    return jax.tree.map(lambda *xs: np.mean([np.asarray(x, np.float32) for x in xs], 0), *trees)


def check_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        tol = 1e-2 if g.dtype == ml_dtypes.bfloat16 else 1e-6
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=tol, atol=tol)


def run_worker(ps: ParameterServers, mode: str) -> None:
    coll = ps.workers
    w, rank = coll.size, coll._rank
    # In skip_nonfinite over the workers: its flag never reaches the servers.
    flat = bfb_allreduce(collective=coll, servers=ps, buffer_bytes=40)
    flat = skip_nonfinite(flat, collective=coll)
    step = jax.jit(lambda g: flat.update(g, flat.init(g)))
    for t in range(2):
        u, s = step(grads(rank, t, w))
        check_close(u, mean(grads, w, t))
        plan = plan_fusion(grads(rank, t, w), buffer_bytes=40, num_shards=ps.num_servers)
        # Each worker sends and receives every buffer once (padding included), plus the
        # non-finite flag's all-reduce among the workers (never sent to the servers).
        flag = all_reduce_bytes(4, w)[0]
        sent, received = wire_bytes(s, "step")
        assert int(sent) == int(received) == sum(plan.buffer_bytes) + flag
    if mode == "orphan":
        return  # no shutdown: the server must time out
    u, _ = jax.jit(lambda g: flat.update(g, flat.init(g)))(half(rank, w))
    assert u["h"].dtype == ml_dtypes.bfloat16
    check_close(u, mean(half, w))

    intra, inter = coll.split(LOCAL)
    # Layouts inconsistent with the communicator: clear errors, before any traffic.
    for bad, match in [
        (dict(collective=inter, servers=ps), "worker ranks"),
        (dict(collective=AxisCollective("w", w), servers=ps), "need MPI workers"),
    ]:
        try:
            bfb_allreduce(**bad)
        except ValueError as e:
            assert match in str(e), e
        else:
            raise AssertionError(f"no error for {bad}")
    hier = bfb_allreduce(collective=inter, intra=intra, servers=ps, buffer_bytes=40)
    hier = skip_nonfinite(hier, collective=(intra, inter))
    u, s = jax.jit(lambda g: hier.update(g, hier.init(g)))(grads(rank, 5, w))
    check_close(u, mean(grads, w, 5))
    plan = plan_fusion(grads(rank, 5, w), buffer_bytes=40, num_shards=LOCAL * ps.num_servers)
    expect = sum((LOCAL - 1) * b // LOCAL + b // LOCAL + (LOCAL - 1) * (b // LOCAL)
                 for b in plan.buffer_bytes)  # fmt: skip
    expect += all_reduce_bytes(4, LOCAL)[0] + all_reduce_bytes(4, inter.size)[0]  # the flag
    sent, received = wire_bytes(s, "step")
    assert int(sent) == int(received) == expect
    ps.shutdown()
    print("worker ok", flush=True)


def run_server(ps: ParameterServers, mode: str) -> None:
    try:
        stats = ps.serve(timeout=2 if mode == "orphan" else 120)
    except TimeoutError as e:
        print(f"server {ps.comm.Get_rank()}: {e}", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(3)
        os._exit(3)  # Abort may return before the process is killed
    w, s = ps.num_workers, ps.num_servers
    g = grads(0, 0, w)
    flat = plan_fusion(g, buffer_bytes=40, num_shards=s)
    halfp = plan_fusion(half(0, w), buffer_bytes=40, num_shards=s)
    hier = plan_fusion(g, buffer_bytes=40, num_shards=LOCAL * s)
    # One shard of every buffer from (and to) every worker, per step.
    expect = w * (2 * sum(flat.shard_bytes) + sum(halfp.shard_bytes) + sum(hier.shard_bytes))
    assert stats.steps == 4, stats
    assert stats.received == stats.sent == expect, (stats, expect)
    assert stats.buffers == 2 * flat.num_buffers + halfp.num_buffers + hier.num_buffers
    print("server ok", flush=True)


def main(mode: str) -> None:
    size = MPI.COMM_WORLD.Get_size()
    for bad in (0, size):  # no server, or no worker left
        try:
            ParameterServers(bad)
        except ValueError as e:
            assert "num_servers" in str(e), e
        else:
            raise AssertionError(f"ParameterServers({bad}) accepted with {size} ranks")
    ps = ParameterServers(SERVERS[mode])
    try:
        (run_server if ps.is_server else run_worker)(ps, mode)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


if __name__ == "__main__":
    main(sys.argv[1])
