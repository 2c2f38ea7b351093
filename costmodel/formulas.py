"""The alpha-beta-gamma formulas of each collective, one message at a time per direction
(`shoal.costmodel`'s docstring has the model and its references)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from shoal.checks import check_int

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


def check_real(name: str, value: Any, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if not positive and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return float(value)


def _check(n: Any, p: Any, alpha: Any, beta: Any, gamma: Any = 0.0):
    return (
        check_real("n", n),
        check_int("p", p, 1),
        check_real("alpha", alpha),
        check_real("beta", beta),
        check_real("gamma", gamma),
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
    segment = check_real("segment", segment, positive=True)
    return p * alpha + n * max(beta, gamma) + min(segment, n) * gamma


@dataclasses.dataclass(frozen=True)
class Link:
    """A link's latency ``alpha`` (s per message) and bandwidth (bytes/s; ``beta`` = 1 /
    bandwidth)."""

    latency: float
    bandwidth: float

    def __post_init__(self):
        check_real("latency", self.latency)
        check_real("bandwidth", self.bandwidth, positive=True)

    @property
    def alpha(self) -> float:
        return self.latency

    @property
    def beta(self) -> float:
        return 1.0 / self.bandwidth

    def shared(self, streams: int) -> Link:
        """This link when ``streams`` concurrent transfers split its bandwidth."""
        return Link(self.latency, self.bandwidth / check_int("streams", streams, 1))


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
    n = check_real("n", n)
    m, g = check_int("nodes", nodes, 1), check_int("per_node", per_node, 1)
    gamma = check_real("gamma", gamma)
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
    n = check_real("n", n)
    m, g = check_int("nodes", nodes, 1), check_int("per_node", per_node, 1)
    gamma = check_real("gamma", gamma)
    if pipelined:
        ps = ps_pipelined(n, m, inter.alpha, inter.beta, gamma, segment)
    else:
        ps = ps_naive(n, m, inter.alpha, inter.beta, gamma)
    return _intra_scatter_gather(n, g, intra, gamma) + ps


# ---------------------------------------------------------------------------------------------
