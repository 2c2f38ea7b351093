# %% [markdown]
# # 1-bit LAMB from the inside
#
# `shoal.optim.onebit_lamb` (Li et al. 2021, Algorithm 1) runs in two stages on a step
# counter $t = 1, 2, \dots$:
#
# * **warm-up**, $t \le T_w$: LAMB on the all-reduced gradient $g$, per layer $l$:
#   $m = \beta_1 m + (1-\beta_1) g$, $v = \beta_2 v + (1-\beta_2) g^2$,
#   $c_l = \mathrm{clip}(\lVert p_l\rVert / \lVert u_l\rVert)$ with $u = m/(\sqrt v + \epsilon)$;
#   the running average of $c_l$ is kept, and $v$ is frozen at $t = T_w$;
# * **compression**, $t > T_w$: each worker adds its *local* gradient to the momentum,
#   which crosses the wire as signs through an error-compensated 1-bit all-reduce; the
#   update is $-\mathrm{lr}\cdot \bar c_l\, f_l\, u_l$, with the frozen $v$ and a factor
#   $f_l$ from the fresh variance of the reconstructed gradients.
#
# Everything is in the optax state (`OneBitLambState`), so we can step the transformation
# by hand and read it: the stage, the bytes, the LAMB coefficients, the per-layer momentum
# scales, the factors, and the error feedback.

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

from shoal.comms import AxisCollective, OneBit
from shoal.experiments.config import Config
from shoal.experiments.tasks import GaussianMixtureTask
from shoal.optim import onebit_lamb, onebit_moments

N = 8  # simulated workers
STEPS = 300
FREEZE = round(0.15 * STEPS)  # T_w
B1 = 0.9  # onebit_lamb's default beta_1
coll = AxisCollective("workers", N)
per_worker = lambda a: jnp.broadcast_to(a, (N, *jnp.shape(a)))
print(f"{N} workers, {STEPS} steps, warm-up {FREEZE} steps")

# %% [markdown]
# ## The compressed all-reduce and its error feedback
#
# `OneBit().mean(x, (worker_error, server_error), collective=...)`: each worker adds
# its error to $x$, sends the signs of its chunks with one scale $s = \lVert v\rVert/\sqrt{n}$
# (all-to-all), keeps what the signs missed as its new error; the worker that owns a chunk
# averages it, adds its server error, compresses again and all-gathers. One call is a crude
# estimate of the mean (two values per chunk), but nothing is lost: what a call misses is
# fed into the next. Below, every worker sends the *same* vector on every call; the running
# mean of the outputs converges to the exact mean, while a call without error feedback
# (errors reset to zero) stays as wrong as the first.

# %%
n, calls = 1024, 100
xs = jax.random.normal(jax.random.key(0), (N, n)) * jnp.linspace(0.1, 2.0, n) + 0.2
exact = np.asarray(xs.mean(0))
codec = OneBit()
memory = tuple(per_worker(e) for e in codec.init(n, N))  # (worker_error, server_error)
reduce = jax.jit(jax.vmap(lambda x, m: codec.mean(x, m, collective=coll), axis_name="workers"))
outs = []
for _ in range(calls):
    y, memory = reduce(xs, memory)
    outs.append(np.asarray(y[0]))  # the same on every worker
running = np.cumsum(outs, 0) / np.arange(1, calls + 1)[:, None]
rel = np.linalg.norm(running - exact, axis=1) / np.linalg.norm(exact)

sent = codec.wire_bytes(n, N)[0]
dense = 2 * (N - 1) * 4 * n // N
print(f"bytes per worker and call: {sent} compressed vs {dense} dense ({dense / sent:.1f}x)")

fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4))
i = np.arange(n)
ax0.plot(i, exact, color="k", lw=1, label="exact mean")
ax0.plot(i, outs[0], color="C0", lw=1, alpha=0.7, label="one call")
ax0.plot(i, running[-1], color="C3", lw=1, label=f"mean of {calls} calls")
ax0.set(xlabel="element", ylabel="value", title="the 1-bit estimate of the mean")
ax0.legend(fontsize=8)
k = np.arange(1, calls + 1)
ax1.loglog(k, rel, "o-", ms=3, color="C3", label="running mean, error feedback")
ax1.loglog(k, np.full(calls, rel[0]), "--", color="C0", label="without error feedback")
ax1.loglog(k, rel[-1] * k[-1] / k, ":", color="gray", label="proportional to 1 / calls")
ax1.set(xlabel="calls", ylabel="relative error", title="what one call misses comes back")
ax1.legend(fontsize=8)
plt.show()

# %% [markdown]
# ## Stepping 1-bit LAMB by hand
#
# The MLP of notebook 01 on $N$ simulated workers. Besides the update, each step returns a
# probe: the loss, the bytes, the per-layer coefficient average $\bar c_l$ (`coeff_avg`),
# factor $f_l$ (`last_factor`) and momentum scale (`scale`), the norms of the error
# buffers, and two vectors: what this worker fed into the compressed all-reduce (its scaled
# local momentum) and what came out, with the exact mean of the inputs for comparison. A
# second run with `freeze_step > STEPS` is uncompressed LAMB, the baseline.

# %%
task = GaussianMixtureTask(Config(workers=N, steps=STEPS, batch_size=32))
params0 = task.init_params()
paths = jax.tree_util.tree_flatten_with_path(params0)[0]
layers = ["/".join(k.key for k in path) for path, _ in paths]  # "Dense_0/bias", ...
leaves = jax.tree.leaves
flat = lambda tree: jnp.concatenate([a.ravel() for a in leaves(tree)])


def run(tx):
    def one_step(params, state, x, y):  # one worker
        loss, grads = jax.value_and_grad(task.loss)(params, x, y)
        updates, new = tx.update(grads, state, params)
        scales = new.scale  # frozen at the first compressed step
        # The momentum whole: simulated workers hold one chunk of it each.
        mu, new_mu = (onebit_moments(s, params, collective=coll)["mu"] for s in (state, new))
        fed = [(B1 * m + (1 - B1) * g) * k for m, g, k in zip(*map(leaves, (mu, grads, scales)))]
        probe = {
            "loss": loss,
            "bytes": new.wire.step.sent,
            "coeff": jnp.stack(leaves(new.coeff_avg)),
            "factor": jnp.stack(leaves(new.last_factor)),
            "scale": jnp.stack(leaves(scales)),
            "worker_error": new.worker_error,
            "server_error": new.server_error,
            "out": flat(jax.tree.map(jnp.multiply, new_mu, scales)),
            "exact": coll.all_reduce(jnp.concatenate([a.ravel() for a in fed]), "mean"),
        }
        return optax.apply_updates(params, updates), new, probe

    step = jax.jit(jax.vmap(one_step, axis_name="workers"))
    params = jax.tree.map(per_worker, params0)
    state = jax.vmap(tx.init)(params)
    probes = []
    for t in range(STEPS):
        params, state, probe = step(params, state, *task.batch(t, N))
        probe = jax.device_get(probe)
        probe["loss"] = probe["loss"].mean()
        probe["worker_error"] = probe["worker_error"].mean(0)  # the mean over workers
        # Worker r holds the server error of chunk r: together, one padded vector.
        probe["server_error"] = probe["server_error"].reshape(-1)
        probes.append(
            {
                k: v if k in ("loss", "worker_error", "server_error") else v[0]
                for k, v in probe.items()
            }
        )
    hist = {k: np.stack([p[k] for p in probes]) for k in probes[0]}
    hist["test"] = task.evaluate(jax.tree.map(lambda a: a.mean(0), params))
    hist["total"] = int(state.wire.total.sent[0])  # worker 0's bytes since init
    assert hist["total"] == hist["bytes"].sum()
    return hist


h = run(onebit_lamb(0.02, collective=coll, freeze_step=FREEZE))
lamb = run(onebit_lamb(0.02, collective=coll, freeze_step=STEPS + 1))
for name, r in (("1-bit LAMB", h), ("LAMB", lamb)):
    mb = r["total"] / 1e6
    print(f"{name:>10}: test accuracy {r['test'][1]:.1%}, {mb:.2f} MB sent per worker")

# %% [markdown]
# ## Warm-up vs compression, scaling factors over time
#
# * **bytes per step** drop from a dense all-reduce to the compressed one after $T_w$;
# * **$\bar c_l$** (`coeff_avg`): the running average of each layer's LAMB trust ratio
#   during the warm-up, frozen afterwards; it sets each layer's step size in the
#   compression stage, in place of the trust ratio the compressed momentum cannot give;
# * **momentum scales** (`scale`): set once at the first compressed step from the warm-up
#   momentum, $r_l = \lVert m_l\rVert/\sqrt{n_l}$, $\mathrm{scale}_l = \mathrm{mean}_k(r_k)/r_l$,
#   so that one shared 1-bit scale per chunk does not drown the small layers;
# * **factor $f_l$** (`last_factor`): $\max(\sqrt{v}/\sqrt{v_\text{fresh}})$ from the
#   frozen and the fresh variance, clipped to [0.5, 4] and to $\pm 10\%$ of its previous
#   value per step, so it can only drift.

# %%
t = np.arange(1, STEPS + 1)
comp = t > FREEZE
fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
ax = axes[0, 0]
ax.semilogy(t, h["bytes"], color="C0", label="1-bit LAMB")
ax.semilogy(t, lamb["bytes"], color="gray", ls="--", label="LAMB")
ax.set(xlabel="step", ylabel="bytes sent per worker", title="bytes per step")
ax.legend(fontsize=8)
ax2 = ax.twinx()
ax2.plot(t, h["loss"], color="C3", lw=0.8, alpha=0.6)
ax2.plot(t, lamb["loss"], color="C3", lw=0.8, alpha=0.6, ls="--")
ax2.set_ylabel("training loss (red)", color="C3")

ax = axes[0, 1]
for i, name in enumerate(layers):
    ax.plot(t, h["coeff"][:, i], label=name)
ax.set(xlabel="step", ylabel="coeff_avg", title="running average of the LAMB coefficients")
ax.legend(fontsize=7)

ax = axes[1, 0]
ax.bar(range(len(layers)), h["scale"][-1], color=[f"C{i}" for i in range(len(layers))])
ax.set_xticks(range(len(layers)), layers, rotation=30, ha="right", fontsize=7)
ax.set(ylabel="scale", title=f"momentum scales, set at step {FREEZE + 1}")

ax = axes[1, 1]
for i, name in enumerate(layers):
    ax.plot(t[comp], h["factor"][comp, i], label=name)
for bound in (0.5, 4.0):
    ax.axhline(bound, color="gray", ls=":", lw=1)
ax.set(xlabel="step", ylabel="last_factor", title="factor f_l (compression stage)")
for ax in axes.flat:
    if ax is not axes[1, 0]:
        ax.axvline(FREEZE + 0.5, color="k", ls=":", lw=1)
    ax.grid(alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Error feedback in training
#
# After the warm-up the momentum that comes out of the all-reduce is not the mean of what
# went in. Summed over the compression steps, though, the two agree up to the errors still
# held: $\sum_t (y_t - \bar x_t) = -(\frac1N \sum_i e_i + e_\text{server})$, so the gap stays
# as small as the error buffers while both sums grow. Left: norms of the error buffers.
# Middle: the running sums (the identity holds to float rounding). Right: one layer's
# momentum at the last step, exact mean of the inputs against the 1-bit output, which takes
# only a few values: one magnitude per server chunk, divided by the layer's scale.

# %%
cum_out = np.cumsum(h["out"][comp], 0)
cum_exact = np.cumsum(h["exact"][comp], 0)
n_flat = cum_out.shape[1]
held = (h["worker_error"] + h["server_error"])[comp][:, :n_flat]  # errors on the payload
gap = np.linalg.norm(cum_out - cum_exact, axis=1)
assert np.allclose(cum_out - cum_exact, -held, atol=1e-3 * np.abs(cum_exact).max())

fig, axes = plt.subplots(1, 3, figsize=(15, 4))
ax = axes[0]
ax.plot(t, np.linalg.norm(h["worker_error"], axis=1), label="worker error (mean over workers)")
ax.plot(t, np.linalg.norm(h["server_error"], axis=1), label="server error")
ax.axvline(FREEZE + 0.5, color="k", ls=":", lw=1)
ax.set(xlabel="step", ylabel="L2 norm", title="error feedback buffers")
ax.legend(fontsize=8)
ax = axes[1]
ax.semilogy(t[comp], np.linalg.norm(cum_exact, axis=1), label="|sum of exact means|")
ax.semilogy(t[comp], gap, label="|sum of outputs - sum of exact means|")
ax.semilogy(t[comp], np.linalg.norm(held, axis=1), ":", color="k", label="|errors held|")
ax.set(xlabel="step", title="running sums over the compression stage")
ax.legend(fontsize=8)
ax = axes[2]
i = layers.index("Dense_1/kernel")
start = sum(int(np.prod(p.shape)) for p in leaves(params0)[:i])
size = int(np.prod(leaves(params0)[i].shape))
scale = h["scale"][-1, i]
got = h["out"][-1, start : start + size] / scale
want = h["exact"][-1, start : start + size] / scale
ax.scatter(want, got, s=3, alpha=0.5)
lim = np.abs(want).max()
ax.plot([-lim, lim], [-lim, lim], color="gray", lw=1)
ax.set(xlabel="exact mean momentum", ylabel="after the 1-bit all-reduce")
ax.set_title(f"{layers[i]}, last step: {np.unique(got).size} distinct values", fontsize=10)
for ax in axes:
    ax.grid(alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# **What to look at.** The bytes fall by about $32\times$ at the freeze (fp32 momentum to
# signs, plus one scale per chunk), while the loss curve of 1-bit LAMB tracks LAMB's. The
# coefficient averages stop moving at the freeze: from then on they are the layers' step
# sizes. The factors start at 1 and move at most 10% per step within [0.5, 4]. The error
# buffers jump from zero at the first compressed step and stay bounded, and the running sum
# of the compressed momenta never drifts from the exact one by more than the errors held.
# For a longer run on a transformer language model, `shoal-run
# experiments/configs/onebit_lamb_lm.py` (`docs/experiments/studies.md`: final losses
# within half a percent at 5.66x fewer bytes).
