"""Clusters for the cost model: nodes of workers, their two links, and the presets of
the papers' clusters (`shoal.costmodel`'s docstring has the model)."""

from __future__ import annotations

import dataclasses
from typing import Any

from shoal.checks import check_int
from shoal.costmodel.formulas import Link, check_real

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
    # Workers that are each a site of their own (one per node) over a 1 Gbps wide-area
    # link, the setting of DiLoCo's successors ("over the internet", DiLoCoX's 1 Gbps).
    # Latency 10 ms one way: a continental round trip of ~20 ms (assumption). The intra
    # link is never used with one worker per node; it is set to the inter one.
    "wan-1gbps": dict(
        workers_per_node=1,
        intra_bandwidth=1 * GBPS,
        intra_latency=10e-3,
        inter_bandwidth=1 * GBPS,
        inter_latency=10e-3,
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
      >>> from shoal.costmodel import Cluster, Event, step_comm_time
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
        check_int("nodes", self.nodes, 1)
        check_int("workers_per_node", self.workers_per_node, 1)
        check_real("intra_bandwidth", self.intra_bandwidth, positive=True)
        check_real("intra_latency", self.intra_latency)
        check_real("inter_bandwidth", self.inter_bandwidth, positive=True)
        check_real("inter_latency", self.inter_latency)
        check_real("gamma", self.gamma)

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
