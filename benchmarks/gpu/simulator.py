"""Stage 4, the simulator at research scale: `sim_scale`'s algorithms (every quickstart
entry, built as the runner builds it) at 25M and 125M parameters x 8 and 16 simulated
workers, and 64 where the device's memory allows, each step's time as a ratio to local
SGD's (no communication) timed interleaved with it, and its memory.

The cells run in one process, 16 workers first (``--cells`` picks some, for a second
try; `benchmarks/sim_scale.py` runs each in its own: on the CPU the allocator's state
carries over from one to the next; on the GPU XLA's allocator owns the device memory, and
a process start costs seconds of the budget).
Memory per row: XLA's accounting of the compiled donated step (`sim_scale.memory`:
arguments + outputs - aliased + temporaries) over the workers, and the device's peak so
far in this process (``memory_stats()["peak_bytes_in_use"]``, which never goes down: a
cell's figure is its own when it is the largest yet).

A cell whose estimated need (parameters x workers x 4 bytes x `COPIES`) exceeds the
device's memory is not run; a program that runs out of memory anyway gets a row saying
so, and the others go on.
"""

from __future__ import annotations

import gc
import time
from types import SimpleNamespace

import numpy as np

# (parameters, workers) in the order they run: N = 16 first (the CPU targets' N, with
# 64), then 8, then 64; the targets are sim_scale's, read at 1M parameters.
CELLS_GPU = [("25M", 16), ("125M", 16), ("25M", 8), ("125M", 8), ("25M", 64), ("125M", 64)]
CELLS_REHEARSE = [("4k", 4)]
# Model-sized buffers per worker held at once by a typical program and the baseline
# (params, momentum, an error-feedback or global copy, the gradients, and the baseline's
# params and momentum): an estimate, to leave out the cells that cannot fit at all rather
# than crash in every program; a larger program that runs out of memory gets its row.
COPIES = 6
TIMING_GPU = SimpleNamespace(block=5, reps=3)  # steps per timed block, interleaved reps
TIMING_REHEARSE = SimpleNamespace(block=1, reps=1)

COLUMNS = [
    ("cell", "params x N"),
    ("row", "algorithm"),
    ("ratio", "ratio to local SGD"),
    ("target", "target (CPU, 1M)"),
    ("ms", "local SGD ms/step"),
    ("mb_per_worker", "XLA MB/worker"),
    ("peak_gb", "device peak GB"),
    ("compile_s", "compile s"),
]


def run(record, ctx) -> bool:
    import jax
    import sim_scale  # benchmarks/ is on sys.path: gpu_check.py lives there

    record.set(device=ctx.device_name())
    base_cfg = sim_scale.load_config(sim_scale.CONFIG)
    names = [sim_scale.algorithms.parse_entry(e)[0] for e in base_cfg.algorithms]
    progs = sim_scale.programs(names, base_cfg)
    timing = TIMING_REHEARSE if ctx.rehearse else TIMING_GPU
    device = jax.devices()[0]
    limit = (device.memory_stats() or {}).get("bytes_limit")
    ok = True
    for size, n in cells(ctx):
        width = sim_scale.parse_size(size)
        params = sim_scale.n_params(width)
        cell = f"{params / 1e6:.1f}M x {n}" if params >= 1e6 else f"{params / 1e3:.0f}k x {n}"
        need = params * n * 4 * COPIES
        if limit and need > limit:
            record.note(
                f"{cell}: not run, about {need / 2**30:.0f} GiB needed "
                f"({COPIES} model copies per worker) of {limit / 2**30:.0f} GiB"
            )
            continue
        if record.left() < 30:
            record.note(f"{cell}: not run, out of time")
            continue
        ok = run_cell(record, sim_scale, base_cfg, progs, width, n, cell, timing, device) and ok
        gc.collect()
        jax.clear_caches()
    return ok


def summary(rows) -> str:
    judged = [r for r in rows if isinstance(r.get("target"), (int, float)) and r.get("ratio")]
    meets = sum(r["ratio"] <= r["target"] for r in judged)
    return f"{meets} of {len(judged)} rows within the CPU targets (ratio <= target)"


def cells(ctx) -> list[tuple[str, int]]:
    """The cells to run: ``--cells`` (``25M:8,125M:64``) or the default list."""
    if not ctx.cells:
        return CELLS_REHEARSE if ctx.rehearse else CELLS_GPU
    out = []
    for spec in ctx.cells.split(","):
        size, _, n = spec.strip().partition(":")
        out.append((size, int(n)))
    return out


def peak_gb(device) -> float:
    stats = device.memory_stats() or {}
    return round(stats.get("peak_bytes_in_use", 0) / 1e9, 2)


def run_cell(record, sim_scale, base_cfg, progs, width, n, cell, timing, device) -> bool:
    start = time.monotonic()
    case = sim_scale.Case(base_cfg, width, n, timing)
    case.start_baseline()
    mem = case.memory["local_sgd"]["peak"] / n / 1e6
    record.row(
        cell=cell,
        row="local SGD (baseline)",
        ratio=1.0,
        target="",
        ms=round(case.base_ms, 2),
        mb_per_worker=round(mem, 1),
        peak_gb=peak_gb(device),
        compile_s=round(case.compile_s["local_sgd"], 1),
    )
    ok = True
    for prog in progs:
        labels = sim_scale.row_labels(prog, case.cfg)
        per_step = (time.monotonic() - start) / max(1, len(case.results) + 1)
        if record.left() < max(10.0, 1.5 * per_step):
            record.note(f"{cell}: {prog.entry} and after not run, out of time")
            break
        try:
            case.measure(prog)
        except Exception as err:  # out of memory, or a failed check: a row, then go on
            ok = False
            for _, label in labels:
                record.row(
                    cell=cell,
                    row=label,
                    ratio=None,
                    target=sim_scale.TARGETS.get(_, ""),
                    ms=None,
                    mb_per_worker=None,
                    peak_gb=peak_gb(device),
                    compile_s=None,
                    error=f"{type(err).__name__}: {str(err)[:300]}",
                )
            continue
        for key, label in labels:
            ratio = case.results.get(key, float("nan"))
            memory = case.memory.get(key, {}).get("peak", float("nan")) / n / 1e6
            record.row(
                cell=cell,
                row=label,
                ratio=None if np.isnan(ratio) else round(float(ratio), 2),
                target=sim_scale.TARGETS.get(key, ""),
                ms=None,
                mb_per_worker=round(memory, 1),
                peak_gb=peak_gb(device),
                compile_s=round(case.compile_s.get(prog.entry, float("nan")), 1),
            )
    for note in case.notes:
        record.note(f"{cell}: {note}")
    try:
        case.base.check("local SGD")
    except AssertionError as err:
        ok = False
        record.note(f"{cell}: {err}")
    return ok
