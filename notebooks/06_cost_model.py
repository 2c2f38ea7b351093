# %% [markdown]
# # The cost model: projected step time versus cluster size
#
# `shoal.costmodel` times collectives with the alpha-beta(-gamma) model: a message of
# `n` bytes costs `alpha + n beta` (latency, inverse bandwidth), reducing it `n gamma`. A
# ring all-reduce over `p` workers costs `2 (p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma`.
# `record_events` replays a transformation's steps for any number of workers with a
# recording stand-in collective and returns each step's collectives (kind, group, bytes),
# counting only the `lax.cond` / `lax.switch` branches taken; `step_comm_time` times them on
# a `Cluster` preset. Here: ten of the quickstart's algorithms, one of each kind of
# exchange, on 8 to 512 workers of 8 x V100 nodes with 25 Gbps between nodes, for the
# quickstart MLP and for a model of BERT-large's size. (The quickstart's other entries
# repeat one of these patterns: LAMB, SMA and BFB all-reduce every step as S-SGD does,
# DiLoCo and MuLoCo once per round as BMUF, top-k all-gathers as GTC.)

# %%
import dataclasses

import jax
import matplotlib.pyplot as plt
import numpy as np

from shoal.comms import OneBit, record_events
from shoal.costmodel import Cluster, step_comm_time
from shoal.experiments import algorithms
from shoal.experiments.overrides import load_config
from shoal.experiments.tasks import make_task

PRESET = "v100-nvlink-25gbps"
SIZES = [8, 32, 128, 512]  # each size is one compile per algorithm
STEPS = 100
cfg = load_config("quickstart")
# record_events never draws a batch, but a config must hold one global batch per step.
cfg = dataclasses.replace(cfg, steps=STEPS, train_size=max(SIZES) * cfg.batch_size)
task = make_task(cfg)
params = task.init_params()
# Each algorithm and size is one compile of the replay: ten algorithms, not all seventeen.
NAMES = [
    "ssgd",  # a float32 all-reduce every step
    "onebit_lamb",  # dense during the warm-up, then signs
    "powersgd",  # two small all-reduces of low-rank factors
    "gtc",  # an all-gather of a fixed share of the gradient
    "demo",  # an all-gather of DCT components
    "partial_exchange",  # an all-reduce of part of the gradient
    "peer_averaging",  # one model to one peer
    "bmuf",  # an all-reduce of the model every 10 steps
    "streaming_diloco",  # the same, a quarter of the model at a time
    "bmuf_gtc",  # GTC inside groups of 4, BMUF across them
]

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
    print(f"{'ms per step':>16}" + "".join(f"{w:>9}" for w in SIZES) + " workers")
    for n in NAMES:
        print(f"{n:>16}" + "".join(f"{v:9.3g}" for v in ms[n]))
    fig, ax = plt.subplots(figsize=(8, 4.6))
    for n in NAMES:
        ax.plot(SIZES, ms[n], marker="o", label=n)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="workers (8 per node)",
        ylabel="projected communication ms / step",
        title=title,
    )
    ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1, 0.5))
    ax.grid(True, which="both", alpha=0.3)


recorded = {(n, w): events_of(n, w) for n in NAMES for w in SIZES}
small = {n: [comm_ms(*recorded[n, w], w) for w in SIZES] for n in NAMES}
plot_ms(small, "quickstart MLP (27 KB)")

# %% [markdown]
# The quickstart model is 27 KB: every message is tiny and the latency terms dominate. A
# ring all-reduce pays `2 (p-1)` hops whatever the payload, so S-SGD, 1-bit LAMB and
# partial exchange cost the same and grow linearly with `p` (0.09 ms at 8 workers, 31 ms
# at 512); PowerSGD, with two all-reduces a step, costs twice that, and the all-gathers of
# GTC and DeMo (`p - 1` hops) half. What helps is talking less often (BMUF: once per
# block, about a tenth of S-SGD), to fewer peers (peer averaging: one message per step,
# nearly flat in `p`), and keeping the frequent exchange inside a node (BMUF_GTC, the
# cheapest from 128 workers on). Streaming DiLoCo pays the latency of each of its four
# fragments, about three times BMUF.
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
# One exception to the proportion: 1-bit LAMB pads its buffer so that every worker owns a
# whole number of 32-bit words of signs. For the 6922-parameter MLP on 512 workers that
# padding is most of the buffer, and scaling it up overstates the bytes of a 340M model:

# %%
n_small = sum(np.size(x) for x in jax.tree.leaves(params))
for w in SIZES:
    recorded_bytes = OneBit().wire_bytes(n_small, w)[0] * scale
    real_bytes = OneBit().wire_bytes(340_000_000, w)[0]
    print(
        f"{w:4d} workers: padded to {OneBit().padded_size(n_small, w):6d} values; compressed "
        f"stage {recorded_bytes / 1e6:7.1f} MB scaled, {real_bytes / 1e6:5.1f} MB at 340M"
    )

# %% [markdown]
# At this scale on 25 Gbps links an S-SGD all-reduce takes about 0.9 s per step from 32
# workers on (bandwidth-bound, nearly flat in `p`). BMUF and Streaming DiLoCo cut it
# about tenfold (an all-reduce every 10 steps; the streaming one in quarters), PowerSGD
# to 0.2-0.3 s, BMUF_GTC, peer averaging and partial exchange to about 0.35-0.47 s. The
# all-gathers grow with `p` instead: GTC passes S-SGD at 32 workers and DeMo between 32
# and 128, each ten or more times S-SGD's time at 512. 1-bit LAMB sits at 0.25-0.45 s up
# to 128 workers; its point at 512 is the padding above, scaled (at 340M it would send
# about what it sends at 128). The model ignores overlap of communication with the
# backward pass and network contention: read it as a ranking and an order of magnitude,
# validated against two papers' measurements in
# `experiments/configs/costmodel_validation.py`.
