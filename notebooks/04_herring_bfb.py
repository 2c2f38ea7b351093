# %% [markdown]
# # Herring's balanced fusion buffers on BERT-large
#
# Thangakrishnan et al. ("Herring: Rethinking the Parameter Server at Scale for the Cloud",
# SC 2020). A classic parameter server places each variable whole on one server (*atomic
# placement*): the server that holds BERT-large's 60 MiB word embedding receives it from
# every worker while a neighbour holding a bias receives almost nothing. Herring lays all
# gradients back to back, in the order the backward pass produces them, into fixed-size
# *balanced fusion buffers* (BFB), and cuts each buffer into one equal shard per server:
# every server receives the same bytes, whatever the variables.
#
# Everything here is computed from shapes: `jax.eval_shape` of a Flax BERT-large
# (`shoal.experiments.tasks.bert`, fp16) and the gradients' production order found in the jaxpr
# of its backward pass (`shoal.comms.gradient_order`). Nothing is allocated or trained,
# except in the last section, a small `bfb_allreduce` on simulated workers.

# %%
import math

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from shoal.comms import AxisCollective, atomic_placement, plan_fusion, wire_bytes
from shoal.experiments.configs import herring_table3 as table3
from shoal.experiments.tasks import bert
from shoal.optim import bfb_allreduce

SERVERS = 8  # for the layout pictures
N = 8  # simulated workers of the last section
MIB = 2**20

# %%
shapes = bert.param_shapes(bert.BERT_LARGE)  # ShapeDtypeStruct leaves
order = bert.production_order(bert.BERT_LARGE)  # leaf indices, first produced first
names = bert.leaf_names(shapes)
nbytes = np.array(
    [math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes)]
)
print(
    f"{len(names)} variables, {bert.num_parameters(shapes):,} parameters, "
    f"{nbytes.sum() / MIB:.1f} MiB of fp16 gradients"
)
print("produced first:", [names[i] for i in order[:3]])
print("produced last: ", [names[i] for i in order[-3:]])


def kind(name):
    if "embeddings" in name:
        return "embeddings"
    if name.startswith("layer_"):
        return "attention" if "attention" in name else "feed-forward"
    return "heads and pooler"


KINDS = {"heads and pooler": "C2", "feed-forward": "C0", "attention": "C1", "embeddings": "C3"}
legend = [Patch(color=c, label=k) for k, c in KINDS.items()]

fig, ax = plt.subplots(figsize=(12, 3))
ax.bar(
    range(len(order)),
    nbytes[list(order)] / MIB,
    width=1.0,
    color=[KINDS[kind(names[i])] for i in order],
)
ax.set(
    yscale="log",
    xlabel="gradient, in production order",
    ylabel="MiB",
    title="BERT-large's gradients as the backward pass produces them",
)
ax.legend(handles=legend, fontsize=8)
plt.show()

# %% [markdown]
# ## Which variables land in which buffer
#
# The paper's buffer is 86684 KB (the sum of its Table II). `plan_fusion` fills buffers in
# production order; a variable may straddle two buffers; buffer $b$ is cut into `SERVERS`
# equal shards (dashed lines) and shard $s$ of every buffer goes to server $s$. Below, one
# row per buffer, each variable a coloured segment at its offset (layers labelled where a
# buffer starts and ends). The embedding, produced last, fills most of the last two buffers,
# spread over every server.

# %%
plan = plan_fusion(shapes, buffer_bytes=table3.BUFFER_BYTES, num_shards=SERVERS, order=order)
item = plan.dtype.itemsize
print(
    f"{plan.num_buffers} buffers of {table3.PAPER_BUFFER_KB} KB (the last "
    f"{plan.buffer_sizes[-1] * item / 1024:.0f} KB), shards of "
    f"{plan.shard_bytes[0] / 1024:.0f} KB, {plan.padding} elements of padding"
)


def label(name):
    return name.split("/")[0].replace("layer_", "L") if name.startswith("layer_") else name


fig, ax = plt.subplots(figsize=(12, 0.55 * plan.num_buffers + 1))
for b, segments in enumerate(plan.segments):
    for s in segments:
        width = (s.stop - s.start) * item / MIB
        ax.barh(
            b,
            width,
            left=s.offset * item / MIB,
            height=0.8,
            edgecolor="white",
            linewidth=0.3,
            color=KINDS[kind(names[s.leaf])],
        )
    first, last = names[segments[0].leaf], names[segments[-1].leaf]
    ax.text(0, b, f" {label(first)}", va="center", fontsize=7, color="white")
    end = plan.buffer_sizes[b] * item / MIB
    ax.text(end, b, f"{label(last)} ", va="center", ha="right", fontsize=7, color="white")
for k in range(1, SERVERS):
    ax.axvline(k * plan.shard_bytes[0] / MIB, color="k", ls="--", lw=0.6)
ax.set(
    xlabel=f"MiB into the buffer (dashed: the {SERVERS} server shards)",
    ylabel="buffer",
    title="balanced fusion buffers of BERT-large (fp16)",
)
ax.invert_yaxis()
ax.legend(handles=legend, fontsize=8, loc="lower right")
plt.show()

# %% [markdown]
# ## Per-server load: atomic placement vs BFB
#
# `atomic_placement` puts variable `order[k]` whole on server $k \bmod S$. Per iteration each
# server receives its bytes from every worker (and sends as much back). With BFB every
# server receives one shard of every buffer from every worker: the same for all. Below at 8
# servers (stacked by kind), then at 64 servers with as many workers, the paper's scale.

# %%
atomic = atomic_placement(shapes, num_servers=SERVERS, order=order)
by_kind = {k: np.zeros(SERVERS) for k in KINDS}
for leaf, server in enumerate(atomic.server):
    by_kind[kind(names[leaf])][server] += nbytes[leaf] / MIB
bfb_load = sum(plan.shard_bytes) / MIB  # one shard of every buffer

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(14, 4), gridspec_kw={"width_ratios": [1, 2.2]})
bottom = np.zeros(SERVERS)
for k, color in KINDS.items():
    ax0.bar(range(SERVERS), by_kind[k], bottom=bottom, color=color, label=k)
    bottom += by_kind[k]
ax0.axhline(bfb_load, color="k", lw=2, label=f"BFB: {bfb_load:.0f} MiB on every server")
ax0.set(
    xlabel="server",
    ylabel="MiB per worker per iteration",
    title=f"{SERVERS} servers: what each holds",
)
ax0.legend(fontsize=7, loc="upper left")

rows = table3.per_server(shapes, order)  # 64 servers, 64 workers
emb = table3.embedding_leaf(shapes)
emb_server = atomic_placement(shapes, num_servers=table3.PLOT_SERVERS, order=order).server[emb]
a = np.array([r["atomic_bytes"] for r in rows]) / MIB
f = np.array([r["bfb_bytes"] + r["bfb_padding_bytes"] for r in rows]) / MIB
colors = ["C3" if s == emb_server else "C0" for s in range(len(rows))]
ax1.bar(range(len(rows)), a, color=colors, label="atomic placement (red: the embedding's)")
ax1.step(range(len(rows)), f, where="mid", color="C1", lw=2, label="BFB")
ax1.set(
    xlabel=f"server ({len(rows)} servers, {len(rows)} workers)",
    ylabel="MiB received per iteration",
    title="per-server load at the paper's scale",
)
ax1.legend(fontsize=8)
for ax in (ax0, ax1):
    ax.grid(alpha=0.3, axis="y")
plt.show()
print(
    f"64 servers, atomic: max {a.max():.0f} MiB (server {a.argmax()}), mean {a.mean():.0f}, "
    f"max/mean {a.max() / a.mean():.1f}; BFB: {f.min():.0f}-{f.max():.0f} MiB on every server"
)

# %% [markdown]
# ## Herring's Table III
#
# What the server holding the embedding gradient receives while a buffer containing it is
# reduced, for 8 to 64 worker nodes with as many servers. Atomic: the whole embedding from
# each of the $N$ workers, growing with $N$. BFB: a $1/N$ shard of one buffer from each of
# the $N$ workers, one buffer whatever $N$.

# %%
rows = table3.table3(shapes, order)
nodes = [r["nodes"] for r in rows]
print(" nodes | atomic MiB (paper) | BFB MiB (paper)")
for r in rows:
    n = r["nodes"]
    print(
        f"{n:>6} | {r['atomic_mb']:8.2f} ({table3.PAPER_ATOMIC_MB[n]:>4}) "
        f"| {r['bfb_mb']:6.2f} ({table3.PAPER_BFB_MB})"
    )
fig, ax = plt.subplots(figsize=(6, 3.6))
ax.plot(nodes, [r["atomic_mb"] for r in rows], "o-", label="atomic placement")
ax.plot(nodes, [r["bfb_mb"] for r in rows], "o-", label="BFB (86684 KB buffers)")
ax.plot(nodes, [table3.PAPER_ATOMIC_MB[n] for n in nodes], "kx", label="paper")
ax.plot(nodes, [table3.PAPER_BFB_MB] * len(nodes), "kx")
ax.set(
    xscale="log",
    yscale="log",
    xlabel="worker nodes (= servers)",
    ylabel="MiB received",
    title="the embedding's server (Table III)",
)
ax.set_xticks(nodes, [str(n) for n in nodes])
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# ## The same layout in a training step
#
# `bfb_allreduce` uses that layout to reduce gradients: colocated (the $N$ workers serve
# the shards themselves: all-to-all of each buffer's shards, a local sum, all-gather),
# with dedicated server ranks under MPI (`ParameterServers`), or hierarchically. On $N$
# simulated workers and a small model with 4 KiB buffers, the result is the mean gradient,
# and the bytes are those of a ring all-reduce of the padded buffers.

# %%
coll = AxisCollective("workers", N)
tiny = {
    "w1": jnp.zeros((32, 64)),
    "b1": jnp.zeros(64),
    "w2": jnp.zeros((64, 10)),
    "b2": jnp.zeros(10),
}
small_plan = plan_fusion(tiny, buffer_bytes=4096, num_shards=N)
print(
    f"{small_plan.num_buffers} buffers of {small_plan.buffer_sizes} elements, "
    f"leaves per buffer: {[small_plan.buffer_leaves(b) for b in range(small_plan.num_buffers)]}"
)

tx = bfb_allreduce(collective=coll, buffer_bytes=4096)
keys = jax.random.split(jax.random.key(0), len(tiny))
grads = {k: jax.random.normal(key, (N, *v.shape)) for key, (k, v) in zip(keys, tiny.items())}


def reduce(g):  # one worker
    updates, state = tx.update(g, tx.init(g))
    return updates, wire_bytes(state, "step").sent


updates, sent = jax.jit(jax.vmap(reduce, axis_name="workers"))(grads)
error = max(float(jnp.abs(updates[k] - grads[k].mean(0)).max()) for k in tiny)
padded = sum(small_plan.buffer_bytes)
print(
    f"max |BFB - mean| = {error:.1e}; bytes sent per worker {int(sent[0])} "
    f"= 2 (N-1)/N x {padded} padded buffer bytes: {2 * (N - 1) * padded // N}"
)

# %% [markdown]
# **What to look at.** The layout picture: buffers hold whole layers in reverse order, and
# the embedding is spread over every server's shard. The load plots: under atomic placement
# a few servers (the embedding's, and those that get the big kernels, since 16 variables
# per layer divide evenly into 8 or 64 servers) carry most of the traffic; with BFB every
# server carries the same. The iteration waits for the busiest server. `shoal-run
# experiments/configs/herring_table3.py` writes these tables and plots as files.
