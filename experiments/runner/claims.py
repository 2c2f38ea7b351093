"""Reproductions: papers' claims, each stated as its paper states it, measured on equal
tokens over several seeds and judged (``shoal-run experiments/configs/reproduce.py``).

A config file whose ``get_config()`` returns a `Reproduction` makes ``shoal-run`` train
every `Arm` of every `Claim` (each distinct ``(workers, algorithm)`` once), every arm's
main learning rate first tuned on the validation split (`shoal.experiments.runner.sweep.
tune`: a grid of factors on a fraction of the run, judged by validation loss, never on
the test set), then any further grids (``tune_also``, e.g. DiLoCo's outer momentum) in
turn for the arms that have them, then trained once per seed. Every arm trains
``tokens`` tokens: ``steps = tokens / (workers * batch_size * seq_len)``.

Every tuning and every run is written to ``out/arms/`` as it ends; ``shoal-run ...
--resume`` continues a stopped reproduction from them (those of a different config are
redone).

A claim compares its ``method`` with its ``reference`` by the final test loss (mean ±
sample std over the seeds) and, where the paper says so, by the bytes each worker sent
(exact, the same every seed)::

    d = loss_method - (1 + within) * loss_reference,   s = sqrt(s_m^2 + (1 + within)^2 s_r^2)

    holds          d + s <= 0  (and the bytes are at least ``fewer_bytes`` times fewer)
    does not hold  d - s > 0   (or the bytes are not)
    inconclusive   otherwise: the intervals overlap

``within = 0`` reads "a lower loss", ``0.01`` "within 1%" (or "no worse", as shoal reads
it: within 1%), ``0.03`` "within a few percent".

A seed *diverged* when its final test loss is not finite or above its first step's
training loss (the model ends worse than it started). Its loss is shown apart and left
out of the mean: a method that diverged on any seed does not hold, and against a
reference that diverged nothing is concluded (inconclusive).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from pathlib import Path
from typing import Any

from shoal.experiments import algorithms
from shoal.experiments.config import Config, ConfigError
from shoal.experiments.reports.files import write_jsonl
from shoal.experiments.reports.seeds import Spread, spread
from shoal.experiments.runner.backends import SimBackend
from shoal.experiments.runner.sweep import MAIN_RATE, swept_path, tune, with_value
from shoal.experiments.runner.train import train
from shoal.experiments.tasks import make_task

VERDICTS = ("holds", "does not hold", "inconclusive")


@dataclasses.dataclass(frozen=True)
class Arm:
    """One run of a claim: ``algorithm`` (a registry entry, brackets allowed) on
    ``workers`` simulated workers, named ``label`` in the table. With ``tuned_as`` (the
    label of another arm of the reproduction) it takes that arm's tuned values instead of
    tuning its own: DiLoCo at H = 10 and 100 as at H = 50, which saves a third of the
    tuning runs."""

    label: str
    algorithm: str
    workers: int
    tuned_as: str = ""

    @property
    def key(self) -> tuple[int, str]:
        return self.workers, self.algorithm


@dataclasses.dataclass(frozen=True)
class Claim:
    """A paper's claim: ``method`` against ``reference`` (module docstring).

    Attributes:
      name: a short name ("DiLoCo, M = 8").
      paper: where it is stated ("arXiv 2311.08105, Table 2").
      statement: the claim in the paper's words, as tested here.
      method, reference: the two runs compared.
      within: how much higher (relative) the method's loss may be; 0: lower.
      fewer_bytes: the method's bytes per worker at least this many times fewer than the
        reference's (None: bytes not claimed).
      peak: compare the largest step's bytes (Streaming DiLoCo's peak bandwidth), not
        the run's.
    """

    name: str
    paper: str
    statement: str
    method: Arm
    reference: Arm
    within: float = 0.0
    fewer_bytes: float | None = None
    peak: bool = False


@dataclasses.dataclass(frozen=True)
class Reproduction:
    """Claims measured on ``config``'s task, every arm ``tokens`` tokens, over ``seeds``,
    every arm's main learning rate tuned first over ``sweep`` (factors of its own) on
    ``sweep_fraction`` of its steps (no grid: no tuning), then each ``(path, values)`` of
    ``tune_also`` in turn, from the values chosen before, for the arms that have ``path``
    (``("outer.momentum", ("0.5", "0.9"))``)."""

    config: Config
    claims: tuple[Claim, ...]
    tokens: int
    seeds: tuple[int, ...] = (0, 1, 2)
    sweep: tuple[str, ...] = ("x0.5", "x1", "x2")
    tune_also: tuple[tuple[str, tuple[str, ...]], ...] = ()
    sweep_fraction: float = 0.5
    evals: int = 4
    description: str = ""

    def __post_init__(self):
        object.__setattr__(self, "claims", tuple(self.claims))
        object.__setattr__(self, "seeds", tuple(self.seeds))
        object.__setattr__(self, "sweep", tuple(self.sweep))
        object.__setattr__(self, "tune_also",
                           tuple((k, tuple(v)) for k, v in self.tune_also))  # fmt: skip
        for key, values in self.tune_also:
            if key == MAIN_RATE or not values or len(set(values)) < len(values):
                raise ConfigError(
                    f"a reproduction's tune_also grid {key!r}: a dotted path other than "
                    f"{MAIN_RATE!r} (the sweep's) with distinct values, got {values}"
                )
        if not self.claims:
            raise ConfigError("a reproduction needs at least one claim")
        if not self.seeds or len(set(self.seeds)) < len(self.seeds):
            raise ConfigError(f"a reproduction's seeds must be distinct, got {self.seeds}")
        if self.tokens < 1 or self.evals < 1:
            raise ConfigError("a reproduction's tokens and evals must be ints >= 1")
        for arm in self.arms():
            if arm.tuned_as and self.arm(arm.tuned_as).tuned_as:
                raise ConfigError(f"{arm.label}: tuned_as {arm.tuned_as!r}, which is itself "
                                  "tuned as another arm: name that one")  # fmt: skip

    def arms(self) -> list[Arm]:
        """Every distinct ``(workers, algorithm)``, in claim order."""
        seen: dict[tuple[int, str], Arm] = {}
        for c in self.claims:
            for arm in (c.method, c.reference):
                seen.setdefault(arm.key, arm)
        return list(seen.values())

    def arm(self, label: str) -> Arm:
        """The arm named ``label``."""
        found = [a for a in self.arms() if a.label == label]
        if not found:
            raise ConfigError(f"a reproduction has no arm {label!r} (tuned_as names one)")
        return found[0]

    def arm_config(self, arm: Arm) -> Config:
        """The config of one arm: its workers, the steps that make ``tokens``."""
        cfg = self.config
        per_step = arm.workers * cfg.batch_size * cfg.seq_len
        if self.tokens % per_step:
            raise ConfigError(
                f"{arm.label}: tokens = {self.tokens} is not a multiple of workers * "
                f"batch_size * seq_len = {per_step}"
            )
        steps = self.tokens // per_step
        run = dataclasses.replace(cfg, workers=arm.workers, steps=steps,
                                  algorithms=(arm.algorithm,),
                                  eval_every=max(1, steps // self.evals))  # fmt: skip
        algorithms.resolve(arm.algorithm, run)  # its own checks (steps a multiple of H, ...)
        return run


def judge(method: Spread, reference: Spread, within: float, bytes_ok: bool = True) -> str:
    """The verdict of the module docstring's rule; a method whose loss is not finite on
    some seed (it diverged) does not hold, and against a reference that diverged nothing
    is concluded."""
    if not math.isfinite(method.mean):
        return "does not hold"
    if not math.isfinite(reference.mean):
        return "inconclusive"
    scale = 1.0 + within
    d = method.mean - scale * reference.mean
    s = math.hypot(method.std or 0.0, scale * (reference.std or 0.0))
    if not bytes_ok or d - s > 0:
        return "does not hold"
    return "holds" if d + s <= 0 else "inconclusive"


def run_reproduction(rep: Reproduction, out: Path, *, command: str, progress: bool = True,
                     resume: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    """Tune and train every arm of ``rep`` and write ``out``: ``reproduce.md`` (the
    table), ``claims.png`` (every claim's test loss against tokens), ``results.jsonl`` (a
    summary per arm and seed), ``metrics.jsonl`` (every step), and ``arms/`` (each
    tuning and run as it ends). With ``resume``, what ``arms/`` already holds for the
    same config is read instead of trained again. Returns the table's rows."""
    start = time.perf_counter()
    configs = {arm.key: rep.arm_config(arm) for arm in rep.arms()}  # all checked first
    saved = _Saved(out / "arms", resume)
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    tuned: dict[tuple[int, str], list[dict[str, Any]]] = {}
    records: list[dict[str, Any]] = []
    read_back = 0  # runs a resumed reproduction read from arms/ rather than trained

    done: dict[str, list[dict[str, Any]]] = {}

    def tuning(arm: Arm) -> list[dict[str, Any]]:
        """The rows of ``arm``'s tuning: done before, read, or tuned now and saved."""
        if arm.label not in done:
            cfg = configs[arm.key].seeded(rep.seeds[0])
            stamp = repr((_own(cfg), rep.sweep, rep.tune_also, rep.sweep_fraction))
            found = saved.read(arm, "tuning", stamp)
            if found is None:
                found = {"rows": _tune(rep, arm.algorithm, cfg, SimBackend(arm.workers),
                                       progress)}  # fmt: skip
                saved.write(arm, "tuning", stamp, found)
            done[arm.label] = found["rows"]
        return done[arm.label]

    for arm in rep.arms():
        backend = SimBackend(arm.workers)
        rows = tuning(rep.arm(arm.tuned_as) if arm.tuned_as else arm)
        label = arm.algorithm
        for row in rows:  # the values chosen, set in this arm's brackets
            label = with_value(label, row["path"], row["value"])
        if rows and not arm.tuned_as:
            tuned[arm.key] = rows
        for seed in rep.seeds:
            run_cfg = dataclasses.replace(configs[arm.key], algorithms=(label,)).seeded(seed)
            found = saved.read(arm, f"seed{seed}", repr(_own(run_cfg)))
            read_back += found is not None
            how = " (saved)" if found is not None else ""
            if found is None:
                result = train(run_cfg, make_task(run_cfg), backend,
                               algorithms.resolve(label, run_cfg), progress=progress)  # fmt: skip
                found = {"summary": {"arm": arm.label, "workers": arm.workers, **result.summary},
                         "records": [{"arm": arm.label, "workers": arm.workers, **r}
                                     for r in result.records]}  # fmt: skip
                saved.write(arm, f"seed{seed}", repr(_own(run_cfg)), found)
            summary = {**found["summary"], "diverged": _diverged(found)}
            runs.setdefault(arm.key, []).append(summary)
            records += found["records"]
            print(f"{arm.label} ({label}), seed {seed}{how}: test loss "
                  f"{summary['test_loss']:.4f}, {summary['mb_sent']:.3f} MB sent/worker",
                  flush=True)  # fmt: skip
    rows = [_row(c, runs) for c in rep.claims]
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "results.jsonl", [s for summaries in runs.values() for s in summaries])
    write_jsonl(out / "metrics.jsonl", records)
    runs_s = sum(s.get("wall_s", 0.0) for summaries in runs.values() for s in summaries)
    text = markdown(rep, rows, tuned, command=command, wall_s=time.perf_counter() - start,
                    read_back=read_back, runs_s=runs_s)  # fmt: skip
    (out / "reproduce.md").write_text(text)
    plot_claims(out / "claims.png", rep, records)
    return rows


def _tune(rep: Reproduction, algorithm: str, cfg: Config, backend: SimBackend,
          progress: bool) -> list[dict[str, Any]]:  # fmt: skip
    """One row per grid of ``rep`` that the arm has (the main rate's, then
    ``tune_also``'s), each tuned from the values chosen before it."""
    label, rows = algorithm, []
    grids = ([(MAIN_RATE, rep.sweep)] if rep.sweep else []) + list(rep.tune_also)
    for key, values in grids:
        entry = algorithms.resolve(label, cfg)
        if key != MAIN_RATE:
            try:
                swept_path(entry, key)
            except ConfigError:  # not this arm's knob (an outer momentum of S-SGD)
                continue
        labels, found, _ = tune(cfg, [entry], backend, key=key, values=values,
                                fraction=rep.sweep_fraction, progress=progress)  # fmt: skip
        label = labels[0]
        rows.append({**found[0], "grid": list(values)})
    return rows


def _own(cfg: Config) -> Config:
    """``cfg`` with the parameters of its own algorithms only: what a saved run is
    stamped with, so that setting another arm's parameters redoes nothing else."""
    names = {algorithms.parse_entry(a)[0] for a in cfg.algorithms}
    return dataclasses.replace(cfg, params={k: v for k, v in cfg.params.items() if k in names})


class _Saved:
    """``arms/<workers>-<algorithm>/<what>.json``: one tuning or run of an arm, with the
    config it was made with (``stamp``), so that a resumed reproduction reads only what
    the same config made."""

    def __init__(self, folder: Path, resume: bool):
        self.folder, self.resume = folder, resume

    def path(self, arm: Arm, what: str) -> Path:
        name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{arm.workers}-{arm.algorithm}")
        return self.folder / name / f"{what}.json"

    def read(self, arm: Arm, what: str, stamp: str) -> dict[str, Any] | None:
        path = self.path(arm, what)
        if not (self.resume and path.is_file()):
            return None
        saved = json.loads(path.read_text())
        return saved["data"] if saved.get("stamp") == stamp else None

    def write(self, arm: Arm, what: str, stamp: str, data: dict[str, Any]) -> None:
        path = self.path(arm, what)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")  # a stop mid-write leaves no half file behind
        # Python's JSON, NaN and all (a diverged run's loss reads back as it was).
        tmp.write_text(json.dumps({"stamp": stamp, "data": data}, default=float))
        tmp.replace(path)


def plot_claims(path: Path, rep: Reproduction, records: list[dict[str, Any]]) -> None:
    """One panel per claim: the method's and the reference's test loss against the tokens
    seen, the mean over the seeds and their range."""
    import numpy as np
    from matplotlib.figure import Figure

    cols = min(4, len(rep.claims))
    rows = -(-len(rep.claims) // cols)
    fig = Figure(figsize=(4.2 * cols, 3.2 * rows), layout="constrained")
    for i, claim in enumerate(rep.claims):
        ax = fig.add_subplot(rows, cols, i + 1)
        for arm, color in ((claim.reference, "tab:gray"), (claim.method, "tab:blue")):
            seen: dict[int, list[float]] = {}
            for r in records:
                if r["arm"] == arm.label and r.get("test_loss") is not None:
                    seen.setdefault(r["tokens"], []).append(r["test_loss"])
            x = np.asarray(sorted(seen)) / 1e6
            losses = [np.asarray(seen[t]) for t in sorted(seen)]
            ax.plot(x, [v.mean() for v in losses], color=color, marker=".", label=arm.label)
            ax.fill_between(x, [v.min() for v in losses], [v.max() for v in losses],
                            color=color, alpha=0.2, linewidth=0)  # fmt: skip
        ax.set_title(claim.name, fontsize=9)
        ax.set_xlabel("M tokens", fontsize=8)
        ax.set_ylabel("test loss (nats/byte)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)


def _diverged(run: dict[str, Any]) -> bool:
    """Whether a saved run (``summary`` and ``records``) diverged: its final test loss is
    not finite or above its first step's training loss."""
    final = run["summary"]["test_loss"]
    first = run["records"][0]["loss"] if run["records"] else math.inf
    return not math.isfinite(final) or final > first


def _kept(summaries: list[dict[str, Any]], gone: dict[int, float]) -> Spread:
    """The spread of the test losses of the seeds not in ``gone`` (n = 0: none left)."""
    kept = [s["test_loss"] for s in summaries if s["seed"] not in gone]
    return spread(kept) if kept else Spread(math.nan, None, 0)


def _row(claim: Claim, runs: dict[tuple[int, str], list[dict[str, Any]]]) -> dict[str, Any]:
    m, r = runs[claim.method.key], runs[claim.reference.key]
    # The diverged seeds apart: one seed at 1e9 would make any interval overlap.
    gone_m = {s["seed"]: s["test_loss"] for s in m if s.get("diverged")}
    gone_r = {s["seed"]: s["test_loss"] for s in r if s.get("diverged")}
    loss_m, loss_r = _kept(m, gone_m), _kept(r, gone_r)
    key = "peak_kb_sent" if claim.peak else "mb_sent"
    sent_m, sent_r = m[0][key], r[0][key]
    # None where neither sends (one worker): no ratio to claim or show.
    ratio = None if not (sent_m or sent_r) else sent_r / sent_m if sent_m else math.inf
    ok = claim.fewer_bytes is None or (ratio is not None and ratio >= claim.fewer_bytes)
    if gone_m:
        verdict = "does not hold"
    elif gone_r:
        verdict = "inconclusive"
    else:
        verdict = judge(loss_m, loss_r, claim.within, ok)
    return {"claim": claim.name, "paper": claim.paper, "statement": claim.statement,
            "method": claim.method.label, "reference": claim.reference.label,
            "loss_method": loss_m, "loss_reference": loss_r, "bytes_ratio": ratio,
            "diverged_method": gone_m, "diverged_reference": gone_r,
            "verdict": verdict, "within": claim.within,
            "fewer_bytes": claim.fewer_bytes, "peak": claim.peak}  # fmt: skip


def _loss(s: Spread, diverged: dict[int, float], n: int = 0) -> str:
    """Mean ± std of the seeds that did not diverge (their count where it is not ``n``,
    the table's), then those that did."""
    text = f"{s.mean:.3f} ± {s.std or 0.0:.3f}" if s.n else "-"
    text += f" (n = {s.n})" if s.n and s.n != n else ""
    if diverged:
        text += "; diverged: " + ", ".join(f"seed {k} at {v:.3g}" for k, v in diverged.items())
    return text


def markdown(rep: Reproduction, rows: list[dict[str, Any]], tuned: dict, *, command: str,
             wall_s: float, read_back: int = 0, runs_s: float = 0.0) -> str:  # fmt: skip
    """``reproduce.md``: the table, how it was measured, and the tuning. ``read_back``
    runs came from ``arms/`` (``--resume``); ``runs_s`` is the seeded runs' own time,
    summed, saved ones included (the tuning's is not)."""
    cfg = rep.config
    n_runs = len(rep.arms()) * len(rep.seeds)
    took = f"{wall_s:.0f} s"
    if read_back:  # a resumed study's time is not the study's: say what was read back
        took += (
            f" this time, {read_back} of the {n_runs} runs read back from `arms/` "
            f"(`--resume`); the {n_runs} runs themselves took {runs_s:.0f} s"
        )
    n = len(rep.seeds)
    lines = [  # the README's "Does it reproduce?" table, as it is
        f"| claim | paper | method | test loss, method (n = {n}) | reference | test loss, "
        f"reference (n = {n}) | bytes per worker, reference / method | verdict |",
        "|---|---|---|---:|---|---:|---:|---|",
    ]
    for r in rows:
        which = "peak step" if r["peak"] else "run"
        need = f" (claimed >= {r['fewer_bytes']:g}x)" if r["fewer_bytes"] else ""
        ratio = "-" if r["bytes_ratio"] is None else f"{r['bytes_ratio']:.3g}x {which}{need}"
        lines.append(
            f"| {r['claim']} | {r['paper']} | {r['method']} | "
            f"{_loss(r['loss_method'], r['diverged_method'], n)} | {r['reference']} | "
            f"{_loss(r['loss_reference'], r['diverged_reference'], n)} | "
            f"{ratio} | **{r['verdict']}** |"
        )
    statements = "\n".join(
        f"- **{r['claim']}** ({r['paper']}): {r['statement']} Judged: the method's loss "
        + (
            "below the reference's"
            if not r["within"]
            else f"at most {r['within']:.0%} above the reference's"
        )  # fmt: skip
        + "."
        for r in rows
    )
    shared = {a.label: a.tuned_as for a in rep.arms() if a.tuned_as}

    def edge(row) -> str:  # a value at the end of its grid may not be the best there is
        grid = list(row.get("grid", rep.sweep))
        return ", the grid's edge" if len(grid) > 1 and row["chosen"] in (grid[0], grid[-1]) else ""

    tuning = "\n".join(
        f"- {key[1]} on {key[0]} worker(s): {row['path']} = {row['value']} "
        f"(validation loss "
        + ", ".join(f"{v}: {row['losses'][v]:.4f}" for v in row.get("grid", rep.sweep))
        + f"{edge(row)})"  # fmt: skip
        for key, rows in tuned.items()
        for row in rows
    ) + "".join(f"\n- {label}: as {other}" for label, other in shared.items())
    about = f"{rep.description}\n\n" if rep.description else ""
    if rep.sweep:
        tuning_text = (
            f"Each arm's main learning rate, {', '.join(rep.sweep)} times its own"
            + "".join(f", then {k} over {', '.join(v)}" for k, v in rep.tune_also)
            + f", on {rep.sweep_fraction:g} of its steps, judged by the loss on the "
            f"validation files (never the test files), seed {rep.seeds[0]}:\n\n{tuning}"
        )
    else:
        tuning_text = "None: every arm trained with its configured learning rates."
    seeds = ", ".join(map(str, rep.seeds))
    return f"""# Does it reproduce? ({cfg.name})

`{command}`: {len(rep.arms())} arms x {len(rep.seeds)} seeds, {took}.

{about}Every arm trains {rep.tokens:,} tokens of the `{cfg.task}` task ({cfg.batch_size} \
windows of {cfg.seq_len} tokens per worker and step) and is judged by its test loss at \
the end, mean ± sample std over seeds {seeds}. A verdict is "holds" when the method's \
interval clears the claimed bound, "does not hold" when it clearly misses it (or the \
bytes miss theirs), "inconclusive" when they overlap (`shoal.experiments.runner.claims`). \
Every claim's test loss against the tokens seen: `claims.png`.

{chr(10).join(lines)}

{statements}

## Tuning

{tuning_text}
"""
