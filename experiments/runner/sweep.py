"""Fair tuning (``shoal-run --sweep``): every entry tries every value of a grid on a short
horizon, is judged by its loss on a validation split held out of the training data (never
the test set), and then trains with its best value over the seeds.

A grid key is ``learning_rate`` (each entry's own main learning rate: the local
optimizer's, DiLoCo's inner one, LAMB's; `swept_path` finds it) or a dotted path in the
entry's hyper-parameters (``outer.learning_rate``). A value is a number, or ``xF``: F
times the entry's own value, so that one grid suits optimizers whose rates differ by
orders of magnitude (SGD at 0.1, AdamW at 1e-3). A value is tried as a bracket of the
entry, so the chosen run's label says what it trained with::

    shoal-run compression_pareto_lm --sweep learning_rate=x0.3,x1,x3 --seeds 0,1,2

trains ``gtc[local.learning_rate=0.3]`` (say) on seeds 0, 1 and 2 after the sweep. The
sweep runs on the first seed, for ``--sweep-fraction`` of the run's steps (shortened to
the nearest horizon every entry accepts, e.g. a whole number of BMUF blocks). A shortened
run is biased towards rates that fall fast early, and it shortens whatever is a fraction
of the run (1-bit LAMB's freeze step, a cosine decay's horizon): ``--sweep-fraction 1``
tunes the run itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from shoal.experiments import algorithms
from shoal.experiments.algorithms.parts import InnerOptimizer, OuterSGD
from shoal.experiments.config import Config, ConfigError
from shoal.experiments.tasks import make_task

# What `swept_path` looks for under the key "learning_rate".
MAIN_RATE = "learning_rate"


def parse_sweep(text: str) -> tuple[str, tuple[str, ...]]:
    """``"learning_rate=0.03,0.1"`` -> ``("learning_rate", ("0.03", "0.1"))``.

    Raises:
      argparse.ArgumentTypeError: naming ``--sweep`` and what is missing.
    """
    key, eq, values = text.partition("=")
    grid = tuple(v.strip() for v in values.split(",") if v.strip())
    if not eq or not key.strip() or not grid:
        raise argparse.ArgumentTypeError(
            f"--sweep takes KEY=V1,V2,..., e.g. learning_rate=0.03,0.1,0.3 or x0.3,x1,x3; "
            f"got {text!r}"
        )
    factors = [v for v in grid if v.startswith("x")]
    if factors and len(factors) < len(grid):
        raise argparse.ArgumentTypeError(
            f"--sweep {key}: give all values as numbers or all as factors xF, not both"
        )
    for v in factors:
        try:
            ok = float(v[1:]) > 0
        except ValueError:
            ok = False
        if not ok:
            raise argparse.ArgumentTypeError(f"--sweep {key}: {v!r} is not a factor xF, F > 0")
    if len(set(grid)) < len(grid):
        raise argparse.ArgumentTypeError(f"--sweep {key}: repeated values in {values!r}")
    return key.strip(), grid


def _rate_paths(value: Any, prefix: str = "") -> list[str]:
    """Every ``learning_rate`` field under ``value`` that sets a per-worker step size:
    not the outer optimizer's, and only the inner optimizer in use."""
    if isinstance(value, OuterSGD):
        return []
    found = []
    for f in dataclasses.fields(value):
        if isinstance(value, InnerOptimizer) and f.name in ("sgd", "adamw") and f.name != value.use:
            continue
        child = getattr(value, f.name)
        if dataclasses.is_dataclass(child):
            found += _rate_paths(child, f"{prefix}{f.name}.")
        elif f.name == MAIN_RATE:
            found.append(f"{prefix}{f.name}")
    return found


def swept_path(entry: algorithms.Entry, key: str) -> str:
    """The path in ``entry``'s hyper-parameters that the grid key ``key`` sets.

    Example:
      >>> from shoal.experiments.config import Config
      >>> cfg = Config(algorithms=("ssgd", "diloco"), workers=2, steps=20)
      >>> [swept_path(e, "learning_rate") for e in algorithms.resolve_all(cfg)]
      ['local.learning_rate', 'inner.adamw.learning_rate']
    """
    if key == MAIN_RATE:
        paths = _rate_paths(entry.params)
        if len(paths) != 1:
            raise ConfigError(
                f"--sweep {key}: {entry.label} has "
                + (f"several ({', '.join(paths)})" if paths else "no learning rate")
                + ": give the path of the one to tune, e.g. --sweep "
                + (f"{paths[0]}=..." if paths else "outer.learning_rate=...")
            )
        return paths[0]
    value = entry.params
    for part in key.split("."):
        part_of = dataclasses.is_dataclass(value) and hasattr(value, part)
        if not part_of:
            raise ConfigError(
                f"--sweep {key}: {entry.label} has no {key!r} (its hyper-parameters: "
                f"{', '.join(f.name for f in dataclasses.fields(entry.params))})"
            )
        value = getattr(value, part)
    return key


def value_at(params: Any, path: str) -> Any:
    """The value at the dotted ``path`` in ``params``."""
    for part in path.split("."):
        params = getattr(params, part)
    return params


def resolved_value(entry: algorithms.Entry, path: str, value: str) -> str:
    """``value`` as the text to set: a factor ``xF`` times the entry's own value."""
    if not value.startswith("x"):
        return value
    # Six significant digits: 0.1 * 3 is written 0.3, not 0.30000000000000004.
    return format(float(value_at(entry.params, path)) * float(value[1:]), ".6g")


def with_value(label: str, path: str, value: str) -> str:
    """``label`` with ``path=value`` added to its brackets (the entry's own override)."""
    name, overrides = algorithms.parse_entry(label)
    kept = [o for o in overrides if o.partition("=")[0].strip() != path]
    return f"{name}[{';'.join([*kept, f'{path}={value}'])}]"


def validation_rows(cfg: Config) -> int:
    """The rows held out for validation during the sweep: ``validation_size`` if set,
    else as many as the test set has (at most a quarter of the training set)."""
    return cfg.validation_size or min(cfg.test_size, cfg.train_size // 4)


def tuning_config(cfg: Config, fraction: float, entries: Sequence[algorithms.Entry]) -> Config:
    """``cfg`` for the sweep: ``fraction`` of its steps (the longest horizon at most that
    long that every entry accepts), one evaluation at the end, on a validation split."""
    if not 0 < fraction <= 1:
        raise ConfigError(f"--sweep-fraction must be in (0, 1], got {fraction}")
    longest = max(1, round(fraction * cfg.steps))
    rows = validation_rows(cfg)
    why = ""
    for steps in range(longest, 0, -1):
        try:
            tune = dataclasses.replace(cfg, steps=steps, eval_every=steps, validation_size=rows,
                                       checkpoint_every=0, inject_nonfinite="")  # fmt: skip
            for e in entries:
                algorithms.resolve(e.label, tune)
        except ConfigError as err:  # e.g. not a whole number of BMUF blocks
            why = str(err)
            continue
        return tune
    raise ConfigError(f"--sweep-fraction {fraction}: no horizon of at most {longest} steps "
                      f"suits every entry ({why})")  # fmt: skip


def _number(value: str) -> float:
    return float(value[1:] if value.startswith("x") else value)


def choose(losses: dict[str, float], values: Sequence[str]) -> tuple[str, bool]:
    """The value with the lowest validation loss, and whether any value stayed finite;
    if none did, the smallest value (the likeliest to be stable) is returned."""
    finite = {v: losses[v] for v in values if math.isfinite(losses[v])}
    if not finite:
        return min(values, key=_number), False
    return min(finite, key=finite.__getitem__), True


def sweep_section(rows: Sequence[dict[str, Any]], *, key: str, values: Sequence[str],
                  steps: int, total: int, validation: int, seed: int) -> str:  # fmt: skip
    """The report's section: the grid, the horizon, every entry's validation losses and
    the value it then trained with."""
    head = f"| entry | tuned | {' | '.join(values)} | chosen |"
    lines = [head, "|---|---|" + "---:|" * len(values) + "---|"]
    for r in rows:
        cells = [f"{r['losses'][v]:.4f}" if math.isfinite(r["losses"][v]) else "diverged"
                 for v in values]  # fmt: skip
        chosen = r["chosen"] if r["chosen"] == r["value"] else f"{r['chosen']} = {r['value']}"
        if not r["finite"]:
            chosen += " (diverged at every value)"
        elif r["chosen"] in (min(values, key=_number), max(values, key=_number)):
            chosen += " (edge of the grid)"  # the best may lie outside it
        lines.append(f"| {r['entry']} | {r['path']} | {' | '.join(cells)} | {chosen} |")
    return (
        f"\n## Tuning\n\n`--sweep {key}={','.join(values)}`: every entry trained "
        f"{steps} of the {total} steps at each value (seed {seed}), then was judged by its "
        f"loss on {validation} rows held out of the training set (not the test set); it "
        f"then trained with the value of lowest validation loss. Validation loss:\n\n"
        + "\n".join(lines)
        + "\n"
    )


def tune(
    cfg: Config,
    entries: Sequence[algorithms.Entry],
    backend: Any,
    *,
    key: str,
    values: Sequence[str],
    fraction: float,
    progress: bool = True,
) -> tuple[list[str], list[dict[str, Any]], Config]:
    """Train every entry of ``cfg`` at every value of the grid on the tuning horizon
    (`tuning_config`) and pick each one's value by validation loss (`choose`).

    Returns:
      ``(labels, rows, tune)``: the chosen entries' labels (`with_value`), one row per
      entry (its path, validation loss per value, choice) on every process, and the
      tuning config.
    """
    from shoal.experiments.runner.train import train  # the runner's loop (no cycle)

    paths = [swept_path(e, key) for e in entries]  # every bad key before any training
    tune_cfg = tuning_config(cfg, fraction, entries)
    task = make_task(tune_cfg)
    if getattr(task, "validation", None) is None:
        raise ConfigError(
            f"--sweep tunes on a validation split held out of the training data, and task "
            f"{cfg.task!r} holds none out: give it a `validation` (x, y) of "
            f"cfg.validation_size rows taken from its training set, as the bundled tasks do "
            f"(shoal.experiments.tasks.classifier.ClassifierTask.hold_out)"
        )
    labels, rows = [], []
    for entry, path in zip(entries, paths, strict=True):
        losses, texts = {}, {v: resolved_value(entry, path, v) for v in values}
        for value in values:
            candidate = algorithms.resolve(with_value(entry.label, path, texts[value]), tune_cfg)
            result = train(tune_cfg, task, backend, candidate, progress=progress)
            loss = result.summary["test_loss"] if backend.is_root else None
            losses[value] = backend.share(loss)  # the root's records decide for all
        chosen, finite = choose(losses, values)
        labels.append(with_value(entry.label, path, texts[chosen]))
        rows.append({"entry": entry.label, "path": path, "losses": losses, "chosen": chosen,
                     "value": texts[chosen], "finite": finite})  # fmt: skip
        if backend.is_root:
            print(f"tuned {entry.label}: {path}={texts[chosen]} (validation loss "
                  f"{losses[chosen]:.4f})", flush=True)  # fmt: skip
    return labels, rows, tune_cfg
