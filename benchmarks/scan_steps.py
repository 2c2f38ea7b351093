"""Benchmark: ``shoal-run`` with ``scan_steps`` (a chunk of steps in one compiled program)
against one program per step, on simulated workers, MPI ranks and ``jax.distributed``
processes.

Each cell is DiLoCo (H = 10 inner steps of momentum SGD, outer Nesterov SGD) on the
quickstart's mixture task (or the kungfu config's CNN on glyph images), 4 workers, 400
steps (the CNN: 200) with an evaluation every half, run as
the CLI runs it: ``--backend sim`` in this process's interpreter, ``--backend mpi`` and
``--backend jax`` as ``mpiexec -n 4``. A run's time per step is read from its
``timing.jsonl``: from the end of the first half (after compiling) to the end, so compiles
and start-up are left out; both halves end with an evaluation either way. The two
settings run interleaved, ``--reps`` times each, and the table gives their medians and the
ratio (below 1: scanning is faster), at the quickstart's size (two hidden layers of 64),
at about 1M parameters (two of 1000), and for the CNN.

Run: ``.venv/bin/python benchmarks/scan_steps.py`` (about 25 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "experiments" / "configs"
WORKERS = 4
# Model -> (config, its --set, steps per run).
MODELS = {
    "quickstart MLP": ("quickstart", ["hidden=64,64"], 400),
    "wide MLP": ("quickstart", ["hidden=1000,1000"], 400),
    "CNN (kungfu)": ("kungfu", [], 200),
}


def mpiexec() -> str | None:
    venv = Path(sys.executable).parent / "mpiexec"
    return str(venv) if venv.exists() else shutil.which("mpiexec")


def parameters(model: str) -> int:
    """The model's parameter count."""
    from jax.flatten_util import ravel_pytree

    from shoal.experiments.overrides import apply_overrides, load_config
    from shoal.experiments.tasks import make_task

    config, sets, _ = MODELS[model]
    cfg = apply_overrides(load_config(str(CONFIGS / f"{config}.py")), sets)
    return ravel_pytree(make_task(cfg).init_params())[0].size


def one_run(backend: str, model: str, scan: int, out: Path) -> float:
    """Seconds per step of the second half of one ``shoal-run``."""
    config, extra, steps = MODELS[model]
    cli = [sys.executable, "-m", "shoal.experiments.runner.cli", str(CONFIGS / f"{config}.py")]
    sets = [f"steps={steps}", f"eval_every={steps // 2}", "algorithms=diloco",
            "project_workers=0", f"scan_steps={scan}", *extra]  # fmt: skip
    args = ["--workers", str(WORKERS), "--no-progress", "--overwrite", "--out", str(out),
            "--backend", backend, "--set", *sets]  # fmt: skip
    if backend != "sim":
        cli = [mpiexec(), "-n", str(WORKERS), *cli]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([*cli, *args], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"{backend} scan_steps={scan}: {proc.stderr[-2000:]}")
    times = {r["step"]: r["time_s"] for r in map(json.loads, (out / "timing.jsonl").open())}
    return (times[steps] - times[steps // 2]) / (steps - steps // 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scan", type=int, default=10, help="scan_steps to compare with 1")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated")
    parser.add_argument("--reps", type=int, default=3, help="runs per setting and cell")
    parser.add_argument("--backends", default="sim,mpi,jax")
    args = parser.parse_args()
    backends = args.backends.split(",")
    if mpiexec() is None:
        backends = [b for b in backends if b == "sim"]
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            for backend in backends:
                times: dict[int, list[float]] = {1: [], args.scan: []}
                for rep in range(args.reps):
                    order = (1, args.scan) if rep % 2 == 0 else (args.scan, 1)
                    for scan in order:
                        out = Path(tmp) / f"{backend}-{scan}"
                        times[scan].append(one_run(backend, model, scan, out))
                one, many = (statistics.median(times[k]) for k in (1, args.scan))
                ratios = sorted(m / o for m, o in zip(times[args.scan], times[1]))
                rows.append((model, backend, one, many, many / one, ratios[0], ratios[-1]))
                print(f"# {model} {backend}: {one * 1e3:.3f} vs {many * 1e3:.3f} ms/step",
                      file=sys.stderr, flush=True)  # fmt: skip
    steps = ", ".join(f"{m} {MODELS[m][2]}" for m in args.models.split(","))
    print(f"scan_steps: DiLoCo (H = 10), {WORKERS} workers, steps per run: {steps}; "
          f"medians of {args.reps} interleaved runs per setting\n")  # fmt: skip
    print(f"| model | backend | ms/step, scan_steps=1 | scan_steps={args.scan} | ratio | "
          "ratio range (run pairs) |")  # fmt: skip
    print("|---|---|---:|---:|---:|---|")
    counts = {model: parameters(model) for model in {r[0] for r in rows}}
    for name, backend, one, many, ratio, lo, hi in rows:
        model = f"{name} ({counts[name] / 1e6:.3g}M)"
        print(f"| {model} | {backend} | {one * 1e3:.3f} | {many * 1e3:.3f} | {ratio:.2f} | "
              f"{lo:.2f}-{hi:.2f} |")  # fmt: skip
    print(f"\ntotal {time.perf_counter() - start:.0f} s; mpi and jax: mpiexec -n {WORKERS} on "
          f"{os.cpu_count()} cores")  # fmt: skip


if __name__ == "__main__":
    main()
