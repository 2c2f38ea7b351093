# %% [markdown]
# # A tour of shoal: optax chains on simulated workers
#
# shoal's algorithms are Optax gradient transformations. A transformation that communicates
# gets a `Collective` at construction and talks to its peers only through it. Here the
# collective is an `AxisCollective`: `N` workers simulated in this process by
# `jax.vmap(..., axis_name="workers")`, with bit-identical collectives. Under MPI the same
# step function runs on one rank per worker with an `MPICollective` instead (end of this
# notebook).
#
# We compose four algorithms into optax chains by hand, train the same small model with
# each, and compare training loss against the bytes each worker put on the wire
# (`shoal.comms.wire_bytes`).

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

from shoal.comms import AxisCollective, OneBit, wire_bytes
from shoal.experiments.config import Config
from shoal.experiments.tasks import GaussianMixtureTask
from shoal.optim import allreduce_gradients, bmuf, gtc, onebit_lamb

N = 8  # simulated workers
STEPS = 200  # a multiple of BMUF's block size (10)
FREEZE = round(0.15 * STEPS)  # 1-bit LAMB's warm-up steps
print(f"{N} workers, {STEPS} steps; jax {jax.__version__} on {jax.devices()[0].platform}")

# %% [markdown]
# ## The task
#
# A 10-class Gaussian mixture in 32 dimensions and an MLP (32-64-64-10), from
# `shoal.experiments`. We use four things from it: `init_params()`, `loss(params, x, y)`,
# `batch(step, workers)` (a batch per worker, leading axis over the workers) and
# `evaluate(params)`.

# %%
cfg = Config(workers=N, steps=STEPS, batch_size=32)
task = GaussianMixtureTask(cfg)
params0 = task.init_params()
n_params = sum(p.size for p in jax.tree.leaves(params0))
print(jax.tree.map(jnp.shape, params0))
print(f"{n_params} parameters: {4 * n_params} bytes of float32 gradient per worker and step")
x, y = task.batch(0, N)
print("batch of step 0:", x.shape, y.shape, "(workers, examples per worker, ...)")

# %% [markdown]
# ## One worker's step, N workers
#
# `step` is what one worker runs: its own gradient, the transformation's update (which
# communicates through the collective), and the bytes that update sent. `jax.vmap` over the
# axis `"workers"` runs `N` of them; each worker's parameters, optimizer state and batch are
# rows of arrays with a leading worker axis. `coll.broadcast(params, root=0)` starts every
# worker from worker 0's model (BMUF needs that). The bytes of a step are static (shapes are
# static): `wire_bytes(state, "step")` has the most recent update's, and
# `wire_bytes(state, "total")` each worker's total since `init`, exact to 64 bits.

# %%
coll = AxisCollective("workers", N)


def train_by_hand(tx, steps=STEPS):
    # Per-step mean loss and bytes sent per worker; test metrics of the workers' mean model.

    def start(params):  # every worker starts from worker 0's model
        params = coll.broadcast(params, root=0)
        return params, tx.init(params)

    def one_step(params, state, x, y):  # what ONE worker runs
        loss, grads = jax.value_and_grad(task.loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, wire_bytes(state, "step").sent

    stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), params0)
    params, state = jax.jit(jax.vmap(start, axis_name="workers"))(stacked)
    step = jax.jit(jax.vmap(one_step, axis_name="workers"))
    losses, sent = [], []
    for t in range(steps):
        params, state, loss, nbytes = step(params, state, *task.batch(t, N))
        losses.append(float(loss.mean()))
        sent.append(int(nbytes[0]))  # every worker sends the same here
    total = int(wire_bytes(state, "total").sent[0])  # worker 0's bytes since init
    assert total == sum(sent)
    mean_model = jax.tree.map(lambda a: a.mean(0), params)
    return {
        "loss": np.array(losses),
        "bytes": np.array(sent),
        "total": total,
        "test": task.evaluate(mean_model),
    }


# %% [markdown]
# ## Four algorithms as optax chains
#
# With $g_i$ worker $i$'s gradient:
#
# * **S-SGD**: $g \leftarrow \frac1N \sum_i g_i$ (ring all-reduce), then SGD with momentum.
# * **GTC** (Strom 2015): $a = g_i + r_i$; send $q_i = \pm\tau$ where $|a| > \tau$, keep
#   $r_i \leftarrow a - q_i$; the update is $\frac1N \sum_j q_j$. A fixed `capacity` (8% of
#   the elements) sizes the exchange: one int32 word (sign + index) per sent element.
# * **BMUF** (Chen & Huo 2016) around local SGD: `block_size` local steps, then
#   $\bar W = \frac1N\sum_i W_i$, $G = \bar W - W_g$, $\Delta \leftarrow \eta\Delta + \zeta G$,
#   $W_g \leftarrow W_g + \Delta + \eta\Delta$ (Nesterov); one all-reduce per block.
# * **1-bit LAMB** (Li et al. 2021): LAMB on the all-reduced gradient for `FREEZE` steps, then
#   the momentum crosses the wire as signs with error feedback (notebook 03).
#
# Any optax transformation composes with them; the last chain clips each worker's gradient
# before GTC and uses Adam after it.


# %%
def local_sgd():
    return optax.sgd(0.05, momentum=0.9)


chains = {
    "ssgd": optax.chain(allreduce_gradients(collective=coll), local_sgd()),
    "gtc": optax.chain(gtc(0.1, collective=coll, capacity=0.08), local_sgd()),
    "bmuf": bmuf(local_sgd(), collective=coll, block_size=10, reset_inner_state=True),
    "onebit_lamb": onebit_lamb(0.02, collective=coll, freeze_step=FREEZE),
    "clip+gtc+adam": optax.chain(
        optax.clip_by_global_norm(1.0),
        gtc(0.1, collective=coll, capacity=0.08),
        optax.adam(1e-2),
    ),
}
runs = {}
for name, tx in chains.items():
    runs[name] = r = train_by_hand(tx)
    test_loss, test_acc = r["test"]
    mb = r["total"] / 1e6
    print(f"{name:>14}: test accuracy {test_acc:.1%}, {mb:6.2f} MB sent per worker")

# %% [markdown]
# ## Where the bytes come from
#
# The counts follow `shoal.comms.wire`'s rules for $n$ float32 parameters on $N$ workers:
# a ring all-reduce sends $2(N-1)/N \cdot 4n$ bytes, GTC's all-gather $(N-1)$ buffers of
# $4(c + 1)$ bytes (a header and $c$ = 8% of $n$ words), BMUF one all-reduce every 10th
# step, 1-bit LAMB a dense all-reduce during the warm-up and about 1 bit per element after.
# A chain wrapped in `shoal.optim.skip_nonfinite(chain, collective=coll)` also all-reduces
# one int32 every step, the count of workers whose gradient was not finite (such a step is
# skipped on every worker); the chains here are not wrapped, so BMUF's local steps send
# nothing at all.

# %%
dense = 2 * (N - 1) * 4 * n_params // N
expected = {
    "ssgd": {dense},
    "gtc": {(N - 1) * 4 * (round(0.08 * n_params) + 1)},
    "bmuf": {0, dense},
    "onebit_lamb": {dense, OneBit().wire_bytes(n_params, N)[0]},
}
for name, want in expected.items():
    seen = set(runs[name]["bytes"].tolist())
    assert seen == want, (name, seen, want)
    print(f"{name:>12}: bytes per step {sorted(seen)}")

# %%
k = 10  # steps per point of the running mean
smooth = lambda v: np.convolve(v, np.ones(k) / k, mode="valid")
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4.2))
for name, r in runs.items():
    mb = np.cumsum(r["bytes"]) / 1e6
    ax0.plot(mb[k - 1 :], smooth(r["loss"]), label=name)
    ax1.plot(np.arange(k, STEPS + 1), smooth(r["loss"]), label=name)
ax0.set(xscale="log", xlabel="MB sent per worker (cumulative)", ylabel="training loss")
ax1.set(xlabel="step", ylabel="training loss")
ax1.axvline(FREEZE, color="gray", ls=":", lw=1)
ax1.text(FREEZE, ax1.get_ylim()[1], " 1-bit LAMB freezes", va="top", fontsize=8)
for ax in (ax0, ax1):
    ax.grid(alpha=0.3)
ax0.legend()
ax0.set_title(f"{N} simulated workers: loss against bytes ({k}-step mean)", fontsize=10)
plt.show()

# %% [markdown]
# **What to look at.** Left: at equal loss the curves sit an order of magnitude apart in
# bytes. S-SGD pays the full gradient every step; GTC pays its fixed capacity; BMUF pays
# one all-reduce per block of 10 steps; 1-bit LAMB pays S-SGD's price during the warm-up,
# then about 1/32 of it (its curve turns almost vertical at the freeze). Right: the cost in
# loss per step. The evaluated model is the workers' mean; `STEPS` is a multiple of the
# block size, so for BMUF it is the global model of the last BMUF step.
#
# ## The same code under MPI
#
# Drop the `vmap` and replace the collective: each process is one worker.
#
# ```python
# from shoal.comms import MPICollective
#
# coll = MPICollective()  # a clone of MPI.COMM_WORLD
# rank = coll.comm.Get_rank()
# tx = optax.chain(gtc(0.1, collective=coll, capacity=0.08), optax.sgd(0.05, momentum=0.9))
# params = jax.jit(lambda p: coll.broadcast(p, root=0))(params0)
# state = tx.init(params)
# step = jax.jit(one_step)  # one_step as in train_by_hand: no vmap
# x, y = task.batch(t, coll.size)  # every worker's batch; this rank trains on row rank
# params, state, loss, nbytes = step(params, state, x[rank], y[rank])
# ```
#
# ```sh
# .venv/bin/mpiexec -n 8 .venv/bin/python my_script.py
# ```
#
# The runner (`shoal-run experiments/configs/quickstart.py`) does all of this for every
# algorithm in a config, on either backend; notebooks 02 and 05 use it through
# `shoal.experiments.runner.train.train`.
