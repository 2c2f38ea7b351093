"""A training step's collectives (`Event`) in seconds on a `Cluster`, and the projection of
a step's compute and communication (`shoal.costmodel`'s docstring has the model)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from shoal.checks import check_int
from shoal.costmodel.clusters import Cluster
from shoal.costmodel.formulas import (
    ALL_REDUCE_ALGORITHMS,
    GROUPS,
    KINDS,
    PS_ALGORITHMS,
    SHORT_ALL_REDUCE,
    all_gather,
    all_to_all,
    broadcast,
    check_real,
    hierarchical_all_reduce,
    hierarchical_ps,
    ppermute,
    ps_naive,
    ps_pipelined,
    rabenseifner_all_reduce,
    recursive_doubling_all_reduce,
    ring_all_reduce,
    tree_all_reduce,
)

# Per-step projection.


@dataclasses.dataclass(frozen=True)
class Event:
    """One collective call of a training step, as the cost model sees it.

    Args:
      kind: ``"all_reduce"``, ``"all_gather"``, ``"all_to_all"``, ``"broadcast"``,
        ``"ppermute"`` or ``"ps"`` (a parameter-server push and pull).
      group: ``"world"``, ``"intra"`` or ``"inter"``, the workers taking part.
      nbytes: int ``>= 0``, the payload as the call sees it: the tree's bytes for
        all_reduce and ps, the worker's own part for all_gather, the whole ``[P, ...]``
        buffer for all_to_all, the sent array for ppermute and broadcast.

    Example:
      >>> from shoal.costmodel import Event
      >>> Event("all_reduce", "world", nbytes=4000)
      Event(kind='all_reduce', group='world', nbytes=4000)
    """

    kind: str
    group: str
    nbytes: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.group not in GROUPS:
            raise ValueError(f"group must be one of {GROUPS}, got {self.group!r}")
        check_int("nbytes", self.nbytes, 0)


@dataclasses.dataclass(frozen=True)
class Projection:
    """Projected seconds per step: communication, and the whole step (``compute + comm``).

    No overlap of computation and communication is assumed: an upper bound for
    frameworks that overlap the all-reduce with the backward pass. ``compute_s`` and
    ``comm_fraction`` (``comm_s / step_s``) are derived.

    Args:
      comm_s: seconds of communication per step.
      step_s: seconds of the whole step.

    Example:
      >>> from shoal.costmodel import Projection
      >>> Projection(comm_s=0.5, step_s=2.0).comm_fraction
      0.25
    """

    comm_s: float
    step_s: float

    @property
    def compute_s(self) -> float:
        return self.step_s - self.comm_s

    @property
    def comm_fraction(self) -> float:
        return self.comm_s / self.step_s if self.step_s > 0 else 0.0


def _check_algorithms(all_reduce: Any, ps: Any) -> None:
    if all_reduce not in ALL_REDUCE_ALGORITHMS:
        raise ValueError(f"all_reduce must be one of {ALL_REDUCE_ALGORITHMS}, got {all_reduce!r}")
    if ps not in PS_ALGORITHMS:
        raise ValueError(f"ps must be one of {PS_ALGORITHMS}, got {ps!r}")


def _group_size(cluster: Cluster, group_size: Any) -> int:
    g = cluster.workers_per_node if group_size is None else group_size
    g = check_int("group_size", g, 1)
    if cluster.workers % g:
        raise ValueError(f"group_size={g} must divide the cluster's {cluster.workers} workers")
    return g


def event_time(
    event: Event,
    cluster: Cluster,
    *,
    group_size: int | None = None,
    all_reduce: str = "ring",
    ps: str = "pipelined",
) -> float:
    """Seconds one `Event` takes on ``cluster`` (see `step_comm_time` for the mapping)."""
    if not isinstance(event, Event):
        event = Event(*event)
    _check_algorithms(all_reduce, ps)
    gs = _group_size(cluster, group_size)
    wpn, n = cluster.workers_per_node, event.nbytes
    if event.group == "world":
        p = cluster.workers
        spans = cluster.nodes > 1
    elif event.group == "intra":
        p = gs
        spans = not (gs <= wpn and wpn % gs == 0)
    else:  # inter
        p = cluster.workers // gs
        spans = cluster.nodes > 1
    if p == 1 and event.kind != "ps":
        return 0.0
    if not spans:
        link = cluster.intra
    elif event.kind == "all_to_all":
        link = cluster.inter.shared(wpn)
    elif event.group == "inter":
        link = cluster.inter.shared(min(gs, wpn))
    else:
        link = cluster.inter
    a, b, c = link.alpha, link.beta, cluster.gamma
    # Hierarchical schemes need whole nodes: "world", or "intra" groups of whole nodes.
    whole_nodes = spans and event.group != "inter" and p % wpn == 0
    if event.kind == "all_reduce":
        if n <= SHORT_ALL_REDUCE:
            return recursive_doubling_all_reduce(n, p, a, b, c)
        if all_reduce == "hierarchical" and whole_nodes:
            return hierarchical_all_reduce(n, p // wpn, wpn, cluster.intra, cluster.inter, c)
        formula = {
            "ring": ring_all_reduce,
            "hierarchical": ring_all_reduce,  # inside a node (or across groups): one level
            "rabenseifner": rabenseifner_all_reduce,
            "tree": tree_all_reduce,
        }[all_reduce]
        return formula(n, p, a, b, c)
    if event.kind == "ps":
        if whole_nodes:
            return hierarchical_ps(
                n, p // wpn, wpn, cluster.intra, cluster.inter, c, pipelined=ps == "pipelined"
            )
        return (ps_pipelined if ps == "pipelined" else ps_naive)(n, p, a, b, c)
    if event.kind == "all_gather":
        return all_gather(n, p, a, b)
    if event.kind == "all_to_all":
        return all_to_all(n, p, a, b)
    if event.kind == "broadcast":
        return broadcast(n, p, a, b)
    return ppermute(n, p, a, b)


def step_comm_time(
    events: Iterable[Event],
    cluster: Cluster,
    *,
    group_size: int | None = None,
    all_reduce: str = "ring",
    ps: str = "pipelined",
) -> float:
    """Seconds of communication of one step's ``events`` on ``cluster``, one after another.

    Collectives of a step are assumed not to overlap each other. Each event costs its
    algorithm's alpha-beta-gamma time, e.g. for a ring all-reduce of ``n`` bytes among
    ``p`` workers::

        T = 2 (p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma

    Groups: "world" has ``p = cluster.workers``; "intra" ``p = group_size`` (default
    ``workers_per_node``), consecutive workers; "inter" ``p = workers / group_size``. A group
    inside one node uses the intra link; one spanning nodes the inter link, whose node
    bandwidth is shared by one stream for ring-shaped collectives, ``workers_per_node``
    for all-to-all, and ``min(group_size, workers_per_node)`` concurrent "inter"
    collectives.

    Algorithms: all_reduce is ``"ring"`` (default; NCCL's bandwidth-optimal choice for large
    buffers and shoal's wire accounting), ``"rabenseifner"``, ``"tree"`` or
    ``"hierarchical"`` (intra reduce-scatter + inter all-reduce + intra all-gather, for a
    group of whole nodes); an all-reduce of at most `SHORT_ALL_REDUCE` bytes is
    latency-bound and always takes `recursive_doubling_all_reduce`. A "ps" event
    (parameter servers, as many server nodes as worker nodes) is Herring's scheme on a
    group of whole nodes (intra reduce-scatter, node <-> servers, intra all-gather;
    `hierarchical_ps`), else the flat formula; ``ps`` picks
    ``"pipelined"`` (Herring) or ``"naive"``. A group of one worker costs nothing, except
    "ps", whose push and pull happen whatever the number of workers.

    Args:
      events: the step's `Event` s, e.g. one step of `record_events`.
      cluster: the `Cluster`.
      group_size: workers per "intra" group; None: ``cluster.workers_per_node``.
      all_reduce: ``"ring"``, ``"rabenseifner"``, ``"tree"`` or ``"hierarchical"``.
      ps: ``"pipelined"`` or ``"naive"``.

    Returns:
      seconds, a float.

    Example:
      >>> from shoal.costmodel import Cluster, Event, step_comm_time
      >>> cluster = Cluster(nodes=2, workers_per_node=4, intra_bandwidth=100e9,
      ...                   intra_latency=0.0, inter_bandwidth=10e9, inter_latency=0.0)
      >>> step = [Event("all_reduce", "world", 8 * 10**9)]  # spans nodes: 10 GB/s
      >>> round(step_comm_time(step, cluster), 3)  # 2 (7/8) 8e9 / 10e9
      1.4
      >>> step = [Event("all_reduce", "intra", 8 * 10**9)]  # inside a node: 100 GB/s
      >>> round(step_comm_time(step, cluster), 3)  # 2 (3/4) 8e9 / 100e9
      0.12

    References:
      R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of Collective Communication
      Operations in MPICH", IJHPCA 19(1), 2005 (alpha-beta-gamma costs).
      A. Thangakrishnan et al., "Herring: Rethinking the Parameter Server at Scale for
      the Cloud", SC 2020, section IV-A (parameter-server costs).
    """
    _check_algorithms(all_reduce, ps)
    _group_size(cluster, group_size)  # checked even for a step without events
    return sum(
        event_time(e, cluster, group_size=group_size, all_reduce=all_reduce, ps=ps) for e in events
    )


def project(
    events: Iterable[Event],
    cluster: Cluster,
    compute_s: float,
    *,
    group_size: int | None = None,
    all_reduce: str = "ring",
    ps: str = "pipelined",
) -> Projection:
    """Projected step time on ``cluster``: computation plus communication, not overlapped.

    ::

        step_s = compute_s + step_comm_time(events, cluster, ...)

    Args:
      events: the step's `Event` s, e.g. one step of `record_events`.
      cluster: the `Cluster`.
      compute_s: seconds of computation per step, e.g. measured on one worker.
      group_size: workers per "intra" group; None: ``cluster.workers_per_node``.
      all_reduce: ``"ring"``, ``"rabenseifner"``, ``"tree"`` or ``"hierarchical"``.
      ps: ``"pipelined"`` or ``"naive"``.

    Returns:
      a `Projection` ``(comm_s, step_s)``.

    Example:
      >>> from shoal.costmodel import Cluster, Event, project
      >>> cluster = Cluster(nodes=2, workers_per_node=4, intra_bandwidth=100e9,
      ...                   intra_latency=0.0, inter_bandwidth=10e9, inter_latency=0.0)
      >>> proj = project([Event("all_reduce", "world", 8 * 10**9)], cluster, compute_s=0.6)
      >>> round(proj.step_s, 3), round(proj.comm_fraction, 3)
      (2.0, 0.7)

    References:
      R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of Collective Communication
      Operations in MPICH", IJHPCA 19(1), 2005 (alpha-beta-gamma costs).
    """
    compute_s = check_real("compute_s", compute_s)
    comm = step_comm_time(events, cluster, group_size=group_size, all_reduce=all_reduce, ps=ps)
    return Projection(comm_s=comm, step_s=compute_s + comm)


def overlapped(projection: Projection, window_s: float) -> Projection:
    """A `Projection` whose communication runs behind ``window_s`` seconds of computation:
    only what does not fit is exposed::

        step_s = compute_s + max(0, comm_s - window_s)

    E.g. an outer all-reduce of DiLoCo overlapped with the next round
    (`shoal.optim.overlapped_diloco`): project the syncing step, then hide its all-reduce
    behind the other ``H - 1`` inner steps of a round, ``window_s = (H - 1) compute_s``.
    ``comm_s`` stays the whole transfer time, so ``comm_fraction`` is no longer its share
    of the step.

    Args:
      projection: the blocking projection (`project`).
      window_s: seconds of computation the communication can hide behind, >= 0.

    Returns:
      the `Projection` with the exposed communication only in ``step_s``.

    Example:
      >>> from shoal.costmodel import Projection, overlapped
      >>> overlapped(Projection(comm_s=3.0, step_s=4.0), window_s=2.0).step_s
      2.0
    """
    window_s = check_real("window_s", window_s)
    if window_s < 0:
        raise ValueError(f"window_s must be >= 0, got {window_s!r}")
    exposed = max(0.0, projection.comm_s - window_s)
    return Projection(comm_s=projection.comm_s, step_s=projection.compute_s + exposed)


def speedup(a: Projection | float, b: Projection | float) -> float:
    """How many times faster ``b`` is than ``a``: ``a.step_s / b.step_s`` (plain numbers are
    step times in seconds). > 1 means ``b`` is faster."""

    def seconds(x: Any, name: str) -> float:
        return x.step_s if isinstance(x, Projection) else check_real(name, x)

    ta, tb = seconds(a, "a"), seconds(b, "b")
    if tb <= 0:
        raise ValueError(f"b must have a step time > 0, got {tb!r}")
    return ta / tb
