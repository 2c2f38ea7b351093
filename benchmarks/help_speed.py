"""Benchmark: ``shoal-run --help`` against ``python -c "import jax"``, wall time.

Usage: ``.venv/bin/python benchmarks/help_speed.py [--reps 5]``

Each command runs as a fresh process, the commands interleaved ``--reps`` times, so that
a change in the machine's load falls on all of them alike. ``shoal-run`` is the console
script next to this python (the venv's); help comes from its parser alone
(`shoal.experiments.runner.command`), so it must beat importing JAX. For scale, the same
help through ``python -m shoal.experiments.runner.cli``, which imports everything first
(the console script's entry point before).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


def wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    script = Path(sys.executable).parent / "shoal-run"
    if not script.is_file():
        sys.exit(f"no console script {script}: pip install -e . first")
    commands = {
        "`shoal-run --help`": [str(script), "--help"],
        '`python -c "import jax"`': [sys.executable, "-c", "import jax"],
        "`python -m shoal.experiments.runner.cli --help`": [
            sys.executable, "-m", "shoal.experiments.runner.cli", "--help",
        ],
    }  # fmt: skip
    for cmd in commands.values():  # once untimed: the files in the page cache for all
        wall(cmd)
    times: dict[str, list[float]] = {name: [] for name in commands}
    load = os.getloadavg()[0]
    for _ in range(args.reps):
        for name, cmd in commands.items():
            times[name].append(wall(cmd))
    medians = {name: statistics.median(t) for name, t in times.items()}
    help_s, jax_s = list(medians.values())[:2]
    print(f"help_speed: {args.reps} interleaved reps of each command, fresh processes; "
          f"{platform.machine()}, {os.cpu_count()} cores, python "
          f"{platform.python_version()}, load (1 min) {load:.2f} - "
          f"{os.getloadavg()[0]:.2f}")  # fmt: skip
    print()
    print("| command | median s | min s | max s | / import jax |")
    print("|---|---:|---:|---:|---:|")
    for name, t in times.items():
        print(f"| {name} | {medians[name]:.3f} | {min(t):.3f} | {max(t):.3f} | "
              f"{medians[name] / jax_s:.2f} |")  # fmt: skip
    print()
    print(f"shoal-run --help / import jax: {help_s / jax_s:.3f} (medians; target < 1)")


if __name__ == "__main__":
    main()
