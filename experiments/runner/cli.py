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

import contextlib
import dataclasses
import logging
import math
import shlex
import sys
import traceback
from pathlib import Path

import jax

from shoal.experiments import algorithms
from shoal.experiments.config import Config, ConfigError
from shoal.experiments.overrides import apply_overrides, parse_assignment
from shoal.experiments.reports import MetricsLog, summary_table, write_run
from shoal.experiments.reports.files import write_jsonl
from shoal.experiments.runner import churn as churn_run
from shoal.experiments.runner import memory, sweep
from shoal.experiments.runner import turns as turns_run
from shoal.experiments.runner.analysis import Analysis, run_analysis
from shoal.experiments.runner.arguments import (
    build_parser,
    check_devices_per_worker,
    launcher_missing,
    load_argument,
    mpi_world_size,
    resolve_workers,
)
from shoal.experiments.runner.backends import make_backend, world_agree, world_rank
from shoal.experiments.runner.checkpoint import Checkpointer, CheckpointError, folder_name
from shoal.experiments.runner.checkpoint_files import CheckpointWriteError
from shoal.experiments.runner.claims import Reproduction, run_reproduction
from shoal.experiments.runner.malloc import (
    RUNNER_DEFAULT,
    reexec_with_tunables,
    restart_simulated,
)
from shoal.experiments.runner.output import (
    OutputLock,
    cannot_write,
    output_problem,
    writable_problem,
)
from shoal.experiments.runner.study import Study, run_study
from shoal.experiments.runner.train import check_grad_chunk, train
from shoal.experiments.tasks import check_task, make_task, task_factory
from shoal.experiments.tasks.bert import num_parameters
from shoal.optim import NonFiniteGradientError


def _setup(args, backend, loaded):
    if not isinstance(loaded, Config):
        raise ConfigError(
            f"{args.config}: get_config() must return a shoal.experiments.config.Config, a "
            "shoal.experiments.runner.study.Study, a shoal.experiments.runner.claims."
            "Reproduction or a shoal.experiments.runner.analysis.Analysis,"
            f" got {type(loaded).__name__}"
        )
    from shoal.experiments.overrides import parse_value

    sets = _assignments(args)
    if args.seeds is not None and "seed" in dict(sets):
        raise ConfigError(
            f"--seeds {','.join(map(str, args.seeds))} and --set seed={dict(sets)['seed']} both "
            "choose the seed: pass one of them"
        )
    explicit = args.workers
    if explicit is not None and explicit < 1:
        raise ConfigError(f"--workers must be >= 1, got {explicit}")
    configured = loaded.workers
    if "workers" in dict(sets):  # --set workers=N asks for N workers, as --workers N does
        configured = parse_value(dict(sets)["workers"], int, "workers")
        explicit = configured if explicit is None else explicit
    world = backend.size if backend is not None else 1
    k = args.devices_per_worker
    # The run's worker count first, then --set and that count checked together: a check
    # that involves the workers (inject_nonfinite's WORKER) sees the run's count, whatever
    # the order of --workers and --set. Passed apart only when it is not what --set or the
    # config says, so that an error names --workers or the launch ("with workers = N").
    workers = resolve_workers(args.backend, configured, explicit, world, k)
    cfg = apply_overrides(loaded, sets, **({"workers": workers} if workers != configured else {}))
    task_factory(cfg.task)  # a task that cannot be found: refused before anything runs
    entries = algorithms.resolve_all(cfg)
    if args.sweep is not None:  # a key an entry lacks, or no horizon: refused now
        for e in entries:
            sweep.swept_path(e, args.sweep[0])
        sweep.tuning_config(cfg, args.sweep_fraction, entries)
    check_grad_chunk(cfg.grad_chunk, args.backend, workers)
    turns_run.check_run(cfg, args.backend)  # in_turn where it cannot apply
    if cfg.churn:  # an entry that cannot churn: refused before any entry trains
        for e in entries:
            churn_run.check_run(cfg, args.backend, e)
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
    sets = _assignments(args)
    fixed = [f"{k}={v}" for k, v in sets if k in _STUDY_FIELDS]
    if fixed:
        raise ConfigError(
            f"a study sets {', '.join(_STUDY_FIELDS)} per run: cannot --set {fixed[0]}"
        )
    if args.seeds is not None and "seed" in dict(sets):
        raise ConfigError("--seeds and --set seed=... both choose the seed: pass one of them")
    if args.sweep is not None:
        raise ConfigError("--sweep tunes a config's entries; a study's rows are fixed: drop it")
    seeds = study.seeds if args.seeds is None else args.seeds
    study = dataclasses.replace(study, config=apply_overrides(study.config, sets), seeds=seeds)
    task_factory(study.config.task)
    return study, study.resolve_runs()  # every run checked, before any training


def _setup_reproduction(args, rep: Reproduction) -> Reproduction:
    if args.backend != "sim" or args.workers is not None or args.sweep is not None:
        raise ConfigError(
            "a reproduction runs its own arms, worker counts and tuning on simulated "
            "workers: drop --workers, --sweep and --backend"
        )
    sets = _assignments(args)
    fixed = [f"{k}={v}" for k, v in sets if k in (*_STUDY_FIELDS, "seed")]
    if fixed:
        raise ConfigError(f"a reproduction sets the runs' {', '.join(_STUDY_FIELDS)} and "
                          f"seeds (--seeds): cannot --set {fixed[0]}")  # fmt: skip
    seeds = rep.seeds if args.seeds is None else args.seeds
    rep = dataclasses.replace(rep, config=apply_overrides(rep.config, sets), seeds=seeds)
    for arm in rep.arms():  # every arm checked, before any training
        rep.arm_config(arm)
    return rep


def _main_reproduction(args, rep: Reproduction, command: str) -> int:
    arms = rep.arms()
    print(f"{rep.config.name}: {len(rep.claims)} claims, {len(arms)} arms x "
          f"{len(rep.seeds)} seeds (sim)")  # fmt: skip
    out = args.out or Path("runs") / rep.config.name
    with _claimed(out, args.overwrite, args.resume) as problem:
        if problem:
            return _error(problem, 2)
        try:
            run_reproduction(rep, out, command=command, progress=not args.no_progress,
                             resume=args.resume)  # fmt: skip
        except OSError as e:
            return _write_error(out, e)
    print((out / "reproduce.md").read_text())
    print(f"wrote {out}/ (reproduce.md, results.jsonl, metrics.jsonl)")
    return 0


def _assignments(args) -> list[tuple[str, str]]:
    """``--set`` key=value pairs, with ``--task SPEC`` as ``task=SPEC`` last."""
    sets = [parse_assignment(o) for o in args.overrides]
    return sets + ([("task", args.task)] if args.task is not None else [])


def _main_study(args, study: Study, resolved: list, command: str) -> int:
    cfg = study.config
    workers = sorted({row.workers for row, _, _ in resolved})
    print(f"{cfg.name}: study of {len(resolved)} runs, workers "
          f"{', '.join(map(str, workers))} (sim)")  # fmt: skip
    out = args.out or Path("runs") / cfg.name
    with _claimed(out, args.overwrite, can_resume=False) as problem:
        if problem:
            return _error(problem, 2)
        try:
            run_study(study, out, command=command, progress=not args.no_progress,
                      resolved=resolved)  # fmt: skip
        except OSError as e:
            return _write_error(out, e)
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
    with _claimed(out, args.overwrite, can_resume=False) as problem:
        if problem:
            return _error(problem, 2)
        try:
            print(run_analysis(analysis, out))
        except OSError as e:
            return _write_error(out, e)
    print(f"wrote {out}/ ({', '.join(sorted(p.name for p in out.iterdir() if p.is_file()))})")
    return 0


def _error(message: str, code: int) -> int:
    print(f"shoal-run: error: {message}", file=sys.stderr, flush=True)
    return code


def _write_error(out: Path, e: OSError) -> int:
    """A write into ``out`` failed (disk full, read-only, a file size limit): one line, no
    traceback; exit 2. Re-raises what is not a write into ``out``."""
    name = Path(e.filename).resolve() if e.filename else None
    if name is not None and out.resolve() not in (name, *name.parents):
        raise e
    return _error(cannot_write(out, e), 2)


@contextlib.contextmanager
def _claimed(out: Path, overwrite: bool, resume: bool = False, can_resume: bool = True):
    """Claim the output folder ``out`` for this process (it writes the results): yields
    why it may not (`output_problem`, `OutputLock`), or None with the lock held until
    the block ends."""
    lock = OutputLock(out)
    problem = output_problem(out, resume, overwrite, can_resume=can_resume)
    if problem is None:  # a second run that saw the folder empty too is refused here
        problem = lock.acquire()
    try:
        yield problem
    finally:
        lock.release()


class _QuietNonFinite(logging.Filter):
    """JAX logs every exception raised inside a debug callback, with its traceback; the
    runner reports the non-finite policy's own error in one line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], NonFiniteGradientError))


_QUIET = _QuietNonFinite()  # one instance: addFilter ignores a filter it already has


def _argument_problem(args) -> str | None:
    """What is wrong with the command line alone (None: nothing)."""
    if args.servers < 0 or (args.servers and args.backend != "mpi"):
        return "--servers S >= 1 needs --backend mpi"
    if not (math.isfinite(args.server_timeout) and args.server_timeout > 0):
        return f"--server-timeout must be a number of seconds > 0, got {args.server_timeout}"
    if args.stop_after is not None and args.stop_after < 1:
        return "--stop-after must be >= 1"
    if args.sweep is not None and (args.resume or args.stop_after is not None):
        flag = "--resume" if args.resume else "--stop-after"
        return (f"{flag} with --sweep: a sweep's choices are not checkpointed; tune once, "
                "then name the chosen entries (sweep.jsonl) with --set algorithms=...")  # fmt: skip
    if args.resume and args.overwrite:
        return ("--resume continues the run in the output folder, --overwrite replaces it: "
                "pass one of them")  # fmt: skip
    k = args.devices_per_worker
    if k < 1 or (k > 1 and args.backend != "jax"):
        why = "must be >= 1" if k < 1 else f"needs --backend jax, not --backend {args.backend}"
        return f"--devices-per-worker {k} {why}"
    if args.coordinator_bind_address is not None and args.backend != "jax":
        return f"--coordinator-bind-address needs --backend jax, not --backend {args.backend}"
    return None


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # a command, not a call from Python: restart with the heap kept?
        reexec_with_tunables(default=RUNNER_DEFAULT)
    logging.getLogger("jax._src.debugging").addFilter(_QUIET)
    args = build_parser().parse_args(argv)
    args.reexec = argv is None  # may restart itself (`restart_simulated`)
    command = shlex.join(["shoal-run", *(sys.argv[1:] if argv is None else argv)])
    problem = _argument_problem(args)
    # Under mpiexec (--backend mpi or jax) every process decides together, servers
    # included: one that stops alone would leave the others waiting for it.
    world = args.world = mpi_world_size() if args.backend != "sim" else 1
    if world > 1:
        problem = world_agree(problem)
    if problem is None and args.backend == "mpi" and world == 1:
        problem = launcher_missing("mpi", "a single MPI process", command)
    if problem is not None:
        return _error(problem, 2) if world_rank() == 0 else 2
    # MPI (or jax.distributed) must exist before the config is resolved: its world size is
    # the worker count.
    backend = None
    if args.backend != "sim":
        try:
            backend = make_backend(args.backend, servers=args.servers,
                                   devices_per_worker=args.devices_per_worker,
                                   bind_address=args.coordinator_bind_address)  # fmt: skip
        except ValueError as e:  # from the world's layout alone: every process finds it
            return _error(str(e), 2) if world_rank() == 0 else 2
    if args.backend == "jax" and jax.process_count() == 1 and len(backend.devices) == 1:
        why = launcher_missing("jax", "one process with one device", command)
        return _error(why, 2)
    if backend is not None and backend.is_server:
        return _serve(backend, args.server_timeout)
    try:
        return _main(args, command, backend)
    except BaseException:
        # Any other exception, on any process, ends every process: the others may be
        # waiting for this one in a collective.
        if world > 1:
            traceback.print_exc()
            sys.stderr.flush()
            backend.abort(1)
        raise
    finally:
        if backend is not None and backend.servers is not None:
            backend.servers.shutdown()  # let the servers' loops end, whatever happened here


def _main(args, command: str, backend) -> int:
    is_root = backend is None or backend.is_root
    problem = None
    try:
        loaded = load_argument(args.config)
        # A reproduction resumes from the tunings and runs it saved in arms/ as they ended.
        if args.resume and not isinstance(loaded, (Config, Reproduction)):
            what = "a study" if isinstance(loaded, Study) else "an analysis"
            raise ConfigError(f"--resume continues a config's runs; {what} has none to resume")
        if isinstance(loaded, Study):
            study, resolved = _setup_study(args, loaded)
        elif isinstance(loaded, Reproduction):
            reproduction = _setup_reproduction(args, loaded)
        elif isinstance(loaded, Analysis):
            if args.overrides or args.workers is not None or args.backend != "sim":
                raise ConfigError(
                    "an analysis computes on this host and has no settings: drop --set, "
                    "--workers and --backend"
                )
        else:
            cfg, entries = _setup(args, backend, loaded)
            for e in entries:  # labels name folders: refused now, not at the first save
                try:
                    folder_name(e.label)
                except ValueError as err:
                    raise ConfigError(str(err)) from None
    except ConfigError as e:
        problem = str(e)
    if backend is not None:  # a config file missing on one node: every rank stops
        problem = backend.agree(problem)
    if problem is not None:
        return _error(problem, 2) if is_root else 2
    if isinstance(loaded, Study):
        return _main_study(args, study, resolved, command)
    if isinstance(loaded, Reproduction):
        return _main_reproduction(args, reproduction, command)
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
        seeds = "" if args.seeds is None else f", seeds {','.join(map(str, args.seeds))}"
        print(f"{cfg.name}: {cfg.workers} workers ({args.backend}{each}), {cfg.steps} steps, "
              f"algorithms: {', '.join(cfg.algorithms)}{seeds}")  # fmt: skip
    out = args.out or Path("runs") / cfg.name
    # Only the root writes the outputs: it claims the folder, and its view decides for
    # every process.
    claim = _claimed(out, args.overwrite, args.resume) if is_root else contextlib.nullcontext()
    with claim as problem:
        return _run_config(args, cfg, entries, backend, out, command, backend.agree(problem))


def _run_config(args, cfg, entries, backend, out: Path, command: str, problem) -> int:
    """Train ``cfg``'s entries into the claimed folder ``out`` and write the results;
    ``problem``: why the folder may not be used (every process's decision)."""
    is_root = backend.is_root
    multi = args.world > 1  # several processes: a failure of this one must end the others
    # One run of every entry per seed, each on the config's data (`Config.seeded`); without
    # --seeds the config as it is, at its own seed.
    several = args.seeds is not None
    seeds = [(s, cfg.seeded(s)) for s in args.seeds] if several else [(cfg.seed, cfg)]

    def checkpointer(run_cfg: Config, entry) -> Checkpointer:
        folder = out / "checkpoints"
        if several:  # each seed's checkpoints apart: the labels repeat across seeds
            folder = folder / f"seed{run_cfg.seed}"
        return Checkpointer(folder, entry.label, run_cfg, backend)

    # Checkpoints only when asked for: periodically, or to stop and resume.
    checkpointing = cfg.checkpoint_every > 0 or args.resume or args.stop_after is not None
    if problem is None and args.resume:
        found = any(checkpointer(c, e).steps() for _, c in seeds for e in entries)
        if not any(backend.gather_all(found)):
            problem = (
                f"--resume found no checkpoint of {', '.join(cfg.algorithms)} in "
                f"{out / 'checkpoints'}: nothing to continue (a run saves checkpoints with "
                f"--stop-after or --set checkpoint_every=N); drop --resume to start afresh"
            )
    # Last: it makes the folder, which a refused run must not leave behind.
    if problem is None and checkpointing:  # every process saves its own
        problem = backend.agree(writable_problem(out / "checkpoints"))
    if problem is not None:
        return _error(problem, 2) if is_root else 2
    if args.overwrite:  # the replaced run's checkpoints must not be resumed later
        for e in entries:
            for _, run_cfg in seeds:
                checkpointer(run_cfg, e).remove()
            if several:  # a single-seed run's layout, in the same folder before
                Checkpointer(out / "checkpoints", e.label, cfg, backend).remove()
    log = None
    tuning = ""  # the report's section on the sweep (--sweep)
    count = None  # parameters x workers of this process, once the model is built
    try:
        log = MetricsLog(out / "metrics.jsonl") if is_root else None
        first = make_task(seeds[0][1])
        try:
            check_task(first, cfg.task)
        except TypeError as e:  # the same on every process
            return _error(str(e), 2) if is_root else 2
        count = num_parameters(first.init_params()) * len(backend.local_ranks)
        if args.backend == "sim" and args.reexec:  # too large to keep the heap? (malloc)
            restart_simulated(count, "shoal-run")  # before any training, the sweep's too
        if args.sweep is not None:
            key, values = args.sweep
            labels, rows, tune_cfg = sweep.tune(
                seeds[0][1], entries, backend, key=key, values=values,
                fraction=args.sweep_fraction, progress=not args.no_progress,
            )  # fmt: skip
            entries = [algorithms.resolve(label, cfg) for label in labels]
            tuning = sweep.sweep_section(
                rows, key=key, values=values, steps=tune_cfg.steps, total=cfg.steps,
                validation=tune_cfg.validation_size, seed=seeds[0][0],
            )  # fmt: skip
            if is_root:
                write_jsonl(out / "sweep.jsonl", rows)
        results = []
        budget = args.stop_after
        for i, (seed, run_cfg) in enumerate(seeds):
            task = first if i == 0 else make_task(run_cfg)
            if several and is_root:
                print(f"seed {seed}:")
            for entry in entries:
                name = entry.label if not several else f"{entry.label} (seed {seed})"
                entry = dataclasses.replace(entry, cfg=run_cfg)  # its builder sees the seed
                ckpt = checkpointer(run_cfg, entry) if checkpointing else None
                result = train(run_cfg, task, backend, entry, progress=not args.no_progress,
                               checkpoints=ckpt, resume=args.resume, max_steps=budget,
                               on_record=log.add if log is not None else None)  # fmt: skip
                results.append(result)
                if budget is not None:
                    budget -= result.trained
                if not result.finished:
                    if is_root:
                        print(f"stopped {name} at step {result.step} of {cfg.steps}; "
                              f"continue with --resume")  # fmt: skip
                    return 0
    except CheckpointWriteError as e:  # this process's own: the others are training on
        _error(str(e), 2)
        if multi:
            backend.abort(2)
        return 2
    except CheckpointError as e:  # refused by every process together (`Checkpointer.load`)
        return _error(str(e), 2) if is_root else 2
    except ConfigError as e:  # found at a run's start on every process alike (same model)
        return _error(str(e), 2) if is_root else 2
    except NonFiniteGradientError as e:
        # nonfinite="raise": every rank stops at the same step, so nobody is left waiting.
        return _error(f"{name}: {e}", 3) if is_root else 3
    except (jax.errors.JaxRuntimeError, MemoryError) as e:  # out of memory: one line
        why = memory.oom_message(e, count, len(backend.local_ranks))
        if why is None:
            raise
        _error(why, 1)
        if multi:
            backend.abort(1)
        return 1
    except OSError as e:  # the metrics log: the root's alone
        code = _write_error(out, e)
        if multi:
            backend.abort(code)
        return code
    finally:
        if log is not None:
            log.close()
    failed = None
    if is_root:
        summaries = [r.summary for r in results]
        try:
            records = [rec for r in results for rec in r.records]
            written = write_run(out, cfg, records, summaries, entries=entries,
                                backend=args.backend, command=command, task=task)  # fmt: skip
            for page in ("summary.md", "report.md"):  # what the sweep chose, and from what
                with open(out / page, "a") as f:
                    f.write(tuning)
        except OSError as e:
            failed = _write_error(out, e)
    if backend.agree("not written" if failed else None) is not None:  # all exit as the root
        return 2
    if not is_root:
        return 0
    print(summary_table(summaries))
    print(f"wrote {out}/ ({', '.join(p.name for p in written)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
