"""``benchmarks/sim_profile.py``: self times from nested trace events (hand-computed
cases), the grouping of HLO instructions, and a smallest run whose table comes out whole.
Timings are not asserted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import harness
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "sim_profile.py"

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="runs its own simulated workers")


@pytest.fixture(scope="module")
def prof():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import sim_profile
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return sim_profile


def event(name, ts, dur, tid=1):
    return {"ph": "X", "tid": tid, "ts": ts, "dur": dur, "name": name, "args": {"hlo_op": name}}


def test_self_time_subtracts_nested_events_on_the_same_thread(prof):
    events = [
        event("while.1", 0, 100),  # holds a body of two instructions, 30 + 20
        event("fusion.2", 10, 30),
        event("copy.3", 50, 20),
        event("dot.4", 120, 5),  # after the loop: nested in nothing
        event("dot.5", 20, 40, tid=2),  # another thread: not nested in the loop
        {"ph": "X", "tid": 1, "ts": 0, "dur": 500, "name": "$python"},  # not an instruction
    ]
    assert prof.self_times(events) == {
        "while.1": 50,
        "fusion.2": 30,
        "copy.3": 20,
        "dot.4": 5,
        "dot.5": 40,
    }
    # Two nesting levels: the inner loop's own time excludes its body only.
    nested = [event("while.1", 0, 100), event("while.2", 10, 60), event("add.3", 20, 25)]
    assert prof.self_times(nested) == {"while.1": 40, "while.2": 35, "add.3": 25}


def test_instructions_are_grouped_by_opcode_and_name(prof):
    hlo = """
  %dot.3 = f32[16,512]{1,0} dot(%a, %b), lhs_contracting_dims={1}
  %ynn_fusion.8 = f32[16,32,512]{2,1,0} fusion(%x, %w), kind=kCustom
  %concatenate.77 = f32[16,1050624]{1,0} concatenate(%p, %q), dimensions={1}
  %wrapped_scatter.3 = f32[16,99]{1,0} fusion(%c), kind=kLoop
  %while.1 = (s32[], f32[4]{0}) while(%t), condition=%c, body=%b
  ROOT %add_fusion = f32[4]{0} fusion(%z), kind=kLoop
"""
    ops = prof.instructions(hlo)
    assert ops["dot.3"] == ("dot", "f32[16,512]")
    assert ops["concatenate.77"] == ("concatenate", "f32[16,1050624]")
    assert ops["add_fusion"] == ("fusion", "f32[4]")
    groups = {name: prof.group_of(name, op) for name, (op, _) in ops.items()}
    assert groups == {
        "dot.3": "matmul",
        "ynn_fusion.8": "matmul",
        "concatenate.77": "concatenate",
        "wrapped_scatter.3": "scatter",
        "while.1": "control flow",
        "add_fusion": "elementwise",
    }


def test_smallest_run_prints_every_step(tmp_path):
    args = "--size 32 --workers 4 --algorithms ssgd,bmuf --steps 2 --top 2".split()
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    header = next(line for line in out.splitlines() if line.startswith("| kind |"))
    assert header == "| kind | local SGD | ssgd | bmuf |"
    total = next(line for line in out.splitlines() if line.startswith("| **total**"))
    assert len(total.split("|")) == len(header.split("|"))
    listed = [line.split("|")[1].strip() for line in out.splitlines() if "| `" in line]
    assert listed == ["local SGD"] * 2 + ["ssgd"] * 2 + ["bmuf"] * 2
