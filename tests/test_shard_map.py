"""Every transformation inside ``jax.shard_map`` with JAX's default checks gives the vmap
run's results: bit for bit where both engines do the same arithmetic, to float32
rounding where a mean is summed in another order (vmap: a dot over the gathered rows;
a mesh: XLA's all-reduce). Workers that span several devices (a mesh ``("workers",
"fsdp")``, leaves sharded over ``"fsdp"``) give the one-device-per-worker results.

The cases run in two jobs (tests/jobs/mesh_cases.py, sharded_workers.py) on 8 host
devices, which XLA must be told of before it starts, hence processes of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import harness
import numpy as np
import pytest

JOBS = Path(__file__).parent / "jobs"
sys.path.insert(0, str(JOBS))
import mesh_cases  # noqa: E402  (the case names; the jobs run in processes of their own)
import sharded_workers  # noqa: E402

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="one process, 8 host devices")

# Same arithmetic on both engines: permutations, gathers and element-wise updates.
EXACT = {"gtc", "gtc_nan", "peer_averaging", "sma", "bmuf_gtc", "bmuf_gtc_nan"}
# Two-tier GTC under the skip guard: the same arithmetic, but the two engines' compiled
# programs round an element 1 ulp apart (seen since the scan trainer and gtc's flat
# residual), so it is held to 1 ulp.
ATOL_ULP = {"gtc_skip_two_tier"}
# PowerSGD orthonormalises sums of products, which the engines reassociate: its error
# buffer's near-zero entries differ by ~1e-6 absolute.
ATOL = {"powersgd": 1e-5, "powersgd_nan": 1e-5}


def host_devices_env(count: int = 8) -> dict[str, str]:
    flags = os.environ.get("XLA_FLAGS", "")
    flags = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")


def run_job(job: str, tmp_path_factory) -> dict[str, np.ndarray]:
    out = tmp_path_factory.mktemp("mesh") / "cases.npz"
    proc = subprocess.run(
        [sys.executable, str(JOBS / job), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=host_devices_env(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with np.load(out) as f:
        return dict(f)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_job("mesh_cases.py", tmp_path_factory)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return run_job("sharded_workers.py", tmp_path_factory)


@pytest.mark.parametrize("case", [*mesh_cases.FLAT, *mesh_cases.TIERS])
def test_shard_map_matches_vmap(results, case):
    assert f"{case}/error" not in results, str(results[f"{case}/error"])
    vmap = sorted(k for k in results if k.startswith(f"{case}/vmap/"))
    assert vmap, f"no results for {case}"
    for key in vmap:
        a, b = results[key], results[key.replace("/vmap/", "/mesh/")]
        assert a.shape == b.shape and a.dtype == b.dtype, key
        if case in EXACT:
            np.testing.assert_array_equal(b, a, err_msg=key)
        elif case in ATOL_ULP:
            np.testing.assert_array_max_ulp(b, a, maxulp=1)
        else:
            np.testing.assert_allclose(b, a, rtol=2e-5, atol=ATOL.get(case, 1e-6), err_msg=key)


def test_nan_cases_skip_the_bad_step(results):
    # The NaN step is skipped on every worker (skip_nonfinite) and leaves nothing
    # non-finite behind; the params differ from the run without the NaN (a step really
    # was skipped).
    cases = [c for c in (*mesh_cases.FLAT, *mesh_cases.TIERS) if c.endswith("_nan")]
    assert len(cases) == 7
    for case in cases:
        leaves = [v for k, v in results.items() if k.startswith(f"{case}/mesh/")]
        for leaf in leaves:
            if np.issubdtype(leaf.dtype, np.floating):
                assert np.isfinite(leaf).all(), case
        clean = case.removesuffix("_nan")
        assert not np.array_equal(results[f"{case}/mesh/0"], results[f"{clean}/mesh/0"]), case


SHARDED_CASES = [c for c in sharded_workers.CASES if c not in ("onebit_lamb", "gtc_mixed")]


@pytest.mark.parametrize("layout", ["2x4", "4x2"])
@pytest.mark.parametrize("case", SHARDED_CASES)
def test_sharded_worker_matches_one_device_per_worker(sharded, case, layout):
    key = f"{case}/{layout}"
    assert f"{key}/error" not in sharded, str(sharded[f"{key}/error"])
    leaves = sorted(k for k in sharded if k.startswith(f"{key}/mesh/"))
    assert leaves, key
    for k in leaves:
        mesh, ref = sharded[k], sharded[k.replace("/mesh/", "/ref/")]
        assert np.isfinite(mesh).all(), k
        np.testing.assert_allclose(mesh, ref, rtol=2e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("layout", ["2x4", "4x2"])
def test_sharded_onebit_lamb_compresses_per_shard(sharded, layout):
    # Each device compresses its own shard (scales per shard), so the compressed stage is
    # not the one-device run's; its layer norms are the whole worker's, so every worker,
    # started alike, stays alike, and the run stays near the one-device one.
    key = f"onebit_lamb/{layout}"
    assert f"{key}/error" not in sharded, str(sharded[f"{key}/error"])
    for k in sorted(k for k in sharded if k.startswith(f"{key}/mesh/")):
        mesh, ref = sharded[k], sharded[k.replace("/mesh/", "/ref/")]
        assert np.isfinite(mesh).all(), k
        np.testing.assert_array_equal(mesh, np.broadcast_to(mesh[:1], mesh.shape), err_msg=k)
        assert not np.allclose(mesh, ref, rtol=1e-4, atol=1e-5), k  # really compressed
        np.testing.assert_allclose(mesh, ref, atol=0.15, err_msg=k)


@pytest.mark.parametrize("layout", ["2x4", "4x2"])
def test_fused_buffer_of_sharded_and_replicated_leaves_is_refused(sharded, layout):
    error = str(sharded[f"gtc_mixed/{layout}/error"])
    assert "ValueError: gtc fuses all leaves into one buffer" in error
    assert "[(), ('fsdp',)]" in error
