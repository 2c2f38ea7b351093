"""Write the notebooks in this folder from the cells below, with empty outputs.

The notebooks are generated so that they can be reviewed as code: edit the cells here,
then run ``.venv/bin/python notebooks/build.py``. CI executes them (``pytest --nbmake
notebooks/``) with ``SHOAL_NOTEBOOK_SMALL=1``, which every notebook reads in its first
code cell to shrink workers and steps.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent

KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def md(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip("\n"))


def code(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_code_cell(textwrap.dedent(text).strip("\n"))


# --------------------------------------------------------------------------- 01 tour

TOUR = [
    md(r"""
# A tour of shoal: optax chains on simulated workers

shoal's algorithms are Optax gradient transformations. A transformation that communicates
gets a `Collective` at construction and talks to its peers only through it. Here the
collective is an `AxisCollective`: `N` workers simulated in this process by
`jax.vmap(..., axis_name="workers")`, with bit-identical collectives. Under MPI the same
step function runs on one rank per worker with an `MPICollective` instead (end of this
notebook).

We compose four algorithms into optax chains by hand, train the same small model with
each, and compare training loss against the bytes each worker put on the wire
(`shoal.comms.wire_bytes`).
"""),
    code("""
import os

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

from shoal.comms import AxisCollective, compressed_allreduce_bytes, wire_bytes
from shoal.experiments.config import Config
from shoal.experiments.tasks import GaussianMixtureTask
from shoal.optim import allreduce_gradients, bmuf, gtc, onebit_lamb

SMALL = os.environ.get("SHOAL_NOTEBOOK_SMALL") == "1"  # CI: fewer workers and steps
N = 4 if SMALL else 8  # simulated workers
STEPS = 60 if SMALL else 200  # a multiple of BMUF's block size (10)
FREEZE = round(0.15 * STEPS)  # 1-bit LAMB's warm-up steps
print(f"{N} workers, {STEPS} steps; jax {jax.__version__} on {jax.devices()[0].platform}")
"""),
    md(r"""
## The task

A 10-class Gaussian mixture in 32 dimensions and an MLP (32-64-64-10), from
`shoal.experiments`. We use four things from it: `init_params()`, `loss(params, x, y)`,
`batch(step, workers)` (a batch per worker, leading axis over the workers) and
`evaluate(params)`.
"""),
    code("""
cfg = Config(workers=N, steps=STEPS, batch_size=32)
task = GaussianMixtureTask(cfg)
params0 = task.init_params()
n_params = sum(p.size for p in jax.tree.leaves(params0))
print(jax.tree.map(jnp.shape, params0))
print(f"{n_params} parameters: {4 * n_params} bytes of float32 gradient per worker and step")
x, y = task.batch(0, N)
print("batch of step 0:", x.shape, y.shape, "(workers, examples per worker, ...)")
"""),
    md(r"""
## One worker's step, N workers

`step` is what one worker runs: its own gradient, the transformation's update (which
communicates through the collective), and the bytes that update sent. `jax.vmap` over the
axis `"workers"` runs `N` of them; each worker's parameters, optimizer state and batch are
rows of arrays with a leading worker axis. `coll.broadcast(params, root=0)` starts every
worker from worker 0's model (BMUF needs that). The bytes of a step are static (shapes are
static): `wire_bytes(state, "step")` has the most recent update's, and
`wire_bytes(state, "total")` each worker's total since `init`, exact to 64 bits.
"""),
    code("""
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
"""),
    md(r"""
## Four algorithms as optax chains

With $g_i$ worker $i$'s gradient:

* **S-SGD**: $g \leftarrow \frac1N \sum_i g_i$ (ring all-reduce), then SGD with momentum.
* **GTC** (Strom 2015): $a = g_i + r_i$; send $q_i = \pm\tau$ where $|a| > \tau$, keep
  $r_i \leftarrow a - q_i$; the update is $\frac1N \sum_j q_j$. A fixed `capacity` (8% of
  the elements) sizes the exchange: one int32 word (sign + index) per sent element.
* **BMUF** (Chen & Huo 2016) around local SGD: `block_size` local steps, then
  $\bar W = \frac1N\sum_i W_i$, $G = \bar W - W_g$, $\Delta \leftarrow \eta\Delta + \zeta G$,
  $W_g \leftarrow W_g + \Delta + \eta\Delta$ (Nesterov); one all-reduce per block.
* **1-bit LAMB** (Li et al. 2021): LAMB on the all-reduced gradient for `FREEZE` steps, then
  the momentum crosses the wire as signs with error feedback (notebook 03).

Any optax transformation composes with them; the last chain clips each worker's gradient
before GTC and uses Adam after it.
"""),
    code("""
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
"""),
    md(r"""
## Where the bytes come from

The counts follow `shoal.comms.wire`'s rules for $n$ float32 parameters on $N$ workers:
a ring all-reduce sends $2(N-1)/N \cdot 4n$ bytes, GTC's all-gather $(N-1)$ buffers of
$4(c + 1)$ bytes (a header and $c$ = 8% of $n$ words), BMUF one all-reduce every 10th
step, 1-bit LAMB a dense all-reduce during the warm-up and about 1 bit per element after.
Every step also all-reduces one int32, the count of workers whose gradient was not finite
(`shoal.optim.nonfinite`: such a step is skipped on every worker); GTC carries that flag
in its header instead.
"""),
    code("""
dense = 2 * (N - 1) * 4 * n_params // N
flag = 2 * (N - 1) * 4 // N
expected = {
    "ssgd": {dense + flag},
    "gtc": {(N - 1) * 4 * (round(0.08 * n_params) + 1)},
    "bmuf": {flag, dense + flag},
    "onebit_lamb": {dense + flag, compressed_allreduce_bytes(n_params, N)[0] + flag},
}
for name, want in expected.items():
    seen = set(runs[name]["bytes"].tolist())
    assert seen == want, (name, seen, want)
    print(f"{name:>12}: bytes per step {sorted(seen)}")
"""),
    code("""
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
"""),
    md(r"""
**What to look at.** Left: at equal loss the curves sit an order of magnitude apart in
bytes. S-SGD pays the full gradient every step; GTC pays its fixed capacity; BMUF pays
one all-reduce per block of 10 steps; 1-bit LAMB pays S-SGD's price during the warm-up,
then about 1/32 of it (its curve turns almost vertical at the freeze). Right: the cost in
loss per step. The evaluated model is the workers' mean; `STEPS` is a multiple of the
block size, so for BMUF it is the global model of the last BMUF step.

## The same code under MPI

Drop the `vmap` and replace the collective: each process is one worker.

```python
from shoal.comms import MPICollective

coll = MPICollective()  # a clone of MPI.COMM_WORLD
rank = coll.comm.Get_rank()
tx = optax.chain(gtc(0.1, collective=coll, capacity=0.08), optax.sgd(0.05, momentum=0.9))
params = jax.jit(lambda p: coll.broadcast(p, root=0))(params0)
state = tx.init(params)
step = jax.jit(one_step)  # one_step as in train_by_hand: no vmap
x, y = task.batch(t, coll.size)  # every worker's batch; this rank trains on row rank
params, state, loss, nbytes = step(params, state, x[rank], y[rank])
```

```sh
.venv/bin/mpiexec -n 8 .venv/bin/python my_script.py
```

The runner (`shoal-run experiments/configs/quickstart.py`) does all of this for every
algorithm in a config, on either backend; notebooks 02 and 05 use it through
`shoal.experiments.train.train`.
"""),
]

# ------------------------------------------------------------------ 02 two-tier BMUF_GTC

TWO_TIER = [
    md(r"""
# Two-tier BMUF_GTC: the group-size study

Ladkat et al. ("Two Tiered Distributed Training Algorithm for Acoustic Modeling") split
$N$ workers into $M = N/P$ groups of $P$:

* **lower tier, every step**: GTC inside each group (threshold $\tau$, residuals), so the
  $P$ members of a group keep one model;
* **upper tier, every $B$ steps**: BMUF across the $M$ groups,
  $\bar W = \frac1M\sum_m W_m$, $G = \bar W - W_g$, $\Delta \leftarrow \eta\Delta + \zeta G$,
  $W_g \leftarrow W_g + \Delta + \eta\Delta$, with $\eta = 1 - \zeta/M$ (eq. 5, $C = 1$).

$P = 1$ is plain BMUF; $P = N$ is GTC on everyone with a trivial BMUF step ($M = 1$,
$\eta = 0$). Per worker and step the bytes are $(P-1)\cdot 4(c+1)$ (GTC's all-gather of
$c$ words and a header among the group) plus, every $B$-th step, a ring all-reduce among
the $M$ groups, $2(M-1)/M\cdot 4n$. This notebook trains the acoustic-model stand-in
(`experiments/configs/acoustic.py`: an LSTM labelling frames of HMM sequences) for a few
group sizes at a fixed number of workers, through `shoal.experiments.train.train`.
"""),
    code("""
import dataclasses
import os

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from shoal.comms import AxisCollective, two_tier
from shoal.experiments.backends import SimBackend
from shoal.experiments.config import load_config
from shoal.experiments.configs.acoustic import entries
from shoal.experiments.configs.acoustic import get_config as acoustic_config
from shoal.experiments.tasks import make_task
from shoal.experiments.train import train

SMALL = os.environ.get("SHOAL_NOTEBOOK_SMALL") == "1"  # CI: fewer workers and steps
WORKERS = 8 if SMALL else 32
GROUP_SIZES = (1, 2, 4, 8) if SMALL else (1, 2, 4, 8, 16)
BASELINES = ("S-SGD", "BMUF") if SMALL else ("S-SGD", "GTC", "BMUF")
print(f"{WORKERS} workers, group sizes {GROUP_SIZES}")
"""),
    md(r"""
## The two tiers are two collectives

`two_tier(world, P)` returns `(intra, inter)`. In simulation they are two nested vmap
axes: `"member"` (inner, size $P$) and `"group"` (outer, size $M$); worker $w$ is member
$w \bmod P$ of group $\lfloor w/P \rfloor$. Under MPI they are `comm.Split`
sub-communicators. Here 8 workers in groups of 4 show whom each one meets: its group
(GTC), and the workers at the same position in the other groups (BMUF; every member
takes part, with identical data, so no leader has to broadcast).
"""),
    code("""
world = AxisCollective("workers", 8)
intra, inter = two_tier(world, 4)
print(intra, inter, sep="\\n")


def who(rank):  # one worker
    return intra.all_gather(rank), inter.all_gather(rank)


ranks = jnp.arange(8).reshape(2, 4)  # [group, member]
members, peers = jax.vmap(jax.vmap(who, axis_name="member"), axis_name="group")(ranks)
for w in range(8):
    g, m = divmod(w, 4)
    gtc_with, bmuf_with = members[g, m].tolist(), peers[g, m].tolist()
    print(f"worker {w}: group {g} member {m}; GTC with {gtc_with}, BMUF with {bmuf_with}")
"""),
    md(r"""
## The study

The acoustic config's settings (64 HMM states, 40-dim features, one LSTM layer of 64,
local SGD with momentum 0.9 reset after each BMUF step, GTC $\tau = 0.05$ with buffers of
2.5% of the parameters, block size 10). Learning rates follow its linear scaling rule:
0.02 per worker whose gradient an update averages ($\times N$ for S-SGD and GTC,
$\times P$ for BMUF_GTC, $\times 1$ for BMUF). The full run trains 2 epochs at 32
workers (320 steps). SMALL (CI) trains the quickstart's MLP on a Gaussian mixture for 60
steps at 8 workers instead: on a run that short, compiling the LSTM would dominate.
"""),
    code("""
if SMALL:
    cfg = load_config("quickstart")
    steps = 60
    baselines = {"S-SGD": "ssgd", "GTC": "gtc", "BMUF": "bmuf"}
    two_tier_entry = lambda p: f"bmuf_gtc[group_size={p}]"
else:
    cfg = acoustic_config()
    steps = 2 * cfg.train_size // (WORKERS * cfg.batch_size)  # 2 epochs
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
"""),
    md(r"""
Two checks: group size 1 is BMUF, bit for bit (a group of one has nothing to exchange);
and the bytes are exactly the formula above, plus the non-finite flag (one int32
all-reduced in the group, then across groups, every step: `shoal.optim.nonfinite`).
"""),
    code("""
bmuf_losses = [rec["loss"] for rec in runs["BMUF"].records]
assert bmuf_losses == [rec["loss"] for rec in runs[1].records]

capacity_words = max(1, round(cfg.gtc_capacity * n_params))


def predicted_bytes(p):
    m = WORKERS // p
    lower = (p - 1) * 4 * (capacity_words + 1)  # every step
    # and every step the non-finite flag (one int32), summed in the group, then across
    lower += 2 * (p - 1) * 4 // p + 2 * (m - 1) * 4 // m
    upper = 2 * (m - 1) * 4 * n_params // m  # every block_size-th step
    return steps * lower, steps // cfg.block_size * upper


for p in GROUP_SIZES:
    lower, upper = predicted_bytes(p)
    measured = round(runs[p].summary["mb_sent"] * 1e6)
    assert measured == lower + upper, (p, measured, lower + upper)
    print(
        f"P={p:>2}: GTC {lower / 1e6:6.2f} MB + BMUF {upper / 1e6:5.2f} MB = {measured / 1e6:.2f}"
    )
"""),
    code("""
P = np.array(GROUP_SIZES)
err = np.array([runs[p].summary["test_error"] for p in GROUP_SIZES])
fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(15, 4.2))
ax0.plot(range(len(P)), 100 * err, "o-", color="C3", label="BMUF_GTC")
for i, method in enumerate(BASELINES):
    e = 100 * runs[method].summary["test_error"]
    ax0.axhline(e, color=f"C{i}", ls="--", lw=1, label=f"{method} ({e:.1f}%)")
ax0.set(xlabel="group size P", ylabel="test error (%)")
ax0.set_xticks(range(len(P)), [f"{p}\\n(M={WORKERS // p})" for p in P])
ax0.legend(fontsize=8)
ax0.set_title(f"{WORKERS} workers, block size {cfg.block_size}", fontsize=10)

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
"""),
    md(r"""
**What to look at.** Left: test error (frame error in the full run) against the group
size, with the baselines as references (BMUF is the $P = 1$ point). Ladkat et al. report
that larger groups reduce the error of plain BMUF; the README's acoustic study (32
workers, block size 10) found that groups of 4 and 8 beat BMUF while groups of 2 did not.
Middle: the price. The GTC part grows with the $P - 1$ peers of a group, the BMUF part
shrinks with $M$. Right: error at the evaluation steps. The full tables over workers, block
sizes and group sizes come from `shoal-run experiments/configs/acoustic_study.py` (about 4
minutes).
"""),
]

# ------------------------------------------------------------------------ 03 1-bit LAMB

ONEBIT = [
    md(r"""
# 1-bit LAMB from the inside

`shoal.optim.onebit_lamb` (Li et al. 2021, Algorithm 1) runs in two stages on a step
counter $t = 1, 2, \dots$:

* **warm-up**, $t \le T_w$: LAMB on the all-reduced gradient $g$, per layer $l$:
  $m = \beta_1 m + (1-\beta_1) g$, $v = \beta_2 v + (1-\beta_2) g^2$,
  $c_l = \mathrm{clip}(\lVert p_l\rVert / \lVert u_l\rVert)$ with $u = m/(\sqrt v + \epsilon)$;
  the running average of $c_l$ is kept, and $v$ is frozen at $t = T_w$;
* **compression**, $t > T_w$: each worker adds its *local* gradient to the momentum,
  which crosses the wire as signs through an error-compensated 1-bit all-reduce; the
  update is $-\mathrm{lr}\cdot \bar c_l\, f_l\, u_l$, with the frozen $v$ and a factor
  $f_l$ from the fresh variance of the reconstructed gradients.

Everything is in the optax state (`OneBitLambState`), so we can step the transformation
by hand and read it: the stage, the bytes, the LAMB coefficients, the per-layer momentum
scales, the factors, and the error feedback.
"""),
    code("""
import os

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

from shoal.comms import (
    AxisCollective,
    compressed_allreduce,
    compressed_allreduce_bytes,
    compressed_allreduce_init,
)
from shoal.experiments.config import Config
from shoal.experiments.tasks import GaussianMixtureTask
from shoal.optim import onebit_lamb

SMALL = os.environ.get("SHOAL_NOTEBOOK_SMALL") == "1"  # CI: fewer workers and steps
N = 4 if SMALL else 8  # simulated workers
STEPS = 80 if SMALL else 300
FREEZE = round(0.15 * STEPS)  # T_w
B1 = 0.9  # onebit_lamb's default beta_1
coll = AxisCollective("workers", N)
per_worker = lambda a: jnp.broadcast_to(a, (N, *jnp.shape(a)))
print(f"{N} workers, {STEPS} steps, warm-up {FREEZE} steps")
"""),
    md(r"""
## The compressed all-reduce and its error feedback

`compressed_allreduce(x, worker_error, server_error, collective=...)`: each worker adds
its error to $x$, sends the signs of its chunks with one scale $s = \lVert v\rVert/\sqrt{n}$
(all-to-all), keeps what the signs missed as its new error; the worker that owns a chunk
averages it, adds its server error, compresses again and all-gathers. One call is a crude
estimate of the mean (two values per chunk), but nothing is lost: what a call misses is
fed into the next. Below, every worker sends the *same* vector on every call; the running
mean of the outputs converges to the exact mean, while a call without error feedback
(errors reset to zero) stays as wrong as the first.
"""),
    code("""
n, calls = 1024, 10 if SMALL else 100
xs = jax.random.normal(jax.random.key(0), (N, n)) * jnp.linspace(0.1, 2.0, n) + 0.2
exact = np.asarray(xs.mean(0))
worker_error, server_error = (per_worker(e) for e in compressed_allreduce_init(n, N))
reduce = jax.jit(
    jax.vmap(
        lambda x, we, se: compressed_allreduce(x, we, se, collective=coll), axis_name="workers"
    )
)
outs = []
for _ in range(calls):
    y, worker_error, server_error = reduce(xs, worker_error, server_error)
    outs.append(np.asarray(y[0]))  # the same on every worker
running = np.cumsum(outs, 0) / np.arange(1, calls + 1)[:, None]
rel = np.linalg.norm(running - exact, axis=1) / np.linalg.norm(exact)

sent = compressed_allreduce_bytes(n, N)[0]
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
"""),
    md(r"""
## Stepping 1-bit LAMB by hand

The MLP of notebook 01 on $N$ simulated workers. Besides the update, each step returns a
probe: the loss, the bytes, the per-layer coefficient average $\bar c_l$ (`coeff_avg`),
factor $f_l$ (`last_factor`) and momentum scale (`scale`), the norms of the error
buffers, and two vectors: what this worker fed into the compressed all-reduce (its scaled
local momentum) and what came out, with the exact mean of the inputs for comparison. A
second run with `freeze_step > STEPS` is uncompressed LAMB, the baseline.
"""),
    code("""
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
        fed = [
            (B1 * m + (1 - B1) * g) * k for m, g, k in zip(*map(leaves, (state.mu, grads, scales)))
        ]
        probe = {
            "loss": loss,
            "bytes": new.wire.step.sent,
            "coeff": jnp.stack(leaves(new.coeff_avg)),
            "factor": jnp.stack(leaves(new.last_factor)),
            "scale": jnp.stack(leaves(scales)),
            "worker_error": new.worker_error,
            "server_error": new.server_error,
            "out": flat(jax.tree.map(jnp.multiply, new.mu, scales)),
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
"""),
    md(r"""
## Warm-up vs compression, scaling factors over time

* **bytes per step** drop from a dense all-reduce to the compressed one after $T_w$;
* **$\bar c_l$** (`coeff_avg`): the running average of each layer's LAMB trust ratio
  during the warm-up, frozen afterwards; it sets each layer's step size in the
  compression stage, in place of the trust ratio the compressed momentum cannot give;
* **momentum scales** (`scale`): set once at the first compressed step from the warm-up
  momentum, $r_l = \lVert m_l\rVert/\sqrt{n_l}$, $\mathrm{scale}_l = \mathrm{mean}_k(r_k)/r_l$,
  so that one shared 1-bit scale per chunk does not drown the small layers;
* **factor $f_l$** (`last_factor`): $\max(\sqrt{v}/\sqrt{v_\text{fresh}})$ from the
  frozen and the fresh variance, clipped to [0.5, 4] and to $\pm 10\%$ of its previous
  value per step, so it can only drift.
"""),
    code("""
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
"""),
    md(r"""
## Error feedback in training

After the warm-up the momentum that comes out of the all-reduce is not the mean of what
went in. Summed over the compression steps, though, the two agree up to the errors still
held: $\sum_t (y_t - \bar x_t) = -(\frac1N \sum_i e_i + e_\text{server})$, so the gap stays
as small as the error buffers while both sums grow. Left: norms of the error buffers.
Middle: the running sums (the identity holds to float rounding). Right: one layer's
momentum at the last step, exact mean of the inputs against the 1-bit output, which takes
only a few values: one magnitude per server chunk, divided by the layer's scale.
"""),
    code("""
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
"""),
    md(r"""
**What to look at.** The bytes fall by about $32\times$ at the freeze (fp32 momentum to
signs, plus one scale per chunk), while the loss curve of 1-bit LAMB tracks LAMB's. The
coefficient averages stop moving at the freeze: from then on they are the layers' step
sizes. The factors start at 1 and move at most 10% per step within [0.5, 4]. The error
buffers jump from zero at the first compressed step and stay bounded, and the running sum
of the compressed momenta never drifts from the exact one by more than the errors held.
For a longer run on a transformer language model, `shoal-run
experiments/configs/onebit_lamb_lm.py` (README: 0.23% loss gap at 5.66x fewer bytes).
"""),
]

# ------------------------------------------------------------------------- 04 Herring BFB

HERRING = [
    md(r"""
# Herring's balanced fusion buffers on BERT-large

Thangakrishnan et al. ("Herring: Rethinking the Parameter Server at Scale for the Cloud",
SC 2020). A classic parameter server places each variable whole on one server (*atomic
placement*): the server that holds BERT-large's 60 MiB word embedding receives it from
every worker while a neighbour holding a bias receives almost nothing. Herring lays all
gradients back to back, in the order the backward pass produces them, into fixed-size
*balanced fusion buffers* (BFB), and cuts each buffer into one equal shard per server:
every server receives the same bytes, whatever the variables.

Everything here is computed from shapes: `jax.eval_shape` of a Flax BERT-large
(`shoal.experiments.bert`, fp16) and the gradients' production order found in the jaxpr
of its backward pass (`shoal.comms.gradient_order`). Nothing is allocated or trained,
except in the last section, a small `bfb_allreduce` on simulated workers.
"""),
    code("""
import math
import os

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch

from shoal.comms import AxisCollective, atomic_placement, plan_fusion, wire_bytes
from shoal.experiments import bert
from shoal.experiments.configs import herring_table3 as table3
from shoal.optim import bfb_allreduce

SMALL = os.environ.get("SHOAL_NOTEBOOK_SMALL") == "1"  # CI: fewer simulated workers
SERVERS = 8  # for the layout pictures
N = 4 if SMALL else 8  # simulated workers of the last section
MIB = 2**20
"""),
    code("""
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
"""),
    md(r"""
## Which variables land in which buffer

The paper's buffer is 86684 KB (the sum of its Table II). `plan_fusion` fills buffers in
production order; a variable may straddle two buffers; buffer $b$ is cut into `SERVERS`
equal shards (dashed lines) and shard $s$ of every buffer goes to server $s$. Below, one
row per buffer, each variable a coloured segment at its offset (layers labelled where a
buffer starts and ends). The embedding, produced last, fills most of the last two buffers,
spread over every server.
"""),
    code("""
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
"""),
    md(r"""
## Per-server load: atomic placement vs BFB

`atomic_placement` puts variable `order[k]` whole on server $k \bmod S$. Per iteration each
server receives its bytes from every worker (and sends as much back). With BFB every
server receives one shard of every buffer from every worker: the same for all. Below at 8
servers (stacked by kind), then at 64 servers with as many workers, the paper's scale.
"""),
    code("""
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
"""),
    md(r"""
## Herring's Table III

What the server holding the embedding gradient receives while a buffer containing it is
reduced, for 8 to 64 worker nodes with as many servers. Atomic: the whole embedding from
each of the $N$ workers, growing with $N$. BFB: a $1/N$ shard of one buffer from each of
the $N$ workers, one buffer whatever $N$.
"""),
    code("""
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
"""),
    md(r"""
## The same layout in a training step

`bfb_allreduce` uses that layout to reduce gradients: colocated (the $N$ workers serve
the shards themselves: all-to-all of each buffer's shards, a local sum, all-gather),
with dedicated server ranks under MPI (`ParameterServers`), or hierarchically. On $N$
simulated workers and a small model with 4 KiB buffers, the result is the mean gradient,
and the bytes are those of a ring all-reduce of the padded buffers.
"""),
    code("""
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
"""),
    md(r"""
**What to look at.** The layout picture: buffers hold whole layers in reverse order, and
the embedding is spread over every server's shard. The load plots: under atomic placement
a few servers (the embedding's, and those that get the big kernels, since 16 variables
per layer divide evenly into 8 or 64 servers) carry most of the traffic; with BFB every
server carries the same. The iteration waits for the busiest server. `shoal-run
experiments/configs/herring_table3.py` writes these tables and plots as files.
"""),
]

# -------------------------------------------------------------------------- 05 KungFu

KUNGFU = [
    md(r"""
# KungFu: flexible synchronisation and an adaptive policy

Brabete's KungFu (MEng thesis, 2019) offers strategies beyond S-SGD, all here as optax
transformations:

* **partial gradient exchange** (`partial_exchange`, "pgx"): the gradient leaves are
  packed into bins of at most a fraction $f$ of the gradient bytes; step $t$ averages
  bin $t \bmod P$ and keeps the rest local;
* **peer model averaging** (`peer_averaging`): each step worker $r$ averages its model
  with one peer's, $v_r \leftarrow (v_r + v_{\mathrm{src}(r)})/2 + u_r$, the peers a
  permutation (round robin or random derangements);
* **synchronous model averaging** (`sma`): $v_r \leftarrow (1-\alpha) v_r + \alpha\,
  \mathrm{mean}(v) + u_r$;
* the **adaptive** policy closes the loop: S-SGD that also estimates the gradient noise
  scale (McCandlish et al.), switching to partial exchange once the noise scale passes a
  threshold.
"""),
    code("""
import dataclasses
import os

import jax
import matplotlib.pyplot as plt
import numpy as np

from shoal.experiments.backends import SimBackend
from shoal.experiments.config import load_config
from shoal.experiments.policies import noise_scale_switch
from shoal.experiments.tasks import make_task
from shoal.experiments.train import train
from shoal.optim import peer_permutation, pgx_partition

SMALL = os.environ.get("SHOAL_NOTEBOOK_SMALL") == "1"  # CI: fewer workers and steps
WORKERS = 4 if SMALL else 8
STEPS = 60 if SMALL else 300
cfg = load_config("kungfu")  # a CNN on generated 16x16 glyph images
cfg = dataclasses.replace(
    cfg,
    workers=WORKERS,
    steps=STEPS,
    eval_every=STEPS // 6,
    policy_after=STEPS // 3,
    train_size=4096 if SMALL else cfg.train_size,
)
task = make_task(cfg)
params = task.init_params()
print(
    f"{WORKERS} workers, {STEPS} steps, {sum(p.size for p in jax.tree.leaves(params))} parameters"
)
"""),
    md(r"""
## PGX bins

`pgx_partition(params, f)` shows the bins `partial_exchange(f, ...)` will use: first-fit
decreasing by bytes, capacity $\lfloor f B\rfloor$. The CNN's hidden layer is stored as
16 column blocks so that no leaf exceeds 10% of the gradient (a bin must hold the largest
leaf). One bar per bin, stacked by leaf; the dashed line is the capacity.
"""),
    code("""
flat = jax.tree_util.tree_flatten_with_path(params)[0]
size = {jax.tree_util.keystr(p): x.size * x.dtype.itemsize for p, x in flat}
total = sum(size.values())


def color(path):
    return "C1" if "Conv" in path else "C0" if "BlockDense" in path else "C2"


fractions = (1.0, 0.3, 0.1)
fig, axes = plt.subplots(1, 3, figsize=(15, 3.6), gridspec_kw={"width_ratios": [1, 2, 4]})
for ax, f in zip(axes, fractions):
    bins = pgx_partition(params, f)
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
"""),
    md(r"""
## Peer permutations

`peer_permutation(strategy, N, step)[r]` is the worker that worker $r$ sends its model to
at `step` (the same table `peer_averaging` uses, on every worker, with no negotiation).
Round robin cycles through the $N - 1$ shifts; random draws a derangement (no worker
sends to itself) from a seeded pool. Rows: steps; columns: workers; numbers: the peer.
"""),
    code("""
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
"""),
    md(r"""
## A short comparison run, and where the policy switched

All algorithms train the same CNN from the same start on the same batches with the same
local SGD (`shoal.experiments.train.train`). S-SGD runs as `ssgd_noise`, which also logs
the noise scale $B_\text{simple} = \mathrm{tr}(\Sigma)/|G|^2$ (one scalar more on the
wire). The adaptive run asks its policy every `policy_every` steps from `policy_after` on
whether the median noise scale of the last steps passed the threshold; the step where it
switched is logged in the records (`"policy"`). The full config's threshold (150) comes
from an S-SGD run of it; the SMALL run is too short for that, so there we take the median
estimate after `policy_after` of the S-SGD run. Until it switches, the adaptive run is
that S-SGD run, bit for bit.
"""),
    code("""
backend = SimBackend(WORKERS)
runs = {"ssgd_noise": train(cfg, task, backend, "ssgd_noise", progress=False)}
if SMALL:
    late = [r["noise_scale"] for r in runs["ssgd_noise"].records[cfg.policy_after :]]
    cfg = dataclasses.replace(cfg, noise_threshold=float(np.median(late)))
# When would the policy switch, judged on the S-SGD records?
asks = range(cfg.policy_every, STEPS, cfg.policy_every)
records = runs["ssgd_noise"].records
predicted = next(
    (s for s in asks if s >= cfg.policy_after and noise_scale_switch(records[:s], cfg)), None
)
print(f"noise threshold {cfg.noise_threshold:.0f}; switch predicted at step {predicted}")

algorithms = ["pgx[pgx_fraction=0.3]", "peer[peer_strategy=round_robin]", "adaptive"]
if not SMALL:
    algorithms = [
        "pgx[pgx_fraction=0.3]",
        "pgx[pgx_fraction=0.1]",
        "peer[peer_strategy=round_robin]",
        "peer[peer_strategy=random]",
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
"""),
    code("""
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
ax.axhline(cfg.noise_threshold, color="k", ls=":", lw=1, label="threshold")
ax.axvspan(0, cfg.policy_after, color="gray", alpha=0.15, label="policy not asked")
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
for entry in ("ssgd_noise", "adaptive", "pgx[pgx_fraction=0.3]"):
    ax.plot(steps, [x["bytes_sent"] / 1e3 for x in runs[entry].records], lw=1, label=entry)
ax.set(xlabel="step", ylabel="kB sent per worker", title="bytes per step")
ax.legend(fontsize=7)
for ax in axes.flat:
    ax.grid(alpha=0.3)
plt.tight_layout()
plt.show()
"""),
    md(r"""
**What to look at.** Accuracy against bytes: peer averaging sends one model per step to
one peer (a ppermute, no all-reduce) and stays close to S-SGD; partial exchange trades
accuracy for bytes steeply on a short run; the adaptive run sits between S-SGD and its
partial fraction. The noise-scale panel shows the estimate the policy reads, the
threshold, and the step where it switched (bytes per step drop there, bottom right; the
estimate stops, since partial exchange does not compute it). The full comparison (ten
algorithms, staleness, README table) is `shoal-run experiments/configs/kungfu.py`.
"""),
]


# --------------------------------------------------------------------------- 06 cost model

COSTMODEL = [
    md(r"""
# The cost model: projected step time versus cluster size

`shoal.comms.costmodel` times collectives with the alpha-beta(-gamma) model: a message of
`n` bytes costs `alpha + n beta` (latency, inverse bandwidth), reducing it `n gamma`. A
ring all-reduce over `p` workers costs `2 (p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma`.
`record_events` replays a transformation's steps for any number of workers with a
recording stand-in collective and returns each step's collectives (kind, group, bytes),
counting only the `lax.cond` / `lax.switch` branches taken; `step_comm_time` times them on
a `Cluster` preset. Here: every quickstart algorithm, 8 to 512 workers, on 8 x V100 nodes
with 25 Gbps between nodes, for the quickstart MLP and for a model of BERT-large's size.
"""),
    code("""
import os

import jax
import matplotlib.pyplot as plt
import numpy as np

from shoal.comms import Cluster, record_events, step_comm_time
from shoal.experiments import algorithms
from shoal.experiments.config import load_config
from shoal.experiments.tasks import make_task

SMALL = os.environ.get("SHOAL_NOTEBOOK_SMALL") == "1"  # CI: fewer sizes and steps
PRESET = "v100-nvlink-25gbps"
SIZES = [8, 64] if SMALL else [8, 16, 32, 64, 128, 256, 512]
STEPS = 20 if SMALL else 100
cfg = load_config(os.path.join(os.path.dirname(algorithms.__file__), "configs", "quickstart.py"))
cfg = cfg.__class__(**{**cfg.__dict__, "steps": STEPS})
task = make_task(cfg)
params = task.init_params()
NAMES = [a for a in cfg.algorithms]
"""),
    md(r"""
## Per-step communication of each algorithm

For a given worker count, rebuild each algorithm for that many workers, replay `STEPS`
steps, and average the projected communication time per step. Two-tier algorithms get
their `(intra, inter)` split (groups of `group_size` consecutive workers).
"""),
    code("""
from shoal.comms import Event


def events_of(name, workers):
    big = cfg.__class__(**{**cfg.__dict__, "workers": workers})
    group = algorithms.group_size(name, big)
    ctx = algorithms.BuildContext(task=task)
    steps = record_events(
        lambda c: algorithms.build(name, big, c, ctx),
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
"""),
    md(r"""
The quickstart model is 27 KB: every message is tiny and the latency terms dominate. A
ring all-reduce pays `2 (p-1)` hops whatever the payload, so S-SGD, 1-bit LAMB, BFB and
PGX cost about the same and grow linearly with `p`; what helps is talking less often
(BMUF: once per block) or to fewer peers (peer averaging: one message per step), and
keeping the frequent exchange inside a node (BMUF_GTC).

## A model of BERT-large's size

Every algorithm here moves bytes in proportion to the model (GTC's and PGX's capacities
are fractions of it), so scaling each recorded event's bytes by 340M / 6922 gives the same
steps for a 340M-parameter float32 model without allocating it (all but the 4-byte
non-finite flag, which does not grow with the model). Bandwidth now dominates,
and the bytes each algorithm saves show up as time.
"""),
    code("""
scale = 340e6 / sum(np.size(x) for x in jax.tree.leaves(params))
big = {n: [comm_ms(*recorded[n, w], w, scale) for w in SIZES] for n in NAMES}
plot_ms(big, "the same, 340M parameters")
"""),
    md(r"""
At this scale on 25 Gbps links an S-SGD all-reduce takes about a second per step; 1-bit
LAMB's compressed stage, GTC's sparse exchange and BMUF's block steps cut it by the
factors their bytes suggest. The model ignores overlap of communication with the backward
pass and network contention: read it as a ranking and an order of magnitude, validated
against two papers' measurements in `experiments/configs/costmodel_validation.py`.
"""),
]


NOTEBOOKS = {
    "01_tour.ipynb": TOUR,
    "02_two_tier_bmuf_gtc.ipynb": TWO_TIER,
    "03_onebit_lamb.ipynb": ONEBIT,
    "04_herring_bfb.ipynb": HERRING,
    "05_kungfu.ipynb": KUNGFU,
    "06_cost_model.ipynb": COSTMODEL,
}


def notebook(name: str, cells: list[nbformat.NotebookNode]) -> nbformat.NotebookNode:
    stem = name.split(".")[0]
    for i, cell in enumerate(cells):
        cell.id = f"{stem}-{i:02d}"  # stable ids: a rebuild changes nothing
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata = {"kernelspec": KERNELSPEC, "language_info": {"name": "python"}}
    nbformat.validate(nb)
    return nb


def main() -> None:
    for name, cells in NOTEBOOKS.items():
        nbformat.write(notebook(name, cells), HERE / name)
        print(f"wrote {HERE / name}")


if __name__ == "__main__":
    main()
