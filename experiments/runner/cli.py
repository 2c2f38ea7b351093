"""``shoal-run``: train a config's algorithms on simulated or MPI workers and report.

Usage::

    shoal-run experiments/configs/quickstart.py --workers 8
    shoal-run quickstart --set steps=500 algorithms=ssgd,gtc
    mpiexec -n 4 shoal-run quickstart --backend mpi
    mpiexec -n 4 shoal-run quickstart --backend jax
    mpiexec -n 2 shoal-run quickstart --backend jax --devices-per-worker 4  # 8 devices: 2 workers
    shoal-run experiments/configs/acoustic_study.py   # a Study: tables over worker counts
    shoal-run quickstart --overwrite   # replace the results already in runs/quickstart/

An output folder that is not empty is never written over silently: ``--resume`` continues
the run in it, ``--overwrite`` replaces its results, otherwise the runner stops (exit 2).

This module runs a config's algorithms, a study or an analysis; the command line itself (the
parser and the checks of its arguments) is `shoal.experiments.runner.arguments`.
"""

from __future__ import annotations

import dataclasses
import logging
import shlex
import sys
import traceback
from pathlib import Path

import jax

from shoal.experiments import algorithms
from shoal.experiments.config import Config, ConfigError
from shoal.experiments.overrides import apply_overrides, parse_assignment
from shoal.experiments.reports import PLOTS, summary_table, write_run
from shoal.experiments.runner.analysis import Analysis, run_analysis
from shoal.experiments.runner.arguments import (
    build_parser,
    check_devices_per_worker,
    launcher_missing,
    load_argument,
    mpi_world_size,
    output_problem,
    resolve_workers,
)
from shoal.experiments.runner.backends import make_backend
from shoal.experiments.runner.checkpoint import Checkpointer, CheckpointError
from shoal.experiments.runner.malloc import reexec_with_tunables, restart_simulated
from shoal.experiments.runner.study import Study, run_study
from shoal.experiments.runner.train import check_grad_chunk, train
from shoal.experiments.tasks import make_task
from shoal.experiments.tasks.bert import num_parameters
from shoal.optim.nonfinite import NonFiniteGradientError


def _setup(args, backend, loaded):
    if not isinstance(loaded, Config):
        raise ConfigError(
            f"{args.config}: get_config() must return a shoal.experiments.config.Config, a "
            "shoal.experiments.runner.study.Study or a shoal.experiments.runner.analysis.Analysis,"
            f" got {type(loaded).__name__}"
        )
    sets = [parse_assignment(o) for o in args.overrides]
    cfg = apply_overrides(loaded, sets)
    explicit = args.workers
    if explicit is None and "workers" in dict(sets):
        explicit = cfg.workers
    if explicit is not None and explicit < 1:
        raise ConfigError(f"--workers must be >= 1, got {explicit}")
    world = backend.size if backend is not None else 1
    k = args.devices_per_worker
    workers = resolve_workers(args.backend, cfg.workers, explicit, world, k)
    try:
        cfg = dataclasses.replace(cfg, workers=workers)
    except ValueError as e:
        raise ConfigError(f"with {workers} workers: {e}") from None
    entries = algorithms.resolve_all(cfg)
    check_grad_chunk(cfg.grad_chunk, args.backend, workers)
    if k > 1:
        check_devices_per_worker(cfg, k)
    return cfg, entries


# Fields a study sets per run from its rows.
_STUDY_FIELDS = ("workers", "steps", "eval_every", "algorithms")


def _setup_study(args, study: Study) -> tuple[Study, list]:
    if args.backend != "sim" or args.workers is not None:
        raise ConfigError(
            "a study runs its own worker counts on simulated workers: drop --workers and "
            f"--backend {args.backend}"
        )
    sets = [parse_assignment(o) for o in args.overrides]
    fixed = [f"{k}={v}" for k, v in sets if k in _STUDY_FIELDS]
    if fixed:
        raise ConfigError(
            f"a study sets {', '.join(_STUDY_FIELDS)} per run: cannot --set {fixed[0]}"
        )
    study = dataclasses.replace(study, config=apply_overrides(study.config, sets))
    return study, study.resolve_runs()  # every run checked, before any training


def _main_study(args, study: Study, resolved: list, command: str) -> int:
    cfg = study.config
    workers = sorted({row.workers for row, _, _ in resolved})
    print(f"{cfg.name}: study of {len(resolved)} runs, workers "
          f"{', '.join(map(str, workers))} (sim)")  # fmt: skip
    out = args.out or Path("runs") / cfg.name
    problem = output_problem(out, False, args.overwrite, can_resume=False)
    if problem:
        print(f"shoal-run: error: {problem}", file=sys.stderr)
        return 2
    run_study(study, out, command=command, progress=not args.no_progress, resolved=resolved)
    print((out / "summary.md").read_text())
    print(f"wrote {out}/ (summary.md, results.jsonl, metrics.jsonl)")
    return 0


def _serve(backend, timeout: float) -> int:
    """A dedicated parameter-server rank: serve until the workers stop, then report."""
    servers = backend.servers
    try:
        stats = servers.serve(timeout=timeout)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        backend.abort(1)
        raise
    index = servers.comm.Get_rank() - servers.num_workers
    print(
        f"parameter server {index}: {stats.steps} steps, {stats.buffers} buffers, "
        f"{stats.received / 1e6:.3f} MB received, {stats.sent / 1e6:.3f} MB sent",
        flush=True,
    )
    return 0


def _main_analysis(args, analysis: Analysis) -> int:
    out = args.out or Path("runs") / analysis.name
    problem = output_problem(out, False, args.overwrite, can_resume=False)
    if problem:
        print(f"shoal-run: error: {problem}", file=sys.stderr)
        return 2
    print(run_analysis(analysis, out))
    print(f"wrote {out}/ ({', '.join(sorted(p.name for p in out.iterdir() if p.is_file()))})")
    return 0


class _QuietNonFinite(logging.Filter):
    """JAX logs every exception raised inside a debug callback, with its traceback; the
    runner reports the non-finite policy's own error in one line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], NonFiniteGradientError))


_QUIET = _QuietNonFinite()  # one instance: addFilter ignores a filter it already has


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # a command, not a call from Python: restart with the heap kept?
        reexec_with_tunables(default="keep")
    logging.getLogger("jax._src.debugging").addFilter(_QUIET)
    args = build_parser().parse_args(argv)
    if args.servers < 0 or (args.servers and args.backend != "mpi"):
        print("shoal-run: error: --servers S >= 1 needs --backend mpi", file=sys.stderr)
        return 2
    if args.stop_after is not None and args.stop_after < 1:
        print("shoal-run: error: --stop-after must be >= 1", file=sys.stderr)
        return 2
    if args.resume and args.overwrite:
        print("shoal-run: error: --resume continues the run in the output folder, "
              "--overwrite replaces it: pass one of them", file=sys.stderr)  # fmt: skip
        return 2
    k = args.devices_per_worker
    if k < 1 or (k > 1 and args.backend != "jax"):
        why = "must be >= 1" if k < 1 else f"needs --backend jax, not --backend {args.backend}"
        print(f"shoal-run: error: --devices-per-worker {k} {why}", file=sys.stderr)
        return 2
    # MPI (or jax.distributed) must exist before the config is resolved: its world size is
    # the worker count.
    backend = None
    command = shlex.join(["shoal-run", *(sys.argv[1:] if argv is None else argv)])
    if args.backend == "mpi" and mpi_world_size() == 1:
        why = launcher_missing("mpi", "a single MPI process", command)
        print(f"shoal-run: error: {why}", file=sys.stderr)
        return 2
    if args.backend != "sim":
        try:
            backend = make_backend(args.backend, servers=args.servers,
                                   devices_per_worker=args.devices_per_worker)  # fmt: skip
        except ValueError as e:  # K does not divide the devices: every process finds it
            if args.backend == "jax" and jax.process_index() == 0:
                print(f"shoal-run: error: {e}", file=sys.stderr)
            return 2
    if args.backend == "jax" and jax.process_count() == 1 and len(backend.devices) == 1:
        why = launcher_missing("jax", "one process with one device", command)
        print(f"shoal-run: error: {why}", file=sys.stderr)
        return 2
    if backend is not None and backend.is_server:
        return _serve(backend, args.server_timeout)
    try:
        return _main(args, argv, backend)
    finally:
        if backend is not None and backend.servers is not None:
            backend.servers.shutdown()  # let the servers' loops end, whatever happened here


def _main(args, argv, backend) -> int:
    is_root = backend is None or backend.is_root
    command = shlex.join(["shoal-run", *(sys.argv[1:] if argv is None else argv)])
    try:
        loaded = load_argument(args.config)
        if args.resume and not isinstance(loaded, Config):
            what = "a study" if isinstance(loaded, Study) else "an analysis"
            raise ConfigError(f"--resume continues a config's runs; {what} has none to resume")
        if isinstance(loaded, Study):
            study, resolved = _setup_study(args, loaded)
        elif isinstance(loaded, Analysis):
            if args.overrides or args.workers is not None or args.backend != "sim":
                raise ConfigError(
                    "an analysis computes on this host and has no settings: drop --set, "
                    "--workers and --backend"
                )
        else:
            cfg, entries = _setup(args, backend, loaded)
    except ConfigError as e:
        if is_root:  # every rank finds the same error; say it once
            print(f"shoal-run: error: {e}", file=sys.stderr)
        return 2
    if isinstance(loaded, Study):
        return _main_study(args, study, resolved, command)
    if isinstance(loaded, Analysis):
        return _main_analysis(args, loaded)
    if backend is None:
        backend = make_backend("sim", cfg.workers)

    if args.backend == "mpi":
        command = f"mpiexec -n {backend.size + args.servers} {command}"
    elif args.backend == "jax":
        command = f"mpiexec -n {backend.comm.Get_size()} {command}"
    if is_root:
        each = f", {args.devices_per_worker} devices each" if args.devices_per_worker > 1 else ""
        print(f"{cfg.name}: {cfg.workers} workers ({args.backend}{each}), {cfg.steps} steps, "
              f"algorithms: {', '.join(cfg.algorithms)}")  # fmt: skip
    out = args.out or Path("runs") / cfg.name
    # Only the root writes the outputs: its view of the folder decides for every process.
    problem = output_problem(out, args.resume, args.overwrite) if is_root else None
    problem = backend.share(problem)
    if problem is None and args.resume:
        found = any(Checkpointer(out / "checkpoints", e.label, cfg, backend).steps()
                    for e in entries)  # fmt: skip
        if not any(backend.gather_all(found)):
            problem = (
                f"--resume found no checkpoint of {', '.join(cfg.algorithms)} in "
                f"{out / 'checkpoints'}: nothing to continue (a run saves checkpoints with "
                f"--stop-after or --set checkpoint_every=N); drop --resume to start afresh"
            )
    if problem is not None:
        if is_root:
            print(f"shoal-run: error: {problem}", file=sys.stderr)
        return 2
    if args.overwrite:  # the replaced run's checkpoints must not be resumed later
        for e in entries:
            Checkpointer(out / "checkpoints", e.label, cfg, backend).remove()
    # Checkpoints only when asked for: periodically, or to stop and resume.
    checkpointing = cfg.checkpoint_every > 0 or args.resume or args.stop_after is not None
    try:
        task = make_task(cfg)
        if args.backend == "sim" and argv is None:  # too large to keep the heap? (malloc)
            restart_simulated(num_parameters(task.init_params()) * cfg.workers, "shoal-run")
        results = []
        budget = args.stop_after
        for entry in entries:
            name = entry.label
            ckpt = Checkpointer(out / "checkpoints", name, cfg, backend) if checkpointing else None
            result = train(cfg, task, backend, entry, progress=not args.no_progress,
                           checkpoints=ckpt, resume=args.resume, max_steps=budget)  # fmt: skip
            results.append(result)
            if budget is not None:
                budget -= result.trained
            if not result.finished:
                if is_root:
                    print(f"stopped {name} at step {result.step} of {cfg.steps}; "
                          f"continue with --resume")  # fmt: skip
                return 0
    except CheckpointError as e:
        if is_root:
            print(f"shoal-run: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteGradientError as e:
        # nonfinite="raise": every rank stops at the same step, so nobody is left waiting.
        if is_root:
            print(f"shoal-run: error: {name}: {e}", file=sys.stderr)
        return 3
    except BaseException:
        if args.backend != "sim" and backend.size > 1:
            traceback.print_exc()
            sys.stderr.flush()
            backend.abort(1)
        raise
    if not is_root:
        return 0
    summaries = [r.summary for r in results]
    write_run(
        out,
        cfg,
        [rec for r in results for rec in r.records],
        summaries,
        entries=entries,
        backend=args.backend,
        command=command,
        task=task,
    )
    print(summary_table(summaries))
    files = ["report.md", "summary.md", "metrics.jsonl", "metrics.csv", *PLOTS, "timing.jsonl"]
    print(f"wrote {out}/ ({', '.join(files)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
