"""``benchmarks/sim_scale.py`` runs: its smallest configuration, one rep, every kind of row
(plain, BMUF's block segments, 1-bit LAMB's two stages) and the grad_chunk comparison.
Timings are not asserted, only that the tables come out whole."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import harness
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "sim_scale.py"
# Width 32 (4224 parameters), 4 workers, one rep of one step; one algorithm of each kind;
# the cell run in two processes, as the targets' cells are.
SMALLEST = (
    "--sizes 32 --workers 4 --algorithms ssgd,bmuf,onebit_lamb --reps 1 --block 1 "
    "--repeat 32,4,2 --chunk-case 32,4,2,32"
).split()

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="runs its own simulated workers")


def test_registered_with_run_all():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import run_all
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert "sim_scale" in run_all.discover()
    assert run_all.command("sim_scale")[-1] == str(SCRIPT)


def table(text: str) -> dict[str, list[str]]:
    """The first markdown table in ``text``, its header left out: first cell -> the others."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|---"))
    rows = {}
    for line in lines[start + 1 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.split("|")[1:-1]]
        rows[cells[0]] = cells[1:]
    return rows


def test_smallest_configuration_runs():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *SMALLEST],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("sim_scale: 4-layer tanh MLP")
    assert "machine: " in out and "load average" in out
    col = "4.2k x 4"  # width 32: 4 * (32^2 + 32) = 4224 parameters
    ratios, memory = out.split("### Memory")
    rows = table(ratios)
    ratio = re.compile(r"\d+\.\d\d")
    for label, target in [
        ("ssgd", "1.2"),
        ("bmuf (block 10, amortised)", "1.1"),
        ("bmuf local steps only", "1.05"),
        ("onebit_lamb warmup stage", ""),
        ("onebit_lamb compression stage", "1.6"),
    ]:
        cells = rows[label]
        assert ratio.fullmatch(cells[0]), (label, cells)
        assert cells[1] == target, (label, cells)
    assert f"| algorithm | {col} | target (1M; N = 16, 64) |" in out
    assert float(rows["local SGD, ms/step (= 1.00)"][0]) > 0
    # Two runs: each ratio of the grid is the median (here the mean) of the runs' ratios.
    runs = table(out.split("### The repeated cells, run by run")[1])
    for label in ("ssgd", "bmuf (block 10, amortised)", "onebit_lamb compression stage"):
        each = [float(v) for v in runs[label][0].split(", ")]
        assert len(each) == 2, (label, runs[label])
        assert abs(float(rows[label][0]) - sum(each) / 2) <= 0.011, (label, rows[label], each)
    assert len(runs["local SGD, ms/step"][0].split(", ")) == 2
    # MB per worker: at least the 4224 float32 parameters of the model.
    memory = table(memory)
    assert set(memory) >= {"local SGD", "ssgd", "bmuf", "onebit_lamb compression stage"}
    assert all(float(cells[0]) >= 4224 * 4 / 1e6 for cells in memory.values())
    chunk = table(out.split("### grad_chunk")[1])
    assert list(chunk) == [f"{col}, 32"]
    k, *cells, diff = chunk[f"{col}, 32"]
    assert k == "2" and len(cells) == 4 and float(diff) < 1e-5, chunk
