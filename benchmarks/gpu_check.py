"""The GPU check: one prepared script for the GPU machine, in stages, within 8 minutes.

Usage::

    python3 benchmarks/gpu_check.py --out DIR [--stages env,kernels,...]
        [--budget STAGE=SECONDS ...] [--write-benchmarks]
    python3 benchmarks/gpu_check.py --rehearse --out DIR      # every stage, tiny, on the CPU
    python3 benchmarks/gpu_check.py --render DIR [DIR2 ...]   # results into BENCHMARKS.md

``make gpu-check`` runs the first form with the machine's own ``python3`` and
``--write-benchmarks``; BENCHMARKS.md ("## gpu") gives the exact command for the device
and the time limit to give it. It needs no venv, no install and no network: it puts the
repository's ``src/`` on the path, and the preflight names any package the machine lacks
(with the command that fetches its wheel to carry along).

The stages, each in a process of its own with its own time budget (`gpu.record.BUDGET_GPU`,
480 s in all; ``--budget`` changes one, for a second try):

1. ``env``: devices, memory, jax/jaxlib/CUDA versions, packages (`gpu.env`);
2. ``kernels``: every Pallas kernel against its jnp reference, bit for bit: the kernel
   tests under pytest on the device, and a size sweep up to 2**24 + 3 (`gpu.kernels`);
3. ``kernel_speed``: each kernel's time next to a device copy, 16M-256M values, and the
   jnp reference's; the target is 60% of the copy's bandwidth (`gpu.kernel_speed`);
4. ``simulator``: `sim_scale`'s algorithms at 25M and 125M parameters x 8, 16 (and 64)
   workers: ratios to local SGD and memory (`gpu.simulator`);
5. ``lm``: S-SGD+AdamW, DiLoCo and Streaming DiLoCo on the byte-level LM at 25M
   parameters (`gpu.lm`, `experiments/configs/gpu_lm.py`);
6. ``peer``: `sim_vs_jax_peer`'s DiLoCo (shoal, held once, scanned, in turn; drjax; the floor)
   at 25M parameters x 8 and 16 workers (`gpu.peer`; drjax travels as its wheel in
   ``.whl``).

Each stage writes ``DIR/<k>_<stage>.json`` after every row (`gpu.record`), so a stage that
crashes or overruns keeps what it finished; a stage past its budget is stopped and the
next one starts. The run also leaves ``DIR/log.txt`` (every stage's output) and
``DIR/report.md`` (the tables): eight files, the device tool's limit. Stages after
``env`` are not started when ``env`` finds no GPU. Programs compile into a persistent
cache (``--cache``, default ``/tmp/shoal-gpu-check-cache``), so a second try on the same
machine starts faster. Exit status 0 when every stage ran and passed.

``--rehearse`` runs the same stages and code paths at tiny sizes on the CPU (``make
test`` runs it, so this script cannot rot unnoticed), writing nothing but ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "src")]  # shoal, as the repository holds it (no install)

from gpu import env as env_stage  # noqa: E402  (benchmarks/ is this script's folder)
from gpu import report  # noqa: E402
from gpu.record import (  # noqa: E402
    BUDGET_GPU,
    BUDGET_REHEARSE,
    STAGES,
    Context,
    Record,
    load,
    stage_file,
)

TITLES = {
    "env": "Environment",
    "kernels": "Kernel correctness on the device",
    "kernel_speed": "Kernel speed against a device copy",
    "simulator": "The simulator at research scale",
    "lm": "A short language-model run",
    "peer": "Simulated DiLoCo against drjax",
}
MARGIN = 10  # seconds before its budget at which a stage stops starting new work
DEFAULT_CACHE = "/tmp/shoal-gpu-check-cache"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="folder for the stage files, log and report")
    p.add_argument("--rehearse", action="store_true", help="tiny sizes on the CPU")
    p.add_argument(
        "--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}"
    )
    p.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="STAGE=SECONDS",
        help="a stage's time budget (repeatable)",
    )
    p.add_argument(
        "--write-benchmarks",
        action="store_true",
        help="also write the report into BENCHMARKS.md's gpu block",
    )
    p.add_argument(
        "--render",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="write the results of earlier runs into BENCHMARKS.md, run nothing; a stage "
        "rerun in a later DIR (a second try) replaces the earlier one's",
    )
    p.add_argument(
        "--cells",
        help="the simulator stage's cells, SIZE:N,... (e.g. 25M:8,125M:8; default: all of "
        "gpu/simulator.py's CELLS_GPU), for a second try",
    )
    p.add_argument("--cache", default=DEFAULT_CACHE, help="JAX's compilation cache (GPU runs)")
    p.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)  # a child: one stage
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)  # the child's budget
    args = p.parse_args(argv)
    if args.render is None and args.out is None:
        p.error("--out DIR is required (or --render DIR)")
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        p.error(
            f"--stages: unknown stage(s) {', '.join(unknown) or '(none)'}; have {', '.join(STAGES)}"
        )
    args.stages = [s for s in STAGES if s in stages]
    for spec in args.cells.split(",") if args.cells else []:
        size, _, n = spec.strip().partition(":")
        if not (n.isdigit() and int(n) >= 2 and re.fullmatch(r"[\d.]+[kKmM]?", size)):
            p.error(f"--cells: {spec!r} is not SIZE:N (e.g. 125M:16, N >= 2)")
    budgets = dict(BUDGET_REHEARSE if args.rehearse else BUDGET_GPU)
    for spec in args.budget:
        name, _, seconds = spec.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if name not in STAGES or value <= 0:
            p.error(
                f"--budget {spec!r}: expected STAGE=SECONDS with STAGE one of "
                f"{', '.join(STAGES)} and SECONDS > 0"
            )
        budgets[name] = value
    args.budgets = budgets
    return args


# ------------------------------------------------------------------------- a child


def run_stage(args) -> int:
    """One stage in this process: its module's ``run(record, ctx)``."""
    module = importlib.import_module(f"gpu.{args.stage}")
    deadline = time.monotonic() + args.deadline
    record = Record(
        args.out,
        args.stage,
        TITLES[args.stage],
        module.COLUMNS,
        budget=args.budgets[args.stage],
        rehearse=args.rehearse,
        deadline=deadline,
    )
    record.save()
    ctx = Context(ROOT, args.rehearse, args.cells)
    try:
        ok = module.run(record, ctx)
    except Exception:
        record.note("crashed: " + traceback.format_exc(limit=8)[-1500:])
        record.set(status="crashed")
        traceback.print_exc()
        return 1
    record.finish(ok)
    return 0 if ok else 1


# ------------------------------------------------------------------------ the parent


class Log:
    """Lines to this process's stdout and to ``DIR/log.txt`` as they come."""

    def __init__(self, path: Path):
        self.file = path.open("a", buffering=1)

    def __call__(self, line: str) -> None:
        sys.stdout.write(line if line.endswith("\n") else line + "\n")
        sys.stdout.flush()
        self.file.write(line if line.endswith("\n") else line + "\n")


def child_env(args) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["SHOAL_GPU_CHECK_COMMAND"] = shlex.join(
        ["python3", "benchmarks/gpu_check.py", *sys.argv[1:]]
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    if args.rehearse:
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.pop("JAX_PLATFORMS", None)  # the Makefile's cpu must not hide the GPU
        env.setdefault("JAX_COMPILATION_CACHE_DIR", args.cache)
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
        # One stage at a time holds the GPU: let it have more than JAX's default 75%.
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    return env


def spawn(args, stage: str, budget: float, log: Log) -> tuple[int | None, float]:
    """Run one stage's child, which stops starting new work `MARGIN` seconds before its
    budget; stop it (its whole process group) at the budget. Returns (exit status, or
    None when stopped; seconds)."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--stage",
        stage,
        "--out",
        str(args.out),
        "--deadline",
        f"{max(budget - MARGIN, 1):.1f}",
        "--budget",
        f"{stage}={budget}",
    ]
    if args.rehearse:
        cmd.append("--rehearse")
    if args.cells:
        cmd += ["--cells", args.cells]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(args),
        start_new_session=True,
    )
    reader = threading.Thread(target=lambda: [log(f"  [{stage}] {line}") for line in proc.stdout])
    reader.start()
    try:
        code = proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    reader.join(timeout=10)
    return code, time.monotonic() - start


def settle(args, stage: str, code: int | None, seconds: float, budget: float) -> dict:
    """The stage's file after its child ended: a "running" left behind becomes "timeout"
    (stopped) or "crashed"; a child that wrote nothing gets a file saying so."""
    path = stage_file(args.out, stage)
    data = load(path) if path.exists() else None
    if data is None:
        record = Record(
            args.out, stage, TITLES[stage], [], budget=budget, rehearse=args.rehearse, deadline=0
        )
        record.note("the stage wrote nothing before it ended")
        data = record.data
    if data["status"] == "running":
        data["status"] = "timeout" if code is None else "crashed"
        data["notes"].append(
            f"stopped after {seconds:.0f} s (budget {budget:.0f} s)"
            if code is None
            else f"exited with status {code}"
        )
    data["seconds"] = round(seconds, 1)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.stage:
        return run_stage(args)
    if args.render:
        text = report.render(args.render)
        report.write_block(ROOT / "BENCHMARKS.md", text)
        print(text)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    for stage in STAGES:  # a folder reused for a second try keeps the stages not rerun
        if stage in args.stages:
            stage_file(args.out, stage).unlink(missing_ok=True)
    log = Log(args.out / "log.txt")
    missing = env_stage.missing_packages_quick()
    for name in missing:
        log(
            f"preflight: {name} is missing here; carry its wheel: "
            + env_stage.CARRY.format(name=name, version="VERSION")
        )
    ok = not missing
    for stage in args.stages:
        budget = args.budgets[stage]
        log(f"{stage}: starting, budget {budget:.0f} s")
        code, seconds = spawn(args, stage, budget, log)
        data = settle(args, stage, code, seconds, budget)
        log(f"{stage}: {data['status']} in {seconds:.0f} s")
        ok = ok and data["status"] == "ok"
        if stage == "env" and data["status"] != "ok":
            log(
                "env: not ok (no GPU, or a package missing): the other stages are not started; "
                "on a CPU, --rehearse runs them at tiny sizes"
            )
            break
    text = report.render([args.out])
    (args.out / "report.md").write_text(text)
    if args.write_benchmarks:
        report.write_block(ROOT / "BENCHMARKS.md", text)
    log(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
