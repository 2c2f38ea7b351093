"""An alpha-beta-gamma cost model of shoal's collectives on a cluster.

Researchers run shoal on one machine but decide for clusters: this module turns the
collectives a training step performs (a list of `Event`, e.g. from
`shoal.comms.recording.record_events`) into seconds on a described `Cluster`.

The model (Hockney's alpha-beta model with a reduction term, as in Thakur, Rabenseifner &
Gropp 2005): sending a message of ``n`` bytes between two workers takes ``alpha + n beta``,
and reducing ``n`` bytes (adding a received array onto a local one) takes ``n gamma``:

* ``alpha``: latency per message (seconds);
* ``beta``: seconds per byte on the link (1 / bandwidth);
* ``gamma``: seconds per byte reduced (1 / reduction throughput).

Each worker sends and receives at the same time (full duplex) but one message at a time per
direction; computation and communication of one collective do not overlap unless the
algorithm's formula says so (Herring's pipelined parameter server).

Links. A `Cluster` has ``nodes`` nodes of ``workers_per_node`` workers. A collective over a
group whose members all sit in one node uses the intra-node link (NVLink or PCIe: the
bandwidth is per worker, so groups in the same node do not slow each other). A group that
spans nodes is limited by the inter-node link, whose bandwidth is the node's network
interface (per direction), shared by whatever of the node's workers cross it at once:

* "world" (and "intra" groups larger than a node), ring-shaped collectives (all-reduce,
  all-gather, broadcast, ppermute): the workers of a node are consecutive ranks, so a ring
  (NCCL's ring, and its trees) enters and leaves each node once: one stream per NIC, ``beta =
  beta_inter``. Algorithms where all of a node's workers talk across nodes at once (the far
  rounds of recursive halving, binomial trees over all ranks) are therefore modelled
  optimistically, by up to ``workers_per_node``.
* all-to-all: every worker exchanges with every remote worker: ``workers_per_node`` streams
  share the NIC, ``beta = workers_per_node * beta_inter`` (an upper bound: the traffic to
  the node's own workers, a fraction ``workers_per_node / p``, stays inside).
* "inter" groups (one member per group, groups of ``group_size`` consecutive workers):
  ``group_size`` inter collectives run at once, one per member index, and the
  ``min(group_size, workers_per_node)`` of them with a member in a node share its NIC.
* NCCL's hierarchical schemes (reduce inside the node, then across nodes) are the
  "hierarchical" all-reduce formula, selected explicitly.

Contention inside the network fabric (oversubscription, incast, TCP flow imbalance) is not
modelled: the fabric is assumed non-blocking.

References:
    Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations in
    MPICH", IJHPCA 19(1), 2005.
    Hockney, "The communication challenge for MPP: Intel Paragon and Meiko CS-2", Parallel
    Computing 20(3), 1994.
    Thangakrishnan et al., "Herring: Rethinking the parameter server at scale for the cloud",
    SC 2020 (section IV-A: the naive and pipelined parameter-server formulas).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable
from typing import Any

KINDS = ("all_reduce", "all_gather", "all_to_all", "broadcast", "ppermute", "ps")
GROUPS = ("world", "intra", "inter")
ALL_REDUCE_ALGORITHMS = ("ring", "rabenseifner", "tree", "hierarchical")
PS_ALGORITHMS = ("pipelined", "naive")

# bytes: all-reduces up to this size are latency-bound and use recursive doubling whatever
# the algorithm asked for (MPICH's MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE default; NCCL likewise
# switches to its low-latency tree protocol for small messages).
SHORT_ALL_REDUCE = 2048
JUMBO_FRAME = 9000  # bytes: Herring's pipelining segment (one Ethernet jumbo frame)


# ---------------------------------------------------------------------------------------------
# Argument checks: every error names the parameter.


def _check_real(name: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if not positive and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return float(value)


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def _check(n: Any, p: Any, alpha: Any, beta: Any, gamma: Any = 0.0):
    return (
        _check_real("n", n),
        _check_count("p", p),
        _check_real("alpha", alpha),
        _check_real("beta", beta),
        _check_real("gamma", gamma),
    )


def _log2_rounds(p: int) -> int:
    """Rounds of a recursive-doubling / binomial-tree algorithm: ``ceil(log2 p)`` (exact
    ``log2 p`` for powers of two; MPICH's extra step for other ``p`` is not modelled)."""
    return (p - 1).bit_length()


# ---------------------------------------------------------------------------------------------
# Formulas (seconds). n is in bytes.


def ring_all_reduce(n: float, p: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Ring all-reduce of ``n`` bytes over ``p`` workers (Patarasuk & Yuan; Thakur et al.):

        T = 2 (p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma.

    The buffer is cut into ``p`` chunks of ``n/p``. Reduce-scatter: ``p-1`` steps, in each a
    worker sends one chunk to its right neighbour, receives one from its left and adds it
    (``alpha + n/p beta + n/p gamma``); then each worker owns one fully reduced chunk.
    All-gather: ``p-1`` more steps passing the reduced chunks on (``alpha + n/p beta``).
    The bandwidth term ``2 (p-1)/p n beta`` grows with ``p`` towards ``2 n beta``; ``p = 1``
    costs nothing.
    """
    n, p, alpha, beta, gamma = _check(n, p, alpha, beta, gamma)
    f = (p - 1) / p
    return 2 * (p - 1) * alpha + 2 * f * n * beta + f * n * gamma


def rabenseifner_all_reduce(
    n: float, p: int, alpha: float, beta: float, gamma: float = 0.0
) -> float:
    """Rabenseifner's all-reduce: reduce-scatter by recursive halving, then all-gather by
    recursive doubling (Thakur et al. 2005, section 4.4):

        T = 2 log2(p) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma.

    Recursive halving: in round ``k = 1..log2 p`` a worker exchanges half of its current
    part with a partner at distance ``p / 2^k`` and reduces the half it keeps, so it sends
    ``n/2 + n/4 + ... + n/p = (p-1)/p n`` bytes in ``log2 p`` messages and reduces as many.
    Recursive doubling mirrors it without the reduction. ``log2 p`` is rounded up for
    ``p`` not a power of two.
    """
    n, p, alpha, beta, gamma = _check(n, p, alpha, beta, gamma)
    f = (p - 1) / p
    return 2 * _log2_rounds(p) * alpha + 2 * f * n * beta + f * n * gamma


def recursive_doubling_all_reduce(
    n: float, p: int, alpha: float, beta: float, gamma: float = 0.0
) -> float:
    """Recursive-doubling all-reduce (Thakur et al. 2005, section 4.4, short messages)::

        T = log2(p) (alpha + n beta + n gamma).

    In round ``k`` each worker swaps its whole partial result with the worker ``2^k``
    away and adds what it received; after ``log2 p`` rounds all hold the total. Used for
    every all-reduce of at most `SHORT_ALL_REDUCE` bytes (e.g. a flag or a scalar).
    """
    n, p, alpha, beta, gamma = _check(n, p, alpha, beta, gamma)
    return _log2_rounds(p) * (alpha + n * beta + n * gamma)


def tree_all_reduce(n: float, p: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Binomial-tree reduce to a root followed by a binomial-tree broadcast of the whole
    buffer (MPICH's short-message algorithm; Thakur et al. 2005):

        T = 2 log2(p) (alpha + n beta) + log2(p) n gamma.

    Each of the ``log2 p`` reduce rounds sends the whole buffer one hop and adds it; each of
    the ``log2 p`` broadcast rounds sends it once more. Latency-optimal, bandwidth-poor.
    """
    n, p, alpha, beta, gamma = _check(n, p, alpha, beta, gamma)
    r = _log2_rounds(p)
    return 2 * r * (alpha + n * beta) + r * n * gamma


def all_gather(n: float, p: int, alpha: float, beta: float) -> float:
    """Ring all-gather where every worker contributes ``n`` bytes (its own part):

        T = (p-1) (alpha + n beta).

    ``p-1`` steps, each passing one part of ``n`` bytes to the right neighbour; every worker
    ends with all ``p n`` bytes. Matches `shoal.comms.wire`: ``(p-1) n`` sent per worker.
    """
    n, p, alpha, beta, _ = _check(n, p, alpha, beta)
    return (p - 1) * (alpha + n * beta)


def all_to_all(n: float, p: int, alpha: float, beta: float) -> float:
    """All-to-all (personalised exchange) of a buffer of ``n`` bytes split into ``p`` blocks,
    block ``j`` going to worker ``j`` (pairwise exchange, Thakur et al. 2005):

        T = (p-1) alpha + (p-1)/p n beta.

    ``p-1`` rounds; in round ``k`` a worker sends its block for ``rank + k`` and receives
    from ``rank - k``: ``n/p`` bytes each. Here ``n`` is the whole buffer as the call sees it.
    """
    n, p, alpha, beta, _ = _check(n, p, alpha, beta)
    return (p - 1) * alpha + (p - 1) / p * n * beta


def broadcast(n: float, p: int, alpha: float, beta: float) -> float:
    """Binomial-tree broadcast of ``n`` bytes from a root:

        T = log2(p) (alpha + n beta).

    The number of workers holding the data doubles every round; each round sends the whole
    buffer once.
    """
    n, p, alpha, beta, _ = _check(n, p, alpha, beta)
    return _log2_rounds(p) * (alpha + n * beta)


def ppermute(n: float, p: int, alpha: float, beta: float) -> float:
    """Point-to-point permutation, every source sending ``n`` bytes to its destination at
    once (a shift, a pairing):

        T = alpha + n beta   (0 for p = 1: a worker's data stays in place).
    """
    n, p, alpha, beta, _ = _check(n, p, alpha, beta)
    return 0.0 if p == 1 else alpha + n * beta


def ps_naive(n: float, p: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Parameter server without pipelining (Herring, section IV-A): push, reduce, pull, one
    after the other:

        T = 2 alpha + 2 n beta + n p gamma.

    Each worker sends its ``n`` bytes to the server(s) (``alpha + n beta``), the server adds
    the ``p`` copies (``n p gamma``) and sends the sum back (``alpha + n beta``). The ``n
    beta`` terms assume servers with as much bandwidth as the workers together (Herring: as
    many server nodes as worker nodes, each holding a 1/p shard of every buffer: a server
    receives ``p`` shards of ``n/p``, so ``n`` bytes, like a worker sends). Herring writes
    ``2 (n-1) beta`` with alpha the first byte; with alpha a per-message latency it is
    ``2 n beta``.
    """
    n, p, alpha, beta, gamma = _check(n, p, alpha, beta, gamma)
    return 2 * alpha + 2 * n * beta + n * p * gamma


def ps_pipelined(
    n: float,
    p: int,
    alpha: float,
    beta: float,
    gamma: float = 0.0,
    segment: float = JUMBO_FRAME,
) -> float:
    """Herring's pipelined parameter server (section IV-A):

        T = p alpha + n max(beta, gamma) + min(segment, n) gamma.

    Workers stream the buffer in segments of one jumbo frame (9000 B); the server adds each
    segment as it arrives and returns a segment's sum as soon as all ``p`` workers' copies
    are in. The first segment must arrive from all ``p`` workers before the first reply
    (``p alpha``); after that sending, reducing and returning overlap and only the return of
    all ``n`` bytes is counted (``n beta``), plus reducing the one segment not overlapped.

    Herring writes ``p alpha + gamma + n beta`` with its gamma the time to add one frame;
    ours is per byte, so that term is ``segment * gamma``. Overlap only holds while the
    server reduces at least as fast as bytes arrive (each byte a server receives is added
    once; it receives ``n`` bytes in all): if ``gamma > beta`` the reduction is the
    bottleneck, hence ``n max(beta, gamma)``; Herring's case (``gamma <= beta``) reduces to
    its formula.
    """
    n, p, alpha, beta, gamma = _check(n, p, alpha, beta, gamma)
    segment = _check_real("segment", segment, positive=True)
    return p * alpha + n * max(beta, gamma) + min(segment, n) * gamma


@dataclasses.dataclass(frozen=True)
class Link:
    """A link's latency ``alpha`` (s per message) and bandwidth (bytes/s; ``beta`` = 1 /
    bandwidth)."""

    latency: float
    bandwidth: float

    def __post_init__(self):
        _check_real("latency", self.latency)
        _check_real("bandwidth", self.bandwidth, positive=True)

    @property
    def alpha(self) -> float:
        return self.latency

    @property
    def beta(self) -> float:
        return 1.0 / self.bandwidth

    def shared(self, streams: int) -> Link:
        """This link when ``streams`` concurrent transfers split its bandwidth."""
        return Link(self.latency, self.bandwidth / _check_count("streams", streams))


def _intra_scatter_gather(n: float, g: int, intra: Link, gamma: float) -> float:
    """The in-node ends of the two-level schemes: ring reduce-scatter of ``n`` bytes over the
    node's ``g`` workers, and the all-gather that undoes it::

        RS_intra + AG_intra = 2 (g-1) alpha_i + 2 (g-1)/g n beta_i + (g-1)/g n gamma
    """
    fg = (g - 1) / g
    return 2 * (g - 1) * intra.alpha + 2 * fg * n * intra.beta + fg * n * gamma


def hierarchical_all_reduce(
    n: float, nodes: int, per_node: int, intra: Link, inter: Link, gamma: float = 0.0
) -> float:
    """Two-level all-reduce (NCCL's/Horovod's hierarchical scheme; Herring's outer structure):
    reduce-scatter inside each node, all-reduce of each worker's ``1/g`` across nodes, then
    all-gather inside each node (``g = per_node``, ``m = nodes``):

        T = RS_intra + AR_inter + AG_intra
        RS_intra = (g-1) alpha_i + (g-1)/g n beta_i + (g-1)/g n gamma
        AR_inter = ring_all_reduce(n/g, m, alpha_e, g beta_e, gamma)
                 = 2 (m-1) alpha_e + 2 (m-1)/m n beta_e + (m-1)/m (n/g) gamma
        AG_intra = (g-1) alpha_i + (g-1)/g n beta_i

    The ``g`` inter-node all-reduces (one per local worker, ``n/g`` bytes each) run at once
    and share the node's network interface (``inter.bandwidth`` is per node), hence ``g
    beta_e``: the node's NIC carries ``2 (m-1)/m n`` bytes each way, as in a flat ring; the
    gain over a flat ring is in latency (``2 (m-1)`` instead of ``2 (gm-1)`` inter-node
    steps) and reduction work. With one node it is the intra-node ring all-reduce.
    """
    n = _check_real("n", n)
    m, g = _check_count("nodes", nodes), _check_count("per_node", per_node)
    gamma = _check_real("gamma", gamma)
    ar = ring_all_reduce(n / g, m, inter.alpha, inter.shared(g).beta, gamma)
    return _intra_scatter_gather(n, g, intra, gamma) + ar


def hierarchical_ps(
    n: float,
    nodes: int,
    per_node: int,
    intra: Link,
    inter: Link,
    gamma: float = 0.0,
    *,
    pipelined: bool = True,
    segment: float = JUMBO_FRAME,
) -> float:
    """Herring's gradient averaging (section III-A, steps 1-5): reduce-scatter inside the node
    (NVLink), each node exchanges its ``n`` bytes with the parameter servers (the ``g``
    local workers send a ``1/g`` slice each over the shared NIC: ``n`` bytes per NIC), then
    all-gather inside the node:

        T = RS_intra + PS(n, m, alpha_e, beta_e, gamma) + AG_intra

    with PS `ps_pipelined` (or `ps_naive`) over the ``m = nodes`` worker nodes. The device
    to host copies over PCIe (steps 2 and 4) are not modelled: they overlap with the
    network in Herring's pipeline.
    """
    n = _check_real("n", n)
    m, g = _check_count("nodes", nodes), _check_count("per_node", per_node)
    gamma = _check_real("gamma", gamma)
    if pipelined:
        ps = ps_pipelined(n, m, inter.alpha, inter.beta, gamma, segment)
    else:
        ps = ps_naive(n, m, inter.alpha, inter.beta, gamma)
    return _intra_scatter_gather(n, g, intra, gamma) + ps


# ---------------------------------------------------------------------------------------------
# Clusters.

GBPS = 1e9 / 8  # bytes/s in one Gbit/s
GB = 1e9

# Shared constants of the presets (one set per cluster kind, never tuned per table row).
# NVLink (V100 SXM2, 8 GPUs in a hybrid cube-mesh, as in DGX-1V and AWS p3.16xlarge /
# p3dn.24xlarge): 6 NVLink2 links x 25 GB/s per direction = 150 GB/s per GPU (NVIDIA V100
# datasheet: "300 GB/s" bidirectional). NCCL's rings reach about 120-130 GB/s of bus bandwidth
# on such a node; we take 120 GB/s. Assumption, from published nccl-tests numbers.
_NVLINK_BANDWIDTH = 120 * GB
# Per-step latency of an NCCL intra-node transfer (kernel-to-kernel over NVLink): a few us.
_NVLINK_LATENCY = 5e-6
# PCIe 3.0 x16: 15.75 GB/s raw; Herring (section III-A) quotes "around 12 GBps" per link
# on p3dn.24xlarge. Used for 4 x V100 PCIe nodes without NVLink. Latency: assumption.
_PCIE_BANDWIDTH = 12 * GB
_PCIE_LATENCY = 10e-6
# gamma: a V100 adds fp16 arrays at HBM2 speed (900 GB/s peak, ~750 achievable); adding
# ``n`` received bytes reads 2n and writes n, so ~250 GB/s reduced. Assumption.
_GPU_REDUCE = 250 * GB

PRESETS: dict[str, dict[str, Any]] = {
    # 8 x V100 with NVLink per node, 25 Gbps Ethernet between nodes (AWS p3.16xlarge:
    # "up to 25 Gbps"). Latency 30 us: kernel TCP over a 25 GbE fabric (assumption).
    "v100-nvlink-25gbps": dict(
        workers_per_node=8,
        intra_bandwidth=_NVLINK_BANDWIDTH,
        intra_latency=_NVLINK_LATENCY,
        inter_bandwidth=25 * GBPS,
        inter_latency=30e-6,
        gamma=1 / _GPU_REDUCE,
    ),
    # 1-bit LAMB (Li et al. 2021), section 3.2: "4 NVIDIA Tesla V100 GPUs per node (16GB),
    # and 40 Gigabit Ethernet inter-node network (4.1 Gbps effective bandwidth based on iperf
    # benchmark)". The paper does not say how the GPUs are linked; 16 GB V100 nodes of 4 are
    # typically PCIe cards: PCIe assumed. Latency 50 us: TCP over 40 GbE (assumption).
    "v100-pcie-40gbe": dict(
        workers_per_node=4,
        intra_bandwidth=_PCIE_BANDWIDTH,
        intra_latency=_PCIE_LATENCY,
        inter_bandwidth=4.1 * GBPS,
        inter_latency=50e-6,
        gamma=1 / _GPU_REDUCE,
    ),
    # 1-bit LAMB, section 3.2: "8 V100 GPUs per node (32GB), and 100 Gigabit InfiniBand EDR
    # inter-node network (close to theoretical peak effective bandwidth based on
    # microbenchmark)": 100 Gbps = 12.5 GB/s, one NIC per node. NVLink assumed (8 x V100
    # 32GB nodes are DGX-1V-like SXM2 servers). Latency 5 us: IB verbs ~1-2 us plus NCCL's
    # per-step overhead (assumption).
    "v100-nvlink-ib-edr": dict(
        workers_per_node=8,
        intra_bandwidth=_NVLINK_BANDWIDTH,
        intra_latency=_NVLINK_LATENCY,
        inter_bandwidth=100 * GBPS,
        inter_latency=5e-6,
        gamma=1 / _GPU_REDUCE,
    ),
    # Herring (SC 2020): p3dn.24xlarge, 8 x V100 with NVLink, 100 Gbps EFA. A single endpoint
    # gets ~70 Gbps; Herring's proxy servers use the whole 100 Gbps (section III-3), so 100.
    # Latency 20 us: EFA/SRD one-way latency is of the order of 15-20 us (assumption).
    "p3dn-efa": dict(
        workers_per_node=8,
        intra_bandwidth=_NVLINK_BANDWIDTH,
        intra_latency=_NVLINK_LATENCY,
        inter_bandwidth=100 * GBPS,
        inter_latency=20e-6,
        gamma=1 / _GPU_REDUCE,
    ),
}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A cluster of ``nodes`` nodes of ``workers_per_node`` workers (GPUs), for the cost model.

    A message of ``n`` bytes over a link costs ``latency + n / bandwidth`` seconds, and
    reducing ``n`` bytes costs ``n gamma``. `Cluster.preset` builds a described machine.

    Args:
      nodes: int ``>= 1``, the number of nodes.
      workers_per_node: int ``>= 1``, workers in each node (consecutive ranks).
      intra_bandwidth: bytes/s per direction per worker inside a node (NVLink/PCIe).
      intra_latency: seconds per message inside a node.
      inter_bandwidth: bytes/s per direction per node (its network interface, shared
        by the node's workers).
      inter_latency: seconds per message between nodes.
      gamma: seconds per byte reduced.
      name: a label for reports.

    Example:
      >>> from shoal.comms import Cluster, Event, step_comm_time
      >>> cluster = Cluster(nodes=2, workers_per_node=4, intra_bandwidth=100e9,
      ...                   intra_latency=0.0, inter_bandwidth=10e9, inter_latency=0.0)
      >>> cluster.workers
      8
      >>> round(step_comm_time([Event("all_reduce", "world", 10**9)], cluster), 3)
      0.175

    References:
      R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of Collective Communication
      Operations in MPICH", IJHPCA 19(1), 2005 (alpha-beta-gamma costs).
    """

    nodes: int
    workers_per_node: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    gamma: float = 0.0
    name: str = "custom"

    def __post_init__(self):
        _check_count("nodes", self.nodes)
        _check_count("workers_per_node", self.workers_per_node)
        _check_real("intra_bandwidth", self.intra_bandwidth, positive=True)
        _check_real("intra_latency", self.intra_latency)
        _check_real("inter_bandwidth", self.inter_bandwidth, positive=True)
        _check_real("inter_latency", self.inter_latency)
        _check_real("gamma", self.gamma)

    @property
    def workers(self) -> int:
        return self.nodes * self.workers_per_node

    @property
    def intra(self) -> Link:
        return Link(self.intra_latency, self.intra_bandwidth)

    @property
    def inter(self) -> Link:
        return Link(self.inter_latency, self.inter_bandwidth)

    @classmethod
    def preset(cls, name: str, nodes: int) -> Cluster:
        """A preset of `PRESETS` (sources in its comments) with ``nodes`` nodes."""
        if name not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
        return cls(nodes=nodes, name=name, **PRESETS[name])


def cluster(name: str, nodes: int) -> Cluster:
    """`Cluster.preset(name, nodes)`."""
    return Cluster.preset(name, nodes)


# ---------------------------------------------------------------------------------------------
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
      >>> from shoal.comms import Event
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
        nb = self.nbytes
        if isinstance(nb, bool) or not isinstance(nb, numbers.Integral) or nb < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nb!r}")


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
      >>> from shoal.comms import Projection
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
    g = _check_count("group_size", g)
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
      >>> from shoal.comms import Cluster, Event, step_comm_time
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
      >>> from shoal.comms import Cluster, Event, project
      >>> cluster = Cluster(nodes=2, workers_per_node=4, intra_bandwidth=100e9,
      ...                   intra_latency=0.0, inter_bandwidth=10e9, inter_latency=0.0)
      >>> proj = project([Event("all_reduce", "world", 8 * 10**9)], cluster, compute_s=0.6)
      >>> round(proj.step_s, 3), round(proj.comm_fraction, 3)
      (2.0, 0.7)

    References:
      R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of Collective Communication
      Operations in MPICH", IJHPCA 19(1), 2005 (alpha-beta-gamma costs).
    """
    compute_s = _check_real("compute_s", compute_s)
    comm = step_comm_time(events, cluster, group_size=group_size, all_reduce=all_reduce, ps=ps)
    return Projection(comm_s=comm, step_s=compute_s + comm)


def speedup(a: Projection | float, b: Projection | float) -> float:
    """How many times faster ``b`` is than ``a``: ``a.step_s / b.step_s`` (plain numbers are
    step times in seconds). > 1 means ``b`` is faster."""

    def seconds(x: Any, name: str) -> float:
        return x.step_s if isinstance(x, Projection) else _check_real(name, x)

    ta, tb = seconds(a, "a"), seconds(b, "b")
    if tb <= 0:
        raise ValueError(f"b must have a step time > 0, got {tb!r}")
    return ta / tb
