"""Collectives over the present workers (`shoal.comms.presence`): the token-weighted mean,
sum, max and min over the present workers against NumPy, under vmap and inside
``shard_map``; the byte counts of the present workers' ring, exact past 2**32; all
present with unit weights is the plain collective bit for bit; what refuses churn."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shoal.comms import AxisCollective, RecordingCollective
from shoal.comms.presence import ChurnError, current, present
from shoal.comms.wire import all_gather_bytes, all_reduce_bytes

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="simulated workers, one process")

N = 4
COLL = AxisCollective("workers", N)
WEIGHTS = np.array([2.0, 0.0, 1.0, 3.0], np.float32)  # worker 1 absent
HERE = WEIGHTS > 0


def on_workers(fn, *args):
    return jax.jit(jax.vmap(fn, axis_name="workers"))(*args)


def oracle(x, op, weights=WEIGHTS):
    here = weights > 0
    rows = np.asarray(x, np.float64)[here]
    if op == "mean":
        w = weights[here].astype(np.float64).reshape(-1, *[1] * (rows.ndim - 1))
        return (w * rows).sum(0) / w.sum()
    return {"sum": rows.sum, "max": rows.max, "min": rows.min}[op](0)


@pytest.mark.parametrize("op", ["mean", "sum", "max", "min"])
def test_reductions_over_the_present_workers_match_numpy(op):
    x = np.random.default_rng(1).normal(size=(N, 3, 5)).astype(np.float32)
    x[1] = np.inf  # an absent worker's stale values never reach the result (0 * inf)

    def f(x):
        with present(COLL, jnp.asarray(WEIGHTS)):
            return COLL.all_reduce(x, op)

    out = np.asarray(on_workers(f, x))
    for w in range(N):  # every worker, present or not, holds the same result
        np.testing.assert_allclose(out[w], oracle(x, op), rtol=2e-7, atol=1e-7)


def test_integer_sum_and_max_count_the_present_workers_only():
    k = np.array([1, 100, 2, 4], np.int32)

    def f(k):
        with present(COLL, jnp.asarray(WEIGHTS)):
            return COLL.all_reduce(k, "sum"), COLL.all_reduce(k, "max")

    total, top = on_workers(f, k)
    assert np.asarray(total).tolist() == [7] * N and np.asarray(top).tolist() == [4] * N


def test_all_present_with_unit_weights_is_the_plain_all_reduce_bit_for_bit():
    x = np.random.default_rng(2).normal(size=(N, 257)).astype(np.float32)

    def churned(x):
        with present(COLL, jnp.ones(N)):
            return COLL.all_reduce(x)

    np.testing.assert_array_equal(on_workers(churned, x), on_workers(COLL.all_reduce, x))


def test_uniform_takes_the_first_present_workers_copy():
    weights = np.array([0.0, 0.0, 5.0, 1.0], np.float32)

    def f(x):
        with present(COLL, jnp.asarray(weights)):
            return COLL.uniform(x)

    assert np.asarray(on_workers(f, jnp.arange(4.0))).tolist() == [2.0] * N


@pytest.mark.parametrize("nbytes", [1000, 3 * 2**32 + 7])
def test_all_reduce_bytes_are_the_present_workers_ring(nbytes):
    def f(_):
        with present(COLL, jnp.asarray(WEIGHTS)):
            sent, received = all_reduce_bytes(nbytes, N)
            return sent, received

    sent, received = on_workers(f, jnp.zeros(N))
    ring = 2 * (3 - 1) * nbytes // 3  # 3 workers present
    assert sent.numpy().tolist() == [ring, 0, ring, ring]
    assert received.numpy().tolist() == sent.numpy().tolist()
    assert current() is None  # the block ended: static counts again
    assert all_reduce_bytes(nbytes, N) == (2 * 3 * nbytes // 4,) * 2


def test_one_present_worker_sends_nothing():
    def f(x):
        with present(COLL, jnp.asarray([0.0, 0.0, 1.0, 0.0])):
            return COLL.all_reduce(x), all_reduce_bytes(400, N)[0]

    mean, sent = on_workers(f, jnp.arange(4.0))
    assert np.asarray(mean).tolist() == [2.0] * N and sent.numpy().tolist() == [0] * N


@pytest.mark.parametrize(
    "call",
    [
        lambda x: COLL.all_gather(x),
        lambda x: COLL.broadcast(x, 0),
        lambda x: COLL.ppermute(x, [(0, 1), (1, 0)]),
        lambda x: COLL.all_to_all(jnp.stack([x] * N)),
        lambda x: COLL.reduce_scatter(jnp.stack([x] * N)),
        lambda x: all_gather_bytes(4, N),
    ],
    ids=["all_gather", "broadcast", "ppermute", "all_to_all", "reduce_scatter", "bytes"],
)
def test_collectives_that_would_hand_out_absent_values_refuse(call):
    def f(x):
        with present(COLL, jnp.asarray(WEIGHTS)):
            return call(x)

    with pytest.raises(ChurnError, match="under churn"):
        on_workers(f, jnp.arange(4.0))
    assert on_workers(call, jnp.arange(4.0)) is not None  # and work without churn


def test_present_names_its_mistakes():
    with pytest.raises(ValueError, match=r"--backend sim"):
        with present(RecordingCollective(N), jnp.ones(N)):
            pass
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        with present(COLL, jnp.ones(3)):
            pass

    def group_bytes(_):
        with present(COLL, jnp.ones(N)):
            return all_reduce_bytes(4, 2)[0]

    with pytest.raises(ChurnError, match="one collective of all 4 workers"):
        on_workers(group_bytes, jnp.zeros(N))


def test_inside_shard_map_the_same_as_numpy(tmp_path):
    job = Path(__file__).parent / "jobs" / "presence_mesh.py"
    out = tmp_path / "presence.npz"
    env = harness_env(4)
    proc = subprocess.run([sys.executable, str(job), str(out)], capture_output=True,
                          text=True, timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(out) as r:
        for op in ("mean", "sum", "max", "min"):
            for w in range(N):
                np.testing.assert_allclose(r[op][w], oracle(r["x"], op), rtol=2e-7, atol=1e-7)
        k = r["k"][HERE]
        assert (r["int_sum"] == k.sum(0)).all() and (r["int_max"] == k.max(0)).all()
        assert r["bytes"].tolist() == [2 * 2 * 1000 // 3, 0, 1333, 1333]


def harness_env(devices: int) -> dict[str, str]:
    import os

    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    return dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
