"""A simulated wall clock for workers of different speeds.

Each worker computes its step for ``compute[step, worker]`` seconds (its own clock runs
on); a collective is a barrier of the workers taking part: they all start it when its last
member arrives, and it takes the cost model's time for it (`step_comm_time` of that one
event). A step without a collective (a local step of DiLoCo) makes no worker wait, so
fast workers run ahead until the next exchange.

Groups: a "world" event waits for every worker; "intra" for each group of ``group_size``
consecutive workers; "inter" for each set of workers with the same index in their group.
A "ppermute" waits for its whole group too: the recorded event does not say which pairs
it joined, so a gossip exchange is charged as if every worker waited for the slowest
(an upper bound on the idle time of peer-to-peer methods).

Churn (``present``): an absent worker computes nothing and joins no collective; its time
away counts as absent, and it comes back at the time its previous step ended for the job.

Pure NumPy; deterministic: the same inputs give the same clock, bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from shoal.costmodel.clusters import Cluster
from shoal.costmodel.projection import Event, step_comm_time

__all__ = ["Timeline", "simulate"]

COMPUTE, COMM, IDLE, ABSENT = "compute", "comm", "idle", "absent"


@dataclasses.dataclass(frozen=True)
class Timeline:
    """What `simulate` found.

    Attributes:
      end: ``[steps]`` seconds: when the last worker finished each step (its compute and
        the step's collectives), from the start of the run.
      busy, comm, idle: ``[workers]`` seconds each worker computed, communicated and
        waited for others; with the time it is ahead at the end, ``busy + comm + idle``
        is ``end[-1]`` for every worker that finished last.
      segments: ``(worker, start, seconds, kind)`` of the first ``keep_steps`` steps,
        ``kind`` one of ``"compute"``, ``"comm"``, ``"idle"``, ``"absent"``: what a
        timeline plot draws.
      absent: ``[workers]`` seconds each worker was away (churn; zeros without).
    """

    end: np.ndarray
    busy: np.ndarray
    comm: np.ndarray
    idle: np.ndarray
    segments: tuple[tuple[int, float, float, str], ...]
    absent: np.ndarray | None = None

    def shares(self) -> dict[str, np.ndarray]:
        """Each worker's busy, communicating, idle and absent share of the run's time
        ``end[-1]`` (the time it is done early counts as idle: it waits for the job to
        end)."""
        total = float(self.end[-1]) if len(self.end) else 0.0
        away = np.zeros_like(self.busy) if self.absent is None else self.absent
        if total <= 0:
            zero = np.zeros_like(self.busy)
            return {"busy": zero, "comm": zero, "idle": zero, "absent": zero}
        # waits within the run, and after its end (rounding can leave -1e-17)
        idle = np.maximum(total - self.busy - self.comm - away, 0.0)
        return {"busy": self.busy / total, "comm": self.comm / total, "idle": idle / total,
                "absent": away / total}  # fmt: skip


def _groups(group: str, workers: int, group_size: int) -> list[np.ndarray]:
    if group == "world" or workers <= 1:
        return [np.arange(workers)]
    size = min(group_size, workers)
    if group == "intra":
        return [np.arange(s, min(s + size, workers)) for s in range(0, workers, size)]
    return [np.arange(j, workers, size) for j in range(size)]  # "inter"


def simulate(
    step_events: Sequence[Sequence[Event]],
    compute: np.ndarray,
    cluster: Cluster,
    *,
    group_size: int | None = None,
    keep_steps: int = 0,
    present: np.ndarray | None = None,
) -> Timeline:
    """The simulated clock of a run whose step ``s`` performs ``step_events[s]``.

    Args:
      step_events: per step, its collectives in order (`shoal.comms.record_events`).
      compute: ``[steps, workers]`` seconds of each worker's compute in each step; workers
        is ``cluster.workers``.
      cluster: the links (`Cluster`) that time each collective.
      group_size: the "intra" group's size (default: ``cluster.workers_per_node``).
      keep_steps: how many first steps' segments to keep for a plot.
      present: ``[steps, workers]`` bools, who is present at each step (churn); None:
        everyone.

    Returns:
      a `Timeline`.

    Example:
      >>> import numpy as np
      >>> from shoal.costmodel import Cluster, Event
      >>> from shoal.costmodel.clock import simulate
      >>> c = Cluster(nodes=2, workers_per_node=1, intra_bandwidth=1e9, intra_latency=0.0,
      ...             inter_bandwidth=1e9, inter_latency=0.0)
      >>> sync = [Event("all_reduce", "world", nbytes=0)]
      >>> t = simulate([[], sync], np.array([[1.0, 2.0], [1.0, 1.0]]), c)
      >>> t.end.tolist(), t.idle.tolist()  # worker 0 waits 1 s at the exchange
      ([2.0, 3.0], [1.0, 0.0])
    """
    compute = np.asarray(compute, np.float64)
    steps, workers = compute.shape
    if len(step_events) != steps:
        raise ValueError(f"step_events has {len(step_events)} steps, compute has {steps}")
    if workers != cluster.workers:
        raise ValueError(f"compute has {workers} workers, the cluster {cluster.workers}")
    if not np.all(np.isfinite(compute)) or np.any(compute < 0):
        raise ValueError("compute must hold finite seconds >= 0")
    here = np.ones((steps, workers), bool) if present is None else np.asarray(present, bool)
    if here.shape != (steps, workers):
        raise ValueError(f"present must be [steps, workers] = {[steps, workers]}")
    compute = np.where(here, compute, 0.0)
    size = cluster.workers_per_node if group_size is None else group_size
    clock = np.zeros(workers)
    busy, comm, idle = np.zeros(workers), np.zeros(workers), np.zeros(workers)
    away = np.zeros(workers)
    end = np.zeros(steps)
    segments: list[tuple[int, float, float, str]] = []
    keep = lambda s: s < keep_steps  # noqa: E731
    seconds_of: dict[Event, float] = {}  # a run repeats few distinct events
    for s in range(steps):
        if keep(s):
            segments += [(w, clock[w], compute[s, w], COMPUTE) for w in range(workers)
                         if here[s, w]]  # fmt: skip
        clock = clock + compute[s]
        busy += compute[s]
        for event in step_events[s]:
            if event not in seconds_of:
                seconds_of[event] = step_comm_time([event], cluster, group_size=group_size)
            seconds = seconds_of[event]
            for members in _groups(event.group, workers, size):
                members = members[here[s, members]]
                if not members.size:
                    continue
                start = clock[members].max()
                wait = start - clock[members]
                if keep(s):
                    segments += [(int(w), clock[w], wait[i], IDLE)
                                 for i, w in enumerate(members) if wait[i] > 0]  # fmt: skip
                    segments += [(int(w), start, seconds, COMM) for w in members]
                idle[members] += wait
                comm[members] += seconds
                clock[members] = start + seconds
        end[s] = clock[here[s]].max()
        # The absent are away until the job ends this step: a joiner starts from there.
        gone = ~here[s]
        if keep(s):
            segments += [(int(w), clock[w], end[s] - clock[w], ABSENT)
                         for w in np.flatnonzero(gone) if end[s] > clock[w]]  # fmt: skip
        away[gone] += np.maximum(end[s] - clock[gone], 0.0)
        clock[gone] = np.maximum(clock[gone], end[s])
    return Timeline(end, busy, comm, idle, tuple((w, float(a), float(d), k)
                                                 for w, a, d, k in segments), away)  # fmt: skip
