"""Validation of `shoal.costmodel` against two papers' measured communication times.

* 1-bit LAMB (Li et al. 2021), Table 2: the "backward allreduce (ms)" of BERT-large
  pre-training (seqlen 128) with baseline LAMB on an Ethernet cluster (4 x V100 per node,
  40 GbE at 4.1 Gbps effective) and an InfiniBand cluster (8 x V100 per node, 100 Gb EDR).
* Herring (Thangakrishnan et al., SC 2020), Table V: time to average 100 MB of gradients
  with Herring's parameter servers on p3dn.24xlarge nodes (8 x V100, 100 Gbps EFA), 64-512
  GPUs.

One preset per cluster (`shoal.costmodel.PRESETS`), never tuned per row. Run with
``shoal-run experiments/configs/costmodel_validation.py`` (well under a second); it writes
``runs/costmodel_validation/``: ``onebit_lamb_table2.csv``, ``herring_table5.csv`` and
``summary.md``. Every CSV has a ``ratio`` column (ours / paper) and a ``claimed`` column:
the rows for which the model claims to be within 2x.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shoal import costmodel as cm
from shoal.costmodel import Event, cluster, step_comm_time
from shoal.experiments.runner.analysis import Analysis, markdown_table, write_rows_csv

# BERT-large: the papers' "340 million" parameters, fp16 gradients (1-bit LAMB, section 6:
# "for FP16 training"; Herring: "680MB gradient update with fp16 communication").
BERT_LARGE_PARAMS = 340_000_000
BERT_BYTES = 2 * BERT_LARGE_PARAMS
HERRING_BYTES = 100_000_000  # "100MB of gradients" (decimal MB; MiB would be 4.9% more)

ETHERNET, INFINIBAND, EFA = "v100-pcie-40gbe", "v100-nvlink-ib-edr", "p3dn-efa"
PRESET_OF = {"Ethernet": ETHERNET, "InfiniBand": INFINIBAND}

# 1-bit LAMB Table 2: (network, nodes, GPUs, batch per GPU, batch, grad accumulation steps,
# forward ms, backward allreduce ms, backward everything else ms, step ms, allreduce %).
ONEBIT_TABLE2 = (
    ("Ethernet", 64, 256, 16, "8K", 2, 55, 3579, 117, 191, 91),
    ("Ethernet", 64, 256, 16, "16K", 4, 111, 3533, 227, 195, 87),
    ("Ethernet", 64, 256, 16, "32K", 8, 224, 3599, 462, 233, 80),
    ("Ethernet", 64, 256, 16, "64K", 16, 445, 3674, 919, 215, 70),
    ("Ethernet", 32, 128, 16, "8K", 4, 112, 3759, 233, 121, 89),
    ("Ethernet", 16, 64, 16, "8K", 8, 223, 3433, 464, 109, 81),
    ("Ethernet", 8, 32, 16, "8K", 16, 445, 3528, 923, 38, 72),
    ("Ethernet", 4, 16, 16, "8K", 32, 881, 3436, 1827, 33, 56),
    ("Ethernet", 2, 8, 16, "8K", 64, 1773, 2087, 3696, 31, 28),
    ("Ethernet", 1, 4, 16, "8K", 128, 3532, 234, 7329, 30, 2),
    ("InfiniBand", 16, 128, 64, "8K", 1, 96, 335, 179, 36, 52),
    ("InfiniBand", 16, 128, 64, "16K", 2, 192, 346, 356, 37, 37),
    ("InfiniBand", 16, 128, 64, "32K", 4, 381, 377, 714, 37, 25),
    ("InfiniBand", 16, 128, 64, "64K", 8, 770, 422, 1422, 32, 16),
    ("InfiniBand", 8, 64, 64, "8K", 2, 192, 332, 352, 34, 36),
    ("InfiniBand", 4, 32, 64, "8K", 4, 384, 339, 711, 31, 23),
    ("InfiniBand", 2, 16, 64, "8K", 8, 768, 270, 1436, 31, 11),
    ("InfiniBand", 1, 8, 64, "8K", 16, 1534, 167, 2869, 31, 4),
)

# Herring Table V: ms to average 100 MB, by GPUs (8 per p3dn.24xlarge node).
HERRING_GPUS = (64, 128, 256, 512)
HERRING_EFA_MS = (13.457, 14.21, 15.237, 16.449)
HERRING_NO_EFA_MS = (20.53, 24.21, 27.49, 31.32)


def claimed_onebit(network: str, allreduce_pct: float) -> bool:
    """Rows the model claims within 2x: communication-dominated (allreduce >= 50% of the
    step) on the Ethernet cluster. The one communication-dominated InfiniBand row (52%) is
    reported as a miss: its measured allreduce is mostly a cost outside the network model
    (see the summary)."""
    return network == "Ethernet" and allreduce_pct >= 50


def onebit_rows() -> list[dict[str, Any]]:
    event = [Event("all_reduce", "world", BERT_BYTES)]
    one_node = {}  # per network: (paper, ours) on one node
    for net, nodes, *_, ar, _, _, _ in ONEBIT_TABLE2:
        if nodes == 1:
            one_node[net] = (ar, step_comm_time(event, cluster(PRESET_OF[net], 1)) * 1e3)
    rows = []
    for net, nodes, gpus, bpg, batch, accum, fwd, ar, bwd, step, pct in ONEBIT_TABLE2:
        c = cluster(PRESET_OF[net], nodes)
        assert c.workers == gpus
        ours = step_comm_time(event, c) * 1e3
        hier = step_comm_time(event, c, all_reduce="hierarchical") * 1e3
        p1, o1 = one_node[net]
        inc = nodes > 1
        rows.append({
            "network": net, "preset": c.name, "nodes": nodes, "gpus": gpus,
            "batch_per_gpu": bpg, "batch": batch, "grad_accum": accum,
            "paper_forward_ms": fwd, "paper_backward_else_ms": bwd, "paper_step_ms": step,
            "paper_allreduce_pct": pct, "paper_ms": ar, "ours_ms": ours, "ratio": ours / ar,
            "ours_hierarchical_ms": hier, "ratio_hierarchical": hier / ar,
            "paper_minus_1node_ms": ar - p1 if inc else "",
            "ours_minus_1node_ms": ours - o1 if inc else "",
            "ratio_increment": (ours - o1) / (ar - p1) if inc else "",
            "comm_dominated": pct >= 50, "claimed": claimed_onebit(net, pct),
            "within_2x": 0.5 <= ours / ar <= 2,
        })  # fmt: skip
    return rows


def herring_rows() -> list[dict[str, Any]]:
    rows = []
    for gpus, efa, no_efa in zip(HERRING_GPUS, HERRING_EFA_MS, HERRING_NO_EFA_MS):
        c = cluster(EFA, gpus // 8)
        ours = step_comm_time([Event("ps", "world", HERRING_BYTES)], c) * 1e3
        ring = step_comm_time([Event("all_reduce", "world", HERRING_BYTES)], c) * 1e3
        rows.append({
            "gpus": gpus, "nodes": c.nodes, "preset": c.name, "paper_efa_ms": efa,
            "ours_ms": ours, "ratio": ours / efa, "paper_no_efa_ms": no_efa,
            "ratio_no_efa": ours / no_efa, "ours_nccl_ring_ms": ring,
            "claimed": True, "within_2x": 0.5 <= ours / efa <= 2,
        })  # fmt: skip
    return rows


def fit_ps(ms: Sequence[float], nodes: Sequence[int]) -> tuple[float, float]:
    """Least-squares ``(alpha_s, bandwidth_Bps)`` of the node-to-server part ``m alpha + n
    beta`` that a column would need: the column minus our intra-node phases (which do not
    depend on m), fitted over m."""
    c = cluster(EFA, 1)
    g = c.workers_per_node
    intra = 2 * ((g - 1) * c.intra.alpha + (g - 1) / g * HERRING_BYTES * c.intra.beta)
    intra += (g - 1) / g * HERRING_BYTES * c.gamma + cm.JUMBO_FRAME * c.gamma
    y = np.asarray(ms) * 1e-3 - intra
    a = np.stack([np.asarray(nodes, float), np.ones(len(nodes))], axis=1)
    (alpha, nbeta), *_ = np.linalg.lstsq(a, y, rcond=None)
    return float(alpha), HERRING_BYTES / float(nbeta)


def _presets_md() -> str:
    rows = []
    for name, p in cm.PRESETS.items():
        rows.append((f"`{name}`", p["workers_per_node"], f"{p['intra_bandwidth'] / 1e9:g}",
                     f"{p['intra_latency'] * 1e6:g}", f"{p['inter_bandwidth'] * 8 / 1e9:g}",
                     f"{p['inter_latency'] * 1e6:g}", f"{1 / p['gamma'] / 1e9:g}"))  # fmt: skip
    heads = ("preset", "GPUs/node", "intra GB/s", "intra us", "inter Gbps", "inter us",
             "reduce GB/s")  # fmt: skip
    return markdown_table(heads, rows)


def analyse(out_dir: Path) -> str:
    ob = onebit_rows()
    he = herring_rows()
    write_rows_csv(out_dir / "onebit_lamb_table2.csv", ob, "{:.4f}")
    write_rows_csv(out_dir / "herring_table5.csv", he, "{:.4f}")

    def mark(r):
        within = "" if r["within_2x"] else "outside 2x"
        return "claimed" + (", MISSED" if within else "") if r["claimed"] else within

    ob_md = markdown_table(
        ("network", "nodes", "GPUs", "batch", "accum", "allreduce %", "paper ms", "ours ms",
         "ours/paper", "hier. ms", "hier./paper", "increment ours/paper", "claim"),
        [(r["network"], r["nodes"], r["gpus"], r["batch"], r["grad_accum"],
          r["paper_allreduce_pct"], r["paper_ms"], f"{r['ours_ms']:.0f}", f"{r['ratio']:.2f}",
          f"{r['ours_hierarchical_ms']:.0f}", f"{r['ratio_hierarchical']:.2f}",
          f"{r['ratio_increment']:.2f}" if r["ratio_increment"] != "" else "-", mark(r))
         for r in ob],
    )  # fmt: skip
    he_md = markdown_table(
        ("GPUs", "nodes", "paper EFA ms", "ours ms", "ours/paper", "paper no-EFA ms",
         "ours/no-EFA", "ours NCCL ring ms", "claim"),
        [(r["gpus"], r["nodes"], r["paper_efa_ms"], f"{r['ours_ms']:.2f}", f"{r['ratio']:.2f}",
          r["paper_no_efa_ms"], f"{r['ratio_no_efa']:.2f}", f"{r['ours_nccl_ring_ms']:.1f}",
          mark(r)) for r in he],
    )  # fmt: skip

    claimed = [r for r in ob + he if r["claimed"]]
    n_ok = sum(r["within_2x"] for r in claimed)
    ratios = [r["ratio"] for r in claimed]
    eth = [r for r in ob if r["network"] == "Ethernet" and r["nodes"] > 1]
    ib = [r for r in ob if r["network"] == "InfiniBand"]
    ib1 = next(r for r in ib if r["nodes"] == 1)
    eth1 = next(r for r in ob if r["network"] == "Ethernet" and r["nodes"] == 1)
    ib_miss = [r for r in ib if r["comm_dominated"]]
    ib_inc = [r["ratio_increment"] for r in ib if r["nodes"] > 1]
    ib16 = [r["paper_ms"] for r in ib if r["nodes"] == 16]
    nodes = [g // 8 for g in HERRING_GPUS]
    a_efa, bw_efa = fit_ps(HERRING_EFA_MS, nodes)
    a_tcp, bw_tcp = fit_ps(HERRING_NO_EFA_MS, nodes)
    efa = cluster(EFA, 8)
    rr = [r["ours_nccl_ring_ms"] / r["ours_ms"] for r in he]

    return f"""# Cost model validation: 1-bit LAMB Table 2 and Herring Table V

`shoal.costmodel` (alpha-beta-gamma, Thakur, Rabenseifner & Gropp 2005) projected onto
the clusters of two papers, one preset per cluster, never tuned per row. Ratios are
ours / paper. **{n_ok} of {len(claimed)} claimed rows are within 2x** (ratios
{min(ratios):.2f} to {max(ratios):.2f}). Claimed: every 1-bit LAMB row where communication
dominates (allreduce >= 50% of the step) except one, the InfiniBand 16-node 8K row (52%),
which we miss at {ib_miss[0]["ratio"]:.2f} (explained below), and all of Herring's rows with
EFA.

## Presets

{_presets_md()}

Sources and assumptions are in the comments of `PRESETS`: the inter-node numbers are the
papers' (4.1 Gbps effective by iperf; 100 Gb EDR "close to theoretical peak"; 100 Gbps EFA,
all of it usable with Herring's proxy servers); NVLink (120 GB/s of NCCL bus bandwidth on a
V100 hybrid cube-mesh), PCIe (12 GB/s, Herring's figure), latencies and the reduction rate
(V100 HBM2) are assumptions. Bandwidths are per direction; the inter-node one is per node.

## 1-bit LAMB Table 2: allreduce of BERT-large's fp16 gradients ({BERT_BYTES / 1e6:.0f} MB)

Reading of the table: the columns are nodes, GPUs, batch per GPU, batch, gradient
accumulation steps, then per optimizer step forward, backward allreduce, backward everything
else, step (optimizer) and the allreduce share, which is allreduce / (sum of the four
times): 3579 / (55 + 3579 + 117 + 191) = 91% in the first row. Forward and "backward
everything else" grow with the accumulation steps (they are summed over micro-batches),
while the allreduce stays flat for a fixed cluster (Ethernet, 64 nodes: 3579, 3533, 3599,
3674 ms for 2 to 16 accumulation steps): DeepSpeed all-reduces once per optimizer step, at
the accumulation boundary. So each row is **one all-reduce of all {
        BERT_LARGE_PARAMS / 1e6:.0f}M fp16 gradients** ({
        BERT_BYTES / 1e6:.0f} MB; the paper trains in FP16 and counts
its 1-bit compression as 16x), not one per micro-batch.

Formula: baseline LAMB in DeepSpeed all-reduces through PyTorch distributed's NCCL backend
(section 5: the NCCL backend "of PyTorch distributed"), which for a 680 MB buffer uses
rings; NCCL lays a ring through the GPUs of a node and then to the next node, so each
node's NIC carries one ring stream: the flat ring all-reduce with the inter-node beta ("ours").
The hierarchical formula (intra reduce-scatter, inter all-reduce of 1/g, intra all-gather)
is shown for comparison: with a shared NIC it moves as many bytes across nodes, so it is
within a few % at scale.

{ob_md}

"increment" compares what adding nodes costs: (ours - ours on 1 node) / (paper - paper on 1
node).

Gaps:
- **Ethernet, 2-64 nodes** (ratios {min(r["ratio"] for r in eth):.2f} to
  {max(r["ratio"] for r in eth):.2f}): the bandwidth term 2(p-1)/p n / 4.1 Gbps is
  {2 * BERT_BYTES / (4.1e9 / 8) * 1e3:.0f} ms at large p; the paper measures up to ~3.7 s. The
  remaining ~25% at 4-64 nodes is not explained by the model; plausible causes are what
  TCP loses under NCCL's concurrent ring streams (the iperf figure is one clean stream) and
  the fixed per-step cost visible on one node (below). At 2 nodes the model is 11% high:
  that row's measured allreduce is the fastest multi-node one.
- **One node** (unclaimed, communication is 2-4% of the step): the paper's "allreduce" on one
  node is {eth1["paper_ms"]} ms over PCIe and {ib1["paper_ms"]} ms over NVLink, where a ring
  needs {eth1["ours_ms"]:.0f} and {ib1["ours_ms"]:.0f} ms. The paper does not say what its
  timer spans; presumably more than the wire: copying gradients into and out of the
  flat buffer, the averaging division, the fp16 overflow check, and waiting for the slowest
  GPU to finish its backward pass (the allreduce is the step's first synchronisation
  point). None of that is in an alpha-beta model.
- **InfiniBand** (ratios {min(r["ratio"] for r in ib):.2f} to {max(r["ratio"] for r in ib):.2f};
  the 16-node 8K row at {ib_miss[0]["paper_allreduce_pct"]}% is the one communication-dominated
  row we miss, at {ib_miss[0]["ratio"]:.2f}): the network part is small at 100 Gbps (~{
        ib_miss[0]["ours_ms"]:.0f} ms for 680 MB), so the fixed cost above dominates: the paper's
  one-node row is already {ib1["paper_ms"]} ms, and the 16-node allreduce rises from
  {ib16[0]} to {ib16[-1]} ms with the accumulation steps alone (same bytes, same network). The
  increments over one node, which cancel the fixed part, agree better (ours/paper
  {min(ib_inc):.2f} to {max(ib_inc):.2f}; the model is again optimistic where the paper grows
  with batch size). The model projects network time, not a framework's bookkeeping: add a
  measured per-step overhead (`project`'s compute_s) when one is known.

## Herring Table V: averaging 100 MB of gradients, p3dn.24xlarge (8 x V100, 100 Gbps EFA)

Formula: Herring's own scheme (section III-A): NCCL reduce-scatter inside the node over
NVLink, each node sends its 100 MB (a 1/8 slice per GPU, over the node's one NIC) to the
parameter servers (as many server nodes as worker nodes, each holding a 1/m shard of every
buffer) and gets the sums back, pipelined per 9000 B jumbo frame (section IV-A: p alpha +
n beta + one frame's reduction), then NCCL all-gather inside the node: the "ps" event on the
world group (`hierarchical_ps`). The NCCL ring column is the flat ring on the same preset:
the model puts it {min(rr):.1f}x to {
        max(rr):.1f}x slower (latency grows with the ring), in line with Herring's "gradient
averaging in half the time NCCL takes" (Fig. 10).

{he_md}

Gaps: ours is 0.68-0.75x the paper with EFA. The model has 100 MB at 12.5 GB/s = 8 ms on the
wire, {2 * 7 / 8 * HERRING_BYTES / efa.intra_bandwidth * 1e3:.2f} ms of NVLink phases and
m x {efa.inter_latency * 1e6:g} us of latency; not modelled: the PCIe copies to and from host
memory (100 MB over 4 x 12 GB/s = ~2 ms each way, partly overlapped), the MPI barriers between
phases, and CPU-side reduction and proxy hand-offs. A least-squares fit of the EFA column
(minus our intra-node phases) to m alpha + n / bandwidth gives alpha = {a_efa * 1e6:.0f} us per
worker node and bandwidth = {bw_efa * 8 / 1e9:.0f} Gbps ({bw_efa / 1e9:.2f} GB/s) against the
preset's {efa.inter_latency * 1e6:g} us and 100 Gbps: about 3/4 of line rate is realised.

**Without EFA** (TCP over the same 100 Gbps ENA), the same fit needs alpha =
{a_tcp * 1e6:.0f} us per worker node and {bw_tcp * 8 / 1e9:.0f} Gbps ({bw_tcp / 1e9:.2f} GB/s):
a lower effective bandwidth and a per-peer cost that grows with the number of flows. The
paper blames TCP head-of-line blocking and the imbalanced rates of many parallel TCP streams;
an alpha-beta model with a constant beta cannot produce the growth except through alpha, so
the no-EFA column would need its own preset (~{bw_tcp * 8 / 1e9:.0f} Gbps, ~{a_tcp * 1e6:.0f} us),
a fitted one rather than a documented one, or a contention term (beta growing with the
number of flows). We do not claim that column (ours/no-EFA: {he[0]["ratio_no_efa"]:.2f} to
{he[-1]["ratio_no_efa"]:.2f}).

Model scope: no overlap of compute and communication, non-blocking fabric, one NIC per node,
rings crossing each NIC once; see `shoal.costmodel`'s docstring.
"""


DESCRIPTION = "alpha-beta-gamma cost model vs 1-bit LAMB Table 2 and Herring Table V"


def get_config() -> Analysis:
    return Analysis(name="costmodel_validation", run=analyse, description=DESCRIPTION)
