"""The command line of ``shoal-run``: its parser, the bundled configs its CONFIG argument
may name, and the checks of its arguments before anything trains (the worker count
against the launch, devices per worker, a launcher for ``--backend mpi|jax``).

`shoal.experiments.runner.cli` runs what they ask for.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from shoal.experiments import config as config_module
from shoal.experiments.config import Config, ConfigError
from shoal.experiments.overrides import load_file

CONFIGS = Path(config_module.__file__).parent / "configs"
ALGORITHMS = Path(config_module.__file__).parent / "algorithms"


def bundled_configs() -> list[str]:
    """The names of the bundled configs (``experiments/configs/*.py``), usable as the
    CONFIG argument in place of their path."""
    return sorted(p.stem for p in CONFIGS.glob("*.py") if not p.name.startswith("_"))


def bundled_algorithms() -> list[str]:
    """The bundled algorithms' names: their modules' (`shoal.experiments.algorithms`),
    read from the folder so that ``--help`` imports nothing."""
    shared = {"parts", "renamed"}
    return sorted(
        p.stem
        for p in ALGORITHMS.glob("*.py")
        if not p.name.startswith("_") and p.stem not in shared
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shoal-run",
        description="Train every algorithm of a config and write runs/<name>/ "
        "(metrics.jsonl, metrics.csv, loss plots, summary.md).",
        epilog=f"bundled configs: {', '.join(bundled_configs())}; algorithms: "
        f"{', '.join(bundled_algorithms())} (each one's hyper-parameters: "
        "experiments/algorithms/<name>.py). --set log=wandb writes wandb runs under "
        "<out>/wandb/, offline unless WANDB_MODE is set (upload them with wandb sync)",
    )
    p.add_argument(
        "config",
        help="a config file (a .py path) or the name of a bundled config: "
        + ", ".join(bundled_configs()),
    )
    p.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        nargs="+",
        action="extend",
        default=[],
        help="override config fields, e.g. --set steps=500 algorithms=ssgd,gtc "
        "gtc.threshold=0.05 (an algorithm's hyper-parameter: name.field; one entry's: "
        "algorithms=ssgd,gtc[threshold=0.05])",
    )
    p.add_argument(
        "--task",
        metavar="SPEC",
        help="the task to train on, the same as --set task=SPEC: a bundled task (mixture, "
        "hmm, lm, images), or your own as module.path:factory or path/to/file.py:factory "
        "(a callable taking the config and returning a shoal.experiments.tasks.Task); a "
        "config file that defines get_task(config) uses it without this flag",
    )
    p.add_argument(
        "--workers",
        type=int,
        help="number of workers (with --backend mpi: the MPI world size; jax: the devices "
        "over --devices-per-worker)",
    )
    p.add_argument(
        "--seeds",
        type=parse_seeds,
        metavar="S1,S2,...",
        help="run every entry once per seed (e.g. 0,1,2), each from its own initial model "
        "and batch order on the same data (the config's data_seed, else its seed); reports "
        "show mean +- std over the seeds. Default: the config's seed alone",
    )
    p.add_argument(
        "--sweep",
        type=_parse_sweep,
        metavar="KEY=V1,V2,...",
        help="tune each entry first: try every value on --sweep-fraction of the steps, judge "
        "by the loss on a validation split held out of the training data (validation_size "
        "rows, default: as many as the test set), then train the best value (over --seeds). "
        "KEY: learning_rate (each entry's own main rate) or a path in its "
        "hyper-parameters, e.g. outer.learning_rate",
    )
    p.add_argument(
        "--sweep-fraction",
        type=float,
        default=0.25,
        metavar="F",
        help="the share of the run's steps each --sweep value trains for (default 0.25)",
    )
    p.add_argument(
        "--backend",
        choices=("sim", "mpi", "jax"),
        default="sim",
        help="sim: N workers in this process (vmap); mpi: one worker per rank under mpiexec; "
        "jax: one worker per device (or per --devices-per-worker devices) of a "
        "jax.distributed job under mpiexec (shard_map)",
    )
    p.add_argument(
        "--devices-per-worker",
        type=int,
        default=1,
        metavar="K",
        help="with --backend jax: each worker spans K consecutive devices (a mesh "
        "workers x fsdp): its parameters and optimizer state are sharded over them and "
        "its batch split among them; the workers are the devices / K",
    )
    p.add_argument(
        "--servers",
        type=int,
        default=0,
        metavar="S",
        help="with --backend mpi: the last S ranks are dedicated parameter servers for "
        "bfb_allreduce (mpiexec -n WORKERS+S); the other algorithms ignore them",
    )
    p.add_argument(
        "--server-timeout",
        type=float,
        default=900.0,
        metavar="SECONDS",
        help="a parameter server that hears nothing from the workers this long aborts the job",
    )
    p.add_argument(
        "--coordinator-bind-address",
        metavar="HOST",
        help="with --backend jax: the address the jax.distributed coordinator (on process "
        "0) listens on; default: the address process 0's host name resolves to (the "
        "loopback address when every process is on one host), never all interfaces",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="output folder (default: runs/<config name>); one that is not empty needs "
        "--resume or --overwrite",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="write into an output folder that already holds results, replacing them",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoints in <out>/checkpoints/: finished algorithms are "
        "skipped, the interrupted one continues exactly where it stopped",
    )
    p.add_argument(
        "--stop-after",
        type=int,
        metavar="STEPS",
        help="train at most STEPS steps in this invocation (all algorithms together), save a "
        "checkpoint and exit without a report; continue with --resume",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="hide the progress bar (a terminal) or the progress lines (stderr not a terminal)",
    )
    return p


def _parse_sweep(text: str) -> tuple[str, tuple[str, ...]]:
    from shoal.experiments.runner.sweep import parse_sweep  # not at --help time

    return parse_sweep(text)


def parse_seeds(text: str) -> tuple[int, ...]:
    """``"0,1,2"`` -> ``(0, 1, 2)``: distinct ints in [0, MAX_SEED], in the order given.

    Raises:
      argparse.ArgumentTypeError: naming ``--seeds`` and the bad item.
    """
    items = [t.strip() for t in text.split(",")]
    if not all(t.isdigit() for t in items):
        bad = next(t for t in items if not t.isdigit())
        raise argparse.ArgumentTypeError(
            f"--seeds takes comma-separated ints >= 0, e.g. 0,1,2; got {bad!r} in {text!r}"
        )
    seeds = tuple(int(t) for t in items)
    if max(seeds) > config_module.MAX_SEED:
        raise argparse.ArgumentTypeError(
            f"--seeds: {max(seeds)} is more than the largest seed {config_module.MAX_SEED}"
        )
    if len(set(seeds)) < len(seeds):
        again = sorted({s for s in seeds if seeds.count(s) > 1})
        raise argparse.ArgumentTypeError(
            f"--seeds must be distinct (repeated: {', '.join(map(str, again))}): a seed run "
            "twice gives the same run twice"
        )
    return seeds


def resolve_workers(
    backend: str, configured: int, requested: int | None, world: int, devices_per_worker: int = 1
) -> int:
    """The number of workers: ``--workers`` (or the config) for ``sim``; the world size for
    ``mpi`` and ``jax`` (there the devices over ``devices_per_worker``), where an explicit
    request that disagrees is an error."""
    if backend == "sim":
        return configured if requested is None else requested
    if requested is not None and requested != world:
        if backend == "jax":
            raise ConfigError(
                f"--workers {requested} disagrees with the {world} workers of this job "
                f"({world * devices_per_worker} devices, --devices-per-worker "
                f"{devices_per_worker}): change the devices or --devices-per-worker, or drop "
                f"--workers"
            )
        raise ConfigError(
            f"--workers {requested} disagrees with the MPI world size {world}: "
            f"launch with `mpiexec -n {requested}` or drop --workers"
        )
    return world


def load_argument(spec: str):
    """`load_file` of the CONFIG argument: a path when it ends in ``.py`` or holds a path
    separator, else a bundled config's name; the error for an unknown name lists the
    bundled configs."""
    from shoal.experiments.overrides import is_path

    if is_path(spec):
        return load_file(spec)
    names = bundled_configs()
    if spec not in names:
        # A file of that name here is never loaded in its place (the meaning of a name must
        # not depend on the current folder): say why it was not taken.
        here = Path(spec).is_file()
        why = f"; {spec} here is a file, but config files end in .py" if here else ""
        raise ConfigError(
            f"config file not found: {spec} (give a path, or a bundled config: "
            f"{', '.join(names)}){why}"
        )
    return load_file(spec)


def check_devices_per_worker(cfg: Config, k: int) -> None:
    """Raise `ConfigError` unless workers of ``k`` devices can train ``cfg``: the batch
    must split evenly over a worker's devices."""
    if cfg.batch_size % k:
        raise ConfigError(
            f"batch_size = {cfg.batch_size} per worker must be a multiple of "
            f"--devices-per-worker {k}: each device takes an equal share of its worker's batch"
        )


def mpi_world_size() -> int:
    from mpi4py import MPI  # initialises MPI, as the MPI backend would

    return MPI.COMM_WORLD.Get_size()


def launcher_missing(backend: str, found: str, command: str) -> str:
    """The error for ``--backend mpi|jax`` started without a launcher: one worker, no
    communication, nothing measured."""
    words, sim = shlex.split(command), []
    while words:  # the same command without --backend and --servers (sim has neither)
        w = words.pop(0)
        if w in ("--backend", "--servers"):
            words[:1] = []
        elif not w.startswith(("--backend=", "--servers=")):
            sim.append(w)
    sim = shlex.join(sim)
    return (
        f"--backend {backend} found {found}: that is one worker that communicates nothing. "
        f"Start one process per worker, e.g. `mpiexec -n 4 {command}`, or simulate the "
        f"workers in this process: `{sim} --workers 4`"
    )
