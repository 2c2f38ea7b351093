"""Weights & Biases logs of a run (``log=wandb``): one wandb run per algorithm entry (per
entry and seed when the records carry a ``seed``), holding the scalars TensorBoard gets
(`shoal.experiments.reports.files.TENSORBOARD_TAGS`) at each record's step and the
entry's config.

Offline by default, with no account and no network: the runs are written under
``<out>/wandb/offline-run-*`` and uploaded later with ``wandb sync``. Setting
``WANDB_MODE`` (``online``, ``disabled``, ...) chooses otherwise. Needs the ``wandb``
package (the ``wandb`` extra); `wandb_problem` says at config time what is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

WANDB = "wandb"
# The values wandb.Settings takes for its mode (WANDB_MODE).
MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")
# The wandb project unless WANDB_PROJECT names one; a run's group is the config's name.
PROJECT = "shoal"


def wandb_mode() -> str:
    """``WANDB_MODE`` if set, else ``"offline"``: a run never needs an account."""
    return os.environ.get("WANDB_MODE") or "offline"


def wandb_problem() -> str | None:
    """Why ``log=wandb`` cannot write (None: it can): the package is missing, or
    ``WANDB_MODE`` is not a mode wandb knows. Asked before training, so that a run does
    not train and then fail to write."""
    if importlib.util.find_spec("wandb") is None:
        return (
            "config field 'log' = 'wandb' needs the wandb package: "
            "pip install wandb (from shoal's clone: pip install -e '.[wandb]')"
        )
    mode = wandb_mode()
    if mode not in MODES:
        return f"log=wandb: environment variable WANDB_MODE={mode!r} must be one of {MODES}"
    return None


def run_config(cfg: Any, entry: Any, seed: int | None = None) -> dict[str, Any]:
    """One wandb run's config: the run's and the task's fields of ``cfg`` (``params``
    left out), ``algorithm`` (the entry as written) and the entry's hyper-parameters
    nested under its algorithm's name; ``seed`` replaces the config's seed when given.

    Example:
      >>> from shoal.experiments.algorithms import resolve
      >>> from shoal.experiments.config import Config
      >>> cfg = Config(algorithms=("gtc[threshold=0.05]",), steps=4)
      >>> c = run_config(cfg, resolve(cfg.algorithms[0], cfg), seed=3)
      >>> c["algorithm"], c["gtc"]["threshold"], c["steps"], c["seed"]
      ('gtc[threshold=0.05]', 0.05, 4, 3)
    """
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "params"}
    config["algorithm"] = entry.label
    config[entry.name] = dataclasses.asdict(entry.params)
    if seed is not None:
        config["seed"] = seed
    return config


def scalars(record: dict[str, Any]) -> dict[str, Any]:
    """A record's values as logged: `TENSORBOARD_TAGS`' scalars under their tags (those
    the record holds), and a policy change as text under ``policy``."""
    from shoal.experiments.reports.files import TENSORBOARD_TAGS  # files imports this module

    row = {tag: record[k] for k, tag in TENSORBOARD_TAGS.items() if record.get(k) is not None}
    if "policy" in record:
        row["policy"] = record["policy"]
    return row


@contextlib.contextmanager
def _default_env(name: str, value: str) -> Iterator[None]:
    """``name=value`` in the environment while inside, unless ``name`` is set already."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


def write_wandb(
    out: Path, cfg: Any, records: Sequence[dict[str, Any]], entries: Sequence[Any] = ()
) -> Path:
    """Log ``records`` to wandb, one run per algorithm entry (and seed), written under
    ``out/wandb/``; returns that folder.

    A run is named after its entry (``gtc``), or ``gtc/seed1`` when the records hold
    several seeds; its config is `run_config`, its history `scalars` at each record's step.
    ``entries`` are the resolved entries (`shoal.experiments.algorithms.Entry`); one not
    among them is resolved from ``cfg``.

    Args:
      out: the run's output folder (it exists).
      cfg: the run's `shoal.experiments.config.Config`.
      records: every step's record, in step order within each entry and seed.
      entries: the run's resolved entries.
    Returns:
      ``out / "wandb"``.
    """
    try:
        import wandb
    except ImportError:
        raise ImportError("log=wandb needs the wandb package: pip install wandb") from None
    from shoal.experiments.algorithms import resolve

    settings = wandb.Settings(
        mode=wandb_mode(),
        silent=True,
        console="off",  # leave the runner's stdout and stderr alone
        disable_git=True,
        save_code=False,
        # The runs are written after training: the host's statistics and metadata now
        # would describe the writing, not the training (and probe cloud metadata servers).
        x_disable_stats=True,
        x_disable_meta=True,
        x_disable_machine_info=True,
    )
    by_label = {e.label: e for e in entries}
    seeded = len({r.get("seed") for r in records}) > 1  # several seeds: name each run's
    users_run = wandb.run is not None  # the caller's own run, which must live on
    # wandb sends its own errors to its servers unless told not to; its service process
    # reads the variable when it starts.
    with _default_env("WANDB_ERROR_REPORTING", "false"):
        for label, seed in dict.fromkeys((r["algorithm"], r.get("seed")) for r in records):
            entry = by_label.get(label) or resolve(label, cfg)
            run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or PROJECT,
                group=cfg.name,
                name=f"{label}/seed{seed}" if seeded else label,
                config=run_config(cfg, entry, seed),
                dir=str(out),
                settings=settings,
                reinit="create_new",  # a run per entry, beside any run of the caller's
            )
            try:
                for r in records:
                    if r["algorithm"] == label and r.get("seed") == seed:
                        run.log(scalars(r), step=r["step"])
            finally:
                run.finish()
        if not users_run:
            wandb.teardown()  # stops wandb's service process now, not at exit
    return out / WANDB
