"""``--backend jax``: the quickstart on 4 ``jax.distributed`` processes (gloo on CPU, one
device each) gives the simulated run's metrics, and the two-tier mesh lays the workers
out as the simulation does."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import textwrap

import harness
import pytest
from harness import QUICKSTART, assert_same_run, mpiexec, read_jsonl

from shoal.experiments.runner.cli import main

# Each test starts its own jax.distributed job under mpiexec.
pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="these tests start their own MPI")

WORKERS = 4
STEPS = 12
# Sparse, two-tier and partial (S-SGD and the dense exchanges: test_devices_per_worker.py).
ALGORITHMS = ("gtc", "bmuf_gtc", "partial_exchange")
SMALL = ["--workers", str(WORKERS), "--no-progress", "--set", f"steps={STEPS}", "eval_every=5",
         "algorithms=" + ",".join(ALGORITHMS), "bmuf_gtc.group_size=2",
         "bmuf_gtc.block_size=4", "project_workers=0"]  # fmt: skip


def launch(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [exe, "-n", str(WORKERS), sys.executable, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_jax_backend_matches_sim(tmp_path):
    sim_out, jax_out = tmp_path / "sim", tmp_path / "jax"
    assert main([str(QUICKSTART), *SMALL, "--out", str(sim_out)]) == 0
    launch(["-m", "shoal.experiments.runner.cli", str(QUICKSTART), "--backend", "jax", *SMALL,
            "--out", str(jax_out)])  # fmt: skip
    sim, dist = read_jsonl(sim_out / "metrics.jsonl"), read_jsonl(jax_out / "metrics.jsonl")
    assert len(dist) == len(sim) == STEPS * len(ALGORITHMS)
    assert_same_run(dist, sim, len(ALGORITHMS))
    summary = (jax_out / "summary.md").read_text()
    assert "backend `jax`" in summary
    assert f"mpiexec -n {WORKERS} shoal-run" in summary


# Every process checks its own workers and prints OK; the root also checks the gathers.
LAYOUT = textwrap.dedent("""
    from pathlib import Path

    import numpy as np
    from shoal.experiments.runner.backends import make_backend

    b = make_backend("jax")
    assert b.size == 4 and b.local_ranks == (b.rank,), (b.size, b.local_ranks)
    intra, inter = b.two_tier(2)

    def ranks(w):
        return (w, intra.rank(), inter.rank(), intra.all_reduce(w, "sum"),
                inter.all_reduce(w, "sum"), intra.broadcast(inter.broadcast(w, 0), 0))

    w = np.arange(4.0)
    out = b.stacked(b.spmd(ranks, group_size=2)(b.local(w)))
    expect = (w, w % 2, w // 2, np.repeat([0 + 1, 2 + 3], 2), np.tile([0 + 2, 1 + 3], 2),
              np.zeros(4))
    for got, want in zip(out, expect):
        np.testing.assert_array_equal(got, want[list(b.local_ranks)])
    # A two-tier result feeds a flat spmd (its arrays move to the other mesh in place).
    grouped = b.spmd(lambda x: x * 2, group_size=2)(b.local(w))
    total = b.stacked(b.spmd(lambda x: b.collective.all_reduce(x, "sum"))(grouped))
    np.testing.assert_array_equal(total, [12.0])
    shift = lambda p: {"a": p["a"] + b.collective.rank()}
    params = b.spmd(shift)(b.replicate({"a": np.ones(3)}))
    mean = b.mean_params(params)
    gathered = b.gather(b.stacked(params))
    if b.is_root:
        np.testing.assert_allclose(mean["a"], np.full(3, 1 + 1.5))
        np.testing.assert_array_equal(gathered["a"], 1 + np.arange(4.0)[:, None].repeat(3, 1))
    else:
        assert mean is None and gathered is None
    assert b.share("root" if b.is_root else "other") == "root"
    # A file per rank: mpiexec may interleave the ranks' stdout within a line.
    Path(__file__).with_name(f"ok.{b.rank}").write_text("ok")
""")


def test_jax_backend_layout(tmp_path):
    script = tmp_path / "layout.py"
    script.write_text(LAYOUT)
    proc = launch([str(script)], timeout=120)
    done = sorted(p.name for p in tmp_path.glob("ok.*"))
    assert done == [f"ok.{r}" for r in range(WORKERS)], proc.stdout[-2000:] + proc.stderr[-2000:]


def coordinator_listens_on(*args: str) -> list[str]:
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    job = os.path.join(os.path.dirname(__file__), "jobs", "coordinator_bind.py")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([exe, "-n", "2", sys.executable, job, *args], capture_output=True,
                          text=True, timeout=120, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (line,) = [w for w in proc.stdout.splitlines() if w.startswith("coordinator ")]
    return line.split("listening ")[1].split(",")


def test_the_coordinator_listens_on_loopback_only_by_default():
    # Every process on one host: jax's default would listen on all interfaces ("::"),
    # unauthenticated, for the whole run.
    addresses = [ipaddress.ip_address(a) for a in coordinator_listens_on()]
    assert addresses and all((a.ipv4_mapped or a).is_loopback for a in addresses), addresses
    # What the user gives is what it binds (0.0.0.0: jax's own default, all interfaces).
    assert coordinator_listens_on("0.0.0.0") in (["0.0.0.0"], ["::"])


def test_the_coordinator_address_is_chosen_on_process_0():
    from shoal.experiments.runner.jax_backend import _coordinator_on_root

    address, bind = _coordinator_on_root(["a", "a"], None)
    assert address == bind and bind.startswith("127.0.0.1:")
    address, bind = _coordinator_on_root(["a", "a"], "0.0.0.0")
    assert bind.startswith("0.0.0.0:") and address.startswith("127.0.0.1:")
    # Processes on other hosts cannot reach process 0's loopback address.
    with pytest.raises(ValueError, match="--coordinator-bind-address"):
        _coordinator_on_root(["localhost", "elsewhere"], None)
    with pytest.raises(ValueError, match="cannot listen there"):
        _coordinator_on_root(["a", "a"], "192.0.2.1")  # TEST-NET-1: not this host's
