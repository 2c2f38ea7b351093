# %% [markdown]
# # KungFu: flexible synchronisation and an adaptive policy
#
# Brabete's KungFu (MEng thesis, 2019) offers strategies beyond S-SGD, all here as optax
# transformations:
#
# * **partial gradient exchange** (`partial_exchange`, "partial_exchange"): the gradient leaves are
#   packed into bins of at most a fraction $f$ of the gradient bytes; step $t$ averages
#   bin $t \bmod P$ and keeps the rest local;
# * **peer model averaging** (`peer_averaging`): each step worker $r$ averages its model
#   with one peer's, $v_r \leftarrow (v_r + v_{\mathrm{src}(r)})/2 + u_r$, the peers a
#   permutation (round robin or random derangements);
# * **synchronous model averaging** (`sma`): $v_r \leftarrow (1-\alpha) v_r + \alpha\,
#   \mathrm{mean}(v) + u_r$;
# * the **adaptive** policy closes the loop: S-SGD that also estimates the gradient noise
#   scale (McCandlish et al.), switching to partial exchange once the noise scale passes a
#   threshold.

# %%
import dataclasses

import jax
import matplotlib.pyplot as plt
import numpy as np

from shoal.experiments.algorithms.adaptive import noise_scale_switch
from shoal.experiments.overrides import load_config
from shoal.experiments.runner.backends import SimBackend
from shoal.experiments.runner.train import train
from shoal.experiments.tasks import make_task
from shoal.optim.helpers import partial_exchange_bins, peer_permutation

WORKERS = 8
STEPS = 150
cfg = load_config("kungfu")  # a CNN on generated 16x16 glyph images
# The adaptive algorithm's own hyper-parameters: its policy may act from step STEPS // 3.
adaptive = dataclasses.replace(cfg.params["adaptive"], after=STEPS // 3)
cfg = dataclasses.replace(
    cfg,
    workers=WORKERS,
    steps=STEPS,
    eval_every=STEPS // 6,
    params={**cfg.params, "adaptive": adaptive},
)
task = make_task(cfg)
params = task.init_params()
print(
    f"{WORKERS} workers, {STEPS} steps, {sum(p.size for p in jax.tree.leaves(params))} parameters"
)

# %% [markdown]
# ## PGX bins
#
# `partial_exchange_bins(params, f)` shows the bins `partial_exchange(f, ...)` will use: first-fit
# decreasing by bytes, capacity $\lfloor f B\rfloor$. The CNN's hidden layer is stored as
# 16 column blocks so that no leaf exceeds 10% of the gradient (a bin must hold the largest
# leaf). One bar per bin, stacked by leaf; the dashed line is the capacity.

# %%
flat = jax.tree_util.tree_flatten_with_path(params)[0]
size = {jax.tree_util.keystr(p): x.size * x.dtype.itemsize for p, x in flat}
total = sum(size.values())


def color(path):
    return "C1" if "Conv" in path else "C0" if "BlockDense" in path else "C2"


fractions = (1.0, 0.3, 0.1)
fig, axes = plt.subplots(1, 3, figsize=(15, 3.6), gridspec_kw={"width_ratios": [1, 2, 4]})
for ax, f in zip(axes, fractions):
    bins = partial_exchange_bins(params, f)
    for b, paths in enumerate(bins):
        bottom = 0
        for path in sorted(paths, key=lambda p: -size[p]):
            ax.bar(b, size[path] / 1e3, bottom=bottom / 1e3, color=color(path), edgecolor="w")
            bottom += size[path]
    ax.axhline(int(f * total) / 1e3, color="k", ls="--", lw=1)
    ax.set_xticks(range(len(bins)))
    ax.set(
        xlabel="bin b (averaged at the steps t with t mod P = b)",
        ylabel="kB",
        title=f"fraction {f}: P = {len(bins)}",
    )
axes[-1].legend(
    handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in ("C1", "C0", "C2")],
    labels=["conv", "hidden blocks", "output"],
    fontsize=8,
)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Peer permutations
#
# `peer_permutation(strategy, N, step)[r]` is the worker that worker $r$ sends its model to
# at `step` (the same table `peer_averaging` uses, on every worker, with no negotiation).
# Round robin cycles through the $N - 1$ shifts; random draws a derangement (no worker
# sends to itself) from a seeded pool. Rows: steps; columns: workers; numbers: the peer.

# %%
show = 2 * (WORKERS - 1)
fig, axes = plt.subplots(1, 2, figsize=(12, 0.35 * show + 1.5))
for ax, strategy in zip(axes, ("round_robin", "random")):
    table = np.array([peer_permutation(strategy, WORKERS, s, seed=cfg.seed) for s in range(show)])
    assert (table != np.arange(WORKERS)).all()  # nobody sends to itself
    ax.imshow(table, cmap="tab10", vmin=0, vmax=9, aspect="auto")
    for (s, r), peer in np.ndenumerate(table):
        ax.text(r, s, str(peer), ha="center", va="center", fontsize=8, color="w")
    ax.set(xlabel="worker r", ylabel="step", title=f"{strategy}: r sends its model to")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## A short comparison run, and where the policy switched
#
# All algorithms train the same CNN from the same start on the same batches with the same
# local SGD (`shoal.experiments.runner.train.train`). S-SGD runs as `ssgd_noise`, which also logs
# the noise scale $B_\text{simple} = \mathrm{tr}(\Sigma)/|G|^2$ (one scalar more on the
# wire). The adaptive run asks its policy every `every` steps from `after` on (its own
# hyper-parameters, `cfg.params["adaptive"]`) whether the median noise scale of the last
# steps passed its `threshold`; the step where it switched is logged in the records
# (`"policy"`). The config's threshold (150) comes from an S-SGD run of its 300 steps;
# this run is half as long, so we take the median estimate of the S-SGD run after `after`
# as the threshold. Until it switches, the adaptive run is that S-SGD run, bit for bit.

# %%
backend = SimBackend(WORKERS)
runs = {"ssgd_noise": train(cfg, task, backend, "ssgd_noise", progress=False)}
late = [r["noise_scale"] for r in runs["ssgd_noise"].records[adaptive.after :]]
adaptive = dataclasses.replace(adaptive, threshold=float(np.median(late)))
cfg = dataclasses.replace(cfg, params={**cfg.params, "adaptive": adaptive})
# When would the policy switch, judged on the S-SGD records?
asks = range(adaptive.every, STEPS, adaptive.every)
records = runs["ssgd_noise"].records
predicted = next(
    (s for s in asks if s >= adaptive.after and noise_scale_switch(records[:s], adaptive)), None
)
print(f"noise threshold {adaptive.threshold:.0f}; switch predicted at step {predicted}")

algorithms = [
    "partial_exchange[fraction=0.3]",
    "partial_exchange[fraction=0.1]",
    "peer_averaging[strategy=round_robin]",
    "peer_averaging[strategy=random]",
    "sma",
    "adaptive",
]
for entry in algorithms:
    runs[entry] = train(cfg, task, backend, entry, progress=False)
switched = [r["step"] for r in runs["adaptive"].records if "policy" in r]
print("adaptive switched at step(s)", switched)
assert switched[:1] == ([predicted] if predicted else [])
for entry, r in runs.items():
    s = r.summary
    print(
        f"{entry:>32}: test accuracy {s['test_accuracy']:.1%}, "
        f"{s['mb_sent']:6.2f} MB sent per worker"
    )

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 8))
ax = axes[0, 0]
for i, (entry, r) in enumerate(runs.items()):
    ax.scatter(r.summary["mb_sent"], 100 * r.summary["test_accuracy"], color=f"C{i}")
    ax.annotate(
        entry,
        (r.summary["mb_sent"], 100 * r.summary["test_accuracy"]),
        fontsize=7,
        xytext=(4, 2),
        textcoords="offset points",
    )
ax.set(xlabel="MB sent per worker", ylabel="test accuracy (%)", title="accuracy vs bytes")

ax = axes[0, 1]
for i, (entry, r) in enumerate(runs.items()):
    ev = [(x["step"], 100 * x["test_accuracy"]) for x in r.records if "test_accuracy" in x]
    ax.plot(*zip(*ev), "o-", ms=3, color=f"C{i}", label=entry)
ax.set(xlabel="step", ylabel="test accuracy (%)", title="accuracy vs step")
ax.legend(fontsize=7)

steps = np.arange(1, STEPS + 1)
ax = axes[1, 0]
for entry, style in (("ssgd_noise", "-"), ("adaptive", "--")):
    ns = [x.get("noise_scale", np.nan) for x in runs[entry].records]
    ax.plot(steps, ns, style, lw=1, label=entry)
ax.axhline(adaptive.threshold, color="k", ls=":", lw=1, label="threshold")
ax.axvspan(0, adaptive.after, color="gray", alpha=0.15, label="policy not asked")
for s in switched:
    ax.axvline(s, color="C3", lw=1.5, label=f"switch at step {s}")
ax.set(
    xlabel="step",
    ylabel="noise scale B_simple",
    yscale="log",
    title="gradient noise scale and the switch",
)
ax.legend(fontsize=7)

ax = axes[1, 1]
for entry in ("ssgd_noise", "adaptive", "partial_exchange[fraction=0.3]"):
    ax.plot(steps, [x["bytes_sent"] / 1e3 for x in runs[entry].records], lw=1, label=entry)
ax.set(xlabel="step", ylabel="kB sent per worker", title="bytes per step")
ax.legend(fontsize=7)
for ax in axes.flat:
    ax.grid(alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# **What to look at.** Accuracy against bytes: peer averaging sends one model per step to
# one peer (a ppermute, no all-reduce) and stays close to S-SGD; partial exchange trades
# accuracy for bytes steeply on a short run; the adaptive run sits between S-SGD and its
# partial fraction. The noise-scale panel shows the estimate the policy reads, the
# threshold, and the step where it switched (bytes per step drop there, bottom right; the
# estimate stops, since partial exchange does not compute it). The full comparison (ten
# algorithms, staleness, the table in `docs/experiments/studies.md`) is `shoal-run
# experiments/configs/kungfu.py`.
