"""benchmarks/sim_vs_jax_peer.py at tiny sizes: every system trains the same DiLoCo, so
after the first round the scanned shoal loop and the drjax program hold shoal's global
model to float32 rounding, on both models; bad options name themselves."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "sim_vs_jax_peer.py"
TINY = "--workers 2 --reps 1 --sync-every 2 --mlp-width 32 --lm-width 32 --lm-layers 1 --lm-heads 2"


def run(*args, timeout=600):
    # XLA's default flags, as the benchmark runs: not the tests' (tests/xla_flags.py).
    env = dict(os.environ, XLA_FLAGS="")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def test_every_system_trains_the_same_diloco():
    done = run(*TINY.split())
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if re.match(r"\| (MLP|GPT)", line)]
    assert [r.split("|")[2].strip() for r in rows] == ["2", "2"]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        seconds = [float(c) for c in cells[2:5]]
        assert all(s > 0 for s in seconds)
        scanned, drjax = (float(x) for x in cells[-1].split(","))
        # The same step, scanned: bit for bit here with XLA's defaults; under the tests' XLA
        # flags, which fuse the loop differently, rounding grew to 3.6e-5 through AdamW's
        # first steps (m / sqrt(v) of tiny gradients).
        assert 0.0 <= scanned < 1e-6
        assert 0.0 <= drjax < 1e-5  # averaged in another order: rounding
        # drjax / shoal is the ratio of the seconds printed (to their rounding).
        assert float(cells[5]) == pytest.approx(seconds[2] / seconds[0], rel=0.01, abs=0.01)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--models", "cnn"], "--models"),
        (["--workers", "1"], "--workers"),
        (["--reps", "0"], "--reps"),
    ],
)
def test_bad_options_name_themselves(args, message):
    done = run(*args, timeout=120)
    assert done.returncode == 2 and message in done.stderr
