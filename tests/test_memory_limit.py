"""Out of memory under an address-space limit (``ulimit -v``): ``shoal-run`` exits non-zero
with one line on stderr, ``shoal-run: error: out of memory: ...``, instead of hanging
forever in ``jax.device_get`` (`shoal.experiments.runner.memory` says why it hung)."""

import os
import subprocess
import sys

import jax
import pytest

from shoal.experiments.runner import memory

PREFIX = "shoal-run: error: out of memory"
# The reported case, scaled to this machine: 30000 simulated workers of quickstart's MLP
# (6922 parameters: 0.83 GB per float32 copy over the workers) and, above what a fresh
# JAX process maps, 2.6 GB of address space. Training starts (two copies: parameters and
# momentum) and the first step's outputs do not fit (about four copies). Measured on 2
# cores: it fails at 2.2 to 3.0 GB above the probe, and runs through at 4.
WORKERS = 30000
BUDGET = int(2.6e9)
HANG_S = 60  # the run itself takes ~5-10 s; it used to hang forever
# A fresh process like the runner's: JAX on CPU, its thread pools started.
PROBE = (
    "import jax, jax.numpy as jnp\n"
    "x = jnp.ones((1 << 20,)); jax.jit(lambda a: a @ a + a.sum())(x).block_until_ready()\n"
    "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmSize:')][0])\n"
)


def _env():
    env = {
        k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "SHOAL_MALLOC_REEXEC")
    }
    env.update(JAX_PLATFORMS="cpu", SHOAL_MALLOC="system")  # the reporter's malloc, no restart
    return env


# Sets the address-space limit, then becomes the command (no fork of the multithreaded
# test process with a preexec_fn).
LIMITED = (
    "import os, resource, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_AS, (n, n)); os.execv(sys.argv[2], sys.argv[2:])"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc: Linux")
def test_out_of_memory_under_ulimit_v_is_one_line_not_a_hang(tmp_path):
    probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                           timeout=120, env=_env(), check=True)  # fmt: skip
    limit = int(probe.stdout.strip()) * 1024 + BUDGET
    argv = [
        sys.executable, "-m", "shoal.experiments.runner.cli", "quickstart",
        "--workers", str(WORKERS),
        "--set", "batch_size=1", f"train_size={WORKERS}", "steps=2", "algorithms=ssgd",
        "--out", str(tmp_path / "out"), "--overwrite", "--no-progress",
    ]  # fmt: skip
    try:
        proc = subprocess.run([sys.executable, "-c", LIMITED, str(limit), *argv],
                              capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path,
                              env=_env())  # fmt: skip
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"shoal-run hung out of memory under ulimit -v {limit // 1024} (killed after "
                    f"{HANG_S} s); stderr: {e.stderr!r}")  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert len(lines) == 1 and lines[0].startswith(PREFIX), proc.stderr[-3000:]
    assert f"ulimit -v {limit // 1024} KiB" in lines[0] and f"{WORKERS} workers" in lines[0]


def test_messages(monkeypatch):
    monkeypatch.setattr(memory, "address_space_limit", lambda: 4_096_000_000)
    monkeypatch.setattr(memory, "address_space_used", lambda: 3_000_000_000)
    error = jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory allocating 491520000 bytes."
    )
    line = memory.oom_message(error, 30000 * 6922, 30000)
    assert line.startswith("out of memory: XLA could not allocate 0.49 GB")
    assert "ulimit -v 4000000 KiB" in line and "30000 workers x 6922 parameters" in line
    assert "\n" not in line
    assert memory.oom_message(jax.errors.JaxRuntimeError("INVALID_ARGUMENT: x")) is None
    assert memory.oom_message(ValueError("Out of memory")) is None
    assert memory.oom_message(MemoryError()).startswith("out of memory: MemoryError")
