"""shoal.costmodel: every formula against a hand computation, its limits, the mapping
of groups to links, the per-step projection, argument checks, and the validation config
(1-bit LAMB Table 2, Herring Table V) within 2x on the rows it claims."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import pytest
from harness import UNDER_MPI

from shoal import costmodel as cm
from shoal.costmodel import Cluster, Event, Link, Projection, project, speedup
from shoal.costmodel import step_comm_time as comm
from shoal.experiments.runner.cli import main

pytestmark = pytest.mark.skipif(UNDER_MPI, reason="host-only arithmetic")

CONFIG = Path(__file__).resolve().parents[1] / "experiments" / "configs"
CONFIG = CONFIG / "costmodel_validation.py"

A, B, G = 1e-3, 1e-6, 1e-7  # alpha (s), beta (s/B), gamma (s/B)
N = 1000.0

# A small cluster to compute by hand: 2 nodes x 4 workers, intra 10 MB/s (beta 1e-7) with
# 0.1 ms latency, inter 1 MB/s per node (beta 1e-6) with 1 ms latency.
INTRA = Link(1e-4, 1e7)
INTER = Link(1e-3, 1e6)
SMALL = Cluster(2, 4, intra_bandwidth=1e7, intra_latency=1e-4, inter_bandwidth=1e6,
                inter_latency=1e-3)  # fmt: skip


# ------------------------------------------------------------------ formulas by hand


def test_ring_all_reduce():
    # 2 (p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma, p = 4
    assert cm.ring_all_reduce(N, 4, A, B, G) == pytest.approx(6e-3 + 1.5e-3 + 7.5e-5)


def test_rabenseifner_all_reduce():
    assert cm.rabenseifner_all_reduce(N, 4, A, B, G) == pytest.approx(4e-3 + 1.5e-3 + 7.5e-5)
    # p = 5 is not a power of two: ceil(log2 5) = 3 rounds each way
    assert cm.rabenseifner_all_reduce(N, 5, A, B, G) == pytest.approx(6e-3 + 1.6e-3 + 8e-5)


def test_tree_all_reduce():
    # 2 log2(p) (alpha + n beta) + log2(p) n gamma
    assert cm.tree_all_reduce(N, 4, A, B, G) == pytest.approx(4 * 2e-3 + 2 * 1e-4)


def test_all_gather_all_to_all_broadcast_ppermute():
    assert cm.all_gather(N, 4, A, B) == pytest.approx(3 * 2e-3)  # (p-1)(alpha + n beta)
    assert cm.all_to_all(N, 4, A, B) == pytest.approx(3e-3 + 0.75e-3)  # n = whole buffer
    assert cm.broadcast(N, 8, A, B) == pytest.approx(3 * 2e-3)
    assert cm.broadcast(N, 5, A, B) == pytest.approx(3 * 2e-3)  # ceil(log2 5) rounds
    assert cm.ppermute(N, 4, A, B) == pytest.approx(2e-3)


def test_parameter_server():
    assert cm.ps_naive(N, 4, A, B, G) == pytest.approx(2e-3 + 2e-3 + 4 * N * G)
    # p alpha + n beta + one segment's reduction (gamma per byte)
    assert cm.ps_pipelined(N, 4, A, B, G, segment=100) == pytest.approx(4e-3 + 1e-3 + 1e-5)
    assert cm.ps_pipelined(N, 4, A, B, G) == pytest.approx(4e-3 + 1e-3 + N * G)  # n < frame
    # a reduction slower than the wire (gamma > beta) becomes the bottleneck
    assert cm.ps_pipelined(N, 4, A, B, 2e-6, segment=100) == pytest.approx(4e-3 + 2e-3 + 2e-4)


def test_hierarchical_all_reduce():
    n, g = 8000.0, 1e-8
    rs = 3e-4 + 0.75 * n * 1e-7 + 0.75 * n * g
    ag = 3e-4 + 0.75 * n * 1e-7
    # the 4 inter-node all-reduces of n/4 share the node's NIC: beta 4e-6 each
    ar = 2 * 1e-3 + 2 * 0.5 * (n / 4) * 4e-6 + 0.5 * (n / 4) * g
    got = cm.hierarchical_all_reduce(n, 2, 4, INTRA, INTER, g)
    assert got == pytest.approx(rs + ar + ag) == pytest.approx(0.01187)


def test_hierarchical_one_node_is_the_intra_ring():
    for g in (1, 2, 8):
        want = cm.ring_all_reduce(5e6, g, INTRA.alpha, INTRA.beta, G)
        assert cm.hierarchical_all_reduce(5e6, 1, g, INTRA, INTER, G) == pytest.approx(want)


def test_hierarchical_ps():
    n = 8000.0
    intra = 2 * (3e-4 + 0.75 * n * 1e-7)
    got = cm.hierarchical_ps(n, 2, 4, INTRA, INTER, segment=100)
    assert got == pytest.approx(intra + 2e-3 + n * 1e-6)
    naive = cm.hierarchical_ps(n, 2, 4, INTRA, INTER, pipelined=False)
    assert naive == pytest.approx(intra + 2e-3 + 2 * n * 1e-6)


# ------------------------------------------------------------------ limits


@pytest.mark.parametrize("f", [cm.ring_all_reduce, cm.rabenseifner_all_reduce, cm.tree_all_reduce])
def test_one_worker_costs_nothing_all_reduce(f):
    assert f(1e9, 1, A, B, G) == 0.0


@pytest.mark.parametrize("f", [cm.all_gather, cm.all_to_all, cm.broadcast, cm.ppermute])
def test_one_worker_costs_nothing(f):
    assert f(1e9, 1, A, B) == 0.0


def test_zero_latency_leaves_the_bandwidth_term():
    p, n = 16, 1e6
    assert cm.ring_all_reduce(n, p, 0, B) == pytest.approx(2 * 15 / 16 * n * B)
    assert cm.rabenseifner_all_reduce(n, p, 0, B) == pytest.approx(2 * 15 / 16 * n * B)
    assert cm.tree_all_reduce(n, p, 0, B) == pytest.approx(2 * 4 * n * B)
    assert cm.all_gather(n, p, 0, B) == pytest.approx(15 * n * B)
    assert cm.all_to_all(n, p, 0, B) == pytest.approx(15 / 16 * n * B)
    assert cm.broadcast(n, p, 0, B) == pytest.approx(4 * n * B)
    assert cm.ppermute(n, p, 0, B) == pytest.approx(n * B)
    assert cm.ps_naive(n, p, 0, B) == pytest.approx(2 * n * B)
    assert cm.ps_pipelined(n, p, 0, B) == pytest.approx(n * B)


def test_ring_bandwidth_term_grows_to_two_n_beta():
    n = 1e8
    terms = [cm.ring_all_reduce(n, p, 0, B) for p in range(1, 1025)]
    assert all(a < b for a, b in zip(terms, terms[1:]))
    assert terms[-1] < 2 * n * B
    assert terms[-1] == pytest.approx(2 * n * B, rel=1e-3)


# ------------------------------------------------------------------ clusters and steps


def test_presets():
    spec = {  # name: (workers per node, inter-node Gbps)
        "v100-nvlink-25gbps": (8, 25),
        "v100-pcie-40gbe": (4, 4.1),
        "v100-nvlink-ib-edr": (8, 100),
        "p3dn-efa": (8, 100),
    }
    assert set(spec) <= set(cm.PRESETS)
    for name, (wpn, gbps) in spec.items():
        c = Cluster.preset(name, 3)
        assert c == cm.cluster(name, 3)
        assert (c.nodes, c.workers_per_node, c.workers, c.name) == (3, wpn, 3 * wpn, name)
        assert c.inter_bandwidth == pytest.approx(gbps * 1e9 / 8)
        assert c.intra_bandwidth > c.inter_bandwidth and c.gamma > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.nodes = 4
    # One worker per site over 1 Gbps: every exchange crosses the wide-area link.
    wan = Cluster.preset("wan-1gbps", 64)
    assert (wan.workers, wan.workers_per_node) == (64, 1)
    assert wan.inter_bandwidth == pytest.approx(1e9 / 8) and wan.inter_latency == 10e-3


def test_step_comm_time_by_hand():
    events = [
        Event("all_reduce", "world", 8000),  # p = 8 spans nodes: ring on the inter link
        Event("all_gather", "intra", 100),  # p = 4 inside a node: intra link
        Event("all_to_all", "inter", 800),  # p = 2, all 4 workers of a node share the NIC
        Event("ppermute", "world", 1000),
        Event("broadcast", "inter", 1000),  # 4 concurrent inter broadcasts share the NIC
    ]
    want = [
        14e-3 + 2 * 7 / 8 * 8000 * 1e-6,
        3 * (1e-4 + 100 * 1e-7),
        1e-3 + 0.5 * 800 * 4e-6,
        1e-3 + 1000 * 1e-6,
        1 * (1e-3 + 1000 * 4e-6),
    ]
    assert [cm.event_time(e, SMALL) for e in events] == pytest.approx(want)
    assert comm(events, SMALL) == pytest.approx(sum(want)) == pytest.approx(0.03793)
    # group_size 2: intra p = 2 (inside a node), inter p = 4 with 2 streams per NIC
    assert comm(events[1:2], SMALL, group_size=2) == pytest.approx(1e-4 + 100 * 1e-7)
    bc = 2 * (1e-3 + 1000 * 2e-6)
    assert comm(events[4:5], SMALL, group_size=2) == pytest.approx(bc)
    # groups of 8 span both nodes: "intra" is then the inter link, "inter" has p = 1
    assert comm(events[1:2], SMALL, group_size=8) == pytest.approx(7 * (1e-3 + 100 * 1e-6))
    assert comm(events[4:5], SMALL, group_size=8) == 0.0
    assert comm([], SMALL) == 0.0
    assert comm([("all_gather", "intra", 100)], SMALL) == pytest.approx(want[1])  # tuples


def test_step_comm_time_algorithms():
    e = [Event("all_reduce", "world", 8000)]
    assert comm(e, SMALL, all_reduce="hierarchical") == pytest.approx(
        cm.hierarchical_all_reduce(8000, 2, 4, INTRA, INTER)
    )
    assert comm(e, SMALL, all_reduce="tree") == pytest.approx(6 * (1e-3 + 8000e-6))
    assert comm(e, SMALL, all_reduce="rabenseifner") == pytest.approx(6e-3 + 14e-3)
    ps = [Event("ps", "world", 8000)]
    assert comm(ps, SMALL) == pytest.approx(cm.hierarchical_ps(8000, 2, 4, INTRA, INTER))
    assert comm(ps, SMALL, ps="naive") == pytest.approx(
        cm.hierarchical_ps(8000, 2, 4, INTRA, INTER, pipelined=False)
    )
    one = dataclasses.replace(SMALL, nodes=1)  # one node: everything on the intra link
    assert comm(e, one) == pytest.approx(cm.ring_all_reduce(8000, 4, 1e-4, 1e-7))
    assert comm(e, one, all_reduce="hierarchical") == pytest.approx(comm(e, one))


def test_short_all_reduce_is_recursive_doubling():
    # 3 rounds (p = 8) of (alpha + n beta + n gamma) on the inter link, for any algorithm.
    assert cm.recursive_doubling_all_reduce(4, 8, A, B, G) == pytest.approx(3 * (A + 4e-6 + 4e-7))
    flag = [Event("all_reduce", "world", 4)]
    for algo in cm.ALL_REDUCE_ALGORITHMS:
        assert comm(flag, SMALL, all_reduce=algo) == pytest.approx(3 * (1e-3 + 4e-6))
    # one byte more than the cut-off: back to the ring (2 (p - 1) latencies)
    big = [Event("all_reduce", "world", cm.SHORT_ALL_REDUCE + 1)]
    assert comm(big, SMALL) == pytest.approx(
        cm.ring_all_reduce(cm.SHORT_ALL_REDUCE + 1, 8, 1e-3, 1e-6)
    )


def test_project_and_speedup():
    events = [Event("all_reduce", "world", 8000)]
    p = project(events, SMALL, 0.1)
    assert p.comm_s == pytest.approx(0.028)
    assert p.step_s == pytest.approx(0.128)  # no overlap: compute + comm
    assert p.compute_s == pytest.approx(0.1) and p.comm_fraction == pytest.approx(0.028 / 0.128)
    fast = project([], SMALL, 0.1)
    assert speedup(p, fast) == pytest.approx(1.28)
    assert speedup(0.3, 0.1) == pytest.approx(3.0)
    assert speedup(fast, Projection(0.0, 0.2)) == pytest.approx(0.5)


def test_event_matches_recording_layout():
    e = Event("all_reduce", "world", 128)
    assert e == Event(kind="all_reduce", group="world", nbytes=128)
    assert hash(e) == hash(Event("all_reduce", "world", 128))


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: cm.ring_all_reduce(N, 0, A, B), "p"),
        (lambda: cm.all_gather(N, 2.5, A, B), "p"),
        (lambda: cm.ring_all_reduce(-1, 4, A, B), "n"),
        (lambda: cm.all_to_all(N, 4, -A, B), "alpha"),
        (lambda: cm.broadcast(N, 4, A, -B), "beta"),
        (lambda: cm.tree_all_reduce(N, 4, A, B, -G), "gamma"),
        (lambda: cm.ps_pipelined(N, 4, A, B, G, segment=0), "segment"),
        (lambda: cm.hierarchical_all_reduce(N, 0, 4, INTRA, INTER), "nodes"),
        (lambda: cm.hierarchical_all_reduce(N, 2, 0, INTRA, INTER), "per_node"),
        (lambda: Event("allreduce", "world", 8), "kind"),
        (lambda: Event("all_reduce", "node", 8), "group"),
        (lambda: Event("all_reduce", "world", -8), "nbytes"),
        (lambda: Event("all_reduce", "world", 8.5), "nbytes"),
        (lambda: Cluster.preset("dgx-a100", 2), "preset"),
        (lambda: cm.cluster("p3dn-efa", 0), "nodes"),
        (lambda: dataclasses.replace(SMALL, workers_per_node=0), "workers_per_node"),
        (lambda: dataclasses.replace(SMALL, inter_bandwidth=0), "inter_bandwidth"),
        (lambda: dataclasses.replace(SMALL, intra_latency=-1), "intra_latency"),
        (lambda: comm([Event("all_reduce", "intra", 8)], SMALL, group_size=3), "group_size"),
        (lambda: comm([Event("all_reduce", "intra", 8)], SMALL, group_size=0), "group_size"),
        (lambda: comm([], SMALL, all_reduce="butterfly"), "all_reduce"),
        (lambda: comm([Event("ps", "world", 8)], SMALL, ps="async"), "ps"),
        (lambda: project([], SMALL, -1.0), "compute_s"),
        (lambda: speedup(1.0, 0.0), "b"),
        (lambda: Link(1e-6, 0), "bandwidth"),
    ],
)
def test_bad_input_names_the_parameter(call, name):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        call()


# ------------------------------------------------------------------ validation config


def test_validation_config(tmp_path, capsys):
    assert main([str(CONFIG), "--out", str(tmp_path)]) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "1-bit LAMB Table 2" in summary and "Herring Table V" in summary
    tables = {}
    for name in ("onebit_lamb_table2.csv", "herring_table5.csv"):
        with open(tmp_path / name) as f:
            tables[name] = list(csv.DictReader(f))
    ob, he = tables["onebit_lamb_table2.csv"], tables["herring_table5.csv"]
    assert len(ob) == 18 and len(he) == 4
    for r in ob:
        assert float(r["ratio"]) == pytest.approx(
            float(r["ours_ms"]) / float(r["paper_ms"]), abs=1e-4
        )
    for r in he:
        assert float(r["ratio"]) == pytest.approx(
            float(r["ours_ms"]) / float(r["paper_efa_ms"]), abs=1e-4
        )
    claimed = [r for r in ob + he if r["claimed"] == "True"]
    # the claim: every Ethernet row where communication dominates (>= 50%: 8 rows) and all
    # four of Herring's EFA rows are within 2x
    eth = [r for r in ob if r["network"] == "Ethernet" and int(r["paper_allreduce_pct"]) >= 50]
    assert len(eth) == 8 and all(r["claimed"] == "True" for r in eth)
    assert all(r["claimed"] == "True" for r in he)
    assert len(claimed) == 12
    assert all(0.5 <= float(r["ratio"]) <= 2.0 for r in claimed)
    # one set of constants per cluster: the Ethernet rows of a node count agree exactly
    by_nodes = {}
    for r in eth:
        by_nodes.setdefault(r["nodes"], set()).add(r["ours_ms"])
    assert all(len(v) == 1 for v in by_nodes.values())
