"""shoal.costmodel: an alpha-beta-gamma cost model of shoal's collectives on a cluster.

Pure Python, no JAX: the ground floor, beside `shoal.kernels`.

Researchers run shoal on one machine but decide for clusters: this module turns the
collectives a training step performs (a list of `Event`, e.g. from
`shoal.comms.record_events`) into seconds on a described `Cluster`.

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

from shoal.costmodel.clusters import GB, GBPS, PRESETS, Cluster, cluster
from shoal.costmodel.formulas import (
    ALL_REDUCE_ALGORITHMS,
    GROUPS,
    JUMBO_FRAME,
    KINDS,
    PS_ALGORITHMS,
    SHORT_ALL_REDUCE,
    Link,
    all_gather,
    all_to_all,
    broadcast,
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
from shoal.costmodel.projection import (
    Event,
    Projection,
    event_time,
    overlapped,
    project,
    speedup,
    step_comm_time,
)

__all__ = [
    "ALL_REDUCE_ALGORITHMS",
    "GB",
    "GBPS",
    "GROUPS",
    "JUMBO_FRAME",
    "KINDS",
    "PRESETS",
    "PS_ALGORITHMS",
    "SHORT_ALL_REDUCE",
    "Cluster",
    "Event",
    "Link",
    "Projection",
    "all_gather",
    "all_to_all",
    "broadcast",
    "cluster",
    "event_time",
    "hierarchical_all_reduce",
    "hierarchical_ps",
    "overlapped",
    "ppermute",
    "project",
    "ps_naive",
    "ps_pipelined",
    "rabenseifner_all_reduce",
    "recursive_doubling_all_reduce",
    "ring_all_reduce",
    "speedup",
    "step_comm_time",
    "tree_all_reduce",
]
