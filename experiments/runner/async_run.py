"""`shoal-run` for an asynchronous algorithm (`Algorithm.asynchronous`): its rounds played
on the simulated clock by `shoal.experiments.asynchronous.simulate`, reported as the
runner reports every algorithm.

The workers' speeds are the config's (``speeds``, ``compute_ms``; ``speeds = ""`` is
every worker at one step's time), a push or pull crosses ``project_cluster``'s link
between nodes. Worker ``i``'s ``k``-th step trains on block ``i`` of the run's ``k``-th
batch, as a synchronous worker's ``k``-th step does, and the run ends after ``steps``
steps' worth of inner steps (``steps x workers``). Records are per such step: step ``s``
is written at the first outer step after which ``s x workers`` inner steps have been
applied, with the clock then, the mean loss of the rounds applied since the previous
record, the bytes pushed and pulled since, and, every ``eval_every`` steps, the test
metrics of the global model. So its curves lie beside a synchronous run's at equal
tokens.

Under ``churn`` worker ``i`` trains its ``k``-th inner step where the schedule's row ``k``
has it present (`shoal.experiments.asynchronous.simulate`'s ``present``), and the run
trains as many inner steps as the synchronous entries do under the schedule; rounds lost
to a departure are never applied, so the records may end before ``steps``, the last one
with the model at the end.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import numpy as np

from shoal.costmodel.speeds import speed_factors
from shoal.experiments import asynchronous
from shoal.experiments.algorithms import Context, Entry
from shoal.experiments.churn import Schedule
from shoal.experiments.config import Config, ConfigError
from shoal.experiments.runner import clock
from shoal.experiments.runner.summary import base_summary, per_worker, time_to_target
from shoal.experiments.tasks.protocol import metrics_of

MB = 1e6
SEGMENT_ROUNDS = 3  # rounds per worker drawn by the timeline plot


def check(cfg: Config, backend: Any, entry: Entry, checkpoints: Any, resume: bool) -> None:
    """`ConfigError` for a run an asynchronous algorithm cannot make."""
    if backend.name != "sim":
        raise ConfigError(
            f"{entry.label} plays its asynchronous rounds on a simulated clock: it runs on "
            f"simulated workers only (--backend sim), not --backend {backend.name}"
        )
    if checkpoints is not None or resume:
        raise ConfigError(
            f"{entry.label} has no checkpoints (its rounds are simulated in one go): "
            "drop --resume, --stop-after and checkpoint_every"
        )
    if cfg.grad_chunk:
        raise ConfigError(f"{entry.label} computes one worker at a time: drop grad_chunk")


def train(cfg: Config, task: Any, backend: Any, entry: Entry, *, checkpoints: Any = None,
          resume: bool = False, on_record: Any = None) -> Any:  # fmt: skip
    """Run ``entry`` (asynchronous) and return the runner's `RunResult`."""
    from shoal.experiments.runner.train import RunResult  # the runner's own type

    check(cfg, backend, entry, checkpoints, resume)
    started = time.perf_counter()
    plan = entry.algorithm.asynchronous(entry.params, cfg)
    # Each worker's own optimizer: no collective, and no non-finite skip (which would
    # all-reduce a flag every step); a non-finite loss shows in the records.
    inner = entry.algorithm.build(entry.params, Context(None, cfg, task))
    n = cfg.workers
    params = task.init_params()
    step_s = clock.step_seconds(cfg, task)
    rows = cfg.steps * n  # a fast worker may run up to every step of the run
    factors = speed_factors(cfg.speeds, steps=rows, workers=n, seed=cfg.seed)
    cluster = clock.cluster_of(cfg)
    # The workers are at different steps: keep the batches of the last few hundred.
    step_batch = functools.lru_cache(maxsize=256)(lambda k: task.batch(k, n))

    def batch(k: int, i: int):
        x, y = step_batch(k)
        return x[i], y[i]

    def evaluate(theta):
        return metrics_of(task.evaluate(theta), cfg.task)

    # Churn: each worker's k-th inner step is trained where the schedule's row k says,
    # and the run trains the tokens the synchronous entries train under it.
    present = Schedule.parse(cfg.churn, steps=cfg.steps, workers=n).present
    sim = asynchronous.simulate(
        task.loss, params, batch, workers=n, inner=inner, present=present if cfg.churn else None,
        outer=plan.outer, sync_every=plan.sync_every, total_steps=int(present.sum()),
        step_seconds=step_s * factors, link=(cluster.inter_latency, cluster.inter_bandwidth),
        quorum=plan.quorum, grace=plan.grace, dynamic=plan.dynamic, evaluate=evaluate,
        evaluate_every=cfg.eval_every * n,
    )  # fmt: skip
    records = _records(cfg, entry, sim, started)
    if on_record is not None:
        for rec in records:
            on_record(rec)
    summary = _summary(cfg, entry, sim, records, step_s, started)
    return RunResult(entry.label, records, summary, sim.params, True, cfg.steps, cfg.steps)


def _records(cfg: Config, entry: Entry, sim: Any, started: float) -> list[dict[str, Any]]:
    n = cfg.workers
    evaluations = {s: metrics for s, _, metrics in sim.evaluations}
    out: list[dict[str, Any]] = []
    applied, losses = 0, []
    sent = np.zeros(n, np.int64)
    window = np.zeros(n, np.int64)
    by_update: dict[int, list[Any]] = {}
    for a in sim.arrivals:
        by_update.setdefault(a.applied, []).append(a)
    for version, when in enumerate(sim.updates, 1):
        for a in by_update[version]:
            applied += a.steps
            losses.append(a.loss)
            window[a.worker] += sim.push_bytes
        emitted = False
        while len(out) < cfg.steps and applied >= (len(out) + 1) * n:
            emitted = True
            s = len(out) + 1
            sent += window
            rec = {
                "algorithm": entry.label,
                "seed": cfg.seed,
                "step": s,
                "loss": float(np.mean(losses)) if losses else math.nan,
                "bytes_sent": per_worker(window),
                "bytes_received": per_worker(window),  # a pull for every push applied
                "mb_sent": float(sent.mean() / MB),
                "mb_received": float(sent.mean() / MB),
                "sim_time_s": float(when),
            }
            metrics = evaluations.get(s * n)
            if metrics is not None:
                rec.update({f"test_{k}": v for k, v in metrics.items()})
            rec["time_s"] = time.perf_counter() - started
            out.append(rec)
            window = np.zeros(n, np.int64)
        if emitted:
            losses = []
    if out and sim.evaluations and sim.evaluations[-1][0] != len(out) * n:
        # Under churn the last tokens need not fill a record: the model at the end is
        # the last record's.
        out[-1].update({f"test_{k}": v for k, v in sim.evaluations[-1][2].items()})
    return out


def _summary(cfg, entry, sim, records, step_s, started) -> dict[str, Any]:
    total = float(sim.updates[-1]) if sim.updates else 0.0
    busy, comm = sim.busy / total, sim.comm / total
    away = sim.away / total if sim.away is not None else 0.0
    idle = np.maximum(1.0 - busy - comm - away, 0.0)  # at the server, and after its last round
    return {
        **base_summary(entry.label, cfg, records, time.perf_counter() - started),
        "sim_time_s": total,
        "sim_to_target_s": time_to_target(records, cfg.target_loss),
        "busy_share": float(busy.mean()),
        "comm_share": float(comm.mean()),
        "idle_share": float(idle.mean()),
        **({"absent_share": float((sim.away / total).mean())} if cfg.churn else {}),
        "outer_steps": len(sim.updates),
        "staleness": float(np.mean([a.applied - 1 - a.version for a in sim.arrivals])),
        "clock": {
            "step_ms": 1e3 * step_s,
            "shares": {"busy": busy.tolist(), "comm": comm.tolist(), "idle": idle.tolist()},
            "segments": _segments(sim),
        },
    }


def _segments(sim: Any) -> list[list[Any]]:
    """The timeline of each worker's first `SEGMENT_ROUNDS` rounds: compute, push, wait
    for the outer step that applies it, pull; under churn its absences and lost rounds
    within that span."""
    out, seen = [], {}
    for a in sorted(sim.arrivals, key=lambda a: (a.worker, a.started)):
        k = seen.get(a.worker, 0)
        if k >= SEGMENT_ROUNDS:
            continue
        seen[a.worker] = k + 1
        transfer = a.arrived - a.started - a.computed
        applied = sim.updates[a.applied - 1]
        out += [
            [a.worker, a.started, a.computed, "compute"],
            [a.worker, a.started + a.computed, transfer, "comm"],
            [a.worker, a.arrived, applied - a.arrived, "idle"],
            [a.worker, applied, transfer, "comm"],
        ]
    # Under churn: absences and lost rounds, up to where the plotted rounds end.
    end = max((start + d for _, start, d, _ in out), default=0.0)
    out += [[w, start, d, kind] for w, start, d, kind in sim.gaps if start < end]
    return out
