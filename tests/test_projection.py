"""Projecting a run to a cluster: per-step collectives replayed for many workers, timed by
the cost model (whose formulas tests/test_costmodel.py checks by hand)."""

import harness
import pytest
from harness import QUICKSTART

from shoal.comms import tree_nbytes
from shoal.costmodel import Cluster, Event, ring_all_reduce, step_comm_time
from shoal.experiments.config import ConfigError
from shoal.experiments.overrides import apply_overrides, load_config
from shoal.experiments.runner.projection import project_run
from shoal.experiments.tasks import GaussianMixtureTask
from shoal.optim.helpers import partial_exchange_bins

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="single-process projection")

CFG = apply_overrides(load_config(QUICKSTART), ["steps=20", "project_workers=64"])
TASK = GaussianMixtureTask(CFG)
N = tree_nbytes(TASK.init_params())
CLUSTER = Cluster.preset("v100-nvlink-25gbps", 8)  # 64 workers
# Every step first all-reduces the non-finite flag, one int32 over all 64 workers: a short
# message, so recursive doubling over the inter-node link, log2(64) = 6 rounds of
# alpha + 4 beta + 4 gamma.
FLAG = Event("all_reduce", "world", 4)
FLAG_S = 6 * (CLUSTER.inter_latency + 4 / CLUSTER.inter_bandwidth + 4 * CLUSTER.gamma)


def test_flag_is_a_short_all_reduce():
    assert step_comm_time([FLAG], CLUSTER) == pytest.approx(FLAG_S)


def test_ssgd_is_one_ring_all_reduce_per_step():
    got = project_run(CFG, "ssgd", TASK, [])
    want = step_comm_time([Event("all_reduce", "world", N)], CLUSTER)
    c = CLUSTER
    # The model's flat ring over 64 workers is limited by the 25 Gbps link between nodes.
    assert want == pytest.approx(ring_all_reduce(N, 64, c.inter_latency, 1 / c.inter_bandwidth,
                                                 c.gamma))  # fmt: skip
    assert got["projected_comm_ms"] == pytest.approx(1e3 * (FLAG_S + want))
    assert got["projected_ms"] == pytest.approx(got["projected_comm_ms"] + got["compute_ms"])
    assert 0 < got["compute_ms"] < 1e3


def test_bmuf_pays_once_per_block():
    block = CFG.params["bmuf"].block_size  # 10: steps 10 and 20 synchronise
    got = project_run(CFG, "bmuf", TASK, [])
    one = step_comm_time([Event("all_reduce", "world", N)], CLUSTER)
    # The flag every step, the model once per block.
    assert got["projected_comm_ms"] == pytest.approx(1e3 * (FLAG_S + one / block))


def test_policy_changes_apply_from_the_next_step():
    cfg = apply_overrides(CFG, ["adaptive.fraction=0.6"])
    got = project_run(cfg, "adaptive", TASK, [(5, {"sync": "partial"})])
    sizes = _leaf_bytes()
    bins = [sum(sizes[p] for p in b) for b in partial_exchange_bins(TASK.init_params(), 0.6)]
    part = [step_comm_time([Event("all_reduce", "world", bins[t % 2])], CLUSTER) for t in
            range(15)]  # fmt: skip
    # The noise scale's squared norm rides in the gradient's all-reduce.
    full = step_comm_time([Event("all_reduce", "world", N + 4)], CLUSTER)
    # Plus the non-finite flag on each of the 20 steps.
    assert got["projected_comm_ms"] == pytest.approx(1e3 * (FLAG_S + (5 * full + sum(part)) / 20))


def _leaf_bytes():
    import jax

    return {
        jax.tree_util.keystr(k): v.size * 4
        for k, v in jax.tree_util.tree_leaves_with_path(TASK.init_params())
    }


def test_projection_settings_are_checked():
    with pytest.raises(ConfigError, match="project_workers"):
        apply_overrides(CFG, ["project_workers=12"])  # not whole nodes of 8
    with pytest.raises(ConfigError, match="project_cluster"):
        apply_overrides(CFG, ["project_cluster=nowhere"])
