"""Studies: many runs at several worker counts, reported as tables against a baseline.

A config file whose ``get_config()`` returns a `Study` instead of a `Config` makes
``shoal-run`` train every row of every table on simulated workers and write
``runs/<name>/`` with ``summary.md`` (one markdown table per `Table`: test error,
relative reduction of the error with respect to the baseline, MB sent per worker),
``results.jsonl`` (one summary per run) and ``metrics.jsonl`` (every step of every run)::

    shoal-run experiments/configs/acoustic_study.py

Every run trains from the same initial model on the same data, and sees the same
number of training examples (``epochs`` passes over the training set), as in a paper
that trains each method on the whole corpus: with ``N`` workers a run takes ``epochs
* train_size / (N * batch_size)`` steps. Rows that name the same (workers, algorithm)
run once. ``--set`` overrides apply to the shared config. With ``seeds`` (or
``shoal-run --seeds``) every run trains once per seed, each from its own initial model and
batch order on the same data (`Config.seeded`), and the tables show mean ± std over them.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from shoal.experiments import algorithms
from shoal.experiments.config import Config, ConfigError
from shoal.experiments.reports.files import json_line
from shoal.experiments.reports.seeds import spread
from shoal.experiments.runner.backends import SimBackend
from shoal.experiments.runner.train import check_grad_chunk, train
from shoal.experiments.tasks import make_task


@dataclasses.dataclass(frozen=True)
class Row:
    """One run: ``algorithm`` (a registry entry, brackets allowed) on ``workers``
    simulated workers; ``labels`` are the row's leading cells."""

    labels: tuple[str, ...]
    workers: int
    algorithm: str

    def __post_init__(self):
        object.__setattr__(self, "labels", tuple(self.labels))

    @property
    def key(self) -> tuple[int, str]:
        return self.workers, self.algorithm


@dataclasses.dataclass(frozen=True)
class Table:
    """A titled table; ``columns`` are the headers of the rows' label cells."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[Row, ...]
    note: str = ""

    def __post_init__(self):
        object.__setattr__(self, "columns", tuple(self.columns))
        object.__setattr__(self, "rows", tuple(self.rows))
        for r in self.rows:
            if len(r.labels) != len(self.columns):
                raise ConfigError(
                    f"table {self.title!r}: row {r.labels} needs one label per column"
                )


@dataclasses.dataclass(frozen=True)
class Study:
    """Tables of runs sharing ``config`` (task, data, local optimizer, algorithm defaults;
    its ``name`` names the output folder), each run ``epochs`` passes over the training
    set, every error compared with ``baseline``'s. Each run is tested ``evals`` times."""

    config: Config
    tables: tuple[Table, ...]
    epochs: int = 1
    baseline: Row = Row(("SGD",), 1, "ssgd")
    evals: int = 4
    description: str = ""
    # Seeds every run trains with (empty: the config's seed alone).
    seeds: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "tables", tuple(self.tables))
        object.__setattr__(self, "seeds", tuple(self.seeds))
        if not self.tables:
            raise ConfigError("a study needs at least one table")
        if self.epochs < 1 or self.evals < 1:
            raise ConfigError("a study's epochs and evals must be ints >= 1")
        if len(set(self.seeds)) < len(self.seeds) or any(
            not isinstance(s, int) or s < 0 for s in self.seeds
        ):
            raise ConfigError(f"a study's seeds must be distinct ints >= 0, got {self.seeds}")

    def seed_configs(self, run: Config) -> list[Config]:
        """``run`` once per seed (`Config.seeded`: the same data), or as it is."""
        return [run.seeded(s) for s in self.seeds] if self.seeds else [run]

    def runs(self) -> list[Row]:
        """The baseline, then every distinct (workers, algorithm) in table order."""
        seen, rows = set(), []
        for row in (self.baseline, *(r for t in self.tables for r in t.rows)):
            if row.key not in seen:
                seen.add(row.key)
                rows.append(row)
        return rows

    def run_config(self, row: Row) -> Config:
        """The config of one run, checked by its algorithm's builder."""
        cfg = self.config
        per_step = row.workers * cfg.batch_size
        if (self.epochs * cfg.train_size) % per_step:
            raise ConfigError(
                f"{row.algorithm} on {_workers(row.workers)}: epochs * train_size = "
                f"{self.epochs * cfg.train_size} is not a multiple of workers * batch_size = "
                f"{per_step}"
            )
        steps = self.epochs * cfg.train_size // per_step
        try:
            run = dataclasses.replace(
                cfg,
                workers=row.workers,
                steps=steps,
                eval_every=max(1, steps // self.evals),
                algorithms=(row.algorithm,),
            )
        except ValueError as e:
            raise ConfigError(f"{row.algorithm} on {_workers(row.workers)}: {e}") from None
        return run

    def resolve_runs(self) -> list[tuple[Row, Config, algorithms.Entry]]:
        """Every run (`runs`) with its config and resolved entry (`run_entry`): all of
        them checked, before any training; what `run_study` takes."""
        return [(row, *self.run_entry(row)) for row in self.runs()]

    def run_entry(self, row: Row) -> tuple[Config, algorithms.Entry]:
        """`run_config` and its one algorithm resolved (`algorithms.resolve`): what
        `run_study` trains; `ConfigError` for a run that cannot train."""
        run = self.run_config(row)
        check_grad_chunk(run.grad_chunk, "sim", run.workers)
        return run, algorithms.resolve(row.algorithm, run)


def run_study(
    study: Study,
    out: Path,
    *,
    command: str,
    progress: bool = True,
    resolved: list[tuple[Row, Config, algorithms.Entry]] | None = None,
) -> dict[tuple[int, str], dict[str, Any]]:
    """Train every run of ``study`` and write ``out``; ``resolved``: its
    `Study.resolve_runs` (made here when None: every config is checked before any
    training). Returns the summary of every run by ``(workers, algorithm)``: over several
    seeds, the mean of each number, with ``test_error_std`` and ``seeds`` (`over_seeds`)."""
    resolved = study.resolve_runs() if resolved is None else resolved
    start = time.perf_counter()
    backends: dict[int, SimBackend] = {}
    per_seed: dict[tuple[int, str], list[dict[str, Any]]] = {}
    records: list[dict[str, Any]] = []
    total = len(resolved) * max(1, len(study.seeds))
    i = 0
    for data_cfg in study.seed_configs(study.config):
        task = make_task(data_cfg)
        for row, run_cfg, entry in resolved:
            i += 1
            cfg = run_cfg.seeded(data_cfg.seed) if study.seeds else run_cfg
            entry = dataclasses.replace(entry, cfg=cfg)  # its builder sees the seed
            backend = backends.setdefault(row.workers, SimBackend(row.workers))
            result = train(cfg, task, backend, entry, progress=progress)
            per_seed.setdefault(row.key, []).append({"workers": row.workers, **result.summary})
            records += [{"workers": row.workers, **rec} for rec in result.records]
            s = result.summary
            print(f"[{i}/{total}] {row.algorithm} on {_workers(row.workers)}, seed {cfg.seed}, "
                  f"{cfg.steps} steps: test error {s['test_error']:.2%}, {s['mb_sent']:.2f} MB "
                  f"sent/worker, {s['wall_s']:.1f} s", flush=True)  # fmt: skip
    wall = time.perf_counter() - start
    summaries = {key: over_seeds(runs) for key, runs in per_seed.items()}

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "w") as f:
        for runs in per_seed.values():
            for s in runs:
                f.write(json_line(s))
    with open(out / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json_line(r))
    (out / "summary.md").write_text(
        summary_markdown(study, summaries, task=task, command=command, wall_s=wall)
    )
    return summaries


def over_seeds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's summaries over its seeds: the first's fields, each number replaced by
    its mean over the seeds, plus ``seeds`` (how many) and ``test_error_std`` (sample
    std, 0 for one seed)."""
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, float):  # the ints (workers, steps, seed) are the run's own
            out[k] = spread([r[k] for r in runs]).mean
    out.pop("seed", None)
    error = spread([r["test_error"] for r in runs])
    out["seeds"], out["test_error_std"] = error.n, error.std or 0.0
    return out


def _workers(n: int) -> str:
    return f"{n} worker" + ("s" if n != 1 else "")


def relative_reduction(error: float, baseline: float) -> float:
    """The paper's "relative error reduction" in percent: negative when worse than baseline;
    NaN when the baseline makes no error (no reduction is defined)."""
    if baseline == 0:
        return float("nan")
    return 100.0 * (baseline - error) / baseline


def _signed(value: float) -> str:
    return "n/a" if value != value else f"{value:+.1f}"  # NaN: the baseline made no error


def table_markdown(
    table: Table, summaries: dict[tuple[int, str], dict[str, Any]], baseline: float, error: str
) -> str:
    heads = (*table.columns, "steps", error, "rel. reduction (%)", "MB sent/worker", "wall s")
    lines = [
        "| " + " | ".join(heads) + " |",
        "|" + "|".join(["---"] * len(table.columns) + ["---:"] * 5) + "|",
    ]
    for row in table.rows:
        s = summaries[row.key]
        cells = (
            *row.labels,
            str(s["steps"]),
            f"{s['test_error']:.2%}"
            + (f" ± {s['test_error_std']:.2%}" if s.get("seeds", 1) > 1 else ""),
            _signed(relative_reduction(s["test_error"], baseline)),
            f"{s['mb_sent']:.2f}",
            f"{s['wall_s']:.1f}",
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_markdown(
    study: Study,
    summaries: dict[tuple[int, str], dict[str, Any]],
    *,
    task: Any,
    command: str,
    wall_s: float,
) -> str:
    cfg = study.config
    error = getattr(task, "error_name", "test error")
    base = summaries[study.baseline.key]
    base_err = base["test_error"]
    refs = getattr(task, "references", dict)()
    ref_lines = "".join(f"- {k}: {v:.2%}\n" for k, v in refs.items())
    tables = "\n\n".join(
        f"## {t.title}\n\n{table_markdown(t, summaries, base_err, error)}"
        + (f"\n\n{t.note}" if t.note else "")
        for t in study.tables
    )
    base_label = f"{' '.join(study.baseline.labels)} on {_workers(study.baseline.workers)}"
    unit = "sequences" if cfg.task == "hmm" else "examples"
    n = len(study.seeds)
    seeds = f" x {n} seeds ({', '.join(map(str, study.seeds))})" if n else ""
    spread = (
        f" With {n} seeds, each run trains from each seed's own initial model and batch order "
        f"on the same data; {error}s are mean ± sample std over the seeds, and the "
        "reduction compares the means."
        if n > 1
        else ""
    )
    base_spread = f" ± {base['test_error_std']:.2%}" if n > 1 else ""
    return f"""# {cfg.name}

`{command}`: {len(summaries)} runs{seeds} on simulated workers, {wall_s:.0f} s in all.

{study.description}

Every run trains from the same initial model on the same data for {study.epochs} epoch(s) of
the {cfg.train_size} training {unit} ({cfg.batch_size} per worker and step), and reports the
{error} of its final model on the {cfg.test_size} test {unit} (for BMUF and BMUF_GTC the
global model of the last BMUF step, which is the last step). "rel. reduction" is the
paper's relative error reduction with respect to the baseline, {base_label}
(`{study.baseline.algorithm}`): `100 * (baseline - error) / baseline`, negative is worse.{spread}
MB: 10^6 bytes sent per worker in the whole run: every step's `shoal.comms.wire_bytes`.
Wall time includes compilation.

Baseline {error}: {base_err:.2%}{base_spread} ({base["steps"]} steps, {base["wall_s"]:.1f} s).
{ref_lines}
{tables}

Per-run summaries: `results.jsonl`; per-step metrics: `metrics.jsonl`.
"""
