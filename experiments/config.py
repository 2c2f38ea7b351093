"""Experiment configs: the typed dataclass `Config` and its checks.

`Config` is two field groups, `RunFields` (below: workers, schedule, checkpoints,
non-finite policy, logs) and `shoal.experiments.fields.TaskFields`, each checking its own
fields, plus ``params``: the hyper-parameters of the algorithms, each a typed dataclass
of the algorithm's own module (`shoal.experiments.algorithms`). A config file under
``experiments/configs/`` defines ``get_config()`` returning a `Config` (or a subclass
with extra fields); `shoal.experiments.overrides` loads it and applies ``--set
key=value`` overrides (``--set diloco.sync_every=20`` sets ``params["diloco"]``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any, Literal

from shoal.experiments.fields import (
    ConfigError,
    TaskFields,
    check_field,
    check_types,
)

__all__ = ["Config", "ConfigError", "RunFields", "TaskFields"]

# The largest seed: NumPy's default_rng refuses negative seeds, and jax.random.key keeps
# only the low 32 bits of a seed in its default 32-bit mode (2**32 draws as 0 does).
MAX_SEED = 2**32 - 1
# The most steps ``scan_steps = 0`` puts in one program: at 10 the runner's host work per
# step (waiting for the metrics, recording them) is a tenth (benchmarks/scan_steps.py).
AUTO_SCAN_STEPS = 10


def is_folder_name(name: str) -> bool:
    """Whether ``name`` is one ordinary folder name: not empty, ".", "..", no path
    separator or NUL, at most 255 bytes (the usual file-name limit)."""
    seps = {"/", os.sep, os.altsep} - {None}
    if name in ("", ".", "..") or "\0" in name or any(s in name for s in seps):
        return False
    try:
        return len(os.fsencode(name)) <= 255
    except UnicodeError:
        return False


@dataclasses.dataclass(frozen=True)
class RunFields:
    """The run itself: which algorithms, how many workers, how long, and what it writes."""

    # Also the default output folder, runs/<name>: one ordinary folder name.
    name: str = "experiment"
    algorithms: tuple[str, ...] = ("ssgd",)

    # Workers and schedule.
    workers: int = 8
    steps: int = 200
    # Per worker: one global batch is ``workers * batch_size`` rows, worker r gets block r.
    batch_size: int = 32
    # Test metrics every ``eval_every`` steps and after the last one.
    eval_every: int = 25
    seed: int = 0
    # Simulated workers only (--backend sim): compute the workers' gradients grad_chunk
    # workers at a time (0: all at once), so N workers need not hold N workers' activations
    # at once; the update still runs on all workers together. Must divide workers.
    grad_chunk: int = 0
    # Steps per compiled program: scan_steps steps run as one jax.lax.scan, one dispatch
    # and one wait for the metrics (a program ends early at every evaluation, checkpoint,
    # policy consultation and the last step). Records, evaluations and checkpoints are the
    # same. 1: a program per step; 0: the largest divisor of eval_every up to
    # AUTO_SCAN_STEPS, so that the programs have one length (one compile). Not the default:
    # XLA:CPU runs simulated conv nets' scanned steps 2.8x slower (benchmarks/scan_steps.py).
    scan_steps: int = 1

    # Simulated workers take turns (--backend sim, scan_steps >= 2): for the entries
    # registered for it (diloco, muloco, sparseloco; the others run as without it), the
    # local steps of a program run one worker after another (shoal.optim.helpers.
    # take_turns), the exchange step under vmap, so each local step's working set is one
    # worker's (benchmarks/sim_vs_jax_peer.py: faster for the 1M MLP at 8 and 16 workers,
    # not for the 4M LM at 8). Records are those without it to float32 rounding; a
    # non-finite skip runs its program's steps again with the workers together.
    in_turn: bool = False

    # Cluster projection (`shoal.costmodel`): when project_workers > 0, every run's
    # collectives are replayed for that many workers and timed on the preset cluster
    # project_cluster (its workers per node), plus one worker's compute time measured here.
    project_workers: int = 0
    project_cluster: str = "v100-nvlink-25gbps"

    # Simulated time (`shoal.costmodel.clock`): with speeds set, every run gets a simulated
    # wall clock on project_cluster's links with its own workers. speeds: factors on each
    # worker's compute time (`shoal.costmodel.speeds`: "2@0-1" workers 0-1 twice as slow,
    # "lognormal:0.3", "pareto:1.5", "trace:PATH", joined by "*"); "1" all equal; "" no
    # clock. compute_ms: one worker's step (0: measured here; set it for a clock that is
    # the same bit for bit on every machine). target_loss > 0: report the simulated time of
    # the first evaluation at or below it.
    speeds: str = ""
    compute_ms: float = 0.0
    target_loss: float = 0.0
    # Churn (`shoal.experiments.churn`, simulated workers only): workers that leave and
    # come back, e.g. "leave:3@100-160,join:5@40" (absent workers compute and send
    # nothing; averages weigh the present ones by tokens). "" none.
    churn: str = ""

    # Checkpoints (`shoal.experiments.runner.checkpoint`): every checkpoint_every steps (0: none
    # periodically; a run that checkpoints also saves when it stops), resumed with --resume.
    checkpoint_every: int = 0

    # Non-finite gradients (`shoal.optim.skip_nonfinite` around the whole chain): "skip"
    # the step on every worker (the whole update, local optimizer included, as if it never
    # happened), "raise" (the run stops with an error on every rank), or "off" (no
    # wrapper: no check, no flag all-reduce).
    # inject_nonfinite "STEP:WORKER" adds a NaN to that worker's gradient at that step
    # (1-based), a fault injection for tests and demonstrations ("": none).
    nonfinite: Literal["skip", "raise", "off"] = "skip"
    inject_nonfinite: str = ""

    # Extra logs next to the run's metrics: "tensorboard" also writes TensorBoard event
    # files, one run per algorithm, under tensorboard/ in the output folder (needs the
    # optional extra: pip install -e '.[tensorboard]' in the clone); "wandb" one wandb run
    # per algorithm under wandb/, offline unless WANDB_MODE says otherwise (pip install -e
    # '.[wandb]'; `shoal.experiments.reports.wandb_log`).
    log: Literal["none", "tensorboard", "wandb"] = "none"

    def check_run(self) -> None:
        """`ConfigError` for a run field out of range."""
        check_field(
            is_folder_name(self.name),
            "name",
            "one folder name (the default output folder runs/<name>): not empty, '.' or "
            f"'..', without '/' or NUL, at most 255 bytes; got {self.name[:60]!r}",
        )
        check_field(len(self.algorithms) > 0, "algorithms", "at least one algorithm")
        dupes = sorted({a for a in self.algorithms if self.algorithms.count(a) > 1})
        check_field(not dupes, "algorithms", f"distinct names (repeated: {', '.join(dupes)})")
        for f in ("workers", "steps", "batch_size", "eval_every"):
            check_field(getattr(self, f) >= 1, f, "an int >= 1")
        check_field(self.grad_chunk >= 0, "grad_chunk", "an int >= 0 (0: all workers at once)")
        check_field(
            self.scan_steps >= 0, "scan_steps", "an int >= 0 (0: automatic, 1: a program per step)"
        )
        check_field(self.checkpoint_every >= 0, "checkpoint_every", "an int >= 0 (0: off)")
        check_field(
            0 <= self.seed <= MAX_SEED,
            "seed",
            f"an int in [0, {MAX_SEED}] (NumPy and jax.random.key seeds), got {self.seed}",
        )
        data_seed = getattr(self, "data_seed", None)  # a TaskFields field
        check_field(
            data_seed is None or 0 <= data_seed <= MAX_SEED,
            "data_seed",
            f"None or an int in [0, {MAX_SEED}], got {data_seed}",
        )
        check_field(
            self.log in ("none", "tensorboard", "wandb"), "log", '"none", "tensorboard" or "wandb"'
        )
        if self.log == "tensorboard" and importlib.util.find_spec("tensorboardX") is None:
            # Checked here, not when the run's outputs are written: before training.
            raise ConfigError(
                "config field 'log' = 'tensorboard' needs the tensorboardX package: "
                "pip install tensorboardX (from shoal's clone: pip install -e '.[tensorboard]')"
            )
        if self.log == "wandb":
            from shoal.experiments.reports.wandb_log import wandb_problem

            problem = wandb_problem()  # the package, WANDB_MODE: before training too
            if problem is not None:
                raise ConfigError(problem)
        check_field(
            self.inject_nonfinite == "" or self.injection() is not None,
            "inject_nonfinite",
            f'"STEP:WORKER" with 1 <= STEP <= steps = {self.steps} and 0 <= WORKER < '
            f'workers = {self.workers}, or ""; got {self.inject_nonfinite!r}',
        )
        check_field(self.project_workers >= 0, "project_workers", "an int >= 0 (0: no projection)")
        from shoal.costmodel import PRESETS

        check_field(self.project_cluster in PRESETS, "project_cluster", f"one of {sorted(PRESETS)}")
        per_node = PRESETS[self.project_cluster]["workers_per_node"]
        check_field(
            self.project_workers % per_node == 0,
            "project_workers",
            f"a multiple of the {per_node} workers per node of {self.project_cluster!r}",
        )
        check_field(self.compute_ms >= 0, "compute_ms", "a number of ms >= 0 (0: measured)")
        check_field(self.target_loss >= 0, "target_loss", "a number >= 0 (0: none)")
        if self.speeds:
            from shoal.costmodel.speeds import check_speeds

            try:
                check_speeds(self.speeds, self.workers)
            except ValueError as e:
                raise ConfigError(f"config field {e}") from None  # "speeds = '...': ..."
            check_field(
                self.workers % per_node == 0,
                "workers",
                f"a multiple of the {per_node} workers per node of project_cluster = "
                f"{self.project_cluster!r} when speeds is set (the simulated clock's links)",
            )

        if self.churn:
            from shoal.experiments.churn import check_churn

            try:
                check_churn(self.churn, steps=self.steps, workers=self.workers)
            except ValueError as e:
                raise ConfigError(f"config field {e}") from None  # "churn = '...': ..."
            check_field(self.grad_chunk == 0, "grad_chunk", "0 when churn is set")

    def steps_per_program(self) -> int:
        """``scan_steps``, or for 0 the largest divisor of ``eval_every`` up to
        `AUTO_SCAN_STEPS`."""
        if self.scan_steps:
            return self.scan_steps
        return max(k for k in range(1, AUTO_SCAN_STEPS + 1) if self.eval_every % k == 0)

    def injection(self) -> tuple[int, int] | None:
        """``inject_nonfinite`` as ``(step, worker)``; None when unset or malformed."""
        step, colon, worker = self.inject_nonfinite.partition(":")
        if not (colon and step.strip().isdigit() and worker.strip().isdigit()):
            return None
        step, worker = int(step), int(worker)
        # A step past the last would never fire: the run would look as if it survived it.
        ok = 1 <= step <= self.steps and worker < self.workers
        return (step, worker) if ok else None


@dataclasses.dataclass(frozen=True)
class Config(TaskFields, RunFields):
    """One experiment: a task, the algorithms to compare on it, and how to train them.

    Every algorithm in ``algorithms`` trains from the same initial parameters on the
    same batches. The run's and the task's fields are flat ``--set`` keys (`RunFields`,
    `TaskFields`); ``params`` maps an algorithm's name to its hyper-parameters for this
    run (its module's dataclass, or a dict of its fields; the defaults for an algorithm
    not named), spelt ``--set diloco.sync_every=20``. One entry may change its own in
    brackets: ``algorithms=("diloco[sync_every=20]",)``.

    Example:
      >>> from shoal.experiments.config import Config
      >>> cfg = Config(algorithms=("ssgd", "gtc"), workers=4, params={"gtc": {"threshold": 0.05}})
      >>> cfg.steps, cfg.task, cfg.params["gtc"].threshold
      (200, 'mixture', 0.05)
      >>> Config(params={"ssgd": {"local": {"momentum": 1.0}}})
      Traceback (most recent call last):
      ...
      shoal.experiments.fields.ConfigError: config field 'momentum' must be a float in [0, 1)
    """

    # Algorithm name -> its hyper-parameters (`shoal.experiments.algorithms`); the
    # defaults are filled in for every algorithm in `algorithms`.
    params: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def seed_of_data(self) -> int:
        """The seed the bundled tasks generate their data from: ``data_seed``, else
        ``seed``."""
        return self.seed if self.data_seed is None else self.data_seed

    def seeded(self, seed: int) -> Config:
        """This config at ``seed`` (its initial model and batch order) on this config's
        data: ``data_seed`` is pinned to `seed_of_data` (`--seeds`).

        Example:
          >>> cfg = Config(seed=3).seeded(7)
          >>> cfg.seed, cfg.data_seed
          (7, 3)
        """
        return dataclasses.replace(self, seed=seed, data_seed=self.seed_of_data)

    def __post_init__(self):
        # Types first, for config files, --set, studies and direct construction alike (and
        # a subclass's own fields): the checks below compare and count. It also stores
        # lists as tuples (hashable, as annotated) and ints given for floats as floats.
        check_types(self)
        from shoal.experiments.algorithms import ALGORITHMS, check_params, parse_entry

        params = check_params(self.params)
        # Every algorithm the run names gets its defaults written out: the run's records,
        # summary and checkpoints then show every hyper-parameter it trained with.
        for entry in self.algorithms:
            name = parse_entry(entry)[0]
            if name in ALGORITHMS and name not in params:
                params[name] = ALGORITHMS[name].params()
        object.__setattr__(self, "params", params)
        self.check_run()
        self.check_task()
        rows = self.train_size - self.validation_size
        check_field(
            self.workers * self.batch_size <= rows,
            "batch_size",
            f"at most {'(train_size - validation_size)' if self.validation_size else 'train_size'}"
            f" / workers = {rows // self.workers} (one global batch must fit in the training set)",
        )
