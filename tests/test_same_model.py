"""`shoal.optim.helpers.same_model_check`: every worker starts from worker 0's model, bit
for bit, or the check names the first worker that does not and its first differing leaf.
On 4 simulated workers and under mpiexec (rank-agnostic), on two tiers, under
``shard_map`` on 8 host devices (a job of its own), and in the runner."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import harness
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from harness import n_workers, run_two_tier, run_workers

from shoal.comms import AxisCollective
from shoal.comms.wire import all_reduce_bytes
from shoal.optim._same_model import leaf_checksum
from shoal.optim.helpers import check_same_model, same_model_check

N = n_workers()
ODD = min(2, N - 1)  # the worker that differs: 2 of 4 (1 under mpiexec -n 2)
JOBS = Path(__file__).parent / "jobs"


def model(workers=N):
    """Every worker's copy of one model, stacked: leaves of several dtypes."""
    rng = np.random.default_rng(0)
    one = {
        "dense": {
            "bias": rng.normal(size=(3,)).astype(np.float32),
            "kernel": rng.normal(size=(4, 3)).astype(np.float32),
        },
        "embed": rng.normal(size=(5, 2)).astype(ml_dtypes.bfloat16),
        "mask": rng.random(6) < 0.5,
        "step": np.int32(7),
    }
    return jax.tree.map(lambda a: np.broadcast_to(a, (workers, *np.shape(a))).copy(), one)


PATHS = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(model(1))]
KERNEL = PATHS.index("['dense']['kernel']")


def check(params):
    return run_workers(lambda c, p: same_model_check(p, c), params)


def found(out):
    """The (worker, leaf) every worker got: one answer, the same on all of them."""
    pairs = {(int(r.worker), int(r.leaf)) for r in out.values()}
    assert len(pairs) == 1, pairs
    return pairs.pop()


def ulp_up(x):
    return np.nextafter(x, np.float32(np.inf), dtype=np.float32)


@pytest.mark.mpi
def test_the_same_model_passes():
    out = check(model())
    assert found(out) == (-1, -1)
    for r in out.values():
        check_same_model(r, model(1))  # no error


@pytest.mark.mpi
def test_the_odd_worker_and_leaf_are_named():
    params = model()
    params["dense"]["kernel"][ODD, 1, 2] += 0.5
    out = check(params)
    assert found(out) == (ODD, KERNEL)
    for r in out.values():  # every worker (every process) raises alike
        with pytest.raises(ValueError) as e:
            check_same_model(r, model(1))
        assert str(e.value) == (
            f"worker {ODD} starts from a different model than worker 0: first differing "
            f"leaf ['dense']['kernel']"
        )


@pytest.mark.mpi
@pytest.mark.parametrize(
    "change",
    ["one_ulp", "negative_zero", "swap", "bfloat16_ulp", "one_bit_of_a_bool", "int_by_one"],
)
def test_a_change_of_one_value_is_caught(change):
    params = model()
    w = N - 1
    kernel = params["dense"]["kernel"]
    if change == "one_ulp":
        kernel[w, 0, 0] = ulp_up(kernel[w, 0, 0])
        leaf = KERNEL
    elif change == "negative_zero":  # equal as floats, not as bits
        params["dense"]["bias"][:, 1] = 0.0
        params["dense"]["bias"][w, 1] = -0.0
        leaf = PATHS.index("['dense']['bias']")
    elif change == "swap":  # the same values, elsewhere
        kernel[w, 0, [0, 1]] = kernel[w, 0, [1, 0]]
        leaf = KERNEL
    elif change == "bfloat16_ulp":
        params["embed"].view(np.uint16)[w, 4, 1] += 1  # the next bfloat16 away from 0
        leaf = PATHS.index("['embed']")
    elif change == "one_bit_of_a_bool":
        params["mask"][w, 5] = not params["mask"][w, 5]
        leaf = PATHS.index("['mask']")
    else:
        params["step"][w] += 1
        leaf = PATHS.index("['step']")
    assert found(check(params)) == (w, leaf)


@pytest.mark.mpi
def test_the_first_worker_then_its_first_leaf():
    if N < 3:
        pytest.skip("needs 3 workers")
    params = model()
    params["step"][N - 1] += 1  # the last worker: a later worker, an earlier leaf
    params["embed"][1, 0, 0] += 1
    params["step"][1] += 1
    assert found(check(params)) == (1, PATHS.index("['embed']"))


@pytest.mark.mpi
def test_worker_0_differing_names_worker_1():
    # Worker 0 is the reference: every other worker then differs from it.
    params = model()
    params["dense"]["bias"][0, 0] += 1
    assert found(check(params)) == (1, PATHS.index("['dense']['bias']"))


@pytest.mark.mpi
def test_bytes_are_two_ring_all_reduces():
    # 5 uint32 checksums, then one int32 key: 2 (P-1)/P of 20 bytes and of 4, each way.
    out = check(model())
    each_way = 2 * (N - 1) * 20 // N + 2 * (N - 1) * 4 // N
    assert all_reduce_bytes(20, N)[0] + all_reduce_bytes(4, N)[0] == each_way
    for r in out.values():
        assert int(r.wire.sent) == int(r.wire.received) == each_way


@pytest.mark.mpi
def test_two_tiers_name_the_worker_of_both_ranks():
    if N < 4:
        pytest.skip("needs 2 groups of 2")
    params = model()
    params["mask"][3, 0] = not params["mask"][3, 0]  # member 1 of group 1
    out = run_two_tier(lambda intra, inter, p: same_model_check(p, (intra, inter)), 2, params)
    assert found(out) == (3, PATHS.index("['mask']"))
    identical = run_two_tier(lambda i, o, p: same_model_check(p, (i, o)), 2, model())
    assert found(identical) == (-1, -1)


def np_checksum(a):
    """NumPy oracle of `leaf_checksum` in Python ints: the module docstring's sum."""
    a = np.ascontiguousarray(a)
    if a.dtype == bool:
        words = a.astype(np.uint32).reshape(-1)
    elif a.dtype.itemsize < 4:
        words = a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint16).astype(np.uint32)
    else:
        words = a.view(np.uint32)
    total = 0
    for i, w in enumerate(words.reshape(-1).tolist()):
        h = w ^ ((i * 0x9E3779B9) % 2**32)
        h ^= h >> 16
        h = (h * 0x85EBCA6B) % 2**32
        h ^= h >> 13
        h = (h * 0xC2B2AE35) % 2**32
        h ^= h >> 16
        total = (total + h) % 2**32
    return total


@pytest.mark.parametrize("leaf", PATHS)
def test_leaf_checksum_is_the_formula(leaf):
    a = dict(zip(PATHS, jax.tree.leaves(model(1))))[leaf][0]
    assert int(leaf_checksum(jnp.asarray(a))) == np_checksum(a)
    assert int(leaf_checksum(jnp.zeros((0, 3)))) == 0


def test_a_collective_is_required():
    with pytest.raises(TypeError, match="collective must be a shoal Collective"):
        same_model_check({"w": jnp.ones(2)}, "workers")
    with pytest.raises(ValueError, match="collective must be a Collective or a non-empty"):
        same_model_check({"w": jnp.ones(2)}, ())


def test_no_leaves_is_the_same_model():
    coll = AxisCollective("workers", 2)
    out = jax.vmap(lambda p: same_model_check(p, coll), axis_name="workers", axis_size=2)({})
    assert out.worker.tolist() == out.leaf.tolist() == [-1, -1]
    assert out.wire.sent.numpy().tolist() == [0, 0]
    check_same_model(out, {})


@pytest.mark.skipif(harness.UNDER_MPI, reason="one process, 8 host devices")
def test_under_shard_map(tmp_path):
    # tests/jobs/same_model.py: 4 workers of one device and of two (leaves sharded over
    # "fsdp"), and 2 x 2 tiers, with and without worker 2 differing in one shard.
    out = tmp_path / "same_model.npz"
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    proc = subprocess.run(
        [sys.executable, str(JOBS / "same_model.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with np.load(out) as f:
        got = dict(f)
    kernel = 1  # leaves: bias, kernel
    for layout in ("flat", "fsdp", "tiers"):
        np.testing.assert_array_equal(got[f"{layout}/same/worker"], -1)
        np.testing.assert_array_equal(got[f"{layout}/same/leaf"], -1)
        np.testing.assert_array_equal(got[f"{layout}/odd/worker"], 2)  # every device
        np.testing.assert_array_equal(got[f"{layout}/odd/leaf"], kernel)


@pytest.mark.skipif(harness.UNDER_MPI, reason="the runner's own workers")
def test_the_runner_refuses_workers_that_start_apart(monkeypatch):
    from shoal.experiments.overrides import apply_overrides, load_config
    from shoal.experiments.runner import backends
    from shoal.experiments.runner.train import train
    from shoal.experiments.tasks import GaussianMixtureTask

    workers, odd = 4, 3
    cfg = apply_overrides(
        load_config(harness.QUICKSTART), [f"workers={workers}", "steps=2", "diloco.sync_every=2"]
    )
    task = GaussianMixtureTask(cfg)
    leaf = jax.tree_util.keystr(jax.tree_util.tree_leaves_with_path(task.init_params())[0][0])

    # A simulated backend whose init broadcast does nothing and whose worker `odd` starts
    # one ulp off in the first leaf.
    @dataclasses.dataclass(frozen=True)
    class NoBroadcast(AxisCollective):
        def broadcast(self, tree, root=0):
            return tree

    class Backend(backends.SimBackend):
        def __init__(self, size):
            super().__init__(size)
            self.collective = NoBroadcast(backends.AXIS, size)

        def replicate(self, tree):
            def apart(a):
                a = np.array(super(Backend, self).replicate(a))
                a.reshape(workers, -1)[odd, 0] = ulp_up(a.reshape(workers, -1)[odd, 0])
                return a

            first, *rest = jax.tree.leaves(tree)
            return jax.tree.unflatten(
                jax.tree.structure(tree), [apart(first), *super().replicate(rest)]
            )

    for algorithm in ("diloco", "ssgd"):
        with pytest.raises(ValueError) as e:
            train(cfg, task, Backend(workers), algorithm, progress=False)
        assert str(e.value) == (
            f"{algorithm}: worker {odd} starts from a different model than worker 0: first "
            f"differing leaf {leaf}"
        )
    # The same backend with the broadcast: the workers start alike and it trains.
    assert train(cfg, task, backends.SimBackend(workers), "diloco", progress=False).finished
