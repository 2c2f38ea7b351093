"""benchmarks/sim_vs_jax_peer.py at tiny sizes: every system trains the same DiLoCo, so
after the first round shoal with its state held once, scanned or not, and the drjax
program hold shoal's global model to float32 rounding, on both models, and so does shoal
taking the local steps in turn; held once, shoal
carries as much state per worker as drjax; bad options name themselves."""

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
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    times, memory = cells[:2], cells[2:]  # the two tables, a row per model each
    assert [c[1] for c in times + memory] == ["2"] * 4
    for c in times:
        shoal, held, both, turn, drjax, floor = (float(x) for x in c[2:8])
        assert min(shoal, held, both, turn, drjax, floor) > 0
        # The ratios are those of the seconds printed (to their rounding).
        assert float(c[8]) == pytest.approx(drjax / both, rel=0.01, abs=0.01)
        assert float(c[9]) == pytest.approx(drjax / turn, rel=0.01, abs=0.01)
        assert float(c[11]) == pytest.approx(turn / floor, rel=0.01, abs=0.01)
    for c in memory:
        state_shoal, state_held, state_drjax = (float(x) for x in c[7:10])
        # Held once, the global model and outer momentum are one copy for the 2 workers,
        # as in drjax's layout: 5 model-sized copies per worker become 3 + 2/2.
        assert state_held < state_shoal and state_held == pytest.approx(state_drjax, rel=0.05)
        held, both, turn, drjax = (float(x) for x in c[-1].split(","))
        # Float32 rounding: XLA fuses the unbatched and the scanned programs otherwise,
        # and drjax averages in another order.
        assert 0.0 <= held < 1e-5 and 0.0 <= both < 1e-5 and 0.0 <= drjax < 1e-5
        # One worker's program rounds its gradients otherwise, and AdamW divides the
        # tiny LM's near-zero ones by sqrt(v) + 1e-8: up to 1.3e-5 here, about 1% of its step
        # (with SGD inside: 4e-9).
        assert 0.0 <= turn < 1e-4


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
