"""Benchmark: every quickstart algorithm's simulated step at research scale, relative to
local SGD without communication.

Usage: ``.venv/bin/python benchmarks/sim_scale.py [--sizes 160,512,1024] [--workers 8,16,64]
[--algorithms ssgd,gtc,...] [--reps R] [--block B] [--repeat W,N,R ...]
[--chunk-case W,N,K,B ...]``
(``make bench`` runs it with no options; a smoke run: ``--sizes 32 --workers 4 --reps 1
--block 1 --repeat off --chunk-case 32,4,2,32``)

The model is a 4-layer tanh MLP of width W (input W, three tanh hidden layers of W, W
logits; ``4 (W^2 + W)`` parameters: W = 160, 512, 1024 give 0.10M, 1.05M and 4.20M; the
issue's reference model is W = 512) with a softmax cross-entropy loss, on
``batch_size = 32`` examples per worker (quickstart's), a fixed random batch already on the
device, so the input pipeline is excluded. ``--sizes`` takes widths or parameter counts
(``1M``: the multiple of 32 closest to it).

For every (size, N) and every algorithm of `experiments/configs/quickstart.py` (with
``workers = N``), the step is built exactly as the runner builds it:
``algorithms.resolve(entry, cfg).build(comms, task=task)`` (the config's non-finite check
``skip_nonfinite`` included; two-tier ``bmuf_gtc`` gets ``backend.two_tier(group_size)``),
``SimBackend(N).spmd(make_step(task.loss, tx), group_size=...)``, then jitted once more
with the parameters and optimizer state donated. The baseline is the same model, batch and
``make_step`` with S-SGD's local optimizer alone (``cfg.params["ssgd"].local``, momentum
SGD: no communication at all), vmapped over the same N workers.

Timing: each algorithm is timed interleaved with the baseline (X B B X X B ...), each rep a
block of consecutive steps that carries the state (step counters advance) and waits for
the result; reported is the median ms per step of the algorithm over the median ms per step
of the baseline blocks interleaved with it. Algorithms whose cost depends on the step:

* ``bmuf`` and ``bmuf_gtc``: blocks of ``block_size`` (10) steps aligned with the BMUF
  steps (9 local steps, then the BMUF step; checked on the state's counters); the
  "amortised" row is the whole block per step, "local steps" the 9 local steps alone
  (timed as one segment of the block);
* ``onebit_lamb``: the warm-up stage (dense all-reduce, LAMB) with its ``freeze_step``
  moved past every timed step, and the compression stage with ``freeze_step = 10``,
  timed after an untimed warm-up beyond it (the stage of every timed step is checked on
  the state's counter);
* ``adaptive``: its starting stage, S-SGD with the noise-scale monitor (``ssgd_noise``);
  after the policy switches it runs ``partial_exchange`` at adaptive's ``fraction``.

GTC's decode costs what it sends (`shoal.kernels.gtc_reference`), so the report gives the
density (elements sent over elements) of the largest worker at the end of each timed block
for the algorithms that have one (``gtc``, ``bmuf_gtc``): on the fixed batch it rises over
the first ~20 steps, then falls.

After timing, every algorithm's state is checked: no step skipped by the non-finite check
(a skipped step is cheaper) and a finite loss. Memory: XLA's own accounting of the
compiled donated step (``memory_analysis()``): arguments + outputs - aliased (donated,
updated in place) + temporaries, divided by N.

The grad_chunk table compares the runner's S-SGD step with all workers' gradients at once
and with ``grad_chunk = K`` (`shoal.experiments.runner.train.compile_step`): memory, ms/step
(interleaved) and the largest difference of the parameters after the same steps. By
default at the reference model (1M x 64, 32 examples per worker), whose peak is the
update's (gradients and all-reduce buffers; the activations are small and dead by then),
and at 0.1M x 64 with 1024 examples per worker, whose peak is the activations'.

Each (size, N) runs in a process of its own (the script restarts itself with ``--case``):
a step's speed depends on what ran before it in the same process (XLA:CPU's and glibc's
memory, by up to 25% at 1M x 16 when the smaller cases ran first), and a researcher's run
has one configuration. The grad_chunk comparisons run in the parent.

The targets' cells (1.05M x 16 and x 64) run in three processes each (``--repeat``), and
each of their ratios is the median of the three runs': from one process to the next,
local SGD's own step moved by up to 10% (41.0, 41.4 and 37.9 ms at 1.05M x 16), and every
ratio with it, more than the interleaving within a process leaves. The report gives
every run's ratios too. The further runs come after the grid, and load their programs
from JAX's compilation cache (a temporary directory) instead of compiling them again.

By default the grid skips the combinations whose baseline alone would hold more than
``2e8`` parameters (4.2M x 64: ~1 GB per copy of the model, about 1.5 s per local step on
2 cores: too long for the default run); asking for one with ``--sizes``/``--workers`` runs
it. ``--reps``/``--block`` default by the speed of local SGD's step (`SPEED`), so that one
run of each cell stays near 17 minutes on a 2-core machine (the default run, with the
targets' cells three times, about 27): fewer reps and shorter blocks where a step is slow.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from run_all import cpu_model  # benchmarks/ is on sys.path when this runs as a script

from shoal.experiments import algorithms
from shoal.experiments.config import ConfigError
from shoal.experiments.overrides import apply_overrides, load_config
from shoal.experiments.runner import malloc
from shoal.experiments.runner.backends import SimBackend
from shoal.experiments.runner.train import compile_step, make_step
from shoal.optim import BMUFState, OneBitLambState

CONFIG = Path(__file__).resolve().parents[1] / "experiments" / "configs" / "quickstart.py"
LAYERS = 4
DEFAULT_SIZES = "160,512,1024"
DEFAULT_WORKERS = "8,16,64"
# The reference model, whose peak memory is the update's, and one whose activations dominate.
DEFAULT_CHUNK = ["512,64,8,32", "160,64,8,1024"]
# The cells the targets are read at (1.05M params x 16 and x 64), each run in 3 processes.
DEFAULT_REPEAT = ["512,16,3", "512,64,3"]
CHUNK_REPS = 2
MAX_DEFAULT = 2e8  # parameters x workers: larger combinations leave the default grid
COMPRESS_FREEZE = 10  # onebit_lamb's freeze step for the compression-stage program
# (local SGD's seconds per step below, steps per timed block, reps): fewer where slow.
SPEED = [(0.01, 10, 7), (0.04, 10, 5), (0.08, 5, 4), (0.25, 3, 5), (math.inf, 3, 3)]
# The targets at 1M parameters, 16 and 64 workers (ratio to local SGD).
TARGETS = {
    "ssgd": 1.2,
    "gtc": 1.6,
    "bmuf:amortised": 1.1,
    "bmuf:local": 1.05,
    "onebit_lamb:compression": 1.6,
    "bfb_allreduce": 1.3,
    "partial_exchange": 1.2,
    "peer_averaging": 1.2,
    "sma": 1.2,
}


class ScaleTask:
    """A 4-layer tanh MLP of width ``width`` on a fixed random batch: the interface the
    builders and `make_step` use (``loss``, ``init_params``, ``batch``)."""

    def __init__(self, width: int, batch_size: int, seed: int = 0):
        self.width, self.batch_size, self.seed = width, batch_size, seed

    def init_params(self) -> dict:
        rng = np.random.default_rng([self.seed, self.width])
        w = self.width
        return {
            f"layer{i}": {
                "w": jnp.asarray(rng.normal(scale=w**-0.5, size=(w, w)).astype(np.float32)),
                "b": jnp.zeros((w,), jnp.float32),
            }
            for i in range(LAYERS)
        }

    @staticmethod
    def loss(params, x, y):
        h = x
        for i in range(LAYERS):
            layer = params[f"layer{i}"]
            h = h @ layer["w"] + layer["b"]
            if i < LAYERS - 1:
                h = jnp.tanh(h)
        logp = jax.nn.log_softmax(h)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    def batch(self, step: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, step, n])
        x = rng.normal(size=(n, self.batch_size, self.width)).astype(np.float32)
        y = rng.integers(self.width, size=(n, self.batch_size)).astype(np.int32)
        return x, y


def n_params(width: int) -> int:
    return LAYERS * (width * width + width)


def parse_size(text: str) -> int:
    """A width (``512``) or a parameter count (``1M``, ``0.1M``, ``4e6``) -> a width."""
    text = text.strip()
    if re.fullmatch(r"\d+", text):
        return int(text)
    m = re.fullmatch(r"([\d.]+(?:e\d+)?)\s*([kKmM]?)", text)
    if not m:
        raise ValueError(f"bad size {text!r}: a width (512) or a parameter count (1M)")
    count = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6}[m.group(2).lower()]
    return max(32, 32 * round(math.sqrt(count / LAYERS) / 32))


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled step to time: ``entry`` as the runner builds it, with ``changes``.

    ``period`` > 0: blocks of ``period`` steps timed as two segments, ``period - 1`` local
    steps then the periodic (BMUF) step. ``stage``: "warmup"/"compression" for onebit_lamb.
    """

    algorithm: str
    entry: str
    period: int = 0
    stage: str = ""
    freeze: int = 0
    steps: int = 0  # > 0: the run's steps for this program (a field of the whole run)


def resolve(prog: Program, cfg) -> algorithms.Entry:
    """``prog``'s entry resolved as the runner would, with its own steps if it has them."""
    return algorithms.resolve(prog.entry, dataclasses.replace(cfg, steps=prog.steps or cfg.steps))


def programs(names: list[str], cfg) -> list[Program]:
    out = []
    for name in names:
        if name in ("bmuf", "bmuf_gtc"):
            out.append(Program(name, name, period=cfg.params[name].block_size))
        elif name == "onebit_lamb":
            never = 10**9  # past every timed step: the warm-up stage throughout
            entry = f"{name}[freeze_step={never}]"
            out.append(Program(name, entry, stage="warmup", freeze=never, steps=never + 1))
            entry = f"{name}[freeze_step={COMPRESS_FREEZE}]"
            out.append(Program(name, entry, stage="compression", freeze=COMPRESS_FREEZE))
        else:
            out.append(Program(name, name))
    return out


def row_labels(prog: Program, cfg) -> list[tuple[str, str]]:
    """(key, label) of the table rows one program fills."""
    if prog.period:
        return [
            (f"{prog.algorithm}:amortised", f"{prog.algorithm} (block {prog.period}, amortised)"),
            (f"{prog.algorithm}:local", f"{prog.algorithm} local steps only"),
        ]
    if prog.stage:
        return [(f"{prog.algorithm}:{prog.stage}", f"{prog.algorithm} {prog.stage} stage")]
    if prog.algorithm == "adaptive":
        return [("adaptive", f"adaptive ({cfg.params['adaptive'].sync} sync stage: ssgd_noise)")]
    if prog.algorithm == "bfb_allreduce":
        return [("bfb_allreduce", "bfb_allreduce (colocated)")]
    return [(prog.algorithm, prog.algorithm)]


def memory(compiled) -> dict[str, int]:
    m = compiled.memory_analysis()
    sizes = {
        "arguments": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "aliased": m.alias_size_in_bytes,
        "temporaries": m.temp_size_in_bytes,
    }
    sizes["peak"] = sizes["arguments"] + sizes["outputs"] - sizes["aliased"] + sizes["temporaries"]
    return sizes


def fresh(tree: Any) -> Any:
    """Copies with buffers of their own: donated inputs must not share a buffer."""
    return jax.tree.map(lambda a: jnp.array(a, copy=True), tree)


def find(tree: Any, kind: type) -> list:
    return [
        s
        for s in jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, kind))
        if isinstance(s, kind)
    ]


class Runner:
    """One compiled donated step and its carried state."""

    def __init__(self, step, state, x, y):
        self.step, self.state, self.x, self.y = step, state, x, y
        self.metrics = None
        self.steps = 0

    def run(self, n: int) -> float:
        """``n`` consecutive steps; seconds until the state is ready."""
        params, opt_state = self.state
        start = time.perf_counter()
        for _ in range(n):
            params, opt_state, self.metrics = self.step(params, opt_state, self.x, self.y)
        jax.block_until_ready((params, opt_state))
        seconds = time.perf_counter() - start
        self.state = (params, opt_state)
        self.steps += n
        return seconds

    def check(self, label: str) -> None:
        loss, figures = np.asarray(self.metrics[0]), self.metrics[-1]
        skipped = np.asarray(figures.get("skipped", 0))
        if skipped.max() > 0:
            raise AssertionError(f"{label}: {skipped.max()} steps skipped (non-finite check)")
        if not np.isfinite(loss).all():
            raise AssertionError(f"{label}: non-finite loss {loss}")


def compile_donated(fn, *args):
    start = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(*args).compile()
    return compiled, time.perf_counter() - start


class Case:
    """One (width, N): the baseline, then each program interleaved with it."""

    def __init__(self, base_cfg, width: int, n: int, args, batch: int | None = None):
        self.width, self.n, self.args = width, n, args
        sets = [f"workers={n}"]
        if batch is not None:  # a training set big enough for the config's check
            sets = [f"train_size={max(base_cfg.train_size, n * batch)}", *sets]
            sets.append(f"batch_size={batch}")
        self.cfg = apply_overrides(base_cfg, sets)
        self.task = ScaleTask(width, self.cfg.batch_size)
        self.backend = SimBackend(n)
        self.params0 = self.task.init_params()
        x, y = self.task.batch(0, n)
        self.x, self.y = jax.device_put(x), jax.device_put(y)
        self.results: dict[str, float] = {}  # row key -> ratio
        self.memory: dict[str, dict[str, int]] = {}  # row key -> memory()
        self.notes: list[str] = []
        self.compile_s: dict[str, float] = {}
        # Row key -> the largest worker's density (elements sent / elements, GTC's) after
        # each timed block: GTC's decode costs what it sends, not its capacity.
        self.density: dict[str, list[float]] = {}
        self.malloc = malloc.describe()

    def state(self, tx, group_size=None):
        params = self.backend.replicate(self.params0)
        opt_state = self.backend.init_state(tx.init, params, group_size)
        return fresh((params, opt_state))

    def build_baseline(self):
        """Local SGD's step (no communication: S-SGD's local optimizer alone) and its fresh
        state, as `build` does for an algorithm."""
        tx = self.cfg.params["ssgd"].local.make()
        return self.backend.spmd(make_step(self.task.loss, tx)), self.state(tx)

    def start_baseline(self) -> None:
        step, state = self.build_baseline()
        compiled, self.compile_s["local_sgd"] = compile_donated(step, *state, self.x, self.y)
        self.memory["local_sgd"] = memory(compiled)
        self.base = Runner(compiled, state, self.x, self.y)
        self.base.run(1)
        # Per-step time decides the default block and reps.
        t = min(self.base.run(3) / 3 for _ in range(2))
        self.base_ms = t * 1e3
        block, reps = next((b, r) for limit, b, r in SPEED if t < limit)
        self.block = self.args.block or block
        self.reps = self.args.reps or reps
        self.base_times: list[float] = []

    def build(self, prog: Program):
        cfg = self.cfg
        entry = resolve(prog, cfg)
        group_size = entry.group_size
        if group_size is None:
            comms = self.backend.collective
        else:
            comms = self.backend.two_tier(group_size)
        tx = entry.build(comms, task=self.task)
        step = self.backend.spmd(make_step(self.task.loss, tx), group_size=group_size)
        return tx, step, group_size

    def measure(self, prog: Program) -> None:
        labels = row_labels(prog, self.cfg)
        try:
            resolve(prog, self.cfg)
        except ConfigError as err:
            for key, _ in labels:
                self.results[key] = float("nan")
            self.notes.append(f"{prog.algorithm}: not run ({err})")
            return
        tx, step, group_size = self.build(prog)
        state = self.state(tx, group_size)
        compiled, self.compile_s[prog.entry] = compile_donated(step, *state, self.x, self.y)
        mem = memory(compiled)
        for key, _ in labels:
            self.memory[key] = mem
        runner = Runner(compiled, state, self.x, self.y)
        base = self.base

        def with_density(seconds: float) -> float:
            density = np.asarray(runner.metrics[-1].get("density", np.nan))
            if np.isfinite(density).all():
                self.density.setdefault(labels[0][0], []).append(float(density.max()))
            return seconds

        if prog.period:
            # Untimed: one block, checking that its last step (only) is the BMUF step.
            for k in range(prog.period):
                before = int(np.asarray(find(runner.state[1], BMUFState)[0].block).flat[0])
                runner.run(1)
                after = int(np.asarray(find(runner.state[1], BMUFState)[0].block).flat[0])
                if (after - before) != (k == prog.period - 1):
                    raise AssertionError(f"{prog.entry}: step {k + 1} of a block: BMUF steps "
                                         f"{before} -> {after}")  # fmt: skip
            local, whole, b_times = [], [], []
            for rep in range(self.reps):
                order = (0, 1) if rep % 2 == 0 else (1, 0)
                for who in order:
                    if who == 0:
                        t_local = with_density(runner.run(prog.period - 1))
                        t_sync = with_density(runner.run(1))
                        local.append(t_local / (prog.period - 1))
                        whole.append((t_local + t_sync) / prog.period)
                    else:
                        b_times.append(base.run(prog.period) / prog.period)
            blocks = runner.steps // prog.period
            done = int(np.asarray(find(runner.state[1], BMUFState)[0].block).flat[0])
            if runner.steps % prog.period or done != blocks:
                raise AssertionError(f"{prog.entry}: {done} BMUF steps after {runner.steps} steps")
            b = np.median(b_times)
            self.results[labels[0][0]] = np.median(whole) / b
            self.results[labels[1][0]] = np.median(local) / b
        else:
            block = self.block
            # Untimed: the first steps (and 1-bit LAMB's warm-up before its compression).
            runner.run(max(block, prog.freeze + 1) if prog.stage == "compression" else block)
            if prog.stage:
                count = int(np.asarray(find(runner.state[1], OneBitLambState)[0].count)[0])
                compressing = count >= prog.freeze  # the next step is past the freeze
                if compressing != (prog.stage == "compression"):
                    raise AssertionError(f"{prog.entry}: count {count} before timing")
            times, b_times = [], []
            for rep in range(self.reps):
                order = (0, 1) if rep % 2 == 0 else (1, 0)
                for who in order:
                    if who == 0:
                        times.append(with_density(runner.run(block)) / block)
                    else:
                        b_times.append(base.run(block) / block)
            if prog.stage == "warmup":
                count = int(np.asarray(find(runner.state[1], OneBitLambState)[0].count)[0])
                if count > prog.freeze:
                    raise AssertionError(f"{prog.entry}: count {count} after timing")
            self.results[labels[0][0]] = np.median(times) / np.median(b_times)
        runner.check(prog.entry)
        self.base_times += b_times

    def chunk(self, k: int, reps: int) -> dict[str, Any]:
        """The runner's S-SGD step, all workers' gradients at once vs ``k`` at a time."""
        cfg, backend = self.cfg, self.backend
        ssgd = algorithms.resolve("ssgd", cfg)
        tx = ssgd.build(backend.collective, task=self.task)
        out: dict[str, Any] = {"k": k, "case": self}
        runners = []
        for chunk in (0, k):
            step = compile_step(backend, self.task.loss, tx, grad_chunk=chunk)
            state = self.state(tx)
            compiled, _ = compile_donated(step, *state, self.x, self.y)
            out[chunk] = {"memory": memory(compiled), "times": []}
            runners.append(Runner(compiled, state, self.x, self.y))
        steps = out["steps"] = 3
        for r in runners:
            r.run(steps)  # untimed, and the same steps on both for the comparison
        a, b = (jax.tree.leaves(r.state[0]) for r in runners)
        out["max_diff"] = max(float(jnp.max(jnp.abs(u - v))) for u, v in zip(a, b))
        for rep in range(reps):
            order = (0, 1) if rep % 2 == 0 else (1, 0)
            for i in order:
                out[(0, k)[i]]["times"].append(runners[i].run(steps) / steps * 1e3)
        for r in runners:
            r.check("ssgd grad_chunk")
        return out


def fmt_mb(nbytes: float) -> str:
    mb = nbytes / 1e6
    return f"{mb:.1f}" if mb >= 10 else f"{mb:.2f}"


def fmt_params(width: int) -> str:
    count = n_params(width)
    return f"{count / 1e6:.2f}M" if count >= 1e5 else f"{count / 1e3:.1f}k"


def chunk_specs(parser, specs: list[str]) -> list[tuple[int, int, int, int]]:
    """``--chunk-case`` values as (W, N, K, B); a malformed one is a usage error."""
    out = []
    for spec in specs:
        try:
            w, n, k, batch = (int(v) for v in spec.split(","))
        except ValueError:
            parser.error(f"--chunk-case {spec!r}: expected W,N,K,B (four ints) or 'off'")
        if min(w, n, k, batch) < 1 or n % k:
            parser.error(f"--chunk-case {spec!r}: K = {k} must divide N = {n} (all >= 1)")
        out.append((w, n, k, batch))
    return out


def main() -> None:
    malloc.reexec_with_tunables(default="keep")  # as shoal-run for simulated workers
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", help=f"widths or parameter counts (default {DEFAULT_SIZES})")
    parser.add_argument("--workers", help=f"comma-separated N (default {DEFAULT_WORKERS})")
    parser.add_argument(
        "--algorithms", help="comma-separated quickstart algorithms (default: all of them)"
    )
    parser.add_argument("--reps", type=int, help="timed reps per algorithm (default: by speed)")
    parser.add_argument(
        "--block", type=int, help="steps per timed rep (default: by speed, see SPEED)"
    )
    parser.add_argument(
        "--repeat",
        action="append",
        metavar="W,N,R",
        help="run the cell of width W and N workers in R processes and report the median of "
        "their ratios (repeatable; 'off': every cell once; default: 512,16,3 and 512,64,3, "
        "the targets' cells, where the grid has them)",
    )
    parser.add_argument("--case", help=argparse.SUPPRESS)  # W,N: one case, in this process
    parser.add_argument("--json", help=argparse.SUPPRESS)  # where --case writes its results
    parser.add_argument(
        "--chunk-case",
        action="append",
        metavar="W,N,K,B",
        help="compare grad_chunk=K with 0 at width W, N workers, B examples per worker "
        "(repeatable; 'off': none; default: 512,64,8,32 and 160,64,8,1024 for the default "
        "grid, else the largest case measured with K = N/8)",
    )
    args = parser.parse_args()
    if (args.reps is not None and args.reps < 1) or (args.block is not None and args.block < 1):
        parser.error("--reps and --block must be >= 1")

    base_cfg = load_config(CONFIG)
    names = list(algorithms.parse_entry(e)[0] for e in base_cfg.algorithms)
    if args.algorithms:
        wanted = [a.strip() for a in args.algorithms.split(",") if a.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            parser.error(f"unknown algorithm(s) {', '.join(unknown)}; have {', '.join(names)}")
        names = [n for n in names if n in wanted]
    try:
        widths = [parse_size(s) for s in (args.sizes or DEFAULT_SIZES).split(",") if s.strip()]
        workers = [int(s) for s in (args.workers or DEFAULT_WORKERS).split(",") if s.strip()]
    except ValueError as err:
        parser.error(str(err))
    if not widths or not workers or min(workers) < 2:
        parser.error("--sizes and --workers must list sizes and N >= 2")
    explicit = args.sizes is not None or args.workers is not None
    grid, skipped = [], []
    for w in widths:
        for n in workers:
            if not explicit and n_params(w) * n > MAX_DEFAULT:
                skipped.append(
                    f"{fmt_params(w)} x {n}: left out of the default grid (the model alone is "
                    f"{n_params(w) * n * 4 / 1e9:.1f} GB over the workers, per copy; too slow "
                    f"for the default run): ask for it with --sizes {w} --workers {n}"
                )
            else:
                grid.append((w, n))

    if args.chunk_case is not None:
        chunk_cases = [] if args.chunk_case == ["off"] else args.chunk_case
    elif not explicit:
        chunk_cases = DEFAULT_CHUNK
    else:  # the largest case measured, at its batch
        w, n = max(grid, key=lambda c: n_params(c[0]) * c[1])
        chunk_cases = [f"{w},{n},{max(1, n // 8)},{base_cfg.batch_size}"]
    chunk_specs(parser, chunk_cases)  # bad specs fail before the long run, not after it
    if args.repeat is not None:
        repeats = repeat_specs(parser, [] if args.repeat == ["off"] else args.repeat)
        missing = sorted(set(repeats) - set(grid))
        if missing:
            w, n = missing[0]
            parser.error(f"--repeat {w},{n},...: that cell is not in the grid measured")
    else:
        default = repeat_specs(parser, DEFAULT_REPEAT)
        repeats = {cell: r for cell, r in default.items() if cell in grid}

    progs = programs(names, base_cfg)
    if args.case:  # one case, in this process, for the parent below
        w, n = (int(v) for v in args.case.split(","))
        Path(args.json).write_text(json.dumps(run_case(base_cfg, w, n, args, progs)))
        return

    load_start = os.getloadavg()
    wall_start = time.perf_counter()
    # The repeated cells' further runs come after the grid, spread out in time rather than
    # back to back; the compilation cache spares them recompiling what the first run did.
    runs: dict[tuple[int, int], list[SimpleNamespace]] = {cell: [] for cell in grid}
    extra = [cell for k in range(1, max(repeats.values(), default=1)) for cell in grid
             if repeats.get(cell, 1) > k]  # fmt: skip
    with tempfile.TemporaryDirectory() as cache:
        for w, n in [*grid, *extra]:
            runs[(w, n)].append(case_in_own_process(w, n, args, names, cache))
    cases = [merge_runs(runs[cell]) for cell in grid]
    chunks = []
    for w, n, k, batch in chunk_specs(parser, chunk_cases):
        case = Case(base_cfg, w, n, args, batch=batch)
        chunks.append(case.chunk(k, reps=CHUNK_REPS))
    load_end = os.getloadavg()
    wall = time.perf_counter() - wall_start

    report(cases, progs, names, base_cfg, skipped, chunks, load_start, load_end, wall)


# What `report` reads of a case, as a child process hands it back.
RESULT_FIELDS = ("width", "n", "block", "reps", "results", "memory", "base_times",
                 "compile_s", "notes", "seconds", "density", "malloc")  # fmt: skip


def run_case(base_cfg, w: int, n: int, args, progs: list[Program]) -> dict[str, Any]:
    """Measure one (width, N): the baseline, then every program interleaved with it."""
    start = time.perf_counter()
    case = Case(base_cfg, w, n, args)
    case.start_baseline()
    for prog in progs:
        t = time.perf_counter()
        case.measure(prog)
        print(f"# {fmt_params(w)} x {n} {prog.entry}: {time.perf_counter() - t:.0f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    case.base.check("local SGD")
    case.seconds = time.perf_counter() - start
    print(f"# done {fmt_params(w)} x {n} in {case.seconds:.0f} s", file=sys.stderr, flush=True)
    return {k: getattr(case, k) for k in RESULT_FIELDS}


def case_in_own_process(w: int, n: int, args, names: list[str], cache: str) -> SimpleNamespace:
    """`run_case` in a fresh process (this script with ``--case``), its results read back;
    ``cache``: JAX's persistent compilation cache, shared by the runs of a cell."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "case.json"
        cmd = [sys.executable, __file__, "--case", f"{w},{n}", "--json", str(out)]
        cmd += ["--algorithms", ",".join(names)]
        for flag in ("reps", "block"):
            if getattr(args, flag) is not None:
                cmd += [f"--{flag}", str(getattr(args, flag))]
        # Huge pages instead of the kept heap above its limit, as shoal-run would take.
        env = malloc.simulated_env(n_params(w) * n)
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
        done = subprocess.run(cmd, stdout=sys.stderr, env=env)  # progress and errors as they come
        if done.returncode:
            sys.exit(f"sim_scale: case {fmt_params(w)} x {n} failed (exit {done.returncode})")
        return SimpleNamespace(**json.loads(out.read_text()))


def merge_runs(runs: list[SimpleNamespace]) -> SimpleNamespace:
    """One cell's runs (processes) as one case: each ratio the median of the runs' (NaN if
    a run has none), the baseline's times and the densities pooled, the rest the first
    run's (the memory analysis is the same in every run; later runs load their programs
    from the compilation cache, so their compile times are not compile times); ``runs``
    keeps every run's ratios for the run-by-run table."""
    first = runs[0]
    results = {
        key: float(np.median([r.results.get(key, float("nan")) for r in runs]))
        for key in first.results
    }
    density: dict[str, list[float]] = {}
    for r in runs:
        for key, values in r.density.items():
            density.setdefault(key, []).extend(values)
    notes = list(dict.fromkeys(note for r in runs for note in r.notes))
    return SimpleNamespace(
        **{
            **vars(first),
            "results": results,
            "base_times": [t for r in runs for t in r.base_times],
            "density": density,
            "notes": notes,
            "seconds": sum(r.seconds for r in runs),
            "runs": [
                {"results": r.results, "base_ms": np.median(r.base_times) * 1e3} for r in runs
            ],
        }
    )


def print_runs(cases, rows) -> None:
    """The repeated cells run by run: each process's ratio, in the order they ran."""
    print("### The repeated cells, run by run (each run a process of its own, in order)")
    print()
    cols = [f"{fmt_params(c.width)} x {c.n}" for c in cases]
    print("| algorithm | " + " | ".join(cols) + " | target |")
    print("|---|" + "---|" * len(cols) + "---|")
    print(
        "| local SGD, ms/step | "
        + " | ".join(", ".join(f"{r['base_ms']:.1f}" for r in c.runs) for c in cases)
        + " | |"
    )
    for key, label in rows:
        vals = []
        for c in cases:
            got = [r["results"].get(key, float("nan")) for r in c.runs]
            vals.append(", ".join("n/a" if np.isnan(v) else f"{v:.2f}" for v in got))
        target = TARGETS.get(key)
        print(f"| {label} | " + " | ".join(vals) + f" | {'' if target is None else target} |")
    print()


def repeat_specs(parser, specs: list[str]) -> dict[tuple[int, int], int]:
    """``--repeat`` values as {(W, N): R}; a malformed one is a usage error."""
    out = {}
    for spec in specs:
        try:
            w, n, r = (int(v) for v in spec.split(","))
        except ValueError:
            parser.error(f"--repeat {spec!r}: expected W,N,R (three ints) or 'off'")
        if min(w, n, r) < 1:
            parser.error(f"--repeat {spec!r}: W, N and R must be >= 1")
        out[(w, n)] = r
    return out


def report(cases, progs, names, cfg, skipped, chunks, load_start, load_end, wall) -> None:
    print(
        f"sim_scale: {LAYERS}-layer tanh MLP (width W: {LAYERS} (W^2 + W) params), "
        f"{cfg.batch_size} examples per worker (fixed batch on the device), quickstart config "
        f"(`experiments/configs/quickstart.py`, workers = N); each algorithm's step as the "
        f"runner builds it (non-finite check '{cfg.nonfinite}'), jitted with params and "
        f"optimizer state donated, timed interleaved with local SGD (no communication, same "
        f"model, batch and vmap)"
    )
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} cores, backend={jax.default_backend()}, "
        f"jax {jax.__version__}, load average (1 min) {load_start[0]:.2f} at start, "
        f"{load_end[0]:.2f} at end; total {wall:.1f} s; malloc: {malloc.describe()}"
    )
    print(
        "settings (steps per timed block x reps; bmuf rows: blocks of "
        f"{cfg.params['bmuf'].block_size}): "
        + ", ".join(f"{fmt_params(c.width)} x {c.n}: {c.block} x {c.reps}" for c in cases)
    )
    print(
        "check: every algorithm (and local SGD) finished its timed steps with no step skipped "
        "and a finite loss; BMUF steps fell on the last step of every timed block; "
        "onebit_lamb's stage was the one named for every timed step"
    )
    for line in skipped:
        print(f"skipped: {line}")
    for c in cases:
        if c.malloc != malloc.describe():
            print(f"malloc ({fmt_params(c.width)} x {c.n}): {c.malloc}")
        for note in c.notes:
            print(f"note ({fmt_params(c.width)} x {c.n}): {note}")
    print()

    cols = [f"{fmt_params(c.width)} x {c.n}" for c in cases]
    rows = [(key, label) for p in progs for key, label in row_labels(p, cfg)]
    repeated = [c for c in cases if len(c.runs) > 1]
    print("### Step time relative to local SGD (median ms/step over the baseline's median)")
    print()
    if repeated:
        print(
            "Cells run in several processes (below, run by run) give the median of their "
            "runs' ratios, and local SGD's median over all their runs: "
            + ", ".join(f"{fmt_params(c.width)} x {c.n} ({len(c.runs)} runs)" for c in repeated)
            + "."
        )
        print()
    print("| algorithm | " + " | ".join(cols) + " | target (1M; N = 16, 64) |")
    print("|---|" + "---|" * len(cols) + "---|")
    print(
        "| local SGD, ms/step (= 1.00) | "
        + " | ".join(f"{np.median(c.base_times) * 1e3:.1f}" for c in cases)
        + " | |"
    )
    for key, label in rows:
        vals = []
        for c in cases:
            v = c.results.get(key)
            vals.append("n/a" if v is None or np.isnan(v) else f"{v:.2f}")
        target = TARGETS.get(key)
        print(f"| {label} | " + " | ".join(vals) + f" | {'' if target is None else target} |")
    print()
    if repeated:
        print_runs(repeated, rows)
    dense = [(key, label) for key, label in rows if any(key in c.density for c in cases)]
    if dense:
        print(
            f"sent / elements (GTC's density; capacity {cfg.params['gtc'].capacity} of the "
            "elements), "
            "the largest worker's at the end of each timed block, median (range): "
            + "; ".join(
                f"{label.split(' (')[0]}: "
                + ", ".join(
                    f"{fmt_params(c.width)} x {c.n} {np.median(d):.3f} ({min(d):.3f}-{max(d):.3f})"
                    for c in cases
                    if (d := c.density.get(key))
                )
                for key, label in dense
            )
        )
        print()
    if "adaptive" in names:
        print(
            f"adaptive starts as S-SGD with the noise-scale monitor; once the policy switches "
            f"it runs partial_exchange at adaptive.fraction = "
            f"{cfg.params['adaptive'].fraction} (the partial_exchange row: "
            f"partial_exchange.fraction = {cfg.params['partial_exchange'].fraction})."
        )
        print()

    print(
        "### Memory per simulated worker, MB (XLA memory_analysis of the donated step: "
        "arguments + outputs - aliased + temporaries, / N)"
    )
    print()
    print("| algorithm | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    mem_rows = [("local_sgd", "local SGD")] + [
        (k, label.replace(" local steps only", "").replace(" (block 10, amortised)", ""))
        for k, label in rows
        if not k.endswith(":local")
    ]
    for key, label in mem_rows:
        vals = [fmt_mb(c.memory[key]["peak"] / c.n) if key in c.memory else "n/a" for c in cases]
        print(f"| {label} | " + " | ".join(vals) + " |")
    print()
    print(
        "compile s (local SGD / slowest algorithm): "
        + ", ".join(
            f"{fmt_params(c.width)} x {c.n}: {c.compile_s['local_sgd']:.1f} / "
            f"{max(v for k, v in c.compile_s.items() if k != 'local_sgd'):.1f}"
            for c in cases
            if len(c.compile_s) > 1
        )
        + "; s per case: "
        + ", ".join(f"{fmt_params(c.width)} x {c.n}: {c.seconds:.0f}" for c in cases)
    )
    if chunks:
        print()
        print(
            "### grad_chunk: the runner's ssgd step with all workers' gradients at once (0) "
            "and K workers at a time"
        )
        print()
        print(
            "| params x N, examples per worker | K | MB per worker, 0 (temporaries) "
            "| MB per worker, K (temporaries) | ms/step, 0 | ms/step, K "
            "| max abs params difference |"
        )
        print("|---|---|---|---|---|---|---|")
        for out in chunks:
            case, k = out["case"], out["k"]
            mem = [out[c]["memory"] for c in (0, k)]
            mb = [
                f"{fmt_mb(m['peak'] / case.n)} ({fmt_mb(m['temporaries'] / case.n)})" for m in mem
            ]
            ms = [f"{np.median(out[c]['times']):.1f}" for c in (0, k)]
            print(
                f"| {fmt_params(case.width)} x {case.n}, {case.cfg.batch_size} | {k} | "
                f"{mb[0]} | {mb[1]} | {ms[0]} | {ms[1]} | {out['max_diff']:.1e} |"
            )
        print()
        print(
            f"(memory as above; ms/step: medians of {CHUNK_REPS} interleaved reps of 3 steps; "
            "the difference: after 3 identical steps of both)"
        )


if __name__ == "__main__":
    main()
