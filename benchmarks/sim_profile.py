"""Benchmark: where a simulated step's time goes, op by op, next to local SGD's.

Usage: ``.venv/bin/python benchmarks/sim_profile.py [--size 512] [--workers 16]
[--algorithms ssgd,gtc,...] [--steps 10] [--top 6]`` (``make bench`` runs it with no
options; a smoke run: ``--size 32 --workers 4 --algorithms ssgd --steps 2``)

`sim_scale` says how much slower each algorithm's step is than local SGD's; this says
why. Each step is built as `sim_scale` builds it (the runner's step, non-finite check
included, jitted with its state donated, same model and batch), warmed up past
1-bit LAMB's ``freeze_step`` (so it is in its compression stage), then ``--steps``
consecutive steps run under ``jax.profiler``. XLA:CPU records one event per HLO
instruction it executes; an instruction's *self* time is its event's duration minus the
events nested in it on the same thread (a loop or a branch holds its body's). XLA runs
independent instructions on several threads at once, so the times add up to the step's
instruction time summed over threads, which can exceed its wall time. They are grouped
by what the instruction is (its name and opcode in the compiled HLO):

* matmul: ``dot`` and the matmul fusions (``ynn_fusion``);
* elementwise: loop fusions, the arithmetic of the updates and checks;
* copy, concatenate, scatter, gather, reduce: as named;
* control flow: the loops and branches themselves, outside their bodies;
* other: everything else.

Reported per group: ms per step, local SGD's and each algorithm's; then each algorithm's
largest instructions with their output shapes. A fresh buffer of the whole model is
paid for in page faults on its first write (glibc gives allocations over 32 MB fresh
pages every step), so a copy or a concatenation of the model costs several read passes.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
from sim_scale import CONFIG, Case, Program, Runner, compile_donated, fmt_params, n_params

from shoal.experiments.overrides import load_config
from shoal.experiments.runner import malloc

DEFAULT_ALGORITHMS = "ssgd,gtc,bmuf,onebit_lamb[freeze_step=10],bfb_allreduce"
WARMUP = 12  # steps before the profile: past onebit_lamb's freeze_step = 10
GROUPS = (
    "matmul",
    "elementwise",
    "copy",
    "concatenate",
    "scatter",
    "gather",
    "reduce",
    "control flow",
    "other",
)


def group_of(name: str, opcode: str) -> str:
    """The group of one HLO instruction, from its name and opcode."""
    if opcode in ("dot", "convolution") or name.startswith(("ynn_fusion", "xnn_fusion")):
        return "matmul"
    for group in ("copy", "concatenate", "scatter", "gather"):
        if opcode == group or group in name:
            return group
    if opcode in ("while", "conditional", "call"):
        return "control flow"
    if "reduce" in name or opcode == "reduce":
        return "reduce"
    if opcode == "fusion":
        return "elementwise"
    return "other"


def instructions(hlo_text: str) -> dict[str, tuple[str, str]]:
    """name -> (opcode, output shape) of every instruction in compiled HLO text."""
    out = {}
    # The output is an array shape (with its layout) or a tuple of them in parentheses.
    pattern = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\([^=]*?\)|[^\s(]+) ([\w\-]+)\(")
    for line in hlo_text.splitlines():
        m = pattern.match(line)
        if m:
            out[m.group(1)] = (m.group(3), re.sub(r"\{[^}]*\}", "", m.group(2)))
    return out


def self_times(events: list[dict]) -> dict[str, float]:
    """Microseconds of self time per HLO instruction: its events' durations minus those of
    the events nested in them on the same thread."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "hlo_op" in e.get("args", {}):
            by_thread[e["tid"]].append(e)
    total: dict[str, float] = collections.Counter()
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, self time]
        for e in evs:
            while stack and e["ts"] >= stack[-1][0]:
                _, name, own = stack.pop()
                total[name] += own
            if stack:
                stack[-1][2] -= e["dur"]
            stack.append([e["ts"] + e["dur"], e["args"]["hlo_op"], e["dur"]])
        for _, name, own in stack:
            total[name] += own
    return total


def profile(step, state, case: Case, steps: int) -> tuple[dict[str, float], Any]:
    """ms per step of self time per instruction, over ``steps`` steps after `WARMUP`, and
    the compiled step."""
    compiled, _ = compile_donated(step, *state, case.x, case.y)
    runner = Runner(compiled, state, case.x, case.y)
    runner.run(WARMUP)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            runner.run(steps)
        (trace,) = Path(d).glob("**/*.trace.json.gz")
        events = json.load(gzip.open(trace))["traceEvents"]
    return {k: v / 1e3 / steps for k, v in self_times(events).items()}, compiled


def main() -> None:
    malloc.reexec_with_tunables(default="keep")  # as sim_scale and shoal-run
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=512, help="MLP width (512: 1.05M params)")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--algorithms", default=DEFAULT_ALGORITHMS)
    parser.add_argument("--steps", type=int, default=10, help="profiled steps per algorithm")
    parser.add_argument("--top", type=int, default=6, help="largest instructions listed")
    args = parser.parse_args()
    if args.size < 8 or args.workers < 1 or args.steps < 1 or args.top < 0:
        parser.error("--size >= 8, --workers >= 1, --steps >= 1 and --top >= 0")
    start = time.perf_counter()
    cfg = load_config(CONFIG)
    # Huge pages instead of the kept heap for a large case, as shoal-run would take.
    malloc.restart_simulated(n_params(args.size) * args.workers, "sim_profile")
    case = Case(cfg, args.size, args.workers, argparse.Namespace(block=None, reps=None))

    runs = {"local SGD": profile(*case.build_baseline(), case, args.steps)}
    for entry in [a for a in args.algorithms.split(",") if a]:
        tx, step, group_size = case.build(Program(entry, entry))
        runs[entry] = profile(step, case.state(tx, group_size), case, args.steps)
        print(f"# {entry}: profiled", file=sys.stderr, flush=True)

    sums, shapes = {}, {}
    for label, (times, compiled) in runs.items():
        ops = shapes[label] = instructions(compiled.as_text())
        by_group = collections.Counter()
        for name, ms in times.items():
            by_group[group_of(name, ops.get(name, ("", ""))[0])] += ms
        sums[label] = by_group
    print(
        f"sim_profile: {fmt_params(args.size)} params ({n_params(args.size)}) x "
        f"{args.workers} simulated workers, self time of XLA:CPU's instructions summed over "
        f"its threads, ms per step over {args.steps} steps after {WARMUP} (steps as "
        f"`sim_scale` builds them); "
        f"{jax.devices()[0].platform}, jax {jax.__version__}, malloc: {malloc.describe()}; "
        f"{time.perf_counter() - start:.0f} s"
    )
    print("\n### Self time per step by kind of instruction, ms\n")
    labels = list(runs)
    print("| kind | " + " | ".join(labels) + " |")
    print("|---|" + "---:|" * len(labels))
    for group in GROUPS:
        if any(sums[lab][group] >= 0.05 for lab in labels):
            print(f"| {group} | " + " | ".join(f"{sums[lab][group]:.1f}" for lab in labels) + " |")
    print(
        "| **total** | " + " | ".join(f"**{sum(sums[lab].values()):.1f}**" for lab in labels) + " |"
    )

    print(f"\n### The {args.top} largest instructions of each step\n")
    print("| step | instruction | kind | output | ms/step |")
    print("|---|---|---|---|---:|")
    for label, (times, _) in runs.items():
        ops = shapes[label]
        for name, ms in sorted(times.items(), key=lambda kv: -kv[1])[: args.top]:
            opcode, shape = ops.get(name, ("?", "?"))
            print(f"| {label} | `{name}` | {group_of(name, opcode)} | `{shape}` | {ms:.1f} |")


if __name__ == "__main__":
    main()
