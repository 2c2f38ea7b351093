# %% [markdown]
# # Two-tier BMUF_GTC: the group-size study
#
# Ladkat et al. ("Two Tiered Distributed Training Algorithm for Acoustic Modeling") split
# $N$ workers into $M = N/P$ groups of $P$:
#
# * **lower tier, every step**: GTC inside each group (threshold $\tau$, residuals), so the
#   $P$ members of a group keep one model;
# * **upper tier, every $B$ steps**: BMUF across the $M$ groups,
#   $\bar W = \frac1M\sum_m W_m$, $G = \bar W - W_g$, $\Delta \leftarrow \eta\Delta + \zeta G$,
#   $W_g \leftarrow W_g + \Delta + \eta\Delta$, with $\eta = 1 - \zeta/M$ (eq. 5, $C = 1$).
#
# $P = 1$ is plain BMUF; $P = N$ is GTC on everyone with a trivial BMUF step ($M = 1$,
# $\eta = 0$). Per worker and step the bytes are $(P-1)\cdot 4(c+1)$ (GTC's all-gather of
# $c$ words and a header among the group) plus, every $B$-th step, a ring all-reduce among
# the $M$ groups, $2(M-1)/M\cdot 4n$. This notebook trains the acoustic-model stand-in
# (`experiments/configs/acoustic.py`: an LSTM labelling frames of HMM sequences) for a few
# group sizes at a fixed number of workers, through `shoal.experiments.runner.train.train`.

# %%
import dataclasses

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from shoal.comms import AxisCollective, two_tier
from shoal.experiments.configs.acoustic import entries
from shoal.experiments.configs.acoustic import get_config as acoustic_config
from shoal.experiments.runner.backends import SimBackend
from shoal.experiments.runner.train import train
from shoal.experiments.tasks import make_task

WORKERS = 8
GROUP_SIZES = (1, 2, 4, 8)
BASELINES = ("S-SGD", "GTC", "BMUF")
print(f"{WORKERS} workers, group sizes {GROUP_SIZES}")

# %% [markdown]
# ## The two tiers are two collectives
#
# `two_tier(world, P)` returns `(intra, inter)`. In simulation they are two nested vmap
# axes: `"member"` (inner, size $P$) and `"group"` (outer, size $M$); worker $w$ is member
# $w \bmod P$ of group $\lfloor w/P \rfloor$. Under MPI they are `comm.Split`
# sub-communicators. Here 8 workers in groups of 4 show whom each one meets: its group
# (GTC), and the workers at the same position in the other groups (BMUF; every member
# takes part, with identical data, so no leader has to broadcast).

# %%
world = AxisCollective("workers", 8)
intra, inter = two_tier(world, 4)
print(intra, inter, sep="\n")


def who(rank):  # one worker
    return intra.all_gather(rank), inter.all_gather(rank)


ranks = jnp.arange(8).reshape(2, 4)  # [group, member]
members, peers = jax.vmap(jax.vmap(who, axis_name="member"), axis_name="group")(ranks)
for w in range(8):
    g, m = divmod(w, 4)
    gtc_with, bmuf_with = members[g, m].tolist(), peers[g, m].tolist()
    print(f"worker {w}: group {g} member {m}; GTC with {gtc_with}, BMUF with {bmuf_with}")

# %% [markdown]
# ## The study
#
# The acoustic config's settings (64 HMM states, 40-dim features, one LSTM layer of 64,
# local SGD with momentum 0.9 reset after each BMUF step, GTC $\tau = 0.05$ with buffers of
# 2.5% of the parameters, block size 10). Learning rates follow its linear scaling rule:
# 0.02 per worker whose gradient an update averages ($\times N$ for S-SGD and GTC,
# $\times P$ for BMUF_GTC, $\times 1$ for BMUF). To keep the notebook to about a minute,
# it trains a quarter of an epoch at 8 workers (160 steps of 2 sequences per worker): the
# errors are those of early training, well above the 2-epoch study's.

# %%
cfg = acoustic_config()
steps = cfg.train_size // (4 * WORKERS * cfg.batch_size)  # a quarter of an epoch
baselines = entries(WORKERS)  # learning rates by the linear scaling rule
two_tier_entry = lambda p: entries(WORKERS, group_size=p)["BMUF_GTC"]
cfg = dataclasses.replace(cfg, workers=WORKERS, steps=steps, eval_every=steps // 4)
task = make_task(cfg)
backend = SimBackend(WORKERS)
n_params = sum(p.size for p in jax.tree.leaves(task.init_params()))
print(f"{steps} steps, {n_params} parameters")

runs = {}
for method in BASELINES:
    runs[method] = train(cfg, task, backend, baselines[method], progress=False)
for p in GROUP_SIZES:
    runs[p] = train(cfg, task, backend, two_tier_entry(p), progress=False)
for label, r in runs.items():
    s = r.summary
    name = label if isinstance(label, str) else f"BMUF_GTC P={label}"
    err, mb = s["test_error"], s["mb_sent"]
    print(f"{name:>15}: test error {err:.1%}, {mb:6.2f} MB sent per worker, {s['wall_s']:.0f} s")

# %% [markdown]
# Two checks: group size 1 is BMUF, bit for bit (a group of one has nothing to exchange);
# and the bytes are exactly the formula above, plus the non-finite flag of
# `shoal.optim.skip_nonfinite` (one int32 all-reduced in the group, then across groups,
# every step).

# %%
bmuf_losses = [rec["loss"] for rec in runs["BMUF"].records]
assert bmuf_losses == [rec["loss"] for rec in runs[1].records]

two_tier_params = cfg.params["bmuf_gtc"]  # GTC's capacity, BMUF's block size
capacity_words = max(1, round(two_tier_params.capacity * n_params))


def predicted_bytes(p):
    m = WORKERS // p
    lower = (p - 1) * 4 * (capacity_words + 1)  # every step
    # and every step the non-finite flag (one int32), summed in the group, then across
    lower += 2 * (p - 1) * 4 // p + 2 * (m - 1) * 4 // m
    upper = 2 * (m - 1) * 4 * n_params // m  # every block_size-th step
    return steps * lower, steps // two_tier_params.block_size * upper


for p in GROUP_SIZES:
    lower, upper = predicted_bytes(p)
    measured = round(runs[p].summary["mb_sent"] * 1e6)
    assert measured == lower + upper, (p, measured, lower + upper)
    print(
        f"P={p:>2}: GTC {lower / 1e6:6.2f} MB + BMUF {upper / 1e6:5.2f} MB = {measured / 1e6:.2f}"
    )

# %%
P = np.array(GROUP_SIZES)
err = np.array([runs[p].summary["test_error"] for p in GROUP_SIZES])
fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(15, 4.2))
ax0.plot(range(len(P)), 100 * err, "o-", color="C3", label="BMUF_GTC")
for i, method in enumerate(BASELINES):
    e = 100 * runs[method].summary["test_error"]
    ax0.axhline(e, color=f"C{i}", ls="--", lw=1, label=f"{method} ({e:.1f}%)")
ax0.set(xlabel="group size P", ylabel="test error (%)")
ax0.set_xticks(range(len(P)), [f"{p}\n(M={WORKERS // p})" for p in P])
ax0.legend(fontsize=8)
ax0.set_title(f"{WORKERS} workers, block size {two_tier_params.block_size}", fontsize=10)

parts = np.array([predicted_bytes(p) for p in GROUP_SIZES]) / 1e6
ax1.bar(range(len(P)), parts[:, 0], label="GTC inside groups (every step)")
ax1.bar(range(len(P)), parts[:, 1], bottom=parts[:, 0], label="BMUF across groups")
ax1.set_xticks(range(len(P)), [str(p) for p in P])
ax1.set(xlabel="group size P", ylabel="MB sent per worker")
ax1.legend(fontsize=8)

for i, p in enumerate(GROUP_SIZES):
    recs = runs[p].records
    evals = [(r["step"], 100 * (1 - r["test_accuracy"])) for r in recs if "test_accuracy" in r]
    ax2.plot(*zip(*evals), "o-", color=plt.cm.viridis(i / len(P)), label=f"P={p}")
ax2.set(xlabel="step", ylabel="test error (%)")
ax2.legend(fontsize=8)
for ax in (ax0, ax1, ax2):
    ax.grid(alpha=0.3)
plt.show()

# %% [markdown]
# **What to look at.** Left: frame error against the group size, with the baselines as
# references (BMUF is the $P = 1$ point). After this quarter epoch (seed 0) groups of 2
# and 4 beat plain BMUF (about 63% and 60% against 66%) and $P = 8$, one group whose
# BMUF step only resets the local momentum, is back near BMUF; S-SGD (43%) and GTC (48%),
# which average every step, are far ahead this early. Ladkat et al. report that larger
# groups reduce the error of plain BMUF; the acoustic study of
# `docs/experiments/studies.md` (32 workers, block size 10, 2 epochs) found that groups of
# 4 and 8 beat BMUF while groups of 2 did not.
# Middle: the price. The GTC part grows with the $P - 1$ peers of a group, the BMUF part
# shrinks with $M$. At 8 workers, a 2.5% capacity and blocks of 10 they trade exactly: per
# block a worker sends about $(P-1)\,n$ bytes of GTC words ($10 \cdot 4 \cdot 0.025\,n$ per
# peer) and $8(M-1)/M \cdot n$ bytes of BMUF's all-reduce, $7n$ for every $P$ (3.48 MB
# here, as much as GTC alone): the group size changes the error at the same cost. Right:
# error at the evaluation steps. The full tables over workers, block sizes and group sizes
# come from `shoal-run experiments/configs/acoustic_study.py` (about 4 minutes).
