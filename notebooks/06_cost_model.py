# %% [markdown]
# # The cost model: projected step time versus cluster size
#
# `shoal.costmodel` times collectives with the alpha-beta(-gamma) model: a message of
# `n` bytes costs `alpha + n beta` (latency, inverse bandwidth), reducing it `n gamma`. A
# ring all-reduce over `p` workers costs `2 (p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma`.
# `record_events` replays a transformation's steps for any number of workers with a
# recording stand-in collective and returns each step's collectives (kind, group, bytes),
# counting only the `lax.cond` / `lax.switch` branches taken; `step_comm_time` times them on
# a `Cluster` preset. Here: every quickstart algorithm, 8 to 512 workers, on 8 x V100 nodes
# with 25 Gbps between nodes, for the quickstart MLP and for a model of BERT-large's size.

# %%
import os

import jax
import matplotlib.pyplot as plt
import numpy as np

from shoal.comms import record_events
from shoal.costmodel import Cluster, step_comm_time
from shoal.experiments import algorithms
from shoal.experiments.overrides import load_config
from shoal.experiments.tasks import make_task

SMALL = os.environ.get("SHOAL_NOTEBOOK_SMALL") == "1"  # CI: fewer sizes and steps
PRESET = "v100-nvlink-25gbps"
SIZES = [8, 64] if SMALL else [8, 16, 32, 64, 128, 256, 512]
STEPS = 20 if SMALL else 100
cfg = load_config("quickstart")
cfg = cfg.__class__(**{**cfg.__dict__, "steps": STEPS})
task = make_task(cfg)
params = task.init_params()
NAMES = [a for a in cfg.algorithms]

# %% [markdown]
# ## Per-step communication of each algorithm
#
# For a given worker count, rebuild each algorithm for that many workers, replay `STEPS`
# steps, and average the projected communication time per step. Two-tier algorithms get
# their `(intra, inter)` split (groups of `group_size` consecutive workers).

# %%
from shoal.costmodel import Event


def events_of(name, workers):
    entry = algorithms.resolve(name, cfg.__class__(**{**cfg.__dict__, "workers": workers}))
    group = entry.group_size
    steps = record_events(
        lambda c: entry.build(c, task=task),
        params,
        workers=workers,
        steps=STEPS,
        group_size=group,
    )
    return steps, group


def scaled(e, scale):
    # The non-finite flag (one int32) is the same for any model; everything else grows
    # with it.
    return e if e.nbytes <= 4 else Event(e.kind, e.group, int(e.nbytes * scale))


def comm_ms(steps, group, workers, scale=1.0):
    cluster = Cluster.preset(PRESET, workers // 8)
    steps = [[scaled(e, scale) for e in ev] for ev in steps]
    return 1e3 * np.mean([step_comm_time(ev, cluster, group_size=group) for ev in steps])


def plot_ms(ms, title):
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for n in NAMES:
        ax.plot(SIZES, ms[n], marker="o", label=n)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="workers (8 per node)",
        ylabel="projected communication ms / step",
        title=title,
    )
    ax.legend(fontsize="small")
    ax.grid(True, which="both", alpha=0.3)


recorded = {(n, w): events_of(n, w) for n in NAMES for w in SIZES}
small = {n: [comm_ms(*recorded[n, w], w) for w in SIZES] for n in NAMES}
plot_ms(small, "quickstart MLP (27 KB)")

# %% [markdown]
# The quickstart model is 27 KB: every message is tiny and the latency terms dominate. A
# ring all-reduce pays `2 (p-1)` hops whatever the payload, so S-SGD, 1-bit LAMB, BFB and
# PGX cost about the same and grow linearly with `p`; what helps is talking less often
# (BMUF: once per block) or to fewer peers (peer averaging: one message per step), and
# keeping the frequent exchange inside a node (BMUF_GTC).
#
# ## A model of BERT-large's size
#
# Every algorithm here moves bytes in proportion to the model (GTC's and PGX's capacities
# are fractions of it), so scaling each recorded event's bytes by 340M / 6922 gives the same
# steps for a 340M-parameter float32 model without allocating it (all but the 4-byte
# non-finite flag, which does not grow with the model). Bandwidth now dominates,
# and the bytes each algorithm saves show up as time.

# %%
scale = 340e6 / sum(np.size(x) for x in jax.tree.leaves(params))
big = {n: [comm_ms(*recorded[n, w], w, scale) for w in SIZES] for n in NAMES}
plot_ms(big, "the same, 340M parameters")

# %% [markdown]
# At this scale on 25 Gbps links an S-SGD all-reduce takes about a second per step; 1-bit
# LAMB's compressed stage, GTC's sparse exchange and BMUF's block steps cut it by the
# factors their bytes suggest. The model ignores overlap of communication with the backward
# pass and network contention: read it as a ranking and an order of magnitude, validated
# against two papers' measurements in `experiments/configs/costmodel_validation.py`.
