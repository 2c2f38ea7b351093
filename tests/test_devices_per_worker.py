"""``--backend jax --devices-per-worker K``: workers of K devices (a mesh ``("workers",
"fsdp")``, every leaf cut into K pieces, the batch split over the worker's devices) train
the quickstart as the simulated run of as many workers does: on 8 host CPU devices in 2
processes as 2 workers x 4 devices and 4 x 2, and on 6 devices in 2 processes as 3 x 2,
where the middle worker spans both processes.

Losses and test metrics are allclose to the simulation's (a worker's gradient is summed
over its devices in another order); so are GTC's while no device's buffer overflows its
capacity (as in these 12 steps); 1-bit LAMB's compressed stage, which compresses each
device's pieces with a scale of their own, only stays near it. Bytes are each device's
own, summed per worker: its pieces (the model, each leaf zero-padded to a multiple of K)
and its own headers (the 4-byte non-finite flag, GTC's count, 1-bit scales); checked
against those formulas.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import harness
import jax
import numpy as np
import pytest
from harness import QUICKSTART, mpiexec, read_jsonl

from shoal.comms import OneBit
from shoal.comms.wire import all_gather_bytes, all_reduce_bytes
from shoal.experiments.overrides import apply_overrides, load_file
from shoal.experiments.runner.cli import main
from shoal.experiments.tasks import make_task
from shoal.optim._gtc import resolve_capacity

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="these tests start their own MPI")

STEPS = 12
REQUIRED = ("ssgd", "gtc", "bmuf", "sma", "peer_averaging", "onebit_lamb")
ELEMENTWISE = ("ssgd", "bmuf", "sma", "peer_averaging")  # bytes: the model's pieces and the flag


def settings(names: tuple[str, ...], steps: int = STEPS, extra: tuple[str, ...] = ()) -> list[str]:
    return [f"steps={steps}", "eval_every=5", "algorithms=" + ",".join(names),
            "bmuf_gtc.group_size=2", "bmuf.block_size=4", "bmuf_gtc.block_size=4",
            "project_workers=0", *extra]  # fmt: skip


def jax_run(
    args: list[str], processes: int, devices: int = 8, timeout: int = 300
) -> subprocess.CompletedProcess:
    """``shoal-run --backend jax`` over ``processes`` processes sharing ``devices`` host
    devices (one process: no launcher)."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        # After the suite's own flags (conftest.py), which a later flag would not undo.
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
        f"--xla_force_host_platform_device_count={devices // processes}",
    )
    cmd = [sys.executable, "-m", "shoal.experiments.runner.cli", "--backend", "jax", *args]
    if processes > 1:
        exe = mpiexec()
        if exe is None:
            pytest.skip("mpiexec not found")
        cmd = [exe, "-n", str(processes), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def model_sizes(k: int) -> tuple[int, int]:
    """The quickstart model's element count, and with every leaf padded to a multiple of k."""
    params = make_task(load_file(str(QUICKSTART))).init_params()
    sizes = [math.prod(np.shape(a)) for a in jax.tree.leaves(params)]
    return sum(sizes), sum(-(-s // k) * k for s in sizes)


def by_algorithm(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(r["algorithm"], []).append(r)
    return out


def check_same_training(tmp_path, names, workers, k, processes, devices=8, steps=STEPS, extra=()):
    """The quickstart's ``names`` (``extra``: more ``--set`` values) on ``workers``
    simulated workers and on ``--backend jax --devices-per-worker k``: the same training,
    and each device's bytes. Returns the jax run's records by algorithm."""
    sim_out, jax_out = tmp_path / "sim", tmp_path / "jax"
    small = ["--no-progress", "--set", *settings(names, steps, extra)]
    assert main([str(QUICKSTART), "--workers", str(workers), *small, "--out", str(sim_out)]) == 0
    proc = jax_run([str(QUICKSTART), "--devices-per-worker", str(k), *small,
                    "--out", str(jax_out)], processes, devices)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    sim = by_algorithm(read_jsonl(sim_out / "metrics.jsonl"))
    dist = by_algorithm(read_jsonl(jax_out / "metrics.jsonl"))
    assert list(dist) == list(sim) == list(names)

    cfg = apply_overrides(load_file(str(QUICKSTART)), settings(names, steps, extra))
    freeze = cfg.params["onebit_lamb"].frozen_at(cfg.steps)
    n, padded = model_sizes(k)
    piece = padded // k  # one device's elements
    flag = all_reduce_bytes(4, workers)[0]  # each device's non-finite flag, every step
    for name in names:
        s, d = sim[name], dist[name]
        assert [r["step"] for r in d] == [r["step"] for r in s] == list(range(1, steps + 1))
        assert [r.get("skipped") for r in d] == [r.get("skipped") for r in s], name
        # 1-bit LAMB compresses each device's pieces on its own once its warm-up ends.
        same = [i for i in range(steps) if name != "onebit_lamb" or i < freeze]
        for key in ("loss", "test_loss", "test_accuracy"):
            got = [(i, d[i][key]) for i in same if key in s[i]]
            want = [(i, s[i][key]) for i in same if key in s[i]]
            assert [i for i, _ in got] == [i for i, _ in want], (name, key)
            np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-5,
                                       atol=1e-7, err_msg=f"{name} {key}")  # fmt: skip
        sent = np.array([r["bytes_sent"] for r in d], np.int64)
        assert [r["bytes_received"] for r in d] == sent.tolist(), name
        sim_sent = np.array([r["bytes_sent"] for r in s], np.int64)
        if name in ELEMENTWISE or name == "onebit_lamb":
            # Each device moves its pieces, as the simulated worker moved its model (an
            # all-reduce, a ppermute or nothing), and its own flag.
            part = slice(None) if name in ELEMENTWISE else slice(0, freeze)
            moves = {all_reduce_bytes(4 * n, workers)[0]: all_reduce_bytes(4 * piece, workers)[0],
                     4 * n: 4 * piece, 0: 0}  # fmt: skip
            expected = [k * (moves[b - flag] + flag) for b in sim_sent[part]]
            np.testing.assert_array_equal(sent[part], expected, err_msg=name)
        if name == "gtc":
            cap = resolve_capacity(cfg.params["gtc"].capacity, piece)  # words per device
            per_device = all_gather_bytes(4 * (cap + 1), workers)[0] + flag
            np.testing.assert_array_equal(sent, k * per_device)
            # The same elements sent, as a fraction of the padded pieces.
            density = [r["density"] * padded for r in d]
            np.testing.assert_allclose(density, [r["density"] * n for r in s], rtol=1e-6)
        if name == "onebit_lamb":
            per_device = OneBit().wire_bytes(piece, workers)[0] + flag
            np.testing.assert_array_equal(sent[freeze:], k * per_device)
            loss, sim_loss = (np.array([r["loss"] for r in x[freeze:]]) for x in (d, s))
            assert np.isfinite(loss).all()
            assert not np.allclose(loss, sim_loss, rtol=1e-5)  # really compressed per device
            np.testing.assert_allclose(loss, sim_loss, rtol=0.05)
    summary = (jax_out / "summary.md").read_text()
    assert "backend `jax`" in summary and f"{workers} workers" in summary
    assert f"mpiexec -n {processes} shoal-run" in summary
    assert f"--devices-per-worker {k}" in summary
    return dist


def test_two_workers_of_four_devices(tmp_path):
    # The last bias (10 elements) is padded to 12: pieces of 1731 elements.
    check_same_training(tmp_path, REQUIRED, workers=2, k=4, processes=2)


def test_four_workers_of_two_devices(tmp_path):
    # Two groups of two workers for BMUF_GTC: a mesh ("group", "member", "fsdp").
    check_same_training(tmp_path, (*REQUIRED, "bmuf_gtc"), workers=4, k=2, processes=2)


def test_a_worker_spans_processes(tmp_path):
    # 3 devices per process: worker 1 is device 2 of process 0 and device 0 of process 1.
    # Its NaN at step 3 reaches both: every worker skips that step, as in the simulation.
    dist = check_same_training(tmp_path, ("ssgd", "peer_averaging"), workers=3, k=2, processes=2,
                               devices=6, steps=6, extra=("inject_nonfinite=3:1",))  # fmt: skip
    for records in dist.values():
        assert [r.get("skipped") for r in records] == [None, None, 1, 1, 1, 1]


# (argv after the config, words the one error line must contain); 8 devices, one process.
ERRORS = {
    "does not divide the devices": (["--devices-per-worker", "3"], ["3", "divide", "8 devices"]),
    "batch does not split": (
        ["--devices-per-worker", "4", "--set", "batch_size=30", "algorithms=ssgd"],
        ["batch_size = 30", "--devices-per-worker 4"],
    ),
    "workers disagree": (
        ["--devices-per-worker", "4", "--workers", "8"],
        ["--workers 8", "2 workers", "--devices-per-worker 4"],
    ),
}


@pytest.mark.parametrize("case", ERRORS)
def test_devices_per_worker_errors(case):
    argv, words = ERRORS[case]
    proc = jax_run([str(QUICKSTART), "--no-progress", *argv], processes=1)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("shoal-run: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for word in words:
        assert word in errors[0], (word, errors[0])


def test_resume_with_other_devices_per_worker_is_refused(tmp_path):
    out = ["--out", str(tmp_path / "run"), "--no-progress"]
    first = jax_run([str(QUICKSTART), "--devices-per-worker", "4", *out, "--set",
                     "steps=4", "algorithms=ssgd", "--stop-after", "2"], processes=1)  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    again = jax_run([str(QUICKSTART), "--devices-per-worker", "2", *out, "--set", "steps=4",
                     "algorithms=ssgd", "--workers", "4", "--resume"], processes=1)  # fmt: skip
    assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-2000:]
    assert "Traceback" not in again.stderr, again.stderr[-2000:]
    assert "--devices-per-worker 4" in again.stderr  # what to resume with
